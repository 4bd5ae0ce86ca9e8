"""Small frozen configs; each bad value raises ValueError saying how to fix it (STYLE.md §6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Method = Literal["ar", "topk", "rrsw", "rheo"]
METHODS: tuple[str, ...] = ("ar", "topk", "rrsw", "rheo")


@dataclass(frozen=True)
class TreeConfig:
    """How the draft tree is grown (DESIGN.md §2.2). Defaults are the paper's setting."""

    method: Method = "rheo"
    topk: int = 10  # nodes expanded per level; also K, the pool size per node
    depth: int = 8  # levels grown below the root
    total_tokens: int = 60  # tree size after global pruning, root included
    leads: int = 1  # m, the rheostat
    support: int = 128  # S, sparse draft support

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {list(METHODS)}; pick one")
        if self.method == "ar":
            return
        if self.topk < 1:
            raise ValueError(f"topk={self.topk} must be >= 1 (nodes expanded per level)")
        if self.depth < 1:
            raise ValueError(f"depth={self.depth} must be >= 1 (levels below the root)")
        if self.total_tokens < 1:
            raise ValueError(f"total_tokens={self.total_tokens} must be >= 1 (the root counts)")
        if self.total_tokens > self.max_tree_size():
            raise ValueError(
                f"total_tokens={self.total_tokens} > {self.max_tree_size()} = 1 + topk + "
                f"(depth - 1) * topk^2 nodes the draft can grow with topk={self.topk}, "
                f"depth={self.depth}; lower total_tokens or raise depth/topk"
            )
        if not 0 <= self.leads < self.topk:
            raise ValueError(
                f"leads={self.leads} must be in [0, topk={self.topk}) so the sampled slot fits "
                "in the pool; lower leads"
            )
        if self.support < self.topk:
            raise ValueError(
                f"support={self.support} < topk={self.topk}: the pool needs K draft tokens in "
                "the support; raise support"
            )

    def max_tree_size(self) -> int:
        return 1 + self.topk + (self.depth - 1) * self.topk * self.topk


@dataclass(frozen=True)
class SamplingConfig:
    """How the target distribution p is processed: temperature, then top-k, then top-p."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature={self.temperature} must be a finite number >= 0 (0 = greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0; use 0 to disable")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
