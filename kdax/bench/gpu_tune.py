"""``kdax bench --gpu-tune``: measure the launch table of the GPU kernels (pallas_gpu.LAUNCH).

At one shape (default B=1, T=8192, H=16, K=V=128 bf16, the in-op options of
:mod:`kdax.bench.fla_compare`), first ``block_v`` and ``block_k``, then each kernel's
(num_warps, num_stages) in turn with the others at their best so far (coordinate
descent), timing forward+backward. Prints each trial and the table to put in LAUNCH.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

BLOCK_V, BLOCK_K = (16, 32, 64), (16, 32, 64)
WARPS, STAGES = (2, 4, 8), (1, 2, 3)


def tune(B=1, T=8192, H=16, K=128, V=128, repeats=10, log=print) -> dict:
    import jax
    import jax.numpy as jnp

    import kdax
    from kdax.bench.fla_compare import inputs
    from kdax.ops.kda import pallas_gpu

    q, k, v, g, beta, A_log, dt_bias = inputs(B, T, H, K, V)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g, beta)]

    def loss(*a):
        o, _ = kdax.chunk_kda(*a, A_log=jnp.asarray(A_log), dt_bias=jnp.asarray(dt_bias), use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, backend="pallas_gpu")  # fmt: skip
        return 0.5 * jnp.sum(jnp.square(o.astype(jnp.float32)))

    def measure(cfg) -> float:
        pallas_gpu.CONFIG = cfg
        f = jax.jit(jax.grad(loss, argnums=tuple(range(5))))  # a fresh trace: the config is read when tracing
        try:
            jax.block_until_ready(f(*args))
        except jax.errors.JaxRuntimeError as e:  # a launch that does not fit (registers, shared memory)
            log(f"  {cfg}: failed ({str(e)[:120]})")
            return float("inf")
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times)) * 1e3
        log(f"  block_v={cfg.block_v} block_k={cfg.block_k} launch={dict(cfg.launch)}: {ms:.3f} ms")
        return ms

    default, timed = pallas_gpu.CONFIG, {}

    def time_of(cfg) -> float:  # each configuration measured once
        if cfg not in timed:
            timed[cfg] = measure(cfg)
        return timed[cfg]

    try:
        best = min((pallas_gpu.Config(block_v=bv, block_k=bk) for bv, bk in itertools.product(BLOCK_V, BLOCK_K)),
                   key=time_of)  # fmt: skip
        for kernel in pallas_gpu.LAUNCH:
            launch = {**pallas_gpu.LAUNCH, **dict(best.launch)}
            trials = [dataclasses.replace(best, launch=tuple({**launch, kernel: ws}.items()))
                      for ws in itertools.product(WARPS, STAGES)]  # fmt: skip
            best = min(trials, key=time_of)
    finally:
        pallas_gpu.CONFIG = default
    shape = f"B={B} T={T} H={H} K={K} V={V} bf16"
    return {"shape": shape, "block_v": best.block_v, "block_k": best.block_k, "launch": dict(best.launch),
            "fwd_bwd_ms": timed[best]}  # fmt: skip
