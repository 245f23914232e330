"""DeepSeek-style mixture of experts, as Kimi Linear and the Ling hybrids use it.

A grouped sigmoid router picks ``top_k`` of ``num_experts`` SwiGLU experts per token: sigmoid
scores, a score-correction bias that only steers the choice, experts limited to the
``topk_group`` best of ``n_group`` groups (a group's score: the sum of its two best biased
scores), and weights from the unbiased scores, normalised and scaled (transformers'
DeepSeek-V3 ``TopkRouter``). Shared experts see every token.

Dispatch sorts the token copies by expert and multiplies each expert's rows by its weights
only: ``jax.lax.ragged_dot`` on TPU and GPU (a grouped matmul there), and on CPU, where
``ragged_dot`` multiplies every row by every expert, blocks of ``block`` rows of one expert
each (padding each expert's rows to whole blocks). Either way the expert work is
O(tokens x top_k), never every expert on every token.

Under :func:`kdax.ops.common.sharding.heads_over` (a serving engine's tensor parallelism) with
the experts split over its experts axis, each device runs its own experts on every token it holds and the
devices' sums are added (``psum``): the weights stay where they are, where XLA would gather every
expert's to each device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from kdax.nn.mlp import GatedMLP, swiglu
from kdax.ops.common.dispatch import platform
from kdax.ops.common.sharding import axis_size, experts_axis


class Buffer(nnx.Variable):
    """A state array that training leaves alone (optimizers update ``nnx.Param`` only)."""


def route(logits, bias, *, top_k, n_group=1, topk_group=1, norm_topk_prob=True, scaling=1.0):
    """The experts and weights of each token, as transformers' DeepSeek-V3 router computes them.

    Args:
        logits: [N, E] router logits (float32).
        bias: [E] score-correction bias, added to the scores to choose experts only.
        top_k: experts per token.
        n_group, topk_group: the experts split into n_group groups; a token chooses among the
            topk_group groups whose two best biased scores sum highest.
        norm_topk_prob: divide the chosen scores by their sum (+ 1e-20).
        scaling: multiply the weights by it (``routed_scaling_factor``).

    Returns:
        (indices [N, top_k] int32, weights [N, top_k] float32).
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    N, E = scores.shape
    if n_group > 1:
        grouped = choice.reshape(N, n_group, E // n_group)
        group_scores = lax.top_k(grouped, min(2, E // n_group))[0].sum(-1)  # [N, n_group]
        keep = (
            jnp.zeros((N, n_group), bool).at[jnp.arange(N)[:, None], lax.top_k(group_scores, topk_group)[1]].set(True)
        )
        choice = jnp.where(jnp.repeat(keep, E // n_group, axis=1), choice, -jnp.inf)
    indices = lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, indices, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return indices.astype(jnp.int32), weights * scaling


def grouped_matmul(x, w, group_sizes, block: int = 8, use_ragged_dot: bool | None = None):
    """Each group's rows times its matrix: rows of x sorted by group.

    Args:
        x: [M, H], the rows of group 0 first, then group 1's, ...
        w: [G, H, F].
        group_sizes: [G] ints summing to at most M (rows past the groups give zeros).
        block: rows per block on CPU (each expert's rows padded to whole blocks).
        use_ragged_dot: ``lax.ragged_dot`` (None: on TPU and GPU).

    Returns:
        [M, F] in the dtype x and w promote to.
    """
    if use_ragged_dot if use_ragged_dot is not None else platform() in ("tpu", "gpu"):
        return lax.ragged_dot(x, w, group_sizes)
    M, G = x.shape[0], w.shape[0]
    padded = -(-group_sizes // block) * block
    ends, padded_ends = jnp.cumsum(group_sizes), jnp.cumsum(padded)
    rows = jnp.arange(M)
    valid = rows < ends[-1]
    group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), G - 1)  # each row's group
    n_blocks = -(-M // block) + min(G, M)  # at most one partial block per non-empty group
    at = (padded_ends - padded)[group] + rows - (ends - group_sizes)[group]  # its padded row
    at = jnp.where(valid, at, n_blocks * block)  # past the groups: dropped
    xp = jnp.zeros((n_blocks * block, x.shape[1]), x.dtype).at[at].set(x, mode="drop")
    owner = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(n_blocks) * block, side="right"), G - 1)
    y = jnp.einsum("nbh,nhf->nbf", xp.reshape(n_blocks, block, -1), w[owner]).reshape(n_blocks * block, -1)
    return jnp.where(valid[:, None], y[jnp.minimum(at, n_blocks * block - 1)], 0)


def _experts(x, gate_up, down, indices, weights, first, limit=None):
    """The routed experts' sum for tokens x [N, H] routed to ``indices`` [N, k] with ``weights``,
    of the experts ``first .. first + E - 1`` alone (gate_up [E, H, 2I], down [E, I, H]; ``limit``:
    the SwiGLU clamp, :func:`kdax.nn.mlp.swiglu`)."""
    N, k = indices.shape
    E = gate_up.shape[0]
    local = indices.reshape(-1) - first
    local = jnp.where((local >= 0) & (local < E), local, E)  # another device's: past the groups
    order = jnp.argsort(local, stable=True)  # token copies sorted by expert
    token = order // k
    sizes = jnp.bincount(local, length=E)
    gate, up = jnp.split(grouped_matmul(x[token], gate_up, sizes), 2, axis=-1)
    y = grouped_matmul(swiglu(gate, up, limit), down, sizes)
    y = (y * weights.reshape(-1)[order][:, None]).astype(x.dtype)  # float32 weights, as transformers
    return jnp.zeros_like(x).at[token].add(jnp.where((local[order] < E)[:, None], y, 0))


class TopKRouter(nnx.Module):
    """The router: ``kernel`` [H, E] (logits in float32) and ``e_score_correction_bias`` [E] (a
    :class:`Buffer`); see :func:`route`."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        rngs: nnx.Rngs,
    ):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: expected an int in [1, {num_experts}], got {top_k}")
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(
                f"n_group, topk_group: expected n_group dividing num_experts={num_experts} and "
                f"1 <= topk_group <= n_group, got {n_group}, {topk_group}"
            )
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k: expected at most the {topk_group} groups' experts, got {top_k}")
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (hidden_size, num_experts)) * 0.02)
        self.e_score_correction_bias = Buffer(jnp.zeros((num_experts,)))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, H] -> (indices [N, top_k] int32, weights [N, top_k] float32)."""
        logits = jnp.dot(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32), precision="highest")
        return route(
            logits,
            self.e_score_correction_bias[...],
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            scaling=self.routed_scaling_factor,
        )


class MoE(nnx.Module):
    """Routed SwiGLU experts plus shared ones: ``sum_k w_k expert_k(x) + shared(x)``.

    Args:
        hidden_size: H.
        moe_intermediate_size: each expert's hidden size I.
        num_experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor: the
            router's (:func:`route`).
        n_shared_experts: shared experts, one SwiGLU MLP of hidden size I x n_shared_experts (0: none).
        swiglu_limit: None, or the routed and shared experts' clamp before the activation
            (:func:`kdax.nn.mlp.swiglu`).
        rngs: the parameters' random keys.

    Parameters: ``gate`` (:class:`TopKRouter`), ``gate_up`` [E, H, 2I] (gate columns first),
    ``down`` [E, I, H], ``shared_experts`` (a :class:`GatedMLP`) or None.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        n_shared_experts: int = 1,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        swiglu_limit: float | None = None,
        rngs: nnx.Rngs,
    ):
        H, I, E = hidden_size, moe_intermediate_size, num_experts
        self.swiglu_limit = swiglu_limit
        self.gate = TopKRouter(
            H,
            E,
            top_k,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor,
            rngs=rngs,
        )
        init = lambda *shape: nnx.Param(jax.random.normal(rngs.params(), shape) * 0.02)
        self.gate_up, self.down = init(E, H, 2 * I), init(E, I, H)
        shared = lambda: GatedMLP(H, intermediate_size=I * n_shared_experts, swiglu_limit=swiglu_limit, rngs=rngs)
        mlp = shared() if n_shared_experts else None
        self.shared_experts = mlp

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., H] -> [..., H] in x's dtype."""
        shape, H = x.shape, x.shape[-1]
        x = x.reshape(-1, H)
        indices, weights = self.gate(x)
        gate_up, down = self.gate_up[...].astype(x.dtype), self.down[...].astype(x.dtype)
        over = experts_axis()
        n = 1 if over is None else axis_size(*over)
        if n > 1 and gate_up.shape[0] % n == 0:  # a serving engine's experts split over its devices
            axis = over[1]
            first = lambda: lax.axis_index(axis) * (gate_up.shape[0] // n)
            run = lambda *a: lax.psum(_experts(*a, first(), self.swiglu_limit), axis)
            spec = P(axis, None, None)
            out = jax.shard_map(
                run, mesh=over[0], in_specs=(P(), spec, spec, P(), P()), out_specs=P(), check_vma=False
            )(x, gate_up, down, indices, weights)
        else:
            out = _experts(x, gate_up, down, indices, weights, 0, self.swiglu_limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)
