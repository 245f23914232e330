"""Context-parallel ``chunk_kda``: the time axis sharded over a device-mesh axis (docs/scale.md).

A device's slice of a sequence maps the state entering it affinely: S_out = M S_in + S_ext,
M [K, K] the product of the slice's per-token maps (I - beta k k^T) Diag(alpha), S_ext the
state the slice leaves from a zero one (FLA's context-parallel design). Both come from one
ordinary local ``chunk_kda`` whose values carry K extra zero columns and whose entering
state carries the identity there: the extra columns of the final state are M, those of the
output are q_t^T M_t, so the true output and states follow from the entering state by one
product each. One ``all_gather`` of the (S_ext, M) pairs, HV x K x (V + K) floats per device
and sequence row, lets every device fold the devices before it into its entering state;
final states are summed over the axis from the device each sequence ends on. Nothing the
devices exchange grows with T. Gradients are autodiff's: the local op's own backward, the
fold's, and the gather's transpose (a reduce-scatter of the same size).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdax.ops.common.arrays import round_up
from kdax.ops.common.validation import fail


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Shard ``chunk_kda``'s time axis over a device-mesh axis.

    Attributes:
        axis: the mesh axis the time axis is split over.
        mesh: a ``jax.sharding.Mesh`` holding ``axis``: the op takes global arrays, shards their
            time axis itself (padding T to a multiple of the axis size times chunk_size) and
            returns o sharded over time and the final states replicated. None: the op is called
            inside the caller's ``jax.shard_map`` where ``axis`` is bound, on each device's
            contiguous time slice (local T a multiple of chunk_size); ``cu_seqlens``,
            ``initial_state`` and the final states are global and replicated.
    """

    axis: str
    mesh: jax.sharding.Mesh | None = None


def check(cp, T: int, chunk_size: int) -> None:
    """Raise ValueError for a context_parallel that does not fit the call.

    Args:
        cp: the ``context_parallel`` argument.
        T: the time axis of the arrays the op got (local with ``mesh=None``).
        chunk_size: the op's chunk size.
    """
    if not isinstance(cp, ContextParallel):
        fail("context_parallel", "None or a kdax.ContextParallel", type(cp).__name__)
    if cp.mesh is not None:
        if cp.axis not in cp.mesh.axis_names:
            fail("context_parallel.axis", f"one of the mesh's axes {tuple(cp.mesh.axis_names)}", repr(cp.axis))
        return
    try:
        lax.axis_index(cp.axis)
    except NameError:
        fail("context_parallel.axis", "an axis bound by the caller's jax.shard_map (or give a mesh)", repr(cp.axis))
    if T % chunk_size:
        fail("q", f"a local time axis that is a multiple of chunk_size={chunk_size} inside shard_map", f"T={T}")


def sharded(
    local,
    cp: ContextParallel,
    q,
    k,
    v,
    g,
    beta,
    params,
    initial_state,
    cu_seqlens,
    *,
    pad_gate: float,
    return_intermediate_states: bool,
    chunk_size: int,
    final_states: bool = True,
):
    """The mesh form: pad T, ``jax.shard_map`` :func:`on_device` over ``cp.axis``, unpad.

    Args:
        local: the single-device op, ``local(q, k, v, g, beta, params, initial_state, cu_seqlens)``
            -> (o, final_state[, h]) with final states always returned.
        cp: with a mesh.
        q, k, v, g, beta: global [B, T, ...] arrays.
        params: (A_log, dt_bias) or Nones, replicated.
        initial_state: [N, HV, K, V] or None; cu_seqlens: [N + 1] or None.
        pad_gate: the g of padding tokens (0, or -inf for raw gate logits: no decay either way).
        return_intermediate_states, chunk_size: as ``chunk_kda``.
        final_states: whether the final states are wanted (else None, and not summed).

    Returns:
        (o [B, T, HV, V] sharded over time, final_state [N, HV, K, V] replicated[, h]).
    """
    W = cp.mesh.shape[cp.axis]
    T = q.shape[1]
    Tp = W * round_up(-(-T // W), chunk_size)

    def pad(x, fill=0.0):  # padding tokens are identity maps of the state: k = 0 (no write, no erase), no decay
        return jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)

    if cu_seqlens is not None:  # the last sequence takes the padding (identity maps leave its state as it was)
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32).at[-1].set(Tp)
    time = P(None, cp.axis)
    run = jax.shard_map(
        functools.partial(
            on_device, local, cp.axis, return_intermediate_states=return_intermediate_states, final_states=final_states
        ),
        mesh=cp.mesh,
        in_specs=(time, time, time, time, time, P(), P(), P()),
        out_specs=(time, P()) + ((time,) if return_intermediate_states else ()),
        check_vma=False,
    )
    args = (pad(q), pad(k), pad(v), pad(g, pad_gate), pad(beta), params, initial_state, cu_seqlens)
    # onto the layout shard_map takes (its specs must match the inputs' types on a mesh of Explicit axes)
    shardings = [NamedSharding(cp.mesh, time)] * 5 + [NamedSharding(cp.mesh, P())] * 3
    o, final, *h = run(*(jax.reshard(x, s) if x is not None else x for x, s in zip(args, shardings)))
    if Tp == T:
        return (o, final, *h)
    if cp.mesh._name_to_type[cp.axis] == jax.sharding.AxisType.Explicit:  # an uneven split has no Explicit type
        o, h = jax.reshard((o, h), NamedSharding(cp.mesh, P()))
    return (o[:, :T], final, *(x[:, : -(-T // chunk_size)] for x in h))


def on_device(
    local,
    axis: str,
    q,
    k,
    v,
    g,
    beta,
    params,
    initial_state,
    cu_seqlens,
    *,
    return_intermediate_states: bool,
    final_states: bool = True,
):
    """One device's part (inside ``shard_map`` over ``axis``): its slice [B, Tl, ...] of the time axis.

    Returns:
        (o [B, Tl, HV, V], final_state [N, HV, K, V] summed over the axis (None without
        ``final_states``: nothing to sum)[, h of the slice's chunks]).
    """
    W, r = lax.axis_size(axis), lax.axis_index(axis)
    B, Tl = q.shape[:2]
    K, (HV, V) = k.shape[-1], v.shape[2:]
    dt = jnp.promote_types(q.dtype, jnp.float32)
    if cu_seqlens is None:  # every row one sequence over all devices
        N = B
        cont = jnp.broadcast_to(r > 0, (N,))  # enters from the device before
        leaves = jnp.broadcast_to(r < W - 1, (N,))  # goes on to the next
        ends = jnp.broadcast_to(r == W - 1, (N,))  # its final state is this device's
        local_cu = None
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        N = cu.shape[0] - 1
        lo, hi = r * Tl, (r + 1) * Tl
        local_cu = jnp.clip(cu - lo, 0, Tl)
        here = local_cu[1:] > local_cu[:-1]
        cont, leaves = here & (cu[:-1] < lo), here & (cu[1:] > hi)
        last = jnp.where(cu[1:] > cu[:-1], cu[1:] - 1, cu[:-1])  # an empty sequence belongs where it sits
        ends = jnp.clip(last // Tl, 0, W - 1) == r
    h0 = jnp.zeros((N, HV, K, V), dt) if initial_state is None else jnp.asarray(initial_state, dt)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=dt), (N, HV, K, K))
    c = cont[:, None, None, None]
    h0_aug = jnp.concatenate([jnp.where(c, 0, h0), jnp.where(c, eye, 0)], axis=-1)  # [N, HV, K, V + K]
    v_aug = jnp.concatenate([v, jnp.zeros((B, Tl, HV, K), v.dtype)], axis=-1)
    o_aug, fin, *h = local(q, k, v_aug, g, beta, params, h0_aug, local_cu)
    fin = fin.astype(dt)

    # the pair leaving this device: per row (dense rows), or the one sequence that goes on (varlen)
    pair = jnp.where(leaves[:, None, None, None], fin, 0)
    pair = pair if cu_seqlens is None else jnp.sum(pair, axis=0, keepdims=True)  # [rows, HV, K, V + K]
    pairs = lax.all_gather(pair, axis)  # [W, rows, HV, K, V + K]

    def fold(S, pair):  # S leaving device j from S leaving device j - 1
        S = jnp.einsum("rhkm,rhmv->rhkv", pair[..., V:], S, precision=lax.Precision.HIGHEST) + pair[..., :V]
        return S, S

    _, leaving = lax.scan(fold, jnp.zeros(pair.shape[:-1] + (V,), dt), pairs)
    S_in = jnp.where(r > 0, leaving[jnp.maximum(r - 1, 0)], 0)  # [rows, HV, K, V]: the state entering this slice

    S_rows = S_in if cu_seqlens is None else jnp.broadcast_to(S_in, (N, HV, K, V))  # per sequence

    def entered(x, spec, S):  # x [..., V + K] (its extra columns the map of S_in) with S_in folded in
        extra = jnp.einsum(spec, x[..., V:].astype(dt), S, precision=lax.Precision.HIGHEST)
        return (x[..., :V].astype(dt) + extra).astype(x.dtype)

    o = entered(o_aug, "bthm,bhmv->bthv", S_in)
    final = None
    if final_states:
        final = lax.psum(jnp.where(ends[:, None, None, None], entered(fin, "nhkm,nhmv->nhkv", S_rows), 0), axis)
    return (o, final, *(entered(x, "bchkm,bhmv->bchkv", S_in) for x in h))
