"""chunk_kda and fused_recurrent_kda against the float64 reference, for every backend."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.kda import pallas_tpu, xla
from tests.ops.kda.cases import CASE, CASES, Case, assert_close_to_reference, make_inputs, run_with_grads, runs
from tests.tolerances import TOL

BACKENDS = ["xla", "pallas_tpu", "pallas_gpu"]  # the Pallas backends run in their interpreters off device
BF16_CASES = [CASE[n] for n in ("T65_gva_h0", "varlen", "strong_decay", "gate_softplus_l2_sigmoid")]


def _recurrent(*args, chunk_size=None, **kwargs):
    return kdax.fused_recurrent_kda(*args, **kwargs)


@pytest.mark.parametrize(("backend", "case"), runs(CASES, BACKENDS))
def test_chunk_fp32(backend, case):
    fn = functools.partial(kdax.chunk_kda, backend=backend)
    if backend == "pallas_gpu" and case.chunk_size > 64:  # float32 tiles that large overflow an H100's shared memory
        with pytest.raises(ValueError, match="chunk_size: pallas_gpu with float32"):
            assert_close_to_reference(fn, case, jnp.float32)
        return
    assert_close_to_reference(fn, case, jnp.float32)


@pytest.mark.parametrize(("backend", "case"), runs(BF16_CASES, BACKENDS, "bf16"))
def test_chunk_bf16(backend, case):
    assert_close_to_reference(functools.partial(kdax.chunk_kda, backend=backend), case, jnp.bfloat16)


@pytest.mark.parametrize(("backend", "case"), runs([CASE["T65_gva_h0"]], BACKENDS, "fp16"))
def test_chunk_fp16(backend, case):
    """float16 inputs: float32 intermediates in every backend (bfloat16 ones would drop float16's
    three extra mantissa bits and miss these bars), so errors of float16's own rounding."""
    assert_close_to_reference(functools.partial(kdax.chunk_kda, backend=backend), case, jnp.float16)


_ALL_CHUNKS = [CASE[n] for n in ("T65_gva_h0", "varlen", "strong_decay_varlen", "chunk32_varlen", "T1000")]


@pytest.mark.parametrize(("backend", "case"), runs(_ALL_CHUNKS, ["xla"], "all_chunks"))
def test_chunk_xla_all_chunks_per_step(backend, case):
    """The accelerator schedule of the xla backend (every chunk in one scan step), run here."""
    assert_close_to_reference(functools.partial(kdax.chunk_kda, config=xla.Config("all_chunks")), case, jnp.float32)


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize(
    ("backend", "case"), runs([CASE["gate_lower_bound_neg_eigval"]], [*BACKENDS, "naive"], "safe_gate")
)
def test_safe_gate_changes_nothing_and_state_v_first_transposes_states(backend, case, op):
    """With return_intermediate_states the states entering the chunks are transposed too. FLA's
    fused_recurrent_kda takes disable_recompute and return_intermediate_states and ignores them:
    so does ours (two outputs, the same values)."""
    if op == "recurrent" and backend.startswith("pallas"):
        pytest.skip("fused_recurrent_kda has only the xla core")
    # the case's lower_bound -5: a safe gate
    args, kwargs = make_inputs(case)
    fn = functools.partial(kdax.chunk_kda if op == "chunk" else _recurrent, backend=backend)
    o, s, *h = fn(*args, **kwargs, return_intermediate_states=True)
    h0_vk = jnp.swapaxes(kwargs["initial_state"], -1, -2)
    o_vk, s_vk, *h_vk = fn(
        *args,
        **{**kwargs, "initial_state": h0_vk},
        safe_gate=True,
        state_v_first=True,
        disable_recompute=True,
        return_intermediate_states=True,
    )
    assert len(h) == len(h_vk) == (op == "chunk")
    np.testing.assert_array_equal(o_vk, o)
    np.testing.assert_array_equal(s_vk, jnp.swapaxes(s, -1, -2))
    for x, x_vk in zip(h, h_vk):
        np.testing.assert_array_equal(x_vk, jnp.swapaxes(x, -1, -2))


def _prefix_call(case: Case, args, kwargs):
    """Arguments of one packed call whose sequences are, for every sequence n of ``case`` and
    every chunk j of it, n's first j * C tokens from n's initial state: its final states are the
    states entering the chunks, in FLA's order (batch rows, then chunks; or sequences, then chunks)."""
    C, (B, T) = kwargs["chunk_size"], args[0].shape[:2]
    cu = np.asarray(kwargs["cu_seqlens"]) if case.lengths else None
    spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if case.lengths else [(b, 0, T) for b in range(B)]
    prefixes = [(row, a, j * C, n) for n, (row, a, e) in enumerate(spans) for j in range(-(-(e - a) // C))]
    packed = [jnp.concatenate([x[row : row + 1, a : a + L] for row, a, L, _ in prefixes], axis=1) for x in args]
    offsets = np.concatenate([[0], np.cumsum([L for _, _, L, _ in prefixes])])
    h0 = kwargs["initial_state"][np.asarray([n for *_, n in prefixes])]
    return packed, {**kwargs, "cu_seqlens": jnp.asarray(offsets, jnp.int32), "initial_state": h0}


STATES_CASES = [CASE[n] for n in ("T65_gva_h0", "K60_V100", "varlen", "varlen_empty", "gate_l2_varlen_K60")]


@pytest.mark.parametrize(("backend", "case"), runs(STATES_CASES, [*BACKENDS, "naive"], "states"))
def test_intermediate_states_are_the_final_states_of_the_first_chunks(backend, case):
    """FLA's h: state i is the final state after the chunks before i, of each batch row or
    sequence (with cu_seqlens [1, total chunks, ...], sum of ceil(L_n / C) chunks)."""
    args, kwargs = make_inputs(case)
    fn = functools.partial(kdax.chunk_kda, backend=backend)
    _, _, h = fn(*args, **kwargs, return_intermediate_states=True)
    prefix_args, prefix_kwargs = _prefix_call(case, args, kwargs)
    _, expected = fn(*prefix_args, **prefix_kwargs)
    C, (B, T), HV, K, V = case.chunk_size, args[0].shape[:2], case.HV, case.K, case.V
    NT = sum(-(-L // C) for L in case.lengths) if case.lengths else -(-T // C)
    assert h.shape == ((1, NT, HV, K, V) if case.lengths else (B, NT, HV, K, V)) and h.dtype == args[0].dtype
    assert rel_rms(h.reshape(expected.shape), expected) <= TOL[jnp.float32]["out"]


@pytest.mark.parametrize(("backend", "case"), runs([CASE["gate_l2_varlen_K60"]], BACKENDS, "states grads"))
def test_intermediate_states_gradients(backend, case):
    """Differentiating through the states entering the chunks gives the float64 reference's gradients."""
    case = dataclasses.replace(case, options=case.options + (("return_intermediate_states", True),))
    assert_close_to_reference(functools.partial(kdax.chunk_kda, backend=backend), case, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_intermediate_states_with_traced_cu_seqlens(backend):
    """Traced offsets leave the chunk count unknown: the static bound (T + N (C - 1)) // C chunks
    come back, those past the sequences' zero."""
    case = CASE["varlen_empty"]  # 4 chunks of 16 for 45 tokens in 5 sequences
    args, kwargs = make_inputs(case)
    cu = kwargs.pop("cu_seqlens")
    fn = functools.partial(kdax.chunk_kda, *args, **kwargs, backend=backend, return_intermediate_states=True)
    h = fn(cu_seqlens=cu)[2]
    h_traced = jax.jit(lambda cu: fn(cu_seqlens=cu)[2])(cu)
    assert h.shape[1] == 4 and h_traced.shape[1] == (45 + 5 * 15) // 16
    assert rel_rms(h_traced[:, :4], h) <= TOL[jnp.float32]["out"]  # compiled apart: rounding may differ
    assert not np.any(np.asarray(h_traced[:, 4:]))


@pytest.mark.parametrize(
    "backend,config",
    [
        ("xla", None),
        pytest.param("xla", xla.Config("all_chunks"), marks=pytest.mark.slow),  # the pallas_tpu_staged run stays
        ("pallas_tpu", None),
        ("pallas_tpu", pallas_tpu.Config(pipeline="staged")),
        ("pallas_gpu", None),
        ("naive", None),
    ],
    ids=["xla", "xla_all_chunks", "pallas_tpu", "pallas_tpu_staged", "pallas_gpu", "naive"],
)
def test_disable_recompute_changes_no_result(backend, config):
    """Outputs, states entering the chunks and every gradient (through those states as well) are
    the same whether the backward recomputes the forward's intermediates or reads them. On naive
    (nothing recomputed) bit for bit. Elsewhere equal to float32 rounding (a few units of 2^-23 =
    1.2e-7): the Pallas kernels' forward and backward compile apart, and the GPU backward otherwise
    rebuilds v_new over blocks of key columns from q and k normalised by XLA instead of in the
    intra kernel; on xla the two are one program each, which XLA fuses differently (bit for bit
    under its CPU fusion emitters, 3.4e-8 apart in dk under the loop emitters the suite compiles
    with, tests/conftest.py)."""
    case = CASE["gate_l2_varlen_K60"]
    args, kwargs = make_inputs(case)
    kwargs["return_intermediate_states"] = True
    fn = functools.partial(kdax.chunk_kda, backend=backend, config=config)
    *outs, grads = run_with_grads(fn, args, kwargs)
    *outs_kept, grads_kept = run_with_grads(fn, args, {**kwargs, "disable_recompute": True})
    bound = 0.0 if backend == "naive" else 1e-6
    for name, x, y in [
        *zip(("o", "final_state", "states"), outs, outs_kept),
        *((n, grads[n], grads_kept[n]) for n in grads),
    ]:
        assert rel_rms(y, x) <= bound, f"{name}: {rel_rms(y, x):.3g}"


def test_disable_recompute_pallas_gpu_bf16():
    """With bfloat16 inputs the GPU kernels store their intermediates in bfloat16, and the backward
    that recomputes v_new does so from bfloat16 states where the kept one is the forward's: the
    gradients differ at bfloat16 rounding, both inside the bf16 bars."""
    case = CASE["gate_l2_varlen_K60"]
    case = dataclasses.replace(case, options=case.options + (("disable_recompute", True),))
    assert_close_to_reference(functools.partial(kdax.chunk_kda, backend="pallas_gpu"), case, jnp.bfloat16)
