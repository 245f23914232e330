"""``kdax bench kascade``: per-layer time of dense, anchor and reuse attention layers, prefill
and decode, each against the dense baseline (``jax.nn.dot_product_attention``) on the same inputs
in the same run, with errors against the float64 reference where it fits in memory, and the
schedule-weighted average of a 32-layer model with 5 anchors."""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import kdax
from kdax.bench import flags
from kdax.bench.measure import rel_rms, time_calls
from kdax.ops.common.dispatch import DEVICE_KERNELS
from kdax.ops.kascade import reference
from kdax.ops.kascade.checks import POOL_SIZE, POOL_SIZES, TILE_SIZE, TILE_SIZES

LAYERS, ANCHORS = 32, 5  # the model the weighted average stands for (layer 0 a dense-output anchor)
REFERENCE_MAX_T = 4096  # the float64 reference forms [B, H, T, T]: errors only up to this T


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured layer kind: times in ms (median and interquartile range)."""

    phase: str  # "prefill" or "decode"
    tokens: int  # T (prefill) or the cache length L (decode)
    backend: str  # the Kascade ops' backend ("-" for dense)
    layer: str  # "dense", "anchor (dense output)", "anchor", "reuse", or "32-layer average"
    median_ms: float
    iqr_ms: tuple[float, float]
    vs_dense: float  # dense time / this time (x faster than dense)
    rel_err: float | None  # vs the float64 reference (dense: jax.nn.dot_product_attention's)


def _inputs(B, T, H, G, D, dtype, seed=0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, H, D)) * 1.5
    k, v = r.standard_normal((B, T, G, D)), r.standard_normal((B, T, G, D))
    return [jnp.asarray(x, dtype) for x in (q, k, v)]


def default_backends() -> tuple[str, ...]:
    """xla, and the device's Kascade kernels where it has them (a TPU's or a GPU's)."""
    kernels = DEVICE_KERNELS.get(jax.default_backend())
    return ("xla",) if kernels is None else ("xla", kernels)


def run(
    B=1,
    T=4096,
    L=16384,
    H=8,
    G=2,
    D=128,
    topk_percent=10,
    min_k=128,
    tile_size=TILE_SIZE,
    pool_size=POOL_SIZE,
    dtype="float32",
    repeats=5,
    progress=True,
    backends=None,
    decode_batch=None,
    cache_layout="BLGD",
) -> list[Row]:
    """Time each layer kind at prefill length T (batch B) and decode cache length L.

    Args:
        decode_batch: the decode rows (None: B).
        cache_layout: the Kascade decode ops' caches, "BLGD" [B, L, G, D] or "BGLD" [B, G, L, D]
            (dense decode reads [B, L, G, D]).
        backends: the Kascade ops' backends to time, each against the same dense rows; None:
            :func:`default_backends`.

    Returns:
        The rows: dense, then each backend's layer kinds and 32-layer average, prefill then decode.
    """
    dtype = jnp.dtype(dtype)
    backends = default_backends() if backends is None else tuple(backends)
    opts = {"topk_percent": topk_percent, "min_k": min_k, "pool_size": pool_size}
    q, k, v = _inputs(B, T, H, G, D, dtype)
    head_map = np.arange(G)[::-1].copy()
    idx, _ = kdax.kascade_anchor(*_inputs(B, T, H, G, D, dtype, seed=1), **opts, tile_size=tile_size)
    prefill = {  # every array an argument: a closed-over array would be a constant XLA may fold
        "dense": lambda q, k, v, idx, b: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        "anchor (dense output)": lambda q, k, v, idx, b: kdax.kascade_anchor(
            q, k, v, **opts, tile_size=tile_size, dense_output=True, backend=b
        ),
        "anchor": lambda q, k, v, idx, b: kdax.kascade_anchor(q, k, v, **opts, tile_size=tile_size, backend=b),
        "reuse": lambda q, k, v, idx, b: kdax.kascade_reuse(
            q, k, v, idx, head_map=head_map, tile_size=tile_size, pool_size=pool_size, backend=b
        ),
    }
    Bd = B if decode_batch is None else decode_batch
    qd, kc, vc = _inputs(Bd, L, H, G, D, dtype, seed=2)
    qd, lengths = qd[:, -1], jnp.full((Bd,), L, jnp.int32)
    didx, _ = kdax.kascade_anchor_decode(qd * 0.5, kc, vc, lengths, **opts)
    layout = {"cache_layout": cache_layout}
    decode = {
        "dense": lambda q, k, v, n, idx, b: jax.nn.dot_product_attention(q[:, None], k, v)[:, 0],
        "anchor (dense output)": lambda q, k, v, n, idx, b: kdax.kascade_anchor_decode(
            q, k, v, n, **opts, **layout, dense_output=True, backend=b
        ),
        "anchor": lambda q, k, v, n, idx, b: kdax.kascade_anchor_decode(q, k, v, n, **opts, **layout, backend=b),
        "reuse": lambda q, k, v, n, idx, b: kdax.kascade_reuse_decode(
            q, k, v, n, idx, head_map=head_map, pool_size=pool_size, **layout, backend=b
        ),
    }
    caches = (kc, vc) if cache_layout == "BLGD" else (kc.swapaxes(1, 2), vc.swapaxes(1, 2))
    jobs = []
    for phase, n, fns, args, kargs in (
        ("prefill", T, prefill, (q, k, v, idx), (q, k, v, idx)),
        ("decode", L, decode, (qd, kc, vc, lengths, didx), (qd, *caches, lengths, didx)),
    ):
        jobs.append((phase, n, "-", "dense", fns["dense"], args, args))
        jobs += [(phase, n, b, name, fn, kargs, args) for b in backends for name, fn in fns.items() if name != "dense"]
    bar = tqdm(jobs, desc="kdax bench kascade", disable=not progress)
    rows, dense_ms = [], {}
    for phase, n, backend, name, fn, args, checked in bar:  # checked: args in the reference's layout
        bar.set_postfix_str(f"{phase} {backend} {name}: compiling, then {repeats} timed calls")
        f = jax.jit(functools.partial(fn, b=backend))
        t = time_calls(lambda f=f, args=args: f(*args), repeats)
        out = f(*args)
        o = out[1] if isinstance(out, tuple) else out
        dense_ms.setdefault(phase, t.median)
        err = _error(name, o, checked, head_map, opts, tile_size)
        rows.append(Row(phase, n, backend, name, t.median, (t.q25, t.q75), dense_ms[phase] / t.median, err))
        if name == "reuse":  # the backend's last layer kind of this phase
            ms = {r.layer: r for r in rows if r.phase == phase and r.backend == backend}
            avg = (
                ms["anchor (dense output)"].median_ms
                + (ANCHORS - 1) * ms["anchor"].median_ms
                + (LAYERS - ANCHORS) * ms["reuse"].median_ms
            ) / LAYERS
            rows.append(
                Row(
                    phase,
                    n,
                    backend,
                    f"{LAYERS}-layer average ({ANCHORS} anchors)",
                    avg,
                    (avg, avg),
                    dense_ms[phase] / avg,
                    None,
                )
            )
    return rows


def _error(name, o, args, head_map, opts, tile_size):
    """rel. RMS error of ``o`` against the float64 reference of the same layer (``args``: prefill
    (q, k, v, indices) or decode (q, k_cache, v_cache, lengths, indices)), None past REFERENCE_MAX_T."""
    with jax.enable_x64(True):
        *arrays, idx = args
        if len(arrays) == 3:  # prefill
            q, k, v = (x.astype(jnp.float64) for x in arrays)
            if q.shape[1] > REFERENCE_MAX_T:
                return None
            if name == "reuse":
                pools = {"tile_size": tile_size, "pool_size": opts["pool_size"]}
                ref = reference.naive_kascade_reuse(q, k, v, idx, head_map=head_map, **pools)
            elif name == "dense":
                ref = reference.naive_attention(q, k, v)
            else:
                ref = reference.naive_kascade_anchor(
                    q, k, v, **opts, tile_size=tile_size, dense_output=name != "anchor"
                )[1]
        else:
            lengths = arrays.pop()
            q, kc, vc = (x.astype(jnp.float64) for x in arrays)
            if name == "reuse":
                pools = {"pool_size": opts["pool_size"]}
                ref = reference.naive_kascade_reuse_decode(q, kc, vc, lengths, idx, head_map=head_map, **pools)
            else:
                ref = reference.naive_kascade_anchor_decode(q, kc, vc, lengths, **opts, dense_output=name != "anchor")[
                    1
                ]
        return rel_rms(o, ref)


def format_table(rows: list[Row]) -> str:
    """The rows as a markdown table with a legend."""
    head = (
        "phase",
        "tokens",
        "backend",
        "layer",
        "median ms (IQR)",
        "x faster than dense",
        "rel. RMS error vs float64",
    )
    lines = [
        (
            r.phase,
            str(r.tokens),
            r.backend,
            r.layer,
            f"{r.median_ms:.2f} ({r.iqr_ms[0]:.2f}-{r.iqr_ms[1]:.2f})",
            f"{r.vs_dense:.2f}x",
            "-" if r.rel_err is None else f"{r.rel_err:.2e}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    fmt = lambda cols: "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |"
    legend = (
        "dense: jax.nn.dot_product_attention (causal) on the same inputs, in the same run. anchor: exact\n"
        "attention selects each query tile's top-k keys (its output sparse, or dense for a schedule's layer 0);\n"
        "reuse: attends an anchor's selection. Decode: one token over a cache of `tokens` keys. The average\n"
        f"weighs one dense-output anchor, {ANCHORS - 1} anchors and {LAYERS - ANCHORS} reuse layers. Error: against "
        "the float64 reference of the same layer (prefill up to T = 4096)."
    )
    return "\n".join(
        [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(x) for x in lines] + ["", legend]
    )


def register(sub) -> None:
    """``kdax bench kascade``."""
    p = flags.command(
        sub, "kascade", _command, "Kascade dense / anchor / reuse layers against dense attention, prefill and decode"
    )
    flags.shape(p, B=1, T=4096, H=8)
    p.add_argument("--kv-heads", type=flags.at_least(1), default=2, help="KV heads G")
    p.add_argument("--head-dim", type=flags.at_least(1), default=128, help="head dim D")
    p.add_argument("--cache-len", type=flags.at_least(1), default=16384, help="the decode cache length")
    p.add_argument("--decode-batch", type=flags.at_least(1), help="decode rows (default: --B)")
    p.add_argument("--topk-percent", type=flags.percent, default=10, help="keys kept, percent")
    p.add_argument("--min-k", type=flags.at_least(0), default=128, help="the least keys a tile keeps")
    p.add_argument("--tile-size", type=int, default=TILE_SIZE, choices=TILE_SIZES, help="queries per tile")
    p.add_argument("--pool-size", type=int, default=POOL_SIZE, choices=POOL_SIZES, help="keys per selected pool")
    p.add_argument("--dtype", default="float32", choices=flags.DTYPES, help="input dtype")
    p.add_argument(
        "--cache-layout",
        default="BLGD",
        choices=("BLGD", "BGLD"),
        help="the Kascade decode caches: [B, L, G, D] or [B, G, L, D] (heads first; on a TPU a bf16 cache's "
        "pools are single copies only so)",
    )
    p.add_argument(
        "--backends",
        type=flags.names(("xla", "pallas_tpu", "pallas_gpu")),
        help="the Kascade ops' backends to time (default: xla and the device's kernels)",
    )
    flags.output(p, repeats=5)


def _command(ns, parser) -> int:
    if ns.dtype == "float16" and jax.default_backend() == "cpu":
        parser.error(
            "--dtype: float16 needs an accelerator (the dense baseline, jax.nn.dot_product_attention, "
            "has no float16 on CPU)"
        )
    if not ns.json:
        print(
            f"compiling and timing dense, anchor and reuse layers (T={ns.T}, cache {ns.cache_len})...",
            file=sys.stderr,
            flush=True,
        )
    rows = run(
        B=ns.B,
        T=ns.T,
        L=ns.cache_len,
        H=ns.H,
        G=ns.kv_heads,
        D=ns.head_dim,
        topk_percent=ns.topk_percent,
        min_k=ns.min_k,
        tile_size=ns.tile_size,
        pool_size=ns.pool_size,
        dtype=ns.dtype,
        repeats=ns.repeats,
        progress=not ns.json,
        backends=ns.backends,
        decode_batch=ns.decode_batch,
        cache_layout=ns.cache_layout,
    )
    shape = (
        f"# B={ns.B} H={ns.H} G={ns.kv_heads} D={ns.head_dim} {ns.dtype}, top-k {ns.topk_percent:g}% (at least "
        f"{ns.min_k} keys), tile {ns.tile_size}, pools of {ns.pool_size}; decode: batch {ns.decode_batch or ns.B}, "
        f"cache {ns.cache_len} keys ({ns.cache_layout})"
    )
    data = [dataclasses.asdict(r) for r in rows]
    return flags.emit(ns, flags.meta(ns), "kascade", data, f"{shape}\n{format_table(rows)}")
