"""The optimisation loop of head.py: loss, schedule, evaluation, checkpoints.

Loss of unroll step s at index p: KL(p_target || q_head) of token p+2+s, where p_target is the
target's softmax at that position (its logits recomputed from the stored final state), restricted
to the draft vocabulary and renormalised when Vd < V; positions past a sequence's end, and (Vd < V)
those whose target argmax is outside the draft vocabulary, are masked, as EAGLE-3 does with t2d
(docs/eagle3_format.md §6). Steps weigh step_decay ** s. Accuracy: head argmax == target argmax.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F

from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.models.eagle3 import HeadConfig, init_head_weights
from rheo_engine.models.llama import LlamaModel
from rheo_engine.train.checkpoint import Budget
from rheo_engine.train.head_config import HeadTrainConfig
from rheo_engine.train.head_data import HeadData
from rheo_engine.train.head_model import TrainableHead

PLAN_AT = (10, 50)  # steps at which the schedule's length is (re)fixed from the measured speed
CHECKPOINT_SECONDS = 120.0  # between checkpoints in --work


class Trainer:
    """Model, optimiser, data sampler and progress of one head-training run."""

    def __init__(self, cfg: HeadTrainConfig, hcfg: HeadConfig, target: LlamaModel,
                 used: torch.Tensor, train: HeadData, val: HeadData,
                 device: str) -> None:  # fmt: skip
        self.cfg, self.hcfg, self.device = cfg, hcfg, torch.device(device)
        self.train_data, self.val_data = train, val
        self.lm_target = target.lm_head.to(self.device, torch.float32)  # [V, hidden]
        self._set_vocabulary(used)
        # The head's matmuls in bf16 (fp32 master weights, fp32 loss) where the CPU runs bf16
        # GEMMs faster (AVX-512-BF16 / AMX: ~2.5x); None = fp32 throughout.
        self.autocast: torch.dtype | None = None
        self.model = TrainableHead(hcfg, target.embed_tokens.to(self.device))
        w = init_head_weights(hcfg, cfg.seed)  # normal(0, 0.02) matrices, unit norms
        self.model.load_state_dict({k: v for k, v in w.items() if k not in ("d2t", "t2d")})
        self.model.to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)  # fmt: skip
        self.gen = torch.Generator().manual_seed(cfg.seed)  # which sequences form each batch
        self.progress: dict = {"step": 0, "planned_steps": cfg.max_steps or None,
                               "train_seconds": 0.0, "train": []}  # fmt: skip

    def _set_vocabulary(self, used: torch.Tensor) -> None:
        """The draft vocabulary: ``used`` [Vd] ascending target ids (row j of the head's
        lm_head is target id used[j])."""
        self.used = used.to(self.device)
        self.t2d = torch.zeros(len(self.lm_target), dtype=torch.bool, device=self.device)  # [V]
        self.t2d[self.used] = True
        self.lm_used = self.lm_target[self.used].contiguous()  # [Vd, hidden]

    # --- loss ------------------------------------------------------------------------------

    def _targets(self, hidden: torch.Tensor, argmax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """hidden [B, T, hidden] -> target log-probs [B, T, Vd], argmax as a draft id [B, T],
        usable [B, T] (argmax inside the draft vocabulary). With the target's full-vocabulary
        ``argmax`` [B, T] known (head_features keeps it), only the Vd draft rows are computed."""
        if argmax is not None and len(self.used) < len(self.lm_target):
            sub = F.linear(hidden.float(), self.lm_used)  # [B, T, Vd]
            return sub.log_softmax(-1), sub.argmax(-1), self.t2d[argmax]
        logits = F.linear(hidden.float(), self.lm_target)  # [B, T, V]
        if len(self.used) == len(self.lm_target):
            everywhere = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)
            return logits.log_softmax(-1), logits.argmax(-1), everywhere
        usable = self.t2d[logits.argmax(-1)]
        sub = logits[..., self.used]  # [B, T, Vd]
        return sub.log_softmax(-1), sub.argmax(-1), usable

    def losses(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[dict]]:
        """The weighted training loss and, per unroll step, sums of KL, hits and positions."""
        tokens, features, hidden, lengths = batch[:4]
        B, T = tokens.shape
        n = T - 1
        logp_t, arg_t, usable = self._targets(hidden, batch[4] if len(batch) > 4 else None)
        with torch.autocast(self.device.type, self.autocast or torch.bfloat16, enabled=bool(self.autocast)):
            drafts = self.model(features, tokens, self.cfg.unroll)  # U x [B, n, Vd]
        # KL(p || q) = sum p log p - sum p log q: the first term once per position; the target
        # rows of step s are a view of the padded target (index p + 1 + s; past the end masked).
        U = self.cfg.unroll
        p_t = F.pad(logp_t.exp(), (0, 0, 0, U))  # [B, T + U, Vd]
        neg_entropy = F.pad((p_t[:, :T] * logp_t).sum(-1), (0, U))  # [B, T + U]
        arg_t, usable = F.pad(arg_t, (0, U)), F.pad(usable, (0, U))
        total = torch.zeros((), device=self.device)
        stats = []
        for s, logits in enumerate(drafts):
            at = torch.arange(n, device=self.device) + 1 + s  # [n] where token p+2+s is predicted
            valid = (at < lengths.unsqueeze(1)) & usable[:, 1 + s : 1 + s + n]  # [B, n]
            logq = logits.log_softmax(-1)
            kl = neg_entropy[:, 1 + s : 1 + s + n] - (p_t[:, 1 + s : 1 + s + n] * logq).sum(-1)
            count = valid.sum()
            kl_sum = (kl * valid).sum()
            total = total + self.cfg.step_decay**s * kl_sum / count.clamp(min=1)
            hits = ((logq.argmax(-1) == arg_t[:, 1 + s : 1 + s + n]) & valid).sum()
            stats.append({"kl": kl_sum.detach(), "hits": hits, "count": count})
        return total, stats

    def _batch(self, data: HeadData, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dev = self.device
        return (data.tokens[rows].to(dev), data.features[rows].to(dev, torch.float32),
                data.hidden[rows].to(dev), data.lengths[rows].to(dev))  # fmt: skip

    # --- schedule and loop -------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then a cosine to lr * min_lr_ratio at the planned last step."""
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        total = self.progress["planned_steps"]
        if total is None:
            return c.lr
        frac = min(1.0, (step - c.warmup) / max(1, total - c.warmup))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    def reserve(self, seconds_per_step: float) -> float:
        """Seconds kept for the final evaluation (forward only: ~1/2 step a batch) and saving."""
        return 5.0 + seconds_per_step * len(self.val_data.tokens) / self.cfg.batch / 2

    def _plan(self, budget: Budget, seconds_per_step: float) -> None:
        """Fix the schedule's length: the steps that fit, keeping time for the evaluation."""
        room = budget.left() - self.reserve(seconds_per_step)
        fits = self.progress["step"] + int(room / seconds_per_step)
        self.progress["planned_steps"] = max(self.cfg.warmup + 1, fits)
        print(f"plan: {self.progress['planned_steps']} steps at {seconds_per_step:.3f} s/step",
              flush=True)  # fmt: skip

    def train_step(self, batch: tuple[torch.Tensor, ...] | None = None) -> list[dict]:
        """One optimiser step on ``batch``, or on cfg.batch random training sequences."""
        step = self.progress["step"]
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        if batch is None:
            rows = torch.randint(len(self.train_data.tokens), (self.cfg.batch,),
                                 generator=self.gen)  # fmt: skip
            batch = self._batch(self.train_data, rows)
        loss, stats = self.losses(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.progress["step"] = step + 1
        return stats

    def run(self, budget: Budget, work: Path | None, log_every: int) -> None:
        """Steps until the planned last step, or until the budget (minus evaluation) runs out."""
        first, t0 = self.progress["step"], time.perf_counter()
        last_ckpt, window, t1 = t0, Window(self.cfg.unroll), t0
        planning = self.progress["planned_steps"] is None
        while self.progress["step"] < (self.progress["planned_steps"] or math.inf):
            done = self.progress["step"] - first
            # Seconds per step, after the first (slower: allocations, warm caches).
            per_step = (time.perf_counter() - (t1 if done > 1 else t0)) / max(1, done - 1)
            if budget.left() < (self.reserve(per_step) + per_step if done else 0.0):
                if done == 0:
                    raise TimeoutError(
                        f"--minutes={budget.seconds / 60:g} ran out after {budget.elapsed():.1f} s "
                        "(loading, data generation) before the first training step; raise "
                        "--minutes or lower --samples (nothing was written)"
                    )
                break
            window.add(self.train_step())
            t1 = t1 if done else time.perf_counter()
            if planning and done + 1 in PLAN_AT:
                self._plan(budget, (time.perf_counter() - t1) / done)
            if self.progress["step"] % log_every == 0:
                self.progress["train"].append(window.line(self, budget))
            if work is not None and time.perf_counter() - last_ckpt > CHECKPOINT_SECONDS:
                self.save(work)
                last_ckpt = time.perf_counter()
        self.progress["train_seconds"] += time.perf_counter() - t0
        if work is not None:
            self.save(work)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-step top-1 accuracy and mean KL on the held-out sequences."""
        self.model.eval()
        window = Window(self.cfg.unroll)
        for rows in torch.arange(len(self.val_data.tokens)).split(self.cfg.batch):
            window.add(self.losses(self._batch(self.val_data, rows))[1])
        self.model.train()
        return window.summary()

    # --- weights and checkpoints -------------------------------------------------------------

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Official head tensors (fp32) plus d2t (offsets) and t2d (docs/eagle3_format.md §6)."""
        w = {k: v.float().cpu() for k, v in self.model.head_weights().items()}
        used = self.used.cpu()
        w["d2t"] = used - torch.arange(len(used))
        w["t2d"] = self.t2d.cpu()
        return w

    def save(self, work: Path) -> None:
        tensors = {f"model.{k}": v.cpu() for k, v in self.model.state_dict().items()}
        params = list(self.model.parameters())
        for i, p in enumerate(params):
            for key, value in self.opt.state.get(p, {}).items():
                tensors[f"opt.{i}.{key}"] = (value.reshape(-1) if key == "step" else value).cpu()
        tensors["rng"] = self.gen.get_state()
        tensors["used"] = self.used.cpu()  # the vocabulary the lm_head rows stand for
        meta = {"config": jsonable(self.cfg), **self.progress}
        save_safetensors(tensors, work / "ckpt.safetensors.tmp")
        (work / "ckpt.json.tmp").write_text(json.dumps(meta, indent=1))
        # Tensors first, JSON last: a ckpt.json always describes a complete ckpt.safetensors.
        os.replace(work / "ckpt.safetensors.tmp", work / "ckpt.safetensors")
        os.replace(work / "ckpt.json.tmp", work / "ckpt.json")

    def load(self, work: Path) -> None:
        """Continue a checkpoint of the same settings (see check_resumable)."""
        meta = check_resumable(work, self.cfg)
        tensors = load_safetensors(work / "ckpt.safetensors")
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        for i, p in enumerate(self.model.parameters()):
            keys = [k for k in tensors if k.startswith(f"opt.{i}.")]
            self.opt.state[p] = {k.split(".", 2)[2]: tensors[k].reshape(()) if k.endswith(".step")
                                 else tensors[k].to(self.device) for k in keys}  # fmt: skip
        self.gen.set_state(tensors["rng"])
        if "used" in tensors and not torch.equal(tensors["used"], self.used.cpu()):
            # More data can change which tokens are the most frequent: the checkpoint's rows
            # keep their own vocabulary.
            self._set_vocabulary(tensors["used"])
            print(f"resume: the checkpoint's draft vocabulary kept ({len(self.used)} ids)",
                  flush=True)  # fmt: skip
        self.progress = {k: meta[k] for k in self.progress}
        if self.cfg.max_steps:
            self.progress["planned_steps"] = self.cfg.max_steps
        print(f"resumed from step {self.progress['step']} in {work}", flush=True)


def check_resumable(work: Path, cfg: HeadTrainConfig) -> dict:
    """The checkpoint's JSON, when it was made with ``cfg``'s settings (--max-steps may grow)."""
    meta = json.loads((work / "ckpt.json").read_text())
    now = jsonable(cfg)
    diff = {k: (meta["config"].get(k), v) for k, v in now.items()
            if k != "max_steps" and meta["config"].get(k) != v}  # fmt: skip
    if diff:
        raise ValueError(
            f"--resume: the checkpoint in {work} was made with other settings "
            f"(name: (checkpoint, now)) {diff}; pass the checkpoint's values or start afresh"
        )
    return meta


def jsonable(cfg: HeadTrainConfig) -> dict:
    return {f.name: list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v
            for f in fields(cfg)}  # fmt: skip


class Window:
    """Sums of KL, hits and positions per unroll step over some batches."""

    def __init__(self, unroll: int) -> None:
        self.kl, self.hits, self.count = [0.0] * unroll, [0] * unroll, [0] * unroll
        self.start = time.perf_counter()

    def add(self, stats: list[dict]) -> None:
        for s, st in enumerate(stats):
            self.kl[s] += float(st["kl"])
            self.hits[s] += int(st["hits"])
            self.count[s] += int(st["count"])

    def summary(self) -> dict:
        def mean(sums: list) -> list[float]:
            return [round(x / max(1, c), 4) for x, c in zip(sums, self.count, strict=True)]

        return {"loss": mean(self.kl), "acc": mean(self.hits), "positions": list(self.count)}

    def line(self, trainer: Trainer, budget: Budget) -> dict:
        """Print one progress line for the batches since the last one, then start afresh."""
        s, p = self.summary(), trainer.progress
        total = p["planned_steps"] or "?"
        print(f"step {p['step']:5d}/{total} | loss {' '.join(f'{x:.3f}' for x in s['loss'])} | "
              f"acc {' '.join(f'{x:.3f}' for x in s['acc'])} | lr {trainer.lr_at(p['step']):.2e} | "
              f"{budget.elapsed() / 60:5.1f} min", flush=True)  # fmt: skip
        self.__init__(len(self.kl))
        return {"step": p["step"], **s, "minutes": round(budget.elapsed() / 60, 2)}
