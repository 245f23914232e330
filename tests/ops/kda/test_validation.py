"""Every bad input raises ValueError naming the argument, what was expected and what came."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdax
from kdax.nn import KimiDeltaAttention
from kdax.ops.kda import xla
from tests.tolerances import F32

B, T, H, HV, K, V = 1, 8, 2, 4, 16, 8


def _args(**over):
    z = lambda *s: jnp.zeros(s, jnp.float32)
    a = {"q": z(B, T, H, K), "k": z(B, T, H, K), "v": z(B, T, HV, V), "g": z(B, T, HV, K), "beta": z(B, T, HV)}
    a.update(over)
    return a


BAD = [
    ("q", _args(q=jnp.zeros((B, T, H))), {}, "q: expected a 4-d array"),
    ("k", _args(k=jnp.zeros((B, T, H, K + 1))), {}, "k: expected shape (1, 8, 2, 16)"),
    ("v", _args(v=jnp.zeros((B, T + 1, HV, V))), {}, "v: expected shape"),
    (
        "v heads",
        _args(v=jnp.zeros((B, T, 3, V)), g=jnp.zeros((B, T, 3, K)), beta=jnp.zeros((B, T, 3))),
        {},
        "divisible by q's heads H=2",
    ),
    ("g", _args(g=jnp.zeros((B, T, H, K))), {}, "g: expected shape (1, 8, 4, 16)"),
    ("beta", _args(beta=jnp.zeros((B, T, HV, 1))), {}, "beta: expected a 3-d array"),
    ("dtype", _args(q=jnp.zeros((B, T, H, K), jnp.int32)), {}, "q: expected a floating dtype"),
    ("mixed dtype", _args(v=jnp.zeros((B, T, HV, V), jnp.bfloat16)), {}, "k, v: expected the dtype of q"),
    (
        "K too big",
        _args(q=jnp.zeros((B, T, H, 300)), k=jnp.zeros((B, T, H, 300)), g=jnp.zeros((B, T, HV, 300))),
        {},
        "head dim K in [1, 256]",
    ),
    (
        "T zero",
        _args(
            q=jnp.zeros((B, 0, H, K)),
            k=jnp.zeros((B, 0, H, K)),
            v=jnp.zeros((B, 0, HV, V)),
            g=jnp.zeros((B, 0, HV, K)),
            beta=jnp.zeros((B, 0, HV)),
        ),
        {},
        "T >= 1",
    ),
    (
        "B zero",
        _args(
            q=jnp.zeros((0, T, H, K)),
            k=jnp.zeros((0, T, H, K)),
            v=jnp.zeros((0, T, HV, V)),
            g=jnp.zeros((0, T, HV, K)),
            beta=jnp.zeros((0, T, HV)),
        ),
        {},
        "q: expected at least one sequence",
    ),
    (
        "H zero",
        _args(q=jnp.zeros((B, T, 0, K)), k=jnp.zeros((B, T, 0, K))),
        {},
        "q: expected at least one sequence and one head",
    ),
    (
        "HV zero",
        _args(v=jnp.zeros((B, T, 0, V)), g=jnp.zeros((B, T, 0, K)), beta=jnp.zeros((B, T, 0))),
        {},
        "v: expected a number of value heads HV divisible",
    ),
    ("chunk", _args(), {"chunk_size": 48}, "chunk_size: expected one of (16, 32, 64, 128)"),
    ("backend", _args(), {"backend": "cuda"}, "backend: expected one of"),
    ("h0 shape", _args(), {"initial_state": jnp.zeros((2, HV, K, V))}, "initial_state: expected shape (1, 4, 16, 8)"),
    ("cu dtype", _args(), {"cu_seqlens": jnp.asarray([0.0, 8.0])}, "cu_seqlens: expected an integer dtype"),
    ("cu list dtype", _args(), {"cu_seqlens": [0.0, 8.0]}, "cu_seqlens: expected an integer dtype"),
    ("cu list values", _args(), {"cu_seqlens": [0, 9]}, "non-decreasing offsets from 0 to T=8"),
    ("cu shape", _args(), {"cu_seqlens": jnp.asarray([[0, 8]])}, "cu_seqlens: expected a 1-d array"),
    ("cu short", _args(), {"cu_seqlens": jnp.asarray([0])}, "cu_seqlens: expected at least 2 entries"),
    ("cu values", _args(), {"cu_seqlens": jnp.asarray([0, 5, 7])}, "non-decreasing offsets from 0 to T=8"),
    (
        "cu batch",
        _args(
            q=jnp.zeros((2, T, H, K)),
            k=jnp.zeros((2, T, H, K)),
            v=jnp.zeros((2, T, HV, V)),
            g=jnp.zeros((2, T, HV, K)),
            beta=jnp.zeros((2, T, HV)),
        ),
        {"cu_seqlens": jnp.asarray([0, 8])},
        "batch size B=1 when cu_seqlens",
    ),
    (
        "cu h0",
        _args(),
        {"cu_seqlens": jnp.asarray([0, 3, 8]), "initial_state": jnp.zeros((1, HV, K, V))},
        "initial_state: expected shape (2, 4, 16, 8)",
    ),
    ("A_log missing", _args(), {"use_gate_in_kernel": True}, "A_log: expected an array of shape (HV,)"),
    ("A_log shape", _args(), {"use_gate_in_kernel": True, "A_log": jnp.zeros((H,))}, "A_log: expected shape (4,)"),
    (
        "dt_bias shape",
        _args(),
        {"use_gate_in_kernel": True, "A_log": jnp.zeros((HV,)), "dt_bias": jnp.zeros((HV, K))},
        "dt_bias: expected a 1-d array",
    ),
    ("A_log unused", _args(), {"A_log": jnp.zeros((HV,))}, "A_log: expected None unless use_gate_in_kernel"),
    ("lower_bound unused", _args(), {"lower_bound": -5.0}, "lower_bound: expected None unless use_gate_in_kernel"),
    ("lower_bound sign", _args(), {"use_gate_in_kernel": True, "lower_bound": 1.0}, "lower_bound: expected a negative"),
    ("neg eigval", _args(), {"allow_neg_eigval": True}, "allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True"),
    ("scale", _args(), {"scale": jnp.ones((2,))}, "scale: expected a Python float"),
    ("not an array", _args(q=[[1.0]]), {}, "q: expected an array, got list"),
    (
        "safe_gate bound",
        _args(),
        {"use_gate_in_kernel": True, "A_log": jnp.zeros((HV,)), "safe_gate": True},
        "lower_bound: expected a float in [-5, 0) with safe_gate=True",
    ),
    (
        "safe_gate range",
        _args(),
        {"use_gate_in_kernel": True, "lower_bound": -8.0, "safe_gate": True},
        "lower_bound: expected a float in [-5, 0) with safe_gate=True",
    ),
    (
        "h0 v-first",
        _args(),
        {"state_v_first": True, "initial_state": jnp.zeros((1, HV, K, V))},
        "initial_state: expected shape (1, 4, 8, 16)",
    ),
    ("safe_gate type", _args(), {"safe_gate": "yes"}, "safe_gate: expected a bool, got str 'yes'"),
    ("disable_recompute type", _args(), {"disable_recompute": 1}, "disable_recompute: expected a bool, got int 1"),
    (
        "return_intermediate_states type",
        _args(),
        {"return_intermediate_states": None},
        "return_intermediate_states: expected a bool, got NoneType None",
    ),
    ("state_v_first type", _args(), {"state_v_first": jnp.asarray(True)}, "state_v_first: expected a bool, got"),
    (
        "config",
        _args(),
        {"backend": "pallas_tpu", "config": xla.Config()},
        "config: expected None or a kdax.ops.kda.pallas_tpu.Config for backend='pallas_tpu', got Config",
    ),
    ("config field", _args(), {"config": xla.Config(schedule="fast")}, "config.schedule: expected 'auto'"),
]


@pytest.mark.parametrize("fn", [kdax.chunk_kda, kdax.fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("name,args,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises(fn, name, args, kwargs, message):
    if fn is kdax.fused_recurrent_kda and ("chunk_size" in kwargs or "config" in kwargs):
        pytest.skip("fused_recurrent_kda takes no chunk_size and no kernel config")
    with pytest.raises(ValueError, match=None) as info:
        fn(**args, **kwargs)
    assert message in str(info.value)


_ARRAY_CASES = [b for b in BAD if set(b[2]) <= {"initial_state", "cu_seqlens", "scale", "chunk_size"}]


@pytest.mark.parametrize("fn", [kdax.naive_recurrent_kda, kdax.naive_chunk_kda], ids=["recurrent", "chunk"])
@pytest.mark.parametrize("name,args,kwargs,message", _ARRAY_CASES, ids=[b[0] for b in _ARRAY_CASES])
def test_references_check_their_inputs_as_the_ops_do(fn, name, args, kwargs, message):
    if fn is kdax.naive_recurrent_kda and "chunk_size" in kwargs:
        pytest.skip("naive_recurrent_kda takes a chunk_size only for its intermediate states")
    with pytest.raises(ValueError, match=None) as info:
        fn(**args, **kwargs)
    assert message in str(info.value)


def test_backends_an_op_lacks_say_not_available():
    from kdax.ops.common.dispatch import OpBackends
    from kdax.ops.kda.api import CONFIGS

    op = OpBackends("an_op", ("xla",), CONFIGS)  # every public KDA op has every backend now
    for backend in ("pallas_gpu", "pallas_tpu"):
        with pytest.raises(NotImplementedError, match=f"backend='{backend}': not available for an_op"):
            op.resolve(backend, jnp.float32)


def test_naive_backend_needs_concrete_cu_seqlens():
    import jax

    a = _args()
    f = jax.jit(lambda cu: kdax.chunk_kda(**a, cu_seqlens=cu, backend="naive")[0])
    with pytest.raises(ValueError, match="cu_seqlens: expected a concrete array"):
        f(jnp.asarray(np.array([0, 8]), jnp.int32))


def test_cu_seqlens_may_be_a_list():
    rng = np.random.default_rng(0)
    x = {n: jnp.asarray(rng.standard_normal(z.shape), jnp.float32) for n, z in _args().items()}
    a = dict(x, g=-jnp.abs(x["g"]), beta=jnp.full((B, T, HV), 0.5), output_final_state=True)
    for fn in (kdax.chunk_kda, kdax.fused_recurrent_kda):
        o_list, s_list = fn(**a, cu_seqlens=[0, 3, 8])
        o_arr, s_arr = fn(**a, cu_seqlens=jnp.asarray([0, 3, 8], jnp.int32))
        np.testing.assert_array_equal(o_list, o_arr)
        np.testing.assert_array_equal(s_list, s_arr)


def test_traced_malformed_cu_seqlens_are_made_valid():
    """Under jit the offsets cannot be checked: out of range or decreasing ones run as
    varlen.valid_offsets makes them (clipped to [0, T], a running maximum, first 0, last T), never NaN."""
    import jax

    rng = np.random.default_rng(1)
    x = {n: jnp.asarray(rng.standard_normal(z.shape), jnp.float32) for n, z in _args().items()}
    a = dict(x, g=-jnp.abs(x["g"]), beta=jnp.full((B, T, HV), 0.5), output_final_state=True)
    for fn in (kdax.chunk_kda, kdax.fused_recurrent_kda):
        f = jax.jit(lambda cu, fn=fn: fn(**a, cu_seqlens=cu))
        for bad, valid in [([-3, 5, 2, 20], [0, 5, 5, 8]), ([2, 9, 1, 4], [0, 8, 8, 8])]:
            o, s = f(jnp.asarray(bad, jnp.int32))
            o_ref, s_ref = fn(**a, cu_seqlens=valid)
            assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
            np.testing.assert_allclose(o, o_ref, rtol=F32["out"], atol=F32["same"])
            np.testing.assert_allclose(s, s_ref, rtol=F32["out"], atol=F32["same"])


def test_debug_checks_raise_on_traced_malformed_cu_seqlens():
    """Under kdax.debug_checks() traced offsets are checked with checkify: bad ones are an error
    naming cu_seqlens, good ones none; outside it the same trace has no check."""
    import jax
    from jax.experimental import checkify

    rng = np.random.default_rng(1)
    x = {n: jnp.asarray(rng.standard_normal(z.shape), jnp.float32) for n, z in _args().items()}
    a = dict(x, g=-jnp.abs(x["g"]), beta=jnp.full((B, T, HV), 0.5))
    for fn in (kdax.chunk_kda, kdax.fused_recurrent_kda):
        with kdax.debug_checks():
            f = checkify.checkify(jax.jit(lambda cu, fn=fn: fn(**a, cu_seqlens=cu)[0]))
            err, _ = f(jnp.asarray([0, 9, 8], jnp.int32))
            assert err.get() is not None and f"cu_seqlens: expected offsets from 0 to T = {T}" in err.get()
            with pytest.raises(checkify.JaxRuntimeError, match="cu_seqlens"):
                err.throw()
            err, o = f(jnp.asarray([0, 3, T], jnp.int32))
            assert err.get() is None
            np.testing.assert_array_equal(o, fn(**a, cu_seqlens=[0, 3, T])[0])
            fn(**a, cu_seqlens=[0, 3, T])  # concrete offsets: no checkify needed
    with pytest.raises(ValueError, match="cu_seqlens"):  # concrete bad ones: the ValueError, as always
        kdax.chunk_kda(**a, cu_seqlens=[0, 9, 8])


def test_explain_backend_says_what_auto_runs_and_why():
    from kdax.ops.kda import pallas_tpu

    backend, why = kdax.explain_backend(jnp.float32)
    assert backend == "xla" and "cpu" in why  # this machine has no accelerator
    assert kdax.explain_backend(config=pallas_tpu.Config()) == ("pallas_tpu", "the config's kernels")
    assert kdax.explain_backend(jnp.float64, config=pallas_tpu.Config())[0] == "xla"
    assert (
        kdax.explain_backend(config=pallas_tpu.Config(), op="fused_recurrent_kda")[0] == "pallas_tpu"
    )  # decode kernel
    with pytest.raises(ValueError, match="op: expected one of") as err:
        kdax.explain_backend(op="attention")
    assert "'chunk_kda'" in str(err.value) and "'kascade_reuse_decode'" in str(err.value)


def test_fla_06_keywords_port_as_they_are():
    """FLA 0.6.0's chunk_kda keywords: cu_seqlens_cpu (the offsets' host copy, or the offsets
    themselves), cp_context=None and transpose_state_layout (state_v_first) give kdax's results;
    a head-first q (fewer tokens than heads) warns, as FLA's does; kdax's own layers do not."""
    import warnings

    r = np.random.default_rng(0)
    a = {n: jnp.asarray(r.standard_normal(x.shape) * 0.3, jnp.float32) for n, x in _args().items()}
    a["g"] = -jnp.abs(a["g"])
    h0 = jnp.asarray(r.standard_normal((2, HV, V, K)), jnp.float32)
    cu = [0, 3, 8]
    want = kdax.chunk_kda(**a, cu_seqlens=cu, initial_state=h0, output_final_state=True, state_v_first=True)
    fla = {"cp_context": None, "transpose_state_layout": True, "initial_state": h0, "output_final_state": True}
    for offsets in ({"cu_seqlens": jnp.asarray(cu), "cu_seqlens_cpu": np.asarray(cu)}, {"cu_seqlens_cpu": cu}):
        got = kdax.chunk_kda(**a, **offsets, **fla)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
    rec = kdax.fused_recurrent_kda(**a, cu_seqlens_cpu=cu, transpose_state_layout=True, initial_state=h0)
    np.testing.assert_allclose(rec[0], want[0], atol=1e-5)
    with pytest.raises(ValueError, match="cp_context: expected None"):
        kdax.chunk_kda(**a, cp_context=object())
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu: expected cu_seqlens' values \[0, 3, 8\], got \[0, 4, 8\]"):
        kdax.chunk_kda(**a, cu_seqlens=cu, cu_seqlens_cpu=[0, 4, 8])
    with pytest.raises(ValueError, match="transpose_state_layout: expected a bool"):
        kdax.chunk_kda(**a, transpose_state_layout="yes")
    head_first = {n: jnp.swapaxes(x, 1, 2) if x.ndim == 4 else x for n, x in _args(beta=jnp.zeros((B, H, T))).items()}
    with pytest.warns(kdax.LayoutWarning, match=r"fewer tokens \(2\) than heads \(8\)"):
        kdax.chunk_kda(head_first["q"], head_first["k"], head_first["q"], head_first["q"], jnp.zeros((B, H, T)))
    layer = KimiDeltaAttention(hidden_size=32, num_heads=4, head_dim=8, rngs=nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", kdax.LayoutWarning)
        layer(jnp.ones((1, 2, 32)))  # two tokens, four heads: no warning
