"""What the benchmarks and tests measure with: wall-clock timings as a median with its
interquartile range, and relative errors. JAX is imported where used: FLA's benchmark
process times with these and never loads it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

BATCH_MS = 5.0  # length of one timed batch of back-to-back calls (:func:`time_batches`)


class Timing(NamedTuple):
    """Milliseconds: the median and the 25th and 75th percentiles of repeated measurements."""

    median: float
    q25: float
    q75: float

    @classmethod
    def of(cls, ms) -> Timing:
        return cls(*(float(np.percentile(ms, p)) for p in (50, 25, 75)))


def time_calls(fn: Callable, repeats: int, setup: Callable = tuple) -> Timing:
    """``fn(*setup())`` timed ``repeats`` times (``setup`` untimed, results blocked on), after
    one untimed call that compiles and warms up."""
    import jax

    jax.block_until_ready(fn(*setup()))
    ms = []
    for _ in range(repeats):
        args = jax.block_until_ready(setup())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ms.append(1e3 * (time.perf_counter() - t0))
    return Timing.of(ms)


def time_batches(batch: Callable[[int], float], repeats: int) -> Timing:
    """ms per call, for calls too short to time one by one (device kernels): ``batch(n)`` runs
    n back-to-back calls and returns ms per call. After two one-call warm-ups, n is chosen so
    that a batch lasts about :data:`BATCH_MS` (at most 10 calls), and ``repeats`` batches are timed."""
    for _ in range(2):
        batch(1)
    n = max(1, min(10, round(BATCH_MS / max(batch(1), 1e-3))))
    return Timing.of([batch(n) for _ in range(repeats)])


def jax_batch(f: Callable, args) -> Callable[[int], float]:
    """:func:`time_batches`'s ``batch`` for a jitted or compiled ``f(*args)``: a host clock around
    n calls and one ``block_until_ready`` at their end, so launch overhead is amortised."""
    import jax

    def batch(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        return 1e3 * (time.perf_counter() - t0) / n

    return batch


def rel_rms(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64; where ref is exactly zero (a structurally zero
    gradient, e.g. dg at T = 1 without a state) the RMS of x itself, inputs being O(1)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    norm = np.linalg.norm(ref)
    if norm == 0:
        return float(np.sqrt(np.mean(x**2))) if x.size else 0.0
    return float(np.linalg.norm(x - ref) / norm)
