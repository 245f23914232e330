"""chunk_kda and fused_recurrent_kda against the float64 reference, for every backend."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.ops.kda import xla
from tests.ops.kda.cases import CASES, Case, assert_close_to_reference, make_inputs

BACKENDS = ["xla", "pallas_tpu", "pallas_gpu"]  # the Pallas backends run in their interpreters off device
BF16_CASES = [c for c in CASES if c.name in ("T65_gva_h0", "varlen", "strong_decay", "gate_softplus_l2_sigmoid")]


def _recurrent(*args, chunk_size=None, **kwargs):
    return kdax.fused_recurrent_kda(*args, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunk_fp32(backend, case):
    fn = functools.partial(kdax.chunk_kda, backend=backend)
    if backend == "pallas_gpu" and case.chunk_size > 64:  # float32 tiles that large overflow an H100's shared memory
        with pytest.raises(ValueError, match="chunk_size: pallas_gpu with float32"):
            assert_close_to_reference(fn, case, jnp.float32)
        return
    assert_close_to_reference(fn, case, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_chunk_bf16(backend, case):
    assert_close_to_reference(functools.partial(kdax.chunk_kda, backend=backend), case, jnp.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_fp16(backend):
    """float16 inputs: float32 intermediates in every backend (bfloat16 ones would drop float16's
    three extra mantissa bits and miss these bars), so errors of float16's own rounding."""
    case = next(c for c in CASES if c.name == "T65_gva_h0")
    assert_close_to_reference(functools.partial(kdax.chunk_kda, backend=backend), case, jnp.float16)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("T65_gva_h0", "varlen", "strong_decay_varlen",
                                                                 "chunk32_varlen", "T1000")], ids=str)  # fmt: skip
def test_chunk_xla_all_chunks_per_step(case):
    """The accelerator schedule of the xla backend (every chunk in one scan step), run here."""
    assert_close_to_reference(functools.partial(kdax.chunk_kda, config=xla.Config("all_chunks")), case, jnp.float32)


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("backend", [*BACKENDS, "naive"])
def test_safe_gate_changes_nothing_and_state_v_first_transposes_states(backend, op):
    if op == "recurrent" and backend.startswith("pallas"):
        pytest.skip("fused_recurrent_kda has only the xla core")
    case = next(c for c in CASES if c.name == "gate_lower_bound_neg_eigval")  # lower_bound -5: a safe gate
    args, kwargs = make_inputs(case)
    fn = functools.partial(kdax.chunk_kda if op == "chunk" else _recurrent, backend=backend)
    o, s = fn(*args, **kwargs)
    h0_vk = jnp.swapaxes(kwargs["initial_state"], -1, -2)
    o_vk, s_vk = fn(*args, **{**kwargs, "initial_state": h0_vk}, safe_gate=True, state_v_first=True)
    np.testing.assert_array_equal(o_vk, o)
    np.testing.assert_array_equal(s_vk, jnp.swapaxes(s, -1, -2))


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "T1000"], ids=str)
def test_fused_recurrent_fp32(case):
    assert_close_to_reference(functools.partial(_recurrent, backend="xla"), case, jnp.float32)


@pytest.mark.parametrize("case", BF16_CASES[:2], ids=str)
def test_fused_recurrent_bf16(case):
    assert_close_to_reference(functools.partial(_recurrent, backend="xla"), case, jnp.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strong_decay_is_finite_far_below_exp_range(backend):
    """Cumulative gates reach about -1300 in a chunk (-320 within one 16-row block of the GPU
    kernels): far past where exp(-G) overflows."""
    case = Case("g_minus_40", T=128, B=1, g_min=-40.0, initial_state=True)
    errors = assert_close_to_reference(functools.partial(kdax.chunk_kda, backend=backend), case)
    assert all(e < 1e-4 for e in errors.values())
