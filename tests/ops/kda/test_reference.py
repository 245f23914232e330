"""The two references agree, and the gate / norm / beta helpers match their formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.kda.gate import softplus_exp2
from tests.ops.kda.cases import Case, make_inputs
from tests.tolerances import F64


@pytest.mark.parametrize(
    "case",
    [Case("gva", T=100, HV=4, initial_state=True), Case("varlen", lengths=(1, 17, 64, 30), initial_state=True)],
    ids=str,
)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_naive_chunk_equals_naive_recurrent_fp64(case, chunk_size):
    args, kw = make_inputs(case, jnp.float64)
    kw = {k: v for k, v in kw.items() if k != "chunk_size"}
    kw["initial_state"] = kw.get("initial_state", None)
    o1, s1 = kdax.naive_recurrent_kda(*args, **kw)
    o2, s2 = kdax.naive_chunk_kda(*args, chunk_size=chunk_size, **kw)
    assert o1.dtype == jnp.float64
    assert rel_rms(o2, o1) < F64["out"] and rel_rms(s2, s1) < F64["out"]


def _softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)


def test_kda_gate_forms():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((2, 3, 4, 8))
    A_log = rng.uniform(-1, 1, 4)
    dt = rng.uniform(-1, 1, 32)
    x = g + dt.reshape(4, 8)
    np.testing.assert_allclose(
        kdax.kda_gate(jnp.asarray(g), jnp.asarray(A_log), jnp.asarray(dt)),
        -np.exp(A_log)[:, None] * _softplus(x),
        rtol=F64["same"],
    )
    sig = lambda z: 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(
        kdax.kda_gate(jnp.asarray(g), jnp.asarray(A_log), jnp.asarray(dt), lower_bound=-5.0),
        -5.0 * sig(np.exp(A_log)[:, None] * x),
        rtol=F64["same"],
    )
    np.testing.assert_allclose(
        kdax.kda_gate(jnp.asarray(g), None, jnp.asarray(dt), lower_bound=-5.0), -5.0 * sig(x), rtol=F64["same"]
    )
    np.testing.assert_allclose(
        kdax.kda_gate(jnp.asarray(g), jnp.asarray(A_log)), -np.exp(A_log)[:, None] * _softplus(g), rtol=F64["same"]
    )
    out = kdax.kda_gate(jnp.asarray(g, jnp.bfloat16), jnp.asarray(A_log, jnp.float32))
    assert out.dtype == jnp.float32


def test_softplus_exp2_is_float32_accurate():
    """The GPU kernels' softplus: a few float32 ulps from the exact one where it is not tiny; below,
    the rounding of its exp2's argument (relative 2^-24 of 1.44 |x|) bounds it; exact at +-inf.
    On a GPU, the exp2 of MUFU adds its own 2^-22 or so."""
    x = np.concatenate([np.linspace(-87, 100, 400_001), np.linspace(-1, 1, 100_001)]).astype(np.float32)
    got = np.asarray(jax.jit(softplus_exp2)(jax.device_put(x, jax.devices("cpu")[0])))  # correctly rounded exp2
    assert got.dtype == np.float32
    exact = _softplus(x.astype(np.float64))
    rel = np.abs(got - exact) / exact
    assert rel[x >= -20].max() < 3e-7
    assert (rel[x < -20] / np.abs(x[x < -20])).max() < 2**-24
    assert np.all(np.diff(got[:400_001]) >= 0)  # monotone
    np.testing.assert_array_equal(softplus_exp2(jnp.asarray([-np.inf, np.inf], jnp.float32)), [0.0, np.inf])


def test_l2norm_and_beta():
    x = np.random.default_rng(1).standard_normal((3, 5, 16))
    np.testing.assert_allclose(
        kdax.l2norm(jnp.asarray(x)), x / np.sqrt((x**2).sum(-1, keepdims=True) + 1e-6), rtol=F64["same"]
    )
    b = np.linspace(-4, 4, 9)
    np.testing.assert_allclose(kdax.beta_activation(jnp.asarray(b)), 1 / (1 + np.exp(-b)), rtol=F64["same"])
    np.testing.assert_allclose(kdax.beta_activation(jnp.asarray(b), True), 2 / (1 + np.exp(-b)), rtol=F64["same"])
