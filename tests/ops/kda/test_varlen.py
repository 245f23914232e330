"""Packed variable-length batches equal running each sequence alone, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from tests.tolerances import F32


@pytest.mark.parametrize("fn", [kdax.chunk_kda, kdax.fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_varlen_equals_separate_runs(fn):
    lengths = [1, 17, 64, 70, 0, 5]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    T, H, HV, K, V = int(cu[-1]), 1, 2, 16, 24
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, T, H, K)), jnp.float32)
    k = kdax.l2norm(jnp.asarray(rng.standard_normal((1, T, H, K)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((1, T, HV, V)), jnp.float32)
    g = jnp.asarray(rng.uniform(-3, -0.01, (1, T, HV, K)), jnp.float32)
    b = jnp.asarray(rng.uniform(0, 1, (1, T, HV)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((len(lengths), HV, K, V)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1, T, HV, V)), jnp.float32)

    def packed(q, k, v, g, b, h0):
        o, s = fn(q, k, v, g, b, initial_state=h0, output_final_state=True, cu_seqlens=jnp.asarray(cu, jnp.int32))
        return jnp.sum(o * w) + jnp.sum(s), (o, s)

    def separate(q, k, v, g, b, h0):
        outs, states, total = [], [], 0.0
        for n in range(len(lengths)):
            a, e = int(cu[n]), int(cu[n + 1])
            if e == a:  # an empty sequence keeps its state
                states.append(h0[n])
                total = total + jnp.sum(h0[n])
                continue
            o, s = fn(*(x[:, a:e] for x in (q, k, v, g, b)), initial_state=h0[n : n + 1], output_final_state=True)
            outs.append(o)
            states.append(s[0])
            total = total + jnp.sum(o * w[:, a:e]) + jnp.sum(s)
        return total, (jnp.concatenate(outs, 1), jnp.stack(states))

    args = (q, k, v, g, b, h0)
    (_, (o1, s1)), g1 = jax.jit(jax.value_and_grad(packed, argnums=range(6), has_aux=True))(*args)
    (_, (o2, s2)), g2 = jax.jit(jax.value_and_grad(separate, argnums=range(6), has_aux=True))(*args)
    assert rel_rms(o1, o2) < F32["same"] and rel_rms(s1, s2) < F32["same"]
    for a, e in zip(g1, g2):
        assert rel_rms(a, e) < F32["out"]


@pytest.mark.parametrize("cu", [[0, 200], [0, 65, 0, 65], [0, 65, -30, 65]], ids=["past_T", "decreasing", "negative"])
def test_traced_malformed_cu_seqlens_stays_inside_the_layout(cu):
    """Traced offsets cannot be checked; the GPU kernels loop over each sequence's chunk range
    unmasked, so the layout must keep those ranges inside its NC chunks whatever the offsets."""
    from kdax.ops.common.varlen import chunk_layout

    lay = jax.jit(lambda c: chunk_layout(65, 64, c))(jnp.asarray(cu, jnp.int32))
    NC = lay.n_chunks
    start, end = np.asarray(lay.seq_chunk_start), np.asarray(lay.seq_chunk_end)
    assert np.all(0 <= start) and np.all(start <= end) and np.all(end <= NC), (start, end, NC)
