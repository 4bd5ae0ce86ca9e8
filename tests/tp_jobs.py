"""Rank 0 of a tensor-parallel engine running a list of jobs, for tests/test_tensor_parallel.py.

    python tests/tp_jobs.py JOBS.json OUT.json

JOBS.json: {"tensor_parallel": N, "target": DIR, "draft": DIR, "tp_check": bool, "jobs": [...]};
the engine is fp32, with tp_check every step's tokens are compared across ranks (a
disagreement fails the job). Each job's result goes to OUT.json in order:
- {"kind": "generate", "prompt": ids, "max_new_tokens": n, "options": {...}, "profile": PATH?}
  -> {"token_ids", "accept_lengths", "trees"}; with "profile" the auto tree runs on that
  profile (measured at TP = 1; its key is renamed for this engine, which is the point: the same
  costs, so the same trees).
- {"kind": "scheduler", "prompts": [ids...], "max_new_tokens": n, "options": {...}} -> the
  token ids of each, all four admitted before the first step (the ranks' lock held while they
  are submitted), as decoder.run admits a list of prompts.
- {"kind": "first_two", "prompt": ids, "runs": R, "options": {...}} -> R seeded runs' first
  two tokens (EOS standing for a stop) and first accept lengths.
- {"kind": "host_reads", "prompt": ids, "max_new_tokens": n, "options": {...}} -> rank 0's host
  reads and uploads per decode step (bench/common.py's OpCounter, as tests/test_host_reads.py
  counts them on one device); ranks > 0 run the same step function.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

import rheo_engine.runtime.decoder as decoder_module
from rheo_engine import Engine
from rheo_engine.runtime.scheduler import Scheduler
from rheo_engine.runtime.tree_policy import CostProfile


def generate(engine: Engine, job: dict) -> dict:
    options = dict(job["options"])
    if job.get("profile"):
        profile = CostProfile.load(job["profile"])
        # The key names where it was measured (TP = 1); this engine's key says tensor parallel.
        profile.key = profile.key + f", tensor parallel {engine.tensor_parallel}"
        options["cost_profile"] = profile
    gen = engine.generate(job["prompt"], job["max_new_tokens"], **options)
    return {"token_ids": gen.token_ids, "accept_lengths": gen.accept_lengths,
            "trees": gen.trees.histogram()}  # fmt: skip


def scheduler(engine: Engine, job: dict) -> dict:
    with Scheduler(engine, max_batch=len(job["prompts"])) as s:
        with engine.tp.lock:  # the worker waits here: all are queued before it admits one
            handles = [s.submit(p, job["max_new_tokens"], **job["options"])
                       for p in job["prompts"]]  # fmt: skip
        results = [h.result() for h in handles]
        sizes = dict(s.batch_sizes)
    return {"token_ids": [r.token_ids for r in results], "batch_sizes": sizes}


def first_two(engine: Engine, job: dict) -> dict:
    (eos,) = engine.tokenizer.eos_ids
    pairs, accepts = [], []
    for seed in range(job["runs"]):
        gen = engine.generate(job["prompt"], job["max_new_tokens"], seed=seed, **job["options"])
        got = gen.token_ids[:2]
        pairs.append(got + [eos] * (2 - len(got)))
        accepts.append(gen.accept_lengths[0])
    return {"pairs": pairs, "first_accepts": accepts}


def host_reads(engine: Engine, job: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from common import OpCounter

    counter, marks = OpCounter(), []
    real_step = decoder_module.speculative_step

    def marked_step(*args, **kwargs):
        marks.append((counter.host_reads, counter.uploads))
        return real_step(*args, **kwargs)

    decoder_module.speculative_step = marked_step
    try:
        request = engine.request(job["prompt"], job["max_new_tokens"], **job["options"])
        with torch.no_grad(), counter:
            for _ in request:
                pass
        marks.append((counter.host_reads, counter.uploads))
    finally:
        decoder_module.speculative_step = real_step
    steps = list(zip(marks, marks[1:], strict=False))
    return {"reads": [b[0] - a[0] for a, b in steps], "uploads": [b[1] - a[1] for a, b in steps]}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    engine = Engine.from_pretrained(
        spec["target"], spec["draft"], dtype=torch.float32,
        tensor_parallel=spec["tensor_parallel"], tp_check=spec["tp_check"],
    )  # fmt: skip
    kinds = {"generate": generate, "scheduler": scheduler, "first_two": first_two,
             "host_reads": host_reads}  # fmt: skip
    out = [kinds[job["kind"]](engine, job) for job in spec["jobs"]]
    stats = dataclasses.asdict(engine.tp.stats)
    with open(sys.argv[2], "w") as f:
        json.dump({"results": out, "stats": stats}, f)


if __name__ == "__main__":
    main()
