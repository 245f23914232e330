"""The chunk math of KDA on whole tiles, shared by the Pallas kernels (TPU and GPU).

One chunk of C rows at a time, with only matmuls, masks built from iotas and
element-wise maps on full ``[C, K]`` / ``[C, C]`` tiles: no sub-tile slices or
reshapes, which neither Mosaic nor Triton lowers well. Gates are in log2 units
(``exp2``). The formulas are those of docs/kda_xla.md; docs/kda_tpu.md explains the
full-tile forms.

:class:`Tiles` fixes how the bulk matmuls run (their precision) and how row sums are
taken; the gate cumsums and one-hot gathers are always exact (``HIGHEST``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda.xla import dyadic_levels

_HIGHEST = lax.Precision.HIGHEST


def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _ones_where(cond):  # float32 0/1 matrix (explicit dtype: no float64 under jax_enable_x64)
    return jnp.where(cond, jnp.float32(1), jnp.float32(0))


def _block(x, s: int):  # x // s for a power of two s (shifts: integer division lowers through sign on TPU)
    return x >> (s.bit_length() - 1)


def _in_block(x, s: int):  # x % s
    return x & (s - 1)


def _mm(a, b, dims, precision):
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _exact(a, b):  # a @ b at full float32 precision (cumsums, one-hot gathers)
    return _mm(a, b, ((1,), (0,)), _HIGHEST)


def _last_row(x):  # [C, D] -> [1, D]
    return jnp.sum(jnp.where(_iota((x.shape[0], 1), 0) == x.shape[0] - 1, x, 0.0), axis=0, keepdims=True)


class Intra(NamedTuple):
    """One chunk's state-free quantities."""

    G: jax.Array  # [C, K] cumulative log2 gate
    Aqk: jax.Array  # [C, C] inclusive lower
    Kkk: jax.Array  # [C, C] strictly lower, before beta
    T: jax.Array  # [C, C] (I + beta Kkk)^-1
    w: jax.Array  # [C, K]
    u: jax.Array  # [C, V]
    q_g: jax.Array  # [C, K] q 2^G
    k_g: jax.Array  # [C, K] k 2^G
    k_d: jax.Array  # [C, K] k 2^(G_C - G)
    decay: jax.Array  # [1, K] 2^G_C


class Grads(NamedTuple):
    dq: jax.Array  # [C, K]
    dk: jax.Array  # [C, K]
    dv: jax.Array  # [C, V]
    dg: jax.Array  # [C, K] w.r.t. the natural-log gate
    dbeta: jax.Array  # [C, 1]
    dS_in: jax.Array  # [V, K] cotangent of the state entering the chunk (transposed)


def _level(G: jax.Array, s: int):
    """Dyadic level s of the pairwise factorisation (docs/kda_xla.md), as full tiles.

    Row i in the lower half of its s-block scales by el = 2^(G_i - G_r), row j in the
    upper half by eu = 2^(G_r - G_j), r the block's middle row: both exponents are <= 0
    where used, -inf elsewhere. ``block`` [C, C] marks the (lower, upper) pairs of the level."""
    C = G.shape[0]
    i, j = _iota((C, C), 0), _iota((C, C), 1)
    h = s // 2
    R = _exact(_ones_where(j == i - _in_block(i, s) + h), G)  # [C, K] G of each row's reference row
    lower = _in_block(_iota((C, 1), 0), s) >= h  # [C, 1]
    el = jnp.exp2(jnp.where(lower, G - R, -jnp.inf))
    eu = jnp.exp2(jnp.where(lower, -jnp.inf, R - G))
    block = (_block(i, s) == _block(j, s)) & (_in_block(i, s) >= h) & (_in_block(j, s) < h)
    return el, eu, block


@dataclasses.dataclass(frozen=True)
class Tiles:
    """precision: of the bulk matmuls (``lax.Precision``; on GPU HIGHEST is IEEE float32,
    DEFAULT TF32). matmul_rowsum: take row sums as a matmul with ones (TPU, where a
    lane reduction to ``[C, 1]`` lowers poorly) or as a reduction (GPU, where a matmul
    needs every dimension >= 16)."""

    precision: lax.Precision = _HIGHEST
    matmul_rowsum: bool = True

    def dot(self, a, b):  # a @ b
        return _mm(a, b, ((1,), (0,)), self.precision)

    def dot_t(self, a, b):  # a @ b^T
        return _mm(a, b, ((1,), (1,)), self.precision)

    def t_dot(self, a, b):  # a^T @ b
        return _mm(a, b, ((0,), (0,)), self.precision)

    def rowsum(self, x):  # [C, D] -> [C, 1]
        if self.matmul_rowsum:
            return _mm(x, jnp.ones((1, x.shape[1]), jnp.float32), ((1,), (1,)), _HIGHEST)
        return jnp.sum(x, axis=1, keepdims=True)

    def diag(self, x, y):  # [C, C] with the row dot products x_i . y_i on the diagonal
        C = x.shape[0]
        return jnp.where(_iota((C, C), 0) == _iota((C, C), 1), self.rowsum(x * y), 0.0)

    def unit_lower_inverse(self, A: jax.Array) -> jax.Array:
        """``(I + strict_lower(A))^-1`` for A: [C, C], C a power of two, by masked full-size matmuls.

        Doubling h = 1, 2, ..., C/2 with T block diagonal in blocks of h: T <- T - T A_h T,
        A_h holding the lower-left h x h block of every 2h diagonal block. That is the block
        forward substitution [[T11, 0], [-T22 A21 T11, T22]] for all blocks at once; the
        masked-out entries only add exact zeros."""
        C = A.shape[-1]
        i, j = _iota((C, C), 0), _iota((C, C), 1)
        T = _ones_where(i == j)
        h = 1
        while h < C:
            s = 2 * h
            off = (_block(i, s) == _block(j, s)) & (_in_block(i, s) >= h) & (_in_block(j, s) < h)
            T = T - self.dot(T, self.dot(jnp.where(off, A, 0.0), T))
            h = s
        return T

    def intra(self, q, k, v, g, beta) -> Intra:
        """q, k: [C, K]; v: [C, V]; g: [C, K] per-step log2 gate; beta: [C, 1] (all float32).

        Aqk[i, j] = sum_d q_id k_jd 2^(G_id - G_jd) (j <= i) and Kkk likewise (j < i), one
        masked [C, K] x [K, C] matmul per dyadic level (:func:`_level`)."""
        C = k.shape[0]
        i, j = _iota((C, C), 0), _iota((C, C), 1)
        G = _exact(_ones_where(i >= j), g)  # [C, K] inclusive cumsum
        Aqk = self.diag(q, k)
        Kkk = jnp.zeros((C, C), jnp.float32)
        for s in dyadic_levels(C):
            el, eu, block = _level(G, s)
            k_u = k * eu
            Aqk = Aqk + jnp.where(block, self.dot_t(q * el, k_u), 0.0)
            Kkk = Kkk + jnp.where(block, self.dot_t(k * el, k_u), 0.0)
        T = self.unit_lower_inverse(beta * Kkk)
        eG = jnp.exp2(G)
        G_end = _last_row(G)
        k_g = k * eG
        w = self.dot(T, beta * k_g)
        u = self.dot(T, beta * v)
        return Intra(G, Aqk, Kkk, T, w, u, q * eG, k_g, k * jnp.exp2(G_end - G), jnp.exp2(G_end))

    def grads(self, q, k, v, g, beta, St, do, dSt) -> Grads:
        """Backward of one chunk. St, dSt: [V, K] the entering state and the cotangent of the
        leaving one (both transposed); do: [C, V]; the rest as :meth:`intra`.
        The formulas are those of docs/kda_xla.md (Backward)."""
        C = k.shape[0]
        i, j = _iota((C, C), 0), _iota((C, C), 1)
        I = self.intra(q, k, v, g, beta)
        v_new = I.u - self.dot_t(I.w, St)  # [C, V]
        dv_new = self.t_dot(I.Aqk, do) + self.dot_t(I.k_d, dSt)
        dS_in = self.t_dot(do, I.q_g) + dSt * I.decay - self.t_dot(dv_new, I.w)  # [V, K]
        dq_g = self.dot(do, St)
        dAqk = jnp.where(i >= j, self.dot_t(do, v_new), 0.0)
        dk_d = self.dot(v_new, dSt)
        dw = -self.dot(dv_new, St)
        ddecay = I.decay * jnp.sum(St * dSt, axis=0, keepdims=True)  # [1, K]
        dbk_g, dbv = self.t_dot(I.T, dw), self.t_dot(I.T, dv_new)  # (I + Akk)^-T [dw du]
        dAkk = jnp.where(i > j, -(self.dot_t(dbk_g, I.w) + self.dot_t(dbv, I.u)), 0.0)
        dbeta = self.rowsum(v * dbv) + self.rowsum(I.k_g * dbk_g) + self.rowsum(dAkk * I.Kkk)
        dk_g, dKkk = beta * dbk_g, beta * dAkk
        dq_p = dk_p = dk_x = dk_y = jnp.zeros_like(k)
        for s in dyadic_levels(C):
            el, eu, block = _level(I.G, s)
            dQ, dK = jnp.where(block, dAqk, 0.0), jnp.where(block, dKkk, 0.0)
            k_u = k * eu
            dq_p = dq_p + self.dot(dQ, k_u) * el
            dk_p = dk_p + self.t_dot(dQ, q * el) * eu
            dk_x = dk_x + self.dot(dK, k_u) * el
            dk_y = dk_y + self.t_dot(dK, k * el) * eu
        d = self.rowsum(jnp.where(i == j, dAqk, 0.0))  # [C, 1] diagonal of dAqk
        eG = jnp.exp2(I.G)
        dq = eG * dq_g + dq_p + d * k
        dk = eG * dk_g + jnp.exp2(_last_row(I.G) - I.G) * dk_d + dk_p + d * q + dk_x + dk_y
        dG = I.q_g * dq_g + I.k_g * dk_g - I.k_d * dk_d + q * dq_p - k * dk_p + k * dk_x - k * dk_y
        dG_end = jnp.sum(I.k_d * dk_d, axis=0, keepdims=True) + ddecay  # [1, K]
        dg = _exact(_ones_where(i <= j), dG) + dG_end  # reverse cumsum
        return Grads(dq, dk, beta * dbv, dg, dbeta, dS_in)


# ----------------------------------------------------------------------------- wrapper layout


def pad_last(x: jax.Array, n: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])


def head_major(layout: ChunkLayout, x: jax.Array, width: int | None) -> jax.Array:
    """[B, T, heads, D] -> [B, heads, NC * C, width] (packed, D zero-padded to width)."""
    x = jnp.moveaxis(layout.pack(x), 2, 1)
    return x if width is None else pad_last(x, width)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
