"""The machine the engine runs on: who it is, and where choices measured on it are kept.

Costs measured on the running machine are kept per user, as autotuners keep theirs: the auto
tree's cost profiles (tree_policy) and prompt lookup's costs (lookup_policy). Keeping them
makes a later process decide exactly as the first did, so a seeded run reproduces on the same
machine with the same settings. (The matmul kernel is no longer chosen per machine: every CPU
bf16/fp32 linear runs one kernel with one summation order, models/linear.py.)

- ``cache_dir(kind)``: $RHEO_CACHE_DIR/kind, else $XDG_CACHE_HOME/rheo-engine/kind
  (~/.cache/...); ``RHEO_CACHE_DIR=off`` keeps everything in the process only.
- ``machine_id()``: CPU model, the vector extensions that change which code runs (AVX2,
  AVX-512, AVX-512-BF16, AMX), the torch version and the compiled kernels' build.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import hashlib
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cache_dir(kind: str) -> Path | None:
    """The folder of kept ``kind`` choices ("profiles", "lookup-costs"), or None when off."""
    root = os.environ.get("RHEO_CACHE_DIR")
    if root == "off":
        return None
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rheo-engine")
    return Path(root) / kind


@functools.lru_cache(maxsize=1)
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; (platform's name, no flags) elsewhere. The
    platform's name only where /proc/cpuinfo has none: on Linux platform.processor() runs
    `uname -p` in a subprocess (2 ms from a small process, a fork of the whole engine's)."""
    model, flags = None, frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = frozenset(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def isa_line() -> str:
    """e.g. "AMD EPYC [avx2 avx512f avx512_bf16]": what to print beside every CPU figure."""
    model, flags = cpu_model_and_flags()
    return f"{model} [{' '.join(f for f in ISA_FLAGS if f in flags)}]"


def machine_id() -> str:
    return f"{isa_line()} torch {torch.__version__} kernels {kernels_build()}"


@functools.lru_cache(maxsize=1)
def kernels_build() -> str:
    """The compiled kernels' build (their file's size and time): costs kept for one build are
    not another's (a kernel change moved the default pair's plain step by 1.3x, within the
    auto tree's check of a kept profile, so the old profile would have been kept)."""
    spec = importlib.util.find_spec("rheo_engine._C")
    if spec is None or not spec.origin:
        return "none"
    try:
        st = os.stat(spec.origin)
    except OSError:
        return "none"
    return f"{st.st_size}-{st.st_mtime_ns}"


def kept_file(kind: str, key: str) -> Path | None:
    """Where the choice of ``kind`` for ``key`` on this machine is kept (None: off)."""
    root = cache_dir(kind)
    if root is None:
        return None
    return root / (hashlib.sha256(f"{key}\n{machine_id()}".encode()).hexdigest()[:20] + ".json")


def read_kept(path: Path | None) -> Any:
    """The JSON kept at ``path``, or None when absent or unreadable (it is measured again)."""
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_kept(path: Path | None, value: Any) -> None:
    """Write ``value`` as JSON atomically; a cache that cannot be written is skipped."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


# --- the CPU thread default ------------------------------------------------------------------

# Measured 2026-12-01 on this project's 2-core machine while a training job kept one core busy
# (the case to handle: a shared machine), bf16 Llamas with random weights, 1 vs 2 threads, the
# median of interleaved runs. One decode token: 7.2 vs 45 ms at 7.8M parameters, 19 vs 323 ms at
# 27M, 37 vs 229 ms at 84M, 87 vs 1068 ms at 192M, 361 vs 1328 ms at 755M; the quick start
# (`--prompt "def quicksort(xs):" --max-new-tokens 64 --temperature 0`, default pair, 6.9M)
# ran at 14.0-22.2 tokens/s with --threads 1 and 2.8-4.2 with --threads 2. A small model is
# bound by per-operator overhead, and OpenMP threads spin when their core is shared, so one
# thread won at every size measured. Above 1B parameters (not measured here) a matmul's work
# dwarfs that overhead and free cores pay, so the default there is torch's.
ONE_THREAD_BELOW_PARAMS = 10**9


def default_threads(n_params: int) -> int:
    """Torch CPU threads for a target of ``n_params`` weights when none are asked for."""
    return 1 if n_params < ONE_THREAD_BELOW_PARAMS else torch.get_num_threads()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim), after a load: reading
    a GGUF file builds ~70 MB of small parser objects (gguf.GGUFReader's fields: one array per
    vocabulary string) that are freed once the weights are out, but that glibc keeps mapped, so
    the process would stay that much larger for its whole life. False where there is no glibc
    (musl, macOS): nothing to do there. A call costs ~0.1 ms once the C library is found."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def freeze_heap() -> None:
    """Collect, then move every object alive to the garbage collector's permanent generation
    (gc.freeze), once a long-lived process (the OpenAI server) has loaded its engine. A full
    collection traverses every tracked object, and after a load there are ~170k (the imports,
    the tokenizer's and the engine's Python side): on the default pair one took 68-77 ms (Zen 4,
    quiet; one came in 48 requests of 128 tokens), a stall in some request's stream. Frozen
    objects are not traversed again; what they own is still freed by reference counting as ever
    (only a cycle among them would stay). Not done by ``Engine.from_pretrained`` nor the CLIs,
    which run in-process in tests and applications whose heaps are theirs: an application that
    serves for long may call it after its own load."""
    gc.collect()
    gc.freeze()


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (found once: ctypes.util.find_library takes ~2 ms)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
