"""Head data for a chat target: its own replies to chat prompts, as token ids (issue 26).

    python -m rheo_engine.train.smollm2_data --out weights/smollm2/data --shards 64

Shard i answers ``prompts_per_shard`` prompts of rheo_engine.train.chat_prompts (seed
``seed * 1_000_003 + i // 2``: shards 2k and 2k+1 share their prompts) at T = 0 for even i and
T = 1 for odd i, so every prompt is answered at both. Round 0 answers each prompt's first user
turn; round 1 answers the follow-up of a multi-turn prompt (after the target's own first reply)
and the request a self-instruct prompt made the target write. Every reply is a sequence:
``prompt ids`` (the chat template applied) then the reply's ids and the EOS that ended it.

Generation runs on the engine's batch decoder (Engine.decoder: admit / step, refilling a slot
as soon as its sequence ends), method ``ar`` (no head: the data must not depend on the head it
trains). This module is a client of the engine, the way a user is; the trainer itself
(head_loop) never imports the runtime.

Each shard is ``shard_NNNNN.npz``: ``tokens`` uint16 (all sequences concatenated; the
vocabulary has 49152 ids) and ``index`` int32 [n, 5] = (offset, prompt_len, length, category,
round), written via a temporary file and renamed, then recorded in ``manifest.json``. A rerun
skips the shards that exist, so a killed run resumes where it stopped. Features are not stored:
a trainer recomputes them with one prefill per sequence, far cheaper than generating.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rheo_engine.train.chat_prompts import CATEGORIES, ChatPrompt, clean_request, sample_prompts

MANIFEST = "manifest.json"
FORMAT = "rheo-head-data-v1: tokens uint16, index int32 [n, 5] (offset, prompt_len, length, category, round)"  # noqa: E501


def shard_path(out: Path, i: int) -> Path:
    return out / f"shard_{i:05d}.npz"


def shard_seed(seed: int, i: int) -> int:
    return seed * 1_000_003 + i // 2


def shard_temperature(i: int) -> float:
    return 0.0 if i % 2 == 0 else 1.0


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


class Progress:
    """A log line at most every ``every_s`` seconds: positions so far and positions/s."""

    def __init__(self, every_s: float = 60.0, total0: int = 0) -> None:
        self.t0 = self.last = time.perf_counter()
        self.every_s, self.positions, self.total0 = every_s, 0, total0

    def add(self, n: int, what: str, force: bool = False) -> None:
        self.positions += n
        now = time.perf_counter()
        if force or now - self.last >= self.every_s:
            self.last = now
            rate = self.positions / max(now - self.t0, 1e-9)
            print(f"[{time.strftime('%H:%M:%S')}] {what}: {self.positions} positions this run "
                  f"({self.total0 + self.positions} in all), {rate:.1f} positions/s",
                  flush=True)  # fmt: skip


def decode_all(engine, jobs: list[tuple[list[int], int, object]], temperature: float,
               max_new_tokens: int, batch: int, max_len: int, progress: Progress, what: str,
               on_reply) -> None:  # fmt: skip
    """Decode every job (prompt ids, seed, tag) ``batch`` at a time on one BatchDecoder, method
    ar, refilling a slot as soon as its sequence ends. ``on_reply(tag, prompt, reply)`` gets each
    reply (token ids, ending with the EOS that stopped it, none when cut at max_new_tokens) and
    returns more jobs to queue (a follow-up turn), so no slot idles between rounds."""
    from rheo_engine.runtime.engine import engine_threads

    eos = engine.eos_ids
    waiting = list(jobs)
    replies: dict[int, tuple[list[int], list[int], object]] = {}
    decoder = engine.decoder(max_batch=batch, max_len=max_len)
    try:
        with engine_threads(engine.threads):
            while waiting or decoder.running:
                while waiting and not decoder.full:
                    ids, seed, tag = waiting.pop(0)
                    request = engine.request(
                        ids, max_new_tokens, method="ar", temperature=temperature, top_p=1.0,
                        top_k=0, min_p=0.0, repetition_penalty=1.0, seed=seed,
                    )  # fmt: skip
                    replies[id(request)] = (ids, [], tag)
                    decoder.admit(request)
                for seq, kept, stop in decoder.step():
                    ids, reply, tag = replies[id(seq.request)]
                    reply.extend(kept)
                    n = len(kept)
                    if stop == "eos":
                        reply.append(eos[0])  # the head learns where a reply ends
                        n += 1
                    progress.add(n, what)
                    if stop is not None:
                        del replies[id(seq.request)]
                        waiting.extend(on_reply(tag, ids, reply))
    finally:
        decoder.close()


def make_shard(engine, i: int, seed: int, n_prompts: int, max_new_tokens: int, batch: int,
               max_len: int, progress: Progress) -> dict:  # fmt: skip
    """Generate shard i (module docstring) and return its arrays and statistics."""
    tok = engine.tokenizer
    T = shard_temperature(i)
    base = shard_seed(seed, i)
    prompts = sample_prompts(base, n_prompts)
    room = max_len - max_new_tokens
    seqs: list[tuple[int, list[int], list[int], int, int]] = []  # (k, prompt, reply, cat, round)

    def on_reply(tag: tuple[int, int, list[dict]], ids: list[int], reply: list[int]) -> list:
        k, rnd, messages = tag
        p = prompts[k]
        seqs.append((k, ids, reply, CATEGORIES.index(p.category), rnd))
        if rnd == 1:
            return []
        text = tok.decode([t for t in reply if t not in engine.eos_ids])
        if p.self_instruct:
            request = clean_request(text)
            if request is None:
                return []
            follow = [{"role": "user", "content": request}]
        elif len(p.turns) > 1:
            follow = messages + [{"role": "assistant", "content": text},
                                 {"role": "user", "content": p.turns[1]}]  # fmt: skip
        else:
            return []
        ids1 = tok.encode_chat(follow)
        return [(ids1, (base * 4096 + k) * 2 + 1, (k, 1, follow))] if len(ids1) <= room else []

    jobs = []
    for k, p in enumerate(prompts):
        messages = [{"role": "user", "content": p.turns[0]}]
        ids = tok.encode_chat(messages)
        if len(ids) <= room:
            jobs.append((ids, (base * 4096 + k) * 2, (k, 0, messages)))
    decode_all(engine, jobs, T, max_new_tokens, batch, max_len, progress,
               f"shard {i} T={T:g}", on_reply)  # fmt: skip
    seqs.sort(key=lambda s: (s[4], s[0]))  # round 0 then 1, by prompt: the same on every run
    tokens, index, offset = [], [], 0
    for _, ids, reply, c, rnd in seqs:
        if not reply:
            continue
        tokens.extend(ids + reply)
        index.append((offset, len(ids), len(ids) + len(reply), c, rnd))
        offset += len(ids) + len(reply)
    positions = sum(r[2] - r[1] for r in index)
    return {
        "tokens": np.asarray(tokens, dtype=np.uint16), "index": np.asarray(index, dtype=np.int32),
        "stats": {"temperature": T, "prompt_seed": base, "prompts": len(prompts),
                  "sequences": len(index), "positions": positions, "tokens": len(tokens),
                  "cut_at_max_new_tokens": sum(1 for s in seqs if len(s[2]) >= max_new_tokens)},
    }  # fmt: skip


def read_manifest(out: Path) -> dict:
    f = out / MANIFEST
    return json.loads(f.read_text()) if f.is_file() else {"format": FORMAT, "shards": {}}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def load_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint16 [total], index int32 [n, 5]) of one shard."""
    with np.load(path) as z:
        return z["tokens"], z["index"]


def run(out: Path, shards: int, seed: int, prompts_per_shard: int, max_new_tokens: int,
        batch: int, max_len: int, dtype: str, threads: int, first: int = 0,
        pair: str = "smollm2", quantized: bool = False) -> dict:  # fmt: skip
    from rheo_engine.runtime.engine import Engine

    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    todo = [i for i in range(first, first + shards) if not shard_path(out, i).is_file()]
    done0 = sum(s["positions"] for s in manifest["shards"].values())
    print(f"{len(todo)} of {shards} shards to make in {out} ({done0} positions already)",
          flush=True)  # fmt: skip
    if not todo:
        return manifest
    # Shards 0-25 were made by the file dequantized to `dtype`; ``quantized`` runs its Q4_1
    # matrices as stored, as the engine serves them (97.9% top-1 agreement with dequantized,
    # ~1.3x the positions/s at batch 64 here). Each shard records which ("weights").
    engine = Engine.from_pretrained(pair=pair, dtype=getattr(torch, dtype), threads=threads,
                                    quantized=quantized)  # fmt: skip
    weights = engine.target.weight_formats  # e.g. "kept quantized: Q4_1 x210, ..."
    settings = {"seed": seed, "prompts_per_shard": prompts_per_shard,
                "max_new_tokens": max_new_tokens, "max_len": max_len}  # fmt: skip
    if manifest.get("settings", settings) != settings:
        raise ValueError(
            f"{out} was made with {manifest['settings']}, not {settings}; pass the same "
            "settings to resume, or another --out"
        )
    manifest["settings"] = settings
    manifest["target"] = {"pair": pair, "source": Path(engine.source).name,
                          "eos_ids": list(engine.eos_ids)}  # fmt: skip
    progress = Progress(total0=done0)
    for i in todo:
        t0 = time.perf_counter()
        shard = make_shard(engine, i, seed, prompts_per_shard, max_new_tokens, batch, max_len,
                           progress)  # fmt: skip
        path = shard_path(out, i)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
        np.savez_compressed(tmp, tokens=shard["tokens"], index=shard["index"])
        tmp.replace(path)
        seconds = time.perf_counter() - t0
        stats = {**shard["stats"], "seconds": round(seconds, 1),
                 "positions_per_s": round(shard["stats"]["positions"] / seconds, 1),
                 "dtype": dtype, "weights": weights, "threads": threads, "batch": batch,
                 "cpu": cpu_name(),
                 "torch": torch.__version__, "python": sys.version.split()[0]}  # fmt: skip
        manifest = read_manifest(out) | {"settings": settings, "target": manifest["target"]}
        manifest["shards"][f"{i:05d}"] = stats
        write_json(out / MANIFEST, manifest)
        total = sum(s["positions"] for s in manifest["shards"].values())
        print(f"[{time.strftime('%H:%M:%S')}] wrote {path.name}: {stats['sequences']} sequences, "
              f"{stats['positions']} positions in {seconds:.0f} s "
              f"({stats['positions_per_s']} positions/s); {total} positions in {out}",
              flush=True)  # fmt: skip
    return manifest


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rheo_engine.train.smollm2_data",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("weights/smollm2/data"))
    p.add_argument("--shards", type=int, default=64, help="shards to make (existing skipped)")
    p.add_argument("--first", type=int, default=0, help="index of the first shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-shard", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--max-len", type=int, default=1024, help="KV rows per sequence")
    p.add_argument("--batch", type=int, default=64, help="sequences decoded at once")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--quantized", action="store_true",
                   help="run the GGUF's Q4_1 matrices as stored (as the engine serves them) "
                        "instead of dequantized to --dtype; faster")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.shards < 1 or a.prompts_per_shard < 1 or a.max_new_tokens >= a.max_len:
        raise SystemExit(
            "need --shards >= 1, --prompts-per-shard >= 1 and --max-new-tokens < --max-len"
        )
    run(a.out, a.shards, a.seed, a.prompts_per_shard, a.max_new_tokens, a.batch, a.max_len,
        a.dtype, a.threads, a.first, quantized=a.quantized)  # fmt: skip


if __name__ == "__main__":
    main()
