"""Train an EAGLE-3 draft head for a Llama target on the target's own samples.

    python -m rheo_engine.train.head --target DIR --out DIR [--corpus DIR] [--minutes 15]

1. Data (head_data.py): prompts (BOS alone, or BOS + short random spans of --corpus) are
   continued by the target at T = 1; every position keeps the fused features at the head's
   feature layers and the target's final normed state (its next-token distribution).
2. The head (head_model.py, official key names) learns by EAGLE-3's training-time test,
   unrolled --unroll steps the way Eagle3Drafter drafts: loss = KL(target || head) at every
   step (over the draft vocabulary, renormalised, when --draft-vocab < V), weighted 0.8**s.
3. AdamW with warm-up and a cosine, sized to fill --minutes (or --max-steps); then held-out
   sequences are evaluated and OUT/{config.json, model.safetensors, train_log.json} written
   via OUT.tmp-<pid>, renamed only when complete. --work keeps the data and a checkpoint
   (safetensors + JSON, no pickle) for --resume.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from rheo_engine.config import ModelConfig
from rheo_engine.io.tokenizer import Tokenizer
from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.models.eagle3 import DEFAULT_ROPE_THETA, HeadConfig, head_config_json
from rheo_engine.models.llama import LlamaModel
from rheo_engine.train.checkpoint import Budget, atomic_folder
from rheo_engine.train.head_config import _DATA_FIELDS, _STORE, HeadTrainConfig
from rheo_engine.train.head_data import (
    HeadData,
    chat_prompts,
    corpus_files,
    corpus_prompts,
    draft_vocabulary,
    generate_data,  # fmt: skip
    resolve_feature_layers,
)
from rheo_engine.train.head_loop import Trainer, check_resumable, jsonable
from rheo_engine.train.head_model import TrainableHead  # noqa: F401  (re-exported)


def head_config(t: ModelConfig, cfg: HeadTrainConfig) -> HeadConfig:
    """The head's shape: the target's width, heads and MLP; RoPE base 10000 as EAGLE."""
    return HeadConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim, vocab_size=t.vocab_size,
        draft_vocab_size=cfg.draft_vocab or t.vocab_size, rms_norm_eps=t.rms_norm_eps,
        rope_theta=DEFAULT_ROPE_THETA, target_hidden_size=t.hidden_size,
        feature_layers=cfg.feature_layers,
    )  # fmt: skip


def check_inputs(out: Path, work: Path | None, resume: bool, t: ModelConfig,
                 cfg: HeadTrainConfig, corpus: Path | None, minutes: float) -> None:  # fmt: skip
    """Everything checkable before any work: paths, sizes, the target's room."""
    if out.exists():
        raise FileExistsError(f"--out {out} already exists; remove it or pick another --out")
    if resume and (work is None or not (work / "ckpt.json").is_file()):
        raise FileNotFoundError(
            f"--resume needs a checkpoint in --work, but {work}/ckpt.json does not exist; "
            "pass the --work folder of the interrupted run"
        )
    if not resume and work is not None and (work / "ckpt.json").exists():
        raise FileExistsError(f"--work {work} holds a checkpoint; pass --resume or another --work")
    if resume:
        check_resumable(work, cfg)
    if not minutes > 0:
        raise ValueError(f"--minutes={minutes} must be > 0")
    if cfg.draft_vocab > t.vocab_size:
        raise ValueError(
            f"--draft-vocab={cfg.draft_vocab} > the target's vocab_size={t.vocab_size}; lower it"
        )
    P = cfg.prompt_len if corpus is not None else 1
    if P + cfg.gen_len > t.max_position_embeddings:
        raise ValueError(
            f"prompt {P} + --gen-len {cfg.gen_len} tokens exceed the target's context "
            f"max_position_embeddings={t.max_position_embeddings}; lower --gen-len"
        )
    if cfg.gen_len < cfg.unroll + 1:
        raise ValueError(f"--gen-len={cfg.gen_len} must exceed --unroll={cfg.unroll}")
    if cfg.chat and corpus is None:
        raise ValueError("--chat writes tasks about corpus spans; pass --corpus DIR (or stdlib)")
    if corpus is None and t.bos_token_id is None:
        raise ValueError("the target has no bos_token_id to prompt with; pass --corpus DIR")


def make_prompts(target_dir: Path, t: ModelConfig, cfg: HeadTrainConfig,
                 corpus: Path | None) -> torch.Tensor:  # fmt: skip
    """[samples, P] int64: corpus spans, or BOS alone."""
    if corpus is None:
        return torch.full((cfg.samples, 1), t.bos_token_id, dtype=torch.int64)
    files = corpus_files(corpus)
    tok = Tokenizer.from_dir(target_dir)
    make = chat_prompts if cfg.chat else corpus_prompts
    return make(files, tok, cfg.samples, cfg.prompt_len, random.Random(cfg.seed))


def load_or_generate(target: LlamaModel, target_dir: Path, cfg: HeadTrainConfig,
                     corpus: Path | None, work: Path | None, budget: Budget,
                     gen_batch: int) -> HeadData:  # fmt: skip
    """The data of these settings: from --work when a run made it, else generated (and kept
    there, with data.json saying what it is)."""
    key = {k: v for k, v in jsonable(cfg).items() if k in _DATA_FIELDS}
    key |= {"corpus": None if corpus is None else str(corpus.resolve()),
            "target_fingerprint": target_fingerprint(target_dir)}  # fmt: skip
    cached = None if work is None else work / "data.safetensors"
    if cached is not None and cached.is_file() and (work / "data.json").is_file():
        if json.loads((work / "data.json").read_text()) == key:
            print(f"data: reusing {cached}", flush=True)
            return HeadData.from_tensors(load_safetensors(cached))
    prompts = make_prompts(target_dir, target.cfg, cfg, corpus)
    t0 = time.perf_counter()
    data = generate_data(target, prompts, cfg.gen_len, gen_batch, cfg.feature_layers, cfg.seed,
                         _STORE[cfg.store_dtype], budget.start + budget.seconds)  # fmt: skip
    n_pos = int(data.lengths.sum())
    print(f"data: {len(data.tokens)} sequences, {n_pos} positions in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    if work is not None:
        (work / "data.json").unlink(missing_ok=True)  # never describe a file being replaced
        save_safetensors(data.tensors(), work / "data.safetensors.tmp")
        os.replace(work / "data.safetensors.tmp", work / "data.safetensors")
        (work / "data.json").write_text(json.dumps(key, indent=1))
    return data


def export(out: Path, hcfg: HeadConfig, weights: dict[str, torch.Tensor], log: dict,
           dtype: torch.dtype) -> None:  # fmt: skip
    """Write config.json, model.safetensors, train_log.json into OUT.tmp-<pid>, then rename.

    Floating weights are stored in ``dtype``, the target's: the engine casts a head to its
    target's dtype when it loads it (as EAGLE does), so wider storage would only cost space."""
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    dtype_name = str(dtype).removeprefix("torch.")
    log["head_config"] = head_config_json(hcfg, dtype_name)
    with atomic_folder(out) as tmp:
        (tmp / "config.json").write_text(
            json.dumps(head_config_json(hcfg, dtype_name), indent=1) + "\n"
        )
        save_safetensors(weights, tmp / "model.safetensors")
        (tmp / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


def target_fingerprint(target_dir: str | Path) -> str:
    """A cheap identity of a target checkpoint: sha256 over config.json and, per weights file,
    its name, size and first and last MiB (hashing a 16 GB target whole would take minutes)."""
    d = Path(target_dir)
    digest = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(1 << 20)
            fh.seek(max(0, size - (1 << 20)))
            tail = fh.read()
        digest.update(f"{f.name}:{size}\n".encode() + head + tail)
    return digest.hexdigest()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def train_head(target_dir: str | Path, out: str | Path, cfg: HeadTrainConfig | None = None,
               corpus: str | Path | None = None, work: str | Path | None = None,
               resume: bool = False, minutes: float = 15.0, threads: int | None = None,
               device: str | None = None, gen_batch: int = 256,
               log_every: int = 25, init_from: str | Path | None = None) -> dict:  # fmt: skip
    """Run the whole recipe (module docstring); returns train_log.json's contents.

    ``init_from``: a head directory of the same shape to start from instead of a fresh
    initialisation (fine-tuning a head to a target that was trained further)."""
    budget = Budget(time.perf_counter(), minutes * 60)
    target_dir, out = Path(target_dir), Path(out)
    work, corpus = (None if p is None else Path(p) for p in (work, corpus))
    t = ModelConfig.from_hf_dir(target_dir)
    cfg = cfg or HeadTrainConfig()
    cfg = replace(cfg, feature_layers=resolve_feature_layers(t, cfg.feature_layers))
    check_inputs(out, work, resume, t, cfg, corpus, minutes)
    if corpus is not None:
        corpus_files(corpus)  # a folder without text fails here, before any work
    hcfg = head_config(t, cfg)
    init_from = None if init_from is None else Path(init_from)
    if init_from is not None:
        check_init(init_from, hcfg)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or min(8, os.cpu_count() or 1))
    try:
        return _run(target_dir, out, cfg, hcfg, corpus, work, resume, budget,
                    device or default_device(), gen_batch, log_every, init_from)  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)  # a library call leaves the process as it was


def _run(target_dir: Path, out: Path, cfg: HeadTrainConfig, hcfg: HeadConfig,
         corpus: Path | None, work: Path | None, resume: bool, budget: Budget, device: str,
         gen_batch: int, log_every: int, init_from: Path | None) -> dict:  # fmt: skip
    """Data, training, evaluation and export, after every input was checked."""
    torch.manual_seed(cfg.seed)
    target = LlamaModel.from_pretrained(target_dir, device=device)
    t = target.cfg
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    data = load_or_generate(target, target_dir, cfg, corpus, work, budget, gen_batch)
    train, val = data.split(cfg.val_samples)
    used = draft_vocabulary(train, t.vocab_size, cfg.draft_vocab)
    trainer = Trainer(cfg, hcfg, target, used, train, val, device)
    if init_from is not None and not resume:
        w = load_safetensors(init_from / "model.safetensors")
        trainer.model.load_state_dict({k: v.float() for k, v in w.items()
                                       if k not in ("d2t", "t2d")})  # fmt: skip
    if resume:
        trainer.load(work)
    resumed_from = trainer.progress["step"] if resume else None
    trainer.run(budget, work, log_every)
    log = {
        "target": str(target_dir.resolve()),
        "target_fingerprint": target_fingerprint(target_dir), "head_config": head_config_json(hcfg),
        "hyper_parameters": {**asdict(cfg), "feature_layers": list(cfg.feature_layers)},
        "seed": cfg.seed, "corpus": None if corpus is None else str(corpus.resolve()),
        "data": {"sequences_train": len(train.tokens), "sequences_val": len(val.tokens),
                 "positions_train": int(train.lengths.sum()), "positions_val":
                 int(val.lengths.sum()), "prompt_len": data.prompt_len,
                 "gen_len": cfg.gen_len},
        "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": sys.version.split()[0], "resumed_from_step": resumed_from,
        "init_from": None if init_from is None else {
            "path": str(init_from), "model_sha256": hashlib.sha256(
                (init_from / "model.safetensors").read_bytes()).hexdigest()},
        **trainer.progress,
    }  # fmt: skip
    log["val"] = trainer.evaluate()
    log["wall_seconds"] = round(budget.elapsed(), 1)
    export(out, hcfg, trainer.export_weights(), log, target.dtype)
    acc = " ".join(f"{a:.3f}" for a in log["val"]["acc"])
    print(f"done: step {log['step']}, val acc per step {acc}, {budget.elapsed() / 60:.1f} min "
          f"-> {out}", flush=True)  # fmt: skip
    return log


def check_init(init: Path, hcfg: HeadConfig) -> None:
    """--init-from must be a head of exactly the shape this run trains (same fields in its
    config.json: widths, vocabularies, feature layers)."""
    f = init / "config.json"
    if not f.is_file() or not (init / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"--init-from {init} is not a head directory (config.json + model.safetensors); "
            "pass the folder of a head trained by train.head"
        )
    theirs, ours = json.loads(f.read_text()), head_config_json(hcfg)
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "draft_vocab_size",
        "eagle_aux_hidden_state_layer_ids",
    )
    diff = {k: (theirs.get(k), ours.get(k)) for k in keys if theirs.get(k) != ours.get(k)}
    if diff:
        raise ValueError(
            f"--init-from {init} has another shape {{field: (its, this run's)}} = {diff}; "
            "pass a head of this target's shape or train from scratch"
        )


def parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected layer ids like 1,2,3") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rheo_engine.train.head", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target", required=True, type=Path, help="HF Llama target directory")
    p.add_argument("--out", required=True, type=Path, help="new head directory (must not exist)")
    p.add_argument(
        "--corpus",
        type=Path,
        help="folder of text files for prompts, or 'stdlib' for the default target's training "
        "split (default: BOS alone)",
    )
    p.add_argument("--work", type=Path, help="data + checkpoint folder for --resume")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --work")
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget (default 15)")
    p.add_argument("--feature-layers", type=parse_layers, help="e.g. 1,2,3 (default 2,N//2,N-3)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: cores, at most 8)")
    p.add_argument("--gen-batch", type=int, default=256, help="sequences generated at once")
    p.add_argument("--log-every", type=int, default=25, help="steps between progress lines")
    p.add_argument("--init-from", type=Path, help="start from this head's weights (fine-tune)")
    d = HeadTrainConfig()
    for f in fields(HeadTrainConfig):
        if f.name == "chat":
            p.add_argument("--chat", action="store_true", help="prompts in the chat template")
        elif f.name != "feature_layers":
            value = getattr(d, f.name)
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=value,
                           help=f"default {value}")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    names = [f.name for f in fields(HeadTrainConfig) if f.name != "feature_layers"]
    values = {name: getattr(a, name) for name in names}
    cfg = HeadTrainConfig(feature_layers=a.feature_layers or (), **values)
    return train_head(a.target, a.out, cfg, a.corpus, a.work, a.resume, a.minutes, a.threads,
                      a.device, a.gen_batch, a.log_every, a.init_from)  # fmt: skip


if __name__ == "__main__":
    main()
