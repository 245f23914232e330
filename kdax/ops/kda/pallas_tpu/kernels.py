"""The pallas_tpu backend's kernel bodies (grids, blocks and scratch in each docstring).

A grid step takes n value heads of one chunk; the chunk math is :mod:`kdax.ops.kda.tiles`'s.
Scalar-prefetch refs, per chunk: first (starts its sequence), last (ends it), seq (its id).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kdax.ops.common.arrays import LOG2E
from kdax.ops.kda.tiles import Intra, gated, last_row, unpair

ALL = slice(None)  # all of a step's heads


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
# factorisation or the inverse: Aqk, Kkk and T (SAVED). The backward takes the gate's prefix and
# suffix sums from g (one 0/1 matmul each), w and u by two matmuls, v_new by a third, and the
# element-wise gated q and k and the chunk's decay. With disable_recompute the forward also
# writes the sums, w, u and v_new (KEPT). The staged forward's intra kernel writes the STAGED
# ones in any case. Aqk and T are only ever bulk matmul operands, so they are stored in the
# precision's operand dtype (bfloat16 for "bf16": the same numbers, half the bytes).
SAVED = ("Aqk", "Kkk", "T")
KEPT = ("G", "R", "Aqk", "Kkk", "T", "w", "u", "v_new")
OPERANDS = ("Aqk", "T")
BY_V = ("u", "v_new")  # the fields of value columns
STAGED = ("Aqk", "w", "u", "q_g", "k_d", "decay")


def _put_fields(refs, names, I: Intra, v_new=None):
    """Write the named fields of I (and v_new) into the [1, n, rows, D] blocks refs; decay
    [n, 1, K] is broadcast over its block's 8 rows, paired heads' [C, C] tiles written head by head."""
    for ref, name in zip(refs, names):
        x = v_new if name == "v_new" else getattr(I, name)
        if name in SAVED and x.shape[0] != ref.shape[1]:  # heads in pairs (Tiles.paired)
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


def fused_kernel(
    tiles, save_states, names, first, last, seq, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, fin_ref, *rest
):
    """Grid (B, head blocks, V-blocks, chunks), n value heads a step. Blocks: g [n, C, K]; q, k
    [n / groups or 1, C, K]; v [n, C, BV]; beta [n, C, 128]; o token-major [C, n BV]; h0, final
    (and S_in if save_states) [n, BV, K]; then the outputs of the named fields (SAVED, KEPT or
    none); scratch St [n, BV, K] carried across chunks."""
    *outs, St = rest
    I = tiles.intra(*_chunk_inputs(q_ref, k_ref, v_ref, g_ref, b_ref))
    S, v_new = _state_step(tiles, first, last, h0_ref, fin_ref, St, I.w, I.u, I.k_d, I.decay)
    if save_states:
        outs[0][0, :, 0] = S
    _put_fields(outs[save_states:], names, I, v_new)
    _join(o_ref, tiles.dot_t(I.q_g, S) + tiles.apply(I.Aqk, v_new))


def intra_kernel(tiles, names, q_ref, k_ref, v_ref, g_ref, b_ref, *out_refs):
    """Grid (B, head blocks, chunks), all parallel. Writes the chunk's named Intra fields, per
    head: Aqk, Kkk, T [C, C], u [C, V], decay [8, K] (row 0, broadcast), the others [C, K]."""
    I = tiles.intra(*_chunk_inputs(q_ref, k_ref, v_ref, g_ref, b_ref))
    _put_fields(out_refs, names, I)


def state_kernel(tiles, first, last, seq, w_ref, u_ref, kd_ref, dec_ref, h0_ref, vn_ref, sin_ref, fin_ref, St):
    """Grid (B, head blocks, V-blocks, chunks): the state pass alone, storing S_in and v_new."""
    S, v_new = _state_step(tiles, first, last, h0_ref, fin_ref, St, w_ref[0], u_ref[0], kd_ref[0], dec_ref[0][:, :1])
    sin_ref[0, :, 0] = S
    vn_ref[0] = v_new


def output_kernel(tiles, aqk_ref, qg_ref, vn_ref, sin_ref, o_ref):
    """Grid (B, head blocks, chunks, V-blocks), all parallel: o = q_g S + Aqk v_new."""
    _join(o_ref, tiles.dot_t(qg_ref[0], sin_ref[0, :, 0]) + tiles.dot(aqk_ref[0], vn_ref[0]))


def bwd_kernel(
    tiles, lockstep, has_dh, names, first, last, seq, q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, do_ref, df_ref, *rest
):
    """Grid (B, head blocks, chunks), n value heads a step, taken ``lockstep`` at a time, chunks
    walked last to first; the cotangent of the state (transposed, [n, V, K]) carried in scratch.
    do comes in and dq, dk, dv, dg go out token-major ([C, n D]), dq and dk per value head.
    Inputs after df: the cotangent of S_in [n, V, K] if has_dh, then the blocks of the forward's
    named fields (SAVED or KEPT)."""
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
        if "w" in f:  # KEPT
            q_g, _, k_d, decay = gated(q, k, f["G"], f["R"], last_row(f["G"]))
            I = Intra(g, **{x: f[x] for x in KEPT if x != "v_new"}, q_g=q_g, k_d=k_d, decay=decay)
        else:
            G, R = tiles.cumsum(g), tiles.suffix_sums(g, inclusive=False)
            I = tiles.from_products(q, k, v, g, beta, G, R, *(f[x] for x in SAVED))
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
