"""KDA benchmark: every available backend and the naive scan on the same inputs, and peers.

Times forward and forward+backward (median over repeats, after a compile-and-warm-up
call), and the relative RMS error of each against chunk_kda's xla backend in float64 (which the
tests hold to the float64 token-by-token scan within 1e-10). Peers (:data:`PEERS`): tokamax's
KDA (``tokamax.ops.kimi_delta_attention``, Python >= 3.12: ``pip install -e ".[tpu-peers]"``),
on the same inputs moved to its ``[H, B, T, D]`` layout before the timed calls.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import resource

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import kdax
from kdax.bench import flags
from kdax.bench.measure import rel_rms, time_calls
from kdax.ops.common.dispatch import BACKENDS

GRAD_ARGS = ("q", "k", "v", "g", "beta")
PEERS = ("tokamax",)  # its Pallas Mosaic TPU kernels ("mosaic"; TPU only)


@dataclasses.dataclass
class Row:
    shape: str
    backend: str
    mode: str  # "fwd" or "fwd+bwd"
    median_ms: float
    iqr_ms: tuple[float, float]  # 25th and 75th percentiles
    speedup_vs_naive: float | None
    rel_err: float | None  # vs float64 reference: o for fwd, worst gradient for fwd+bwd


def make_inputs(B, T, H, K, V, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V))
    g = rng.uniform(-1.0, -0.01, (B, T, H, K))
    beta = rng.uniform(0.0, 1.0, (B, T, H))
    return [jnp.asarray(x, dtype) for x in (q, k, v, g, beta)]


def _loss_and_grad(op):
    def loss(*a):  # cotangent do = o: as cheap as it gets, and not structured
        return 0.5 * jnp.sum(jnp.square(op(*a).astype(jnp.float32)))

    return jax.jit(op), jax.jit(jax.grad(loss, argnums=tuple(range(5))))


def _fns(backend: str, chunk_size: int):
    if backend == "naive":
        op = lambda *a: kdax.naive_recurrent_kda(*a)[0]
    else:
        op = lambda *a: kdax.chunk_kda(*a, chunk_size=chunk_size, backend=backend)[0]
    return _loss_and_grad(op)


def _peer(name: str, args, implementation: str = "mosaic"):
    """(fwd, fwd+bwd, its inputs, a map of its outputs to kdax's layout) of peer ``name``: tokamax's
    KDA with ``implementation`` ("mosaic", its TPU kernels; "xla", its token recurrence)."""
    if name not in PEERS:
        raise ValueError(f"peers: expected names from {PEERS}, got {name!r}")
    import tokamax  # the command checks it is installed (_table)

    op = lambda *a: tokamax.ops.kimi_delta_attention(*a, implementation=implementation)[0]
    heads_first = [jnp.moveaxis(x, 2, 0) for x in args]  # [B, T, H, ...] -> [H, B, T, ...]
    back = lambda x: np.moveaxis(np.asarray(x), 0, 2)
    return *_loss_and_grad(op), heads_first, lambda out: jax.tree.map(back, out)


def run(
    B=1,
    T=1024,
    H=4,
    K=64,
    V=64,
    dtype="float32",
    chunk_size=64,
    backends=("xla", "naive"),
    repeats=5,
    check_error=True,
    progress=True,
    peers=(),
    tokamax_implementation="mosaic",
) -> list[Row]:
    """Benchmark the given backends and peers (:data:`PEERS`) on one shape; returns one Row per
    backend or peer and mode. ``tokamax_implementation``: tokamax's "mosaic" (TPU) or "xla"."""
    args = make_inputs(B, T, H, K, V, jnp.dtype(dtype))
    shape = f"B={B} T={T} H={H} K={K} V={V} {dtype}"
    ref_o = ref_g = None
    same = lambda out: jax.tree.map(np.asarray, out)
    runs = [(b, *_fns(b, chunk_size), args, same) for b in backends]
    runs += [(p, *_peer(p, args, tokamax_implementation)) for p in peers]
    steps = len(runs) * 2 + (1 if check_error else 0)
    bar = tqdm(total=steps, desc="kdax bench", disable=not progress, leave=False)
    timings, rows, outputs = {}, [], {}
    for backend, fwd, bwd, inputs, to_kdax in runs:
        for mode, f in (("fwd", fwd), ("fwd+bwd", bwd)):
            bar.set_postfix_str(f"{backend} {mode}: compiling, then {repeats} timed calls")
            med, p25, p75 = time_calls(functools.partial(f, *inputs), repeats)
            timings[backend, mode] = med
            if check_error:
                outputs[backend, mode] = to_kdax(f(*inputs))
            rows.append(Row(shape, backend, mode, med, (p25, p75), None, None))
            bar.update()
    if check_error:  # the chunked form in float64: the float64 scan's gradient would store a state a token
        bar.set_postfix_str("float64 reference (chunk_kda xla in float64): compiling and running")
        with jax.enable_x64(True):
            a64 = [jnp.asarray(a, jnp.float64) for a in args]
            fwd64, bwd64 = _fns("xla", chunk_size)
            ref_o, ref_g = np.asarray(fwd64(*a64)), [np.asarray(x) for x in bwd64(*a64)]
        for r in rows:
            out = outputs[r.backend, r.mode]
            r.rel_err = rel_rms(out, ref_o) if r.mode == "fwd" else max(rel_rms(a, b) for a, b in zip(out, ref_g))
        bar.update()
    bar.close()
    for r in rows:
        naive = timings.get(("naive", r.mode))
        r.speedup_vs_naive = naive / r.median_ms if naive else None
    return rows


def peak_memory(B=1, T=65536, H=4, K=128, V=128, chunk_size=64, run_xla=True) -> dict:
    """Peak device memory of forward+backward, from XLA's buffer assignment, for the xla
    backend and jax.grad of the naive scan; optionally runs the xla one and reports the
    process's peak resident set size."""
    args = make_inputs(B, T, H, K, V, jnp.float32)
    out = {"shape": f"B={B} T={T} H={H} K={K} V={V} float32"}
    for backend in ("xla", "naive"):
        _, bwd = _fns(backend, chunk_size)
        m = bwd.lower(*args).compile().memory_analysis()
        total = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
        out[f"{backend}_peak_gb"] = total / 2**30
    if run_xla:
        _, bwd = _fns("xla", chunk_size)
        jax.block_until_ready(bwd(*args))
        out["xla_process_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def format_table(rows: list[Row]) -> str:
    """The rows as a markdown table, with a legend saying what each column measures."""
    head = (
        "shape",
        "backend",
        "pass (fwd / fwd+bwd)",
        "median ms (IQR)",
        "x faster than the naive scan",
        "rel. RMS error vs float64",
    )
    lines = [
        (
            r.shape,
            r.backend,
            r.mode,
            f"{r.median_ms:.2f} ({r.iqr_ms[0]:.2f}-{r.iqr_ms[1]:.2f})",
            "-" if r.speedup_vs_naive is None else f"{r.speedup_vs_naive:.2f}x",
            "-" if r.rel_err is None else f"{r.rel_err:.2e}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    fmt = lambda cols: "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    legend = (
        "fwd: o = chunk_kda(q, k, v, g, beta); fwd+bwd: o and the gradients of 0.5 * sum(o^2) with respect to\n"
        "q, k, v, g, beta. Times: wall-clock medians (interquartile range) after a first call that compiles.\n"
        "Error: ||x - x_float64|| / ||x_float64|| for o (fwd) and for the worst of the five gradients (fwd+bwd),\n"
        "against chunk_kda(backend='xla') in float64 on the same inputs (within 1e-10 of the float64 token scan)."
    )
    return "\n".join([fmt(head), sep] + [fmt(x) for x in lines] + ["", legend])


DEFAULT_SHAPE = {"B": 1, "T": 4096, "H": 4, "K": 128, "V": 128}


def register(sub) -> None:
    """``kdax bench kda`` (the default) and ``kdax bench memory``."""
    p = flags.command(sub, "kda", _table, "time chunk_kda's backends against the naive token scan (the default)")
    flags.shape(p, **DEFAULT_SHAPE)
    p.add_argument("--dtype", default="float32", choices=flags.DTYPES, help="input dtype")
    p.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64, 128), help="chunk_size of chunk_kda")
    p.add_argument("--backends", type=flags.names(BACKENDS), default=("xla", "naive"), help="backends to time")
    p.add_argument("--peers", type=flags.names(PEERS), default=(), help="peers to time beside them (module docstring)")
    p.add_argument("--no-error", action="store_true", help="skip the float64 reference")
    flags.output(p, repeats=5)
    m = flags.command(
        sub, "memory", _memory, "peak memory of chunk_kda forward+backward (xla) and of the naive scan's gradient"
    )
    flags.shape(m, B=1, T=65536, H=4, K=128, V=128)
    m.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64, 128), help="chunk_size of chunk_kda")


def _table(ns, parser) -> int:
    if "tokamax" in ns.peers and importlib.util.find_spec("tokamax") is None:
        parser.error("--peers: tokamax is not installed (Python >= 3.12: pip install -e '.[tpu-peers]')")
    if "tokamax" in ns.peers and jax.default_backend() != "tpu":
        parser.error(f"--peers: tokamax's Mosaic kernels need a TPU, this process runs on {jax.default_backend()}")
    shape = {d: getattr(ns, d) for d in DEFAULT_SHAPE}
    rows = run(
        **shape,
        dtype=ns.dtype,
        chunk_size=ns.chunk_size,
        backends=ns.backends,
        repeats=ns.repeats,
        check_error=not ns.no_error,
        progress=not ns.json,
        peers=ns.peers,
    )
    auto, why = kdax.explain_backend(jnp.dtype(ns.dtype), ns.chunk_size)
    lines = []
    if shape == DEFAULT_SHAPE:
        lines += [
            "# The default shape, T = 4096 with head dims 128: long enough that the chunked form's",
            "# matmuls beat the token-by-token scan (at T = 1024, K = V = 64 its forward is not faster).",
        ]
    lines += [f"# backend='auto' runs {auto!r} here: {why}", format_table(rows)]
    return flags.emit(ns, flags.meta(ns), "rows", [dataclasses.asdict(r) for r in rows], "\n".join(lines))


def _memory(ns, parser) -> int:
    memory = peak_memory(B=ns.B, T=ns.T, H=ns.H, K=ns.K, V=ns.V, chunk_size=ns.chunk_size)
    print(json.dumps({"meta": flags.meta(ns), "memory": memory}, indent=2))
    return 0
