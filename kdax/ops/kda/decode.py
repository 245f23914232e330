"""The recurrent form of KDA as one Pallas kernel, for decoding and verifying draft tokens:
``fused_recurrent_kda`` on ``backend="pallas_tpu"`` and ``"pallas_gpu"`` (docs/kda_decode.md).

One program per (row, value head, V-block) holds its state block in float32 as the caller lays
the states out: ``S`` [Kp, BV] for [K, V] states (the default, and pools of them), ``St = S^T``
[BV, Kp] for a pool of [V, K] states (``state_v_first``). It walks the row's T tokens (a few:
one to decode, or a token and its drafts): per token the gate, the L2 norm of q and k and the
beta sigmoid where the call asks for them in the op, then ``S <- S exp(g)``, the delta rule,
and the output. Every operation is element-wise or a reduction over one axis of the tile (no
matmul: one token's products are matrix-vector), so the same body lowers through Mosaic (TPU)
and Triton (GPU). The kernel reads each state once and writes it once (and, for speculative
decoding, once per token), with no transpose around it.

Token t's vectors are addressed by their leading index. With the state as ``S`` [Kp, BV] q, k
and g come in as [.., T, Kp, 1] columns, v and o as [.., T, 1, BV] rows; with ``St`` (key axis
last) the other way round. beta is [.., T, 1, 1]. So no tile is transposed inside a kernel. K
and V are padded (to multiples of 128 on TPU, powers of two >= 16 on GPU); padded key columns
carry zero keys and queries, so they neither change the state nor the output.

With state slots (:func:`fused_recurrent_slots`) the kernel reads each row's state from the pool
and writes the states back into it (the pool aliased to the output): a DMA between HBM and a
VMEM tile on TPU, a load and a store at the slot's offset on GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common.arrays import pad_last
from kdax.ops.kda import slots
from kdax.ops.kda.gate import in_op, log_decay
from kdax.ops.kda.recurrent import fused_recurrent_kda_xla

MAX_TOKENS = 16  # tokens a row the kernels take (decoding and draft verification; longer inputs: chunk_kda)


@dataclasses.dataclass(frozen=True)
class Options:
    """What the kernel applies in the op: the gate from raw logits (``gate``: per-head exp(A_log)
    and dt_bias are kernel inputs; ``lower_bound`` as :func:`kdax.kda_gate`), the L2 norm of q
    and k, beta = sigmoid (x2 with ``allow_neg_eigval``), and the scale of q."""

    gate: bool = False
    lower_bound: float | None = None
    l2norm: bool = False
    beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    scale: float = 1.0
    token_states: bool = False


def _walk(opt: Options, T: int, kax: int, q_ref, k_ref, v_ref, g_ref, b_ref, p_ref, o_ref, S, after):
    """Walk the row's T tokens from the float32 state tile ``S`` and return the final one.

    ``kax`` is the tile's key axis: 1 for ``St`` [BV, Kp] (q, k, g blocks [T, 1, Kp]; v, o
    [T, BV, 1]; gate parameters [2, Kp]), 0 for ``S`` [Kp, BV] (q, k, g [T, Kp, 1]; v, o
    [T, 1, BV]; gate parameters [Kp, 2]). beta is [T, 1, 1]. ``after(t, S)`` is called with the
    state after token t.
    """
    f32 = jnp.float32
    red = functools.partial(jnp.sum, axis=kax, keepdims=True)  # over the key axis

    def token(t, S):
        q, k, g = (r[t].astype(f32) for r in (q_ref, k_ref, g_ref))
        v, beta = v_ref[t].astype(f32), b_ref[t].astype(f32)
        if opt.l2norm:
            q = q * lax.rsqrt(red(q * q) + 1e-6)
            k = k * lax.rsqrt(red(k * k) + 1e-6)
        if opt.gate:
            a, b = (p_ref[i : i + 1, :] if kax else p_ref[:, i : i + 1] for i in (0, 1))
            g = log_decay(g, a, b, opt.lower_bound)
        if opt.beta_sigmoid:
            beta = jax.nn.sigmoid(beta) * (2.0 if opt.allow_neg_eigval else 1.0)
        S = S * jnp.exp(g)
        pred = red(S * k)  # one prediction per value column
        S = S + (beta * (v - pred)) * k
        o_ref[t] = (red(S * q) * opt.scale).astype(o_ref.dtype)
        after(t, S)
        return S

    return lax.fori_loop(jnp.int32(0), jnp.int32(T), token, S)  # int32 token indices, with x64 on too


def _kernel(opt: Options, T: int, q_ref, k_ref, v_ref, g_ref, b_ref, p_ref, h0_ref, o_ref, fin_ref, *states):
    """Grid (B, HV, V-blocks). Blocks as :func:`_walk`'s with ``kax`` = 0; h0, final [Kp, BV];
    with token_states the state after each token [T, Kp, BV]."""

    def after(t, S):
        if opt.token_states:
            states[0][t] = S

    start = h0_ref[...].astype(jnp.float32)
    fin_ref[...] = _walk(opt, T, 0, q_ref, k_ref, v_ref, g_ref, b_ref, p_ref, o_ref, start, after)


def _slots_kernel(opt: Options, T: int, Tp: int, kax: int, dma: bool, read_ref, write_ref, *refs):
    """Grid (B, HV, V-blocks). read [B]: the row's start slot (-1: a zero state); write [B * Tp]:
    where the state after each token goes (-1: nowhere). The pool in and out is one buffer: with
    ``dma`` (TPU) the whole pool in HBM and a VMEM tile to copy through; else (GPU) blocks
    [S, BV, Kp] (``kax`` = 1) or [S, Kp, BV] of every slot at this head and V-block."""
    *vectors, pool_ref, o_ref, out_ref = refs[:9]
    b = pl.program_id(0)
    src = read_ref[b]
    if dma:
        (tile,) = refs[9:]
        h, j = pl.program_id(1), pl.program_id(2)
        BV = tile.shape[1 - kax]
        block = (pl.ds(j * BV, BV), slice(None)) if kax else (slice(None), pl.ds(j * BV, BV))
        at = lambda ref, slot: ref.at[(slot, h, *block)]

        @pl.when(src >= 0)
        def _():
            pltpu.sync_copy(at(pool_ref, src), tile)

        @pl.when(src < 0)
        def _():
            tile[...] = jnp.zeros(tile.shape, tile.dtype)

        start = tile[...]
    else:
        start = jnp.where(src >= 0, pool_ref[jnp.maximum(src, 0)], 0.0)

    def after(t, S):
        dst = write_ref[b * Tp + t]
        if dma:
            tile[...] = S

        @pl.when(dst >= 0)
        def _():
            if dma:
                pltpu.sync_copy(tile, at(out_ref, dst))
            else:
                out_ref[dst] = S

    _walk(opt, T, kax, *vectors, o_ref, start.astype(jnp.float32), after)


def fused_recurrent(
    q,
    k,
    v,
    g,
    beta,
    h0,
    cu_seqlens=None,
    *,
    opt: Options,
    gate_params,
    Kp: int,
    Vp: int,
    BV: int,
    Tp: int,
    interpret,
    params=None,
):
    """Run the kernel on rows of T tokens (T <= :data:`MAX_TOKENS`); differentiable, the backward
    that of the same math in XLA (:func:`_xla`: decoding rarely needs one, so it is not a kernel).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] (the log decay, or raw logits with
            ``opt.gate``); beta: [B, T, HV] (or its logits with ``opt.beta_sigmoid``).
        h0: [B, 1, HV, K, V] float32, each row's initial state (the backends' core layout).
        cu_seqlens: None (the kernel takes rows).
        opt: the in-kernel :class:`Options`.
        Kp, Vp: the padded head dims; BV: the V-block (divides Vp); Tp >= T: the token axis
            padded (Triton blocks are powers of two); the kernel walks the T real tokens.
        gate_params: (A_log [HV] or None, dt_bias [HV * K] or None), read with ``opt.gate``.
        interpret: run in the Pallas interpreter.
        params: the platform's compiler parameters, or None.

    Returns:
        (o [B, T, HV, V] in q's dtype, final [B, 1, HV, K, V] float32, and with
        ``opt.token_states`` the state after each token [B, T, HV, K, V] float32).
    """
    launch = functools.partial(_launch, opt=opt, Kp=Kp, Vp=Vp, BV=BV, Tp=Tp, interpret=interpret, params=params)

    @jax.custom_vjp
    def run(q, k, v, g, beta, h0, gate_params):
        return launch(q, k, v, g, beta, h0, gate_params)

    def forward(*args):
        return launch(*args), args

    def backward(args, cotangents):
        return jax.vjp(functools.partial(_xla, opt), *args)[1](cotangents)

    run.defvjp(forward, backward)
    o, final, *states = run(q, k, v, g, beta, h0[:, 0], gate_params)
    return o, final[:, None], *states


def _xla(opt: Options, q, k, v, g, beta, h0, gate_params):
    """What the kernel computes, in XLA (its backward)."""
    flags = {"lower_bound": opt.lower_bound, "allow_neg_eigval": opt.allow_neg_eigval}
    flags.update(l2norm_qk=opt.l2norm, gate=opt.gate, beta_sigmoid=opt.beta_sigmoid)
    q, k, g, beta = in_op(q, k, g, beta, *gate_params, **flags)
    groups = v.shape[2] // q.shape[2]
    q, k = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (q, k))
    out = fused_recurrent_kda_xla(q * opt.scale, k, v, g, beta, h0[:, None], None, token_states=opt.token_states)
    return (out[0].astype(v.dtype), out[1][:, 0], *out[2:])


def _vectors(q, k, v, g, beta, gate_params, *, opt: Options, kax: int, Kp, Vp, BV, Tp):
    """The per-token inputs as :func:`_walk` reads them with key axis ``kax``, their BlockSpecs
    over the grid (B, HV, V-blocks), and o's BlockSpec and shape ([B, HV, Tp, Vp, 1] with ``kax``
    = 1, [B, HV, Tp, 1, Vp] with 0)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    groups, f32 = HV // H, jnp.float32
    q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    row = lambda x, d: pad_last(jnp.swapaxes(x, 1, 2), d)[:, :, :, None, :]  # [B, heads, Tp, 1, d]
    col = lambda x, d: pad_last(jnp.swapaxes(x, 1, 2), d)[..., None]  # [B, heads, Tp, d, 1]
    keys, values = (row, col) if kax else (col, row)
    kb, vb = ((1, Kp), (BV, 1)) if kax else ((Kp, 1), (1, BV))
    at_v = (lambda b, h, j: (b, h, 0, j, 0)) if kax else (lambda b, h, j: (b, h, 0, 0, j))
    qk = pl.BlockSpec((None, None, Tp, *kb), lambda b, h, j: (b, lax.div(h, jnp.int32(groups)), 0, 0, 0))
    per_head = pl.BlockSpec((None, None, Tp, *kb), lambda b, h, j: (b, h, 0, 0, 0))
    val = pl.BlockSpec((None, None, Tp, *vb), at_v)
    one = pl.BlockSpec((None, None, Tp, 1, 1), lambda b, h, j: (b, h, 0, 0, 0))
    A_log, dt_bias = gate_params
    p = jnp.zeros((HV, 2, Kp), f32)
    if opt.gate:
        a = jnp.ones((HV,), f32) if A_log is None else jnp.exp(A_log.astype(f32))
        b = jnp.zeros((HV, K), f32) if dt_bias is None else dt_bias.astype(f32).reshape(HV, K)
        p = jnp.stack([jnp.broadcast_to(a[:, None], (HV, Kp)), pad_last(b, Kp)], axis=1)
    p, pb = (p, (2, Kp)) if kax else (jnp.swapaxes(p, 1, 2), (Kp, 2))
    xs = [keys(q, Kp), keys(k, Kp), values(v, Vp), keys(g, Kp), jnp.swapaxes(beta, 1, 2)[..., None, None], p]
    specs = [qk, qk, val, per_head, one, pl.BlockSpec((None, *pb), lambda b, h, j: (h, 0, 0))]
    o_shape = jax.ShapeDtypeStruct((B, HV, Tp, *((Vp, 1) if kax else (1, Vp))), q.dtype)
    return xs, specs, val, o_shape


def _launch(q, k, v, g, beta, h0, gate_params, *, opt: Options, Kp, Vp, BV, Tp, interpret, params):
    """The pallas_call of :func:`fused_recurrent`: the [K, V] states read and written as they are
    (no transpose around the kernel: at B = 64, H = 32 two would move 256 MiB)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2:]
    f32 = jnp.float32
    xs, specs, o_spec, o_shape = _vectors(q, k, v, g, beta, gate_params, opt=opt, kax=0, Kp=Kp, Vp=Vp, BV=BV, Tp=Tp)
    S = jnp.pad(h0.astype(f32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    state = pl.BlockSpec((None, None, Kp, BV), lambda b, h, j: (b, h, 0, j))
    out_specs = [o_spec, state]
    out_shape = [o_shape, jax.ShapeDtypeStruct((B, HV, Kp, Vp), f32)]
    if opt.token_states:
        out_specs.append(pl.BlockSpec((None, None, Tp, Kp, BV), lambda b, h, j: (b, h, 0, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, HV, Tp, Kp, Vp), f32))
    out = pl.pallas_call(
        functools.partial(_kernel, opt, T),
        grid=(B, HV, Vp // BV),
        in_specs=[*specs, state],
        out_specs=out_specs,
        out_shape=out_shape,
        name="kda_fused_recurrent",
        interpret=interpret,
        compiler_params=params,
    )(*xs, S)
    o = jnp.swapaxes(out[0][:, :, :T, 0, :V], 1, 2)  # [B, T, HV, V]
    final = out[1][:, :, :K, :V]
    if not opt.token_states:
        return o, final
    return o, final, out[2][:, :, :T, :K, :V].transpose(0, 2, 1, 3, 4)


def fused_recurrent_slots(
    q,
    k,
    v,
    g,
    beta,
    pool,
    read,
    write,
    *,
    opt: Options,
    gate_params,
    v_first: bool,
    dma: bool,
    BV,
    Tp,
    interpret,
    params,
):
    """The kernel on rows of T tokens with the states in a pool it reads and writes in place (the
    pool aliased to the output: under ``jax.jit`` with the pool donated nothing of its size is
    copied); differentiable, the backward that of :func:`_xla_slots`.

    Args:
        q, k, v, g, beta: as :func:`fused_recurrent`'s.
        pool: [S, HV, K, V] float32, or [S, HV, V, K] with ``v_first``; K and V as the kernel
            pads them (the caller checks: :func:`in_place`).
        read: int32 [B], row b's start slot (-1: a zero state).
        write: int32 [B, T], the slot for the state after each token (-1: not written).
        v_first: the pool's layout; dma: the TPU's way to reach the pool (else the GPU's).
        BV, Tp, interpret, params: as :func:`fused_recurrent`'s.

    Returns:
        (o [B, T, HV, V] in q's dtype, the updated pool).
    """
    launch = functools.partial(
        _launch_slots, opt=opt, v_first=v_first, dma=dma, BV=BV, Tp=Tp, interpret=interpret, params=params
    )

    @jax.custom_vjp
    def run(q, k, v, g, beta, pool, gate_params, read, write):
        return launch(q, k, v, g, beta, pool, read, write, gate_params)

    def forward(*args):
        return run(*args), args

    def backward(args, cotangents):
        *floats, read, write = args
        grads = jax.vjp(functools.partial(_xla_slots, opt, v_first, read, write), *floats)[1](cotangents)
        return *grads, None, None  # the slots are integers

    run.defvjp(forward, backward)
    return run(q, k, v, g, beta, pool, gate_params, read, write)


def in_place(pool, pads, v_first: bool) -> bool:
    """Whether :func:`fused_recurrent_slots` takes a pool: float32, with K and V as the kernel
    pads them (``pads(K, V) -> (Kp, Vp)``, the backend's). (No row may start from a slot another
    row writes, or the programs would race: :func:`kdax.ops.kda.slots.check` refuses such slots.)"""
    K, V = pool.shape[-1:-3:-1] if v_first else pool.shape[-2:]
    return pool.dtype == jnp.float32 and (K, V) == pads(K, V)


def _xla_slots(opt: Options, v_first: bool, read, write, q, k, v, g, beta, pool, gate_params):
    """What :func:`fused_recurrent_slots` computes, in XLA: gather, the recurrence, scatter."""
    h0 = slots.read(pool, read)
    h0 = jnp.swapaxes(h0, -1, -2) if v_first else h0
    o, _, states = _xla(dataclasses.replace(opt, token_states=True), q, k, v, g, beta, h0, gate_params)
    states = jnp.swapaxes(states, -1, -2) if v_first else states
    return o, slots.write(pool, write.reshape(-1), states.reshape(-1, *states.shape[2:]))


def _launch_slots(q, k, v, g, beta, pool, read, write, gate_params, *, opt, v_first, dma, BV, Tp, interpret, params):
    """The pallas_call of :func:`fused_recurrent_slots`."""
    B, T = q.shape[:2]
    V = v.shape[-1]
    S, HV, *tile = pool.shape
    kax = 1 if v_first else 0
    Kp, Vp = tile[::-1] if kax else tile
    xs, specs, o_spec, o_shape = _vectors(q, k, v, g, beta, gate_params, opt=opt, kax=kax, Kp=Kp, Vp=Vp, BV=BV, Tp=Tp)
    if dma:
        indices = [pl.BlockSpec(memory_space=pltpu.SMEM)] * 2
        pool_spec = pl.BlockSpec(memory_space=pl.ANY)
        scratch = [pltpu.VMEM((BV, Kp) if kax else (Kp, BV), jnp.float32)]
    else:
        indices = [pl.BlockSpec((B,), lambda *_: (0,)), pl.BlockSpec((B * Tp,), lambda *_: (0,))]
        blocks = (S, None, BV, Kp) if kax else (S, None, Kp, BV)
        pool_spec = pl.BlockSpec(blocks, (lambda b, h, j: (0, h, j, 0)) if kax else (lambda b, h, j: (0, h, 0, j)))
        scratch = []
    o, pool = pl.pallas_call(
        functools.partial(_slots_kernel, opt, T, Tp, kax, dma),
        grid=(B, HV, Vp // BV),
        in_specs=[*indices, *specs, pool_spec],
        out_specs=[o_spec, pool_spec],
        out_shape=[o_shape, jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        scratch_shapes=scratch,
        input_output_aliases={8: 1},  # the pool
        name="kda_fused_recurrent_slots",
        interpret=interpret,
        compiler_params=params,
    )(
        read.astype(jnp.int32),
        jnp.pad(write.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1).reshape(-1),
        *xs,
        pool,
    )
    o = o[:, :, :T, :V, 0] if kax else o[:, :, :T, 0, :V]
    return jnp.swapaxes(o, 1, 2), pool
