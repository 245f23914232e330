"""The MoE layer: routing as transformers' DeepSeek-V3 router computes it, the output against every
expert run token by token, and expert work O(tokens x top_k) in the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax.nn.moe import MoE, grouped_matmul, route
from tests.tolerances import F32, F64


def _route_reference(logits, bias, top_k, n_group, topk_group, scaling):
    """The router in NumPy, step by step as transformers writes it (float64)."""
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    N, E = scores.shape
    groups = np.sort(choice.reshape(N, n_group, E // n_group), axis=-1)[..., -2:].sum(-1)
    best_groups = np.argsort(-groups, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((N, n_group), bool)
    np.put_along_axis(mask, best_groups, True, axis=1)
    choice = np.where(np.repeat(mask, E // n_group, axis=1), choice, -np.inf)
    indices = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, indices, axis=1)
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * scaling
    return indices, weights


@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (4, 2), (8, 3)])
def test_route_matches_the_reference(n_group, topk_group):
    rng = np.random.default_rng(0)
    logits, bias = rng.standard_normal((50, 32)), rng.standard_normal(32) * 0.5
    idx, w = route(jnp.asarray(logits), jnp.asarray(bias), top_k=4, n_group=n_group, topk_group=topk_group, scaling=2.5)
    ref_idx, ref_w = _route_reference(logits, bias, 4, n_group, topk_group, 2.5)
    np.testing.assert_array_equal(np.sort(idx, axis=1), np.sort(ref_idx, axis=1))
    order = np.argsort(idx, axis=1), np.argsort(ref_idx, axis=1)
    got, want = np.take_along_axis(np.asarray(w), order[0], 1), np.take_along_axis(ref_w, order[1], 1)
    np.testing.assert_allclose(got, want, rtol=F32["same"])
    if n_group > 1:  # the bias steers the choice: a strong one on the first group's experts wins them
        steer = np.where(np.arange(32) < 32 // n_group, 10.0, 0.0)
        idx, w = route(jnp.asarray(logits), jnp.asarray(steer), top_k=4, n_group=n_group, topk_group=topk_group)
        assert np.all(np.asarray(idx) < 32 // n_group)
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=F32["same"])  # weights from unbiased scores


def _moe(E=16, top_k=3, n_group=4, topk_group=2, shared=1, seed=0, limit=None):
    return MoE(
        24,
        20,
        E,
        top_k,
        n_shared_experts=shared,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.0,
        swiglu_limit=limit,
        rngs=nnx.Rngs(seed),
    )


def _moe_reference(moe, x):
    """Every token through its chosen experts one at a time (NumPy float64)."""
    x = np.asarray(x, np.float64)
    idx, w = (np.asarray(a) for a in moe.gate(jnp.asarray(x)))
    gate_up, down = np.asarray(moe.gate_up[...], np.float64), np.asarray(moe.down[...], np.float64)
    limit = np.inf if moe.swiglu_limit is None else moe.swiglu_limit
    act = lambda g, u: np.minimum(g, limit) / (1 + np.exp(-np.minimum(g, limit))) * np.clip(u, -limit, limit)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for e, weight in zip(idx[n], w[n]):
            g, u = np.split(x[n] @ gate_up[e], 2)
            out[n] += weight * act(g, u) @ down[e]
    s = moe.shared_experts
    if s is not None:
        kernel = lambda lin: np.asarray(lin.kernel[...], np.float64)
        out += act(x @ kernel(s.gate_proj), x @ kernel(s.up_proj)) @ kernel(s.down_proj)
    return out


@pytest.mark.parametrize("limit", [None, 0.05])
@pytest.mark.parametrize("use_ragged_dot", [False, True])
def test_moe_equals_every_token_through_its_experts(use_ragged_dot, limit, monkeypatch):
    """Float64, batched and shaped inputs, both dispatches (ragged_dot as TPU and GPU run it),
    with and without GLM-5's SwiGLU clamp (0.05 clips about a third of these gate values)."""
    import kdax.nn.moe as moe_module

    monkeypatch.setattr(moe_module, "platform", lambda: "gpu" if use_ragged_dot else "cpu")
    moe = _moe(limit=limit)
    moe = nnx.merge(*jax.tree.map(lambda a: a.astype(jnp.float64), nnx.split(moe)))
    x = jax.random.normal(jax.random.key(1), (3, 11, 24), jnp.float64)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == jnp.float64
    np.testing.assert_allclose(y.reshape(-1, 24), _moe_reference(moe, x.reshape(-1, 24)), rtol=F64["same"], atol=1e-13)


def test_moe_jit_grad_and_no_shared_experts():
    moe = _moe(E=8, top_k=2, n_group=1, topk_group=1, shared=0)
    x = jax.random.normal(jax.random.key(2), (2, 9, 24))
    y = nnx.jit(lambda m, x: m(x))(moe, x)
    np.testing.assert_allclose(y.reshape(-1, 24), _moe_reference(moe, x.reshape(-1, 24)), rtol=F32["out"], atol=1e-6)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(moe)
    assert float(jnp.abs(grads.gate_up[...]).sum()) > 0 and float(jnp.abs(grads.gate.kernel[...]).sum()) > 0
    assert list(grads["gate"].keys()) == ["kernel"]  # the bias is a Buffer: no gradient, no update


def test_expert_work_is_tokens_times_top_k():
    """The compiled CPU program's FLOPs: about the routed rows' (plus one block of padding per
    expert), far below every expert on every token, and growing little with the experts."""
    N, H, I, k = 256, 24, 20, 2

    def flops(E):
        moe = MoE(H, I, E, k, n_shared_experts=0, rngs=nnx.Rngs(0))
        x = jnp.ones((N, H))
        return nnx.jit(lambda m, x: m(x)).lower(moe, x).compile().cost_analysis()["flops"]

    dense = 2 * N * 64 * H * 3 * I  # all 64 experts on every token
    assert flops(64) < dense / 8
    assert flops(64) < 2 * flops(16)


def test_grouped_matmul_uneven_and_empty_groups():
    rng = np.random.default_rng(3)
    sizes = np.array([0, 5, 1, 0, 17, 9])
    x, w = rng.standard_normal((sizes.sum(), 7)), rng.standard_normal((6, 7, 4))
    want = np.concatenate([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes)))])
    for block in (1, 4, 8):
        got = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), block=block, use_ragged_dot=False)
        np.testing.assert_allclose(got, want, rtol=F64["same"], atol=1e-13)


def test_grouped_matmul_rows_past_the_groups_give_zeros():
    """The groups cover the first 20 of 26 rows (an engine's device holding some of the experts)."""
    rng = np.random.default_rng(4)
    sizes = np.array([3, 0, 9, 8])
    x, w = rng.standard_normal((26, 7)), rng.standard_normal((4, 7, 4))
    ends = np.cumsum(sizes)
    want = np.concatenate([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(ends - sizes, ends))] + [np.zeros((6, 4))])
    for block in (1, 4, 8):
        got = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), block=block, use_ragged_dot=False)
        np.testing.assert_allclose(got, want, rtol=F64["same"], atol=1e-13)
    got = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), use_ragged_dot=True)
    np.testing.assert_allclose(got, want, rtol=F64["same"], atol=1e-13)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"top_k": 0}, "top_k: expected an int in"),
        ({"n_group": 3}, "n_group, topk_group: expected n_group dividing"),
        ({"n_group": 4, "topk_group": 5}, "n_group, topk_group"),
        ({"top_k": 5, "n_group": 4, "topk_group": 1}, "top_k: expected at most"),
    ],
)
def test_router_settings_are_checked(kwargs, says):
    args = {"top_k": 2, "n_group": 1, "topk_group": 1} | kwargs
    with pytest.raises(ValueError, match=says):
        MoE(8, 4, 16, args.pop("top_k"), **args, rngs=nnx.Rngs(0))
