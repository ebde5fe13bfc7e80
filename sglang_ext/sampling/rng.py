"""Counter-based random numbers for sampling: one uniform per sampled token.

A seeded request's k-th output token uses `uniform(seed, k)`, a pure function of the two (a
SplitMix64-style hash, vectorised in numpy, whose uint64 arithmetic wraps by definition). The token
is then drawn by inverting the row's filtered CDF with that number, so a seeded request gets the
same tokens whatever else shares its batch, on CPU and GPU alike. Unseeded rows take their numbers
from the worker's own generator (Philox, keyed by the server's random_seed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """uniform(seed_i, counter_i) in [0, 1) as float64, 53 random bits each."""
    s = np.asarray(seeds, dtype=np.uint64)
    c = np.asarray(counters, dtype=np.uint64)
    h = _mix(s ^ _mix(c))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class RowRandom:
    """Uniforms for a batch of rows: per-row counters for seeded rows, the worker's stream otherwise."""

    def __init__(self, seed: int) -> None:
        self.gen = np.random.Generator(np.random.Philox(seed))

    def uniforms(self, seeds: Sequence[int | None], counters: Sequence[int]) -> np.ndarray:
        out = self.gen.random(len(seeds))
        idx = [i for i, s in enumerate(seeds) if s is not None]
        if idx:
            out[idx] = seeded_uniforms([seeds[i] for i in idx], [counters[i] for i in idx])  # type: ignore[misc]
        return out
