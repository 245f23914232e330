"""What ``disable_recompute`` trades on the xla backend: forward+backward time and compiled peak memory.

    PYTHONPATH=. python scripts/xla_recompute.py [--T 4096 --H 4 --K 128 --V 128 --repeats 30]

Compiles the gradient of 0.5 * sum(o^2) with respect to q, k, v, g and beta with and without
``disable_recompute``, prints XLA's buffer assignment of each (temporaries, and temporaries +
arguments + outputs as ``kdax bench memory`` counts the peak), then alternates their calls so
that a shared, noisy CPU slows both alike, and prints the median time with its quartiles.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import kdax
from kdax.bench.kda import make_inputs
from kdax.bench.measure import Timing
from kdax.ops.kda import xla


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for dim, default in (("B", 1), ("T", 4096), ("H", 4), ("K", 128), ("V", 128), ("repeats", 30)):
        p.add_argument(f"--{dim}", type=int, default=default, help=f"(default {default})")
    p.add_argument("--schedule", default="auto", help="xla.Config.schedule (default auto)")
    ns = p.parse_args()
    args = make_inputs(ns.B, ns.T, ns.H, ns.K, ns.V, jnp.float32)
    config = xla.Config(ns.schedule)
    fns = {}
    print(
        f"B={ns.B} T={ns.T} H={ns.H} K={ns.K} V={ns.V} float32, schedule {config.resolved().schedule}, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    )
    for keep in (False, True):

        def loss(*a, keep=keep):
            o = kdax.chunk_kda(*a, backend="xla", config=config, disable_recompute=keep)[0]
            return 0.5 * jnp.sum(jnp.square(o))

        compiled = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).lower(*args).compile()
        m = compiled.memory_analysis()
        peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
        print(
            f"  disable_recompute={keep!s:5}  temporaries {m.temp_size_in_bytes / 2**20:7.1f} MiB, "
            f"peak (with arguments and outputs) {peak / 2**20:7.1f} MiB"
        )
        fns[keep] = compiled
        jax.block_until_ready(compiled(*args))
    times = {keep: [] for keep in fns}
    for _ in range(ns.repeats):
        for keep, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[keep].append((time.perf_counter() - t0) * 1e3)
    for keep, ts in times.items():
        med, q25, q75 = Timing.of(ts)
        print(
            f"  disable_recompute={keep!s:5}  fwd+bwd median {med:7.1f} ms (quartiles {q25:.1f}-{q75:.1f}), "
            f"{ns.repeats} alternated runs"
        )


if __name__ == "__main__":
    main()
