"""Train the project's default target from scratch: a small Llama on Python's own source.

    python -m rheo_engine.train.target --out weights/target

1. A sentencepiece BPE tokenizer is trained on the training split (byte fallback, so any text
   encodes; newlines are kept and become the byte piece <0x0A>).
2. Every file is tokenized as one document, BOS ... EOS, and the documents are concatenated.
3. A Llama decoder (RMSNorm, RoPE, SwiGLU, GQA, tied embeddings) is trained with AdamW on random
   windows under a warm-up + cosine schedule, within a wall-clock budget (--minutes).
4. The result is written as an HF Llama directory (config.json, model.safetensors,
   tokenizer.model, train_log.json) into OUT.tmp-<pid>, renamed to OUT only when complete.

Checkpoints for --resume go to --work (safetensors + JSON, no pickle). weights/README.md is the
model card of the default run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.train.checkpoint import Budget, atomic_folder, load_checkpoint, save_checkpoint
from rheo_engine.train.corpus import Corpus, load_corpus
from rheo_engine.train.data import TokenStreams, build_streams, train_tokenizer
from rheo_engine.train.model import TinyLlama

_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (a resumed run must match it exactly)."""

    vocab: int = 4096  # V, tokenizer and model
    dim: int = 256  # hidden size
    layers: int = 8  # EAGLE-3's default feature layers (2, N//2, N-3) = (2, 4, 5): distinct
    heads: int = 8  # H
    kv_heads: int = 4  # Hkv (GQA)
    hidden: int = 688  # SwiGLU intermediate size
    seq: int = 256  # training window; also max_position_embeddings
    batch: int = 16  # windows per step
    steps: int = 1500  # schedule length (the budget may stop earlier): ~6.1M tokens
    lr: float = 2e-3  # peak learning rate
    min_lr: float = 2e-4  # end of the cosine
    warmup: int = 100  # linear warm-up steps
    weight_decay: float = 0.1  # on matrices only
    grad_clip: float = 1.0
    seed: int = 0
    storage: str = "bfloat16"  # dtype of model.safetensors
    tokenizer_lines: int = 400_000  # lines sampled to train the tokenizer

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("lr", "min_lr", "weight_decay", "grad_clip", "seed", "storage"):
                if getattr(self, f.name) < (0 if f.name == "warmup" else 1):
                    raise ValueError(f"--{f.name}={getattr(self, f.name)} must be positive")
        if self.vocab < 260:
            raise ValueError(
                f"--vocab={self.vocab} < 260: byte fallback needs 256 byte pieces plus "
                "unk/bos/eos and at least one merge; raise --vocab"
            )
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(
                f"--dim={self.dim} must split into --heads={self.heads} heads of even size "
                "(RoPE rotates pairs); pick dim = heads * an even head size"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--heads={self.heads} is not a multiple of --kv-heads={self.kv_heads} "
                "(GQA shares each K/V head among heads/kv_heads query heads); fix one of them"
            )
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"need 0 < --min-lr={self.min_lr} <= --lr={self.lr}")
        if self.storage not in _STORAGE:
            raise ValueError(f"--storage={self.storage!r} is not one of {list(_STORAGE)}")

    def lr_at(self, step: int) -> float:
        """Linear warm-up to ``lr``, then a cosine down to ``min_lr`` at ``steps``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        cos = 0.5 * (1 + torch.cos(torch.tensor(frac * torch.pi)).item())
        return self.min_lr + (self.lr - self.min_lr) * cos

    def hf_config(self) -> dict:
        """config.json of the trained model (HF LlamaForCausalLM fields)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.dim,
            "intermediate_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.dim // self.heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": self.seq,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": self.storage,
            "use_cache": True,
        }


def new_model(cfg: TrainConfig) -> TinyLlama:
    return TinyLlama(cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.kv_heads, cfg.hidden, cfg.seq)


def new_optimizer(model: TinyLlama, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices (the tied embedding included), not the RMSNorm gains.
    named = sorted(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


# --- training ------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: TinyLlama, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over validation windows [n, seq + 1]."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(8):
        loss = model.loss(chunk[:, :-1], chunk[:, 1:])
        total += loss.item() * chunk[:, 1:].numel()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


@dataclass(frozen=True)
class RunOptions:
    """How one run goes (paths, budget, logging); none of it changes the trained weights."""

    out: Path  # the new model directory; must not exist
    corpus: Path | None = None  # a folder of text files; None = the standard library
    work: Path | None = None  # checkpoints for --resume; None = no checkpoints
    resume: bool = False
    minutes: float = 55.0  # wall-clock budget from the start of the command
    stop_at: int | None = None  # stop, checkpoint and export at this step (None = --steps)
    threads: int = 2
    log_every: int = 10  # steps between progress lines
    eval_minutes: float = 5.0  # between validation checks (and checkpoints)
    init_from: Path | None = None  # continue training this HF target (weights + tokenizer)

    def __post_init__(self) -> None:
        for name in ("minutes", "threads", "log_every", "eval_minutes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be > 0")


def train_loop(
    model: TinyLlama,
    opt: torch.optim.AdamW,
    gen: torch.Generator,
    data: TokenStreams,
    cfg: TrainConfig,
    opts: RunOptions,
    progress: dict,
    budget: Budget,
) -> None:
    """Steps from progress["step"] to the stop step, or until the budget runs out."""
    stop_at = opts.stop_at or cfg.steps
    first = progress["step"]
    session_start, window_tokens, last_eval = time.perf_counter(), 0, time.perf_counter()
    eval_windows = data.val_windows[:: max(1, len(data.val_windows) // 32)][:32]
    while progress["step"] < stop_at:
        if budget.left() <= 0:
            if progress["step"] == first:
                raise TimeoutError(
                    f"--minutes={budget.seconds / 60:g} ran out after {budget.elapsed():.1f} s of "
                    "setup (tokenizer, tokenization), before the first training step; raise "
                    "--minutes (nothing was written)"
                )
            break
        step = progress["step"]
        lr = cfg.lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.train_batch(cfg.batch, cfg.seq, gen)  # [B, seq] each
        loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        progress["step"] = step + 1
        progress["tokens_seen"] += x.numel()
        progress["train_loss"] = loss.item()
        window_tokens += x.numel()
        if progress["step"] % opts.log_every == 0 or progress["step"] == stop_at:
            rate = window_tokens / (time.perf_counter() - session_start)
            print(
                f"step {progress['step']:5d}/{cfg.steps} | loss {loss.item():.4f} | lr {lr:.2e} "
                f"| {rate:6.0f} tok/s | {budget.elapsed() / 60:5.1f} min",
                flush=True,
            )
        if time.perf_counter() - last_eval >= opts.eval_minutes * 60:
            val = evaluate(model, eval_windows)
            progress["evals"].append([progress["step"], round(val, 4)])
            ppl = torch.tensor(val).exp().item()
            print(
                f"eval  step {progress['step']:5d} | val loss {val:.4f} | ppl {ppl:.2f} "
                f"({len(eval_windows)} windows)",
                flush=True,
            )
            if opts.work is not None:
                save_checkpoint(opts.work, model, opt, gen, asdict(cfg), progress)
            last_eval = time.perf_counter()
    progress["train_seconds"] = progress.get("train_seconds", 0.0) + (
        time.perf_counter() - session_start
    )


def export(
    out: Path,
    model: TinyLlama,
    cfg: TrainConfig,
    tokenizer_path: Path,
    data: TokenStreams,
    log: dict,
) -> None:
    """Evaluate, then write the HF directory into OUT.tmp-<pid>, renamed to OUT once complete."""
    dtype = _STORAGE[cfg.storage]
    weights = {k: v.to(dtype) for k, v in model.state_dict().items()}  # HF names
    # Report the loss of the weights as stored (bf16 rounding costs a little).
    stored = new_model(cfg)
    stored.load_state_dict({k: v.float() for k, v in weights.items()})
    log["val_loss_fp32"] = round(evaluate(model, data.val_windows), 4)
    log["val_loss"] = round(evaluate(stored, data.val_windows), 4)
    log["val_perplexity"] = round(float(torch.tensor(log["val_loss"]).exp()), 3)
    with atomic_folder(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg.hf_config(), indent=2) + "\n")
        save_safetensors(weights, tmp / "model.safetensors")
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.model")
        (tmp / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


_ARCH_FIELDS = ("vocab", "dim", "layers", "heads", "kv_heads", "hidden")


def load_init(model: TinyLlama, cfg: TrainConfig, init: Path) -> dict:
    """Load the weights of the target directory ``init`` into ``model`` (fp32), checking that its
    architecture is ``cfg``'s (the window, and so the context, may grow); returns its identity
    for train_log.json."""
    hf = json.loads((init / "config.json").read_text())
    theirs = dict(zip(_ARCH_FIELDS, (hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"],
                  hf["num_attention_heads"], hf["num_key_value_heads"],
                  hf["intermediate_size"]), strict=True))  # fmt: skip
    diff = {k: (v, getattr(cfg, k)) for k, v in theirs.items() if v != getattr(cfg, k)}
    if diff:
        raise ValueError(
            f"--init-from {init} has another architecture {{name: (its, given)}} = {diff}; "
            "pass its values"
        )
    weights = load_safetensors(init / "model.safetensors")
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    digest = hashlib.sha256((init / "model.safetensors").read_bytes()).hexdigest()
    prior = json.loads((init / "train_log.json").read_text()) if (
        init / "train_log.json").is_file() else {}  # fmt: skip
    return {"path": str(init), "model_sha256": digest, "context": hf["max_position_embeddings"],
            "steps": prior.get("step"), "tokens_seen": prior.get("tokens_seen"),
            "val_loss": prior.get("val_loss")}  # fmt: skip


def check_paths(out: Path, work: Path | None, resume: bool) -> None:
    """Refuse, before any work, what would clobber a model or a checkpoint."""
    if out.exists():
        raise FileExistsError(
            f"--out {out} already exists; the trainer never overwrites a model: remove it or "
            "pick another --out"
        )
    if resume and (work is None or not (work / "ckpt.json").is_file()):
        raise FileNotFoundError(
            f"--resume needs a checkpoint in --work, but {work}/ckpt.json does not exist; "
            "pass the --work folder of the interrupted run"
        )
    if not resume and work is not None and (work / "ckpt.json").exists():
        raise FileExistsError(
            f"--work {work} holds a checkpoint; pass --resume to continue it, or use another --work"
        )


def stop_reason(step: int, cfg: TrainConfig, opts: RunOptions) -> str:
    if step == cfg.steps:
        return "schedule"
    return "--stop-at" if step == opts.stop_at else "--minutes budget"


def train(cfg: TrainConfig, opts: RunOptions) -> dict:
    """Run the whole recipe; returns train_log.json's contents. See the module docstring."""
    budget = Budget(time.perf_counter(), opts.minutes * 60)
    if not 0 < (opts.stop_at or cfg.steps) <= cfg.steps:
        raise ValueError(f"--stop-at={opts.stop_at} must be in [1, --steps={cfg.steps}]")
    check_paths(opts.out, opts.work, opts.resume)
    corpus = load_corpus(opts.corpus)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    try:
        return _train(cfg, opts, corpus, budget)
    finally:
        torch.set_num_threads(threads_before)  # a library call leaves the process as it was


def _train(cfg: TrainConfig, opts: RunOptions, corpus: Corpus, budget: Budget) -> dict:
    """The recipe after its inputs were checked, with torch set to opts.threads."""
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as scratch:
        if opts.work is not None:
            opts.work.mkdir(parents=True, exist_ok=True)
        tok_path = (opts.work or Path(scratch)) / "tokenizer.model"
        if opts.init_from is not None and not opts.resume:
            shutil.copyfile(opts.init_from / "tokenizer.model", tok_path)
        elif not opts.resume:
            train_tokenizer(corpus, cfg.vocab, cfg.tokenizer_lines, cfg.seed, tok_path)
        data = build_streams(corpus, tok_path, cfg.seq)
        model, gen = new_model(cfg), torch.Generator().manual_seed(cfg.seed)
        init = load_init(model, cfg, opts.init_from) if opts.init_from is not None else None
        opt = new_optimizer(model, cfg)
        progress = {"step": 0, "tokens_seen": 0, "train_loss": None, "evals": []}
        if opts.resume:
            progress = load_checkpoint(opts.work, model, opt, gen, asdict(cfg))
            print(f"resumed from step {progress['step']} in {opts.work}", flush=True)
        start_step = progress["step"]
        train_loop(model, opt, gen, data, cfg, opts, progress, budget)
        if opts.work is not None:
            save_checkpoint(opts.work, model, opt, gen, asdict(cfg), progress)
        log = {
            "config": asdict(cfg),
            "hf_config": cfg.hf_config(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "corpus": corpus.describe(),
            "train_tokens_per_epoch": len(data.train),
            "val_tokens": data.val_windows[:, 1:].numel(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "threads": opts.threads,
            "resumed_from_step": start_step if opts.resume else None,
            "init_from": init,
            "stopped_by": stop_reason(progress["step"], cfg, opts),
            **progress,
            # Taken before the final evaluation and write (seconds more, printed below).
            "wall_seconds": round(budget.elapsed(), 1),
        }
        export(opts.out, model, cfg, tok_path, data, log)
    print(
        f"done: step {log['step']}/{cfg.steps}, val loss {log['val_loss']:.4f} "
        f"(ppl {log['val_perplexity']:.2f}), {budget.elapsed() / 60:.1f} min -> {opts.out}",
        flush=True,
    )
    return log


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m rheo_engine.train.target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, type=Path, help="new model directory (must not exist)")
    p.add_argument("--corpus", type=Path, help="folder of text files (default: the stdlib)")
    p.add_argument("--work", type=Path, help="checkpoint folder for --resume (default: none)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --work")
    p.add_argument("--minutes", type=float, default=55.0, help="wall-clock budget (default 55)")
    p.add_argument("--stop-at", type=int, help="stop (checkpoint, export) at this step")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--eval-minutes", type=float, default=5.0, help="minutes between evaluations")
    p.add_argument("--init-from", type=Path,
                   help="continue training this target directory (its weights and tokenizer; "
                   "the window --seq may be longer than its context)")  # fmt: skip
    for f in fields(TrainConfig):
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(getattr(d, f.name)),
            default=getattr(d, f.name),
            help=f"default {getattr(d, f.name)}",
        )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = vars(parse_args(argv))
    cfg = TrainConfig(**{f.name: a[f.name] for f in fields(TrainConfig)})
    return train(cfg, RunOptions(**{f.name: a[f.name] for f in fields(RunOptions)}))


if __name__ == "__main__":
    main()
