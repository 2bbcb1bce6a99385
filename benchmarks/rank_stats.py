"""Rank statistics of the benchmarks that judge the cost model by its orderings
(``ranking.py``, ``cost_model_accuracy.py``)."""
from __future__ import annotations

import math


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of ``xs``, ties given the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks (ties averaged); NaN when either
    side has one distinct value or fewer than two points."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} predicted against {len(ys)} measured values")
    if len(xs) < 2:
        return math.nan
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)
