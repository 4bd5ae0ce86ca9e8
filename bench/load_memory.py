"""What loading a pair costs in memory: the process's resident set before and after
``Engine.from_pretrained``, after a short generation, and at its peak, against the weights'
size on disk.

    python bench/load_memory.py --pair smollm2          # the Q4_1 GGUF + its head
    python bench/load_memory.py --pair default --tokens 16

The load runs in a fresh process (a child of this one) so that nothing loaded earlier is
counted: it imports the engine and runs one small matmul (torch's own first-use pages), reads
/proc/self/status (VmRSS, RssAnon, RssFile), loads the pair, reads it again, generates
``--tokens`` tokens (T = 0, default options: the KV rows and buffers a first answer touches) and
reads it once more; the peak while loading is VmHWM after the load, the peak is getrusage's
ru_maxrss (the load and the first answer). "Growth" is after - before; the ratios
divide it by the target's bytes on disk (its GGUF file, or its directory's safetensors) and by
those plus the head's. Linux only (/proc). Prints the conditions line and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import conditions, conditions_line, markdown_table
from inputs import ArgumentParser, BadInput, add_model_args, at_least, checking, cli, resolve_pair

CHILD = r"""
import json, resource, sys, torch
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[name] = int(line.split()[1]) / 1024
    return out
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
from rheo_engine import Engine
torch.ones(8, 8) @ torch.ones(8, 8)
before = status()
engine = Engine.from_pretrained(args["target"], args["draft"], device=args["device"])
loaded = status()
engine.generate("Write one sentence about the sea.", args["tokens"], temperature=0)
generated = status()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"before": before, "loaded": loaded, "generated": generated, "peak": peak}))
"""


def file_bytes(path: Path | None) -> int:
    """The weights' bytes: a file, or a directory's safetensors."""
    if path is None:
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="bench/load_memory.py", description=__doc__)
    add_model_args(p, default_pair="smollm2")
    p.add_argument("--tokens", type=at_least(1), default=8, help="tokens generated after loading")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not Path("/proc/self/status").is_file():
        raise BadInput("this bench reads /proc/self/status: run it on Linux")
    with checking():
        target, draft = resolve_pair(args.pair, args.target, args.draft)
    job = {"target": str(target), "draft": None if draft is None else str(draft),
           "device": args.device, "threads": args.threads, "tokens": args.tokens}  # fmt: skip
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], capture_output=True,
                         text=True)  # fmt: skip
    if run.returncode != 0:
        raise BadInput(f"the loading process failed: {run.stderr.strip().splitlines()[-1:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    target_bytes = file_bytes(Path(target))
    files = target_bytes + file_bytes(None if draft is None else Path(draft))
    cond = conditions("load_memory", args.device, target=target, draft=draft,
                      tokens=args.tokens, file_mb=round(files / 2**20, 1))  # fmt: skip
    print(conditions_line(cond))
    before = got["before"]
    rows = []
    after = f"after {args.tokens} tokens"
    for label, when in (("loaded", got["loaded"]), (after, got["generated"])):
        grown = {k: when[k] - before[k] for k in before if k != "VmHWM"}
        mb, anon, mapped = grown["VmRSS"], grown["RssAnon"], grown["RssFile"]
        ratios = [f"{mb * 2**20 / target_bytes:.2f}x", f"{mb * 2**20 / files:.2f}x"]
        rows.append([label, f"{mb:.0f}", f"{anon:.0f}", f"{mapped:.0f}", *ratios])
    mb = got["loaded"]["VmHWM"] - before["VmRSS"]
    rows.append(["peak while loading (VmHWM)", f"{mb:.0f}", "-", "-",
                 f"{mb * 2**20 / target_bytes:.2f}x", f"{mb * 2**20 / files:.2f}x"])  # fmt: skip
    mb = got["peak"] - before["VmRSS"]
    rows.append(["peak (ru_maxrss)", f"{mb:.0f}", "-", "-", f"{mb * 2**20 / target_bytes:.2f}x",
                 f"{mb * 2**20 / files:.2f}x"])  # fmt: skip
    table = markdown_table(["RSS growth", "MB", "anonymous MB", "file-backed MB",
                            "x the target's file(s)", "x target + head files"], rows)  # fmt: skip
    print(table)
    return {"conditions": cond, "status": got, "file_bytes": files}


if __name__ == "__main__":
    cli(main, sys.argv[1:])
