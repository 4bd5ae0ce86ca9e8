"""What a decode step costs, per method and with / without the static buffers (runtime/graphs.py):
ms a step, tokens a step, the operators a step launches, its host reads, the GPU's busy share.

    python bench/step_profile.py                                   # default pair, CPU
    python bench/step_profile.py --pair widened --device cuda --dtype bfloat16 --graphs 0 1
    python bench/step_profile.py --methods ar rheo --tree auto --temperature 1

Per prompt, every (method, graphs) configuration runs back to back in a rotating order; ms a
step is the median over prompts of wall time / steps, and each configuration's speed is the
median of its paired tokens/s ratios against ``ar`` with graphs off (the same prompt, the same
pass). Then one more run per configuration is counted:
- on CUDA under torch.profiler: kernel launches a step (cudaLaunchKernel, cuLaunchKernel(Ex),
  cudaLaunchKernelExC; a graph replay is one launch, cudaGraphLaunch), device-to-host copies a
  step (the host reads), and the GPU's busy share (the device time of its kernels and copies
  over the wall time);
- on the CPU, what a GPU would launch: the aten operators a step dispatches (a recorder below
  the autograd and composite layers, so a composite counts as the kernels it becomes) plus the
  engine's own kernels (rheo_engine.spec.kernels calls into _C), with a captured forward
  counted as one launch; host reads are the values a step reads back (item / tolist / numpy /
  a scalar conversion). The CPU has no busy share ("-").
And on either device the Python calls a step (sys.setprofile's events; on the CPU with the
layers in their one C++ call, as it runs them): the host's work, beside the operators.
Counts are over a whole request (its prefill too) divided by its steps.
Prints the conditions line and a markdown table (BENCHMARKS.md keeps them with the command).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import conditions, conditions_line, markdown_table
from inputs import (
    ArgumentParser,
    add_model_args,
    add_tree_args,
    at_least,
    check_output,
    checking,
    cli,
    load_pair,
    tree_options,
)
from torch.utils._python_dispatch import TorchDispatchMode

from rheo_engine.runtime import graphs
from rheo_engine.spec import kernels

PROMPTS = [
    "def fibonacci(n):",
    "class LinkedList:\n    def __init__(self):",
    "import json\n\ndef load_config(path):",
    "def is_prime(n: int) -> bool:",
    "for line in open('data.txt'):",
    "def merge_sort(xs):\n    if len(xs) <= 1:",
]
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaGraphLaunch")  # fmt: skip
HOST_READ_OPS = {torch.ops.aten._local_scalar_dense}
# Operators that launch no kernel on a GPU (besides views, which alias their input).
NO_LAUNCH = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
             torch.ops.aten.detach, torch.ops.aten.lift_fresh}  # fmt: skip


class _Ops(TorchDispatchMode):
    """Counts the aten operators dispatched (what a GPU would launch as kernels) and host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READ_OPS:
            self.reads += 1
        elif not (func.is_view or func.overloadpacket in NO_LAUNCH):
            self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cpu_counter():
    """(_Ops, counts) while the engine runs: aten operators, the engine's kernels (each a launch
    on CUDA), a replayed bucket counted once, and the host reads of tolist / numpy."""
    counts = {"kernels": 0, "reads": 0, "captured": 0}
    saved_kernels = {
        n: fn for n in dir(kernels) if not n.startswith("_")
        and inspect.isfunction(fn := getattr(kernels, n)) and fn.__module__ == kernels.__name__
    }  # fmt: skip
    saved_tensor = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy", "item")}
    buckets = (graphs._Bucket, graphs._DraftBucket, graphs._CommitBucket)  # each a graph on CUDA
    saved_runs = {cls: cls.run for cls in buckets}
    depth = {"in": 0}

    def wrap(fn):
        def call(*args, **kwargs):  # one launch however many wrappers it calls itself
            if depth["in"] == 0:
                counts["kernels"] += 1
            depth["in"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth["in"] -= 1

        return call

    def read(fn):
        def call(*args, **kwargs):
            if depth["in"] == 0:
                counts["reads"] += 1
            return fn(*args, **kwargs)

        return call

    mode = _Ops()

    def run_once(saved_run):
        def run(self):
            # A captured bucket (the target's forward, the draft loop) replays as one launch:
            # count it once, not the operators inside.
            counts["captured"] += 1
            before = mode.ops
            depth["in"] += 1
            try:
                saved_run(self)
            finally:
                depth["in"] -= 1
                mode.ops = before

        return run

    for n, fn in saved_kernels.items():
        setattr(kernels, n, wrap(fn))
    for n, fn in saved_tensor.items():
        setattr(torch.Tensor, n, read(fn))
    for cls, saved_run in saved_runs.items():
        cls.run = run_once(saved_run)
    try:
        with mode:
            yield mode, counts
    finally:
        for n, fn in saved_kernels.items():
            setattr(kernels, n, fn)
        for n, fn in saved_tensor.items():
            setattr(torch.Tensor, n, fn)
        for cls, saved_run in saved_runs.items():
            cls.run = saved_run


def generate(engine, prompt, cfg, args):
    os.environ["RHEO_GRAPHS"] = "1" if cfg["graphs"] else "0"
    return engine.generate(prompt, args.max_new_tokens, method=cfg["method"],
                           temperature=args.temperature, seed=1, ignore_eos=True,
                           **(cfg["tree"] if cfg["method"] != "ar" else {}))  # fmt: skip


def count_cuda(engine, prompt, cfg, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    generate(engine, prompt, cfg, args)  # captures happen here, not in the counted run
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        gen = generate(engine, prompt, cfg, args)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    launches = reads = 0
    busy_us = 0.0
    for e in prof.events():
        if e.name in LAUNCHES:
            launches += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            busy_us += e.time_range.elapsed_us()  # one stream: its kernels do not overlap
            reads += "DtoH" in e.name  # "Memcpy DtoH (Device -> Pageable)"
    steps = max(1, gen.steps)
    return {"launches": launches / steps, "reads": reads / steps,
            "busy": busy_us * 1e-6 / wall}  # fmt: skip


def python_calls(engine, prompt, cfg, args) -> float:
    """Python calls a step (sys.setprofile's call and c_call events: functions of Python and of
    C called from it), the layers in one C++ call where the CPU runs them so: the host's work
    of a step, which on a small model is a large share of it (a plain step of the default pair
    is ~300 calls)."""
    from rheo_engine.models.llama import LlamaModel

    calls = [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    saved, LlamaModel.one_call = LlamaModel.one_call, True
    try:
        generate(engine, prompt, cfg, args)
        sys.setprofile(count)
        try:
            gen = generate(engine, prompt, cfg, args)
        finally:
            sys.setprofile(None)
    finally:
        LlamaModel.one_call = saved
    return calls[0] / max(1, gen.steps)


def count_cpu(engine, prompt, cfg, args) -> dict:
    generate(engine, prompt, cfg, args)  # the auto tree's measurement happens here
    with cpu_counter() as (mode, counts):
        gen = generate(engine, prompt, cfg, args)
    steps = max(1, gen.steps)
    launches = mode.ops + counts["kernels"] + counts["captured"]
    return {"launches": launches / steps, "reads": (mode.reads + counts["reads"]) / steps,
            "busy": None}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="bench/step_profile.py", description=__doc__)
    add_model_args(p)
    add_tree_args(p, tree="fixed")
    p.add_argument("--methods", nargs="+", default=["ar", "rheo"])
    p.add_argument("--graphs", nargs="+", type=int, choices=(0, 1), default=[0, 1],
                   help="without (0) and with (1) the static buffers (captured on CUDA)")
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.0)
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--prompts", type=at_least(1), default=len(PROMPTS),
                   help=f"how many of the {len(PROMPTS)} Python prompts")
    p.add_argument("--md", help="write the conditions line and the table here too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # What a GPU would launch: on the CPU one sequence's layers run in one C++ call
    # (LlamaModel._one_call), which a GPU does not have; count the layers' operators instead.
    from rheo_engine.models.llama import LlamaModel

    LlamaModel.one_call = False
    with checking():
        check_output(args.md, "--md")
        target, draft, engine = load_pair(args)
        tree = tree_options(args)
        for m in args.methods:
            engine.request([1], 1, method=m, temperature=args.temperature,
                           **(tree if m != "ar" else {}))  # fmt: skip
    configs = [{"method": m, "graphs": g, "tree": tree} for m in args.methods for g in args.graphs]
    cond = conditions("step_profile", args.device, target=target, draft=draft,
                      dtype=args.dtype or "config", T=args.temperature,
                      max_new_tokens=args.max_new_tokens, prompts=args.prompts, **tree)  # fmt: skip
    print(conditions_line(cond), flush=True)
    prompts = PROMPTS[: args.prompts]
    base = {"method": "ar", "graphs": 0, "tree": tree}
    ms = {i: [] for i in range(len(configs))}
    taus = {i: [] for i in range(len(configs))}
    ratio = {i: [] for i in range(len(configs))}
    for i in range(len(configs)):  # warm up: first-use costs (captures, the auto tree's timers)
        generate(engine, prompts[0], configs[i], args)
    for p, prompt in enumerate(prompts):
        order = list(range(len(configs)))
        order = order[p % len(order):] + order[: p % len(order)]
        speed = {}
        for i in order:
            gen = generate(engine, prompt, configs[i], args)
            ms[i].append(gen.wall_s * 1e3 / max(1, gen.steps))
            taus[i].append(len(gen.token_ids) / max(1, gen.steps))
            speed[i] = len(gen.token_ids) / gen.wall_s
        b = generate(engine, prompt, base, args) if base not in configs else None
        b_speed = speed[configs.index(base)] if b is None else len(b.token_ids) / b.wall_s
        for i in speed:
            ratio[i].append(speed[i] / b_speed)
    count = count_cuda if args.device.startswith("cuda") else count_cpu
    rows, out = [], []
    for i, cfg in enumerate(configs):
        c = count(engine, prompts[0], cfg, args)
        c["python_calls"] = python_calls(engine, prompts[0], cfg, args)
        med_ms, tau = statistics.median(ms[i]), statistics.median(taus[i])
        busy = "-" if c["busy"] is None else f"{100 * c['busy']:.0f}%"
        rows.append([cfg["method"], "on" if cfg["graphs"] else "off", f"{med_ms:.2f}",
                     f"{tau:.2f}", f"{c['launches']:.0f}", f"{c['reads']:.1f}",
                     f"{c['python_calls']:.0f}", busy,
                     f"{statistics.median(ratio[i]):.2f}x"])  # fmt: skip
        out.append({**{k: v for k, v in cfg.items() if k != "tree"}, "ms_per_step": med_ms,
                    "tokens_per_step": tau, **c, "vs_ar": statistics.median(ratio[i])})  # fmt: skip
    what = "kernel launches" if args.device.startswith("cuda") else "operators (a GPU's launches)"
    md = markdown_table(["method", "static buffers", "ms / step", "tokens / step",
                         f"{what} / step", "host reads / step", "Python calls / step", "GPU busy",
                         "speed vs ar (off)"], rows)  # fmt: skip
    print(md, end="")
    if args.md:
        Path(args.md).write_text(f"{conditions_line(cond)}\n\n{md}")
    os.environ.pop("RHEO_GRAPHS", None)
    return {"conditions": cond, "rows": out}


if __name__ == "__main__":
    cli(main, sys.argv[1:], freeze=True)  # a script: the load's objects out of every collection
