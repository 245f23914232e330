"""HyperConnection against a float64 NumPy reference written from GLM-5's formulas: the collapse,
the post weights, the Sinkhorn-mixed streams and their recombination; jit and grad; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax.nn.hyper import HyperConnection


def _reference(h, x, y):
    """(collapsed, post, comb, new streams) in float64, element by element."""
    fn, base, scale = (np.asarray(p[...], np.float64) for p in (h.fn, h.base, h.scale))
    N, D = x.shape[-2:]
    sig = lambda z: 1 / (1 + np.exp(-z))
    out = []
    for X, Y in zip(x.reshape(-1, N, D), y.reshape(-1, D)):
        flat = X.reshape(-1)
        flat = flat / np.sqrt(np.mean(flat**2) + h.norm_eps)
        z = fn @ flat
        pre = sig(z[:N] * scale[0] + base[:N]) + h.eps
        post = 2 * sig(z[N : 2 * N] * scale[1] + base[N : 2 * N])
        c = (z[2 * N :] * scale[2] + base[2 * N :]).reshape(N, N)
        c = np.exp(c - c.max(1, keepdims=True))
        c = c / c.sum(1, keepdims=True) + h.eps
        c = c / (c.sum(0, keepdims=True) + h.eps)
        for _ in range(h.sinkhorn_iters - 1):
            c = c / (c.sum(1, keepdims=True) + h.eps)
            c = c / (c.sum(0, keepdims=True) + h.eps)
        new = np.stack([post[n] * Y + sum(c[i, n] * X[i] for i in range(N)) for n in range(N)])
        out.append(((pre[:, None] * X).sum(0), post, c, new))
    return [np.stack(a).reshape(*x.shape[:-2], *a[0].shape) for a in zip(*out)]


def _layer(N=4, D=12, seed=0):
    h = HyperConnection(D, N, sinkhorn_iters=20, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    h.base[...] = jnp.asarray(rng.normal(size=h.base.shape), jnp.float32)  # away from the init's zeros
    h.scale[...] = jnp.asarray(rng.uniform(0.5, 2, size=3), jnp.float32)
    h.fn[...] = h.fn[...] * 20
    return h


@pytest.mark.parametrize("N", [1, 4])
def test_matches_the_reference(N):
    h = _layer(N)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, N, 12)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(2, 5, 12)), jnp.float32)
    collapsed, post, comb = h(x)
    new = HyperConnection.combine(x, y, post, comb)
    ref = _reference(h, np.asarray(x, np.float64), np.asarray(y, np.float64))
    for got, want in zip((collapsed, post, comb, new), ref):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6)
    if N > 1:  # Sinkhorn ends on the columns: they sum to one; rows within 4% after 20 rounds here
        np.testing.assert_allclose(comb.sum(-2), 1, atol=1e-5)
        np.testing.assert_allclose(comb.sum(-1), 1, atol=0.04)
        assert float(jnp.std(comb)) > 0.05  # mixing, not uniform


def test_bf16_streams_jit_and_grad():
    h = _layer()
    x = jax.random.normal(jax.random.key(2), (3, 4, 12), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(3), (3, 12), jnp.bfloat16)
    run = nnx.jit(lambda h, x, y: HyperConnection.combine(x, y, *h(x)[1:]) + h(x)[0][..., None, :])
    out = run(h, x, y)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    grads = nnx.grad(lambda h: jnp.sum(run(h, x, y).astype(jnp.float32) ** 2))(h)
    assert all(float(jnp.abs(g[...]).sum()) > 0 for g in (grads.fn, grads.base, grads.scale))


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"streams": 0}, "streams: expected a positive int"),
        ({"sinkhorn_iters": 0}, "sinkhorn_iters"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, says):
    with pytest.raises(ValueError, match=says):
        HyperConnection(**{"hidden_size": 8, "streams": 2, **kwargs}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="x: expected"):
        _layer()(jnp.zeros((2, 3, 12)))
