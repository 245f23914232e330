"""kdax.nn building blocks against direct NumPy formulas; the conv cache against full runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax.nn import GatedMLP, GatedRMSNorm, RMSNorm, ShortConvolution
from tests.tolerances import F32


def _conv_reference(x, weight, bias, lengths, cache):
    """Per sequence, token by token: the last W inputs (cache first), newest last."""
    D, _, W = weight.shape
    ys, finals, start = [], [], 0
    for n, L in enumerate(lengths):
        window = list(cache[n].T) if cache is not None else [np.zeros(D)] * W
        for t in range(start, start + L):
            window = window[1:] + [x[t]]
            y = sum(weight[:, 0, i] * window[i] for i in range(W)) + (0 if bias is None else bias)
            ys.append(y / (1 + np.exp(-y)))
        finals.append(np.stack(window, axis=1))
        start += L
    return np.stack(ys), np.stack(finals)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_cache", [False, True])
def test_short_conv_varlen_matches_token_by_token(bias, with_cache):
    rng = np.random.default_rng(0)
    D, W, lengths = 6, 4, [1, 5, 0, 9, 2]
    conv = ShortConvolution(D, W, bias=bias, rngs=nnx.Rngs(0))
    x = rng.standard_normal((sum(lengths), D))
    cache = rng.standard_normal((len(lengths), D, W)) if with_cache else None
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    y, final = conv(
        jnp.asarray(x, jnp.float32)[None],
        None if cache is None else jnp.asarray(cache, jnp.float32),
        output_final_state=True,
        cu_seqlens=cu,
    )
    b = None if conv.bias is None else np.asarray(conv.bias[...])
    y_ref, final_ref = _conv_reference(x, np.asarray(conv.weight[...]), b, lengths, cache)
    np.testing.assert_allclose(y[0], y_ref, rtol=F32["out"], atol=F32["out"])
    np.testing.assert_allclose(final, final_ref, rtol=F32["same"], atol=F32["same"])


def test_short_conv_batch_prefill_then_decode_equals_full_run():
    rng = np.random.default_rng(1)
    B, T, D, W = 2, 11, 8, 4
    conv = ShortConvolution(D, W, bias=True, rngs=nnx.Rngs(1))
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    full, _ = conv(x)
    y, cache = conv(x[:, :3], output_final_state=True)  # prefill shorter than the kernel
    outs = [y]
    step = jax.jit(lambda x_t, c: conv(x_t, c, output_final_state=True))
    for t in range(3, T):
        y, cache = step(x[:, t : t + 1], cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=F32["out"], atol=F32["same"])


def test_short_conv_grad_and_bad_input():
    conv = ShortConvolution(4, 3, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 5, 4))
    g = jax.grad(lambda x: conv(x)[0].sum())(x)
    assert g.shape == x.shape and bool(jnp.all(jnp.isfinite(g)))
    with pytest.raises(ValueError, match="cache: expected shape"):
        conv(x, jnp.zeros((2, 4, 3)))
    with pytest.raises(ValueError, match="x: expected last dim 4"):
        conv(jnp.ones((1, 5, 3)))
    with pytest.raises(ValueError, match="activation"):
        ShortConvolution(4, 3, activation="relu", rngs=nnx.Rngs(0))


def test_norms_match_formulas_and_keep_dtype():
    rng = np.random.default_rng(2)
    x, gate = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 3, 16))
    norm, gated = RMSNorm(16, eps=1e-6), GatedRMSNorm(16, activation="sigmoid", eps=1e-6)
    norm.weight[...] = jnp.asarray(rng.standard_normal(16), jnp.float32)
    gated.weight[...] = norm.weight[...]
    ref = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * np.asarray(norm.weight[...])
    np.testing.assert_allclose(norm(jnp.asarray(x, jnp.float32)), ref, rtol=F32["out"])
    out = gated(jnp.asarray(x, jnp.float32), jnp.asarray(gate, jnp.float32))
    np.testing.assert_allclose(out, ref / (1 + np.exp(-gate)), rtol=F32["out"])
    assert norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="activation"):
        GatedRMSNorm(16, activation="tanh")


def test_gated_mlp():
    mlp = GatedMLP(64, rngs=nnx.Rngs(0))
    assert mlp.intermediate_size == 256  # 2/3 * 64 * 4 = 170, rounded up to 256 as in FLA
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 64)), jnp.float32)
    ref = mlp.down_proj(jax.nn.silu(x @ mlp.gate_proj.kernel[...]) * (x @ mlp.up_proj.kernel[...]))
    np.testing.assert_allclose(mlp(x), ref, rtol=F32["out"], atol=F32["same"])
    with pytest.raises(ValueError, match="hidden_act"):
        GatedMLP(64, hidden_act="gelu", rngs=nnx.Rngs(0))
    clamped = GatedMLP(64, swiglu_limit=0.5, rngs=nnx.Rngs(0))  # the same weights, GLM-5's clamp
    g, u = x @ mlp.gate_proj.kernel[...], x @ mlp.up_proj.kernel[...]
    assert float(jnp.mean(g > 0.5)) > 0.05 and float(jnp.mean(jnp.abs(u) > 0.5)) > 0.05  # the clamp bites
    ref = mlp.down_proj(jax.nn.silu(jnp.minimum(g, 0.5)) * jnp.clip(u, -0.5, 0.5))
    np.testing.assert_allclose(clamped(x), ref, rtol=F32["out"], atol=F32["same"])
