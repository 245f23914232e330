"""The GPU kernels' bodies (docs/kda_gpu.md, "Kernels"), and how they take g (:class:`Gate`) and
q, k (:class:`QK`). Each works on refs of one program's blocks; :mod:`.calls` launches them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kdax.ops.common.arrays import LOG2E
from kdax.ops.kda.gate import L2NORM_EPS, l2norm, log_decay, softplus_exp2
from kdax.ops.kda.tiles import StateProducts, Tiles, last_row


@dataclasses.dataclass(frozen=True)
class Gate:
    """How the kernels get the natural-log decay from their g input: as it is, or (``logits``)
    from raw gate logits by :func:`~kdax.ops.kda.gate.log_decay` with per-head parameters
    p [2, Kp] (row 0 exp(A_log), row 1 dt_bias), so that XLA never writes the float32 decay.
    Padding holds -inf logits, which gives decay 0 as the zero padding of a decay does. The
    kernels take the softplus by :func:`~kdax.ops.kda.gate.softplus_exp2` (a third of the
    instructions); :meth:`vjp` differentiates the exact one."""

    logits: bool = False
    lower_bound: float | None = None

    @property
    def fill(self) -> float:  # of padding slots and key columns
        return -jnp.inf if self.logits else 0.0

    def __call__(self, x, p_ref, cols=slice(None)):  # x [rows, BK] of g, p_ref [2, Kp] or [2, BK] -> float32 decay
        x = x.astype(jnp.float32)
        if not self.logits:
            return x
        a, b = p_ref[pl.ds(0, 1), cols], p_ref[pl.ds(1, 1), cols]
        return jnp.where(x > -jnp.inf, log_decay(x, a, b, self.lower_bound, softplus_exp2), 0.0)

    def vjp(self, g, p, dG):
        """Cotangents of g [B, L, HV, Kp] and p [HV, 2, Kp] from the decay's dG (float32), in XLA;
        padding contributes nothing to dp."""
        if not self.logits:
            return dG.astype(g.dtype), jnp.zeros_like(p)
        real = g > -jnp.inf
        decay = lambda x, p: log_decay(x, p[:, 0], p[:, 1], self.lower_bound)
        _, pull = jax.vjp(decay, jnp.where(real, g.astype(jnp.float32), 0.0), p)
        dg, dp = pull(jnp.where(real, dG, 0.0))
        return dg.astype(g.dtype), dp


@dataclasses.dataclass(frozen=True)
class QK:
    """What the forward's intra kernel does to the q and k rows it reads: the L2 norm of each
    (``l2norm``, with the row sums of squares taken over every key column first) and q times
    ``scale``, so that XLA writes no normalised or scaled copy of q and k in the forward. The
    backward's kernels read the copies :meth:`prepare` makes, and its VJP pulls dq, dk back."""

    l2norm: bool = False
    scale: float = 1.0

    def prepare(self, q, k):  # in XLA, as the intra kernel sees them: q, k [B, L, H, Kp], their dtype
        f32 = jnp.float32
        qn, kn = (l2norm(x.astype(f32)) if self.l2norm else x.astype(f32) for x in (q, k))
        return (qn * self.scale).astype(q.dtype), kn.astype(k.dtype)


def _cols(ref, kb, BK):  # key columns of block kb of a [rows, K] ref
    return ref[:, pl.ds(kb * BK, BK)]


def _cols32(ref, kb, BK):  # the same in float32 (q, k, states: refs in the stored dtype used element-wise)
    return _cols(ref, kb, BK).astype(jnp.float32)


def _put(ref, idx, x):  # ref[idx] = x, rounded to the ref's dtype (intermediates may be bfloat16)
    ref[idx] = x.astype(ref.dtype)


SUB = 16  # rows of the sub-blocks of the intra and levels kernels (the smallest tl.dot)


def _rows(ref, i, S, cols=slice(None)):  # row block i of S rows (columns cols) of a [C, D] ref, float32
    return ref[pl.ds(i * S, S), cols].astype(jnp.float32)


class _BlockGates:
    """The log2 gates of a chunk's nb row blocks (for the levels kernel), from the natural-log
    per-step gates ``g_rows(i)`` [S, D] of each: every decay exponent it needs is a sum of steps
    built from per-block sums (never a difference of cumulative gates, whose rounding, eps |G|,
    would reach the decay factors; docs/kda_xla.md)."""

    def __init__(self, tiles: Tiles, g_rows, nb: int):
        self.g = [g_rows(i) * LOG2E for i in range(nb)]  # per-step, [S, D]
        self.prefix = [tiles.cumsum(x) for x in self.g]  # steps from the block's first row to row i
        self.suffix = [tiles.suffix_sums(x, inclusive=False) for x in self.g]  # steps after row i in the block
        self.total = [last_row(x) for x in self.prefix]  # [1, D]

    def span(self, a: int, b: int):  # steps of blocks a..b-1, [1, D] (0 when empty)
        return sum(self.total[a:b], 0.0)

    def between(self, j: int, i: int):  # G_r - G on block j's rows, r the last row of block i - 1 (j < i)
        return self.suffix[j] + self.span(j + 1, i)


def diag_kernel(tiles, gate, qk, BK, q_ref, k_ref, g_ref, gp_ref, b_ref, aqk_ref, kkk_ref, t_ref, *scale_ref):
    """Grid (B, HV, row blocks of S): the diagonal S x S blocks of Aqk and Kkk by the dyadic
    levels (``Tiles.pairs``, summed over key blocks of BK) and T_ii = (I + beta Kkk_ii)^-1, so
    that the intra kernel's key walk carries only the off-diagonal products (docs/kda_gpu.md).
    With ``qk.l2norm`` also the factors of the rows of q and k [S, 2] (scale / ||q||, 1 / ||k||)."""
    f32, S, n_kb = jnp.float32, aqk_ref.shape[0], q_ref.shape[1] // BK
    q_scale, k_scale = qk.scale, 1.0
    if qk.l2norm:

        def squares(kb, acc):
            return tuple(
                a + jnp.sum(_cols32(r, kb, BK) ** 2, axis=1, keepdims=True) for a, r in zip(acc, (q_ref, k_ref))
            )

        ss_q, ss_k = lax.fori_loop(0, n_kb, squares, (jnp.zeros((S, 1), f32),) * 2)
        q_scale, k_scale = qk.scale * lax.rsqrt(ss_q + L2NORM_EPS), lax.rsqrt(ss_k + L2NORM_EPS)
        scale_ref[0][:, pl.ds(0, 1)], scale_ref[0][:, pl.ds(1, 1)] = q_scale, k_scale

    def pairs(kb, acc):
        cols = pl.ds(kb * BK, BK)
        g = gate(_cols(g_ref, kb, BK), gp_ref, cols) * LOG2E
        A, Kk = tiles.pairs(_cols32(q_ref, kb, BK) * q_scale, _cols32(k_ref, kb, BK) * k_scale, g)
        return acc[0] + A, acc[1] + Kk

    zero = jnp.zeros((S, S), f32)
    Aqk, Kkk = lax.fori_loop(0, n_kb, pairs, (zero, zero))
    _put(aqk_ref, ..., Aqk)
    kkk_ref[...] = Kkk
    t_ref[...] = tiles.unit_lower_inverse(b_ref[...].astype(f32) * Kkk)


def _solve(tiles, Aqk, Kkk, aqkd_ref, kkkd_ref, td_ref, b_ref, aqk_ref, *pair_refs):
    """The intra kernel's [C, C] blocks from the off-diagonal sums Aqk, Kkk {(i, j > i): [S, S]} and
    the diag kernel's blocks: stores Aqk (and with ``pair_refs`` Kkk and T) and returns T's blocks
    {(i, j <= i)}, T_ij = -T_ii sum_{j <= m < i} beta_i Kkk_im T_mj (float32)."""
    S = aqkd_ref.shape[1]
    nb, zero = aqkd_ref.shape[0] // S, jnp.zeros((S, S), jnp.float32)

    def store(ref, blocks):
        for i in range(nb):
            for j in range(nb):
                _put(ref, (pl.ds(i * S, S), pl.ds(j * S, S)), blocks[i, j] if j <= i else zero)

    for i in range(nb):  # Aqk stored first, so that its tiles are dead before T's are made
        Aqk[i, i] = _rows(aqkd_ref, i, S)
    store(aqk_ref, Aqk)
    T, wide = {}, tiles.wide
    for i in range(nb):
        Kkk[i, i], T[i, i], beta = _rows(kkkd_ref, i, S), _rows(td_ref, i, S), _rows(b_ref, i, S)
        for j in range(i):
            T[i, j] = -wide.dot(T[i, i], sum(wide.dot(beta * Kkk[i, m], T[m, j]) for m in range(j, i)))
    for ref, blocks in zip(pair_refs, (Kkk, T)):
        store(ref, blocks)
    return T


def intra_kernel(tiles, gate, qk, BK, BV, interpret, solve, q_ref, k_ref, v_ref, g_ref, gp_ref, b_ref, *refs):
    """Grid (B, HV, chunks). With ``solve``, reads the diag kernel's outputs: the diagonal
    blocks of Aqk, Kkk and T [C, S] and with ``qk.l2norm`` the factors of the rows of q and k
    [C, 2]; writes Aqk [C, C], w, q_g, k_d [C, K], u [C, V], decay [1, K], and for the backward
    (two more refs) Kkk and T [C, C]. Without (the backward's recompute), reads T [C, C] as
    the forward wrote it and writes w, u, q_g, k_d and decay only.

    Works on row blocks of SUB: block (i, j < i) of Aqk and Kkk by one product around the
    reference row just before block i (both factors <= 1); T by block forward substitution.
    Walks the key columns in blocks of BK twice: summing the off-diagonal blocks and writing
    q_g, k_d, decay and, in w's place, beta k_g (in w's dtype, which the bulk matmuls round
    to); then w = T (beta k_g); and the value columns in blocks of BV for u = T (beta v)."""
    n_in = 3 + qk.l2norm if solve else 1  # the diagonal blocks (and the row factors), or the forward's T
    ins, outs = refs[:n_in], refs[n_in:]
    aqk_ref, outs = (outs[0], outs[1:]) if solve else (None, outs)
    w_ref, u_ref, qg_ref, kd_ref, dec_ref, *pair_refs = outs
    scale_ref = ins[3:]
    C, f32 = w_ref.shape[0], jnp.float32
    S = min(SUB, C)
    nb = C // S
    lower = [(i, j) for i in range(nb) for j in range(i)] if solve else []

    def rows(ref, i, kb=None):  # row block i (key columns of block kb) of a [C, D] ref, float32
        return _rows(ref, i, S, slice(None) if kb is None else pl.ds(kb * BK, BK))

    def qk_rows(i, kb):  # row block i of q and k as the math sees them (normalised, q scaled)
        q, k = rows(q_ref, i, kb), rows(k_ref, i, kb)
        if not qk.l2norm:
            return q * qk.scale, k
        return q * _rows(scale_ref[0], i, S, pl.ds(0, 1)), k * _rows(scale_ref[0], i, S, pl.ds(1, 1))

    n_kb = q_ref.shape[1] // BK

    def pairs(kb, acc):  # one row block at a time, so that few [S, BK] tiles are live beside the accumulators
        cols = pl.ds(kb * BK, BK)
        acc, k_r, totals = list(acc), [], []  # k_r: k 2^(steps after the row to its block's end); block totals
        for i in range(nb):
            q, k = qk_rows(i, kb)
            g = gate(rows(g_ref, i, kb), gp_ref, cols) * LOG2E  # per-step log2 gate
            prefix = tiles.cumsum(g)
            e_q = jnp.exp2(prefix)  # 2^(G - G_r), r the row before block i
            q_e, k_e = q * e_q, k * e_q
            for j in range(i if solve else 0):  # (q_i e_q)(k_j 2^(G_r - G_j))^T: k_r[j] times its blocks' spans
                k_u = k_r[j] * jnp.exp2(sum(totals[j + 1 : i], 0.0))
                n = lower.index((i, j))
                acc[2 * n] += tiles.dot_t(q_e, k_u)
                acc[2 * n + 1] += tiles.dot_t(k_e, k_u)
            e_r = jnp.exp2(sum(totals, 0.0))  # 2^(G_r) of the chunk's start: q_g = q 2^G, k_g
            _put(qg_ref, (pl.ds(i * S, S), cols), q_e * e_r)
            _put(w_ref, (pl.ds(i * S, S), cols), rows(b_ref, i) * k_e * e_r)
            k_r.append(k * jnp.exp2(tiles.suffix_sums(g, inclusive=False)))
            totals.append(last_row(prefix))
        for i in range(nb):  # k_d = k 2^(G_C - G)
            _put(kd_ref, (pl.ds(i * S, S), cols), k_r[i] * jnp.exp2(sum(totals[i + 1 :], 0.0)))
        _put(dec_ref, (slice(None), cols), jnp.exp2(sum(totals)))
        return tuple(acc)

    zero = jnp.zeros((S, S), f32)
    acc = lax.fori_loop(0, n_kb, pairs, (zero,) * (2 * len(lower)))
    if solve:
        T = _solve(
            tiles, dict(zip(lower, acc[0::2])), dict(zip(lower, acc[1::2])), *ins[:3], b_ref, aqk_ref, *pair_refs
        )
    else:
        T = {(i, j): ins[0][pl.ds(i * S, S), pl.ds(j * S, S)].astype(f32) for i in range(nb) for j in range(i + 1)}

    def values(vb, carry):  # u = T (beta v), BV value columns at a time (few live tiles)
        cols = pl.ds(vb * BV, BV)
        bv = [rows(b_ref, j) * _rows(v_ref, j, S, cols) for j in range(nb)]
        for i in range(nb):
            _put(u_ref, (pl.ds(i * S, S), cols), sum(tiles.dot(T[i, j], bv[j]) for j in range(i + 1)))
        return carry

    lax.fori_loop(0, v_ref.shape[1] // BV, values, 0)

    def barrier():  # every thread's global loads and stores so far before any thread's next ones (GPU only)
        if not interpret:
            pltriton.debug_barrier()

    barrier()  # the stores of beta k_g before its loads

    def outputs(kb, carry):  # w = T (beta k_g) in place of beta k_g, once every thread has loaded the block
        cols = pl.ds(kb * BK, BK)
        bk_g = [rows(w_ref, i, kb) for i in range(nb)]
        barrier()
        for i in range(nb):
            _put(w_ref, (pl.ds(i * S, S), cols), sum(tiles.dot(T[i, j], bk_g[j]) for j in range(i + 1)))
        return carry

    lax.fori_loop(0, n_kb, outputs, 0)


def _chunk(ref, c, C):  # rows of chunk c of a [slots, D] ref
    return ref[pl.ds(c * C, C), :]


def _decay_row(dec_ref, c):  # [1, K] row c of the chunks' decays [NC, K], c clamped to the chunks (float32)
    return dec_ref[pl.ds(jnp.clip(c, 0, dec_ref.shape[0] - 1), 1), :]


def state_kernel(tiles, C, start_ref, end_ref, w_ref, u_ref, kd_ref, dec_ref, h0_ref, vn_ref, sin_ref, fin_ref):
    """Grid (B, N, HV, V-blocks): walk sequence n's chunks; per chunk store S_in and
    v_new = u - w S, then S <- S decay + v_new^T k_d. Refs span the whole slot axis."""
    n, start = pl.program_id(1), start_ref[pl.program_id(1)]

    def step(c, carry):
        St, decay = carry
        decay_next = _decay_row(dec_ref, c + 1)  # a step ahead: its load is not on the chain of S
        w, k_d = _chunk(w_ref, c, C), _chunk(kd_ref, c, C)
        _put(sin_ref, c, St)
        v_new = _chunk(u_ref, c, C) - tiles.dot_t(w, St)
        _put(vn_ref, (pl.ds(c * C, C), slice(None)), v_new)
        return St * decay + tiles.t_dot(v_new, k_d), decay_next

    fin_ref[...] = lax.fori_loop(start, end_ref[n], step, (h0_ref[...], _decay_row(dec_ref, start)))[0]


def output_kernel(tiles, aqk_ref, qg_ref, vn_ref, sin_ref, o_ref):
    """Grid (B, HV, chunks, V-blocks): o = q_g S_in + Aqk v_new."""
    _put(o_ref, ..., tiles.dot_t(qg_ref[...], sin_ref[...]) + tiles.dot(aqk_ref[...], vn_ref[...]))


def dstate_kernel(tiles, C, start_ref, end_ref, aqk_ref, qg_ref, kd_ref, w_ref, dec_ref, do_ref, df_ref, *refs):
    """Grid (B, N, HV, V-blocks): walk sequence n's chunks last to first with the state
    cotangent dSt [BV, K]; store, per chunk, the cotangent of the state leaving it. With three
    refs left, the first is the cotangent of the states entering the chunks [NC, BV, K]."""
    *dh_ref, dso_ref, dh0_ref = refs
    n = pl.program_id(1)
    start, end = start_ref[n], end_ref[n]

    def step(i, carry):
        dSt, decay = carry
        c = end - 1 - i
        decay_next = _decay_row(dec_ref, c - 1)  # a step ahead, as in the state kernel
        _put(dso_ref, c, dSt)
        do = _chunk(do_ref, c, C)
        dv_new = tiles.t_dot(_chunk(aqk_ref, c, C), do) + tiles.dot_t(_chunk(kd_ref, c, C), dSt)
        dS_in = tiles.t_dot(do, _chunk(qg_ref, c, C)) + dSt * decay - tiles.t_dot(dv_new, _chunk(w_ref, c, C))
        return (dS_in + dh_ref[0][c].astype(jnp.float32) if dh_ref else dS_in), decay_next

    dh0_ref[...] = lax.fori_loop(0, end - start, step, (df_ref[...], _decay_row(dec_ref, end - 1)))[0]


def values_kernel(
    tiles,
    BK,
    BV,
    kept,
    aqk_ref,
    t_ref,
    w_ref,
    kd_ref,
    u_ref,
    v_ref,
    b_ref,
    sin_ref,
    do_ref,
    dso_ref,
    vn_ref,
    dvn_ref,
    dv_ref,
    daqk_ref,
    dakku_ref,
    dbeta_v_ref,
    d_ref,
):
    """Grid (B, HV, chunks): walks the value columns in blocks of BV: v_new = u - w S (an input,
    the forward's, if ``kept``; else computed and written) and its cotangent dv_new (each
    summed over blocks of BK key columns), then the block's terms (``Tiles.grads_values``),
    summing the [C, C] and [C, 1] ones."""
    aqk, T, beta, f32 = aqk_ref[...], t_ref[...], b_ref[...], jnp.float32

    def values(vb, acc):
        vc = pl.ds(vb * BV, BV)
        do = do_ref[:, vc]

        def keys(kb, vd):
            kc = pl.ds(kb * BK, BK)
            dv_new = vd[-1] + tiles.dot_t(_cols(kd_ref, kb, BK), dso_ref[vc, kc])
            return (dv_new,) if kept else (vd[0] - tiles.dot_t(_cols(w_ref, kb, BK), sin_ref[vc, kc]), dv_new)

        u = u_ref[:, vc].astype(f32)
        dv_new_o = tiles.t_dot(aqk, do)
        *new, dv_new = lax.fori_loop(0, w_ref.shape[1] // BK, keys, (dv_new_o,) if kept else (u, dv_new_o))
        v_new = vn_ref[:, vc].astype(f32) if kept else new[0]
        Vg = tiles.grads_values(T, u, v_ref[:, vc], do, v_new, dv_new)
        for ref, x in [(dvn_ref, dv_new), (dv_ref, beta * Vg.dbv)] + ([] if kept else [(vn_ref, v_new)]):
            _put(ref, (slice(None), vc), x)
        return tuple(a + x for a, x in zip(acc, (Vg.dAqk, Vg.dAkk_u, Vg.dbeta, Vg.d)))

    C = aqk.shape[0]
    zeros = (jnp.zeros((C, C), f32),) * 2 + (jnp.zeros((C, 1), f32),) * 2
    sums = lax.fori_loop(0, u_ref.shape[1] // BV, values, zeros)
    for ref, x in zip((daqk_ref, dakku_ref, dbeta_v_ref, d_ref), sums):
        ref[...] = x


def keys_kernel(
    tiles,
    gate,
    BK,
    BV,
    q_ref,
    k_ref,
    g_ref,
    gp_ref,
    b_ref,
    kkk_ref,
    t_ref,
    w_ref,
    sin_ref,
    dso_ref,
    do_ref,
    vn_ref,
    dvn_ref,
    d_ref,
    dakku_ref,
    dbeta_v_ref,
    dkkk_ref,
    db_ref,
    dq_ref,
    dk_ref,
    dg_ref,
):
    """Grid (B, HV, chunks): walks the key columns in blocks of BK for the column-wise gradients
    (``Tiles.grads_keys``), summing the [C, C] and [C, 1] terms for dKkk and dbeta; each
    block's products with the states (``Tiles.state_products``) summed over blocks of BV value
    columns."""
    beta, T, d, f32 = b_ref[...], t_ref[...], d_ref[...], jnp.float32
    C = T.shape[0]

    def keys(kb, acc):
        cols = pl.ds(kb * BK, BK)

        def values(vb, P):
            vc = pl.ds(vb * BV, BV)
            Pb = tiles.state_products(
                sin_ref[vc, cols], dso_ref[vc, cols], do_ref[:, vc], vn_ref[:, vc], dvn_ref[:, vc]
            )
            return StateProducts(*(a + b for a, b in zip(P, Pb)))

        zero = jnp.zeros((C, BK), f32)
        P = lax.fori_loop(0, do_ref.shape[1] // BV, values, StateProducts(zero, zero, zero, jnp.zeros((1, BK), f32)))
        g = gate(_cols(g_ref, kb, BK), gp_ref, cols) * LOG2E
        G, R = tiles.cumsum(g), tiles.suffix_sums(g) - g  # the 0/1 matrix gate_terms takes: one in registers
        Kg = tiles.grads_keys(_cols32(q_ref, kb, BK), _cols32(k_ref, kb, BK), beta, G, R, T, _cols(w_ref, kb, BK), P, d)
        dq_ref[:, cols], dk_ref[:, cols], dg_ref[:, cols] = Kg.dq, Kg.dk, tiles.gate_terms(Kg)
        return acc[0] + Kg.dAkk_w, acc[1] + Kg.dbeta

    dAkk, dbeta = lax.fori_loop(0, q_ref.shape[1] // BK, keys, (dakku_ref[...], dbeta_v_ref[...]))
    dkkk_ref[...], db_ref[...] = tiles.grads_pairs(beta, kkk_ref[...], dAkk, dbeta)


def diag_grads_kernel(
    tiles, gate, BK, q_ref, k_ref, g_ref, gp_ref, daqk_ref, dkkk_ref, dq_ref, dk_ref, dg_ref, dq_out, dk_out, dg_out
):
    """Grid (B, HV, row blocks of S): adds the diagonal S x S blocks' share of dq, dk and dg
    (``Tiles.grads_levels`` on the block's rows, each pair's gate term over the steps it spans)
    to the keys kernel's partials in place (the outputs alias them), key blocks of BK at a time."""
    dAqk, dKkk = daqk_ref[...], dkkk_ref[...]

    def keys(kb, carry):
        cols = pl.ds(kb * BK, BK)
        g = gate(_cols(g_ref, kb, BK), gp_ref, cols) * LOG2E
        dq, dk, dg = tiles.grads_levels(_cols32(q_ref, kb, BK), _cols32(k_ref, kb, BK), g, dAqk, dKkk)
        for ref, out, x in ((dq_ref, dq_out, dq), (dk_ref, dk_out, dk), (dg_ref, dg_out, dg)):
            out[:, cols] = ref[:, cols] + x
        return carry

    lax.fori_loop(0, q_ref.shape[1] // BK, keys, 0)


def levels_kernel(
    tiles, gate, q_ref, k_ref, g_ref, gp_ref, daqk_ref, dkkk_ref, dq_ref, dk_ref, dg_ref, dq_out, dk_out, dg_out
):
    """Grid (B, HV, chunks, K-blocks): add the share of the off-diagonal blocks of the pair
    products Aqk and Kkk to dq, dk and dg (the diagonal blocks' share is in them already:
    :func:`diag_grads_kernel`), on the intra kernel's row blocks, each through its two
    factors. One row block at a time, last first, loading the others' rows as needed (few
    live tiles). Each pair (i, j) enters dg at the steps its
    decay spans, j < t <= i: in block m, the row terms of its pairs (m, j < m) summed over rows
    >= t, the column terms of its pairs (i > m, m) over rows < t, and in full every pair that
    straddles the block (i > m > j), so that no pair's terms cancel. Float32 operands
    (``Tiles.wide``)."""
    C, wide = daqk_ref.shape[0], tiles.wide
    S = min(SUB, C)
    nb = C // S
    gb = _BlockGates(tiles, lambda i: gate(_rows(g_ref, i, S), gp_ref), nb)

    def pair(ref, i, j):  # block (i, j) of a [C, C] ref
        return ref[pl.ds(i * S, S), pl.ds(j * S, S)]

    straddling = [0.0] * nb  # per block j: column sums of the row terms of the pairs (i, j) of blocks i done so far
    for m in reversed(range(nb)):
        q_m, k_m = _rows(q_ref, m, S), _rows(k_ref, m, S)
        dq = dk = 0.0
        dg = sum(straddling[:m], 0.0)  # pairs (i > m, j < m), all done before block m
        e_q, row_terms, col_terms = jnp.exp2(gb.prefix[m]), 0.0, 0.0
        for j in range(m):  # blocks (m, j) = (x_m e_q)(k_j e_k)^T, e_q = 2^(G_m - G_r), e_k = 2^(G_r - G_j): x_m's side
            k_u = _rows(k_ref, j, S) * jnp.exp2(gb.between(j, m))
            dq_m, dk_m = wide.dot(pair(daqk_ref, m, j), k_u) * e_q, wide.dot(pair(dkkk_ref, m, j), k_u) * e_q
            terms = q_m * dq_m + k_m * dk_m
            dq, dk, row_terms = dq + dq_m, dk + dk_m, row_terms + terms
            straddling[j] = straddling[j] + jnp.sum(terms, axis=0, keepdims=True)
        for i in range(m + 1, nb):  # blocks (i, m): k_m's side
            e_qi = jnp.exp2(gb.prefix[i])
            dk_m = wide.t_dot(pair(daqk_ref, i, m), _rows(q_ref, i, S) * e_qi)
            dk_m = (dk_m + wide.t_dot(pair(dkkk_ref, i, m), _rows(k_ref, i, S) * e_qi)) * jnp.exp2(gb.between(m, i))
            dk, col_terms = dk + dk_m, col_terms + k_m * dk_m
        if m:
            dg = dg + tiles.suffix_sums(row_terms)
        if m + 1 < nb:
            dg = dg + tiles.prefix_sums(col_terms, inclusive=False)
        rows = (pl.ds(m * S, S), slice(None))
        _put(dq_out, rows, dq_ref[rows] + dq)
        _put(dk_out, rows, dk_ref[rows] + dk)
        dg_out[rows] = dg_ref[rows] + dg
