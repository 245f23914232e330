"""The chunk math of KDA on whole tiles, shared by the Pallas kernels (TPU and GPU).

One chunk of C rows at a time, with only matmuls, masks built from iotas and
element-wise maps on full ``[C, K]`` / ``[C, C]`` tiles: no sub-tile slices or
reshapes, which neither Mosaic nor Triton lowers well. Gates are in log2 units
(``exp2``). The formulas are those of docs/kda_xla.md; docs/kda_tpu.md explains the
full-tile forms.

:class:`Tiles` fixes how the bulk matmuls run (their precision), how row sums are taken
and the precision of the 0/1 sums over rows (decay exponents, cumsums, the gate cotangent).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kdax.ops.common.arrays import pad_last, round_tf32
from kdax.ops.common.triangular import dyadic_levels
from kdax.ops.common.varlen import ChunkLayout

_HIGHEST = lax.Precision.HIGHEST
TF32X2 = "tf32x2"  # Tiles.sums: two TF32 products, of the 0/1 matrix with x's TF32 value and with the rest
BF16X3 = "bf16x3"  # Tiles.sums: three bfloat16 products, of the 0/1 matrix with x split into three bfloat16 parts
BF16X2 = "bf16x2"  # Tiles.sums: two of them, of x's first two bfloat16 parts (16 of float32's 24 bits)
_PARTS = {BF16X3: 3, BF16X2: 2}
BF16_HIGH = "bf16_high"  # a matmul precision: both operands as two bfloat16 parts, three products (TPU's HIGH)


def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _ones_where(cond):  # float32 0/1 matrix (explicit dtype: no float64 under jax_enable_x64)
    return jnp.where(cond, jnp.float32(1), jnp.float32(0))


def split_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 x as three bfloat16 parts whose sum is x exactly (each part takes 8 of float32's 24
    significant bits, rounding to nearest leaves at most 16, then 8): a product of a part with 0 or
    1 is exact, so three single-pass bfloat16 matmuls of a 0/1 matrix with the parts sum x's rows
    as float32 would (to float32 rounding of the sums)."""
    x = x.astype(jnp.float32)
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def _block(x, s: int):  # x // s for a power of two s (shifts: integer division lowers through sign on TPU)
    return x >> (s.bit_length() - 1)


def _in_block(x, s: int):  # x % s
    return x & (s - 1)


def _lower_left(i, j, s: int):  # [C, C] mask of (row in the lower half, column in the upper half) of each s-block
    h = s // 2
    return (_block(i, s) == _block(j, s)) & (_in_block(i, s) >= h) & (_in_block(j, s) < h)


def _level_steps(i, j, s: int):  # Tiles.level's mask: the steps between row i and its block's reference row r
    r = i - _in_block(i, s) + s // 2
    lower = i >= r  # bool masks combine with & and | (Mosaic rejects a select over bool arrays)
    return (lower & (r < j) & (j <= i)) | (~lower & (i < j) & (j <= r))


def _straddle_steps(t, i, s: int):  # Tiles.straddle's mask: row t sums rows i of its half-block
    h = s // 2
    lower = _in_block(t, s) >= h
    return (_block(t, h) == _block(i, h)) & ((lower & (i >= t)) | (~lower & (i < t)))


def _high(a, b, dims):
    """:data:`BF16_HIGH` product of float32 tiles a and b as their (hi, lo) bfloat16 parts (16 of
    float32's 24 bits each): hi hi + hi lo + lo hi as one matmul over the concatenated contraction,
    accumulated on the MXU (one set of result pops rather than three)."""
    (da,), (db,) = dims
    a, b = split_bf16(a)[:2], split_bf16(b)[:2]
    a3 = jnp.concatenate((a[0], a[0], a[1]), axis=da - 2)
    b3 = jnp.concatenate((b[0], b[1], b[0]), axis=db - 2)
    return _mm(a3, b3, dims, lax.Precision.DEFAULT)


def _mm(a, b, dims, precision):
    """dot_general of tiles [C, D] with contracting ``dims``, float32 result."""
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _by_head(fn, *xs):
    """fn of tiles [C, D], or head by head of stacks of tiles [n, C, D] (several heads at once; a
    single tile serves every head), stacked. Each head's products are 2D matmuls, their operands
    cast or split inside fn: Mosaic lowers a batched matmul with its bfloat16 operands relaid out,
    2.5 vector ops a float32 vreg, where a 2D one takes them as cast (docs/kda_tpu.md, Precision)."""
    n = next((x.shape[0] for x in xs if x.ndim == 3), None)
    if n is None:
        return fn(*xs)
    return jnp.stack([fn(*(x[h] if x.ndim == 3 else x for x in xs)) for h in range(n)])


def _plus(acc, x):  # acc + x, or x where there is no acc yet (None): a sum of zeros is a tile operation
    return x if acc is None else acc + x


def _bd(P):
    """A pair of heads' tiles side by side, ``P = [P_a | P_b]`` ([..., R, 2C]), as the block diagonal
    [[P_a, 0], [0, P_b]] ([..., 2R, 2C]): ``[X_a | X_b] @ _bd(P)`` is ``[X_a P_a | X_b P_b]`` and
    ``_bd(P) @ [Y_a; Y_b]`` is ``[P_a Y_a; P_b Y_b]``, both heads' products in one matmul."""
    left = _iota(P.shape[-2:], 1) < P.shape[-1] // 2
    return jnp.concatenate((jnp.where(left, P, 0.0), jnp.where(left, 0.0, P)), axis=-2)


def _pair_iotas(M):
    """(row, column) iotas of M's [R, C] tiles, or of [R, 2C] pairs of heads (:attr:`Tiles.paired`):
    the column within its head's tile (C a power of two)."""
    R, W = M.shape[-2:]
    j = _iota((R, W), 1)
    return _iota((R, W), 0), j if W == R else _in_block(j, R)


def _pair_heads(x, width: int):
    """[n, R, 1] per-head values -> [n / 2, R, width]: head 2p's on the left half of pair p's lanes,
    head 2p + 1's on the right."""
    left = _iota((x.shape[-2], width), 1) < width // 2
    return jnp.stack([jnp.where(left, x[2 * p], x[2 * p + 1]) for p in range(x.shape[0] // 2)])


def _is_pairs(M, X) -> bool:  # M holds X's heads in pairs (M [n / 2, ...], X [n, ...])
    return M.ndim == 3 and X.ndim == 3 and 2 * M.shape[0] == X.shape[0]


def unpair(P):
    """[m, C, 2C] pairs of heads' [C, C] tiles side by side -> [2m, C, C], head by head."""
    C = P.shape[-1] // 2
    return jnp.stack([x for p in range(P.shape[0]) for x in (P[p, :, :C], P[p, :, C:])])


def last_row(x):
    """[..., C, D] -> [..., 1, D], the last row, by a masked sum (no dynamic index inside a kernel)."""
    C = x.shape[-2]
    return jnp.sum(jnp.where(_iota((C, 1), 0) == C - 1, x, 0.0), axis=-2, keepdims=True)


def gated(q, k, G, R, G_end):
    """(q 2^G, k 2^G, k 2^R, 2^G_end): [C, K] x3 and [1, K], G the cumulative log2 gate, R the
    exponent of k's decay to the chunk's end (G_C - G) and G_end the chunk's last G."""
    eG = jnp.exp2(G)
    return q * eG, k * eG, k * jnp.exp2(R), jnp.exp2(G_end)


class Intra(NamedTuple):
    """One chunk's state-free quantities: what the backward needs of the forward's intra-chunk stage."""

    g: jax.Array  # [C, K] per-step log2 gate
    G: jax.Array  # [C, K] cumulative log2 gate (prefix sums of g)
    R: jax.Array  # [C, K] G_C - G (exclusive suffix sums of g)
    Aqk: jax.Array  # [C, C] inclusive lower
    Kkk: jax.Array  # [C, C] strictly lower, before beta
    T: jax.Array  # [C, C] (I + beta Kkk)^-1
    w: jax.Array  # [C, K]
    u: jax.Array  # [C, V]
    q_g: jax.Array  # [C, K] q 2^G
    k_d: jax.Array  # [C, K] k 2^(G_C - G)
    decay: jax.Array  # [1, K] 2^G_C


class ValueGrads(NamedTuple):
    """A chunk's backward terms of a block of value columns (:meth:`Tiles.grads_values`):
    dbv column by column, the rest sums over the value columns (blocks may be summed)."""

    dAqk: jax.Array  # [C, C] cotangent of Aqk (inclusive lower)
    dAkk_u: jax.Array  # [C, C] dbv u^T
    dbeta: jax.Array  # [C, 1] rowsums of v dbv
    dbv: jax.Array  # [C, BV] dv / beta
    d: jax.Array  # [C, 1] diagonal of dAqk


class StateProducts(NamedTuple):
    """The backward's products with the chunk states, for a block of key columns
    (:meth:`Tiles.state_products`): sums over the value columns (blocks may be summed)."""

    dq_g: jax.Array  # [C, BK] do S
    dk_d: jax.Array  # [C, BK] v_new dS
    dw: jax.Array  # [C, BK] -dv_new S, the cotangent of w
    s_ds: jax.Array  # [1, BK] column sums of S^T . dS^T


class KeyGrads(NamedTuple):
    """A chunk's backward terms of a block of key columns (:meth:`Tiles.grads_keys`), before
    the pairwise factorisation's share (:meth:`Tiles.grads_levels`)."""

    dq: jax.Array  # [C, BK]
    dk: jax.Array  # [C, BK]
    dG_start: jax.Array  # [C, BK] terms of q 2^G and k 2^G (natural-log units): dg gets their reverse cumsum
    dG_rest: jax.Array  # [C, BK] terms of k 2^(G_C - G): dg gets their exclusive cumsum
    dG_end: jax.Array  # [1, BK] the term of 2^G_C, on every row of dg
    dAkk_w: jax.Array  # [C, C] dbk_g w^T, to be summed over key blocks
    dbeta: jax.Array  # [C, 1] rowsums of k_g dbk_g, to be summed over key blocks


class Grads(NamedTuple):
    dq: jax.Array  # [C, K]
    dk: jax.Array  # [C, K]
    dv: jax.Array  # [C, V]
    dg: jax.Array  # [C, K] w.r.t. the natural-log gate
    dbeta: jax.Array  # [C, 1]
    dS_in: jax.Array  # [V, K] cotangent of the state entering the chunk (transposed)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """precision: of the bulk matmuls (``lax.Precision`` or ``lax.DotAlgorithmPreset``; on GPU
    HIGHEST is IEEE float32, DEFAULT TF32, TF32_TF32_F32_X3 three TF32 products).
    operands: None, or a dtype (bfloat16) the bulk matmuls round their operands to,
    accumulating in float32; the triangular inverse and the backward of the
    pairwise factorisation keep float32 operands (:attr:`wide`; docs/kda_gpu.md, Precision), at
    ``wide_precision`` where set (on a TPU :data:`BF16_HIGH`, spelled out so that the interpreter
    rounds as the TPU does: its DEFAULT would round them to bfloat16).
    matmul_reductions: take gate cumsums as matmuls with 0/1 matrices (TPU, where scans lower
    poorly) or as scans (GPU, where a matmul needs every dimension >= 16); row sums are lane
    reductions on both. sums: the precision of the 0/1 sums that must
    keep float32 accuracy: HIGHEST (IEEE float32; on a GPU that runs on the FMA units), or
    on a GPU :data:`TF32X2`: the summed operand split into its TF32 value and the rest, each
    multiplied by the 0/1 matrix (exact in TF32) on the tensor cores, which keeps about 22 of
    float32's 24 bits; TF32_TF32_F32_X3 adds a third product that is zero (the 0/1 matrix's
    low part) and the registers its operands take; on a TPU :data:`BF16X3`: the summed operand
    split into three bfloat16 parts (:func:`split_bf16`), three single-pass products, exact
    products and float32 sums at half the passes of HIGHEST; with bfloat16 inputs :data:`BF16X2`,
    two parts: each summed step to 16 bits, still with no cancellation, a factor 2^x then within
    |x| 2^-17 ln 2 of exact, below the bfloat16 rounding (2^-9) of the products it scales while it is
    a normal float32 (|x| < 126). stacked: products that share a factor
    run as one matmul over row-stacked operands (a level's q e and k e against k e; the levels'
    backward's dQ and dK), one MXU weight load and fewer products to add (TPU; the GPU kernels keep
    them apart, for registers). wide_levels: the pairwise factorisation's backward
    (:meth:`grads_levels`) at :attr:`wide` precision, as the inverse (False: as the bulk matmuls;
    its errors, unlike the inverse's, feed no later row). Every
    method also takes stacks of tiles [n, C, D] (several heads at once), tile by tile. paired: with
    an even number of heads and 2C <= 128, :meth:`intra` keeps the [C, C] tiles (Aqk, Kkk, T) of two
    heads side by side, [n / 2, C, 2C] (TPU: a [64, 64] float32 tile fills half of each vreg's
    lanes, and a matmul's [64, 64] result half of each result pop); :meth:`apply` takes either form,
    :func:`unpair` gives the heads'."""

    precision: lax.Precision | lax.DotAlgorithmPreset = _HIGHEST
    matmul_reductions: bool = True
    operands: jnp.dtype | None = None
    sums: lax.Precision | lax.DotAlgorithmPreset | str = _HIGHEST
    wide_precision: lax.Precision | lax.DotAlgorithmPreset | None = None
    stacked: bool = False
    wide_levels: bool = True
    paired: bool = False

    def _sum(self, mask, x):  # (0/1 matrix of mask(i, j), [C, C] iotas) @ x at the precision of ``sums``
        C, dims, P = x.shape[-2], ((1,), (0,)), _PARTS.get(self.sums)
        if P:
            # one matmul of contraction P C: [M M M] @ [hi; mid; lo], the parts' products
            # accumulated on the MXU (exact products, float32 sums) with one set of result pops
            i, j = _iota((C, P * C), 0), _in_block(_iota((C, P * C), 1), C)
            ones = _ones_where(mask(i, j)).astype(jnp.bfloat16)
            parts = lambda x: jnp.concatenate(split_bf16(x)[:P], axis=-2)
            return _by_head(lambda x: _mm(ones, parts(x), dims, lax.Precision.DEFAULT), x)
        ones = _ones_where(mask(_iota((C, C), 0), _iota((C, C), 1)))
        if self.sums != TF32X2:
            return _by_head(lambda x: _mm(ones, x, dims, self.sums), x)
        head = round_tf32(x)
        tf32 = lambda x: _mm(ones, x, dims, lax.Precision.DEFAULT)
        return _by_head(tf32, head) + _by_head(tf32, x - head)

    def prefix_sums(self, x, inclusive: bool = True):  # [..., C, D]: row i sums rows 0..i (0..i-1)
        return self._sum((lambda i, j: j <= i) if inclusive else (lambda i, j: j < i), x)

    def suffix_sums(self, x, inclusive: bool = True):  # [..., C, D]: row i sums rows i..C-1 (i+1..C-1)
        return self._sum((lambda i, j: j >= i) if inclusive else (lambda i, j: j > i), x)

    def level(self, g: jax.Array, s: int):
        """Dyadic level s of the pairwise factorisation (docs/kda_xla.md), as full tiles: (e [C, K],
        block [C, C]), from the per-step log2 gates g [C, K].

        Row i scales by e = 2^(G_i - G_r) in the lower half of its s-block and by 2^(G_r - G_i) in
        the upper half, r the lower half's first row: both exponents <= 0 for a decay, and each the
        sum of the steps it spans (one 0/1 matmul over g), never a difference of cumulative gates,
        whose rounding (eps |G|) would reach the factors. ``block`` marks the level's pairs (i
        lower, j upper, one block), which take e_i on the left and e_j on the right, so one tile
        serves both sides; the mask drops the other products."""
        C = g.shape[-2]
        i, j = _iota((C, C), 0), _iota((C, C), 1)
        return jnp.exp2(self._sum(lambda i, j: _level_steps(i, j, s), g)), _lower_left(i, j, s)

    def levels(self, g: jax.Array, with_sums: bool = False):
        """{s: :meth:`level` (g, s)} for every dyadic level; stacked, every level's exponents from one
        0/1 matmul, the levels' masks stacked by rows against g's parts pushed once. with_sums: (G,
        R, levels), G the prefix sums of g and R its exclusive suffix sums, stacked in the same
        matmul (the forward, which uses them at once; the backward needs G and R long before the
        levels, and holding them cost TPU7x more than the matmul saved)."""
        C, P = g.shape[-2], _PARTS.get(self.sums)
        if not (self.stacked and P):
            sums = (self.cumsum(g), self.suffix_sums(g, inclusive=False)) if with_sums else ()
            levels = {s: self.level(g, s) for s in dyadic_levels(C)}
            return (*sums, levels) if with_sums else levels
        i, j = _iota((C, C), 0), _iota((C, C), 1)
        ii, jj = _iota((C, P * C), 0), _in_block(_iota((C, P * C), 1), C)
        ss = dyadic_levels(C)
        masks = [_level_steps(ii, jj, s) for s in ss] + ([jj <= ii, jj > ii] if with_sums else [])
        ones = jnp.concatenate([_ones_where(m).astype(jnp.bfloat16) for m in masks], axis=0)
        parts = lambda g: jnp.concatenate(split_bf16(g)[:P], axis=-2)
        X = _by_head(lambda g: _mm(ones, parts(g), ((1,), (0,)), lax.Precision.DEFAULT), g)
        L = len(ss) * C
        E = jnp.exp2(X[..., :L, :])
        levels = {s: (E[..., m * C : (m + 1) * C, :], _lower_left(i, j, s)) for m, s in enumerate(ss)}
        return (X[..., L : L + C, :], X[..., L + C :, :], levels) if with_sums else levels

    def straddle(self, z: jax.Array, s: int) -> jax.Array:
        """[C, D]: in each s-block, row t of the lower half sums z's rows i >= t of that half, row t
        of the upper half z's rows i < t of that half. With z the row terms of a level's pairs
        (lower half) and their column terms (upper half), that is the sum of the pairs whose
        decay spans step t: the cotangent of g_t, with no pair's terms cancelling."""
        return self._sum(lambda t, i: _straddle_steps(t, i, s), z)

    def straddles(self, zs: dict, tail: tuple = ()) -> jax.Array:
        """The sum of :meth:`straddle` (z, s) over {s: z} of every dyadic level, and with ``tail``
        (a, b) the suffix sums of a (rows i >= t) and the exclusive prefix sums of b (rows i < t);
        with BF16X3 or BF16X2 one 0/1 matmul over the concatenated contraction (levels and tail,
        then parts, then rows), the products of all of them accumulated on the MXU."""
        ss, P = list(zs), _PARTS.get(self.sums)
        if not P or ss != dyadic_levels(zs[ss[0]].shape[-2]):
            out = sum(self.straddle(z, s) for s, z in zs.items())
            return out + self.suffix_sums(tail[0]) + self.prefix_sums(tail[1], inclusive=False) if tail else out
        C = zs[ss[0]].shape[-2]
        L = C.bit_length() - 1
        t, j = _iota((C, P * C * len(ss)), 0), _iota((C, P * C * len(ss)), 1)
        # j // (P C), the level index (s = C >> m); 11 / 32 is 1 / 3 exactly up to 10 levels
        m = ((j >> L) * 11) >> 5 if P == 3 else j >> (L + 1)
        i = _in_block(j, C)
        lower = (t & ((C >> m) - 1)) >= (C >> (m + 1))
        same_half = (t >> (L - 1 - m)) == (i >> (L - 1 - m))
        mask = same_half & ((lower & (i >= t)) | (~lower & (i < t)))
        if tail:  # then a's parts (rows i >= t), b's (rows i < t): lane-aligned blocks
            t, j = _iota((C, 2 * P * C), 0), _iota((C, 2 * P * C), 1)
            i = _in_block(j, C)
            mask = jnp.concatenate((mask, ((j < P * C) & (i >= t)) | ((j >= P * C) & (i < t))), axis=1)
        ones = _ones_where(mask).astype(jnp.bfloat16)
        rhs = lambda *zs: jnp.concatenate([p for z in zs for p in split_bf16(z)[:P]], axis=-2)
        terms = [zs[s] for s in ss] + list(tail)
        return _by_head(lambda *zs: _mm(ones, rhs(*zs), ((1,), (0,)), lax.Precision.DEFAULT), *terms)

    def gate_terms(self, Kg: KeyGrads) -> jax.Array:
        """[C, BK]: the share of dg of the state-side terms, each summed over the steps it decays
        by: q 2^G and k 2^G over steps 0..i, k 2^(G_C - G) over i+1..C-1, 2^G_C over every step.
        The second as the inclusive cumsum less the row (its terms grow down the chunk, so the
        rounding is of the row's size), which spares a GPU kernel a second 0/1 matrix."""
        return self.suffix_sums(Kg.dG_start) + (self.cumsum(Kg.dG_rest) - Kg.dG_rest) + Kg.dG_end

    @property
    def wide(self) -> Tiles:  # the matmuls with float32 operands, at wide_precision (if set)
        return dataclasses.replace(self, operands=None, precision=self.wide_precision or self.precision)

    def _bulk(self, a, b, dims):
        if self.precision == BF16_HIGH:
            return _by_head(lambda a, b: _high(a, b, dims), a, b)
        cast = (lambda x: x) if self.operands is None else (lambda x: x.astype(self.operands))
        return _by_head(lambda a, b: _mm(cast(a), cast(b), dims, self.precision), a, b)

    def dot(self, a, b):  # a @ b
        return self._bulk(a, b, ((1,), (0,)))

    def dot_t(self, a, b):  # a @ b^T
        return self._bulk(a, b, ((1,), (1,)))

    def t_dot(self, a, b):  # a^T @ b
        return self._bulk(a, b, ((0,), (0,)))

    def rowsum(self, x):  # [..., C, D] -> [..., C, 1]
        return jnp.sum(x, axis=-1, keepdims=True)

    def cumsum(self, x):  # [C, D] inclusive cumsum over rows
        if self.matmul_reductions:
            return self.prefix_sums(x)
        return jnp.cumsum(x, axis=-2)

    def diag(self, x, y):  # [..., C, C] with the row dot products x_i . y_i on the diagonal
        C = x.shape[-2]
        return jnp.where(_iota((C, C), 0) == _iota((C, C), 1), self.rowsum(x * y), 0.0)

    def unit_lower_inverse(self, A: jax.Array) -> jax.Array:
        """``(I + strict_lower(A))^-1`` for A: [C, C], C a power of two, by masked full-size matmuls.

        Doubling h = 1, 2, ..., C/2 with T block diagonal in blocks of h: T <- T - T A_h T,
        A_h holding the lower-left h x h block of every 2h diagonal block. That is the block
        forward substitution [[T11, 0], [-T22 A21 T11, T22]] for all blocks at once; the
        masked-out entries only add exact zeros. At :data:`BF16_HIGH` the doubling runs at the bulk
        matmuls' precision and one Newton step T <- T + T (I - M T), M = I + strict_lower(A), its
        residual at BF16_HIGH, squares its error: 2.6e-5 to 6.2e-5 relative where the doubling alone
        leaves 5e-3 to 8e-3 and BF16_HIGH throughout 1e-5 (cond(M) 34-79), in half the passes.
        A may hold two heads' tiles side by side, [..., C, 2C] (:attr:`paired`): each right factor
        then enters as its block diagonal (:func:`_bd`), both heads' products in one matmul."""
        C = A.shape[-2]
        i, j = _pair_iotas(A)
        right = (lambda X: X) if A.shape[-1] == C else _bd
        wide = self.wide
        T = _ones_where(i == j) - jnp.where(_lower_left(i, j, 2), A, 0.0)  # h = 1: T = I, so T A_1 T = A_1
        s = 4
        step = self if wide.precision == BF16_HIGH else wide
        while s <= C:
            T = T - step.dot(T, right(step.dot(jnp.where(_lower_left(i, j, s), A, 0.0), right(T))))
            s *= 2
        if wide.precision != BF16_HIGH:
            return T
        R = (_ones_where(i == j) - T) - wide.dot(jnp.where(i > j, A, 0.0), right(T))  # I - M T
        return T + self.dot(T, right(R))

    def intra(self, q, k, v, g, beta) -> Intra:
        """q, k: [C, K]; v: [C, V]; g: [C, K] per-step log2 gate; beta: [C, 1] (all float32)."""
        G, R, levels = self.levels(g, with_sums=True)  # G [C, K] prefix sums, R the steps after each row
        Aqk, Kkk = self.pairs(q, k, g, levels)
        bKkk = (_pair_heads(beta, Kkk.shape[-1]) if _is_pairs(Kkk, beta) else beta) * Kkk
        return self.from_products(q, k, v, g, beta, G, R, Aqk, Kkk, self.unit_lower_inverse(bKkk))

    def from_products(self, q, k, v, g, beta, G, R, Aqk, Kkk, T) -> Intra:
        """The :class:`Intra` of a chunk from its matmul products that take levels or an inverse (G, R,
        Aqk, Kkk, T): the gated q and k, the decay, and w, u (two matmuls, or stacked one of K + V columns)."""
        q_g, k_g, k_d, decay = gated(q, k, G, R, last_row(G))
        if self.stacked:
            K = k.shape[-1]
            WU = self.apply(T, jnp.concatenate((beta * k_g, beta * v), axis=-1))
            return Intra(g, G, R, Aqk, Kkk, T, WU[..., :K], WU[..., K:], q_g, k_d, decay)
        return Intra(g, G, R, Aqk, Kkk, T, self.dot(T, beta * k_g), self.dot(T, beta * v), q_g, k_d, decay)

    def pairs(self, q, k, g, levels: dict | None = None):
        """(Aqk, Kkk) [C, C]: Aqk[i, j] = sum_d q_id k_jd 2^(G_id - G_jd) (j <= i) and Kkk likewise
        (j < i), G the prefix sums of the per-step log2 gates g [C, K]; one masked [C, K] x [K, C]
        matmul per dyadic level (:meth:`level`; ``levels`` if taken already). Sums over the key
        columns: blocks of columns may be summed."""
        C = k.shape[-2]
        if self._pairs_heads(k):
            return self._paired_pairs(q, k, self.levels(g) if levels is None else levels)
        Aqk = self.diag(q, k)
        Kkk = jnp.zeros(k.shape[:-1] + (C,), jnp.float32)
        for e, block in (self.levels(g) if levels is None else levels).values():
            k_e = k * e
            if self.stacked:  # [q e; k e] (k e)^T: one matmul of 2C rows
                P = self.dot_t(jnp.concatenate((q * e, k_e), axis=-2), k_e)
                Aqk = Aqk + jnp.where(block, P[..., :C, :], 0.0)
                Kkk = Kkk + jnp.where(block, P[..., C:, :], 0.0)
                continue
            Aqk = Aqk + jnp.where(block, self.dot_t(q * e, k_e), 0.0)
            Kkk = Kkk + jnp.where(block, self.dot_t(k_e, k_e), 0.0)
        return Aqk, Kkk

    def _pairs_heads(self, x) -> bool:  # whether :meth:`intra` pairs the heads of the stack x [n, C, D]
        return self.paired and x.ndim == 3 and x.shape[0] % 2 == 0 and 2 * x.shape[-2] <= 128

    def pair_products(self, X, Y):
        """[n / 2, R, 2C]: per pair of heads (2p, 2p + 1) ``[X_a Y_a^T | X_b Y_b^T]`` (X [n, R, D], Y
        [n, C, D]) at the bulk precision: ``[X_a | X_b]`` against the block diagonal of Y_a and Y_b,
        one matmul of contraction 2D whose result pops fill the lanes that a [R, C] result would
        leave half empty (:attr:`paired`)."""
        n, C, D = Y.shape
        zero = jnp.zeros((C, D), jnp.float32)
        out = []
        for p in range(n // 2):
            a, b = 2 * p, 2 * p + 1
            rhs = jnp.concatenate((jnp.concatenate((Y[a], zero), -1), jnp.concatenate((zero, Y[b]), -1)))
            out.append(self._bulk(jnp.concatenate((X[a], X[b]), -1), rhs, ((1,), (1,))))
        return jnp.stack(out)

    def _paired_pairs(self, q, k, levels: dict):
        """:meth:`pairs` of stacks [n, C, K] as pairs of heads (:meth:`pair_products`): per level and
        pair one matmul of ``[q_a e; k_a e | q_b e; k_b e]`` against the block diagonal of the k e."""
        n, C, _ = k.shape
        d = _pair_heads(self.rowsum(q * k), 2 * C)
        i, j = _pair_iotas(d)
        Aqk, Kkk = jnp.where(i == j, d, 0.0), None
        for s, (e, _) in levels.items():
            block = _lower_left(i, j, s)
            k_e = k * e
            P = self.pair_products(jnp.concatenate((q * e, k_e), axis=-2), k_e)
            Aqk = Aqk + jnp.where(block, P[..., :C, :], 0.0)
            Kkk = _plus(Kkk, jnp.where(block, P[..., C:, :], 0.0))
        return Aqk, Kkk

    def apply(self, M, X):
        """Head by head ``M @ X`` at the bulk precision: M [n, C, C], or its heads in pairs
        [n / 2, C, 2C] (:meth:`intra`; each pair's product one matmul of its block diagonal,
        :func:`_bd`); X [n, C, D]."""
        if not _is_pairs(M, X):
            return self.dot(M, X)
        XX = jnp.stack([jnp.concatenate((X[2 * p], X[2 * p + 1])) for p in range(M.shape[0])])
        Y = self.dot(_bd(M), XX)
        h = Y.shape[-2] // 2
        return jnp.stack([y for p in range(M.shape[0]) for y in (Y[p, :h], Y[p, h:])])

    def v_new(self, I: Intra, St):  # [C, V] u - w S, St [V, K] the entering state (transposed)
        return I.u - self.dot_t(I.w, St)

    def grads(self, q, k, v, beta, I: Intra, v_new, St, do, dSt) -> Grads:
        """Backward of one chunk from its intra-chunk stage I (:meth:`intra`) and v_new
        (:meth:`v_new`). St, dSt: [V, K] the entering state and the cotangent of the leaving one
        (both transposed); do: [C, V]; the rest as :meth:`intra`.
        The formulas are those of docs/kda_xla.md (Backward)."""
        dv_new = self.t_dot(I.Aqk, do) + self.dot_t(I.k_d, dSt)
        if self.stacked:  # [do; -dv_new] against [q_g; w] and against S: one matmul each
            C = do.shape[-2]
            D = jnp.concatenate((do, -dv_new), axis=-2)
            dS_in = self.t_dot(D, jnp.concatenate((I.q_g, I.w), axis=-2)) + dSt * I.decay  # [V, K]
            DS = self.dot(D, St)
            s_ds = jnp.sum(St * dSt, axis=-2, keepdims=True)
            P = StateProducts(DS[..., :C, :], self.dot(v_new, dSt), DS[..., C:, :], s_ds)
            # T^T [dw dv_new] and [dbk_g dbv] [w u]^T: one matmul each, K + V wide
            K = q.shape[-1]
            TB = self.t_dot(I.T, jnp.concatenate((P.dw, dv_new), axis=-1))
            Vg = self.grads_values(I.T, None, v, do, v_new, None, dbv=TB[..., K:])
            Kg = self.grads_keys(q, k, beta, I.G, I.R, I.T, None, P, Vg.d, dbk_g=TB[..., :K])
            dAkk_sum = self.dot_t(TB, jnp.concatenate((I.w, I.u), axis=-1))
        else:
            dS_in = self.t_dot(do, I.q_g) + dSt * I.decay - self.t_dot(dv_new, I.w)  # [V, K]
            P = self.state_products(St, dSt, do, v_new, dv_new)
            Vg = self.grads_values(I.T, I.u, v, do, v_new, dv_new)
            Kg = self.grads_keys(q, k, beta, I.G, I.R, I.T, I.w, P, Vg.d)
            dAkk_sum = Kg.dAkk_w + Vg.dAkk_u
        dKkk, dbeta = self.grads_pairs(beta, I.Kkk, dAkk_sum, Vg.dbeta + Kg.dbeta)
        dq, dk, dg = self.grads_levels(
            q, k, I.g, Vg.dAqk, dKkk, (Kg.dG_start, Kg.dG_rest), acc=(Kg.dq, Kg.dk, Kg.dG_end)
        )
        return Grads(dq, dk, beta * Vg.dbv, dg, dbeta, dS_in)

    def grads_values(self, T, u, v, do, v_new, dv_new, dbv=None) -> ValueGrads:
        """The backward's terms of a block of value columns. u, v, do, v_new, dv_new: [C, BV]
        (dv_new the cotangent of v_new = u - w S); T as :class:`Intra`. dbv: T^T dv_new if taken
        already (then dAkk_u is the caller's, None here, and u and dv_new are not read)."""
        C = T.shape[-1]
        i, j = _iota((C, C), 0), _iota((C, C), 1)
        dAqk = jnp.where(i >= j, self.dot_t(do, v_new), 0.0)
        dAkk_u = None
        if dbv is None:
            dbv = self.t_dot(T, dv_new)  # (I + Akk)^-T du
            dAkk_u = self.dot_t(dbv, u)
        d = self.rowsum(jnp.where(i == j, dAqk, 0.0))  # [C, 1] diagonal of dAqk
        return ValueGrads(dAqk, dAkk_u, self.rowsum(v * dbv), dbv, d)

    def state_products(self, St, dSt, do, v_new, dv_new) -> StateProducts:
        """St, dSt: [BV, BK] blocks of the entering state and of the cotangent of the leaving
        one (transposed); do, v_new, dv_new: [C, BV] (as :meth:`grads_values`)."""
        return StateProducts(
            self.dot(do, St),
            self.dot(v_new, dSt),
            -self.dot(dv_new, St),
            jnp.sum(St.astype(jnp.float32) * dSt, axis=-2, keepdims=True),
        )

    def grads_keys(self, q, k, beta, G, R, T, w, P: StateProducts, d, dbk_g=None) -> KeyGrads:
        """The backward's terms of a block of key columns (every [C, BK] output is column by
        column; the [C, C] and [C, 1] ones are to be summed over blocks). q, k, G, R, w: [C, BK];
        P: :meth:`state_products` summed over every value column; d: [C, 1] from
        :meth:`grads_values`; the rest as there. dbk_g: T^T dw if taken already (then dAkk_w is
        the caller's, None here, and T and w are not read)."""
        eG, e_d = jnp.exp2(G), jnp.exp2(R)
        dAkk_w = None
        if dbk_g is None:
            dbk_g = self.t_dot(T, P.dw)  # (I + Akk)^-T dw
            dAkk_w = self.dot_t(dbk_g, w)
        dk_g = beta * dbk_g
        return KeyGrads(
            dq=eG * P.dq_g + d * k,
            dk=eG * dk_g + e_d * P.dk_d + d * q,
            dG_start=q * eG * P.dq_g + k * eG * dk_g,
            dG_rest=k * e_d * P.dk_d,
            dG_end=jnp.exp2(last_row(G)) * P.s_ds,
            dAkk_w=dAkk_w,
            dbeta=self.rowsum(k * eG * dbk_g),
        )

    def grads_pairs(self, beta, Kkk, dAkk_sum, dbeta_sum):
        """(dKkk [C, C], dbeta [C, 1]) from the sums over value and key blocks: dAkk_sum =
        dbk_g w^T + dbv u^T, dbeta_sum = rowsums of v dbv and k_g dbk_g."""
        C = Kkk.shape[-1]
        dAkk = jnp.where(_iota((C, C), 0) > _iota((C, C), 1), -dAkk_sum, 0.0)
        return beta * dAkk, dbeta_sum + self.rowsum(dAkk * Kkk)

    def grads_levels(self, q, k, g, dAqk, dKkk, tail: tuple = (), acc: tuple | None = None):
        """Backward of the pairwise factorisation of Aqk and Kkk (:meth:`intra`), level by level,
        given their cotangents dAqk, dKkk [C, C] and the per-step log2 gates g: (dq, dk, dg)
        [C, K] each, dg the pairs' share of the cotangent of g (natural-log units), each pair's
        term summed over the steps its decay spans (:meth:`straddle`). Float32 operands
        (:attr:`wide`) if ``wide_levels``. tail: (dG_start, dG_rest) of :class:`KeyGrads`, whose sums
        (:meth:`gate_terms`, less dG_end) dg then includes, in the straddles' matmul when stacked.
        acc: (dq, dk, dg) the results start from (None: none; dg may be a [1, K] row)."""
        wide = self.wide if self.wide_levels else self
        dq, dk, dg = acc or (None, None, None)  # None: the first term, no addition of zeros
        C, zs = k.shape[-2], {}
        if self.stacked:
            L, masks = _level_lhs(dAqk, dKkk), _level_lhs_masks(C)
        for s, (e, block) in self.levels(g).items():  # dQ, dK: zero outside the level's pairs, so e serves both sides
            if self.stacked:  # [dq_s; dk_s] / e = L_s [k e; q e]: one matmul of contraction 2C a level
                X = wide.dot(jnp.where(masks[s], L, 0.0), jnp.concatenate((k * e, q * e), axis=-2))
                dq_s, dk_s = X[..., :C, :] * e, X[..., C:, :] * e
                dq, dk = _plus(dq, dq_s), _plus(dk, dk_s)
                zs[s] = q * dq_s + k * dk_s
                continue
            dQ, dK = jnp.where(block, dAqk, 0.0), jnp.where(block, dKkk, 0.0)
            k_e = k * e
            dq_s = wide.dot(dQ, k_e) * e
            dk_s = (wide.t_dot(dQ, q * e) + wide.t_dot(dK, k_e) + wide.dot(dK, k_e)) * e
            dq, dk = _plus(dq, dq_s), _plus(dk, dk_s)
            dg = _plus(dg, self.straddle(q * dq_s + k * dk_s, s))
        if zs:
            dg = _plus(dg, self.straddles(zs, tail))
        elif tail:
            dg = _plus(dg, self.suffix_sums(tail[0]) + self.prefix_sums(tail[1], inclusive=False))
        return dq, dk, dg


def _level_lhs(dAqk, dKkk):
    """[..., 2C, 2C] ``[[dAqk, 0], [dKkk + dKkk^T, dAqk^T]]`` from dAqk, dKkk [..., C, C]: masked to
    a level's pairs (lower row i, upper column j: :func:`_level_lhs_masks`), its product with
    ``[k e; q e]`` is ``[dQ k e; dK k e + dQ^T q e + dK^T k e]``, the level's shares of dq and dk
    before the row factor e (a row's shares as left and as right factor have disjoint supports)."""
    dAqk_t, dKkk_t = jnp.swapaxes(dAqk, -1, -2), jnp.swapaxes(dKkk, -1, -2)
    top = jnp.concatenate((dAqk, jnp.zeros_like(dAqk)), axis=-1)
    return jnp.concatenate((top, jnp.concatenate((dKkk + dKkk_t, dAqk_t), axis=-1)), axis=-2)


def _level_lhs_masks(C: int) -> dict:
    """{s: [2C, 2C] mask of :func:`_level_lhs`'s entries that level s takes}: in each [C, C] block the
    level's pairs (:func:`_lower_left`) and their transposes. The blocks' other entries those would
    add are zeros of ``L`` (the upper right block, dAqk above its diagonal, dAqk^T below). Written
    as one same-block test and one half test, not ``_lower_left(i, j, s) | _lower_left(j, i, s)``:
    the masks are rebuilt every grid step, and that form cost the backward 0.01 M static cycles."""
    i, j = _in_block(_iota((2 * C, 2 * C), 0), C), _in_block(_iota((2 * C, 2 * C), 1), C)
    return {
        s: (_block(i, s) == _block(j, s)) & ((_in_block(i, s) < s // 2) != (_in_block(j, s) < s // 2))
        for s in dyadic_levels(C)
    }


# ----------------------------------------------------------------------------- wrapper layout


def head_major(layout: ChunkLayout, x: jax.Array, width: int | None) -> jax.Array:
    """[B, T, heads, D] -> [B, heads, NC * C, width] (packed, D zero-padded to width)."""
    x = jnp.moveaxis(layout.pack(x), 2, 1)
    return x if width is None else pad_last(x, width)


def chunk_states(layout: ChunkLayout, S_in: jax.Array, K: int, V: int) -> jax.Array:
    """The kernels' states entering each chunk, transposed and padded [B, HV, NC, Vp, Kp], as
    [B, NC, HV, K, V], the chunks no sequence uses set to 0."""
    return layout.zero_unused(jnp.swapaxes(jnp.moveaxis(S_in, 1, 2), -1, -2)[..., :K, :V])
