"""The settings of a head training run (shared by head.py and head_loop.py, which import it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_STORE = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# The settings that decide the generated data (kept in --work/data.json for reuse).
_DATA_FIELDS = ("feature_layers", "samples", "gen_len", "prompt_len", "seed", "store_dtype",
                "chat")  # fmt: skip


@dataclass(frozen=True)
class HeadTrainConfig:
    """Everything that determines the trained head (a resumed run must match it exactly)."""

    feature_layers: tuple[int, ...] = ()  # target layers fused by fc; () = EAGLE's (2, N//2, N-3)
    draft_vocab: int = 0  # Vd; 0 = the full target vocabulary (d2t all zeros)
    unroll: int = 4  # U, training-time-test steps (tree levels 0..U-1)
    samples: int = 1536  # sequences generated (1/16 held out, at least 1)
    gen_len: int = 224  # tokens sampled per sequence
    prompt_len: int = 16  # tokens per corpus prompt, BOS included (1 without --corpus)
    batch: int = 16  # sequences per step
    lr: float = 4e-3  # peak learning rate
    min_lr_ratio: float = 0.05  # the cosine ends at lr * min_lr_ratio
    warmup: int = 40  # linear warm-up steps
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # as EAGLE-3
    step_decay: float = 0.8  # loss weight of unroll step s = step_decay ** s (EAGLE-3)
    max_steps: int = 0  # 0 = as many as --minutes allows
    seed: int = 0
    store_dtype: str = "float16"  # features and states in memory (bfloat16 for wide ranges)
    chat: bool = False  # prompts in the target's chat template (head_data.chat_prompts)

    def __post_init__(self) -> None:
        for name in ("unroll", "samples", "gen_len", "prompt_len", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.samples < 2:
            raise ValueError(f"--samples={self.samples} must be >= 2 (one is held out)")
        if min(self.draft_vocab, self.warmup, self.max_steps) < 0:
            raise ValueError("--draft-vocab, --warmup and --max-steps must be >= 0")
        if not (self.lr > 0 and 0 < self.min_lr_ratio <= 1 and self.grad_clip > 0):
            raise ValueError(
                f"need --lr={self.lr} > 0, 0 < --min-lr-ratio={self.min_lr_ratio} <= 1 and "
                f"--grad-clip={self.grad_clip} > 0"
            )
        if self.store_dtype not in _STORE:
            raise ValueError(f"--store-dtype={self.store_dtype!r} is not one of {list(_STORE)}")

    @property
    def val_samples(self) -> int:
        return max(1, self.samples // 16)
