"""Chunked KDA as Mosaic TPU kernels (``backend="pallas_tpu"``): forward.

Layout: the kernels read head-major ``[B, heads, slots, D]`` inputs with K and V padded to
multiples of 128 (XLA fuses the transpose with the cast to float32) and write the outputs (o, and
dq, dk, dv, dg) token-major, as ``[B, slots, heads * D]``, each head's columns lane-aligned (XLA's
relayout to ``[B, T, heads, D]`` costs a third of a transpose; docs/kda_tpu.md, Layout). One
chunk of C slots per grid step, the state kept transposed
(``St = S^T``, ``[V, K]``) so the per-key decay scales its lanes. GVA maps value
head h to q/k head ``h // (HV // H)`` in the index maps (q and k are never repeated).
Variable-length batches come in through scalar prefetch: per chunk, whether it starts
or ends its sequence and which sequence it belongs to.

The chunk math is :mod:`kdax.ops.kda.tiles` (full-tile operations only, shared with the
GPU kernels). Two kernel pipelines compute the forward (docs/kda_tpu.md):

- ``fused``: one kernel per (batch, head, V-block) walking the chunks, everything
  on chip (default);
- ``staged``: intra-chunk kernel -> state kernel -> output kernel, through HBM.

Off TPU the kernels run in the Pallas TPU interpreter (for tests; slow). The recurrent form's
decode kernel (``fused_recurrent_kda``) is :mod:`kdax.ops.kda.decode`'s, launched here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common import dispatch
from kdax.ops.common.arrays import LOG2E, pad_last, round_up
from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda import decode
from kdax.ops.kda.tiles import (
    BF16_HIGH,
    BF16X2,
    BF16X3,
    Intra,
    Tiles,
    chunk_states,
    gated,
    head_major,
    last_row,
    unpair,
)

LANE = 128
ALL = slice(None)  # all of a step's heads
PRECISIONS = ("highest", "bf16")  # Config.precision, besides "auto" (docs/kda_tpu.md, Precision)


@dataclasses.dataclass(frozen=True)
class Config:
    """The pallas_tpu backend's per-call config (``chunk_kda(..., config=pallas_tpu.Config(...))``).

    Attributes:
        pipeline: how the forward runs, "fused" (one kernel) or "staged" (intra, state, output).
        block_v: None (all of V in one block) or a multiple of 128 below V, which splits V over
            grid programs of one value head each.
        precision: of the matmuls, "highest" (float32: six bfloat16 passes), "bf16" (every
            matmul on bfloat16 operands, one pass, float32 accumulation, but the triangular
            inverse's: two bfloat16 parts of each operand, three products) or "auto" (bf16 for
            bfloat16 inputs, highest for the others). The 0/1 sums (exponents, cumsums) take three
            bfloat16 parts of their operand, exact products, in every mode.
        heads: value heads a grid step takes, forward and backward (a batch of independent chains
            of matmuls, which hide each other's latency); None: :data:`HEADS` (:data:`ROOMY` on
            chips with 64 MiB of VMEM a core or more) at K = V = 128, fewer for wider states, more
            than :data:`PAIRED` on two cores a device (v4, v5p) only where two parallel programs
            remain.
            Lowered to a count that divides the value heads and fits the groups of value
            heads per q/k head.
        interpret: run in the Pallas TPU interpreter; None: unless on a TPU (or lowering for one).
        detect_races: in the interpreter, check the kernels for data races.

    Raises:
        ValueError: from :meth:`resolved`, naming the field that is out of range.
    """

    pipeline: str = "fused"
    block_v: int | None = None
    precision: str = "auto"
    heads: int | None = None
    interpret: bool | None = None
    detect_races: bool = False

    def resolved(self) -> Config:
        """This config, its fields checked, with ``interpret`` None replaced by what it means here."""
        if self.pipeline not in ("fused", "staged"):
            raise ValueError(f"config.pipeline: expected 'fused' or 'staged', got {self.pipeline!r}")
        if self.block_v is not None and (not isinstance(self.block_v, int) or self.block_v < 1 or self.block_v % LANE):
            raise ValueError(f"config.block_v: expected None or a positive multiple of {LANE}, got {self.block_v!r}")
        if self.heads is not None and (not isinstance(self.heads, int) or self.heads < 1):
            raise ValueError(f"config.heads: expected None or a positive int, got {self.heads!r}")
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(f"config.precision: expected 'auto' or one of {PRECISIONS}, got {self.precision!r}")
        interpret = dispatch.platform() != "tpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


def tiles_for(cfg: Config) -> Tiles:
    """The chunk math's matmuls for ``cfg.precision`` (resolved: not "auto")."""
    hi = lax.Precision.HIGHEST
    if cfg.precision == "bf16":
        return Tiles(
            precision=lax.Precision.DEFAULT,
            operands=jnp.bfloat16,
            sums=BF16X2,
            wide_precision=BF16_HIGH,
            stacked=True,
            wide_levels=False,
            paired=True,
        )
    return Tiles(precision=hi, sums=BF16X3, stacked=True, paired=mxu_width() == 128)


def mxu_width() -> int:
    """The MXU's width on the chip the kernels are built for (128 on v5e and older, 256 on v6e and
    TPU7x), 128 where no TPU is known (the interpreter). Heads in pairs (``Tiles.paired``) pay under
    "highest" on a 128-wide MXU (v5e float32 forward 6.48 -> 5.58 M static cycles), not on a 256-wide
    one (TPU7x 7.58 -> 8.14 M; bf16 gains on both, docs/kda_tpu.md)."""
    try:
        return pltpu.get_tpu_info().mxu_column_size
    except ValueError:
        return 128


# ----------------------------------------------------------------------------- kernels
# Scalar-prefetch refs, per chunk: first (starts its sequence), last (ends it), seq (its id).


def _state_step(tiles, first, last, h0_ref, fin_ref, St, w, u, k_d, decay):
    """One chunk of the sequential state pass: reset St to h0 at a sequence start,
    v_new = u - w S, St <- St decay + v_new^T k_d, write the final state at a sequence end.
    Returns (S entering the chunk [n, BV, K], v_new [n, C, BV]) for the step's n heads."""
    c = pl.program_id(3)

    @pl.when(first[c] == 1)
    def _():
        St[...] = h0_ref[0, 0]

    S = St[...]
    v_new = u - tiles.dot_t(w, S)
    S_next = S * decay + tiles.t_dot(v_new, k_d)
    St[...] = S_next

    @pl.when(last[c] == 1)
    def _():
        fin_ref[0, 0] = S_next

    return S, v_new


# When a gradient is taken the forward writes, besides the state entering each chunk, the
# products of the intra-chunk stage (tiles.Intra) that take the levels of the pairwise
# factorisation or the inverse: Aqk, Kkk and T (_SAVED). The backward takes the gate's prefix and
# suffix sums from g (one 0/1 matmul each), w and u by two matmuls, v_new by a third, and the
# element-wise gated q and k and the chunk's decay. With disable_recompute the forward also
# writes the sums, w, u and v_new (_KEPT). The staged forward's intra kernel writes the _STAGED
# ones in any case. Aqk and T are only ever bulk matmul operands, so they are stored in the
# precision's operand dtype (bfloat16 for "bf16": the same numbers, half the bytes).
_SAVED = ("Aqk", "Kkk", "T")
_KEPT = ("G", "R", "Aqk", "Kkk", "T", "w", "u", "v_new")
_OPERANDS = ("Aqk", "T")
_BY_V = ("u", "v_new")  # the fields of value columns
_STAGED = ("Aqk", "w", "u", "q_g", "k_d", "decay")


def _put_fields(refs, names, I: Intra, v_new=None):
    """Write the named fields of I (and v_new) into the [1, n, rows, D] blocks refs; decay
    [n, 1, K] is broadcast over its block's 8 rows, paired heads' [C, C] tiles written head by head."""
    for ref, name in zip(refs, names):
        x = v_new if name == "v_new" else getattr(I, name)
        if name in _SAVED and x.shape[0] != ref.shape[1]:  # heads in pairs (Tiles.paired)
            x = unpair(x)
        ref[0] = jnp.broadcast_to(x, ref.shape[1:]).astype(ref.dtype)


def _heads(x, n: int):
    """[m, C, D] q or k rows of the step's q/k heads -> [n, C, D], one per value head (m divides n)."""
    m = x.shape[0]
    return x if m == n else jnp.broadcast_to(x[:, None], (m, n // m, *x.shape[1:])).reshape(n, *x.shape[1:])


def _split(ref, hs: slice, D: int):
    """Heads hs of a token-major block [1, C, n * D] as [m, C, D] float32 (lane-aligned columns)."""
    return jnp.stack([ref[0, :, i * D : (i + 1) * D] for i in range(hs.start, hs.stop)]).astype(jnp.float32)


def _join(ref, x, first: int = 0):
    """Write [m, C, D] into heads first, ..., first + m - 1 of the token-major block [1, C, n * D]."""
    D = x.shape[-1]
    for i in range(x.shape[0]):
        ref[0, :, (first + i) * D : (first + i + 1) * D] = x[i].astype(ref.dtype)


def _first_head(n: int, HV: int):
    """The value head a grid step's n heads start at (axis 1 of every chunk grid: blocks of n)."""
    return 0 if n == HV else pl.program_id(1) * n


def _chunk_inputs(q_ref, k_ref, v_ref, g_ref, b_ref, hs=ALL):
    """The (q, k, v, g in log2 units, beta) [m, C, D] of the step's value heads hs from their
    [1, heads, C, D] blocks (beta [m, C, 1]: the heads' columns of the [1, 1, C, HV] block of
    every head's, :func:`_beta_spec`)."""
    n = v_ref.shape[1]
    q, k = _heads(q_ref[0], n)[hs], _heads(k_ref[0], n)[hs]
    b = b_ref[0, 0]
    head0 = _first_head(n, b.shape[-1])
    if isinstance(head0, int):
        beta = jnp.stack([b[:, i : i + 1] for i in range(n)[hs]])
    else:  # a column at a traced lane: its one nonzero kept by a mask, summed over the lanes (exact)
        lanes = lax.broadcasted_iota(jnp.int32, b.shape, 1)
        beta = jnp.stack([jnp.sum(jnp.where(lanes == head0 + i, b, 0.0), -1, keepdims=True) for i in range(n)[hs]])
    return q, k, v_ref[0, hs], g_ref[0, hs] * LOG2E, beta


def _lockstep(n: int, m: int) -> list[slice]:
    """A step's n heads, m at a time."""
    return [slice(i, min(i + m, n)) for i in range(0, n, m)]


def _fused_kernel(
    tiles, save_states, names, first, last, seq, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, fin_ref, *rest
):
    """Grid (B, head blocks, V-blocks, chunks), n value heads a step. Blocks: g [n, C, K]; q, k
    [n / groups or 1, C, K]; v [n, C, BV]; beta [n, C, 128]; o token-major [C, n BV]; h0, final
    (and S_in if save_states) [n, BV, K]; then the outputs of the named fields (_SAVED, _KEPT or
    none); scratch St [n, BV, K] carried across chunks."""
    *outs, St = rest
    I = tiles.intra(*_chunk_inputs(q_ref, k_ref, v_ref, g_ref, b_ref))
    S, v_new = _state_step(tiles, first, last, h0_ref, fin_ref, St, I.w, I.u, I.k_d, I.decay)
    if save_states:
        outs[0][0, :, 0] = S
    _put_fields(outs[save_states:], names, I, v_new)
    _join(o_ref, tiles.dot_t(I.q_g, S) + tiles.apply(I.Aqk, v_new))


def _intra_kernel(tiles, names, q_ref, k_ref, v_ref, g_ref, b_ref, *out_refs):
    """Grid (B, head blocks, chunks), all parallel. Writes the chunk's named Intra fields, per
    head: Aqk, Kkk, T [C, C], u [C, V], decay [8, K] (row 0, broadcast), the others [C, K]."""
    I = tiles.intra(*_chunk_inputs(q_ref, k_ref, v_ref, g_ref, b_ref))
    _put_fields(out_refs, names, I)


def _state_kernel(tiles, first, last, seq, w_ref, u_ref, kd_ref, dec_ref, h0_ref, vn_ref, sin_ref, fin_ref, St):
    """Grid (B, head blocks, V-blocks, chunks): the state pass alone, storing S_in and v_new."""
    S, v_new = _state_step(tiles, first, last, h0_ref, fin_ref, St, w_ref[0], u_ref[0], kd_ref[0], dec_ref[0][:, :1])
    sin_ref[0, :, 0] = S
    vn_ref[0] = v_new


def _output_kernel(tiles, aqk_ref, qg_ref, vn_ref, sin_ref, o_ref):
    """Grid (B, head blocks, chunks, V-blocks), all parallel: o = q_g S + Aqk v_new."""
    _join(o_ref, tiles.dot_t(qg_ref[0], sin_ref[0, :, 0]) + tiles.dot(aqk_ref[0], vn_ref[0]))


def _bwd_kernel(
    tiles, lockstep, has_dh, names, first, last, seq, q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, do_ref, df_ref, *rest
):
    """Grid (B, head blocks, chunks), n value heads a step, taken ``lockstep`` at a time, chunks
    walked last to first; the cotangent of the state (transposed, [n, V, K]) carried in scratch.
    do comes in and dq, dk, dv, dg go out token-major ([C, n D]), dq and dk per value head.
    Inputs after df: the cotangent of S_in [n, V, K] if has_dh, then the blocks of the forward's
    named fields (_SAVED or _KEPT)."""
    dh_ref, kept = (rest[0] if has_dh else None), rest[has_dh:-7]
    dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, dSt = rest[-7:]
    n = pl.num_programs(2)
    c = n - 1 - pl.program_id(2)

    @pl.when(pl.program_id(2) == 0)
    def _():
        dSt[...] = jnp.zeros_like(dSt)

    @pl.when(last[c] == 1)
    def _():
        dSt[...] = df_ref[0, 0]

    n_heads = v_ref.shape[1]
    lanes = lax.broadcasted_iota(jnp.int32, db_ref.shape[2:], 1)
    dbeta, head0 = jnp.zeros(db_ref.shape[2:], jnp.float32), _first_head(n_heads, db_ref.shape[-1])
    for hs in _lockstep(n_heads, lockstep):
        q, k, v, g, beta = _chunk_inputs(q_ref, k_ref, v_ref, g_ref, b_ref, hs)
        S = s_ref[0, hs, 0]
        f = {name: ref[0, hs] for name, ref in zip(names, kept)}
        if "w" in f:  # _KEPT
            q_g, _, k_d, decay = gated(q, k, f["G"], f["R"], last_row(f["G"]))
            I = Intra(g, **{x: f[x] for x in _KEPT if x != "v_new"}, q_g=q_g, k_d=k_d, decay=decay)
        else:
            G, R = tiles.cumsum(g), tiles.suffix_sums(g, inclusive=False)
            I = tiles.from_products(q, k, v, g, beta, G, R, *(f[x] for x in _SAVED))
        v_new = f["v_new"] if "v_new" in f else tiles.v_new(I, S)
        r = tiles.grads(q, k, v, beta, I, v_new, S, _split(do_ref, hs, v.shape[-1]), dSt[hs])
        for ref, x in zip((dq_ref, dk_ref, dv_ref, dg_ref), (r.dq, r.dk, r.dv, r.dg)):
            _join(ref, x, hs.start)
        for i, x in zip(range(n_heads)[hs], r.dbeta):  # the head's column of the [C, HV] dbeta block
            dbeta = jnp.where(lanes == head0 + i, x, dbeta)
        dS_in = r.dS_in if dh_ref is None else r.dS_in + dh_ref[0, hs, 0]
        dSt[hs] = dS_in

        @pl.when(first[c] == 1)
        def _(hs=hs, dS_in=dS_in):
            dh0_ref[0, 0, hs] = dS_in

    db_ref[0, 0] = dbeta


# ----------------------------------------------------------------------------- wrapper


def _interpret(cfg: Config):
    return pltpu.InterpretParams(detect_races=cfg.detect_races) if cfg.interpret else False


def _field(name: str, C: int, Kp: int, Vp: int) -> tuple[int, int]:
    """(rows per chunk, width) of the head-major array [B, HV, NC * rows, width] of a field of the
    intra stage, or of v_new."""
    rows = 8 if name == "decay" else C
    return rows, C if name in ("Aqk", "Kkk", "T") else Vp if name in _BY_V else Kp


def _qk_spec(n: int, groups: int, C: int, Kp: int, where):
    """The q or k block of a step of n value heads: n / groups q/k heads when groups divides n, else
    the one q/k head all n share (n divides groups). where: grid indices -> (b, head block, chunk)."""

    def index(*grid):
        b, h, c = where(*grid)
        return (b, h, c, 0) if n % groups == 0 else (b, lax.div(h * n, jnp.int32(groups)), c, 0)

    return pl.BlockSpec((1, max(n // groups, 1), C, Kp), index)


def _beta_spec(HV: int, C: int, where):
    """A [1, 1, C, HV] block of beta, [B, 1, L, HV] (every step reads all heads' betas, the tokens'
    row as it comes), or of dbeta, [B, HV / n, L, HV] (a step writes its heads' columns, zeros
    elsewhere; summed over axis 1 in XLA). A block of n columns would need a transpose in XLA
    to [B, HV / n, L, n], a copy for float32 whose loops the compile report cannot bound.
    where: grid indices -> (b, block, chunk)."""

    def index(*grid):
        b, h, c = where(*grid)
        return (b, h, c, 0)

    return pl.BlockSpec((1, 1, C, HV), index)


def _tokens(C: int, width: int, n: int, where):
    """A token-major block [1, C, n * width] of chunk c; where: grid indices -> (b, lane block, chunk)."""

    def index(*grid):
        b, h, c = where(*grid)
        return (b, c, h)

    return pl.BlockSpec((1, C, n * width), index)


# Value heads a grid step takes by default at C = 64, K = V = 128, per precision and kernel: the
# forward; the forward saving products and states for the backward; the forward keeping its fields
# too (disable_recompute); the backward; the backward reading the kept fields. Each as many as fit
# the VMEM limit and gain (docs/kda_tpu.md, Layout), fewer for wider states or chunks; ROOMY where the
# limit is ROOMY_LIMIT. The backward takes its heads LOCKSTEP at a time (more in lockstep spill past
# the limit). On chips with two TensorCores a device (v4, v5p), which split the grid's parallel axes
# between them, a step takes more than PAIRED heads only where the grid keeps two parallel programs
# (B HV / n >= 2).
KERNELS = ("forward", "saving", "keeping", "backward", "reading")
HEADS = {"bf16": dict(zip(KERNELS, (32, 16, 16, 16, 16))), "highest": dict(zip(KERNELS, (8, 8, 8, 8, 8)))}
ROOMY = {"bf16": {"saving": 32, "backward": 32}, "highest": {"backward": 16}}
LOCKSTEP = {"bf16": 8, "highest": 4}
PAIRED = 8
# The chunk kernels' scoped VMEM limit: ROOMY_LIMIT on chips with at least 64 MiB of VMEM a core
# (v5e and v6e have 128 MiB, v5p and TPU7x 64 MiB), else VMEM_LIMIT (and off a TPU).
VMEM_LIMIT, ROOMY_LIMIT = 32 << 20, 56 << 20


def vmem_limit() -> int:
    """The chunk kernels' scoped VMEM limit on the chip they are built for (:data:`ROOMY_LIMIT` or
    :data:`VMEM_LIMIT`)."""
    try:
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    except ValueError:
        return VMEM_LIMIT
    return ROOMY_LIMIT if capacity >= 64 << 20 else VMEM_LIMIT


def _scaled(top: int, C: int, Kp: int, Vp: int) -> int:  # top at C = 64, K = V = 128
    return max(1, min(top, top * LANE * LANE * 64 // (Kp * Vp * C)))


def cores_per_device() -> int:
    """The TensorCores of one device of the chip the kernels are built for (2 on v4 and v5p), 2 where
    no TPU is known (the interpreter)."""
    try:
        return pltpu.get_tpu_info().num_cores
    except ValueError:
        return 2


def heads_per_step(
    HV: int,
    groups: int,
    C: int,
    Kp: int,
    Vp: int,
    cfg: Config,
    kernel: str,
    B: int = 1,
    cores: int | None = None,
    vmem: int | None = None,
) -> int:
    """The value heads a grid step of ``kernel`` (one of :data:`KERNELS`) takes: ``cfg.heads``
    (None: :data:`HEADS` of the precision, or :data:`ROOMY` where the VMEM limit ``vmem`` (None:
    :func:`vmem_limit`) is :data:`ROOMY_LIMIT`, scaled down by the state's size over 128 x 128 and
    the chunk's over 64, and above :data:`PAIRED` on two cores a device (``cores``, None:
    :func:`cores_per_device`) only where B HV / n >= 2), lowered to the largest count that divides
    HV and that groups divides or that divides groups (q and k come in whole blocks)."""
    asked = cfg.heads
    if asked is None:
        roomy = (vmem_limit() if vmem is None else vmem) >= ROOMY_LIMIT
        table = {**HEADS[cfg.precision], **(ROOMY[cfg.precision] if roomy else {})}
        top = _scaled(table[kernel], C, Kp, Vp)
    else:
        top = asked
    fits = [n for n in range(1, min(top, HV) + 1) if HV % n == 0 and (n % groups == 0 or groups % n == 0)]
    if asked is not None or (cores_per_device() if cores is None else cores) == 1:
        return max(fits)
    return max([n for n in fits if n <= PAIRED or B * HV // n >= 2] or fits)


@dataclasses.dataclass(frozen=True)
class _Forward:
    """What both forward pipelines share: the sizes, the block specs on the grid (b, h, v-block, c)
    with the schedule (first, last, seq) prefetched, and the outputs' shapes."""

    B: int
    HV: int
    L: int  # padded slots
    NC: int
    Kp: int
    Vp: int
    BV: int
    groups: int  # value heads per q/k head
    cfg: Config  # resolved: cfg.heads the value heads a grid step takes
    o_dtype: jnp.dtype  # o's, the caller's (the op's output is cast to it)

    @property
    def C(self) -> int:
        return self.L // self.NC

    @property
    def interpret(self):
        return _interpret(self.cfg)

    @property
    def n(self) -> int:  # value heads a grid step
        return self.cfg.heads

    def spec(self, width):  # a [n, C, width] block of chunk c, all columns
        return pl.BlockSpec((1, self.n, self.C, width), lambda b, h, vb, c, *_: (b, h, c, 0))

    def beta(self):  # every head's beta [C, HV] of chunk c (:func:`_beta_spec`)
        return _beta_spec(self.HV, self.C, lambda b, h, vb, c, *_: (b, 0, c))

    def v_block(self):  # a [n, C, BV] block of chunk c, value columns of V-block vb
        return pl.BlockSpec((1, self.n, self.C, self.BV), lambda b, h, vb, c, *_: (b, h, c, vb))

    def o(self):  # the token-major o block [C, n BV]: V-block vb (one head a step where BV < Vp)
        blocks = self.Vp // self.BV
        return _tokens(self.C, self.BV, self.n, lambda b, h, vb, c, *_: (b, h * blocks + vb, c))

    def qk(self):  # q and k: the q/k heads of the step's value heads
        return _qk_spec(self.n, self.groups, self.C, self.Kp, lambda b, h, vb, c, *_: (b, h, c))

    def state(self):  # a sequence's state [n, BV, Kp] (initial or final), the schedule naming the sequence
        return pl.BlockSpec(
            (1, 1, self.n, self.BV, self.Kp), lambda b, h, vb, c, first, last, seq: (b, seq[c], h, vb, 0)
        )

    def s_in(self):  # the state entering chunk c
        return pl.BlockSpec((1, self.n, 1, self.BV, self.Kp), lambda b, h, vb, c, *_: (b, h, c, vb, 0))

    def shape(self, name: str, chunks: int | None = None):
        """An output's ShapeDtypeStruct: "o", "s_in" or a field (of NC chunks, or ``chunks``)."""
        f32 = jnp.float32
        if name == "o":
            return jax.ShapeDtypeStruct((self.B, self.L, self.HV * self.Vp), self.o_dtype)
        if name == "s_in":
            return jax.ShapeDtypeStruct((self.B, self.HV, self.NC, self.Vp, self.Kp), f32)
        rows, width = _field(name, self.C, self.Kp, self.Vp)
        dtype = (tiles_for(self.cfg).operands or f32) if name in _OPERANDS else f32
        return jax.ShapeDtypeStruct((self.B, self.HV, (chunks or self.NC) * rows, width), dtype)

    def sequential(self):
        return pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit()
        )


def _forward(q, k, v, g, beta, h0t, sched, groups: int, cfg: Config, save_states: bool, keep: tuple[str, ...], o_dtype):
    """Head-major padded inputs: q, k [B, H, L, Kp]; v [B, HV, L, Vp]; g [B, HV, L, Kp] (natural log);
    beta [B, 1, L, HV] (:func:`_beta_spec`); h0t [B, N, HV, Vp, Kp]; sched (first, last, seq) int32 [NC].
    Returns o [B, L, HV Vp] (token-major, in o_dtype), final [B, N, HV, Vp, Kp], S_in [B, HV, NC, Vp, Kp] or None, and
    {name: field} of the fields named in ``keep`` (:func:`_field`; _SAVED, _KEPT or none)."""
    B, HV, L, Vp = v.shape
    Kp = k.shape[-1]
    kernel = "keeping" if "w" in keep else "saving" if save_states or keep else "forward"
    n = 1 if cfg.block_v < Vp else heads_per_step(HV, groups, L // sched[0].shape[0], Kp, Vp, cfg, kernel, B)
    fw = _Forward(B, HV, L, sched[0].shape[0], Kp, Vp, cfg.block_v, groups, dataclasses.replace(cfg, heads=n), o_dtype)
    run = _fused if cfg.pipeline == "fused" else _staged
    return run(fw, q, k, v, g, beta, h0t, sched, save_states, keep)


def _fused(fw: _Forward, q, k, v, g, beta, h0t, sched, save_states, keep):
    """One kernel per (batch, head, V-block) walking the chunks, everything on chip."""

    # The fields of value columns by V-block; the others are written by V-block 0, the later V-blocks
    # writing theirs to a spare chunk past the last (so that no block is visited twice).
    spare = fw.Vp > fw.BV

    def kept_spec(name):
        rows, width = _field(name, fw.C, fw.Kp, fw.Vp)
        if name in _BY_V:
            return pl.BlockSpec((1, fw.n, rows, fw.BV), lambda b, h, vb, c, *_: (b, h, c, vb))
        return pl.BlockSpec((1, fw.n, rows, width), lambda b, h, vb, c, *_: (b, h, jnp.where(vb == 0, c, fw.NC), 0))

    def kept_shape(name):
        return fw.shape(name, None if name in _BY_V else fw.NC + spare)

    fin_shape = jax.ShapeDtypeStruct(h0t.shape, jnp.float32)
    v_spec = fw.v_block()
    outs = pl.pallas_call(
        functools.partial(_fused_kernel, tiles_for(fw.cfg), save_states, keep),
        name="kda_fused",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(fw.B, fw.HV // fw.n, fw.Vp // fw.BV, fw.NC),
            in_specs=[fw.qk(), fw.qk(), v_spec, fw.spec(fw.Kp), fw.beta(), fw.state()],
            out_specs=[fw.o(), fw.state()] + [fw.s_in()] * save_states + [kept_spec(n) for n in keep],
            scratch_shapes=[pltpu.VMEM((fw.n, fw.BV, fw.Kp), jnp.float32)],
        ),
        out_shape=[fw.shape("o"), fin_shape] + [fw.shape("s_in")] * save_states + [kept_shape(n) for n in keep],
        compiler_params=fw.sequential(),
        interpret=fw.interpret,
    )(*sched, q, k, v, g, beta, h0t)
    return outs[0], outs[1], (outs[2] if save_states else None), dict(zip(keep, outs[2 + save_states :]))


def _staged(fw: _Forward, q, k, v, g, beta, h0t, sched, save_states, keep):
    """Intra (parallel over chunks) -> state (sequential over chunks) -> output (parallel), through HBM."""
    B, HV, NC, C, Kp, Vp, BV, n = fw.B, fw.HV, fw.NC, fw.C, fw.Kp, fw.Vp, fw.BV, fw.n
    spec3 = lambda d: pl.BlockSpec((1, n, C, d), lambda b, h, c: (b, h, c, 0))

    def chunk_spec(name):  # a field's block of one chunk on grid (b, h, c)
        rows, width = _field(name, C, Kp, Vp)
        return pl.BlockSpec((1, n, rows, width), lambda b, h, c: (b, h, c, 0))

    names = _STAGED + tuple(n for n in keep if n not in _STAGED and n != "v_new")
    staged = pl.pallas_call(
        functools.partial(_intra_kernel, tiles_for(fw.cfg), names),
        name="kda_intra",
        grid=(B, HV // n, NC),
        in_specs=[_qk_spec(n, fw.groups, C, Kp, lambda b, h, c: (b, h, c))] * 2
        + [spec3(Vp), spec3(Kp), _beta_spec(HV, C, lambda b, h, c: (b, 0, c))],
        out_specs=[chunk_spec(n) for n in names],
        out_shape=[fw.shape(n) for n in names],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3, vmem_limit_bytes=vmem_limit()),
        interpret=fw.interpret,
    )(q, k, v, g, beta)
    f = dict(zip(names, staged))
    dec_spec = pl.BlockSpec((1, n, 8, Kp), lambda b, h, vb, c, *_: (b, h, c, 0))
    v_spec, k_spec = fw.v_block(), fw.spec(Kp)
    v_new, s_in, final = pl.pallas_call(
        functools.partial(_state_kernel, tiles_for(fw.cfg)),
        name="kda_state",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, HV // n, Vp // BV, NC),
            in_specs=[k_spec, v_spec, k_spec, dec_spec, fw.state()],
            out_specs=[v_spec, fw.s_in(), fw.state()],
            scratch_shapes=[pltpu.VMEM((n, BV, Kp), jnp.float32)],
        ),
        out_shape=[fw.shape("v_new"), fw.shape("s_in"), jax.ShapeDtypeStruct(h0t.shape, jnp.float32)],
        compiler_params=fw.sequential(),
        interpret=fw.interpret,
    )(*sched, f["w"], f["u"], f["k_d"], f["decay"], h0t)
    o = pl.pallas_call(
        functools.partial(_output_kernel, tiles_for(fw.cfg)),
        name="kda_output",
        grid=(B, HV // n, NC, Vp // BV),
        in_specs=[
            pl.BlockSpec((1, n, C, C), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((1, n, C, Kp), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((1, n, C, BV), lambda b, h, c, vb: (b, h, c, vb)),
            pl.BlockSpec((1, n, 1, BV, Kp), lambda b, h, c, vb: (b, h, c, vb, 0)),
        ],
        out_specs=_tokens(C, BV, n, lambda b, h, c, vb: (b, h * (Vp // BV) + vb, c)),
        out_shape=fw.shape("o"),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 4, vmem_limit_bytes=vmem_limit()),
        interpret=fw.interpret,
    )(f["Aqk"], f["q_g"], v_new, s_in)
    kept = {**f, "v_new": v_new}
    return o, final, (s_in if save_states else None), {n: kept[n] for n in keep}


def _backward(q, k, v, g, beta, sched, S_in, kept, do, dfinal_t, dS_in, groups: int, cfg: Config, dv_dtype):
    """Cotangents of the padded inputs of :func:`_forward`, token-major ([B, L, heads, D]; dq, dk
    summed over each group's value heads; dv in dv_dtype, the others float32), dbeta [B, 1, L, HV].
    kept: {name: field} of the forward's (:func:`_forward`); do: [B, L, HV Vp]; dfinal_t:
    [B, N, HV, Vp, Kp]; dS_in: cotangent of S_in or None."""
    B, HV, L, Vp = v.shape
    H, Kp = k.shape[1], k.shape[-1]
    NC = sched[0].shape[0]
    C = L // NC
    n = heads_per_step(HV, groups, C, Kp, Vp, cfg, "reading" if "w" in kept else "backward", B)
    lockstep = _scaled(LOCKSTEP[cfg.precision], C, Kp, Vp)
    f32 = jnp.float32

    def spec(d, rows=C):
        return pl.BlockSpec((1, n, rows, d), lambda b, h, c, *_: (b, h, NC - 1 - c, 0))

    tok = lambda d: _tokens(C, d, n, lambda b, h, c, *_: (b, h, NC - 1 - c))
    beta_in = _beta_spec(HV, C, lambda b, h, c, *_: (b, 0, NC - 1 - c))
    dbeta_out = _beta_spec(HV, C, lambda b, h, c, *_: (b, h, NC - 1 - c))

    qk = _qk_spec(n, groups, C, Kp, lambda b, h, c, *_: (b, h, NC - 1 - c))
    st = pl.BlockSpec((1, 1, n, Vp, Kp), lambda b, h, c, first, last, seq: (b, seq[NC - 1 - c], h, 0, 0))
    sin = pl.BlockSpec((1, n, 1, Vp, Kp), lambda b, h, c, *_: (b, h, NC - 1 - c, 0, 0))
    fields = [spec(w, rows=r) for r, w in (_field(n, C, Kp, Vp) for n in kept)]
    dh = [] if dS_in is None else [dS_in]
    dq, dk, dv, dg, dbeta, dh0t = pl.pallas_call(
        functools.partial(_bwd_kernel, tiles_for(cfg), lockstep, dS_in is not None, tuple(kept)),
        name="kda_backward",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, HV // n, NC),
            in_specs=[qk, qk, spec(Vp), spec(Kp), beta_in, sin, tok(Vp), st] + [sin] * len(dh) + fields,
            out_specs=[tok(Kp), tok(Kp), tok(Vp), tok(Kp), dbeta_out, st],
            scratch_shapes=[pltpu.VMEM((n, Vp, Kp), f32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, L, HV * d), t) for d, t in ((Kp, f32), (Kp, f32), (Vp, dv_dtype), (Kp, f32))
        ]
        + [jax.ShapeDtypeStruct((B, HV // n, L, HV), f32), jax.ShapeDtypeStruct(dfinal_t.shape, f32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit()
        ),
        interpret=_interpret(cfg),
    )(*sched, q, k, v, g, beta, S_in, do, dfinal_t, *dh, *kept.values())
    dq, dk = (x.reshape(B, L, H, groups, Kp).sum(3) for x in (dq, dk))
    dv, dg = dv.reshape(B, L, HV, Vp), dg.reshape(B, L, HV, Kp)
    return dq, dk, dv, dg, dbeta.sum(1, keepdims=True), dh0t


def _if_empty(empty, x, y):
    """Per sequence: x where the sequence has no tokens (no chunk of its own, so the kernels
    never write its final state or dh0), else y. empty: [N]; x, y: [B, N, ...]."""
    return jnp.where(empty.reshape((1, -1) + (1,) * (x.ndim - 2)), x, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _core(q, k, v, g, beta, h0t, sched, empty, groups, cfg, keep, states, o_dtype):
    o, final, S_in, _ = _forward(q, k, v, g, beta, h0t, sched, groups, cfg, states, (), o_dtype)
    return o, _if_empty(empty, h0t, final), S_in


def _core_fwd(q, k, v, g, beta, h0t, sched, empty, groups, cfg, keep, states, o_dtype):
    o, final, S_in, kept = _forward(q, k, v, g, beta, h0t, sched, groups, cfg, True, _KEPT if keep else _SAVED, o_dtype)
    return (o, _if_empty(empty, h0t, final), S_in if states else None), (q, k, v, g, beta, sched, empty, S_in, kept)


def _core_bwd(groups, cfg, keep, states, o_dtype, res, cts):
    q, k, v, g, beta, sched, empty, S_in, kept = res
    do, dfinal_t, dS_in = cts
    # dv in the caller's dtype (v, unlike q, k, g and beta, reaches the op unchanged): the kernel
    # writes, and XLA's relayout reads, half the bytes (static cycles, docs/kda_tpu.md, Precision)
    dq, dk, dv, dg, dbeta, dh0t = _backward(
        q, k, v, g, beta, sched, S_in, kept, do, dfinal_t, dS_in, groups, cfg, o_dtype
    )
    dq, dk, dv, dg = (jnp.moveaxis(x, 2, 1).astype(jnp.float32) for x in (dq, dk, dv, dg))  # XLA drops (below)
    return dq, dk, dv, dg, dbeta, _if_empty(empty, dfinal_t, dh0t), (None, None, None), None


_core.defvjp(_core_fwd, _core_bwd)


def chunk_kda_pallas_tpu(
    q,
    k,
    v,
    g,
    beta,
    h0,
    layout: ChunkLayout,
    cfg: Config = Config(),
    disable_recompute: bool = False,
    intermediate_states: bool = False,
    input_dtype=jnp.float32,
):
    """Core chunked KDA with the TPU kernels, on prepared float32 inputs (``input_dtype`` the
    caller's, which ``cfg.precision="auto"`` follows).

    q, k: [B, T, H, K] (q scaled, not repeated over value heads); v: [B, T, HV, V];
    g: [B, T, HV, K] natural-log decay; beta: [B, T, HV]; h0: [B, N, HV, K, V].
    disable_recompute: besides the products of levels and inverse the forward saves for a gradient
    (_SAVED), it writes G, R, w, u and v_new (_KEPT), which the backward then reads instead of
    taking them by 0/1 sums and three matmuls.
    Returns (o [B, T, HV, V], final [B, N, HV, K, V]) and with ``intermediate_states`` the
    state entering each chunk [B, NC, HV, K, V] (differentiable; chunks no sequence uses are 0)."""
    cfg = cfg.resolved()
    H, K = q.shape[2:]
    HV, V = v.shape[2:]
    precision = cfg.precision if cfg.precision != "auto" else "bf16" if input_dtype == jnp.bfloat16 else "highest"
    cfg = dataclasses.replace(cfg, precision=precision)
    Kp = round_up(K, LANE)
    Vp = round_up(V, max(LANE, cfg.block_v or LANE))
    cfg = dataclasses.replace(cfg, block_v=min(cfg.block_v or Vp, Vp))
    if cfg.block_v < Vp and cfg.heads not in (None, 1):
        raise ValueError(f"config.heads: with block_v below V a grid step takes one value head, got {cfg.heads}")
    qh, kh, gh = (head_major(layout, x, Kp) for x in (q, k, g))
    vh = head_major(layout, v, Vp)
    bh = layout.pack(beta)[:, None]  # [B, 1, L, HV]: every step reads all heads' (_beta_spec)
    h0t = pad_last(jnp.swapaxes(pad_last(h0, Vp), -1, -2), Kp)  # [B, N, HV, Vp, Kp]
    i32 = jnp.int32
    sched = (layout.chunk_first.astype(i32), layout.chunk_last.astype(i32), layout.chunk_seq)
    o, final, S_in = _core(
        qh,
        kh,
        vh,
        gh,
        bh,
        h0t,
        sched,
        layout.seq_empty,
        HV // H,
        cfg,
        disable_recompute,
        intermediate_states,
        jnp.dtype(input_dtype),
    )
    o = layout.unpack(o.reshape(*o.shape[:2], HV, Vp)[..., :V])
    final = jnp.swapaxes(final, -1, -2)[..., :K, :V]
    if not intermediate_states:
        return o, final
    return o, final, chunk_states(layout, S_in, K, V)


def decode_pads(K: int, V: int) -> tuple[int, int]:
    """K and V as the decode kernel pads them: multiples of 128."""
    return round_up(K, LANE), round_up(V, LANE)


def _decode_launch(q, cfg: Config) -> dict:
    cfg = cfg.resolved()
    params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)
    return {"BV": LANE, "Tp": q.shape[1], "interpret": _interpret(cfg), "params": params}


def fused_recurrent_pallas_tpu(*args, opt: decode.Options, gate_params, cfg: Config):
    """Core recurrent KDA (decoding, draft verification) with the TPU decode kernel
    (:func:`kdax.ops.kda.decode.fused_recurrent`, its arguments and outputs): K and V padded to
    multiples of 128."""
    Kp, Vp = decode_pads(args[0].shape[-1], args[2].shape[-1])
    return decode.fused_recurrent(*args, opt=opt, gate_params=gate_params, Kp=Kp, Vp=Vp, **_decode_launch(args[0], cfg))


def fused_recurrent_slots_pallas_tpu(*args, opt: decode.Options, gate_params, cfg: Config, v_first: bool):
    """The TPU decode kernel on a state pool in HBM, each row's state copied in and out by DMA
    (:func:`kdax.ops.kda.decode.fused_recurrent_slots`, its arguments and outputs)."""
    launch = _decode_launch(args[0], cfg)
    return decode.fused_recurrent_slots(*args, opt=opt, gate_params=gate_params, v_first=v_first, dma=True, **launch)
