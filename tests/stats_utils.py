"""Goodness-of-fit helpers for the stochastic tests (no scipy needed)."""

from __future__ import annotations

import math

import torch


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma."""
    if df <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2.0, dtype=torch.float64),
            torch.tensor(stat / 2.0, dtype=torch.float64),
        )
    )


def g_test(
    counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
) -> tuple[float, float]:
    """G-test of observed ``counts`` against exact ``probs`` (same shape); returns (G, p-value).

    Cells whose expected count is below ``min_expected`` are pooled into one cell. A count in a
    cell of probability 0 gives p-value 0 (an impossible outcome was seen).
    """
    counts = counts.flatten().to(torch.float64)
    probs = probs.flatten().to(torch.float64)
    n = counts.sum()
    if bool(((probs <= 0) & (counts > 0)).any()):
        return math.inf, 0.0
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    nz = obs > 0
    G = 2.0 * float((obs[nz] * torch.log(obs[nz] / exp[nz])).sum())
    return G, chi2_sf(G, int(keep.sum()) - 1)
