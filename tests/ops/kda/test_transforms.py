"""check_grads on the custom VJP, and jit / vmap / grad / recompilation behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import kdax
from tests.tolerances import F32


def _tiny(seed=0, T=11, HV=2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, T, 1, 4)))
    k = kdax.l2norm(jnp.asarray(rng.standard_normal((1, T, 1, 4))))
    v = jnp.asarray(rng.standard_normal((1, T, HV, 3)))
    g = jnp.asarray(rng.uniform(-2, -0.1, (1, T, HV, 4)))
    b = jnp.asarray(rng.uniform(0.1, 0.9, (1, T, HV)))
    h0 = jnp.asarray(rng.standard_normal((2, HV, 4, 3)))
    return q, k, v, g, b, h0


CHUNK_STATES = {"chunk_size": 16, "disable_recompute": True, "return_intermediate_states": True}


@pytest.mark.parametrize(
    "fn,kw,T",
    [(kdax.chunk_kda, {"chunk_size": 16}, 11), (kdax.chunk_kda, CHUNK_STATES, 40), (kdax.fused_recurrent_kda, {}, 11)],
    ids=["chunk", "chunk_kept_states", "recurrent"],
)
def test_check_grads_fp64(fn, kw, T):
    """chunk_kept_states: the backward reading the forward's intermediates, and the cotangent of
    the states entering the chunks (sequences of 4 and 36 tokens: 1 and 3 chunks of 16)."""
    q, k, v, g, b, h0 = _tiny(T=T)
    cu = jnp.asarray([0, 4, T], jnp.int32)

    def f(q, k, v, g, b, h0):
        return fn(q, k, v, g, b, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)

    check_grads(f, (q, k, v, g, b, h0), order=1, modes=["rev"], atol=F32["same"], rtol=F32["same"])


def test_jit_vmap_grad_and_no_recompilation():
    q, k, v, g, b, _ = (x.astype(jnp.float32) for x in _tiny(T=40))

    def loss(q, k, v, g, b):
        return jnp.sum(kdax.chunk_kda(q, k, v, g, b, chunk_size=16)[0] ** 2)

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    f(q, k, v, g, b)
    n = f._cache_size()
    f(q * 2, k, v * 0.5, g, b)
    assert f._cache_size() == n
    # vmap over an extra leading axis equals a loop
    qs, vs = jnp.stack([q, 2 * q, -q]), jnp.stack([v, v * 0.5, v])
    batched = jax.vmap(lambda q, v: kdax.chunk_kda(q, k, v, g, b, chunk_size=16)[0])(qs, vs)
    looped = jnp.stack([kdax.chunk_kda(qs[i], k, vs[i], g, b, chunk_size=16)[0] for i in range(3)])
    np.testing.assert_allclose(batched, looped, rtol=F32["out"], atol=F32["same"])
    gb = jax.vmap(jax.grad(lambda q, v: loss(q, k, v, g, b)))(qs, vs)
    assert gb.shape == qs.shape and bool(jnp.all(jnp.isfinite(gb)))
    g_loop = jnp.stack([jax.grad(lambda q, v: loss(q, k, v, g, b))(qs[i], vs[i]) for i in range(3)])
    np.testing.assert_allclose(gb, g_loop, rtol=F32["out"], atol=F32["same"])  # the values, not only the shapes


def test_traced_cu_seqlens_does_not_recompile():
    q, k, v, g, b, _ = (x.astype(jnp.float32) for x in _tiny(T=30))
    f = jax.jit(lambda cu: kdax.chunk_kda(q, k, v, g, b, cu_seqlens=cu, output_final_state=True, chunk_size=16))
    _, s1 = f(jnp.asarray([0, 10, 30], jnp.int32))
    _, s2 = f(jnp.asarray([0, 25, 30], jnp.int32))
    assert f._cache_size() == 1
    assert not np.allclose(s1, s2)
