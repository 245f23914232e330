"""Kascade as Mosaic TPU kernels (``backend="pallas_tpu"``): forward only (docs/kascade_tpu.md).

Over pools (``pool_size`` > 1, the default 128; block selection):

- ``kascade_pool_scores`` (grid B, G, query blocks): one flash-style pass over the keys up to
  the block's last query that sums each tile's probability mass on each pool at the running
  max and makes the sums exact once each query's log-sum-exp is known; with a dense output,
  also the exact attention.
- ``kascade_pool_attend`` (grid B, G, NT): a tile's selected pools, one DMA each from K and V
  as the callers lay them out ([B, T, G, D]), and its own causal block, on its queries
  [B, T, H, D] in place.
- ``kascade_pool_decode_scores`` / ``kascade_pool_decode_attend`` (grid B, G): the same for one
  token over the cache, each pool one DMA.

Over tokens (``pool_size=1``), on the packed layout of :mod:`kdax.ops.kascade.blocks`, as the
GPU backend: ``kascade_attend`` (dense, or sparse with the selected rows gathered from the KV
head kept in VMEM or by DMA), ``kascade_scores`` (a tile's pooled probabilities, key block by
key block), ``kascade_decode_scores`` and ``kascade_decode_attend`` (split-K over the cache).

Work loops inside programs rather than over grid steps (each TPU grid step costs about
0.35 us, more than a [128, 128] x [128, 512] product). Off TPU the kernels run in the Pallas
TPU interpreter (for tests; slow).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common import dispatch
from kdax.ops.common.arrays import LOG2E, round_up
from kdax.ops.kascade import blocks as bl
from kdax.ops.kascade.capabilities import Capabilities
from kdax.ops.kascade.checks import index_tail, pool_count, pool_keys, pooled_index_keys
from kdax.ops.kascade.xla import (
    compact,
    decode_select_pools,
    select_index_pools,
    select_pools,
    with_decode_tail,
)

LANE = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """The pallas_tpu backend's per-call config (``kascade_anchor(..., config=pallas_tpu.Config(...))``).

    Attributes:
        block_k: keys per step of the sparse attend kernels (a multiple of 8); None: for prefill
            :func:`sparse_block` of the selection's width, for decode 128.
        block_dense: keys per step of the anchor's dense attention pass (a multiple of 8).
        block_scores: keys per program of the scoring kernel (a multiple of 128).
        block_decode: keys per step of the token decode kernels (a multiple of 128).
        block_decode_pools: keys per step of the pooled decode kernels' pass over the cache (a
            multiple of 128, taken down to whole pools, at least 8): long steps let the MXU take one block's keys while
            the last block's softmax runs (docs/kascade_tpu.md, "Decode").
        splits: cache splits per decode row; None: 1 when B * G >= 8, else enough for 8 programs.
        resident_bytes: the most bytes of a KV head's keys and values (as gathered: bfloat16 K and V
            as one uint32 array, other narrow dtypes as float32) the sparse prefill kernel keeps in
            VMEM to gather selected rows with vector loads; longer heads are gathered from HBM by
            DMA, row by row (docs/kascade_tpu.md, "The token kernels").
        pool_keys: keys a step of the pooled kernels (block selection): pools a chunk of the sparse
            pass times the pool size, and the key blocks of the anchor's pass (at least one pool).
        pool_rows: query rows (tiles times query heads) a program of the pooled anchor's pass takes
            (512: one tile of the default 128 at four query heads a KV head, whose masses are a row
            of the output as they are; several tiles a program leave XLA a transpose).
        pool_scratch: the most VMEM bytes of that pass's pool sums (Tp / pool_size x its rows floats).
        decode_keys_bytes: the most VMEM bytes of a row's keys (one KV head) the pooled anchor
            decode keeps while it selects, so that its sparse pass reads only values from HBM;
            longer rows run two kernels and read the selected pools' keys again.
        index_rows: query rows (queries times the query heads of a KV head) a program of the
            indexed attention takes; its queries share each key block's read (one to eight).
        interpret: run in the Pallas TPU interpreter; None: unless on a TPU (or lowering for one).
        detect_races: in the interpreter, check the kernels for data races.

    Raises:
        ValueError: from :meth:`resolved`, naming the field that is out of range.
    """

    block_k: int | None = None
    block_dense: int = 512
    block_scores: int = 512
    block_decode: int = 512
    block_decode_pools: int = 4096
    splits: int | None = None
    resident_bytes: int = 24 << 20
    pool_keys: int = 512
    pool_rows: int = 512
    pool_scratch: int = 16 << 20
    decode_keys_bytes: int = 40 << 20
    index_rows: int = 256
    interpret: bool | None = None
    detect_races: bool = False

    def resolved(self) -> Config:
        """This config, its fields checked, with ``interpret`` None replaced by what it means here."""
        if self.block_k is not None and (self.block_k < 8 or self.block_k % 8):
            raise ValueError(f"config.block_k: expected None or a multiple of 8, got {self.block_k}")
        if self.block_dense < 8 or self.block_dense % 8:
            raise ValueError(f"config.block_dense: expected a multiple of 8, got {self.block_dense}")
        for name in ("block_scores", "block_decode", "block_decode_pools"):
            if (n := getattr(self, name)) < LANE or n % LANE:
                raise ValueError(f"config.{name}: expected a multiple of {LANE}, got {n}")
        if self.splits is not None and (isinstance(self.splits, bool) or self.splits < 1):
            raise ValueError(f"config.splits: expected None or an int >= 1, got {self.splits!r}")
        for name in ("resident_bytes", "decode_keys_bytes"):
            if (n := getattr(self, name)) < 0:
                raise ValueError(f"config.{name}: expected an int >= 0, got {n}")
        if self.index_rows < 1:
            raise ValueError(f"config.index_rows: expected an int >= 1, got {self.index_rows}")
        interpret = dispatch.platform() != "tpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


SPARSE_BLOCK_MAX = 4 * LANE  # the most keys a step :func:`sparse_block` gives


def sparse_block(k_max: int) -> int:
    """The sparse prefill pass's keys a step by default, for selections of up to ``k_max`` keys a tile:
    k_max / 3 rounded down to a multiple of 128, from 128 to 512. A step's fixed work (the softmax's
    rescale, the loop) favours large blocks, a selection's last, partly padded block small ones:
    static cycles of the reuse layer (v5e, bf16, B = 1, H = 32, G = 8, D = 128, 10% of the keys)
    at T = 16384 (k_max 1638) 20.11, 18.69 and 17.45 M for 128, 256 and 512 keys a step, at T = 4096
    (k_max 409) 1.95, 2.10 and 2.39 M."""
    return min(SPARSE_BLOCK_MAX, max(LANE, k_max // 3 // LANE * LANE))


def _call(kernel, **kwargs):
    """``pl.pallas_call`` traced with 32-bit Python scalars (Mosaic's index arithmetic is int32; the
    kernels' arrays have explicit dtypes, so this only keeps ``jax_enable_x64`` out of them)."""

    def run(*args):
        with jax.enable_x64(False):
            return pl.pallas_call(kernel, **kwargs)(*args)

    return run


def _interpret(cfg: Config):
    return pltpu.InterpretParams(detect_races=cfg.detect_races) if cfg.interpret else False


class _Blocks:
    """K/V blocks of ``n`` rows put into the VMEM buffers kbuf, vbuf [2, n, ...], two slots so one
    block is read while the next is in flight (K alone when v_hbm is None).

    ``src(x, j, n)`` is the slice of x holding rows j .. j + n - 1 of the head: [n, D], or
    [n, G, D] rows of every KV head of a decode cache, of which ``pick`` keeps the program's
    [n, D] (:func:`_cache_rows`). Without ``sel`` block i is rows i * n onward, one DMA. With
    ``sel`` (idx_hbm(i) the [1, S] row of block i's indices, :func:`_index_rows`; idx_smem
    [2 * S], idx_vmem [2, 1, S]) block i's rows are its selection: with ``resident`` x is the
    whole head in VMEM and the rows are vector loads (the indices copied a block ahead; no index
    may be -1: the caller pads with the head's last row), else one DMA each from HBM (index -1
    reads row 0). ``dtype``: what the blocks are cast to (the queries').
    ``packed``: k holds bfloat16 K and V rows as one uint32 row each (:func:`_pack_kv`; v and vbuf
    None), unpacked in VMEM.
    """

    def __init__(self, k, v, src, kbuf, vbuf, sems, n, sel=None, pick=None, dtype=None, resident=False, packed=False):
        self.k, self.v, self.src, self.kbuf, self.vbuf, self.sems, self.n = k, v, src, kbuf, vbuf, sems, n
        self.sel, self.pick, self.dtype, self.resident = sel, pick or (lambda x: x), dtype, resident
        self.packed = packed
        self.S = _slot_ints(n)

    def _pairs(self):
        return ((self.k, self.kbuf), (self.v, self.vbuf))[: 1 if self.v is None else 2]

    def _copies(self, slot, j, r, rows):
        return [
            pltpu.make_async_copy(self.src(x, j, rows), buf.at[slot, pl.ds(r, rows)], self.sems.at[a, slot])
            for a, (x, buf) in enumerate(self._pairs())
        ]

    def _index_copies(self, i, slot):
        idx_hbm, idx_smem, idx_vmem = self.sel
        return [
            pltpu.make_async_copy(idx_hbm(i).at[0], idx_smem.at[pl.ds(slot * self.S, self.S)], self.sems.at[2, slot]),
            pltpu.make_async_copy(idx_hbm(i), idx_vmem.at[slot], self.sems.at[3, slot]),
        ]

    def start(self, i, slot):
        if self.sel is None:
            for c in self._copies(slot, i * self.n, 0, self.n):
                c.start()
            return
        for c in self._index_copies(i, slot):
            c.start()
        if self.resident:
            return
        for c in self._index_copies(i, slot):
            c.wait()
        idx_smem = self.sel[1]

        @pl.loop(0, self.n)
        def _(r):
            for c in self._copies(slot, jnp.maximum(idx_smem[slot * self.S + r], 0), r, 1):
                c.start()

    def wait(self, slot):
        if self.sel is None or not self.resident:  # the row copies of a block, waited as one
            for c in self._copies(slot, 0, 0, self.n):
                c.wait()
            return
        for c in self._index_copies(0, slot):
            c.wait()
        idx_smem, base = self.sel[1], slot * self.S

        def gather(step, carry):  # rows r0 .. r0 + 7 (padding indices are the head's last row: _attend)
            r0 = step * 8
            ids = idx_smem.at[pl.ds(base + r0, 8)]  # one address, the rows' offsets from it
            for r in range(8):
                j = ids[r]
                for x, buf in self._pairs():
                    buf[slot, pl.ds(r0 + r, 1)] = self.src(x, j, 1)[...]
            return carry

        lax.fori_loop(0, self.n // 8, gather, 0, unroll=2)

    def keys(self, i, slot):
        """[1, n] the positions of block i's rows (its indices with a selection)."""
        if self.sel is None:
            return i * self.n + lax.broadcasted_iota(jnp.int32, (1, self.n), 1)
        return self.sel[2][slot, :, pl.ds(0, self.n)]

    def read(self, buf, slot):  # a block as the kernel computes with it: [n, D] in ``dtype``
        x = self.pick(buf[slot])
        return x if self.dtype is None else x.astype(self.dtype)

    def scan(self, count, step, state, first=0):
        """Fold ``step(state, i, keys [1, n], kb [n, D], vb [n, D] or None)`` over blocks first ..
        first + count - 1."""

        @pl.when(count > 0)
        def _():
            self.start(first, 0)

        def body(n, state):
            i, slot = first + n, bl.rem(n, 2)

            @pl.when(n + 1 < count)
            def _():
                self.start(i + 1, 1 - slot)

            self.wait(slot)
            if self.packed:
                kb, vb = _unpack_kv(self.kbuf[slot])
                return step(state, i, self.keys(i, slot), kb, vb)
            vb = None if self.v is None else self.read(self.vbuf, slot)
            return step(state, i, self.keys(i, slot), self.read(self.kbuf, slot), vb)

        return lax.fori_loop(0, count, body, state)


def _slot_ints(n: int) -> int:
    """S, the ints a block of ``n`` indices takes in the index arrays: whole 512-byte granules (a DMA
    into a slice of SMEM copies whole granules)."""
    return round_up(n, 128)


def _scratch(row, dtype, sparse, values=True):
    """Two slots of K and V blocks (K alone without ``values``), ``row`` the shape of a block ([n, D]
    or [n, G, D]), the DMA semaphores, and with ``sparse`` two slots of a block's indices in SMEM and
    VMEM."""
    shapes = [pltpu.VMEM((2, *row), dtype) for _ in range(1 + values)] + [pltpu.SemaphoreType.DMA((4, 2))]
    if sparse:
        S = _slot_ints(row[0])
        shapes += [pltpu.SMEM((2 * S,), jnp.int32), pltpu.VMEM((2, 1, S), jnp.int32)]
    return shapes


def _index_rows(indices, n: int, blocks: int):
    """A selection [..., k] as the sparse kernels read it, [..., blocks, S] (:func:`_slot_ints`): block
    i's n positions a row (-1 padded), so a block's indices are one sublane row of an int32 array
    (Mosaic copies those from any row; a lane offset it needs in multiples of 128)."""
    rows = bl.pad_selection(indices, blocks * n).reshape(*indices.shape[:-1], blocks, n)
    return bl.pad_selection(rows, _slot_ints(n))


def _gathered(dtype):
    """The dtype the sparse kernels gather K and V rows in: bfloat16 K and V as one uint32 row
    (:func:`_pack_kv`), float32 for other narrower inputs; Mosaic cannot copy a single row of a
    16-bit array (a bf16 row is half of a packed sublane)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return jnp.uint32
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def _pack_kv(k, v):
    """bfloat16 K and V [..., D] as one uint32 array [..., D]: k's 16 bits high, v's low, so that one
    row copy gathers both (half the row copies, or DMAs, of float32 K and V, half the VMEM)."""
    bits = lambda x: lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return (bits(k) << 16) | bits(v)


def _unpack_kv(x):
    """uint32 rows of :func:`_pack_kv` -> (k, v) bfloat16: a bfloat16 is a float32's high 16 bits, so
    each is its word with the other half zeroed, as a float32, cast (exactly)."""
    as_bf16 = lambda bits: lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)
    return as_bf16(x & jnp.uint32(0xFFFF0000)), as_bf16(x << 16)


def _cache_rows(dtype, G: int, cache_layout: str = "BLGD"):
    """How the decode kernels read KV head g of a cache [B, L, G, D]: (whole, pick). Float32 (or
    G = 1, or heads first, [B, G, L, D]): head g's rows themselves. Narrower with G > 1: one bf16
    head is half of a packed sublane, which Mosaic cannot copy alone, so blocks [n, G, D] of every
    head (``whole``) and ``pick(x, g)`` selecting head g's [n, D] from them in VMEM."""
    if jnp.dtype(dtype).itemsize >= 4 or G == 1 or cache_layout == "BGLD":
        return False, None

    def pick(x, g):
        return functools.reduce(lambda out, h: jnp.where(g == h, x[:, h, :], out), range(1, G), x[:, 0, :])

    return True, pick


def _row_copies(dtype, G: int, cache_layout: str = "BLGD"):
    """:func:`_cache_rows` for the kernels that copy single rows (the sparse decode's token kernel): a
    narrower cache of one KV head [B, L, 1, D] is read as blocks [n, 1, D] too, since a bf16 row is
    half of a packed sublane of an [n, D] buffer, which Mosaic cannot write alone (in [n, 1, D] it is
    the first row of its own tile)."""
    if jnp.dtype(dtype).itemsize < 4 and G == 1 and cache_layout == "BLGD":
        return True, lambda x, g: x[:, 0, :]
    return _cache_rows(dtype, G, cache_layout)


def _cache_reads(b, g, pick, key0=0, cache_layout="BLGD"):
    """(src, head) for :class:`_Blocks` reading KV head g of row b of a cache [B, L, G, D] (or heads
    first, [B, G, L, D]) from key ``key0`` on: head g's rows, or with ``pick`` (:func:`_cache_rows`)
    every head's and the pick."""
    if cache_layout == "BGLD":
        return (lambda x, j, n: x.at[b, g, pl.ds(key0 + j, n)]), None
    if pick is None:
        return (lambda x, j, n: x.at[b, pl.ds(key0 + j, n), g]), None
    return (lambda x, j, n: x.at[b, pl.ds(key0 + j, n)]), functools.partial(pick, g=g)


# ----------------------------------------------------------------------------- prefill kernels


def _attend_kernel(lengths_ref, nblk_ref, q_ref, *refs, tile, R, Rp, bk, sparse, resident, packed, scale2, prec):
    """Grid (B, G, NT). q, o [tile * Rp, D]; k, v [B, G, Tp, D] in HBM, or with ``resident`` the
    head's [Tp, D] in VMEM (with ``sparse`` and narrower inputs as :func:`_gathered`; with
    ``packed`` one uint32 array of both, :func:`_pack_kv`, and no v); kd, vd [tile, D] the tile's
    own keys; lse [rows, 1]; with ``sparse`` idx [B, G, NT, blocks, S] in HBM (:func:`_index_rows`)."""
    (k_ref, v_ref), refs = ((refs[0], None), refs[1:]) if packed else (refs[:2], refs[2:])
    kd_ref, vd_ref, *rest = refs  # the scratch: kbuf, then vbuf unless packed
    if sparse:
        idx_hbm, o_ref, lse_ref, kbuf, *vbuf, sems, idx_smem, idx_vmem = rest
    else:
        o_ref, lse_ref, kbuf, *vbuf, sems = rest
    vbuf = vbuf[0] if vbuf else None
    b, g, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = tile * Rp
    start = t * tile
    pos, row_ok = bl.row_mask(rows, Rp, R, start, lengths_ref[b])
    q = q_ref[...]

    def attend(state, ok, kb, vb):
        s2 = jnp.where(ok & row_ok, bl.dot_nt(q, kb, prec) * scale2, -jnp.inf)
        return bl.softmax_step(state, s2, vb, prec)

    sel = None
    if sparse:
        sel = (lambda i: idx_hbm.at[b, g, t, pl.ds(i, 1)], idx_smem, idx_vmem)
    src = (lambda x, j, n: x.at[pl.ds(j, n)]) if resident else (lambda x, j, n: x.at[b, g, pl.ds(j, n)])
    reads = _Blocks(k_ref, v_ref, src, kbuf, vbuf, sems, bk, sel, dtype=q.dtype, resident=resident, packed=packed)
    count = nblk_ref[0, 0] if sparse else bl.cdiv(start, bk)
    state = reads.scan(
        count,
        lambda s, i, keys, kb, vb: attend(s, keys < start, kb, vb),
        bl.start_softmax(rows, q.shape[1]),
    )
    keys = start + lax.broadcasted_iota(jnp.int32, (1, tile), 1)
    o, lse2 = bl.finish_softmax(attend(state, keys <= pos, kd_ref[...], vd_ref[...]))
    o_ref[...] = jnp.where(row_ok, o, 0.0).astype(o_ref.dtype)
    lse_ref[...] = lse2


def _scores_kernel(lengths_ref, q_ref, lse_ref, k_hbm, p_ref, kbuf, sems, *, tile, R, Rp, bs, scale2, prec):
    """Grid (B, G, NT). q [rows, D]; lse [rows, 1]; k [B, G, Tp, D] in HBM; p [Tp / bs, bs]: the
    tile's pooled probabilities of the keys before it, a row per key block (the rest not written)."""
    b, g, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = t * tile
    _, row_ok = bl.row_mask(tile * Rp, Rp, R, start, lengths_ref[b])
    q, lse2 = q_ref[...], lse_ref[...]

    def step(state, c, keys, kb, vb):
        s2 = bl.dot_nt(q, kb, prec) * scale2
        p_ref[pl.ds(c, 1), :] = bl.pooled(s2, lse2, row_ok & (keys < start))
        return state

    reads = _Blocks(k_hbm, None, lambda x, j, n: x.at[b, g, pl.ds(j, n)], kbuf, None, sems, bs)
    reads.scan(bl.cdiv(start, bs), step, jnp.int32(0))


def _attend(qp, kp, vp, lengths, indices, plan: bl.Plan, *, cfg):
    """The attend kernel over packed inputs; indices None for the dense pass.
    Returns (o [B, G, Tp * Rp, D], lse2 [B, G, Tp * Rp, 1])."""
    B, G, _, D = kp.shape
    sparse = indices is not None
    bk = (cfg.block_k or sparse_block(indices.shape[-1])) if sparse else cfg.block_dense
    NT, rows, tile_size = plan.NT, plan.rows, plan.tile_size
    qspec = pl.BlockSpec((None, None, rows, D), lambda b, g, t, *_: (b, g, t, 0))
    own = pl.BlockSpec((None, None, tile_size, D), lambda b, g, t, *_: (b, g, t, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    nblk = jnp.zeros((B, G, NT), jnp.int32)
    rows_in = _gathered(qp.dtype) if sparse else qp.dtype
    packed = rows_in == jnp.uint32
    gathered = [_pack_kv(kp, vp)] if packed else [kp.astype(rows_in), vp.astype(rows_in)]
    resident_bytes = len(gathered) * kp.shape[2] * D * jnp.dtype(rows_in).itemsize
    resident = sparse and resident_bytes <= cfg.resident_bytes
    # a resident head: one [Tp, D] block per (b, g), fetched once (its index is the same for every tile)
    head = pl.BlockSpec((None, None, kp.shape[2], D), lambda b, g, t, *_: (b, g, 0, 0), pipeline_mode=pl.Buffered(1))
    kv = head if resident else hbm
    args, in_specs = [qp, *gathered, kp, vp], [qspec, *[kv] * len(gathered), own, own]
    if sparse:
        nblk = bl.selection_blocks(indices, bk)
        idx = _index_rows(indices, bk, -(-max(indices.shape[-1], 1) // bk))
        # padding (-1) as the head's last row: never before a tile, so masked as the tile's later keys
        # are, and a resident gather reads it with no clamp (a scalar op a row)
        args.append(jnp.where(idx < 0, kp.shape[2] - 1, idx))
        in_specs.append(hbm)
    kernel = functools.partial(
        _attend_kernel,
        tile=tile_size,
        R=plan.R,
        Rp=plan.Rp,
        bk=bk,
        sparse=sparse,
        resident=resident,
        packed=packed,
        scale2=plan.scale2,
        prec=bl.precision(qp.dtype),
    )
    # one count per program, [.., 1, 1] blocks: the last two dims of a TPU block are the array's or tiled
    nblk_spec = pl.BlockSpec((None, None, None, 1, 1), lambda b, g, t, *_: (b, g, t, 0, 0), memory_space=pltpu.SMEM)
    return _call(
        kernel,
        name="kascade_attend_sparse" if sparse else "kascade_attend",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, G, NT),
            in_specs=[nblk_spec, *in_specs],
            out_specs=[qspec, pl.BlockSpec((None, None, rows, 1), lambda b, g, t, *_: (b, g, t, 0))],
            scratch_shapes=_scratch((bk, D), rows_in, sparse, values=not packed),
        ),
        out_shape=[jax.ShapeDtypeStruct(qp.shape, qp.dtype), jax.ShapeDtypeStruct((*qp.shape[:3], 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",) * 3, vmem_limit_bytes=resident_bytes + (16 << 20) if resident else None
        ),
        interpret=_interpret(cfg),
    )(lengths, nblk[..., None, None], *args)


def _scores(qp, kp, lse2, lengths, plan: bl.Plan, *, cfg):
    """Pooled probabilities P [B, G, NT, Tp] float32 (only keys before each tile written)."""
    B, G, Tp, D = kp.shape
    NT, rows, bs = plan.NT, plan.rows, cfg.block_scores
    kernel = functools.partial(
        _scores_kernel,
        tile=plan.tile_size,
        R=plan.R,
        Rp=plan.Rp,
        bs=bs,
        scale2=plan.scale2,
        prec=bl.precision(qp.dtype),
    )
    P = _call(
        kernel,
        name="kascade_scores",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, G, NT),
            in_specs=[
                pl.BlockSpec((None, None, rows, D), lambda b, g, t, *_: (b, g, t, 0)),
                pl.BlockSpec((None, None, rows, 1), lambda b, g, t, *_: (b, g, t, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((None, None, None, Tp // bs, bs), lambda b, g, t, *_: (b, g, t, 0, 0)),
            scratch_shapes=[pltpu.VMEM((2, bs, D), qp.dtype), pltpu.SemaphoreType.DMA((4, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct((B, G, NT, Tp // bs, bs), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        interpret=_interpret(cfg),
    )(lengths, qp, lse2, kp)
    return P.reshape(B, G, NT, Tp)


def _plan(q, k, tile_size, scale, cfg) -> bl.Plan:
    # tile_size >= 16: a tile's rows fill whole sublanes with R rows a token; D needs no padding
    return bl.Plan.make(
        q,
        k,
        tile_size,
        scale,
        Rp=q.shape[2] // k.shape[2],
        Dp=q.shape[3],
        block=max(cfg.block_k or SPARSE_BLOCK_MAX, cfg.block_dense, cfg.block_scores),
    )


def kascade_anchor_tpu(q, k, v, lengths, *, tile_size, pool_size, scale, cfg, **budget):
    """See :func:`kdax.kascade_anchor`; ``budget``: tenths, min_k, k_max, dense_output (:func:`blocks.anchor`).
    Returns (indices [B, G, NT, k_max] int32, o [B, T, H, D])."""
    if pool_size > 1:
        plan, nq = _pool_plan(q, k, tile_size, pool_size, scale, cfg)
        return _pooled_anchor(q, k, v, lengths, plan, nq, pool_size, cfg, **budget)
    kernels = functools.partial(_attend, cfg=cfg), functools.partial(_scores, cfg=cfg)
    return bl.anchor(*kernels, q, k, v, lengths, _plan(q, k, tile_size, scale, cfg), pool_size=1, **budget)


def kascade_reuse_tpu(q, k, v, lengths, indices, *, tile_size, pool_size, scale, cfg):
    """See :func:`kdax.kascade_reuse`. indices [B, G, NT, k] already remapped. Returns o [B, T, H, D]."""
    if pool_size > 1:
        plan, _ = _pool_plan(q, k, tile_size, pool_size, scale, cfg)
        return _pool_attend(q, k, v, lengths, *pool_selection(indices, plan, pool_size), plan, pool_size, cfg=cfg)
    return bl.reuse(
        functools.partial(_attend, cfg=cfg), q, k, v, lengths, indices, _plan(q, k, tile_size, scale, cfg), pool_size
    )


# ----------------------------------------------------------------------------- prefill over pools (block selection)

_NN = (((1,), (0,)), ((), ()))  # a [m, k] x b [k, n]
_TN = (((0,), (0,)), ((), ()))  # a [k, m] x b [k, n] -> [m, n]


def _dot(a, b, dims, prec):
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _pool_attend_kernel(
    lengths_ref,
    q_ref,
    cnt_ref,
    pid_ref,
    ko_ref,
    vo_ref,
    k_hbm,
    v_hbm,
    o_ref,
    kbuf,
    vbuf,
    sbuf,
    sems,
    *,
    tile,
    R,
    D,
    P,
    S,
    scale2,
    prec,
):
    """Grid (B, G, NT), on the callers' layouts: a query tile q, o [tile, R * D] (its KV head's R
    query heads side by side); cnt [1, 1] its selected pools, pid [1, NPp] their ids (the first cnt
    valid, before the tile's pool boundary b); ko, vo [own, D] its own keys and values from b
    (own = max(P, tile)); k, v [B, Tp, G * D] in HBM. Scratch: kbuf, vbuf [NPc * P, D] the selected
    pools (every pool one DMA each, all started at once, a semaphore a chunk), sbuf
    [NPc * P, R * tile] their log2 scores.

    The R heads' queries are stacked as rows [R * tile, D] (head-major); the scores are taken
    transposed, keys by rows (the MXU reads the queries transposed), so a row's max and sum are
    sublane reductions and the output is transposed once at the end. Two passes over the
    selection in chunks of S pools, no running rescale (an online softmax's rescale of the
    accumulator costs more than storing the scores): the scores and their max, then exp2 against
    that max, the sums and the products with V (the last chunk's unfilled pools zeroed and
    masked). The own block, causal, opens both."""
    b, g, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    C, rows = S * P, R * tile  # keys a chunk, query rows
    start = t * tile
    base = bl.div(start, P) * P if P >= tile else start  # the own block's first key
    pos = start + bl.rem(lax.broadcasted_iota(jnp.int32, (1, rows), 1), tile)  # [1, rows]
    q = jnp.concatenate([q_ref[:, r * D : (r + 1) * D] for r in range(R)], axis=0)  # [rows, D]
    q = (q.astype(jnp.float32) * scale2).astype(q.dtype)  # the scores come in log2 units
    count = cnt_ref[0, 0]
    chunks = bl.cdiv(count, S)

    def copy(j, which):  # pool j's keys (which 0) or values (1), signalling its chunk's semaphore
        x, buf = ((k_hbm, kbuf), (v_hbm, vbuf))[which]
        at = pl.ds(pl.multiple_of(pid_ref[0, j] * P, P), P)
        dst = pl.ds(pl.multiple_of(j * P, P), P)
        return pltpu.make_async_copy(x.at[b, at, pl.ds(g * D, D)], buf.at[dst], sems.at[which, bl.div(j, S)])

    @pl.loop(0, count)
    def _(j):
        copy(j, 0).start()
        copy(j, 1).start()

    for j in range(1, S):  # the unfilled pools of the last chunk: zeros (masked, weight 0; never NaN)

        @pl.when((bl.rem(count, S) != 0) & (bl.rem(count, S) <= j))
        def _(j=j):
            dst = pl.ds(pl.multiple_of((bl.div(count, S) * S + j) * P, P), P)
            for buf in (kbuf, vbuf):
                buf[dst] = jnp.zeros((P, D), buf.dtype)

    keys = base + lax.broadcasted_iota(jnp.int32, (ko_ref.shape[0], 1), 0)
    s_own = jnp.where(keys <= pos, bl.dot_nt(ko_ref[...], q, prec), -jnp.inf)  # [own, rows]

    def wait(c, which):  # chunk c's copies of keys (which 0) or values (1)
        for j in range(S):

            @pl.when(c * S + j < count)
            def _(j=j):
                copy(c * S + j, which).wait()

    def scores(c, m):
        wait(c, 0)
        at = pl.ds(pl.multiple_of(c * C, C), C)
        bias = jnp.where(lax.broadcasted_iota(jnp.int32, (C, 1), 0) < (count - c * S) * P, 0.0, -jnp.inf)
        s2 = bl.dot_nt(kbuf[at], q, prec) + bias  # [C, rows]
        sbuf[at] = s2
        return jnp.maximum(m, jnp.max(s2, axis=0, keepdims=True))

    m = lax.fori_loop(0, chunks, scores, jnp.max(s_own, axis=0, keepdims=True))
    p = jnp.exp2(s_own - m)

    def attend(c, state):
        l, acc = state
        wait(c, 1)
        at = pl.ds(pl.multiple_of(c * C, C), C)
        p = jnp.exp2(sbuf[at] - m)
        vb = vbuf[at]
        return l + jnp.sum(p, axis=0, keepdims=True), acc + _dot(vb, p.astype(vb.dtype), _TN, prec)

    init = jnp.sum(p, axis=0, keepdims=True), _dot(vo_ref[...], p.astype(vo_ref.dtype), _TN, prec)
    l, acc = lax.fori_loop(0, chunks, attend, init)  # acc [D, rows]
    o = jnp.where(pos < lengths_ref[b], acc / l, 0.0).T.astype(o_ref.dtype)  # [rows, D]
    for r in range(R):
        o_ref[:, r * D : (r + 1) * D] = o[r * tile : (r + 1) * tile]


def pool_selection(indices, plan: bl.Plan, pool_size: int):
    """A selection of whole pools [B, G, NT, k] (keys, -1 for none) as the pooled kernels read it:
    (ids [B, G, NT, max(1, k / P)] int32, each tile's pools before its pool boundary first, in the
    selection's order, the rest 0 (in range); counts [B, G, NT] int32 of those)."""
    ids = _pool_ids(indices, pool_size)
    first = jnp.arange(plan.NT, dtype=jnp.int32) * plan.tile_size // pool_size  # pools before the boundary
    return _compact(ids, (ids >= 0) & (ids < first[:, None]))


def _pool_ids(indices, pool_size: int):
    """A selection of whole pools [..., k] (keys, -1 for none) as pool ids [..., k / P] (-1 for none):
    each pool's least key, by a reduce (a strided slice compiles to loops of unknown trips)."""
    first = jnp.min(indices.reshape(*indices.shape[:-1], -1, pool_size), axis=-1)
    return jnp.where(first >= 0, first // pool_size, -1)


def _compact(ids, valid):
    """(ids [..., max(1, n)] with the valid ones first, in order, the rest 0 (in range); their
    counts [...]), with no sort (:func:`xla.compact`)."""
    return compact(ids, valid, max(1, ids.shape[-1]), 0), jnp.sum(valid, axis=-1, dtype=jnp.int32)


def _pool_attend(q, k, v, lengths, ids, counts, plan: bl.Plan, pool_size: int, *, cfg):
    """The pooled sparse pass on the callers' layouts: q [B, T, H, D], k, v [B, T, G, D], ids,
    counts (:func:`pool_selection`). Returns o [B, T, H, D]. Only a T off whole own blocks or a D
    off whole lanes costs a padded copy."""
    B, T, H, D = q.shape
    G, P, tile = k.shape[2], pool_size, plan.tile_size
    R, S = H // G, max(1, cfg.pool_keys // P)
    own, NPp = max(P, tile), ids.shape[-1]
    NPc = -(-NPp // S) * S
    Tp, Dp = round_up(T, own), round_up(D, LANE)
    if (Tp, Dp) != (T, D):
        q, k, v = (jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))) for x in (q, k, v))
    q, k, v = q.reshape(B, Tp, H * Dp), k.reshape(B, Tp, G * Dp), v.reshape(B, Tp, G * Dp)
    kernel = functools.partial(
        _pool_attend_kernel, tile=tile, R=R, D=Dp, P=P, S=S, scale2=plan.scale2, prec=bl.precision(q.dtype)
    )
    qspec = pl.BlockSpec((None, tile, R * Dp), lambda b, g, t, *_: (b, t, g))
    own_spec = pl.BlockSpec((None, own, Dp), lambda b, g, t, *_: (b, bl.div(t * tile, own), g))
    smem = lambda n: pl.BlockSpec(
        (None, None, None, 1, n), lambda b, g, t, *_: (b, g, t, 0, 0), memory_space=pltpu.SMEM
    )
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [pltpu.VMEM((NPc * P, Dp), k.dtype), pltpu.VMEM((NPc * P, Dp), k.dtype)]
    scratch += [pltpu.VMEM((NPc * P, R * tile), jnp.float32), pltpu.SemaphoreType.DMA((2, NPc // S))]
    item = jnp.dtype(k.dtype).itemsize  # the scratch, and the double-buffered tiles and own blocks
    vmem = NPc * P * (2 * Dp * item + R * tile * 4) + 4 * (tile * R * Dp + own * Dp) * item
    o = _call(
        kernel,
        name="kascade_pool_attend",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, G, plan.NT),
            in_specs=[qspec, smem(1), smem(NPp), own_spec, own_spec, hbm, hbm],
            out_specs=qspec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        # every copy is in range: pool_selection clamps the ids
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",) * 3, disable_bounds_checks=True, vmem_limit_bytes=vmem + (8 << 20)
        ),
        interpret=_interpret(cfg),
    )(lengths, q, counts[..., None, None], ids[..., None, :], k, v, k, v)
    return o.reshape(B, Tp, H, Dp)[:, :T, :, :D]


def _pool_scores_kernel(lengths_ref, qt_ref, k_hbm, *rest, tile, R, Rp, P, W, nq, scale2, prec, dense):
    """Grid (B, G, NQ): a block of nq query tiles, transposed, qt [D, rows] (rows = nq * tile * Rp
    lanes), against every key block of W keys (W / P a multiple of 8) up to its last query (k, and
    with ``dense`` v, [B, G, Tp, D] in HBM). Out: mass [Tp / P, nq], the attention mass each tile's
    queries (those before the row's length, of the R real heads) put on each pool (0 past the
    block's keys); with ``dense`` also o [D, rows] (dense
    causal attention) and lse [1, rows].

    One pass, flash-style: a block's probabilities are taken at the running max m_c of each query,
    summed over each pool (sublanes) into C [Tp / P, rows], and m_c kept in Mh [Tp / W, rows]; once
    every block is in, each query's weights exp2(m_c - lse) turn C into exact probability masses,
    summed over each tile's queries (lanes). The key blocks before the query block need no mask."""
    if dense:
        v_hbm, ms_ref, o_ref, lse_ref, kbuf, vbuf, sems, c_ref, mh_ref = rest
    else:
        (ms_ref, kbuf, sems, c_ref, mh_ref), v_hbm, vbuf = rest, None, None
    b, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = qt_ref.shape[1]
    q0 = j * nq * tile
    pos = q0 + bl.div(lax.broadcasted_iota(jnp.int32, (1, rows), 1), Rp)  # [1, rows]
    qt = qt_ref[...]
    before, total = bl.div(q0, W), bl.cdiv(q0 + nq * tile, W)  # key blocks wholly before the queries; all

    def fold(masked):
        def step(state, c, _, kb, vb):
            m, l, acc = state
            s2 = _dot(kb, qt, _NN, prec) * scale2  # [W, rows]
            if masked:
                s2 = jnp.where(c * W + lax.broadcasted_iota(jnp.int32, (W, 1), 0) <= pos, s2, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s2, axis=0, keepdims=True))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s2 - m_new)
            l = l * alpha + jnp.sum(p, axis=0, keepdims=True)
            c_ref[pl.ds(pl.multiple_of(c * (W // P), 8), W // P)] = jnp.sum(p.reshape(W // P, P, rows), axis=1)
            mh_ref[pl.ds(c, 1)] = m_new
            if dense:
                acc = acc * alpha + _dot(vb, p.astype(vb.dtype), _TN, prec)
            return m_new, l, acc

        return step

    reads = _Blocks(k_hbm, v_hbm, lambda x, i, n: x.at[b, g, pl.ds(i, n)], kbuf, vbuf, sems, W)
    state = jnp.full((1, rows), -jnp.inf, jnp.float32), jnp.zeros((1, rows), jnp.float32)
    state += (jnp.zeros((qt.shape[0], rows) if dense else (), jnp.float32),)
    state = reads.scan(before, fold(False), state)
    m, l, acc = reads.scan(total - before, fold(True), state, first=before)
    lse = m + jnp.log2(l)
    counted = (pos < lengths_ref[b]) & (bl.rem(lax.broadcasted_iota(jnp.int32, (1, rows), 1), Rp) < R)

    @pl.loop(0, total)
    def _(c):
        at = pl.ds(pl.multiple_of(c * (W // P), 8), W // P)
        mass = c_ref[at] * jnp.where(counted, jnp.exp2(mh_ref[pl.ds(c, 1)] - lse), 0.0)  # [W / P, rows]
        ms_ref[at, pl.ds(0, nq)] = jnp.sum(mass.reshape(W // P, nq, rows // nq), axis=2)

    @pl.loop(total, ms_ref.shape[0] // (W // P))
    def _(c):
        ms_ref[pl.ds(pl.multiple_of(c * (W // P), 8), W // P), pl.ds(0, nq)] = jnp.zeros((W // P, nq), jnp.float32)

    if dense:
        o_ref[...] = jnp.where(pos < lengths_ref[b], acc / l, 0.0).astype(o_ref.dtype)
        lse_ref[...] = lse


def _pool_scores(qt, kp, vp, lengths, plan: bl.Plan, pool_size: int, nq: int, *, cfg):
    """The pooled anchor's pass over qt [B, G, D, Tp * Rp] (queries transposed) and kp (and vp for a
    dense output) [B, G, Tp, D]: mass [B, G, NT, Tp / P] float32 (a tile's probability mass on each
    pool; meaningful for the pools before its pool boundary), and with vp the dense output o
    transposed [B, G, D, Tp * Rp]."""
    B, G, Tp, D = kp.shape
    P, W, dense = pool_size, _pool_block_keys(pool_size, cfg), vp is not None
    rows, NQ = nq * plan.rows, Tp // (nq * plan.tile_size)
    kernel = functools.partial(
        _pool_scores_kernel,
        tile=plan.tile_size,
        R=plan.R,
        Rp=plan.Rp,
        P=P,
        W=W,
        nq=nq,
        scale2=plan.scale2,
        prec=bl.precision(qt.dtype),
        dense=dense,
    )
    qspec = pl.BlockSpec((None, None, D, rows), lambda b, g, j, *_: (b, g, 0, j))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # a tile's masses a lane (of 128: whole vregs; XLA takes the nq and transposes)
    mass = pl.BlockSpec((None, None, None, Tp // P, LANE), lambda b, g, j, *_: (b, g, j, 0, 0))
    out_specs, out_shape = [mass], [jax.ShapeDtypeStruct((B, G, NQ, Tp // P, LANE), jnp.float32)]
    if dense:
        out_specs += [qspec, pl.BlockSpec((None, None, 1, rows), lambda b, g, j, *_: (b, g, 0, j))]
        out_shape += [
            jax.ShapeDtypeStruct(qt.shape, qt.dtype),
            jax.ShapeDtypeStruct((B, G, 1, qt.shape[3]), jnp.float32),
        ]
    scratch = _scratch((W, D), kp.dtype, False, values=dense)
    scratch += [pltpu.VMEM((Tp // P, rows), jnp.float32), pltpu.VMEM((Tp // W, rows), jnp.float32)]
    item = jnp.dtype(kp.dtype).itemsize  # the scratch, the double-buffered key (and value) blocks, queries, outputs
    vmem = (Tp // P + Tp // W) * rows * 4 + 2 * (1 + dense) * W * D * item + 2 * (1 + dense) * D * rows * item
    outs = _call(
        kernel,
        name="kascade_pool_scores",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, G, NQ),
            in_specs=[qspec, hbm] + ([hbm] if dense else []),
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3, vmem_limit_bytes=vmem + (8 << 20)),
        interpret=_interpret(cfg),
    )(lengths, qt, kp, *([vp] if dense else []))
    mass = outs[0][..., :nq].transpose(0, 1, 2, 4, 3).reshape(B, G, NQ * nq, Tp // P)
    return mass, (outs[1] if dense else None)


def _pooled_anchor(
    q, k, v, lengths, plan: bl.Plan, nq: int, pool_size: int, cfg, *, tenths, min_k, k_max, dense_output
):
    """An anchor over pools: the pooled pass, the selection of whole pools (XLA's top-k over a
    tile's pools), then the sparse pass unless the output is dense."""
    qp, kp, vp = plan.pack(q, k, v)
    qt = qp.swapaxes(2, 3)
    mass, ot = _pool_scores(qt, kp, vp if dense_output else None, lengths, plan, pool_size, nq, cfg=cfg)
    starts = jnp.arange(plan.NT, dtype=jnp.int32) * plan.tile_size
    budget = {"tenths": tenths, "min_k": min_k, "k_max": k_max, "pool_size": pool_size}
    pools = select_pools(mass[:, :, : plan.NT], starts, lengths, **budget)
    indices = pool_keys(pools, pool_size)
    if dense_output:
        return indices, plan.unpack(ot.swapaxes(2, 3))
    return indices, _pool_attend(q, k, v, lengths, *pool_selection(indices, plan, pool_size), plan, pool_size, cfg=cfg)


def _pool_block_keys(pool_size: int, cfg) -> int:
    """Keys a block of the pooled anchor's pass: ``cfg.pool_keys``, at least 8 pools (a block's pool
    sums are whole sublane tiles)."""
    return max(cfg.pool_keys, 8 * pool_size)


def _pool_plan(q, k, tile_size, pool_size, scale, cfg) -> tuple[bl.Plan, int]:
    """(the packed geometry of the pooled kernels, the query tiles a program of the anchor's pass
    takes: about ``cfg.pool_rows`` rows whose pool sums fit ``cfg.pool_scratch`` bytes of VMEM)."""
    R, T = q.shape[2] // k.shape[2], q.shape[1]
    Rp = round_up(R, max(1, LANE // tile_size))  # a tile's rows are lanes of the transposed queries
    W = _pool_block_keys(pool_size, cfg)
    Tp = round_up(T, max(W, tile_size))
    nq = max(1, min(cfg.pool_rows // (tile_size * Rp), cfg.pool_scratch // (Tp // pool_size * tile_size * Rp * 4)))
    nq = min(1 << (nq.bit_length() - 1), -(-T // tile_size))  # a power of two, as tile and W are
    return bl.Plan.make(q, k, tile_size, scale, Rp=Rp, Dp=q.shape[3], block=max(W, nq * tile_size)), nq


# ----------------------------------------------------------------------------- decode kernels


def _decode_scores_kernel(lengths_ref, q_ref, k_hbm, *rest, R, bd, nl, scale2, prec, with_output, pick, layout):
    """Grid (B, G, splits). q [Rq, D]; k (and v) [B, Lp, G, D] in HBM; s [Rq, nl, bd]: the
    split's log2 scores, a row per key block (written below the row's length); with_output the
    split's partial acc [Rq, D], m, l [Rq, 1]. ``pick``: see :func:`_cache_rows`."""
    if with_output:
        v_hbm, s_ref, acc_ref, m_ref, l_ref, kbuf, vbuf, sems = rest
    else:
        (s_ref, kbuf, sems), v_hbm, vbuf = rest, None, None
    b, g, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    key0 = sp * nl * bd
    q = q_ref[...]
    row_ok = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) < R

    def step(state, i, keys, kb, vb):
        s2 = jnp.where(row_ok & (key0 + keys < length), bl.dot_nt(q, kb, prec) * scale2, -jnp.inf)
        for r in range(q.shape[0]):  # scores of block i: a sublane row of each query's [nl, bd]
            s_ref[r, pl.ds(i, 1), :] = s2[r : r + 1]
        return bl.softmax_step(state, s2, vb, prec) if with_output else state

    src, head = _cache_reads(b, g, pick, key0, layout)
    reads = _Blocks(k_hbm, v_hbm, src, kbuf, vbuf, sems, bd, pick=head)
    count = jnp.clip(bl.cdiv(jnp.maximum(length - key0, 0), bd), 0, nl)
    state = reads.scan(count, step, bl.start_softmax(*q.shape))
    if with_output:
        m, l, acc = state
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _decode_attend_kernel(
    lengths_ref,
    nblk_ref,
    q_ref,
    k_hbm,
    v_hbm,
    idx_hbm,
    acc_ref,
    m_ref,
    l_ref,
    kbuf,
    vbuf,
    sems,
    idx_smem,
    idx_vmem,
    *,
    R,
    bd,
    per_split,
    scale2,
    prec,
    pick,
    layout,
):
    """Grid (B, G, splits). q [Rq, D]; k, v [B, Lp, G, D] (or [B, G, Lp, D]) and idx [B, G, blocks, S] in HBM
    (:func:`_index_rows`); out: the split's partial acc [Rq, D], m, l [Rq, 1]. ``pick``: see
    :func:`_row_copies`."""
    b, g, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    q = q_ref[...]
    row_ok = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0) < R
    sel = (lambda i: idx_hbm.at[b, g, pl.ds(sp * per_split + i, 1)], idx_smem, idx_vmem)
    src, head = _cache_reads(b, g, pick, cache_layout=layout)
    reads = _Blocks(k_hbm, v_hbm, src, kbuf, vbuf, sems, bd, sel, pick=head)

    def step(state, i, keys, kb, vb):
        s2 = jnp.where(row_ok & (keys >= 0) & (keys < length), bl.dot_nt(q, kb, prec) * scale2, -jnp.inf)
        return bl.softmax_step(state, s2, vb, prec)

    count = jnp.clip(nblk_ref[b, g] - sp * per_split, 0, per_split)
    m_ref[...], l_ref[...], acc_ref[...] = reads.scan(count, step, bl.start_softmax(*q.shape))


def _decode_plan(q, G, cfg, keys):
    """(Rq, splits, key blocks per split) for ``keys`` keys per row of G KV heads."""
    B, H, _ = q.shape
    Rq = round_up(H // G, 8)
    blocks = max(1, -(-keys // cfg.block_decode))
    S = cfg.splits or max(1, -(-8 // (B * G)))
    S = min(S, blocks)
    return Rq, S, -(-blocks // S)


def _cache_in_place(x, bd, layout="BLGD"):
    """The cache [B, L, G, D] (or [B, G, L, D]) as the kernels read it, its keys a multiple of the
    decode block: in place when L is one (else a padded copy), so every block lies inside it."""
    axis = 2 if layout == "BGLD" else 1
    pad = round_up(x.shape[axis], bd) - x.shape[axis]
    return x if not pad else jnp.pad(x, [(0, pad) if d == axis else (0, 0) for d in range(4)])


def kascade_anchor_decode_tpu(
    q, k_cache, v_cache, lengths, *, tenths, min_k, k_max, pool_size, scale, dense_output, cache_layout, cfg
):
    """See :func:`kdax.kascade_anchor_decode`. Returns (indices [B, G, k_max] int32, o [B, H, D])."""
    B, H, D = q.shape
    L, G = (k_cache.shape[2], k_cache.shape[1]) if cache_layout == "BGLD" else k_cache.shape[1:3]
    budget = {"tenths": tenths, "min_k": min_k, "k_max": k_max, "pool_size": pool_size}
    reuse = {"pool_size": pool_size, "scale": scale, "cache_layout": cache_layout, "cfg": cfg}
    if _decode_pools(pool_size, L, q.dtype, G, cache_layout):
        if not dense_output and _keys_fit(L, D, q.dtype, pool_size, cfg):
            sel = {"tenths": tenths, "min_k": min_k, "k_max": k_max}
            ids, parts = _pool_decode_anchor(
                q, k_cache, v_cache, lengths, G, pool_size, scale, cache_layout, cfg, **sel
            )
            return pool_keys(ids, pool_size), bl.decode_output(*parts, q)
        mass, parts = _pool_decode_scores(
            q, k_cache, v_cache if dense_output else None, lengths, G, L, pool_size, scale, cache_layout, cfg
        )
        idx = pool_keys(decode_select_pools(mass, lengths, **budget), pool_size)
        return idx, (
            bl.decode_output(*parts, q)
            if dense_output
            else kascade_reuse_decode_tpu(q, k_cache, v_cache, lengths, idx, **reuse)
        )
    bd = cfg.block_decode
    Rq, S, nl = _decode_plan(q, G, cfg, L)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    index = lambda b, g, s, *_: (b, g, s, 0, 0, 0)
    in_specs = [pl.BlockSpec((None, None, Rq, D), lambda b, g, s, *_: (b, g, 0, 0)), hbm]
    args = [bl.pack_decode_queries(q, G, Rq, D), _cache_in_place(k_cache, bd, cache_layout)]
    out_specs = [pl.BlockSpec((None, None, None, Rq, nl, bd), index)]
    out_shape = [jax.ShapeDtypeStruct((B, G, S, Rq, nl, bd), jnp.float32)]
    whole, pick = _cache_rows(q.dtype, G, cache_layout)
    row = (bd, G, D) if whole else (bd, D)
    scratch = [pltpu.VMEM((2, *row), q.dtype)]
    if dense_output:
        in_specs.append(hbm)
        args.append(_cache_in_place(v_cache, bd, cache_layout))
        specs, shapes = bl.decode_partials(B, G, S, Rq, D, lambda b, g, s, *_: (b, g, s, 0, 0))
        out_specs, out_shape = out_specs + specs, out_shape + shapes
        scratch.append(pltpu.VMEM((2, *row), q.dtype))
    kernel = functools.partial(
        _decode_scores_kernel,
        R=H // G,
        bd=bd,
        nl=nl,
        scale2=scale * LOG2E,
        prec=bl.precision(q.dtype),
        with_output=dense_output,
        pick=pick,
        layout=cache_layout,
    )
    s2, *parts = _call(
        kernel,
        name="kascade_decode_scores",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, G, S),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA((4, 2))],
        ),
        out_shape=out_shape,
        interpret=_interpret(cfg),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
    )(lengths, *args)
    s2 = s2.transpose(0, 1, 3, 2, 4, 5).reshape(B, G, Rq, S * nl * bd)
    idx, _ = bl.decode_selection(s2, lengths, R=H // G, L=L, **budget)
    if dense_output:
        return idx, bl.decode_output(*parts, q)
    return idx, kascade_reuse_decode_tpu(q, k_cache, v_cache, lengths, idx, **reuse)


def kascade_reuse_decode_tpu(q, k_cache, v_cache, lengths, indices, *, pool_size, scale, cache_layout, cfg):
    """See :func:`kdax.kascade_reuse_decode`. indices [B, G, k] already remapped. Returns o [B, H, D]."""
    B, H, D = q.shape
    L, G = (k_cache.shape[2], k_cache.shape[1]) if cache_layout == "BGLD" else k_cache.shape[1:3]
    if _decode_pools(pool_size, L, q.dtype, G, cache_layout):
        return bl.decode_output(
            *_pool_decode_attend(q, k_cache, v_cache, lengths, indices, G, L, pool_size, scale, cache_layout, cfg), q
        )
    indices = with_decode_tail(indices, lengths, pool_size)
    bd = min(cfg.block_k or LANE, round_up(max(indices.shape[-1], 1), 8))
    Rq, S, per_split = _decode_plan(q, G, dataclasses.replace(cfg, block_decode=bd), indices.shape[-1])
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    specs, shapes = bl.decode_partials(B, G, S, Rq, D, lambda b, g, s, *_: (b, g, s, 0, 0))
    whole, pick = _row_copies(q.dtype, G, cache_layout)
    kernel = functools.partial(
        _decode_attend_kernel,
        R=H // G,
        bd=bd,
        per_split=per_split,
        scale2=scale * LOG2E,
        prec=bl.precision(q.dtype),
        pick=pick,
        layout=cache_layout,
    )
    idx = _index_rows(indices, bd, S * per_split)
    prefetch = (lengths, bl.selection_blocks(indices, bd))
    parts = _call(
        kernel,
        name="kascade_decode_attend",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(B, G, S),
            in_specs=[pl.BlockSpec((None, None, Rq, D), lambda b, g, s, *_: (b, g, 0, 0)), hbm, hbm, hbm],
            out_specs=specs,
            scratch_shapes=_scratch((bd, G, D) if whole else (bd, D), q.dtype, True),
        ),
        out_shape=shapes,
        interpret=_interpret(cfg),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
    )(*prefetch, bl.pack_decode_queries(q, G, Rq, D), k_cache, v_cache, idx)
    return bl.decode_output(*parts, q)


# ----------------------------------------------------------------------------- DSA's indexed attention

KEY_BLOCK = 16  # the keys one copy of the indexed attention reads: a packed bfloat16 tile's rows
_INDEX_SMEM_WORDS = 16384  # the most ints a program's key block ids and bits take in SMEM (64 KiB)
_INDEX_QUERIES = 8  # the most queries a program: its masks cost a select per query and score


def indexed_blocks(indices, lengths, *, bq: int, cap: int):
    """The key blocks (keys 16 j .. 16 j + 15) that each block of ``bq`` queries lists, as
    ``kascade_indexed_attend`` reads them. indices [B, T, W] (-1, or past the row's length: none),
    lengths [B]; ``cap`` at least min(the key blocks of a row, bq W). One sort of a query block's
    listed keys (one int32 each: block, query, place), then running sums and a binary search; no
    scatter (TPU scatters of millions of entries compile for seconds and run an entry at a time).

    Returns:
        ids [B, NQ, cap] int32: the blocks ascending, 0 past the count (in range);
        counts [B, NQ] int32: the distinct blocks listed;
        bits [B, NQ, cap * bq] int32: bit r of entry u * bq + i set when query i of the block
        lists key 16 ids[u] + r. NQ = ceil(T / bq).
    """
    B, T, W = indices.shape
    NQ, n, unit = -(-T // bq), bq * W, bq * KEY_BLOCK
    idx = jnp.pad(indices, ((0, 0), (0, NQ * bq - T), (0, 0)), constant_values=-1)
    ok = (idx >= 0) & (idx < lengths[:, None, None])
    query = jnp.arange(NQ * bq, dtype=jnp.int32)[:, None] % bq
    none = jnp.iinfo(jnp.int32).max
    # one int32 sort key a listed key: its block, then its query in the block, then its place in the block
    code = (idx // KEY_BLOCK) * unit + query * KEY_BLOCK + idx % KEY_BLOCK
    code = jnp.sort(jnp.where(ok, code, none).reshape(B, NQ, n), axis=-1)
    listed, block = code != none, code // unit
    new = listed & (block != jnp.pad(block[..., :-1], ((0, 0), (0, 0), (1, 0)), constant_values=-1))
    slot = jnp.cumsum(new, axis=-1, dtype=jnp.int32) - 1  # each entry's block among the distinct ones
    count = slot[..., -1] + 1
    # (block, query) pairs ascending along the entries: each pair's bits a difference of running sums
    pair = jnp.where(listed, slot * bq + code % unit // KEY_BLOCK, cap * bq)
    sums = jnp.cumsum(jnp.where(listed, jnp.left_shift(1, code % KEY_BLOCK), 0), axis=-1, dtype=jnp.int32)
    search = jax.vmap(functools.partial(jnp.searchsorted, side="right", method="scan"))
    ends = search(pair.reshape(B * NQ, n), jnp.broadcast_to(jnp.arange(cap * bq, dtype=jnp.int32), (B * NQ, cap * bq)))
    ends = ends.reshape(B, NQ, cap * bq)
    total = jnp.take_along_axis(jnp.pad(sums, ((0, 0), (0, 0), (1, 0))), ends, axis=-1)  # sums up to each pair
    bits = total - jnp.pad(total[..., :-1], ((0, 0), (0, 0), (1, 0)))
    last = ends.reshape(B, NQ, cap, bq)[..., -1] - 1  # each distinct block's last entry
    ids = jnp.take_along_axis(block, jnp.maximum(last, 0), axis=-1)
    ids = jnp.where(jnp.arange(cap) < count[..., None], ids, 0)
    return ids, count, bits


def _indexed_kernel(cnt_ref, ids_ref, bits_ref, q_ref, k_hbm, *rest, R, bq, C, scale2, prec, shared):
    """Grid (B, NQ, G): a block of ``bq`` queries, its R heads of KV head g as rows q [bq * R, D]
    (query-major), over the key blocks its queries list (SMEM: count [1, 1], ids [1, cap], bits
    [1, cap * bq]: :func:`indexed_blocks`). C blocks a step, each one DMA of 16 rows of k, v
    [B, S, G * D] in HBM into two slots (K alone when ``shared``, v = k); an online softmax in
    float32 over the keys each row's query lists (its bits). out o [bq * R, D], 0 in a row whose
    query lists no key."""
    if shared:
        o_ref, kbuf, sems = rest
        pairs = ((k_hbm, kbuf),)
    else:
        v_hbm, o_ref, kbuf, vbuf, sems = rest
        pairs = ((k_hbm, kbuf), (v_hbm, vbuf))
    b, g = pl.program_id(0), pl.program_id(2)
    rows, D = q_ref.shape
    n = C * KEY_BLOCK
    count = cnt_ref[0, 0]
    q = (q_ref[...].astype(jnp.float32) * scale2).astype(q_ref.dtype)  # log2 units

    def each(c, slot, act):  # act on the copies of step c's blocks (those listed) into ``slot``
        for j in range(C):

            @pl.when(c * C + j < count)
            def _(j=j):
                at = pl.ds(pl.multiple_of(ids_ref[0, c * C + j] * KEY_BLOCK, KEY_BLOCK), KEY_BLOCK)
                for a, (x, buf) in enumerate(pairs):
                    dst = buf.at[slot, pl.ds(j * KEY_BLOCK, KEY_BLOCK)]
                    act(pltpu.make_async_copy(x.at[b, at, pl.ds(g * D, D)], dst, sems.at[a, slot]))

    lane = lax.broadcasted_iota(jnp.int32, (1, n), 1)
    which, shift = bl.div(lane, KEY_BLOCK), bl.rem(lane, KEY_BLOCK)
    mine = [bl.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), R) == i for i in range(bq)]

    def bias(c):  # [rows, n]: 0 where a row's query lists a key of step c, else -inf
        out = jnp.full((rows, n), -jnp.inf, jnp.float32)
        for i in range(bq):
            word = jnp.zeros((1, n), jnp.int32)
            for j in range(C):
                word = jnp.where(which == j, bits_ref[0, (c * C + j) * bq + i], word)
            out = jnp.where(mine[i], jnp.where(jnp.right_shift(word, shift) & 1 == 1, 0.0, -jnp.inf), out)
        return out

    def step(c, state):
        slot = bl.rem(c, 2)

        @pl.when(c + 1 < chunks)
        def _():
            each(c + 1, 1 - slot, lambda cp: cp.start())

        each(c, slot, lambda cp: cp.wait())
        for j in range(1, C):  # the last step's unfilled blocks: zeros (unlisted, weight 0; never NaN)

            @pl.when(c * C + j >= count)
            def _(j=j):
                for _, buf in pairs:
                    buf[slot, pl.ds(j * KEY_BLOCK, KEY_BLOCK)] = jnp.zeros((KEY_BLOCK, D), buf.dtype)

        kb = kbuf[slot]
        s2 = bl.dot_nt(q, kb, prec) + bias(c)
        return bl.softmax_step(state, s2, kb if shared else vbuf[slot], prec)

    chunks = bl.cdiv(count, C)

    @pl.when(count > 0)
    def _():
        each(0, 0, lambda cp: cp.start())

    o, _ = bl.finish_softmax(lax.fori_loop(0, chunks, step, bl.start_softmax(rows, D)))
    o_ref[...] = o.astype(o_ref.dtype)


def indexed_attention_tpu(q, k, v, indices, lengths, *, scale, cfg, shared=False):
    """See :func:`kdax.indexed_attention` (v of k's shape; ``shared``: v is k, read once): blocks of
    queries (``cfg.index_rows`` rows of queries times the heads of a KV head, one to eight queries,
    fewer where their lists' key blocks would take over 64 KiB of SMEM) read the key blocks of 16
    their queries list, each block one DMA shared by the block's queries and heads
    (``kascade_indexed_attend``): :func:`kdax.index_select`'s whole pools of 16 are a block each.
    q [B, T, H, D]; k, v [B, S, G, D]; indices [B, T, W]; lengths [B]. Returns o [B, T, H, D]."""
    B, T, H, D = q.shape
    S, G, W = k.shape[1], k.shape[2], indices.shape[-1]
    R, C, NB = H // G, max(1, cfg.pool_keys // KEY_BLOCK), -(-S // KEY_BLOCK)
    slots = lambda bq: round_up(min(NB, bq * W), C)  # a block's distinct key blocks, at most
    bq = max(1, min(T, cfg.index_rows // R, _INDEX_QUERIES))
    while bq > 1 and slots(bq) * (bq + 1) > _INDEX_SMEM_WORDS:
        bq -= 1
    cap = slots(bq)
    ids, counts, bits = indexed_blocks(indices, lengths, bq=bq, cap=cap)
    NQ, Sp, Dp = counts.shape[1], round_up(S, KEY_BLOCK), round_up(D, LANE)
    pad = lambda x: x if (Sp, Dp) == (S, D) else jnp.pad(x, ((0, 0), (0, Sp - S), (0, 0), (0, Dp - D)))
    kv = [pad(x).reshape(B, Sp, G * Dp) for x in ((k,) if shared else (k, v))]
    qb = jnp.pad(q, ((0, 0), (0, NQ * bq - T), (0, 0), (0, Dp - D))).reshape(B, NQ, bq, G, R, Dp)
    qb = qb.transpose(0, 1, 3, 2, 4, 5).reshape(B, NQ, G, bq * R, Dp)
    kernel = functools.partial(
        _indexed_kernel, R=R, bq=bq, C=C, scale2=scale * LOG2E, prec=bl.precision(q.dtype), shared=shared
    )
    smem = lambda m: pl.BlockSpec((None, None, 1, m), lambda b, t, g: (b, t, 0, 0), memory_space=pltpu.SMEM)
    qspec = pl.BlockSpec((None, None, None, bq * R, Dp), lambda b, t, g: (b, t, g, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [pltpu.VMEM((2, C * KEY_BLOCK, Dp), k.dtype) for _ in kv] + [pltpu.SemaphoreType.DMA((len(kv), 2))]
    o = _call(
        kernel,
        name="kascade_indexed_attend",
        grid=(B, NQ, G),
        in_specs=[smem(1), smem(cap), smem(cap * bq), qspec, *(hbm for _ in kv)],
        out_specs=qspec,
        scratch_shapes=scratch,
        out_shape=jax.ShapeDtypeStruct(qb.shape, q.dtype),
        interpret=_interpret(cfg),
        # every copy is in range: indexed_blocks gives 0 past the count
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3, disable_bounds_checks=True),
    )(counts[..., None, None], ids[:, :, None], bits[:, :, None], qb, *kv)
    o = o.reshape(B, NQ, G, bq, R, Dp).transpose(0, 1, 3, 2, 4, 5)
    return o.reshape(B, NQ * bq, H, Dp)[:, :T, :, :D]


def _index_scores_kernel(q_ref, w_ref, k_ref, o_ref, *, heads, scale, prec):
    """Grid (B, query blocks): DSA's index scores of a block of queries against its row's pools,
    ``sum_h w_h relu(scale q_h . pool)``. q [Hi, bq, d], w [bq, Hi] float32, the row's pooled keys
    [NPp, d] (resident); out [bq, NPp] float32. The heads unrolled: Hi products [bq, d] x [d, NPp]."""
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for h in range(heads):
        s = bl.dot_nt(q_ref[h], k_ref[...], prec) * scale
        acc = acc + w_ref[:, h : h + 1] * jnp.maximum(s, 0)
    o_ref[...] = acc


def index_select_tpu(q, weights, keys, gates, ape, q_positions, lengths, key_rows, *, topk, kpool, tail, scale, cfg):
    """See :func:`kdax.index_select`: the pools' keys in XLA (one pass over the keys), the scores of
    every query against every pool of its row on the MXU (``kascade_index_scores``, the row's pooled
    keys resident in VMEM, blocks of queries whose scores take at most 2 MiB), the selection from
    them in XLA (:func:`kdax.ops.kascade.xla.select_index_pools`), as Kascade's anchors select.
    Queries reading other rows (``key_rows``) run on xla. Returns indices [B, T, W] int32."""
    if key_rows is not None:
        raise NotImplementedError("index_select (pallas_tpu): key_rows (queries reading other rows) runs on xla")
    B, T, Hi, d = q.shape
    pooled = pooled_index_keys(keys, gates, ape, kpool)  # [B, NP, d]
    NP = pooled.shape[1]
    NPp = round_up(max(NP, 1), LANE)
    bq = max(8, min(256, round_up(T, 8), (2 << 20) // (4 * NPp) // 8 * 8))
    Tp = round_up(T, bq)
    qt = jnp.pad(q.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))  # [B, Hi, Tp, d]
    wt = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, 0)))  # [B, Tp, Hi]
    kp = jnp.pad(pooled, ((0, 0), (0, NPp - NP), (0, 0))).astype(q.dtype)
    kernel = functools.partial(_index_scores_kernel, heads=Hi, scale=scale, prec=bl.precision(q.dtype))
    scores = _call(
        kernel,
        name="kascade_index_scores",
        grid=(B, Tp // bq),
        in_specs=[
            pl.BlockSpec((None, Hi, bq, d), lambda b, t: (b, 0, t, 0)),
            pl.BlockSpec((None, bq, Hi), lambda b, t: (b, t, 0)),
            pl.BlockSpec((None, NPp, d), lambda b, t: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, NPp), lambda b, t: (b, t, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, NPp), jnp.float32),
        interpret=_interpret(cfg),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    )(qt, wt, kp)[:, :T, :NP]
    n = jnp.broadcast_to(lengths[:, None], (B, T))
    indices = select_index_pools(scores, q_positions, n, topk=topk, kpool=kpool)
    if tail and kpool > 1:
        indices = jnp.concatenate([indices, index_tail(q_positions, n, kpool)], -1)
    return indices


# ----------------------------------------------------------------------------- decode over pools


def decode_block(pool_size: int, cfg: Config) -> int:
    """Keys a step of the pooled decode kernels' pass over the cache: whole pools, at least 8."""
    return max(8, cfg.block_decode_pools // pool_size) * pool_size


def _decode_pools(pool_size: int, L: int, dtype, G: int, cache_layout: str) -> bool:
    """Whether the decode ops run the pooled kernels: pools of whole lane tiles (128 keys or more),
    a cache of at least one pool, and a head's rows its own (not a bf16 cache [B, L, G, D] of
    several heads, whose rows come with every head's: :func:`_cache_rows`); else the token kernels
    with each row's last pool's keys."""
    return pool_size >= LANE and L >= pool_size and not _cache_rows(dtype, G, cache_layout)[0]


def _mass_step(q, length, c_ref, mh_ref, *, P, scale2, prec):
    """The anchor decode's step over key block c (keys [1, W], kb [W, D], vb [W, D] or None) for
    :meth:`_Blocks.scan`: the online softmax's (m, l, acc) and the block's pool sums
    c_ref[c] [Rq, W / P] at its running max mh_ref[c] [Rq, 1] (:func:`_mass_fold`)."""

    def step(state, c, keys, kb, vb):
        s2 = jnp.where(keys < length, bl.dot_nt(q, kb, prec) * scale2, -jnp.inf)  # [Rq, W]
        return _mass_fold(state, c, s2, vb, c_ref, mh_ref, P=P, prec=prec)

    return step


def _mass_fold(state, c, s2, vb, c_ref, mh_ref, *, P, prec):
    """:func:`_mass_step` past the scores s2 [Rq, W] (log2 units, masked): the online softmax's
    (m, l, acc; acc None without values vb) and the pool sums c_ref[c] at the running max mh_ref[c]."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(s2, axis=1, keepdims=True))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s2 - m_new)
    l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
    c_ref[c] = jnp.sum(p.reshape(p.shape[0], -1, P), axis=2)
    mh_ref[c] = m_new
    if vb is not None:
        acc = acc * alpha + bl.dot_nn(p.astype(vb.dtype), vb, prec)
    return m_new, l, acc


def _pool_masses(c_ref, mh_ref, m, l, count, R):
    """[nb, W / P] the token's attention mass on each pool of the first ``count`` key blocks (0 in
    the rest), pooled over its R query heads: each block's sums rescaled from the running max they
    were taken at to the rows' final log-sum-exp (padding rows weigh 0)."""
    row_ok = lax.broadcasted_iota(jnp.int32, m.shape, 0) < R
    lse = jnp.where(row_ok, m + jnp.log2(jnp.where(l > 0, l, 1.0)), jnp.inf)
    mass = jnp.sum(c_ref[...] * jnp.exp2(mh_ref[...] - lse[None]), axis=1)
    return jnp.where(lax.broadcasted_iota(jnp.int32, mass.shape, 0) < count, mass, 0.0)


def _before(x):
    """For a bool [n, w], the count of true entries before each in row-major order (int32; exact:
    products of 0 and 1, and of counts in float32 at ``HIGHEST``, summed in float32)."""
    n, w = x.shape
    x = x.astype(jnp.bfloat16)
    tri = lambda m, a, b: lax.broadcasted_iota(jnp.int32, (m, m), a) < lax.broadcasted_iota(jnp.int32, (m, m), b)
    in_row = bl.dot_nn(x, tri(w, 0, 1).astype(x.dtype), None)  # [n, w]: those left of it in its row
    rows = bl.dot_nn(x, jnp.ones((w, w), x.dtype), None)  # each row's count, on every lane
    earlier = bl.dot_nn(tri(n, 1, 0).astype(jnp.float32), rows, lax.Precision.HIGHEST)  # the rows above
    return (in_row + earlier).astype(jnp.int32)


def _take_pools(mass, candidates, keep, width, most):
    """The selection of :func:`xla.threshold_top` inside a kernel: of the first ``candidates`` pools
    of mass [n, w] (pool id row-major), the ``keep`` (at most ``most``) of largest mass, ties
    toward the smaller id. The threshold: the largest key (the float bits, ordered) with ``keep``
    keys at or above it, found two bits a step (a step's three counts independent); the ties at it
    by a running count; the slot-th id the count of pools with at most slot taken up to them.
    Returns ids [1, width] int32, ascending, then -1."""
    n, w = mass.shape
    pid = lax.broadcasted_iota(jnp.int32, mass.shape, 0) * w + lax.broadcasted_iota(jnp.int32, mass.shape, 1)
    bits = lax.bitcast_convert_type(mass, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # ordered as the floats are
    low, high = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max
    key = jnp.where(pid < candidates, key, low)
    total = lambda x: jnp.sum(jnp.sum(jnp.where(x, 1.0, 0.0), axis=0, keepdims=True), axis=1, keepdims=True)
    need = keep.astype(jnp.float32)
    lo = jnp.full((1, 1), low, jnp.int32)  # count(key >= lo) >= keep
    for shift in range(30, -1, -2):
        steps = [lo + np.int32(((j << shift) + 2**31) % 2**32 - 2**31) for j in (1, 2, 3)]  # wrapping
        ok = [total(key >= t) >= need for t in steps]
        lo = jnp.where(ok[2], steps[2], jnp.where(ok[1], steps[1], jnp.where(ok[0], steps[0], lo)))
    lo = jnp.minimum(lo, high - 1)  # as a bisection below INT_MAX finds it
    above, tied = key > lo, key == lo
    taken = (above | (tied & (_before(tied) < keep - total(above).astype(jnp.int32)))) & (keep > 0)
    upto = (_before(taken) + taken.astype(jnp.int32)).astype(jnp.float32)  # [n, w]
    slots = round_up(max(most, 1), 8)
    slot = lax.broadcasted_iota(jnp.int32, (slots, w), 0).astype(jnp.float32)
    cnt = functools.reduce(lambda c, r: c + jnp.where(upto[r : r + 1] <= slot, 1.0, 0.0), range(n), 0.0)
    if width > slots:
        cnt = jnp.concatenate([cnt, jnp.zeros((width - slots, w), jnp.float32)], axis=0)
    ids = bl.dot_nt(jnp.ones((8, w), jnp.float32), cnt, lax.Precision.HIGHEST)[:1]  # [1, width]: exact
    at = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    return jnp.where(at < total(taken).astype(jnp.int32), ids.astype(jnp.int32), -1)


def _pool_decode_scores_kernel(lengths_ref, q_ref, k_hbm, *rest, R, P, W, scale2, prec, dense, pick, layout):
    """Grid (B, G): one token's queries q [Rq, D] (R real rows) over a row's valid keys in blocks of
    W (k, and with ``dense`` v, in HBM). Out: mass [Lp / W, W / P] (:func:`_pool_masses`); with
    ``dense`` the softmax partials acc [Rq, D], m, l [Rq, 1]. As the prefill pass
    (:func:`_pool_scores_kernel`): each block's pool sums at the running max, made exact once the
    log-sum-exp is known."""
    if dense:
        v_hbm, mass_ref, acc_ref, m_ref, l_ref, kbuf, vbuf, sems, c_ref, mh_ref = rest
    else:
        (mass_ref, kbuf, sems, c_ref, mh_ref), v_hbm, vbuf = rest, None, None
    b, g = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]
    q = q_ref[...]
    step = _mass_step(q, length, c_ref, mh_ref, P=P, scale2=scale2, prec=prec)
    src, head = _cache_reads(b, g, pick, cache_layout=layout)
    reads = _Blocks(k_hbm, v_hbm, src, kbuf, vbuf, sems, W, pick=head)
    count = bl.cdiv(length, W)
    init = jnp.full((q.shape[0], 1), -jnp.inf, jnp.float32), jnp.zeros((q.shape[0], 1), jnp.float32)
    init += (jnp.zeros(q.shape, jnp.float32),)
    m, l, acc = reads.scan(count, step, init)
    mass_ref[...] = _pool_masses(c_ref, mh_ref, m, l, count, R)
    if dense:
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _pool_decode_scores(q, k_cache, v_cache, lengths, G, L, pool_size, scale, layout, cfg):
    """The anchor decode's pass over the caches: (mass [B, G, L // P] float32, the dense output's
    softmax partials (acc, m, l) with ``v_cache``, else None)."""
    B, H, D = q.shape
    P, W, dense = pool_size, decode_block(pool_size, cfg), v_cache is not None
    Rq = round_up(H // G, 8)
    kc = _cache_in_place(k_cache, W, layout)
    nb = kc.shape[2 if layout == "BGLD" else 1] // W
    whole, pick = _cache_rows(q.dtype, G, layout)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    mass_spec = pl.BlockSpec((None, None, nb, W // P), lambda b, g, *_: (b, g, 0, 0))
    out_specs, out_shape = [mass_spec], [jax.ShapeDtypeStruct((B, G, nb, W // P), jnp.float32)]
    args = [bl.pack_decode_queries(q, G, Rq, D), kc]
    if dense:
        args.append(_cache_in_place(v_cache, W, layout))
        specs, shapes = bl.decode_partials(B, G, 1, Rq, D, lambda b, g, *_: (b, g, 0, 0, 0))
        out_specs, out_shape = out_specs + specs, out_shape + shapes
    scratch = _scratch((W, G, D) if whole else (W, D), q.dtype, False, values=dense)
    scratch += [pltpu.VMEM((nb, Rq, W // P), jnp.float32), pltpu.VMEM((nb, Rq, 1), jnp.float32)]
    kernel = functools.partial(
        _pool_decode_scores_kernel,
        R=H // G,
        P=P,
        W=W,
        scale2=scale * LOG2E,
        prec=bl.precision(q.dtype),
        dense=dense,
        pick=pick,
        layout=layout,
    )
    mass, *parts = _call(
        kernel,
        name="kascade_pool_decode_scores",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, G),
            in_specs=[pl.BlockSpec((None, None, Rq, D), lambda b, g, *_: (b, g, 0, 0)), hbm] + ([hbm] if dense else []),
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        interpret=_interpret(cfg),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 2),
    )(lengths, *args)
    return mass.reshape(B, G, nb * W // P)[:, :, : L // P], (parts if dense else None)


def _attend_pools(q, length, count, id_of, src, head, pairs, sems, *, P, S, L, scale2, prec, kres=None):
    """The sparse decode's fold: one token's queries q [Rq, D] over a row's selected pools (the j-th
    of ``count`` is pool ``id_of(j)``) and its last, partial pool [floor(len / P) P, len). ``pairs``
    (cache in HBM, VMEM buffer [(NPc + 1) P, ...]): keys and values, or with ``kres`` (the row's
    keys resident in VMEM, [>= L, D]) values alone, each pool one copy, all started at once. The
    partial pool first (its copy starts at most at L - P, masked to its keys), then S pools a
    step. Returns the softmax state (m, l, acc)."""
    head = head or (lambda x: x)
    tail = bl.div(length, P) * P
    at = pl.multiple_of(jnp.minimum(tail, L - P), P)

    def copies(j, key):  # slot j (0 the partial pool) from key ``key``, a semaphore a step (waits are exact)
        rows = pl.ds(pl.multiple_of(j * P, P), P)
        return [
            pltpu.make_async_copy(src(x, key, P), buf.at[rows], sems.at[i, bl.div(j + S - 1, S)])
            for i, (x, buf) in enumerate(pairs)
        ]

    for c in copies(0, at):
        c.start()

    @pl.loop(0, count)
    def _(j):
        for c in copies(j + 1, pl.multiple_of(id_of(j) * P, P)):
            c.start()

    full, rem = bl.div(count, S), bl.rem(count, S)
    for j in range(1, S):  # the last step's unfilled pools: zeros (masked; never NaN)

        @pl.when((rem != 0) & (rem <= j))
        def _(j=j):
            rows = pl.ds(pl.multiple_of((1 + full * S + j) * P, P), P)
            for _, buf in pairs:
                buf[rows] = jnp.zeros((P, *buf.shape[1:]), buf.dtype)

    def keys_of(first, n, starts):  # keys [n P, D] of slots first .. first + n - 1
        if kres is None:
            return head(pairs[0][1][pl.ds(pl.multiple_of(first * P, P), n * P)])
        kb = [kres[pl.ds(start, P)] for start in starts]  # the slots' pools, from their first keys
        return kb[0] if n == 1 else jnp.concatenate(kb, axis=0)

    values_of = lambda first, n: head(pairs[-1][1][pl.ds(pl.multiple_of(first * P, P), n * P)])

    def pool_start(j):  # the first key of the j-th selected pool (a padding slot: pool 0)
        return pl.multiple_of(jnp.maximum(id_of(j), 0) * P, P)

    for c in copies(0, at):
        c.wait()
    keys = at + lax.broadcasted_iota(jnp.int32, (1, P), 1)
    s2 = jnp.where((keys >= tail) & (keys < length), bl.dot_nt(q, keys_of(0, 1, [at]), prec) * scale2, -jnp.inf)
    state = bl.softmax_step(bl.start_softmax(*q.shape), s2, values_of(0, 1), prec)

    def wait(i):  # whole step i's S copies: one wait for each cache
        rows = pl.ds(pl.multiple_of((1 + i * S) * P, P), S * P)
        for k, (x, buf) in enumerate(pairs):
            pltpu.make_async_copy(src(x, 0, S * P), buf.at[rows], sems.at[k, 1 + i]).wait()

    def scores(i):  # step i's scores [Rq, S P] and their row max (before its copies land: unread)
        starts = None if kres is None else [pool_start(i * S + j) for j in range(S)]
        s2 = bl.dot_nt(q, keys_of(1 + i * S, S, starts), prec) * scale2
        return s2, jnp.max(s2, axis=1, keepdims=True)

    fold = lambda i, st, s: bl.softmax_step(st, s[0], values_of(1 + i * S, S), prec, s_max=s[1])

    @pl.when(full > 0)
    def _():
        wait(0)

    state = _pipelined(full, wait, scores, fold, state)

    def partial(st):  # the last step's pools, their copies waited one at a time
        @pl.loop(full * S, count)
        def _(j):
            for c in copies(1 + j, 0):
                c.wait()

        s2 = jnp.where(lax.broadcasted_iota(jnp.int32, (1, S * P), 1) < rem * P, scores(full)[0], -jnp.inf)
        return bl.softmax_step(st, s2, values_of(1 + full * S, S), prec)

    return lax.cond(rem > 0, partial, lambda st: st, state)


def _pipelined(n, wait, scores, fold, state):
    """Fold steps 0 .. n - 1 into ``state`` (the caller waited for step 0): a loop trip waits for
    step i + 1 (``wait(i + 1)``) and takes its ``scores`` beside step i's ``fold(i, state,
    scores)``, one basic block for the scheduler; the last step folds after the loop."""

    def body(i, carry):
        st, s = carry
        wait(i + 1)
        return fold(i, st, s), scores(i + 1)

    state, s = lax.fori_loop(0, n - 1, body, (state, scores(0)))
    return lax.cond(n > 0, lambda st: fold(n - 1, st, s), lambda st: st, state)


def _pool_decode_attend_kernel(
    lengths_ref, cnt_ref, q_ref, ids_ref, k_hbm, v_hbm, acc_ref, m_ref, l_ref, kbuf, vbuf, sems, *, pick, layout, **kw
):
    """Grid (B, G): one token's queries q [Rq, D] over the row's selected pools (ids [1, NPp], the
    first cnt[b, g] valid) and its last, partial pool (:func:`_attend_pools`, keys and values
    copied from the caches in HBM into kbuf, vbuf [(NPc + 1) P, ...]); out the softmax partials
    acc [Rq, D], m, l [Rq, 1]."""
    b, g = pl.program_id(0), pl.program_id(1)
    src, head = _cache_reads(b, g, pick, cache_layout=layout)
    pairs = ((k_hbm, kbuf), (v_hbm, vbuf))
    id_of = lambda j: ids_ref[0, j]
    state = _attend_pools(q_ref[...], lengths_ref[b], cnt_ref[b, g], id_of, src, head, pairs, sems, **kw)
    acc_ref[...], m_ref[...], l_ref[...] = state[2], state[0], state[1]


def _pool_decode_attend(q, k_cache, v_cache, lengths, indices, G, L, pool_size, scale, layout, cfg):
    """The pooled sparse decode: softmax partials (acc, m, l) of one split."""
    B, H, D = q.shape
    P = pool_size
    S = max(1, cfg.pool_keys // P)
    Rq = round_up(H // G, 8)
    ids = _pool_ids(indices, P)  # the pools, whole ones of the row
    ids, counts = _compact(ids, (ids >= 0) & (ids < (lengths // P)[:, None, None]))
    NPc = -(-ids.shape[-1] // S) * S
    k_cache, v_cache = (_cache_in_place(x, P, layout) for x in (k_cache, v_cache))  # whole pools
    L = k_cache.shape[2 if layout == "BGLD" else 1]
    whole, pick = _cache_rows(q.dtype, G, layout)
    row = (G, D) if whole else (D,)
    specs, shapes = bl.decode_partials(B, G, 1, Rq, D, lambda b, g, *_: (b, g, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _pool_decode_attend_kernel,
        P=P,
        S=S,
        L=L,
        scale2=scale * LOG2E,
        prec=bl.precision(q.dtype),
        pick=pick,
        layout=layout,
    )
    ids_spec = pl.BlockSpec((None, None, 1, ids.shape[-1]), lambda b, g, *_: (b, g, 0, 0), memory_space=pltpu.SMEM)
    return _call(
        kernel,
        name="kascade_pool_decode_attend",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, G),
            in_specs=[pl.BlockSpec((None, None, Rq, D), lambda b, g, *_: (b, g, 0, 0)), ids_spec, hbm, hbm],
            out_specs=specs,
            scratch_shapes=[pltpu.VMEM(((NPc + 1) * P, *row), q.dtype) for _ in range(2)]
            + [pltpu.SemaphoreType.DMA((2, 1 + NPc // S))],
        ),
        out_shape=shapes,
        interpret=_interpret(cfg),
        # every copy is in range: the ids are clamped, the partial pool's copy starts at most at L - P
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 2, disable_bounds_checks=True),
    )(lengths, counts, bl.pack_decode_queries(q, G, Rq, D), ids[:, :, None, :], k_cache, v_cache)


def _pool_decode_anchor_kernel(
    lengths_ref,
    keep_ref,
    q_ref,
    k_hbm,
    v_hbm,
    ids_ref,
    acc_ref,
    m_ref,
    l_ref,
    kres,
    vbuf,
    c_ref,
    mh_ref,
    ids_vmem,
    ids_smem,
    ksems,
    vsems,
    lsem,
    *,
    R,
    P,
    W,
    S,
    Lv,
    most,
    scale2,
    prec,
    layout,
):
    """Grid (B, G): the anchor decode of one KV head in one program, each key read from HBM once.
    The row's valid keys in blocks of W land in kres [Lp, D] and the token's queries q [Rq, D]
    pool their attention mass over them (:func:`_mass_step`); the keep[b] pools of largest mass
    are taken in the kernel (:func:`_take_pools`): ids [1, NPl], ascending, then -1, which go to
    SMEM; then the sparse fold (:func:`_attend_pools`) copies the values of those pools and of the
    partial pool from HBM and reads their keys from kres. Out: ids, the softmax partials acc
    [Rq, D], m, l [Rq, 1]."""
    b, g = pl.program_id(0), pl.program_id(1)
    length, keep = lengths_ref[b], keep_ref[b]
    q = q_ref[...]
    src, _ = _cache_reads(b, g, None, cache_layout=layout)
    count = bl.cdiv(length, W)

    rows = lambda i: pl.ds(pl.multiple_of(i * W, W), W)
    block = lambda i: pltpu.make_async_copy(src(k_hbm, i * W, W), kres.at[rows(i)], ksems.at[bl.rem(i, 2)])

    def scores(i):  # block i's scores [Rq, W], masked past the row (block 0 of an empty row: unread)
        keys = i * W + lax.broadcasted_iota(jnp.int32, (1, W), 1)
        return jnp.where(keys < length, bl.dot_nt(q, kres[rows(i)], prec) * scale2, -jnp.inf)

    for i in range(min(2, kres.shape[0] // W)):

        @pl.when(i < count)
        def _(i=i):
            block(i).start()

    @pl.when(count > 0)
    def _():
        block(0).wait()

    def wait(i):  # block i's keys (block 0's: waited above), the copy of block i + 1 started first
        @pl.when(i + 1 < count)
        def _():
            block(i + 1).start()

        block(i).wait()

    fold = lambda i, st, s2: _mass_fold(st, i, s2, None, c_ref, mh_ref, P=P, prec=prec)
    init = jnp.full((q.shape[0], 1), -jnp.inf, jnp.float32), jnp.zeros((q.shape[0], 1), jnp.float32), None
    m, l, _ = _pipelined(count, wait, scores, fold, init)
    mass = _pool_masses(c_ref, mh_ref, m, l, count, R)
    ids_ref[...] = ids_vmem[...] = _take_pools(mass, bl.div(length, P), keep, ids_ref.shape[-1], most)
    copy = pltpu.make_async_copy(ids_vmem, ids_smem, lsem.at[0])
    copy.start()
    copy.wait()
    kw = {"P": P, "S": S, "L": Lv, "scale2": scale2, "prec": prec}
    m, l, acc = _attend_pools(
        q, length, keep, lambda j: ids_smem[0, j], src, None, ((v_hbm, vbuf),), vsems, kres=kres, **kw
    )
    acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _keys_fit(L: int, D: int, dtype, pool_size: int, cfg) -> bool:
    """Whether a row's keys fit ``cfg.decode_keys_bytes`` of VMEM, as the one-kernel anchor decode
    holds them (else the two kernels run)."""
    W = decode_block(pool_size, cfg)
    return round_up(L, W) * round_up(D, LANE) * jnp.dtype(dtype).itemsize <= cfg.decode_keys_bytes


def _pool_decode_anchor(q, k_cache, v_cache, lengths, G, pool_size, scale, layout, cfg, *, tenths, min_k, k_max):
    """The anchor decode over pools in one kernel (:func:`_pool_decode_anchor_kernel`): (pool ids
    [B, G, k_max / P] int32, ascending then -1; the softmax partials of one split)."""
    B, H, D = q.shape
    P, Rq = pool_size, round_up(H // G, 8)
    W, S = decode_block(P, cfg), max(1, cfg.pool_keys // P)
    NPo = k_max // P
    NPl, NPc = round_up(max(NPo, 1), LANE), -(-max(NPo, 1) // S) * S
    kc, vc = _cache_in_place(k_cache, W, layout), _cache_in_place(v_cache, P, layout)
    axis = 2 if layout == "BGLD" else 1
    Lp, Lv = kc.shape[axis], vc.shape[axis]
    nb, item = Lp // W, jnp.dtype(q.dtype).itemsize
    keep = pool_count(lengths, tenths, min_k, P).astype(jnp.int32)
    specs, shapes = bl.decode_partials(B, G, 1, Rq, D, lambda b, g, *_: (b, g, 0, 0, 0))
    ids_spec = pl.BlockSpec((None, None, 1, NPl), lambda b, g, *_: (b, g, 0, 0))
    scratch = [pltpu.VMEM((Lp, D), q.dtype), pltpu.VMEM(((NPc + 1) * P, D), q.dtype)]
    scratch += [pltpu.VMEM((nb, Rq, W // P), jnp.float32), pltpu.VMEM((nb, Rq, 1), jnp.float32)]
    scratch += [pltpu.VMEM((1, NPl), jnp.int32), pltpu.SMEM((1, NPl), jnp.int32), pltpu.SemaphoreType.DMA((2,))]
    scratch += [pltpu.SemaphoreType.DMA((1, 1 + NPc // S)), pltpu.SemaphoreType.DMA((1,))]
    Dp = round_up(D, LANE)
    vmem = (Lp + (NPc + 1) * P) * Dp * item + 2 * nb * Rq * LANE * 4 + 8 * Rq * Dp * 4
    kernel = functools.partial(
        _pool_decode_anchor_kernel,
        R=H // G,
        P=P,
        W=W,
        S=S,
        Lv=Lv,
        most=NPo,
        scale2=scale * LOG2E,
        prec=bl.precision(q.dtype),
        layout=layout,
    )
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    ids, *parts = _call(
        kernel,
        name="kascade_pool_decode_anchor",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, G),
            in_specs=[pl.BlockSpec((None, None, Rq, D), lambda b, g, *_: (b, g, 0, 0)), hbm, hbm],
            out_specs=[ids_spec, *specs],
            scratch_shapes=scratch,
        ),
        out_shape=[jax.ShapeDtypeStruct((B, G, 1, NPl), jnp.int32), *shapes],
        interpret=_interpret(cfg),
        # every copy is in range: the selected pools are whole pools of the row, the partial pool's
        # copy starts at most at Lv - P, the key blocks end by Lp
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",) * 2, disable_bounds_checks=True, vmem_limit_bytes=vmem + (8 << 20)
        ),
    )(lengths, keep, bl.pack_decode_queries(q, G, Rq, D), kc, vc)
    return ids[:, :, 0, :NPo], parts


CAPABILITIES = Capabilities(
    "pallas_tpu",
    config=Config,
    cores={
        "anchor": kascade_anchor_tpu,
        "reuse": kascade_reuse_tpu,
        "anchor_decode": kascade_anchor_decode_tpu,
        "reuse_decode": kascade_reuse_decode_tpu,
        "index_select": index_select_tpu,
        "indexed_attention": indexed_attention_tpu,
    },
    forward_only=True,
    kv_as_one=True,
)
