"""The decode kernels (fused_recurrent_kda on pallas_tpu and pallas_gpu), interpreted on CPU
against the float64 recurrence, and lowered for TPU and for an H100."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.kda import api, decode, pallas_gpu
from tests.tolerances import TOL

KERNELS = ["pallas_tpu", "pallas_gpu"]
# The TPU interpreter costs 3-4x the generic one: the TPU kernel's runs of what both kernels share
# (one body, kdax.ops.kda.decode) go behind the slow marker, its float64 cases stay in CI.
SLOW_TPU = [pytest.param("pallas_tpu", marks=pytest.mark.slow), "pallas_gpu"]
RATES = (np.log(20.0), np.log(60.0))  # decay rates of 20-60 a token through the in-kernel gate


def inputs(B, T, H, HV, K, V, seed=0, dtype=jnp.float32, in_op=True, g_scale=1.0, lower_bound=None):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, H, K))
    v, g = rng.standard_normal((B, T, HV, V)), g_scale * rng.standard_normal((B, T, HV, K))
    beta = rng.standard_normal((B, T, HV))
    f = lambda x: jnp.asarray(x, dtype)
    kw = {"output_final_state": True, "initial_state": jnp.asarray(rng.standard_normal((B, HV, K, V)), jnp.float32)}
    if in_op:
        kw.update(
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            A_log=jnp.asarray(rng.uniform(*RATES, HV), jnp.float32),
            dt_bias=jnp.asarray(rng.standard_normal(HV * K), jnp.float32),
            lower_bound=lower_bound,
        )
    else:  # the log decay itself, and unit keys
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        g, beta = -np.abs(g), rng.uniform(0, 1, (B, T, HV))
    return [f(x) for x in (q, k, v, g, beta)], kw


def reference(args, kw):
    f64 = lambda x: x if x is None or not hasattr(x, "dtype") else jnp.asarray(x, jnp.float64)
    return kdax.fused_recurrent_kda(*map(f64, args), backend="naive", **{n: f64(x) for n, x in kw.items()})


CASES = {
    "T1_gva_K60_V100": {"B": 2, "T": 1, "H": 2, "HV": 4, "K": 60, "V": 100},
    "T4_sigmoid_gate_neg_eigval": {"B": 2, "T": 4, "H": 1, "HV": 2, "K": 32, "V": 32, "lower_bound": -5.0},
    "T5_strong_decay": {
        "B": 1,
        "T": 5,
        "H": 1,
        "HV": 1,
        "K": 16,
        "V": 48,
        "in_op": False,
        "g_scale": 40.0,
    },  # sum of g ~ -160
}


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_recurrence(backend, case):
    args, kw = inputs(**CASES[case])
    if case.startswith("T4"):
        kw["allow_neg_eigval"] = True
    o, final = kdax.fused_recurrent_kda(*args, backend=backend, **kw)
    o_ref, final_ref = reference(args, kw)
    tol = TOL[jnp.float32]["out"]
    assert o.dtype == jnp.float32 and final.dtype == jnp.float32
    assert rel_rms(o, o_ref) <= tol and rel_rms(final, final_ref) <= tol, (rel_rms(o, o_ref), rel_rms(final, final_ref))


@pytest.mark.parametrize("backend", SLOW_TPU)
def test_bf16_and_state_v_first(backend):
    args, kw = inputs(B=2, T=2, H=2, HV=2, K=64, V=32, dtype=jnp.bfloat16)
    kw["initial_state"] = jnp.swapaxes(kw["initial_state"], -1, -2)
    o, final = kdax.fused_recurrent_kda(*args, backend=backend, state_v_first=True, **kw)
    o_ref, final_ref = reference(args, {**kw, "state_v_first": True})
    assert o.dtype == jnp.bfloat16 and final.shape == kw["initial_state"].shape
    assert rel_rms(o, o_ref) <= TOL[jnp.bfloat16]["out"] and rel_rms(final, final_ref) <= TOL[jnp.bfloat16]["out"]


def _pool_call(backend, state_v_first, seed=1):
    """A call on a pool of 12 slots whose K and V the kernel reads in place (128 on TPU)."""
    K, V = (128, 128) if backend == "pallas_tpu" else (32, 16)
    args, kw = inputs(B=3, T=3, H=1, HV=2, K=K, V=V, seed=seed)
    shape = (12, 2, V, K) if state_v_first else (12, 2, K, V)
    pool = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(shape), jnp.float32)
    kw = {n: x for n, x in kw.items() if n not in ("initial_state", "output_final_state")}
    return functools.partial(kdax.fused_recurrent_kda, *args, initial_state=pool, state_v_first=state_v_first, **kw)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("backend", SLOW_TPU)
def test_slots_and_speculative_slots(backend, state_v_first):
    """One slot per row, and a slot per token with accepted counts (two rows starting from slot
    9, which neither writes: a fork), read and written by the kernel in the pool: as the xla backend (itself checked against the float64 recurrence in test_slots.py),
    untouched slots bit for bit."""
    run = _pool_call(backend, state_v_first)
    pool = run.keywords["initial_state"]
    q = run.args[0]
    for idx, accepted in [
        (jnp.asarray([4, -1, 0], jnp.int32), None),
        (jnp.asarray([[0, 1, 2], [3, 4, 5], [-1, 7, 8]], jnp.int32), jnp.asarray([2, 1, 3], jnp.int32)),
        (jnp.asarray([[0, 1, 2, 9], [3, 4, 5, 10], [-1, 7, 8, 9]], jnp.int32), jnp.asarray([4, 1, 4], jnp.int32)),
    ]:
        opts = api.Options(op="recurrent", backend=backend, state_v_first=state_v_first)
        assert api._in_kernel_slots(opts, q, pool, idx) is not None
        call = functools.partial(run, ssm_state_indices=idx, num_accepted_tokens=accepted)
        (o, new), (o_ref, new_ref) = call(backend=backend), call(backend="xla")
        assert rel_rms(o, o_ref) <= 1e-6 and rel_rms(new, new_ref) <= 1e-6
        untouched = np.setdiff1d(np.arange(12), np.asarray(idx))
        np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])


def test_traced_slots_out_of_range_read_zeros_and_write_nothing():
    """Under jit the slots are not checked: one past the pool and a negative one are padding rows
    in the kernel as in the gather and scatter."""
    run = _pool_call("pallas_gpu", False)
    pool = run.keywords["initial_state"]
    step = jax.jit(lambda idx, backend: run(ssm_state_indices=idx, backend=backend), static_argnums=1)
    idx = jnp.asarray([12, 5, -3], jnp.int32)
    (o, new), (o_ref, new_ref) = step(idx, "pallas_gpu"), step(idx, "xla")
    assert rel_rms(o, o_ref) <= 1e-6
    np.testing.assert_array_equal(np.asarray(new)[np.arange(12) != 5], np.asarray(pool)[np.arange(12) != 5])
    assert rel_rms(new[5], new_ref[5]) <= 1e-6


def test_pool_gradients_through_the_kernel():
    run = _pool_call("pallas_gpu", True, seed=6)
    pool = run.keywords["initial_state"]
    w = jnp.asarray(np.random.default_rng(7).standard_normal(pool.shape), jnp.float32)
    idx, acc = jnp.asarray([[0, 1, 2], [3, 4, 5], [-1, 7, 8]], jnp.int32), jnp.asarray([2, 1, 3], jnp.int32)

    def loss(pool, q, backend):
        o, new = run.func(
            q,
            *run.args[1:],
            **{**run.keywords, "initial_state": pool},
            backend=backend,
            ssm_state_indices=idx,
            num_accepted_tokens=acc,
        )
        return jnp.sum(o**2) + jnp.sum(new * w)

    got = jax.grad(loss, argnums=(0, 1))(pool, run.args[0], "pallas_gpu")
    ref = jax.grad(loss, argnums=(0, 1))(pool, run.args[0], "xla")
    for x, r in zip(got, ref):
        assert rel_rms(x, r) <= 1e-5


@pytest.mark.parametrize("backend", SLOW_TPU)
def test_gradients_match_the_reference(backend):
    args, kw = inputs(B=1, T=3, H=1, HV=2, K=16, V=16, seed=3)
    w = jnp.asarray(np.random.default_rng(4).standard_normal(kw["initial_state"].shape))

    def loss(args, h0, dt_bias, b):
        f64 = b == "naive"
        o, s = kdax.fused_recurrent_kda(
            *[jnp.asarray(x, jnp.float64) if f64 else x for x in args],
            backend=b,
            **{**kw, "initial_state": h0, "dt_bias": dt_bias},
        )
        return jnp.sum(o**2) + jnp.sum(s * w)

    got = jax.grad(loss, argnums=(0, 1, 2))(args, kw["initial_state"], kw["dt_bias"], backend)
    ref = jax.grad(loss, argnums=(0, 1, 2))(args, kw["initial_state"], kw["dt_bias"], "naive")
    for x, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert rel_rms(x, r) <= TOL[jnp.float32]["grad"]


def _lowered(platform, T=1, cu=None, dtype=jnp.bfloat16):
    B = 1 if cu is not None else 4
    shapes = [(B, T, 4, 128), (B, T, 4, 128), (B, T, 8, 128), (B, T, 8, 128), (B, T, 8)]
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    h0 = jax.ShapeDtypeStruct((B if cu is None else len(cu) - 1, 8, 128, 128), jnp.float32)
    gate = {"use_gate_in_kernel": True, "A_log": jnp.zeros((8,)), "dt_bias": jnp.zeros((8 * 128,))}

    def decode_step(q, k, v, g, beta, h0):
        return kdax.fused_recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            **gate,
        )

    return kdax.lower(decode_step, *args, h0, platform=platform).as_text()


def test_the_tpu_kernel_lowers_where_it_takes_the_rows():
    """Asked for (auto on a TPU follows the compiled costs: tests/ops/common/test_tpu_costs.py)."""
    with kdax.use_backend("pallas_tpu"):
        assert _lowered("tpu").count("tpu_custom_call") == 1
        assert "kda_fused_recurrent" in _lowered("tpu", T=decode.MAX_TOKENS)
        assert "tpu_custom_call" not in _lowered("tpu", T=decode.MAX_TOKENS + 1)  # longer: the xla scan
        assert "tpu_custom_call" not in _lowered("tpu", T=2, cu=np.array([0, 1, 2]))  # packed: the xla scan


def test_auto_runs_the_kernel_on_gpu_once_verified_and_lowers(monkeypatch):
    triton = "__gpu$xla.gpu.triton"
    assert triton not in _lowered("cuda")  # not verified on a GPU yet: xla
    monkeypatch.setattr(pallas_gpu, "DECODE_VERIFIED_ON_GPU", True)
    text = _lowered("cuda", T=4)
    assert text.count(triton) == 1 and "kda_fused_recurrent" in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_the_pool_goes_into_the_kernel_alone(platform, state_v_first, monkeypatch):
    """A decode step and a verify step on a pool of 64 slots lower to the kernel with the pool
    aliased to its output, and no other operation touches the pool: no gather, scatter or copy
    of it (with the pool donated, XLA updates it in place). The kernels asked for: "auto" takes
    them on a TPU only where they cost less than xla (tests/ops/common/test_tpu_costs.py)."""
    monkeypatch.setattr(pallas_gpu, "DECODE_VERIFIED_ON_GPU", True)
    B, pool_type = 4, "tensor<64x8x128x128xf32>"
    for T, per_token in ((1, False), (4, True)):
        shapes = [(B, T, 4, 128), (B, T, 4, 128), (B, T, 8, 128), (B, T, 8, 128), (B, T, 8)]
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
        pool = jax.ShapeDtypeStruct((64, 8, 128, 128), jnp.float32)
        idx = jax.ShapeDtypeStruct((B, T) if per_token else (B,), jnp.int32)
        acc = jax.ShapeDtypeStruct((B,), jnp.int32) if per_token else None

        def step(q, k, v, g, beta, pool, idx, acc):
            return kdax.fused_recurrent_kda(
                q,
                k,
                v,
                g,
                beta,
                initial_state=pool,
                ssm_state_indices=idx,
                num_accepted_tokens=acc,
                state_v_first=state_v_first,
                use_gate_in_kernel=True,
                A_log=jnp.zeros((8,)),
                use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
            )

        with kdax.use_backend({"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform]):
            text = kdax.lower(step, *args, pool, idx, acc, platform=platform).as_text()
        uses = [line for line in text.splitlines() if pool_type in line]
        kernel = [line for line in uses if "custom_call" in line]
        assert len(kernel) == 1 and "kda_fused_recurrent_slots" in text
        assert "output_operand_aliases" in kernel[0]
        others = [
            line for line in uses if not any(op in line for op in ("func.func", "call @", "custom_call", "return"))
        ]
        assert not others, others


def test_kernels_refuse_inputs_they_do_not_take():
    args, kw = inputs(B=1, T=3, H=1, HV=1, K=16, V=16)
    with pytest.raises(ValueError, match="backend: expected inputs the pallas_tpu decode kernel takes, not packed"):
        kdax.fused_recurrent_kda(*args, backend="pallas_tpu", cu_seqlens=[0, 1, 3], **{**kw, "initial_state": None})
    long = [jnp.concatenate([x] * 6, axis=1) for x in args]
    with pytest.raises(ValueError, match="18 tokens a row"):
        kdax.fused_recurrent_kda(*long, backend="pallas_gpu", **kw)
