"""Tensor parallelism's processes: start the ranks, load each rank's part, and let ranks > 0
follow rank 0.

``start`` is what ``Engine.from_pretrained(tensor_parallel=N)`` (and so the CLI's and the
server's ``--tensor-parallel N``) runs:

* Under ``torchrun`` (RANK and WORLD_SIZE set) the ranks are torchrun's processes, joined by
  its rendezvous (``env://``, several machines with ``--nnodes``); WORLD_SIZE must be N.
* Otherwise the calling process becomes rank 0 and starts ranks 1..N-1 itself, each a fresh
  ``python -m rheo_engine.runtime.tp`` (so a script needs no ``if __name__ == "__main__"``
  guard and a REPL works, unlike multiprocessing's spawn, which re-imports the caller's main
  module), joined with ``init_process_group`` over a free local TCP port.

Every rank loads its part of the target (models.llama.rank_parts) and the whole EAGLE-3 head,
then the ranks tell each other whether they loaded (one line of error each) before anything
runs. Rank 0 returns the Engine: its API, CLI or server run there. Ranks > 0 run ``follow``: a
loop over rank 0's control messages (parallel.TPGroup.send), replaying each decoder call on
their own decoders, until rank 0 says exit; under torchrun they then leave the process
(``SystemExit(0)``), so code after ``from_pretrained`` runs on rank 0 only.

Failure: a spawned rank that dies (killed, crashed) is seen by rank 0's watcher within
WATCH_S, which prints one line, ends the other ranks and exits rank 0 (status 1): a rank
waiting in a collective for a dead peer would otherwise wait for ever. Spawned ranks ignore
Ctrl-C (rank 0 gets it, and ends them) and end when rank 0's process is gone. Under torchrun,
torchrun's agent does both.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rheo_engine.config import ModelConfig
from rheo_engine.io.gguf import gguf_config, is_gguf
from rheo_engine.parallel import TPGroup
from rheo_engine.runtime.decoder import BatchDecoder
from rheo_engine.runtime.request import Request

__all__ = ["check_shardable", "check_size", "follow", "shutdown", "start"]

WATCH_S = 0.2  # how often rank 0 checks that its spawned ranks live
# Collectives wait this long for a peer (a follower waits for the next request between them:
# an idle server). A dead peer is caught by the watcher, or by gloo's closed connection.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=30)


def check_size(tensor_parallel: object) -> int:
    """``tensor_parallel`` if it is an int >= 1, else a one-line ValueError."""
    if (
        isinstance(tensor_parallel, bool)
        or not isinstance(tensor_parallel, int)
        or (tensor_parallel < 1)
    ):
        raise ValueError(f"tensor_parallel={tensor_parallel!r} must be an int >= 1 (1: one device)")
    return tensor_parallel


def read_config(target: str | Path) -> ModelConfig:
    """The target's config (config.json, or a GGUF file's metadata): no weight is read."""
    if is_gguf(target):
        return ModelConfig.from_dict(gguf_config(target), str(target))
    return ModelConfig.from_hf_dir(target)


def check_shardable(cfg: ModelConfig, tensor_parallel: int, device: torch.device) -> None:
    """One ValueError line for a target that cannot be split ``tensor_parallel`` ways, or a
    machine without the devices, before any weight is read."""
    n = tensor_parallel
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % n:
            fits = [k for k in range(1, min(value, 8) + 1) if not _splits(cfg, k)]
            raise ValueError(
                f"tensor_parallel={n}: the target's {name}={value} is not divisible by {n} (each "
                f"rank holds 1/{n} of the heads, KV heads and MLP); use tensor_parallel in "
                f"{fits}"
            )
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if have < n:
            raise ValueError(
                f"tensor_parallel={n} needs {n} CUDA devices (one per rank) but this machine has "
                f"{have}; use tensor_parallel <= {have}, or device='cpu'"
            )


def _splits(cfg: ModelConfig, n: int) -> list[str]:
    return [name for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
            if getattr(cfg, name) % n]  # fmt: skip


def _torchrun() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun (or another env:// launcher) started us."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))  # fmt: skip


def launched_rank() -> int:
    """This process's rank when torchrun started it, else 0 (the process that starts the rest)."""
    launched = _torchrun()
    return 0 if launched is None else launched[0]


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(load, load_args: tuple, tensor_parallel: int, target: str | Path,
          device: torch.device, threads: int | None, check: bool = False):  # fmt: skip
    """Rank 0's Engine of a ``tensor_parallel``-way group (see the module docstring).
    ``load(group, device, threads, *load_args)`` builds one rank's Engine: a module-level
    function (the spawned ranks import it)."""
    n = check_size(tensor_parallel)
    check_shardable(read_config(target), n, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    launched = _torchrun()
    if launched is not None:
        return _start_launched(*launched, n, backend, device, threads, check, load, load_args)
    return _start_spawning(n, backend, device, threads, check, load, load_args)


def _start_launched(rank: int, world: int, local: int, n: int, backend: str,
                    device: torch.device, threads, check: bool, load,
                    load_args: tuple):  # fmt: skip
    """torchrun's ranks: rank 0 returns its Engine, the others follow it and leave."""
    if world != n:
        raise ValueError(
            f"tensor_parallel={n} but torchrun started WORLD_SIZE={world} processes; run "
            f"torchrun --nproc-per-node {n} (times --nnodes), or pass --tensor-parallel {world}"
        )
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    try:
        engine = _join(rank, n, _rank_device(device, local), threads, check, load, load_args)
    except _LoadFailed as e:
        if rank == 0:
            raise ValueError(str(e)) from None
        raise SystemExit(1) from None
    if rank != 0:
        follow(engine, engine.tp)
        dist.destroy_process_group()
        raise SystemExit(0)
    atexit.register(shutdown, engine.tp)
    return engine


def _start_spawning(n: int, backend: str, device: torch.device, threads, check: bool, load,
                    load_args: tuple):  # fmt: skip
    """This process is rank 0 and starts ranks 1..n-1 (fresh interpreters) itself."""
    if dist.is_initialized():
        raise ValueError(
            "torch.distributed is already initialized in this process (one tensor-parallel "
            "engine per process); start the ranks with torchrun, or use one engine"
        )
    init = f"tcp://127.0.0.1:{_free_port()}"
    errors = Path(tempfile.mkdtemp(prefix="rheo-tp-"))
    spec = {"n": n, "init": init, "backend": backend, "device": str(device), "threads": threads,
            "check": check, "load": f"{load.__module__}:{load.__qualname__}",
            "load_args": list(load_args)}  # fmt: skip
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "rheo_engine.runtime.tp", json.dumps({**spec, "rank": r}),
             str(errors / f"rank{r}.txt")],
            env=env, stdin=subprocess.DEVNULL,
        )
        for r in range(1, n)
    ]  # fmt: skip
    watcher = _Watcher(workers, errors)
    watcher.start()
    dist.init_process_group(backend, init_method=init, rank=0, world_size=n,
                            timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
    try:
        engine = _join(0, n, _rank_device(device, 0), threads, check, load, load_args)
    except BaseException as e:
        # A rank that died while loading (killed, out of memory) fails rank 0's collective:
        # said in one line, as a rank that reported its error.
        with watcher.lock:
            watcher.stopping = True
        dead = watcher.dead(wait_s=2.0) if isinstance(e, RuntimeError) else None
        for w in workers:
            _end(w)
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(e, _LoadFailed):
            raise ValueError(str(e)) from None
        if dead is not None:
            raise ValueError(f"{dead} while loading its part of the target") from None
        raise
    group = engine.tp
    group.workers, group.watcher = workers, watcher
    group.peer_lost = watcher.check_now
    atexit.register(shutdown, group)
    return engine


def _end(worker: subprocess.Popen, wait_s: float = 5.0) -> None:
    try:
        worker.wait(max(wait_s, 0.001))
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


class _LoadFailed(Exception):
    """A rank could not load its part (``rank``, its one-line ``text``)."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(text if rank == 0 else f"tensor-parallel rank {rank}: {text}")
        self.rank = rank


def _join(rank: int, n: int, device: torch.device, threads: int | None, check: bool, load,
          load_args: tuple):  # fmt: skip
    """Load this rank's Engine, then learn whether every rank did: _LoadFailed names the
    first rank that did not (with its error line) on every rank."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup(rank, n, device, check)
    engine, error = None, ""
    try:
        engine = load(group, device, threads, *load_args)
    except Exception as e:  # reported by rank 0, as one line
        said = str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
        error = " ".join(said.split()) or type(e).__name__
    failed = [(r, text) for r, text in enumerate(group.gather_text(error)) if text]
    if failed:
        dist.destroy_process_group()
        raise _LoadFailed(*failed[0])
    return engine


def _worker(spec: dict, error_file: str) -> None:
    """A spawned rank: join the group, load its part, follow rank 0 until it says exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    parent = os.getppid()

    def orphaned() -> None:  # rank 0's process is gone (killed): nobody to follow
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    rank, n = spec["rank"], spec["n"]
    module, name = spec["load"].split(":")
    load = getattr(importlib.import_module(module), name)
    try:
        dist.init_process_group(spec["backend"], init_method=spec["init"], rank=rank,
                                world_size=n, timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
        device = _rank_device(torch.device(spec["device"]), rank)
        engine = _join(rank, n, device, spec["threads"], spec["check"], load,
                       tuple(spec["load_args"]))  # fmt: skip
        follow(engine, engine.tp)
        dist.destroy_process_group()
    except _LoadFailed:  # rank 0 reports it
        raise SystemExit(0) from None
    except BaseException as e:
        Path(error_file).write_text(f"{type(e).__name__}: {e}".splitlines()[0][:500])
        raise SystemExit(1) from None


class _Watcher(threading.Thread):
    """Rank 0's watch over its spawned ranks: one that dies ends them all, with one line."""

    def __init__(self, workers, errors) -> None:
        super().__init__(name="rheo-tp-watcher", daemon=True)
        self.workers, self.errors, self.stopping = workers, errors, False
        self.lock = threading.Lock()  # one report, from this thread or rank 0's main thread

    def run(self) -> None:
        while not self.stopping:
            self._report(self.dead())
            time.sleep(WATCH_S)

    def dead(self, wait_s: float = 0.0) -> str | None:
        """'tensor-parallel rank R (pid P) stopped (why)' for a rank that left with a failure
        (waiting up to ``wait_s`` for one), else None. A rank leaves with status 0 only when
        told to, or when rank 0 reports its failed load."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, w in enumerate(self.workers, start=1):
                code = w.poll()
                if code not in (None, 0):
                    how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                    said = self.errors / f"rank{r}.txt"
                    why = said.read_text() if said.is_file() else how
                    return f"tensor-parallel rank {r} (pid {w.pid}) stopped ({why})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def check_now(self) -> None:
        """A collective failed on rank 0: if a rank died, say so and end (gloo notices a dead
        peer before the next poll would)."""
        self._report(self.dead(wait_s=2.0))

    def _report(self, line: str | None) -> None:
        if line is None:
            return
        with self.lock:
            if self.stopping:
                return
            sys.stderr.write(f"rheo-engine: {line}; ending all ranks\n")
            sys.stderr.flush()
            for other in self.workers:
                if other.poll() is None:
                    other.kill()
            os._exit(1)


def shutdown(group: TPGroup, workers=None, watcher=None) -> None:
    """Rank 0 leaving: tell the other ranks to exit (when no call is half done; else they are
    ended), then wait for them briefly."""
    workers = getattr(group, "workers", []) if workers is None else workers
    watcher = getattr(group, "watcher", None) if watcher is None else watcher
    if watcher is not None:
        with watcher.lock:
            watcher.stopping = True
    if not dist.is_initialized():
        return
    if not group.broken and group.in_flight == 0 and group.lock.acquire(timeout=1.0):
        try:
            group.send({"op": "exit"})
        except Exception:  # a peer already gone: nothing to tell
            pass
        finally:
            group.lock.release()
    for w in workers:
        _end(w, 5.0 if not group.broken else 0.0)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def follow(engine, group: TPGroup) -> None:
    """Ranks > 0: replay rank 0's decoder calls on this rank's decoders until it says exit."""
    decoders: dict[int, BatchDecoder] = {}
    context = engine.context()

    def make_request(prompt_ids: list[int], options: dict) -> Request:
        return Request(context, prompt_ids, **options)

    while True:
        message = group.recv()
        op = message["op"]
        if op == "exit":
            return
        if op == "open":
            head = engine.head if message["head"] else None
            decoders[message["d"]] = BatchDecoder(
                engine.target, head, message["max_batch"], message["max_len"], {}, group
            )
        elif op == "close":
            decoders.pop(message["d"], None)
        else:
            decoders[message["d"]].follow(message, make_request)


# A rank that start() spawned: python -m rheo_engine.runtime.tp SPEC ERROR_FILE
if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), sys.argv[2])
