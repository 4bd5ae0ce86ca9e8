"""Train (or evaluate) an EAGLE-3 head on token-id shards of smollm2_data (issue 26).

    python -m rheo_engine.train.head_shards --data weights/smollm2/data --work W --minutes 60
    python -m rheo_engine.train.head_shards --evaluate weights/smollm2/head

The shards hold token ids only; the features and the target's final states are recomputed
here by one prefill per sequence (``sequence_features``). Each sequence becomes a window of
``CONTEXT`` prompt tokens then its reply (the window's ``prompt_len`` is CONTEXT for all), so
windows stack into one HeadData and head_loop's Trainer trains on them unchanged: loss over the
draft vocabulary, unrolled ``--unroll`` steps (7, as EAGLE-3 drafts), weights step_decay ** s.

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
from rheo_engine.train.head_loop import CHECKPOINT_SECONDS, Trainer, Window
from rheo_engine.train.smollm2_data import load_shard, shard_path

CONTEXT = 16  # prompt tokens kept before each reply in a window
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


@torch.no_grad()
def sequence_features(target: LlamaModel, seqs: list[tuple[np.ndarray, int]], window: int,
                      feature_layers: tuple[int, ...], store: torch.dtype) -> HeadData:  # fmt: skip
    """Prefill each sequence whole; keep the window [prompt_len - CONTEXT, + window) of its
    tokens, features and final states (zero-padded; ``lengths`` = valid positions)."""
    N, F = len(seqs), len(feature_layers) * target.cfg.hidden_size
    tokens = torch.zeros(N, window, dtype=torch.int64)
    features = torch.zeros(N, window, F, dtype=store)
    hidden = torch.zeros(N, window, target.cfg.hidden_size, dtype=store)
    lengths = torch.zeros(N, dtype=torch.int64)
    for k, (ids, prompt_len) in enumerate(seqs):
        L = len(ids)
        x = torch.from_numpy(ids).unsqueeze(0).to(target.device)
        cache = target.new_cache(L, 1)
        h, f = target.forward(x, torch.arange(L, device=target.device).unsqueeze(0), cache,
                              None, feature_layers, output_hidden=True)  # fmt: skip
        a = max(0, prompt_len - CONTEXT)
        b = min(L, a + window)
        tokens[k, : b - a] = x[0, a:b].cpu()
        features[k, : b - a] = f[0, a:b].to("cpu", store)
        hidden[k, : b - a] = h[0, a:b].to("cpu", store)
        lengths[k] = b - a
    return HeadData(tokens, features, hidden, lengths, CONTEXT)


def draft_vocabulary_of(seqs: list[tuple[np.ndarray, int]], V: int, Vd: int) -> torch.Tensor:
    """The Vd most frequent reply tokens (ties by lower id), ascending; all ids when Vd is 0/V."""
    if Vd in (0, V):
        return torch.arange(V)
    counts = np.zeros(V, dtype=np.int64)
    for ids, prompt_len in seqs:
        counts += np.bincount(ids[prompt_len:], minlength=V)
    order = torch.sort(-torch.from_numpy(counts), stable=True).indices
    return order[:Vd].sort().values


def load_target(path: Path, device: str, dtype: torch.dtype) -> LlamaModel:
    if is_gguf(path):
        return LlamaModel.from_gguf(read_gguf(path), device=device, dtype=dtype)
    return LlamaModel.from_pretrained(path, device=device, dtype=dtype)


def quick_eval(trainer: Trainer, val: HeadData, n: int) -> dict:
    """Held-out loss and top-1 per unroll step on the first n windows."""
    trainer.model.eval()
    window = Window(trainer.cfg.unroll)
    with torch.no_grad():
        for rows in torch.arange(min(n, len(val.tokens))).split(trainer.cfg.batch):
            window.add(trainer.losses(trainer._batch(val, rows))[1])
    trainer.model.train()
    return window.summary()


def fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m rheo_engine.train.head_shards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--data", type=Path, default=Path("weights/smollm2/data"))
    p.add_argument("--target", type=Path, help="target (default: the smollm2 pair's GGUF)")
    p.add_argument("--work", type=Path, help="checkpoint folder (--resume continues it)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", type=Path, help="export the head here at the end (must not exist)")
    p.add_argument("--evaluate", type=Path, help="only evaluate this head on the held-out shards")
    p.add_argument("--init-from", type=Path,
                   help="start from this head (its weights, feature layers, draft vocabulary)")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--max-steps", type=int, default=20000, help="the schedule's length, all runs")
    p.add_argument("--feature-layers", type=parse_layers, help="default: EAGLE's (2, N//2, N-3)")
    p.add_argument("--unroll", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--window", type=int, default=CONTEXT + 321, help="positions per window")
    p.add_argument("--train-sequences", type=int, default=1024, help="held in memory at once")
    p.add_argument("--val-sequences", type=int, default=128)
    p.add_argument("--val-quick", type=int, default=8, help="held-out windows per minute line")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    budget = Budget(time.perf_counter(), a.minutes * 60)
    if a.target is None:
        from rheo_engine.runtime.pairs import smollm2_gguf  # a path lookup, nothing of the runtime

        a.target = smollm2_gguf()
    dtype = getattr(torch, a.dtype)
    target = load_target(a.target, "cpu", dtype)
    t = target.cfg
    held_out = read_sequences(a.data, list(VAL_SHARDS))
    val_seqs = held_out[:: max(1, len(held_out) // a.val_sequences)][: a.val_sequences]
    if not val_seqs:
        raise FileNotFoundError(f"no held-out shards {VAL_SHARDS} in {a.data}; make them first")
    train_ids = [i for i in available_shards(a.data) if i not in VAL_SHARDS]
    if a.evaluate is not None:
        return evaluate_head(a, target, val_seqs, budget)
    train_seqs = read_sequences(a.data, train_ids)
    if not train_seqs:
        raise FileNotFoundError(f"no training shards (2..) in {a.data}")
    cfg = HeadTrainConfig(feature_layers=resolve_feature_layers(t, a.feature_layers),
                          draft_vocab=a.draft_vocab, unroll=a.unroll, batch=a.batch, lr=a.lr,
                          warmup=a.warmup, max_steps=a.max_steps, seed=a.seed,
                          store_dtype="bfloat16", chat=True)  # fmt: skip
    hcfg = head_config(t, cfg)
    rng = np.random.default_rng(a.seed)
    pick = rng.permutation(len(train_seqs))[: a.train_sequences]
    chosen = [train_seqs[k] for k in sorted(pick)]
    used = draft_vocabulary_of(train_seqs, t.vocab_size, a.draft_vocab)
    init = None if a.init_from is None else read_head(a.init_from, t)
    if init is not None:  # its lm_head rows are its own draft vocabulary's
        layers, used, weights = init
        cfg = replace(cfg, feature_layers=layers, draft_vocab=len(used))
        hcfg = head_config(t, cfg)
    t0 = time.perf_counter()
    train = sequence_features(target, chosen, a.window, cfg.feature_layers, dtype)
    val = sequence_features(target, val_seqs, a.window, cfg.feature_layers, dtype)
    positions = int(train.lengths.sum())
    print(f"features of {len(chosen)} training windows ({positions} positions) and "
          f"{len(val_seqs)} held-out in {time.perf_counter() - t0:.0f} s "
          f"({(positions + int(val.lengths.sum())) / (time.perf_counter() - t0):.0f} positions/s)",
          flush=True)  # fmt: skip
    trainer = Trainer(cfg, hcfg, target, used, train, val, "cpu")
    if init is not None and not a.resume:
        trainer.model.load_state_dict(init[2])
    if a.resume:
        trainer.load(a.work)
    if a.work is not None:
        a.work.mkdir(parents=True, exist_ok=True)
    q = quick_eval(trainer, val, a.val_quick)
    print(f"step {trainer.progress['step']} (start) | held-out acc {fmt(q['acc'])}", flush=True)
    window, last_line, last_ckpt = Window(cfg.unroll), time.perf_counter(), time.perf_counter()
    start_step, t_train = trainer.progress["step"], time.perf_counter()
    while trainer.progress["step"] < cfg.max_steps and budget.left() > 60:
        window.add(trainer.train_step())
        now = time.perf_counter()
        if now - last_line >= 60:
            s, q = window.summary(), quick_eval(trainer, val, a.val_quick)
            rate = (trainer.progress["step"] - start_step) * a.batch / (now - t_train)
            print(f"step {trainer.progress['step']}/{cfg.max_steps} | train acc {fmt(s['acc'])} | "
                  f"held-out acc {fmt(q['acc'])} | lr {trainer.lr_at(trainer.progress['step']):.2e}"
                  f" | {rate:.2f} windows/s | {budget.elapsed() / 60:.1f} min", flush=True)
            trainer.progress["train"].append({"step": trainer.progress["step"], **s,
                                              "val_quick": q})  # fmt: skip
            window, last_line = Window(cfg.unroll), time.perf_counter()
        if a.work is not None and now - last_ckpt > CHECKPOINT_SECONDS:
            trainer.save(a.work)
            last_ckpt = time.perf_counter()
    trainer.progress["train_seconds"] += time.perf_counter() - t_train
    if a.work is not None:
        trainer.save(a.work)
    result = trainer.evaluate()
    print(f"held-out ({len(val_seqs)} windows) acc per step {fmt(result['acc'])}", flush=True)
    if a.out is not None:
        log = {"data": str(a.data), "target": str(a.target), "train_shards": train_ids,
               "train_windows": len(chosen), "positions_train": positions,
               "hyper_parameters": {**asdict(cfg), "feature_layers": list(cfg.feature_layers)},
               **trainer.progress, "val": result}  # fmt: skip
        export(a.out, hcfg, trainer.export_weights(), log, target.dtype)
    return result


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


def evaluate_head(a: argparse.Namespace, target: LlamaModel, val_seqs, budget: Budget) -> dict:
    """Top-1 per unroll step of an existing head on the held-out windows (same loss code)."""
    layers, used, weights = read_head(a.evaluate, target.cfg)
    cfg = HeadTrainConfig(feature_layers=layers, draft_vocab=len(used), unroll=a.unroll,
                          batch=a.batch, chat=True)  # fmt: skip
    hcfg = head_config(target.cfg, cfg)
    val = sequence_features(target, val_seqs, a.window, layers, getattr(torch, a.dtype))
    empty = HeadData(val.tokens[:0], val.features[:0], val.hidden[:0], val.lengths[:0], CONTEXT)
    trainer = Trainer(cfg, hcfg, target, used, empty, val, "cpu")
    trainer.model.load_state_dict(weights)
    result = trainer.evaluate()
    print(f"{a.evaluate}: held-out ({len(val_seqs)} windows, shards {VAL_SHARDS}) acc per step "
          f"{fmt(result['acc'])} | positions {result['positions']} | "
          f"{budget.elapsed():.0f} s", flush=True)  # fmt: skip
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
