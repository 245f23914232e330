"""Time the xla backend against its own code at another git revision, in one process.

    PYTHONPATH=. python scripts/xla_ab.py --against HEAD~1 [--T 4096 --H 4 --K 128 --V 128 --repeats 30]

Loads kdax/ops/kda/xla.py as it was at ``--against`` beside today's, compiles the forward and
forward+backward of both on the same inputs, and alternates their calls so that a shared,
noisy CPU slows both alike. Prints the median time of each with its interquartile range.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import kdax
from kdax.bench.kda import make_inputs
from kdax.bench.measure import Timing
from kdax.ops.kda import api, xla


def _module_at(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:kdax/ops/kda/xla.py"], capture_output=True, text=True, check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src.stdout)
    spec = importlib.util.spec_from_file_location("xla_at_rev", f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="git revision to compare with")
    for dim, default in (("B", 1), ("T", 4096), ("H", 4), ("K", 128), ("V", 128), ("repeats", 30)):
        p.add_argument(f"--{dim}", type=int, default=default, help=f"(default {default})")
    ns = p.parse_args()
    args = make_inputs(ns.B, ns.T, ns.H, ns.K, ns.V, jnp.float32)
    fns = {}
    ours = xla.chunk_kda_xla
    for name, mod in ((ns.against, _module_at(ns.against)), ("working tree", xla)):
        core = mod.chunk_kda_xla  # read when chunk_kda is traced, just below; older ones take fewer keywords
        params = inspect.signature(core).parameters  # (cfg, disable_recompute, ...: all at their defaults here)
        xla.chunk_kda_xla = lambda *a, core=core, params=params, **kw: core(*a, **{n: kw[n] for n in kw if n in params})
        api._compiled.clear_cache()  # so it is traced again
        op = lambda *a: kdax.chunk_kda(*a, backend="xla")[0]
        loss = lambda *a, op=op: 0.5 * jnp.sum(jnp.square(op(*a)))
        fns[name] = {"fwd": jax.jit(op), "fwd+bwd": jax.jit(jax.grad(loss, argnums=tuple(range(5))))}
        for f in fns[name].values():
            jax.block_until_ready(f(*args))
    xla.chunk_kda_xla = ours
    times = {(n, m): [] for n in fns for m in ("fwd", "fwd+bwd")}
    for _ in range(ns.repeats):
        for (n, m), ts in times.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fns[n][m](*args))
            ts.append((time.perf_counter() - t0) * 1e3)
    print(
        f"B={ns.B} T={ns.T} H={ns.H} K={ns.K} V={ns.V} float32, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, {ns.repeats} alternated runs"
    )
    for m in ("fwd", "fwd+bwd"):
        med = {}
        for n in fns:
            med[n], q25, q75 = Timing.of(times[(n, m)])
            print(f"  {m:8s} {n:14s} median {med[n]:7.1f} ms (IQR {q25:.1f}-{q75:.1f})")
        print(f"  {m:8s} ratio {med['working tree'] / med[ns.against]:.3f}")


if __name__ == "__main__":
    main()
