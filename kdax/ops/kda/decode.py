"""The recurrent form of KDA as one Pallas kernel, for decoding and verifying draft tokens:
``fused_recurrent_kda`` on ``backend="pallas_tpu"`` and ``"pallas_gpu"`` (docs/kda_decode.md).

One program per (row, value head, V-block) holds its state block transposed, ``St = S^T``
[BV, Kp] in float32, and walks the row's T tokens (a few: one to decode, or a token and its
drafts): per token the gate, the L2 norm of q and k and the beta sigmoid where the call asks
for them in the op, then ``St <- St exp(g)``, the delta rule, and the output. Every operation is
element-wise or a reduction over one axis of a [BV, Kp] tile (no matmul: one token's products
are matrix-vector), so the same body lowers through Mosaic (TPU) and Triton (GPU). The kernel
reads each state once and writes it once (and, for speculative decoding, once per token).

Token t's rows are addressed by their leading index: q, k and g come in as [.., T, 1, Kp]
rows, v and o as [.., T, BV, 1] columns, beta as [.., T, 1, 1], so no tile is transposed inside
a kernel. K and V are padded (to multiples of 128 on TPU, powers of two >= 16 on GPU); padded
key columns carry zero keys and queries, so they neither change the state nor the output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kdax.ops.common.arrays import pad_last
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


def _kernel(opt: Options, T: int, q_ref, k_ref, v_ref, g_ref, b_ref, p_ref, h0_ref, o_ref, fin_ref, *states):
    """Grid (B, HV, V-blocks). Blocks: q, k, g [T, 1, Kp]; v, o [T, BV, 1]; beta [T, 1, 1];
    gate parameters [2, Kp]; h0, final [BV, Kp]; with token_states the state after each token
    [T, BV, Kp]."""
    f32 = jnp.float32

    def token(t, St):
        q, k, g = (r[t].astype(f32) for r in (q_ref, k_ref, g_ref))  # [1, Kp]
        v, beta = v_ref[t].astype(f32), b_ref[t].astype(f32)  # [BV, 1], [1, 1]
        if opt.l2norm:
            q = q * lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + 1e-6)
            k = k * lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        if opt.gate:
            g = log_decay(g, p_ref[0:1, :], p_ref[1:2, :], opt.lower_bound)
        if opt.beta_sigmoid:
            beta = jax.nn.sigmoid(beta) * (2.0 if opt.allow_neg_eigval else 1.0)
        St = St * jnp.exp(g)
        pred = jnp.sum(St * k, axis=-1, keepdims=True)  # [BV, 1]
        St = St + (beta * (v - pred)) * k
        o_ref[t] = (jnp.sum(St * q, axis=-1, keepdims=True) * opt.scale).astype(o_ref.dtype)
        if opt.token_states:
            states[0][t] = St
        return St

    fin_ref[...] = lax.fori_loop(0, T, token, h0_ref[...].astype(f32))


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


def _launch(q, k, v, g, beta, h0, gate_params, *, opt: Options, Kp, Vp, BV, Tp, interpret, params):
    """The pallas_call of :func:`fused_recurrent`."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    groups, f32 = HV // H, jnp.float32
    q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    rows = lambda x, d: pad_last(jnp.swapaxes(x, 1, 2), d)[:, :, :, None, :]  # [B, heads, Tp, 1, d]
    qr, kr, gr = rows(q, Kp), rows(k, Kp), rows(g, Kp)
    vc = pad_last(jnp.swapaxes(v, 1, 2), Vp)[..., None]  # [B, HV, Tp, Vp, 1]
    bc = jnp.swapaxes(beta, 1, 2)[..., None, None]  # [B, HV, Tp, 1, 1]
    St = jnp.pad(jnp.swapaxes(h0.astype(f32), -1, -2), ((0, 0), (0, 0), (0, Vp - V), (0, Kp - K)))
    A_log, dt_bias = gate_params
    p = jnp.zeros((HV, 2, Kp), f32)
    if opt.gate:
        a = jnp.ones((HV,), f32) if A_log is None else jnp.exp(A_log.astype(f32))
        b = jnp.zeros((HV, K), f32) if dt_bias is None else dt_bias.astype(f32).reshape(HV, K)
        p = jnp.stack([jnp.broadcast_to(a[:, None], (HV, Kp)), pad_last(b, Kp)], axis=1)
    qk_row = pl.BlockSpec((None, None, Tp, 1, Kp), lambda b, h, j: (b, lax.div(h, jnp.int32(groups)), 0, 0, 0))
    g_row = pl.BlockSpec((None, None, Tp, 1, Kp), lambda b, h, j: (b, h, 0, 0, 0))
    col = pl.BlockSpec((None, None, Tp, BV, 1), lambda b, h, j: (b, h, 0, j, 0))
    one = pl.BlockSpec((None, None, Tp, 1, 1), lambda b, h, j: (b, h, 0, 0, 0))
    state = pl.BlockSpec((None, None, BV, Kp), lambda b, h, j: (b, h, j, 0))
    out_specs = [col, state]
    out_shape = [jax.ShapeDtypeStruct((B, HV, Tp, Vp, 1), q.dtype), jax.ShapeDtypeStruct((B, HV, Vp, Kp), f32)]
    if opt.token_states:
        out_specs.append(pl.BlockSpec((None, None, Tp, BV, Kp), lambda b, h, j: (b, h, 0, j, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, HV, Tp, Vp, Kp), f32))
    out = pl.pallas_call(
        functools.partial(_kernel, opt, T),
        grid=(B, HV, Vp // BV),
        in_specs=[qk_row, qk_row, col, g_row, one, pl.BlockSpec((None, 2, Kp), lambda b, h, j: (h, 0, 0)), state],
        out_specs=out_specs,
        out_shape=out_shape,
        name="kda_fused_recurrent",
        interpret=interpret,
        compiler_params=params,
    )(qr, kr, vc, gr, bc, p, St)
    o = jnp.swapaxes(out[0][:, :, :T, :V, 0], 1, 2)  # [B, T, HV, V]
    final = jnp.swapaxes(out[1][:, :, :V, :K], -1, -2)
    if not opt.token_states:
        return o, final
    return o, final, jnp.swapaxes(out[2][:, :, :T, :V, :K], -1, -2).transpose(0, 2, 1, 3, 4)
