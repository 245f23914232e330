"""Chunked KDA as Pallas kernels lowered through Triton (``backend="pallas_gpu"``).

The same full-tile chunk math as the TPU kernels (:mod:`kdax.ops.kda.tiles`, states transposed
``St = S^T`` ``[V, K]``), in the staged form that suits a GPU (docs/kda_gpu.md). Inputs, o and the
gradients are token-major ``[B, slots, heads, D]`` as the caller has them; the intermediates the
kernels pass each other head-major ``[B, HV, slots, D]``:

forward   diag (B, HV, row blocks) -> intra (B, HV, chunks) -> state (B, N, HV, V-blocks)
          -> output (B, HV, chunks, V-blocks)
backward  recompute (B, HV, chunks) -> state cotangent (B, N, HV, V-blocks) -> values (B, HV, chunks)
          -> keys (B, HV, chunks) -> diag grads (B, HV, row blocks) -> levels (B, HV, chunks, K-blocks)

The two sequential kernels give one program to each (sequence, head, V-block), which
walks that sequence's chunks with ``lax.fori_loop``, the state in registers. The others
work on blocks of key columns (``Config.block_k``; values and keys also of value columns,
``Config.block_v``), and the diag, intra and levels kernels on row blocks of ``SUB`` (the
diagonal blocks apart, the off-diagonal ones, nothing above the diagonal), so that
few tiles are live at once (registers, shared memory: scripts/gpu_compile_report.py). K and V are
padded to powers of two >= 16 (Triton's tile rule). Off GPU the kernels run in the
Pallas interpreter (for tests; slow).
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
from kdax.ops.common.arrays import LOG2E, pad_last
from kdax.ops.common.varlen import ChunkLayout
from kdax.ops.kda.gate import L2NORM_EPS, l2norm, log_decay, softplus_exp2
from kdax.ops.kda.tiles import TF32X2, StateProducts, Tiles, chunk_states, last_row

# Whether the compiled kernels have passed the shared cases' error bars on a GPU
# (`scripts/gpu_session.sh tests`, recorded in BENCHMARKS.md). Until then backend="auto" runs
# xla on a GPU; backend="pallas_gpu" runs these kernels all the same.
VERIFIED_ON_GPU = False

# name: (precision of the matmuls, dtype their bulk operands and the stored intermediates are rounded to)
PRECISIONS = {
    "ieee": (lax.Precision.HIGHEST, None),
    "tf32x3": (lax.DotAlgorithmPreset.TF32_TF32_F32_X3, None),
    "tf32": (lax.Precision.DEFAULT, None),
    "bf16": (lax.Precision.DEFAULT, jnp.bfloat16),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The pallas_gpu backend's per-call config (``chunk_kda(..., config=pallas_gpu.Config(...))``).

    Attributes:
        block_v: V block of the state, output, state-cotangent, values and keys kernels; None:
            32 with bfloat16 intermediates, 16 with float32 ones (whose three-pass TF32 products
            spill the state cotangent's loop at 32: docs/kda_gpu.md).
        block_k: K block of the intra, values, keys and levels kernels (both powers of two >= 16).
        precision: of the matmuls, "ieee" (float32 on the FMA units), "tf32x3" (float32 as
            three TF32 tensor-core products), "tf32", "bf16" (bulk matmuls on bfloat16 operands
            and intermediates stored in bfloat16; TF32 for the triangular inverse and the
            pairwise factorisation's backward) or "auto" (bf16 for bfloat16 inputs, tf32x3 for
            float32 and float16). In the interpreter, float32 matmuls are exact whatever the
            precision.
        launch: ((kernel, (num_warps, num_stages)), ...) overriding :data:`LAUNCH`; a launch
            named here is taken as it is (no shared-memory fitting).
        interpret: run in the Pallas interpreter; None: unless on a GPU (or lowering for one).

    Raises:
        ValueError: from :meth:`resolved`, naming the field that is out of range.
    """

    block_v: int | None = None
    block_k: int = 16
    precision: str = "auto"
    launch: tuple[tuple[str, tuple[int, int]], ...] = ()
    interpret: bool | None = None

    def resolved(self) -> Config:
        """This config, its fields checked, with ``interpret`` None replaced by what it means here."""
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(f"config.precision: expected 'auto' or one of {tuple(PRECISIONS)}, got {self.precision!r}")
        for name in ("block_v", "block_k"):
            if (n := getattr(self, name)) is not None and (n < 16 or n & (n - 1)):
                raise ValueError(f"config.{name}: expected a power of two >= 16, got {n}")
        if unknown := set(dict(self.launch)) - set(LAUNCH):
            raise ValueError(f"config.launch: expected kernels among {tuple(LAUNCH)}, got {sorted(unknown)}")
        interpret = dispatch.platform() != "gpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


# (num_warps, num_stages) per kernel at C = 64, K = V = 128, from the compiled code (docs/kda_gpu.md,
# "Shared memory and the launch table"), not yet timed on a GPU: the 16-row kernels at 1 warp (more
# warps would each compute the same 16 x 16 products), intra at 2 (1 spills), values and keys at 4,
# one warp group for their 64-row products.
LAUNCH = {
    "diag": (1, 1),
    "intra": (2, 1),
    "recompute": (1, 1),
    "state": (4, 2),
    "output": (4, 2),
    "dstate": (4, 2),
    "values": (4, 1),
    "keys": (4, 1),
    "diag_grads": (1, 1),
    "levels": (1, 1),
}


# Shared memory one block may use (CUDA's opt-in maximum), KiB, by compute capability.
SHARED_MEMORY_KIB = {"8.0": 163, "8.6": 99, "8.7": 163, "8.9": 99, "9.0": 227, "10.0": 227, "12.0": 99}


def shared_memory_limit() -> tuple[int, str]:
    """Shared memory a block may use on the default GPU.

    Returns:
        (bytes, a description of the GPU): by compute capability (:data:`SHARED_MEMORY_KIB`),
        an H100's where no GPU is present (the interpreter, :func:`kdax.lower`).
    """
    device = jax.devices()[0]
    if device.platform != "gpu":
        return 227 * 1024, "an H100 (no GPU here)"
    cc = str(getattr(device, "compute_capability", ""))
    kib = SHARED_MEMORY_KIB.get(cc)
    if kib is None:  # a GPU not in the table: Hopper's from sm_90 up, else the least of the table
        kib = 227 if cc and float(cc) >= 9 else 99
    return kib * 1024, f"{device.device_kind} (compute capability {cc or 'unknown'})"


def shared_memory(kernel: str, C: int, Kp: int, BV: int, itemsize: int, stages: int = 1) -> int:
    """An upper bound on the shared memory (bytes) of one block of ``kernel`` at chunk size C,
    padded key dim Kp, V block BV, intermediates of ``itemsize`` bytes and ``stages`` pipeline
    stages, from its [C, Kp] and [C, C] tiles: fitted over what the CUDA compiler gave at C = 32
    to 128, K = 64 to 256, bfloat16 and float32 (``scripts/gpu_compile_report.py``; the
    measurements are in tests/ops/kda/test_pallas_gpu.py, which checks the bound against them)."""
    t, c = C * Kp * itemsize, C * C
    f32 = itemsize == 4
    return {
        "diag": 4096,
        "recompute": c * (6 if f32 else 2) + 2048,
        "intra": (c * 5 + 64 * Kp if f32 else c * 5 // 4 + 32 * Kp) + 2048,
        "state": 4 * t + 4096 if stages > 1 else t + c * itemsize // 2,
        "output": max(t, c * itemsize) + BV * max(Kp, C) * 2,
        "dstate": 5 * t + 2 * c * itemsize if stages > 1 else t + c * itemsize // 2,
        "values": c * (20 if f32 else 7) + 4096,
        "keys": c * (10 if f32 else 6) + 8192,
        "diag_grads": (36 if f32 else 10) * 1024,
        "levels": (c if f32 else c // 2) + 2048,
    }[kernel]


def _fit_launch(cfg: Config, C: int, Kp: int, itemsize: int) -> Config:
    """The state loops' software pipeline keeps each stage's tiles in shared memory: where two
    stages would overflow this GPU's shared memory (:func:`shared_memory`; on an H100 past 32 KiB
    a [C, Kp] tile: float32 at K = 256, bf16 at C = 128 and K = 256), those loops get one stage
    unless cfg.launch names them."""
    launch, (limit, _) = dict(cfg.launch), shared_memory_limit()
    for name in ("state", "dstate"):
        if shared_memory(name, C, Kp, cfg.block_v, itemsize, stages=2) > limit:
            launch.setdefault(name, (LAUNCH[name][0], 1))
    return dataclasses.replace(cfg, launch=tuple(launch.items()))


def _too_large(cfg: Config, tiles: Tiles, C: int, K: int, V: int) -> str | None:
    """Why the kernels do not fit this GPU's shared memory at these sizes (None: they do). A
    launch the config names is taken as it is (the compiler says if it does not fit)."""
    Kp, itemsize = _pow2(K), jnp.dtype(_stored(tiles)).itemsize
    cfg = _blocks(cfg, tiles, K, V)
    BV = cfg.block_v
    launch = dict(_fit_launch(cfg, C, Kp, itemsize).launch)
    limit, gpu = shared_memory_limit()
    named = dict(cfg.launch)
    for name in (n for n in LAUNCH if n not in named):
        need = shared_memory(name, C, Kp, BV, itemsize, launch.get(name, LAUNCH[name])[1])
        if need > limit:
            return f"its {name} kernel needs about {-(-need // 1024)} KiB of shared memory a block, {gpu} allows {limit // 1024}"
    return None


def _blocks(cfg: Config, tiles: Tiles, K: int, V: int) -> Config:  # block_v and block_k as the kernels take them
    block_v = cfg.block_v or (32 if tiles.operands else 16)
    return dataclasses.replace(cfg, block_v=min(block_v, _pow2(V)), block_k=min(cfg.block_k, _pow2(K)))


def _params(cfg: Config, kernel: str) -> pltriton.CompilerParams:
    num_warps, num_stages = dict(cfg.launch).get(kernel, LAUNCH[kernel])
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@dataclasses.dataclass(frozen=True)
class _Gate:
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
class _QK:
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


# ----------------------------------------------------------------------------- kernels


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


def _diag_kernel(tiles, gate, qk, BK, q_ref, k_ref, g_ref, gp_ref, b_ref, aqk_ref, kkk_ref, t_ref, *scale_ref):
    """Grid (B, HV, row blocks of S): the diagonal S x S blocks of Aqk and Kkk by the dyadic
    levels (``Tiles.pairs``, summed over key blocks of BK) and T_ii = (I + beta Kkk_ii)^-1, so
    that the intra kernel's key walk carries only the off-diagonal products (docs/kda_gpu.md).
    With ``qk.l2norm`` also the factors of the rows of q and k [S, 2] (scale / ||q||, 1 / ||k||)."""
    f32, S, n_kb = jnp.float32, aqk_ref.shape[0], q_ref.shape[1] // BK
    q_scale, k_scale = qk.scale, 1.0
    if qk.l2norm:

        def squares(kb, acc):
            return tuple(a + jnp.sum(_cols32(r, kb, BK) ** 2, axis=1, keepdims=True) for a, r in zip(acc, (q_ref, k_ref)))  # fmt: skip

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


def _intra_kernel(tiles, gate, qk, BK, BV, interpret, solve, q_ref, k_ref, v_ref, g_ref, gp_ref, b_ref, *refs):
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
        T = _solve(tiles, dict(zip(lower, acc[0::2])), dict(zip(lower, acc[1::2])), *ins[:3], b_ref, aqk_ref,
                   *pair_refs)  # fmt: skip
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


def _state_kernel(tiles, C, start_ref, end_ref, w_ref, u_ref, kd_ref, dec_ref, h0_ref, vn_ref, sin_ref, fin_ref):
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


def _output_kernel(tiles, aqk_ref, qg_ref, vn_ref, sin_ref, o_ref):
    """Grid (B, HV, chunks, V-blocks): o = q_g S_in + Aqk v_new."""
    _put(o_ref, ..., tiles.dot_t(qg_ref[...], sin_ref[...]) + tiles.dot(aqk_ref[...], vn_ref[...]))


def _dstate_kernel(tiles, C, start_ref, end_ref, aqk_ref, qg_ref, kd_ref, w_ref, dec_ref, do_ref, df_ref, *refs):
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


def _values_kernel(tiles, BK, BV, kept, aqk_ref, t_ref, w_ref, kd_ref, u_ref, v_ref, b_ref, sin_ref, do_ref, dso_ref,
                   vn_ref, dvn_ref, dv_ref, daqk_ref, dakku_ref, dbeta_v_ref, d_ref):  # fmt: skip
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


def _keys_kernel(tiles, gate, BK, BV, q_ref, k_ref, g_ref, gp_ref, b_ref, kkk_ref, t_ref, w_ref, sin_ref, dso_ref,
                 do_ref, vn_ref, dvn_ref, d_ref, dakku_ref, dbeta_v_ref, dkkk_ref, db_ref, dq_ref, dk_ref,
                 dg_ref):  # fmt: skip
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


def _diag_grads_kernel(tiles, gate, BK, q_ref, k_ref, g_ref, gp_ref, daqk_ref, dkkk_ref, dq_ref, dk_ref, dg_ref, dq_out,
                       dk_out, dg_out):  # fmt: skip
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


def _levels_kernel(tiles, gate, q_ref, k_ref, g_ref, gp_ref, daqk_ref, dkkk_ref, dq_ref, dk_ref, dg_ref, dq_out,
                   dk_out, dg_out):  # fmt: skip
    """Grid (B, HV, chunks, K-blocks): add the share of the off-diagonal blocks of the pair
    products Aqk and Kkk to dq, dk and dg (the diagonal blocks' share is in them already:
    :func:`_diag_grads_kernel`), on the intra kernel's row blocks, each through its two
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


# ----------------------------------------------------------------------------- wrapper


def _interpret(cfg: Config) -> bool:
    return cfg.resolved().interpret


def _stored(tiles: Tiles):  # dtype of the intermediates that feed only bulk matmuls
    return tiles.operands or jnp.float32


def _tiles(cfg: Config, input_dtype) -> Tiles:
    name = cfg.precision
    if name == "auto":
        name = "bf16" if input_dtype == jnp.bfloat16 else "tf32x3"  # bf16 would lose float16's 3 extra bits
    precision, operands = PRECISIONS[name]
    sums = TF32X2  # the 0/1 sums on the tensor cores (docs/kda_gpu.md)
    if _interpret(cfg):  # no such algorithm on CPU; float32 there is exact anyway
        precision = lax.Precision.HIGHEST if isinstance(precision, lax.DotAlgorithmPreset) else precision
        sums = lax.Precision.HIGHEST
    return Tiles(precision=precision, matmul_reductions=False, operands=operands, sums=sums)


# Inputs and gradients are token-major [B, L, heads, D], as the caller has them (no layout copies);
# the intermediates the kernels pass each other are head-major [B, HV, L, D].


def _per_chunk(C: int, d: int):  # chunk c of head-major [B, HV, L, d] on grid (b, h, c)
    return pl.BlockSpec((None, None, C, d), lambda b, h, c: (b, h, c, 0))


def _head(h, groups: int):  # the q/k head of value head h
    return lax.div(h, jnp.int32(groups))


def _tokens(C: int, d: int, groups: int = 1):  # chunk c of token-major [B, L, heads, d] on grid (b, h, c)
    return pl.BlockSpec((None, C, None, d), lambda b, h, c: (b, c, _head(h, groups), 0))


def _token_cols(C: int, d: int, groups: int = 1):  # its column block j on grid (b, h, c, j)
    return pl.BlockSpec((None, C, None, d), lambda b, h, c, j: (b, c, _head(h, groups), j))


# Specs of the sequential kernels, grid (b, n, h, vb): they see the whole slot (or chunk) axis.


def _whole(*tail):  # [B, HV, rows, D] -> [rows, D]
    return pl.BlockSpec((None, None, *tail), lambda b, n, h, vb: (b, h, 0, 0))


def _whole_vblock(rows: int, BV: int):  # [B, HV, rows, Vp] -> [rows, BV]
    return pl.BlockSpec((None, None, rows, BV), lambda b, n, h, vb: (b, h, 0, vb))


def _whole_tokens(L: int, BV: int):  # token-major [B, L, HV, Vp] -> [L, BV]
    return pl.BlockSpec((None, L, None, BV), lambda b, n, h, vb: (b, 0, h, vb))


def _chunk_states(NC: int, BV: int, Kp: int):  # [B, HV, NC, Vp, Kp] -> [NC, BV, Kp]
    return pl.BlockSpec((None, None, NC, BV, Kp), lambda b, n, h, vb: (b, h, 0, vb, 0))


def _seq_state(BV: int, Kp: int):  # [B, N, HV, Vp, Kp] -> [BV, Kp] of sequence n
    return pl.BlockSpec((None, None, None, BV, Kp), lambda b, n, h, vb: (b, n, h, vb, 0))


def _seq_range(N: int):  # [N] int32, whole
    return pl.BlockSpec((N,), lambda *_: (0,))


def _per_chunk_row(d: int):  # row c of [B, HV, NC, d] on grid (b, h, c)
    return pl.BlockSpec((None, None, 1, d), lambda b, h, c: (b, h, c, 0))


def _gate_spec(Kp: int):  # per-head gate parameters [HV, 2, Kp] on grid (b, h, c)
    return pl.BlockSpec((None, 2, Kp), lambda b, h, c: (h, 0, 0))


def _run_intra(q, k, v, g, gp, beta, C, groups, tiles, cfg, gate, qk, backward=False, T=None):
    """The diag and intra kernels: Aqk [B, HV, L, C], w [.., Kp], u [.., Vp], q_g, k_d [.., Kp], decay
    [B, HV, NC, Kp], and with ``backward`` also Kkk (float32), T [B, HV, L, C]; the [C, D] ones in
    :func:`_stored` dtype; q and k as :class:`_QK` ``qk`` says. Given the forward's T, the intra
    kernel alone recomputes w, u, q_g, k_d and decay (the backward's ``kda_recompute``)."""
    B, L, HV, Vp = v.shape
    Kp, NC, f32, sd = k.shape[-1], L // C, jnp.float32, _stored(tiles)
    spec, tok, S = functools.partial(_per_chunk, C), functools.partial(_tokens, C), min(SUB, C)
    tiled = lambda d, t: jax.ShapeDtypeStruct((B, HV, L, d), t)
    head = [(C, sd)] if T is None else []  # Aqk (the recompute writes none)
    head += [(Kp, sd), (Vp, sd), (Kp, sd), (Kp, sd)]  # w, u, q_g, k_d; then decay
    tail = [(C, f32), (C, sd)] if backward else []  # Kkk, T
    if T is None:
        ins = pl.pallas_call(
            functools.partial(_diag_kernel, tiles, gate, qk, cfg.block_k),
            name="kda_diag",
            grid=(B, HV, L // S),
            in_specs=[_tokens(S, Kp, groups)] * 2 + [_tokens(S, Kp), _gate_spec(Kp), _tokens(S, 1)],
            out_specs=[_per_chunk(S, S)] * 3 + [_per_chunk(S, 2)] * qk.l2norm,
            out_shape=[tiled(S, sd), tiled(S, f32), tiled(S, f32)] + [tiled(2, f32)] * qk.l2norm,
            compiler_params=_params(cfg, "diag"), interpret=_interpret(cfg),
        )(q, k, g, gp, beta)  # fmt: skip
        name, in_specs = "intra", [spec(S)] * 3 + [spec(2)] * qk.l2norm
    else:
        ins, name, in_specs = [T], "recompute", [spec(C)]
    return pl.pallas_call(
        functools.partial(_intra_kernel, tiles, gate, qk, cfg.block_k, cfg.block_v, _interpret(cfg), T is None),
        name=f"kda_{name}",
        grid=(B, HV, NC),
        in_specs=[tok(Kp, groups), tok(Kp, groups), tok(Vp), tok(Kp), _gate_spec(Kp), tok(1)] + in_specs,
        out_specs=[spec(d) for d, _ in head] + [_per_chunk_row(Kp)] + [spec(d) for d, _ in tail],
        out_shape=[tiled(*x) for x in head] + [jax.ShapeDtypeStruct((B, HV, NC, Kp), f32)]
        + [tiled(*x) for x in tail],
        compiler_params=_params(cfg, name), interpret=_interpret(cfg),
    )(q, k, v, g, gp, beta, *ins)  # fmt: skip


def _forward(q, k, v, g, gp, beta, h0t, ranges, C, groups, tiles, cfg, gate, qk, keep):
    """Token-major inputs on the padded slot axis: q, k [B, L, H, Kp] (as :class:`_QK` ``qk`` takes
    them), v [B, L, HV, Vp] (in :func:`_stored` dtype); g [B, L, HV, Kp] (natural-log decay or
    logits, :class:`_Gate`) and its parameters gp [HV, 2, Kp]; beta [B, L, HV, 1] (float32);
    h0t [B, N, HV, Vp, Kp];
    ranges (start, end) int32 [N] chunk range of each sequence. Returns o [B, L, HV, Vp] (v's dtype),
    final [B, N, HV, Vp, Kp], S_in [B, HV, NC, Vp, Kp] (stored dtype), and what ``keep`` says the
    backward is to get: None (nothing), "pairs" (Aqk, Kkk and T, from which it recomputes the rest)
    or "all" (the intra kernel's outputs, :func:`_run_intra` with ``backward``, and v_new)."""
    B, L, HV, Vp = v.shape
    Kp, NC, N, BV, f32, sd = k.shape[-1], L // C, h0t.shape[1], cfg.block_v, jnp.float32, _stored(tiles)
    intra = _run_intra(q, k, v, g, gp, beta, C, groups, tiles, cfg, gate, qk, backward=keep is not None)
    aqk, w, u, q_g, k_d, dec = intra[:6]
    seq, state = _seq_range(N), _seq_state(BV, Kp)
    v_new, s_in, final = pl.pallas_call(
        functools.partial(_state_kernel, tiles, C),
        name="kda_state",
        grid=(B, N, HV, Vp // BV),
        in_specs=[seq, seq, _whole(L, Kp), _whole_vblock(L, BV), _whole(L, Kp), _whole(NC, Kp), state],
        out_specs=[_whole_vblock(L, BV), _chunk_states(NC, BV, Kp), state],
        out_shape=[jax.ShapeDtypeStruct((B, HV, L, Vp), sd), jax.ShapeDtypeStruct((B, HV, NC, Vp, Kp), sd),
                   jax.ShapeDtypeStruct(h0t.shape, f32)],
        compiler_params=_params(cfg, "state"), interpret=_interpret(cfg),
    )(*ranges, w, u, k_d, dec, h0t)  # fmt: skip
    o = pl.pallas_call(
        functools.partial(_output_kernel, tiles),
        name="kda_output",
        grid=(B, HV, NC, Vp // BV),
        in_specs=[
            pl.BlockSpec((None, None, C, C), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((None, None, C, Kp), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((None, None, C, BV), lambda b, h, c, vb: (b, h, c, vb)),
            pl.BlockSpec((None, None, None, BV, Kp), lambda b, h, c, vb: (b, h, c, vb, 0)),
        ],
        out_specs=_token_cols(C, BV),
        out_shape=jax.ShapeDtypeStruct((B, L, HV, Vp), v.dtype),
        compiler_params=_params(cfg, "output"), interpret=_interpret(cfg),
    )(aqk, q_g, v_new, s_in)  # fmt: skip
    return o, final, s_in, {None: None, "pairs": intra[:1] + intra[6:], "all": (*intra, v_new)}[keep]


def _backward(q, k, v, g, gp, beta, ranges, S_in, kept, do, dfinal_t, dS_in, C, groups, tiles, cfg, gate):
    """Cotangents of q, k (prepared: :meth:`_QK.prepare`), v, the decay (float32), beta and h0t
    (dq, dk summed over each group's value heads). kept: what :func:`_forward` kept ("pairs": w,
    u, q_g, k_d and decay are recomputed from T; "all"); dS_in: cotangent of S_in, or None."""
    B, L, HV, Vp = v.shape
    H, Kp, NC, N, BV = k.shape[2], k.shape[-1], L // C, dfinal_t.shape[1], cfg.block_v
    f32, sd = jnp.float32, _stored(tiles)
    if len(kept) == 3:
        aqk, kkk, T = kept
        w, u, q_g, k_d, dec = _run_intra(q, k, v, g, gp, beta, C, groups, tiles, cfg, gate, _QK(), T=T)
        v_new_in = []  # the values kernel computes v_new
    else:
        *intra, v_new = kept
        aqk, w, u, q_g, k_d, dec, kkk, T = intra
        v_new_in = [v_new]
    seq, state = _seq_range(N), _seq_state(BV, Kp)
    dh = [] if dS_in is None else [dS_in]
    dS_out, dh0t = pl.pallas_call(
        functools.partial(_dstate_kernel, tiles, C),
        name="kda_state_cotangent",
        grid=(B, N, HV, Vp // BV),
        in_specs=[seq, seq, _whole(L, C), _whole(L, Kp), _whole(L, Kp), _whole(L, Kp), _whole(NC, Kp),
                  _whole_tokens(L, BV), state] + [_chunk_states(NC, BV, Kp)] * len(dh),
        out_specs=[_chunk_states(NC, BV, Kp), state],
        out_shape=[jax.ShapeDtypeStruct((B, HV, NC, Vp, Kp), sd), jax.ShapeDtypeStruct(dfinal_t.shape, f32)],
        compiler_params=_params(cfg, "dstate"), interpret=_interpret(cfg),
    )(*ranges, aqk, q_g, k_d, w, dec, do, dfinal_t, *dh)  # fmt: skip
    spec, tok = functools.partial(_per_chunk, C), functools.partial(_tokens, C)
    qk = tok(Kp, groups)
    st = pl.BlockSpec((None, None, None, Vp, Kp), lambda b, h, c: (b, h, c, 0, 0))
    BK = cfg.block_k
    n_out = 2 - len(v_new_in)  # v_new (unless kept) and dv_new
    *v_new_out, dv_new, dv, daqk, dakk_u, dbeta_v, d = pl.pallas_call(
        functools.partial(_values_kernel, tiles, BK, BV, bool(v_new_in)),
        name="kda_values",
        grid=(B, HV, NC),
        in_specs=[spec(C), spec(C), spec(Kp), spec(Kp), spec(Vp), tok(Vp), tok(1), st, tok(Vp), st]
        + [spec(Vp)] * len(v_new_in),
        out_specs=[spec(Vp)] * n_out + [tok(Vp)] + [spec(C)] * 2 + [spec(1)] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, HV, L, Vp), sd)] * n_out + [jax.ShapeDtypeStruct(v.shape, v.dtype)]
        + [jax.ShapeDtypeStruct((B, HV, L, d), f32) for d in (C, C, 1, 1)],
        compiler_params=_params(cfg, "values"), interpret=_interpret(cfg),
    )(aqk, T, w, k_d, u, v, beta, S_in, do, dS_out, *v_new_in)  # fmt: skip
    v_new = (*v_new_in, *v_new_out)[0]
    dkkk, dbeta, dq, dk, dG = pl.pallas_call(
        functools.partial(_keys_kernel, tiles, gate, BK, BV),
        name="kda_keys",
        grid=(B, HV, NC),
        in_specs=[qk, qk, tok(Kp), _gate_spec(Kp), tok(1), spec(C), spec(C), spec(Kp), st, st, tok(Vp), spec(Vp),
                  spec(Vp), spec(1), spec(C), spec(1)],
        out_specs=[spec(C), tok(1), spec(Kp), spec(Kp), spec(Kp)],
        out_shape=[jax.ShapeDtypeStruct((B, HV, L, C), f32), jax.ShapeDtypeStruct(beta.shape, f32)]
        + [jax.ShapeDtypeStruct((B, HV, L, Kp), f32)] * 3,
        compiler_params=_params(cfg, "keys"), interpret=_interpret(cfg),
    )(q, k, g, gp, beta, kkk, T, w, S_in, dS_out, do, v_new, dv_new, d, dakk_u, dbeta_v)  # fmt: skip
    cols = pl.BlockSpec((None, None, C, BK), lambda b, h, c, kb: (b, h, c, kb))
    pair = pl.BlockSpec((None, None, C, C), lambda b, h, c, kb: (b, h, c, 0))
    gp_cols = pl.BlockSpec((None, 2, BK), lambda b, h, c, kb: (h, 0, kb))
    S = min(SUB, C)
    rows = _per_chunk(S, Kp)
    diag = pl.BlockSpec((None, None, S, S), lambda b, h, r: (b, h, r, lax.rem(r, jnp.int32(C // S))))
    dq, dk, dG = pl.pallas_call(
        functools.partial(_diag_grads_kernel, tiles, gate, BK),
        name="kda_diag_grads",
        grid=(B, HV, L // S),
        in_specs=[_tokens(S, Kp, groups)] * 2 + [_tokens(S, Kp), _gate_spec(Kp), diag, diag, rows, rows, rows],
        out_specs=[rows] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, HV, L, Kp), f32)] * 3,
        input_output_aliases={6: 0, 7: 1, 8: 2},
        compiler_params=_params(cfg, "diag_grads"), interpret=_interpret(cfg),
    )(q, k, g, gp, daqk, dkkk, dq, dk, dG)  # fmt: skip
    dqk = q.dtype if groups == 1 else f32  # summed over the group in XLA otherwise
    dq, dk, dg = pl.pallas_call(
        functools.partial(_levels_kernel, tiles, gate),
        name="kda_levels",
        grid=(B, HV, NC, Kp // BK),
        in_specs=[_token_cols(C, BK, groups)] * 2 + [_token_cols(C, BK), gp_cols, pair, pair, cols, cols, cols],
        out_specs=[_token_cols(C, BK)] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, L, HV, Kp), t) for t in (dqk, dqk, f32)],
        compiler_params=_params(cfg, "levels"), interpret=_interpret(cfg),
    )(q, k, g, gp, daqk, dkkk, dq, dk, dG)  # fmt: skip
    dq, dk = (x.reshape(B, L, H, groups, Kp).sum(3).astype(q.dtype) for x in (dq, dk))
    return dq, dk, dv, dg, dbeta, dh0t


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13, 14, 15))
def _core(q, k, v, g, gp, beta, h0t, ranges, C, groups, tiles, cfg, gate, qk, keep, states):
    o, final, S_in, _ = _forward(q, k, v, g, gp, beta, h0t, ranges, C, groups, tiles, cfg, gate, qk, keep=None)
    return o, final, (S_in if states else None)


def _core_fwd(q, k, v, g, gp, beta, h0t, ranges, C, groups, tiles, cfg, gate, qk, keep, states):
    o, final, S_in, kept = _forward(q, k, v, g, gp, beta, h0t, ranges, C, groups, tiles, cfg, gate, qk,
                                    "all" if keep else "pairs")  # fmt: skip
    return (o, final, (S_in if states else None)), (q, k, v, g, gp, beta, ranges, S_in, kept)


def _core_bwd(C, groups, tiles, cfg, gate, qk, keep, states, res, cts):
    q, k, v, g, gp, beta, ranges, S_in, kept = res
    do, dfinal_t, dS_in = cts
    (qp, kp), pull = jax.vjp(qk.prepare, q, k)
    dq, dk, dv, dG, dbeta, dh0t = _backward(qp, kp, v, g, gp, beta, ranges, S_in, kept, do, dfinal_t, dS_in, C, groups,
                                            tiles, cfg, gate)  # fmt: skip
    return (*pull((dq, dk)), dv, *gate.vjp(g, gp, dG), dbeta, dh0t, (None, None))


_core.defvjp(_core_fwd, _core_bwd)


def _pow2(n: int) -> int:  # smallest power of two >= max(n, 16)
    return max(16, 1 << (n - 1).bit_length())


def _gate_params(gate, HV: int, K: int, Kp: int):  # [HV, 2, Kp]: exp(A_log), dt_bias (zeros when g is the decay)
    f32 = jnp.float32
    if gate is None:
        return jnp.zeros((HV, 2, Kp), f32)
    A_log, dt_bias, _ = gate
    a = jnp.ones((HV,), f32) if A_log is None else jnp.exp(A_log.astype(f32))
    b = jnp.zeros((HV, K), f32) if dt_bias is None else dt_bias.astype(f32).reshape(HV, K)
    return jnp.stack([jnp.broadcast_to(a[:, None], (HV, Kp)), pad_last(b, Kp)], axis=1)


def chunk_fits(input_dtype, chunk_size: int, cfg: Config = Config(), K: int = 128, V: int = 128) -> str | None:
    """Whether the kernels fit this GPU's shared memory (:func:`shared_memory` against
    :func:`shared_memory_limit`). On an H100 every size fits with bfloat16 intermediates, and
    chunk sizes up to 64 with float32 ones (the values kernel's [C, C] tiles).

    Args:
        input_dtype: the inputs' dtype (with ``cfg.precision`` it sets the intermediates').
        chunk_size: C.
        cfg: the config.
        K, V: the head dims.

    Returns:
        None where they fit, else why not (which kernel needs how much, what the GPU allows).
    """
    cfg = cfg.resolved()
    return _too_large(cfg, _tiles(cfg, input_dtype), chunk_size, K, V)


def chunk_kda_pallas_gpu(q, k, v, g, beta, h0, layout: ChunkLayout, input_dtype=jnp.float32, cfg: Config = Config(),
                         gate=None, g_dtype=None, l2norm_qk: bool = False, scale: float = 1.0,
                         disable_recompute: bool = False, intermediate_states: bool = False):  # fmt: skip
    """Core chunked KDA with the GPU kernels, on prepared float32 inputs.

    q, k: [B, T, H, K] (not repeated over value heads; the kernels take the L2 norm of both
    when ``l2norm_qk`` and scale q by ``scale``); v: [B, T, HV, V];
    g: [B, T, HV, K] natural-log decay, or with ``gate = (A_log [HV] | None, dt_bias [HV * K] | None,
    lower_bound | None)`` the raw logits that the kernels turn into the decay as
    :func:`~kdax.ops.kda.gate.kda_gate` does; beta: [B, T, HV]; h0: [B, N, HV, K, V];
    input_dtype: the caller's dtype (chooses the matmul precision under "auto");
    g_dtype: the caller's dtype of g (bfloat16 or float16 g is read as such);
    disable_recompute: the forward keeps the intra kernel's outputs and v_new for the backward,
    which then runs neither again.
    Returns (o [B, T, HV, V], final [B, N, HV, K, V]) and with ``intermediate_states`` the state
    entering each chunk [B, NC, HV, K, V] (differentiable; chunks no sequence uses are 0); o and
    those states in bfloat16 under precision "bf16".

    The kernels read q, k, v (rounded to :func:`_stored` dtype), g and beta token-major as they
    come: with no cu_seqlens, T a multiple of the chunk and K, V powers of two >= 16, XLA
    makes no copy of them (under "bf16", the float32 the caller upcast to folds back)."""
    cfg = cfg.resolved()
    tiles = _tiles(cfg, input_dtype)
    H, K = q.shape[2:]
    HV, V = v.shape[2:]
    if why := _too_large(cfg, tiles, layout.chunk_size, K, V):
        raise ValueError(f"chunk_size: pallas_gpu with {jnp.dtype(_stored(tiles))} intermediates at chunk_size="
                         f"{layout.chunk_size}, K={K}, V={V} does not fit: {why}; use a smaller chunk_size, bfloat16 "
                         f"inputs or backend='xla'")  # fmt: skip
    Kp, Vp = _pow2(K), _pow2(V)
    cfg = _blocks(cfg, tiles, K, V)
    sd = _stored(tiles)
    cfg = _fit_launch(cfg, layout.chunk_size, Kp, jnp.dtype(sd).itemsize)
    qt, kt = (pad_last(layout.pack(x.astype(sd)), Kp) for x in (q, k))
    kgate = _Gate(gate is not None, None if gate is None else gate[2])
    if g_dtype in (jnp.bfloat16, jnp.float16):
        g = g.astype(g_dtype)
    vt, gt = pad_last(layout.pack(v.astype(sd)), Vp), pad_last(layout.pack(g, kgate.fill), Kp, kgate.fill)
    bt = layout.pack(beta[..., None])
    h0t = pad_last(jnp.swapaxes(pad_last(h0, Vp), -1, -2), Kp)  # [B, N, HV, Vp, Kp]
    ranges = (layout.seq_chunk_start, layout.seq_chunk_end)
    gp = _gate_params(gate, HV, K, Kp)
    qk = _QK(l2norm_qk, float(scale))
    o, final, S_in = _core(qt, kt, vt, gt, gp, bt, h0t, ranges, layout.chunk_size, HV // H, tiles, cfg, kgate, qk,
                           disable_recompute, intermediate_states)  # fmt: skip
    o, final = layout.unpack(o[..., :V]), jnp.swapaxes(final, -1, -2)[..., :K, :V]
    if not intermediate_states:
        return o, final
    return o, final, chunk_states(layout, S_in, K, V)
