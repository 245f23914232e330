"""Kascade as Pallas kernels lowered through Triton (``backend="pallas_gpu"``): forward only.

Four kernels (docs/kascade_gpu.md), each program one KV head's query rows in the packed
layout of :mod:`kdax.ops.kascade.blocks`:

- ``kascade_attend`` (grid NT, G, B): a query tile attends a list of key blocks with an
  online softmax, then its own causal block. Dense (every block before the tile: an anchor's
  exact pass, which also writes the log-sum-exp) or sparse (the tile's selected rows,
  gathered by pointer arithmetic ``k[indices]`` inside the kernel: a reuse layer).
- ``kascade_scores`` (grid NT, G, B): recomputes a tile's probabilities block by block from
  the log-sum-exp and writes their sum over the tile's rows, the pooled scores that XLA's
  top-k selects from (only blocks before the tile are computed or written).
- ``kascade_decode_scores`` (grid splits, G, B): one token's log2 scores over a split of the
  cache (read in place, ``[B, L, G, D]``) and, for a dense output, its partial softmax.
- ``kascade_decode_attend`` (grid splits, G, B): split-K over the selected rows; the
  partials are combined in XLA by their log-sum-exp.

Triton wants power-of-two blocks of at least 16: D is padded to one (decode reads the cache
in place only when D is one already), heads per group to Rp (and decode rows to 16).
Off GPU the kernels run in the Pallas interpreter (for tests; slow).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kdax.ops.common import dispatch
from kdax.ops.common.arrays import LOG2E, round_up
from kdax.ops.kascade import blocks as bl
from kdax.ops.kascade.capabilities import Capabilities
from kdax.ops.kascade.xla import with_decode_tail

# Whether the compiled kernels have passed the shared cases' error bars on a GPU
# (`scripts/gpu_session.sh kascade`, recorded in BENCHMARKS.md). Until then backend="auto"
# runs xla on a GPU; backend="pallas_gpu" runs these kernels all the same.
VERIFIED_ON_GPU = False

KERNELS = ("attend", "scores", "decode_scores", "decode_attend")


@dataclasses.dataclass(frozen=True)
class Config:
    """The pallas_gpu backend's per-call config (``kascade_anchor(..., config=pallas_gpu.Config(...))``).

    Attributes:
        block_k: keys per step of the attend kernels (a power of two >= 16); None: 64, or 32
            with float32 inputs (:data:`PREFILL_BLOCKS`).
        block_scores: keys per step of the scoring kernel (a power of two >= 16); None: 128, or
            64 with float32 inputs.
        block_decode: keys per step of the decode kernels (a power of two >= 16).
        splits: cache splits per decode row (split-K); None: enough programs for 2 per SM.
        launch: ((kernel, (num_warps, num_stages)), ...) overriding :data:`LAUNCH`.
        interpret: run in the Pallas interpreter; None: unless on a GPU (or lowering for one).

    Raises:
        ValueError: from :meth:`resolved`, naming the field that is out of range.
    """

    block_k: int | None = None
    block_scores: int | None = None
    block_decode: int = 64
    splits: int | None = None
    launch: tuple[tuple[str, tuple[int, int]], ...] = ()
    interpret: bool | None = None

    def resolved(self) -> Config:
        """This config, its fields checked, with ``interpret`` None replaced by what it means here."""
        for name in ("block_k", "block_scores", "block_decode"):
            if (n := getattr(self, name)) is not None and (n < 16 or n & (n - 1)):
                raise ValueError(f"config.{name}: expected a power of two >= 16, got {n}")
        if self.splits is not None and (isinstance(self.splits, bool) or self.splits < 1):
            raise ValueError(f"config.splits: expected None or an int >= 1, got {self.splits!r}")
        if unknown := set(dict(self.launch)) - set(KERNELS):
            raise ValueError(f"config.launch: expected kernels among {KERNELS}, got {sorted(unknown)}")
        interpret = dispatch.platform() != "gpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


# (num_warps, num_stages) per kernel: starting values, not yet timed on a GPU (docs/kascade_gpu.md).
LAUNCH = {"attend": (4, 2), "scores": (4, 2), "decode_scores": (4, 2), "decode_attend": (4, 2)}
SMS = 132  # streaming multiprocessors assumed for the default decode splits (an H100's)


# The prefill kernels' blocks by input dtype, and float32's launches: its three-pass TF32 products
# hold high and low parts of their operands, so half the keys a step on 8 warps keeps them within
# the spill budget and an H100's shared memory (docs/kascade_gpu.md, "Compile report"); a block or
# launch the config names is kept.
PREFILL_BLOCKS = {"float32": {"block_k": 32, "block_scores": 64}, "16-bit": {"block_k": 64, "block_scores": 128}}
FLOAT32_LAUNCH = {"attend": (8, 1), "scores": (8, 1)}


def for_dtype(cfg: Config, dtype) -> Config:
    """cfg with its prefill blocks (and float32's launches) for inputs of ``dtype``."""
    f32 = dtype == jnp.float32
    blocks = {name: getattr(cfg, name) or n for name, n in PREFILL_BLOCKS["float32" if f32 else "16-bit"].items()}
    launch = {**(FLOAT32_LAUNCH if f32 else {}), **dict(cfg.launch)}
    return dataclasses.replace(cfg, **blocks, launch=tuple(launch.items()))


def _params(cfg: Config, kernel: str) -> pltriton.CompilerParams:
    num_warps, num_stages = dict(cfg.launch).get(kernel, LAUNCH[kernel])
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _precision(dtype, cfg: Config):
    """Of the kernels' products: float32 as three TF32 products on a GPU (about 22 bits; exact
    float32 products run on the FMA units and spill 20 KB a thread), exact in the interpreter."""
    if dtype == jnp.float32 and not cfg.interpret:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return bl.precision(dtype)


def _whole(shape):
    """A block that is the whole (small) array, for every program."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


# ----------------------------------------------------------------------------- prefill kernels


def _attend_kernel(lengths_ref, nblk_ref, q_ref, k_ref, v_ref, *rest, tile, R, Rp, bk, sparse, scale2, prec):
    """Grid (NT, G, B). q, o [tile * Rp, Dp]; k, v [Tp, Dp] (the head's keys); lse [rows, 1];
    with ``sparse`` the tile's selection idx [Kp] (-1: none), else every key block before it."""
    idx_ref, o_ref, lse_ref = rest if sparse else (None, *rest)
    t, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = tile * Rp
    start = t * tile
    pos, row_ok = bl.row_mask(rows, Rp, R, start, lengths_ref[b])
    q = q_ref[...]

    def attend(state, ok, kb, vb):
        s2 = jnp.where(ok & row_ok, bl.dot_nt(q, kb, prec) * scale2, -jnp.inf)
        return bl.softmax_step(state, s2, vb, prec)

    def body(i, state):
        if sparse:
            keys = idx_ref[pl.ds(i * bk, bk)]
            ok = ((keys >= 0) & (keys < start))[None, :]
            at = jnp.maximum(keys, 0)
            return attend(state, ok, k_ref[at, :], v_ref[at, :])
        keys = i * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        return attend(state, keys < start, k_ref[pl.ds(i * bk, bk), :], v_ref[pl.ds(i * bk, bk), :])

    n = nblk_ref[b, g, t] if sparse else bl.cdiv(start, bk)
    state = lax.fori_loop(0, n, body, bl.start_softmax(rows, q.shape[1]))
    keys = start + lax.broadcasted_iota(jnp.int32, (1, tile), 1)
    state = attend(state, keys <= pos, k_ref[pl.ds(start, tile), :], v_ref[pl.ds(start, tile), :])
    o, lse2 = bl.finish_softmax(state)
    o_ref[...] = jnp.where(row_ok, o, 0.0).astype(o_ref.dtype)
    lse_ref[...] = lse2


def _scores_kernel(lengths_ref, q_ref, lse_ref, k_ref, p_ref, *, tile, R, Rp, bs, scale2, prec):
    """Grid (NT, G, B). q [rows, Dp]; lse [rows, 1]; k [Tp, Dp]; p [Tp]: the tile's pooled
    probabilities of the keys before it, ``bs`` keys a step (the rest of p is not written)."""
    t, b = pl.program_id(0), pl.program_id(2)
    start = t * tile
    _, row_ok = bl.row_mask(tile * Rp, Rp, R, start, lengths_ref[b])
    q, lse2 = q_ref[...], lse_ref[...]

    @pl.loop(0, bl.cdiv(start, bs))
    def _(c):
        keys = c * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1)
        s2 = bl.dot_nt(q, k_ref[pl.ds(c * bs, bs), :], prec) * scale2
        p_ref[pl.ds(c * bs, bs)] = bl.pooled(s2, lse2, row_ok & (keys < start))[0]


def _attend(qp, kp, vp, lengths, indices, plan: bl.Plan, *, cfg):
    """The attend kernel over packed inputs; indices None for the dense pass.
    Returns (o [B, G, Tp * Rp, Dp], lse2 [B, G, Tp * Rp, 1])."""
    B, G, Tp, Dp = kp.shape
    bk, NT = cfg.block_k, plan.NT
    sparse = indices is not None
    qspec = pl.BlockSpec((None, None, plan.rows, Dp), lambda t, g, b: (b, g, t, 0))
    kvspec = pl.BlockSpec((None, None, Tp, Dp), lambda t, g, b: (b, g, 0, 0))
    in_specs = [_whole((B,)), _whole((B, G, NT)), qspec, kvspec, kvspec]
    args = [lengths, jnp.zeros((B, G, NT), jnp.int32), qp, kp, vp]
    if sparse:
        Kp = round_up(max(indices.shape[-1], 1), bk)
        args[1] = bl.selection_blocks(indices, bk)
        args.append(bl.pad_selection(indices, Kp))
        in_specs.append(pl.BlockSpec((None, None, None, Kp), lambda t, g, b: (b, g, t, 0)))
    kernel = functools.partial(
        _attend_kernel,
        tile=plan.tile_size,
        R=plan.R,
        Rp=plan.Rp,
        bk=bk,
        sparse=sparse,
        scale2=plan.scale2,
        prec=_precision(qp.dtype, cfg),
    )
    return pl.pallas_call(
        kernel,
        grid=(NT, G, B),
        name="kascade_attend",
        in_specs=in_specs,
        out_specs=[qspec, pl.BlockSpec((None, None, plan.rows, 1), lambda t, g, b: (b, g, t, 0))],
        out_shape=[jax.ShapeDtypeStruct(qp.shape, qp.dtype), jax.ShapeDtypeStruct((*qp.shape[:3], 1), jnp.float32)],
        compiler_params=_params(cfg, "attend"),
        interpret=cfg.interpret,
    )(*args)


def _scores(qp, kp, lse2, lengths, plan: bl.Plan, *, cfg):
    """Pooled probabilities P [B, G, NT, Tp] float32 (only keys before each tile written)."""
    B, G, Tp, Dp = kp.shape
    row = lambda t, g, b: (b, g, t, 0)
    kernel = functools.partial(
        _scores_kernel,
        tile=plan.tile_size,
        R=plan.R,
        Rp=plan.Rp,
        bs=cfg.block_scores,
        scale2=plan.scale2,
        prec=_precision(qp.dtype, cfg),
    )
    return pl.pallas_call(
        kernel,
        grid=(plan.NT, G, B),
        name="kascade_scores",
        in_specs=[
            _whole((B,)),
            pl.BlockSpec((None, None, plan.rows, Dp), row),
            pl.BlockSpec((None, None, plan.rows, 1), row),
            pl.BlockSpec((None, None, Tp, Dp), lambda t, g, b: (b, g, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, Tp), row),
        out_shape=jax.ShapeDtypeStruct((B, G, plan.NT, Tp), jnp.float32),
        compiler_params=_params(cfg, "scores"),
        interpret=cfg.interpret,
    )(lengths, qp, lse2, kp)


def _plan(q, k, tile_size, scale, cfg) -> bl.Plan:
    H, D, G = q.shape[2], q.shape[3], k.shape[2]
    return bl.Plan.make(
        q, k, tile_size, scale, Rp=bl.pow2(H // G), Dp=bl.pow2(D, 16), block=max(cfg.block_k, cfg.block_scores)
    )


def kascade_anchor_gpu(q, k, v, lengths, *, tile_size, scale, cfg, **budget):
    """See :func:`kdax.kascade_anchor`; ``budget``: tenths, min_k, k_max, dense_output (:func:`blocks.anchor`).
    Returns (indices [B, G, NT, k_max] int32, o [B, T, H, D])."""
    cfg = for_dtype(cfg, q.dtype)
    kernels = functools.partial(_attend, cfg=cfg), functools.partial(_scores, cfg=cfg)
    return bl.anchor(*kernels, q, k, v, lengths, _plan(q, k, tile_size, scale, cfg), **budget)


def kascade_reuse_gpu(q, k, v, lengths, indices, *, tile_size, pool_size, scale, cfg):
    """See :func:`kdax.kascade_reuse`. indices [B, G, NT, k] already remapped. Returns o [B, T, H, D]."""
    cfg = for_dtype(cfg, q.dtype)
    return bl.reuse(
        functools.partial(_attend, cfg=cfg), q, k, v, lengths, indices, _plan(q, k, tile_size, scale, cfg), pool_size
    )


# ----------------------------------------------------------------------------- decode kernels


def _decode_scores_kernel(lengths_ref, q_ref, k_ref, *rest, R, bd, Ls, scale2, prec, with_output):
    """Grid (splits, G, B). q [Rq, Dp]; k (and v) [Lp, Dp], the head's cache in place; s [Rq, Ls]:
    the split's log2 scores (written for keys below the row's length); with_output the split's
    softmax partial acc [Rq, Dp], m, l [Rq, 1]."""
    v_ref, s_ref, *parts = rest if with_output else (None, *rest)
    sp, b = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    q = q_ref[...]
    row_ok = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) < R
    n = jnp.clip(bl.cdiv(jnp.maximum(length - sp * Ls, 0), bd), 0, Ls // bd)

    def body(i, state):
        keys = sp * Ls + i * bd + lax.broadcasted_iota(jnp.int32, (1, bd), 1)
        kb = k_ref[pl.ds(sp * Ls + i * bd, bd), :]
        s2 = jnp.where(row_ok & (keys < length), bl.dot_nt(q, kb, prec) * scale2, -jnp.inf)
        s_ref[:, pl.ds(i * bd, bd)] = s2
        if not with_output:
            return state
        return bl.softmax_step(state, s2, v_ref[pl.ds(sp * Ls + i * bd, bd), :], prec)

    state = lax.fori_loop(0, n, body, bl.start_softmax(*q.shape))
    if with_output:
        m, l, acc = state
        parts[0][...], parts[1][...], parts[2][...] = acc, m, l


def _decode_attend_kernel(
    lengths_ref, nblk_ref, q_ref, k_ref, v_ref, idx_ref, acc_ref, m_ref, l_ref, *, R, bd, per_split, prec, scale2
):
    """Grid (splits, G, B). q [Rq, Dp]; k, v [L, Dp] in place; idx [Ks] the split's share of
    the selection; out: the split's softmax partial acc [Rq, Dp], m, l [Rq, 1]."""
    sp, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    q = q_ref[...]
    row_ok = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) < R

    def body(i, state):
        keys = idx_ref[pl.ds(i * bd, bd)]
        at = jnp.maximum(keys, 0)
        ok = ((keys >= 0) & (keys < length))[None, :]
        s2 = jnp.where(row_ok & ok, bl.dot_nt(q, k_ref[at, :], prec) * scale2, -jnp.inf)
        return bl.softmax_step(state, s2, v_ref[at, :], prec)

    n = jnp.clip(nblk_ref[b, g] - sp * per_split, 0, per_split)
    m, l, acc = lax.fori_loop(0, n, body, bl.start_softmax(*q.shape))
    acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _decode_plan(q, k_cache, cfg, keys):
    """(Rq, Dp, splits, keys per split) for ``keys`` keys per row."""
    B, H, D = q.shape
    G = k_cache.shape[2]
    Rq, Dp = bl.pow2(H // G, 16), bl.pow2(D, 16)
    blocks = max(1, -(-keys // cfg.block_decode))
    S = cfg.splits or max(1, -(-2 * SMS // (B * G)))
    S = min(S, blocks)
    return Rq, Dp, S, -(-blocks // S) * cfg.block_decode


def _cache_in_place(x, Dp, bd):
    """The cache [B, L, G, D] as the kernels read it, [B, Lp, G, Dp]: in place when D is a power
    of two >= 16 and L a multiple of the decode block (else a padded copy), so that every block
    a kernel reads lies inside it."""
    L, D = x.shape[1], x.shape[3]
    Lp = round_up(L, bd)
    return x if (Lp, Dp) == (L, D) else jnp.pad(x, ((0, 0), (0, Lp - L), (0, 0), (0, Dp - D)))


def _partial_specs(B, G, S, Rq, Dp):
    return bl.decode_partials(B, G, S, Rq, Dp, lambda sp, g, b: (b, g, sp, 0, 0))


def kascade_anchor_decode_gpu(
    q, k_cache, v_cache, lengths, *, tenths, min_k, k_max, pool_size, scale, dense_output, cache_layout, cfg
):
    """See :func:`kdax.kascade_anchor_decode`. Returns (indices [B, G, k_max] int32, o [B, H, D]).
    Heads-first caches ("BGLD") are read transposed (a copy)."""
    if cache_layout == "BGLD":
        k_cache, v_cache = k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2)
    B, H, _ = q.shape
    L, G = k_cache.shape[1:3]
    Rq, Dp, S, Ls = _decode_plan(q, k_cache, cfg, L)
    qp = bl.pack_decode_queries(q, G, Rq, Dp)  # [B, G, Rq, Dp]
    bd = cfg.block_decode
    kc = _cache_in_place(k_cache, Dp, bd)
    cache = pl.BlockSpec((None, kc.shape[1], None, Dp), lambda sp, g, b: (b, 0, g, 0))
    in_specs = [_whole((B,)), pl.BlockSpec((None, None, Rq, Dp), lambda sp, g, b: (b, g, 0, 0)), cache]
    args = [lengths, qp, kc]
    out_specs = [pl.BlockSpec((None, None, Rq, Ls), lambda sp, g, b: (b, g, 0, sp))]
    out_shape = [jax.ShapeDtypeStruct((B, G, Rq, S * Ls), jnp.float32)]
    if dense_output:
        in_specs.append(cache)
        args.append(_cache_in_place(v_cache, Dp, bd))
        specs, shapes = _partial_specs(B, G, S, Rq, Dp)
        out_specs, out_shape = out_specs + specs, out_shape + shapes
    kernel = functools.partial(
        _decode_scores_kernel,
        R=H // G,
        bd=bd,
        Ls=Ls,
        scale2=scale * LOG2E,
        prec=_precision(q.dtype, cfg),
        with_output=dense_output,
    )
    s2, *parts = pl.pallas_call(
        kernel,
        grid=(S, G, B),
        name="kascade_decode_scores",
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg, "decode_scores"),
        interpret=cfg.interpret,
    )(*args)
    idx, _ = bl.decode_selection(
        s2, lengths, R=H // G, L=L, tenths=tenths, min_k=min_k, k_max=k_max, pool_size=pool_size
    )
    if dense_output:
        return idx, bl.decode_output(*parts, q)
    options = {"pool_size": pool_size, "scale": scale, "cache_layout": "BLGD", "cfg": cfg}
    return idx, kascade_reuse_decode_gpu(q, k_cache, v_cache, lengths, idx, **options)


def kascade_reuse_decode_gpu(q, k_cache, v_cache, lengths, indices, *, pool_size, scale, cache_layout, cfg):
    """See :func:`kdax.kascade_reuse_decode`. indices [B, G, k] already remapped. Returns o [B, H, D]."""
    if cache_layout == "BGLD":
        k_cache, v_cache = k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2)
    indices = with_decode_tail(indices, lengths, pool_size)
    B, H, _ = q.shape
    G = k_cache.shape[2]
    Rq, Dp, S, Ks = _decode_plan(q, k_cache, cfg, indices.shape[-1])
    bd = cfg.block_decode
    kc, vc = _cache_in_place(k_cache, Dp, bd), _cache_in_place(v_cache, Dp, bd)
    cache = pl.BlockSpec((None, kc.shape[1], None, Dp), lambda sp, g, b: (b, 0, g, 0))
    specs, shapes = _partial_specs(B, G, S, Rq, Dp)
    kernel = functools.partial(
        _decode_attend_kernel, R=H // G, bd=bd, per_split=Ks // bd, prec=_precision(q.dtype, cfg), scale2=scale * LOG2E
    )
    parts = pl.pallas_call(
        kernel,
        grid=(S, G, B),
        name="kascade_decode_attend",
        in_specs=[
            _whole((B,)),
            _whole((B, G)),
            pl.BlockSpec((None, None, Rq, Dp), lambda sp, g, b: (b, g, 0, 0)),
            cache,
            cache,
            pl.BlockSpec((None, None, Ks), lambda sp, g, b: (b, g, sp)),
        ],
        out_specs=specs,
        out_shape=shapes,
        compiler_params=_params(cfg, "decode_attend"),
        interpret=cfg.interpret,
    )(
        lengths,
        bl.selection_blocks(indices, bd),
        bl.pack_decode_queries(q, G, Rq, Dp),
        kc,
        vc,
        bl.pad_selection(indices, S * Ks),
    )
    return bl.decode_output(*parts, q)


def _refuse(asked) -> str | None:
    if not asked and not VERIFIED_ON_GPU:
        return "the GPU kernels are not yet verified on a GPU (kascade pallas_gpu.VERIFIED_ON_GPU)"
    return None


CAPABILITIES = Capabilities(
    "pallas_gpu",
    config=Config,
    cores={
        "anchor": kascade_anchor_gpu,
        "reuse": kascade_reuse_gpu,
        "anchor_decode": kascade_anchor_decode_gpu,
        "reuse_decode": kascade_reuse_decode_gpu,
    },
    forward_only=True,
    refuse=_refuse,
)
