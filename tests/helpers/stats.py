"""Chi-square tests without scipy: the survival function is torch's regularized upper
incomplete gamma."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch


def chi2_sf(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit(samples: Sequence[int], probs: Sequence[float], min_expected: float = 5.0) -> float:
    """p-value of `samples` being draws from `probs` (categories with a small expected
    count are pooled into one)."""
    n = len(samples)
    counts = Counter(samples)
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for token, p in enumerate(probs):
        expected = n * p
        if expected < min_expected:
            pooled_obs += counts.get(token, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(token, 0) - expected) ** 2 / expected
        dof += 1
    outside = sum(c for t, c in counts.items() if not 0 <= t < len(probs) or probs[t] == 0.0)
    assert outside == 0, f"{outside} samples fell where the distribution has no mass"
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    return chi2_sf(stat, max(dof, 1))


def two_sample(a: Sequence, b: Sequence, min_count: int = 10) -> float:
    """p-value of two equally sized samples coming from one distribution (chi-square
    test of homogeneity; rare categories pooled)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    stat, dof, pa, pb = 0.0, -1, 0, 0
    for key in set(ca) | set(cb):
        x, y = ca.get(key, 0), cb.get(key, 0)
        if x + y < min_count:
            pa, pb = pa + x, pb + y
            continue
        stat += _cell(x, y, na, nb)
        dof += 1
    if pa + pb:
        stat += _cell(pa, pb, na, nb)
        dof += 1
    return chi2_sf(stat, max(dof, 1))


def _cell(x: int, y: int, na: int, nb: int) -> float:
    total = x + y
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    return (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
