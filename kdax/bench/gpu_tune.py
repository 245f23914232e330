"""``kdax bench gpu-tune``: measure the launch table of the GPU kernels (pallas_gpu.LAUNCH).

At one shape (default :data:`kdax.ops.kda.shapes.BENCHMARK`, bf16, the in-op options of
:mod:`kdax.bench.fla_compare`), first ``block_v`` and ``block_k``, then each kernel's
(num_warps, num_stages) in turn with the others at their best so far (coordinate
descent), timing forward+backward (:func:`~kdax.bench.measure.time_batches`). Logs each
trial to stderr as it goes; returns the table to put in LAUNCH.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys

from kdax.bench import flags
from kdax.ops.kda.shapes import BENCHMARK

BLOCK_V, BLOCK_K = (16, 32, 64), (16, 32, 64)
WARPS, STAGES = (1, 2, 4, 8), (1, 2, 3)


_stderr = functools.partial(print, file=sys.stderr, flush=True)


def tune(
    B=BENCHMARK.B,
    T=BENCHMARK.T,
    H=BENCHMARK.H,
    K=BENCHMARK.K,
    V=BENCHMARK.V,
    repeats=10,
    kernels=None,
    blocks=None,
    log=_stderr,
) -> dict:
    """kernels: those whose launch to sweep (default all of LAUNCH); blocks: (block_v, block_k) to
    keep instead of sweeping them. Each trial compiles forward+backward anew, so on a GPU with a
    10-minute limit per call split the sweep: blocks with kernels=(), then a few kernels at a time."""
    import jax
    import jax.numpy as jnp

    import kdax
    from kdax.bench.fla_compare import inputs
    from kdax.bench.measure import jax_batch, time_batches
    from kdax.ops.kda import pallas_gpu

    if unknown := set(kernels or ()) - set(pallas_gpu.LAUNCH):
        raise ValueError(f"kernels: expected names among {tuple(pallas_gpu.LAUNCH)}, got {sorted(unknown)}")
    q, k, v, g, beta, A_log, dt_bias = inputs(B, T, H, K, V)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g, beta)]

    def loss(*a, cfg):
        o, _ = kdax.chunk_kda(
            *a,
            A_log=jnp.asarray(A_log),
            dt_bias=jnp.asarray(dt_bias),
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            config=cfg,
        )
        return 0.5 * jnp.sum(jnp.square(o.astype(jnp.float32)))

    def measure(cfg) -> float:
        f = jax.jit(jax.grad(functools.partial(loss, cfg=cfg), argnums=tuple(range(5))))
        try:
            ms = time_batches(jax_batch(f, args), repeats).median
        except jax.errors.JaxRuntimeError as e:  # a launch that does not fit (registers, shared memory)
            log(f"  {cfg}: failed ({str(e)[:120]})")
            return float("inf")
        log(f"  block_v={cfg.block_v} block_k={cfg.block_k} launch={dict(cfg.launch)}: {ms:.3f} ms")
        return ms

    timed = {}

    def time_of(cfg) -> float:  # each configuration measured once
        if cfg not in timed:
            timed[cfg] = measure(cfg)
        return timed[cfg]

    sweep = itertools.product(BLOCK_V, BLOCK_K) if blocks is None else [blocks]
    best = min((pallas_gpu.Config(block_v=bv, block_k=bk) for bv, bk in sweep), key=time_of)
    for kernel in pallas_gpu.LAUNCH if kernels is None else kernels:
        launch = {**pallas_gpu.LAUNCH, **dict(best.launch)}
        trials = [
            dataclasses.replace(best, launch=tuple({**launch, kernel: ws}.items()))
            for ws in itertools.product(WARPS, STAGES)
        ]
        best = min(trials, key=time_of)
    shape = f"B={B} T={T} H={H} K={K} V={V} bf16"
    return {
        "shape": shape,
        "block_v": best.block_v,
        "block_k": best.block_k,
        "launch": dict(best.launch),
        "fwd_bwd_ms": timed[best],
    }


def register(sub) -> None:
    """``kdax bench gpu-tune``."""
    from kdax.ops.kda import pallas_gpu

    p = flags.command(sub, "gpu-tune", _command, "on a CUDA GPU: measure the pallas_gpu launch table (JSON)")
    flags.shape(p, **BENCHMARK.dims())
    p.add_argument(
        "--kernels",
        type=flags.names(("all", "none", *pallas_gpu.LAUNCH)),
        default=("all",),
        help="kernels whose launch to sweep (all, none, or names of pallas_gpu.LAUNCH)",
    )
    p.add_argument("--blocks", type=flags.pairs, help="block_v x block_k to keep (e.g. 32x16) instead of sweeping")
    flags.output(p, repeats=10, json_flag=False)


def _command(ns, parser) -> int:
    kernels = None if "all" in ns.kernels else [k for k in ns.kernels if k != "none"]
    blocks = None if ns.blocks is None else ns.blocks[0]
    result = tune(B=ns.B, T=ns.T, H=ns.H, K=ns.K, V=ns.V, repeats=ns.repeats, kernels=kernels, blocks=blocks)
    print(json.dumps({"meta": flags.meta(ns), "tuned": result}, indent=2))
    return 0
