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


def generate_replies(engine, prompts: list[list[int]], seeds: list[int], temperature: float,
                     max_new_tokens: int, batch: int, max_len: int,
                     progress: Progress, what: str) -> list[list[int]]:  # fmt: skip
    """The target's reply to each prompt (token ids), ending with the EOS id that stopped it
    (none when cut at max_new_tokens), decoded ``batch`` at a time on one BatchDecoder."""
    from rheo_engine.runtime.engine import engine_threads

    eos = engine.eos_ids
    requests = [
        engine.request(p, max_new_tokens, method="ar", temperature=temperature, top_p=1.0,
                       top_k=0, min_p=0.0, repetition_penalty=1.0, seed=s)
        for p, s in zip(prompts, seeds, strict=True)
    ]  # fmt: skip
    replies: list[list[int]] = [[] for _ in requests]
    slot_of = {id(r): k for k, r in enumerate(requests)}
    decoder = engine.decoder(max_batch=min(batch, len(requests)), max_len=max_len)
    try:
        with engine_threads(engine.threads):
            waiting = list(requests)
            while waiting or decoder.running:
                while waiting and not decoder.full:
                    decoder.admit(waiting.pop(0))
                for seq, kept, stop in decoder.step():
                    k = slot_of[id(seq.request)]
                    replies[k].extend(kept)
                    n = len(kept)
                    if stop == "eos":
                        replies[k].append(eos[0])  # the head learns where a reply ends
                        n += 1
                    progress.add(n, what)
    finally:
        decoder.close()
    return replies


def make_shard(engine, i: int, seed: int, n_prompts: int, max_new_tokens: int, batch: int,
               max_len: int, progress: Progress) -> dict:  # fmt: skip
    """Generate shard i (module docstring) and return its arrays and statistics."""
    tok = engine.tokenizer
    T = shard_temperature(i)
    prompts = sample_prompts(shard_seed(seed, i), n_prompts)
    room = max_len - max_new_tokens
    seqs: list[tuple[list[int], list[int], int, int]] = []  # (prompt, reply, category, round)
    # Round 0: every prompt's first turn.
    chats: list[tuple[ChatPrompt, list[dict]]] = []
    for p in prompts:
        messages = [{"role": "user", "content": p.turns[0]}]
        if len(tok.encode_chat(messages)) <= room:
            chats.append((p, messages))
    ids0 = [tok.encode_chat(m) for _, m in chats]
    seeds0 = [(shard_seed(seed, i) * 4096 + k) * 2 for k in range(len(ids0))]
    what = f"shard {i} T={T:g}"
    replies0 = generate_replies(engine, ids0, seeds0, T, max_new_tokens, batch, max_len, progress,
                                what + " round 0")  # fmt: skip
    follow: list[tuple[int, list[dict]]] = []  # (category, messages) of round 1
    for (p, messages), ids, reply in zip(chats, ids0, replies0, strict=True):
        seqs.append((ids, reply, CATEGORIES.index(p.category), 0))
        text = tok.decode([t for t in reply if t not in engine.eos_ids])
        if p.self_instruct:
            request = clean_request(text)
            if request is not None:
                follow.append((CATEGORIES.index(p.category), [{"role": "user", "content": request}]))
        elif len(p.turns) > 1:
            follow.append((CATEGORIES.index(p.category), messages + [
                {"role": "assistant", "content": text}, {"role": "user", "content": p.turns[1]}]))
    # Round 1: follow-ups and self-instructed requests.
    follow = [(c, m) for c, m in follow if len(tok.encode_chat(m)) <= room]
    ids1 = [tok.encode_chat(m) for _, m in follow]
    seeds1 = [(shard_seed(seed, i) * 4096 + k) * 2 + 1 for k in range(len(ids1))]
    if ids1:
        replies1 = generate_replies(engine, ids1, seeds1, T, max_new_tokens, batch, max_len,
                                    progress, what + " round 1")  # fmt: skip
        for (c, _), ids, reply in zip(follow, ids1, replies1, strict=True):
            seqs.append((ids, reply, c, 1))
    tokens, index, offset = [], [], 0
    for ids, reply, c, rnd in seqs:
        if not reply:
            continue
        tokens.extend(ids + reply)
        index.append((offset, len(ids), len(ids) + len(reply), c, rnd))
        offset += len(ids) + len(reply)
    positions = sum(r[2] - r[1] for r in index)
    return {
        "tokens": np.asarray(tokens, dtype=np.uint16), "index": np.asarray(index, dtype=np.int32),
        "stats": {"temperature": T, "prompt_seed": shard_seed(seed, i), "prompts": len(prompts),
                  "sequences": len(index), "positions": positions, "tokens": len(tokens),
                  "cut_at_max_new_tokens": sum(1 for _, r, _, _ in seqs
                                               if len(r) >= max_new_tokens)},
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
        pair: str = "smollm2") -> dict:  # fmt: skip
    from rheo_engine.runtime.engine import Engine

    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    todo = [i for i in range(first, first + shards) if not shard_path(out, i).is_file()]
    done0 = sum(s["positions"] for s in manifest["shards"].values())
    print(f"{len(todo)} of {shards} shards to make in {out} ({done0} positions already)",
          flush=True)  # fmt: skip
    if not todo:
        return manifest
    engine = Engine.from_pretrained(pair=pair, dtype=getattr(torch, dtype), threads=threads)
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
                 "dtype": dtype, "threads": threads, "batch": batch, "cpu": cpu_name(),
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.shards < 1 or a.prompts_per_shard < 1 or a.max_new_tokens >= a.max_len:
        raise SystemExit("need --shards >= 1, --prompts-per-shard >= 1, --max-new-tokens < --max-len")
    run(a.out, a.shards, a.seed, a.prompts_per_shard, a.max_new_tokens, a.batch, a.max_len,
        a.dtype, a.threads, a.first)  # fmt: skip


if __name__ == "__main__":
    main()
