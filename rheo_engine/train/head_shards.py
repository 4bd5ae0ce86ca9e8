"""Train (or evaluate) an EAGLE-3 head on token-id shards of smollm2_data (issue 26).

    python -m rheo_engine.train.head_shards --data weights/smollm2/data --work W --features-only
    python -m rheo_engine.train.head_shards --data weights/smollm2/data --work W --max-steps 400
    python -m rheo_engine.train.head_shards --evaluate weights/smollm2/head

The shards hold token ids only; each shard's features, the target's final states and its
argmax are recomputed once by one prefill per sequence and kept in ``--work/features``
(rheo_engine.train.head_features: a window of ``CONTEXT`` prompt tokens then the reply, packed
without padding). head_loop's Trainer trains on batches of windows of similar length
(``--positions`` a batch): loss over the draft vocabulary, unrolled ``--unroll`` steps (7, as
EAGLE-3 drafts), weights step_decay ** s, the head's matmuls in bf16 where this CPU is faster.

Held out: shards 0 and 1 (the same prompts at T = 0 and T = 1); training uses shards 2.. .
The schedule is fixed by ``--max-steps`` (warm-up then a cosine to that step), so a run that
stops at --minutes continues the same schedule with --resume (a checkpoint every 2 minutes in
--work). Every minute a line gives the held-out top-1 per unroll step on the first
``--val-quick`` held-out windows; the end evaluates all of them and, with --out, exports.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from rheo_engine.io.gguf import is_gguf, read_gguf
from rheo_engine.io.weights import load_safetensors
from rheo_engine.models.llama import LlamaModel
from rheo_engine.train.checkpoint import Budget
from rheo_engine.train.head import export, head_config, parse_layers
from rheo_engine.train.head_config import HeadTrainConfig
from rheo_engine.train.head_data import HeadData, resolve_feature_layers
from rheo_engine.train.head_features import (CONTEXT, LengthBatches, Packed, cached_features,
                                             is_cached, load_packed_many, settings_of,
                                             shard_features, spill_folder)  # fmt: skip
from rheo_engine.train.head_loop import CHECKPOINT_SECONDS, Trainer, Window
from rheo_engine.train.smollm2_data import load_shard, shard_path

VAL_SHARDS = (0, 1)


def read_sequences(data: Path, shards: list[int]) -> list[tuple[np.ndarray, int]]:
    """(token ids, prompt_len) of every sequence of ``shards`` that exist, in order."""
    out = []
    for i in shards:
        path = shard_path(data, i)
        if not path.is_file():
            continue
        tokens, index = load_shard(path)
        for offset, prompt_len, length, _, _ in index:
            out.append((tokens[offset : offset + length].astype(np.int64), int(prompt_len)))
    return out


def available_shards(data: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in data.glob("shard_*.npz"))


def parse_shards(text: str) -> set[int]:
    """"2-24,30" -> {2, ..., 24, 30}."""
    ids: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            ids.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected shard ids like 2-24,30") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r}: names no shard; e.g. 2-24,30")
    return ids


def reply_counts(seqs: list[tuple[np.ndarray, int]], V: int) -> torch.Tensor:
    """[V] how often each target id occurs in the sequences' replies."""
    counts = np.zeros(V, dtype=np.int64)
    for ids, prompt_len in seqs:
        counts += np.bincount(ids[prompt_len:], minlength=V)
    return torch.from_numpy(counts)


def most_frequent(ids: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n of ``ids`` most frequent by ``counts`` (ties by lower id), ascending."""
    ids = ids.sort().values
    order = torch.sort(-counts[ids], stable=True).indices
    return ids[order[:n]].sort().values


def draft_vocabulary_of(seqs: list[tuple[np.ndarray, int]], V: int, Vd: int) -> torch.Tensor:
    """The Vd most frequent reply tokens (ties by lower id), ascending; all ids when Vd is 0/V."""
    if Vd in (0, V):
        return torch.arange(V)
    return most_frequent(torch.arange(V), reply_counts(seqs, V), Vd)


def narrowed(init: tuple, seqs: list[tuple[np.ndarray, int]], V: int, Vd: int) -> tuple:
    """A head read by read_head with its draft vocabulary cut to the Vd of its ids most frequent
    in the sequences' replies: those rows of its lm_head, the rest of it as it was. The same
    logits at the rows kept; a head's drafts cost its lm_head's rows (half a level's work at
    8,192 rows for SmolLM2's head), docs/training.md."""
    layers, used, weights = init
    if not 0 < Vd <= len(used):
        raise ValueError(f"--draft-vocab {Vd} with an --init-from head of {len(used)} draft "
                         f"tokens: a head's vocabulary can be narrowed, not widened; pass "
                         f"1..{len(used)} or drop --draft-vocab")  # fmt: skip
    kept = most_frequent(used, reply_counts(seqs, V), Vd)
    rows = torch.searchsorted(used, kept)  # used is ascending (read_head)
    return layers, kept, dict(weights, **{"lm_head.weight": weights["lm_head.weight"][rows]})


def load_target(path: Path, device: str, dtype: torch.dtype) -> LlamaModel:
    """The target in float (a GGUF file's quantized matrices dequantized to ``dtype``): the
    trainer takes gradients through nothing of it, but reads its embedding and lm_head rows."""
    if is_gguf(path):
        return LlamaModel.from_gguf(read_gguf(path, quantized=False), device=device, dtype=dtype,
                                    quantized=False)  # fmt: skip
    return LlamaModel.from_pretrained(path, device=device, dtype=dtype)


def check_device(name: str) -> str:
    """``--device`` as torch names it, or a one-line error naming the value and the fix."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name!r}: head training runs on cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise SystemExit(f"--device {name!r}: this torch sees {count} CUDA device(s) "
                             f"(torch {torch.__version__}); use --device cpu, or install a CUDA "
                             "torch")  # fmt: skip
    return str(device)


def quick_eval(trainer: Trainer, val: Packed, n: int | None, positions: int) -> dict:
    """Held-out loss and top-1 per unroll step on the first n windows (all with None), in runs
    of similar length."""
    trainer.model.eval()
    window = Window(trainer.cfg.unroll)
    k = len(val) if n is None else min(n, len(val))
    order = torch.sort(val.lengths[:k], stable=True).indices
    with torch.no_grad():
        i = 0
        while i < k:
            B = max(1, positions // int(val.lengths[order[min(k - 1, i + 1)]]))
            window.add(trainer.losses(val.batch(order[i : i + B], trainer.device))[1])
            i += B
    trainer.model.train()
    return window.summary()


def gemm_seconds(dtype: torch.dtype, rows: int = 1024, repeats: int = 3) -> float:
    """Fastest of ``repeats`` [rows, 576] x [576, 8192] products in ``dtype``."""
    a, b = torch.randn(rows, 576).to(dtype), torch.randn(8192, 576).to(dtype)
    torch.nn.functional.linear(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def pick_autocast(choice: str, device: str = "cpu") -> torch.dtype | None:
    """bf16 autocast where this CPU runs bf16 GEMMs >= 1.3x faster than fp32 (AVX-512-BF16,
    AMX), else fp32; always on a GPU (its bf16 tensor cores); ``choice`` bfloat16 / off forces
    one."""
    if choice != "auto":
        return torch.bfloat16 if choice == "bfloat16" else None
    if device != "cpu":
        return torch.bfloat16
    f32, b16 = gemm_seconds(torch.float32), gemm_seconds(torch.bfloat16)
    print(f"GEMM [1024x576]x[576x8192]: fp32 {f32 * 1e3:.1f} ms, bf16 {b16 * 1e3:.1f} ms -> "
          f"{'bf16 autocast' if f32 >= 1.3 * b16 else 'fp32'}", flush=True)  # fmt: skip
    return torch.bfloat16 if f32 >= 1.3 * b16 else None


def fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def features_of(a: argparse.Namespace, target: LlamaModel, layers: tuple[int, ...],
                dtype: torch.dtype) -> tuple[Packed, Packed | None, list[int]]:  # fmt: skip
    """(held-out windows, training windows or None with --no-train shards, training shards):
    every shard's features read from --work/features or computed once and kept there."""
    cache = None if a.work is None else a.work / "features"
    settings = settings_of(Path(a.target), layers, dtype)
    held_out = read_sequences(a.data, list(VAL_SHARDS))
    val_seqs = held_out[:: max(1, len(held_out) // a.val_sequences)][: a.val_sequences]
    if not val_seqs:
        raise FileNotFoundError(f"no held-out shards {VAL_SHARDS} in {a.data}; make them first")
    val, _ = cached_features(cache, f"val{len(val_seqs)}",
                             lambda: shard_features(target, val_seqs, layers, dtype),
                             settings)  # fmt: skip
    train_ids = [i for i in available_shards(a.data) if i not in VAL_SHARDS]
    if a.evaluate is not None:
        return val, None, train_ids
    if a.shards is not None:
        missing = sorted(set(a.shards) - set(train_ids))
        if missing:
            raise FileNotFoundError(f"--shards: no training shard {missing} in {a.data} (held-out "
                                    f"{list(VAL_SHARDS)} never train); pick from {train_ids}")
        train_ids = [i for i in train_ids if i in a.shards]
    if not train_ids:
        raise FileNotFoundError(f"no training shards (2..) in {a.data}")
    parts = []
    for i in train_ids:
        name = shard_path(a.data, i).stem
        if cache is not None and is_cached(cache / f"{name}.safetensors", settings):
            continue  # read below, into the tensors of all shards
        seqs = read_sequences(a.data, [i])
        got = cached_features(cache, name,
                              lambda seqs=seqs: shard_features(target, seqs, layers, dtype),
                              settings)[0]  # fmt: skip
        if cache is None:
            parts.append(got)
    if cache is None:
        return val, Packed.cat(parts), train_ids
    paths = [cache / f"{shard_path(a.data, i).stem}.safetensors" for i in train_ids]
    spill = spill_folder(paths, cache)  # more than half the free memory: in file mappings
    if spill is not None:
        print(f"features of {len(paths)} shards held in file mappings in {spill} (page cache)",
              flush=True)  # fmt: skip
    return val, load_packed_many(paths, spill), train_ids


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m rheo_engine.train.head_shards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--data", type=Path, default=Path("weights/smollm2/data"))
    p.add_argument("--target", type=Path, help="target (default: the smollm2 pair's GGUF)")
    p.add_argument("--work", type=Path, help="checkpoint and feature folder (--resume continues)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", type=Path, help="export the head here at the end (must not exist)")
    p.add_argument("--evaluate", type=Path, help="only evaluate this head on the held-out shards")
    p.add_argument("--features-only", action="store_true",
                   help="compute and keep every shard's features in --work, then stop")
    p.add_argument("--shards", type=parse_shards,
                   help="training shards to use, e.g. 2-24 or 2,5,30-46 (default: all of 2..); "
                        "two --features-only jobs on disjoint ranges share one --work")
    p.add_argument("--init-from", type=Path,
                   help="start from this head (its weights, feature layers, draft vocabulary)")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--max-steps", type=int, default=20000, help="the schedule's length, all runs")
    p.add_argument("--feature-layers", type=parse_layers, help="default: EAGLE's (2, N//2, N-3)")
    p.add_argument("--unroll", type=int, default=7)
    p.add_argument("--draft-vocab", type=int,
                   help="draft tokens: the N most frequent reply tokens (default 8192); "
                        "with --init-from, that head's N most frequent (default: all)")
    p.add_argument("--positions", type=int, default=2048, help="positions per batch (about)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--val-sequences", type=int, default=128)
    p.add_argument("--val-quick", type=int, default=16, help="held-out windows per minute line")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the target's dtype for the features")
    p.add_argument("--autocast", default="auto", choices=("auto", "bfloat16", "off"),
                   help="the head's matmuls in bf16: auto = where this CPU runs them faster")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="where the target computes the features and the head trains: cpu, "
                        "cuda, cuda:N (docs/training.md: the GPU recipe)")  # fmt: skip
    a = p.parse_args(argv)
    a.device = check_device(a.device)
    torch.set_num_threads(a.threads)
    budget = Budget(time.perf_counter(), a.minutes * 60)
    if a.target is None:
        from rheo_engine.runtime.pairs import smollm2_gguf  # a path lookup, nothing of the runtime

        a.target = smollm2_gguf()
    dtype = getattr(torch, a.dtype)
    target = load_target(a.target, a.device, dtype)
    t = target.cfg
    init = None if a.init_from is None else read_head(a.init_from, t)
    if a.evaluate is not None:
        init = read_head(a.evaluate, t)
    if init is not None and a.draft_vocab is not None and not 0 < a.draft_vocab <= len(init[1]):
        p.error(f"--draft-vocab {a.draft_vocab}: the --init-from head has {len(init[1])} draft "
                f"tokens, and a head's vocabulary can be narrowed (1..{len(init[1])}), not widened")
    layers = resolve_feature_layers(t, a.feature_layers) if init is None else init[0]
    t0 = time.perf_counter()
    val, train, train_ids = features_of(a, target, layers, dtype)
    if a.evaluate is not None:
        return evaluate_head(a, target, val, init, budget)
    positions = int(train.offsets[-1])
    print(f"{len(train)} training windows ({positions} positions, shards {train_ids[0]}.."
          f"{train_ids[-1]}) and {len(val)} held-out ready in {time.perf_counter() - t0:.0f} s",
          flush=True)  # fmt: skip
    if a.features_only:
        return {"train_positions": positions, "val_positions": int(val.offsets[-1])}
    vocab = 8192 if a.draft_vocab is None else a.draft_vocab
    cfg = HeadTrainConfig(feature_layers=layers, draft_vocab=vocab, unroll=a.unroll,
                          batch=a.positions, lr=a.lr, warmup=a.warmup, max_steps=a.max_steps,
                          seed=a.seed, store_dtype="bfloat16", chat=True)  # fmt: skip
    seqs = read_sequences(a.data, train_ids)
    if init is not None:  # its lm_head rows are its own draft vocabulary's (or --draft-vocab's)
        if a.draft_vocab is not None and a.draft_vocab != len(init[1]):
            init = narrowed(init, seqs, t.vocab_size, a.draft_vocab)
        layers, used, weights = init
        cfg = replace(cfg, draft_vocab=len(used))
    else:
        used = draft_vocabulary_of(seqs, t.vocab_size, cfg.draft_vocab)
    hcfg = head_config(t, cfg)
    trainer = Trainer(cfg, hcfg, target, used, empty_data(), empty_data(), a.device)
    trainer.autocast = pick_autocast(a.autocast, a.device)
    if init is not None and not a.resume:
        trainer.model.load_state_dict(init[2])
    if a.resume:
        trainer.load(a.work)
    if a.work is not None:
        a.work.mkdir(parents=True, exist_ok=True)
    batches = LengthBatches(train, a.positions)
    q = quick_eval(trainer, val, a.val_quick, a.positions)
    print(f"step {trainer.progress['step']} (start) | held-out acc {fmt(q['acc'])}", flush=True)
    window, last_line, last_ckpt = Window(cfg.unroll), time.perf_counter(), time.perf_counter()
    start_step, t_train, done = trainer.progress["step"], time.perf_counter(), 0
    counted = t_train  # train_seconds holds the time up to here (each checkpoint adds its part)

    def count_time() -> None:
        nonlocal counted
        now = time.perf_counter()
        trainer.progress["train_seconds"] += now - counted
        counted = now

    while trainer.progress["step"] < cfg.max_steps and budget.left() > 60:
        batch = train.batch(batches.draw(trainer.gen), trainer.device)
        window.add(trainer.train_step(batch))
        done += int(batch[3].sum())
        now = time.perf_counter()
        if now - last_line >= 60:
            s, q = window.summary(), quick_eval(trainer, val, a.val_quick, a.positions)
            rate = done / (now - t_train)
            print(f"step {trainer.progress['step']}/{cfg.max_steps} | train acc {fmt(s['acc'])} | "
                  f"held-out acc {fmt(q['acc'])} | lr {trainer.lr_at(trainer.progress['step']):.2e}"
                  f" | {rate:.0f} positions/s | {budget.elapsed() / 60:.1f} min", flush=True)
            trainer.progress["train"].append({"step": trainer.progress["step"], **s,
                                              "val_quick": q})  # fmt: skip
            window, last_line = Window(cfg.unroll), time.perf_counter()
        if a.work is not None and now - last_ckpt > CHECKPOINT_SECONDS:
            count_time()  # so a run killed after this checkpoint keeps its time
            trainer.save(a.work)
            last_ckpt = time.perf_counter()
    count_time()
    if a.work is not None:
        trainer.save(a.work)
    result = quick_eval(trainer, val, None, a.positions)
    print(f"held-out ({len(val)} windows) acc per step {fmt(result['acc'])}", flush=True)
    if a.out is not None:
        log = {"data": str(a.data), "target": str(a.target), "train_shards": train_ids,
               "train_windows": len(train), "positions_train": positions,
               "positions_per_batch": a.positions, "device": a.device,
               "autocast": str(trainer.autocast).split(".")[-1] if trainer.autocast else "off",
               "hyper_parameters": {**asdict(cfg), "feature_layers": list(cfg.feature_layers)},
               **trainer.progress, "val": result}  # fmt: skip
        export(a.out, hcfg, trainer.export_weights(), log, target.dtype)
    return result


def empty_data() -> HeadData:
    z = torch.zeros(0, 1, dtype=torch.int64)
    return HeadData(z, z.float(), z.float(), z[:, 0], CONTEXT)


def read_head(path: Path, t) -> tuple[tuple[int, ...], torch.Tensor, dict]:
    """(feature layers, draft vocabulary as ascending target ids, trainable weights) of a head
    directory written by train.head / head_shards."""
    config = json.loads((path / "config.json").read_text())
    w = load_safetensors(path / "model.safetensors")
    layers = tuple(config.get("eagle_aux_hidden_state_layer_ids") or
                   resolve_feature_layers(t, None))  # fmt: skip
    Vd = int(config.get("draft_vocab_size", t.vocab_size))
    used = (w["d2t"].long() + torch.arange(Vd)) if "d2t" in w else torch.arange(Vd)
    return layers, used, {k: v.float() for k, v in w.items() if k not in ("d2t", "t2d")}


def evaluate_head(a: argparse.Namespace, target: LlamaModel, val: Packed, init,
                  budget: Budget) -> dict:  # fmt: skip
    """Top-1 per unroll step of an existing head on the held-out windows (same loss code)."""
    layers, used, weights = init
    cfg = HeadTrainConfig(feature_layers=layers, draft_vocab=len(used), unroll=a.unroll,
                          batch=a.positions, chat=True)  # fmt: skip
    trainer = Trainer(cfg, head_config(target.cfg, cfg), target, used, empty_data(),
                      empty_data(), a.device)  # fmt: skip
    trainer.autocast = pick_autocast(a.autocast, a.device)
    trainer.model.load_state_dict(weights)
    result = quick_eval(trainer, val, None, a.positions)
    print(f"{a.evaluate}: held-out ({len(val)} windows, shards {VAL_SHARDS}) acc per step "
          f"{fmt(result['acc'])} | positions {sum(result['positions'][:1])} | "
          f"{budget.elapsed():.0f} s", flush=True)  # fmt: skip
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
