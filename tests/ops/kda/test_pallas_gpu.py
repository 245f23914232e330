"""Pallas GPU (Triton) kernels, in the Pallas interpreter on CPU, and their lowering for CUDA.

Every shared case of test_chunk.py runs for pallas_gpu there (fp32 and bf16); here what
only these kernels have."""

import functools
import os

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.common.arrays import round_tf32
from kdax.ops.kda import pallas_gpu, tiles
from tests.ops.kda.cases import CASE, Case, assert_close_to_reference, make_inputs, slow_if
from tests.tolerances import F64, TOL

chunk_kda_gpu = functools.partial(kdax.chunk_kda, backend="pallas_gpu")


def test_head_dim_256_and_small_v_block(monkeypatch):
    chunk_kda_gpu = functools.partial(kdax.chunk_kda, backend="pallas_gpu", config=pallas_gpu.Config(block_v=16))
    case = Case("K256_V256", T=70, B=1, H=1, HV=1, K=256, V=256, initial_state=True)
    assert_close_to_reference(chunk_kda_gpu, case, jnp.float32)


_TF32X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _tf32x3(a, b, dims):  # the three products of TF32 high and low parts Triton sums
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    a_hi, b_hi = round_tf32(a), round_tf32(b)
    a_lo, b_lo = round_tf32(a - a_hi), round_tf32(b - b_hi)
    exact = functools.partial(
        jax.lax.dot_general, dimension_numbers=(dims, ((), ())), precision=jax.lax.Precision.HIGHEST
    )
    return exact(a_lo, b_hi) + exact(a_hi, b_lo) + exact(a_hi, b_hi)


class _GPUTiles(tiles.Tiles):
    """The GPU's matmuls on CPU: float32 operands rounded to TF32 under Precision.DEFAULT,
    and under TF32_TF32_F32_X3 the three products of TF32 high and low parts Triton sums
    (bfloat16 operands need nothing: their products are exact in float32); the 0/1 sums as
    the two TF32 products ``pallas_gpu.tiles_for`` gives them on a GPU (``tiles.TF32X2``)."""

    def _bulk(self, a, b, dims):
        if self.operands is None and self.precision == jax.lax.Precision.DEFAULT:
            a, b = round_tf32(a), round_tf32(b)
        if self.precision != _TF32X3:
            return super()._bulk(a, b, dims)
        return _tf32x3(a, b, dims)

    def _sum(self, mask, x):  # mask(i, j) of the [C, C] row and column iotas
        C = x.shape[-2]
        i, j = (jax.lax.broadcasted_iota(jnp.int32, (C, C), d) for d in (0, 1))
        return _tf32x2(jnp.where(mask(i, j), 1.0, 0.0), x)


def _tf32x2(ones, x):  # the two TF32 products of tiles.TF32X2, the tensor cores' operand rounding emulated
    head = round_tf32(x)
    exact = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    return exact(ones, head) + exact(ones, round_tf32(x - head))


def test_float32_inputs_get_three_pass_tf32_on_gpu():
    assert pallas_gpu.tiles_for(pallas_gpu.Config(interpret=False), jnp.float32).precision == _TF32X3
    assert pallas_gpu.tiles_for(pallas_gpu.Config(interpret=True), jnp.float32).precision == jax.lax.Precision.HIGHEST
    for dtype in (jnp.float32, jnp.bfloat16):  # the 0/1 sums: two TF32 products on a GPU, float32 off it
        assert pallas_gpu.tiles_for(pallas_gpu.Config(interpret=False), dtype).sums == tiles.TF32X2
        assert pallas_gpu.tiles_for(pallas_gpu.Config(interpret=True), dtype).sums == jax.lax.Precision.HIGHEST


def test_round_tf32_splits_exactly():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(4096) * np.exp2(np.linspace(-100.0, 100.0, 4096)), jnp.float32)
    head = round_tf32(x)
    bits = np.asarray(jax.lax.bitcast_convert_type(head, jnp.uint32))
    assert not (bits & 0x1FFF).any()  # 13 low bits clear: a TF32 value
    rest = x - head
    assert (np.abs(rest) <= np.abs(x) * 2.0**-11).all()  # to nearest
    np.testing.assert_array_equal(head + rest, x)  # the split is exact
    np.testing.assert_array_equal(round_tf32(jnp.array([-jnp.inf, 0.0, 2.0**-100])), [-jnp.inf, 0.0, 2.0**-100])


def test_two_pass_tf32_sums_keep_float32_accuracy():
    """The 0/1 sums as tiles.TF32X2 runs them: exact off GPU (float32 products), and with the
    tensor cores' TF32 operands emulated within 2^-20 of the summed magnitudes, where one TF32
    product is off by 2^-11."""
    C = 64
    x = np.random.default_rng(0).standard_normal((C, 16)) * np.exp2(np.arange(C) / 4)[:, None]
    x = jnp.asarray(x, jnp.float32)
    upper = jnp.arange(C)[None, :] >= jnp.arange(C)[:, None]
    ones, exact = jnp.where(upper, 1.0, 0.0), np.triu(np.ones((C, C))) @ np.asarray(x, np.float64)
    scale = np.triu(np.ones((C, C))) @ np.abs(np.asarray(x, np.float64))
    on_cpu = tiles.Tiles(sums=tiles.TF32X2).suffix_sums(x)
    assert np.max(np.abs(np.asarray(on_cpu) - exact) / scale) < 2.0**-22
    assert np.max(np.abs(np.asarray(_tf32x2(ones, x)) - exact) / scale) < 2.0**-20
    assert np.max(np.abs(np.asarray(ones @ round_tf32(x)) - exact) / scale) > 2.0**-13


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(CASE[n], id=n, marks=slow_if(CASE[n], "pallas_gpu matmuls fp32"))
        for n in ("T65_gva_h0", "strong_decay_varlen", "gate_rate_20_60_varlen")
    ],
)
def test_float32_inputs_within_bars_with_gpu_matmuls(case, monkeypatch):
    """float32 inputs with the matmuls "auto" picks on a GPU (tf32x3), emulated here: the
    float32 bars, which one-pass TF32 misses."""
    prec, operands = pallas_gpu.PRECISIONS["tf32x3"]
    monkeypatch.setattr(pallas_gpu, "tiles_for", lambda cfg, dtype: _GPUTiles(prec, False, operands, _TF32X3))
    assert_close_to_reference(chunk_kda_gpu, case, jnp.float32)


_GPU_MATMUL_CASES = [
    pytest.param(CASE[n], p, id=f"{n}-{p}", marks=slow_if(CASE[n], f"pallas_gpu matmuls {p}"))
    for n in ("T65_gva_h0", "strong_decay_varlen", "gate_l2_varlen_K60")
    for p in ("bf16", "tf32")
    if n != "gate_l2_varlen_K60" or p == "bf16"  # gate logits and the L2 norm in the kernels
]


@pytest.mark.parametrize(("case", "precision"), _GPU_MATMUL_CASES)
def test_bf16_inputs_within_bars_with_gpu_matmuls(case, precision, monkeypatch):
    """bfloat16 inputs with the matmuls of precision="bf16" (what "auto" picks) and "tf32",
    the GPU's TF32 rounding emulated here."""
    assert pallas_gpu.tiles_for(pallas_gpu.Config(), jnp.bfloat16).operands == jnp.bfloat16
    prec, operands = pallas_gpu.PRECISIONS[precision]
    monkeypatch.setattr(pallas_gpu, "tiles_for", lambda cfg, dtype: _GPUTiles(prec, False, operands, _TF32X3))
    assert_close_to_reference(chunk_kda_gpu, case, jnp.bfloat16)


def _xla_eqns(fn, *args):  # the equations of fn's jaxpr outside the pallas_call kernels, nested ones too
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            if eqn.primitive.name != "pallas_call":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _pallas_calls(fn, *args, get=lambda eqn: tuple(v.aval.dtype for v in eqn.outvars)):  # get(eqn) of each call
    return [get(eqn) for eqn in _xla_eqns(fn, *args) if eqn.primitive.name == "pallas_call"]


def test_bf16_inputs_store_intermediates_in_bf16():
    """w, u, q_g, k_d, Aqk, v_new, the chunk states and o: half the bytes of float32."""
    B, T, H, K = 1, 64, 1, 16
    x = jnp.zeros((B, T, H, K), jnp.bfloat16)
    b = jnp.zeros((B, T, H), jnp.bfloat16)
    diag, intra, state, output = _pallas_calls(lambda *a: chunk_kda_gpu(*a)[0], x, x, x, x, b)
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert diag == (bf16, f32, f32)  # the diagonal blocks of Aqk; of Kkk and T, which feed the inverse
    assert intra == (bf16,) * 5 + (f32,)  # Aqk, w, u, q_g, k_d; decay
    assert state == (bf16, bf16, f32)  # v_new, S_in; final state
    assert output == (bf16,)
    intra32 = _pallas_calls(lambda *a: chunk_kda_gpu(*a)[0], *(a.astype(f32) for a in (x, x, x, x, b)))[1]
    assert intra32 == (f32,) * 6


@pytest.mark.slow  # interpreted it takes a minute; scripts/gpu_session.sh tests runs it compiled
def test_chunk128_in_bf16():
    """C = 128 runs with bf16 intermediates (float32 ones are refused: test_chunk.py)."""
    assert_close_to_reference(chunk_kda_gpu, CASE["chunk128"], jnp.bfloat16)


@pytest.mark.parametrize(
    "dtype, K, C, launch, stages",
    [
        (jnp.bfloat16, 256, 64, (), (2, 2)),
        (jnp.float32, 128, 64, (), (2, 2)),
        (jnp.float32, 256, 64, (), (1, 1)),
        (jnp.bfloat16, 256, 128, (), (1, 1)),
        (jnp.float32, 256, 64, (("dstate", (4, 3)),), (1, 3)),
    ],
)
def test_state_loops_get_one_stage_past_32_kib_a_tile(monkeypatch, dtype, K, C, launch, stages):
    """Two pipeline stages of [C, Kp] tiles over 32 KiB (float32 at K = 256, bf16 at C = 128 and
    K = 256) overflow an H100's shared memory (compile report in docs/kda_gpu.md); a launch
    the config names is kept."""
    chunk_kda_gpu = functools.partial(kdax.chunk_kda, backend="pallas_gpu", config=pallas_gpu.Config(launch=launch))
    x, b = jnp.zeros((1, C, 1, K), dtype), jnp.zeros((1, C, 1), dtype)
    loss = lambda *a: chunk_kda_gpu(*a, chunk_size=C)[0].astype(jnp.float32).sum()
    get = lambda eqn: (eqn.params["jaxpr"].debug_info.func_name, eqn.params["compiler_params"])
    params = dict(_pallas_calls(jax.grad(loss), x, x, x, x, b, get=get))
    assert (params["kda_state"].num_stages, params["kda_state_cotangent"].num_stages) == stages


def test_gate_logits_are_read_by_the_kernels():
    """With use_gate_in_kernel the kernels read the bf16 logits: no float32 decay in HBM."""
    B, T, H, K = 1, 64, 1, 16
    x = jnp.zeros((B, T, H, K), jnp.bfloat16)
    b = jnp.zeros((B, T, H), jnp.bfloat16)
    gate = {"use_gate_in_kernel": True, "A_log": jnp.zeros((H,)), "dt_bias": jnp.zeros((H * K,))}

    def loss(q, k, v, g, beta):
        return chunk_kda_gpu(q, k, v, g, beta, **gate)[0].astype(jnp.float32).sum()

    calls = _pallas_calls(
        jax.grad(loss, argnums=3), x, x, x, x, b, get=lambda eqn: tuple(v.aval.dtype for v in eqn.invars)
    )
    # forward: diag, intra, state, output; backward: recompute, state cotangent, values, keys, diag grads, levels
    diag, intra, _, _, recompute, _, _, keys, diag_grads, levels = calls
    readers = ((diag, 2), (intra, 3), (recompute, 3), (keys, 2), (diag_grads, 2), (levels, 2))
    for ins, at in readers:  # g is input `at`, its parameters next
        assert ins[at : at + 2] == (jnp.bfloat16, jnp.float32)


def test_l2_norm_and_scale_are_applied_by_the_kernels():
    """With use_qk_l2norm_in_kernel the forward normalises and scales q and k in the intra
    kernel: no rsqrt and no multiply in XLA, which reads q and k as they come (bf16, no copies).
    The backward prepares them in XLA for its kernels."""
    x = jnp.ones((1, 64, 1, 16), jnp.bfloat16)
    b = jnp.zeros((1, 64, 1), jnp.bfloat16)
    run = lambda q, k: chunk_kda_gpu(q, k, x, x, b, use_qk_l2norm_in_kernel=True, scale=0.3)[0]
    forward = {eqn.primitive.name for eqn in _xla_eqns(run, x, x)}
    assert "pallas_call" in forward and not forward & {"rsqrt", "mul", "div"}
    loss = lambda q, k: run(q, k).astype(jnp.float32).sum()
    assert "rsqrt" in {eqn.primitive.name for eqn in _xla_eqns(jax.grad(loss, argnums=(0, 1)), x, x)}


def test_gate_in_kernels_equals_the_gate_in_xla():
    """The sigmoid form on varlen padding, one head with an exp(A_log) that underflows to 0
    (a * -inf would be nan there), the other a usual one: outputs and gradients as with xla."""
    case = Case("sigmoid_varlen", lengths=(1, 40, 9), H=1, HV=2, K=24, V=16, chunk_size=16)
    (q, k, v, g, beta), kw = make_inputs(case)
    kw.update(use_gate_in_kernel=True, lower_bound=-3.0)

    def run(backend):
        def loss(A_log, dt_bias, g):
            o, s = kdax.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **kw, backend=backend)
            return jnp.sum(o**2) + jnp.sum(s), (o, s)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            jnp.asarray([-200.0, 0.3]), jnp.linspace(-1, 1, 2 * 24), g
        )

    got, want = jax.tree.leaves(run("pallas_gpu")), jax.tree.leaves(run("xla"))  # loss, o, s; dA_log, ddt_bias, dg
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.all(np.isfinite(a))
        assert rel_rms(a, b) <= (TOL[jnp.float32]["out"] if i < 3 else TOL[jnp.float32]["grad"]), i


def test_round_tf32_ties_to_even():
    x = jnp.asarray([1.0, 1 + 2.0**-10, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-12], jnp.float32)
    np.testing.assert_array_equal(round_tf32(x), [1.0, 1 + 2.0**-10, 1.0, 1 + 2 * 2.0**-10, 1.0])


def test_bad_config_raises():
    x = jnp.zeros((1, 16, 1, 8), jnp.float32)
    b = jnp.zeros((1, 16, 1), jnp.float32)
    for cfg, field in [
        (pallas_gpu.Config(precision="fp8"), "config.precision"),
        (pallas_gpu.Config(block_v=48), "config.block_v"),
        (pallas_gpu.Config(launch=(("attention", (4, 1)),)), "config.launch"),
    ]:
        with pytest.raises(ValueError, match=field):
            kdax.chunk_kda(x, x, x, x, b, config=cfg)


def test_float64_inputs_are_rejected():
    x = jnp.zeros((1, 16, 1, 8), jnp.float64)
    with pytest.raises(ValueError, match="q: expected float32 or bfloat16 inputs"):
        chunk_kda_gpu(x, x, x, x, jnp.zeros((1, 16, 1), jnp.float64))


def test_vmap_and_its_grad_equal_a_loop():
    """vmap adds a grid axis to every kernel; outputs and gradients equal the per-item runs."""
    (q, k, v, g, b), _ = make_inputs(Case("vmap", T=40, B=1, H=1, HV=2, K=16, V=16))
    qs, vs = jnp.stack([q, 2 * q, -q]), jnp.stack([v, 0.5 * v, v])

    def f(q, v):
        return chunk_kda_gpu(q, k, v, g, b, chunk_size=16)[0]

    def loss(q, v):
        return jnp.sum(f(q, v) ** 2)

    one, grad = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1)))  # compiled once for the loop
    np.testing.assert_array_equal(jax.vmap(f)(qs, vs), jnp.stack([one(qs[i], vs[i]) for i in range(3)]))
    batched = jax.vmap(grad)(qs, vs)
    for i in range(3):
        for got, want in zip(batched, grad(qs[i], vs[i])):
            np.testing.assert_array_equal(got[i], want)


N_FWD, N_BWD = 4, 6  # kernels: diag, intra, state, output; recompute, state cotangent, values, keys, diag grads, levels


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_lowers_for_cuda(dtype, dim, varlen, monkeypatch):
    """Forward alone, and forward + backward: every kernel lowers through Triton."""
    _assert_lowers_for_cuda(dtype, dim, varlen, monkeypatch)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "sigmoid"])
def test_gate_in_kernels_lowers_for_cuda(lower_bound, monkeypatch):
    HV, K = 4, 128
    gate = {"use_gate_in_kernel": True, "A_log": jnp.zeros((HV,)), "dt_bias": jnp.zeros((HV * K,))}
    _assert_lowers_for_cuda(jnp.bfloat16, K, True, monkeypatch, lower_bound=lower_bound, **gate)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_kept_intermediates_and_chunk_states_lower_for_cuda(dtype, monkeypatch):
    """The values kernel reading the forward's v_new and the state cotangent kernel taking the
    cotangent of the states entering the chunks; the backward runs no intra kernel."""
    _assert_lowers_for_cuda(dtype, 128, True, monkeypatch, disable_recompute=True, return_intermediate_states=True)


def _assert_lowers_for_cuda(dtype, dim, varlen, monkeypatch, **options):
    """kdax.lower builds the "auto" backend's GPU kernels for an H100 here, without one."""
    monkeypatch.setattr(pallas_gpu, "VERIFIED_ON_GPU", True)  # so that "auto" picks them there
    B, T, H, HV = (1, 130, 2, 4) if varlen else (2, 130, 2, 4)
    cu = jnp.asarray([0, 1, 100, 130], jnp.int32) if varlen else None
    shapes = [(B, T, H, dim), (B, T, H, dim), (B, T, HV, dim), (B, T, HV, dim), (B, T, HV)]
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    fwd = lambda *a: kdax.chunk_kda(*a, cu_seqlens=cu, output_final_state=True, **options)

    def loss(*a):  # squares: every output is used (no dead kernel)
        return sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in fwd(*a))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    triton = "__gpu$xla.gpu.triton"
    n_bwd = N_BWD - bool(options.get("disable_recompute"))  # the intra kernel's outputs kept: no recompute
    assert kdax.lower(fwd, *args, platform="cuda").as_text().count(triton) == N_FWD
    text = kdax.lower(grad, *args, platform="cuda").as_text()
    assert text.count(triton) == N_FWD + n_bwd
    names = ("diag", "intra", "state", "output", "state_cotangent", "values", "keys", "diag_grads", "levels")
    assert all(f"kda_{name}" in text for name in names)  # every pallas_call named
    assert ("kda_recompute" in text) != bool(options.get("disable_recompute"))  # w, u, q_g, k_d from T


def test_intra_kernel_overwrites_its_stash_behind_barriers(monkeypatch):
    """The intra kernel stores beta k_g in w's place and then overwrites it with w: on a GPU,
    barriers must keep every thread's loads ahead of other threads' stores to the same elements,
    which the interpreter (in order) cannot show. In its Triton IR, the output walk (the last
    loop) loads the stash of all four row blocks, passes a barrier, and only then stores (each
    store there is a swap, whose read of the old value the TTIR passes drop)."""
    from jax._src.pallas.triton import pallas_call_registration

    lowering, irs = pallas_call_registration.lowering, []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        if jaxpr.debug_info.func_name == "kda_intra":  # the pallas_call's name
            irs.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    x, b = jax.ShapeDtypeStruct((1, 64, 1, 32), jnp.bfloat16), jax.ShapeDtypeStruct((1, 64, 1), jnp.bfloat16)
    kdax.lower(chunk_kda_gpu, x, x, x, x, b, platform="cuda")
    (ir,) = irs
    before, walk = ir.rsplit("scf.for", 1)
    assert "gpu.barrier" in before  # the pair walk's stores of beta k_g before the output walk's loads
    barrier = walk.find("gpu.barrier")
    assert 0 <= barrier < walk.find("tt.store") and walk[:barrier].count("tt.load") == 64 // pallas_gpu.SUB


def test_auto_picks_the_gpu_kernels_on_gpu_where_they_fit(monkeypatch):
    ops = {"chunk": "chunk_kda", "recurrent": "fused_recurrent_kda"}
    pick = lambda dtype, C, op="chunk", config=None: kdax.explain_backend(dtype, C, config, op=ops[op])[0]
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert pick(jnp.float32, 64) == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pick(jnp.bfloat16, 64, config=None) == ("pallas_gpu" if pallas_gpu.VERIFIED_ON_GPU else "xla")
    assert pick(jnp.bfloat16, 64, config=pallas_gpu.Config()) == "pallas_gpu"  # a config asks for its kernels
    monkeypatch.setattr(pallas_gpu, "VERIFIED_ON_GPU", True)  # what follows: once verified
    assert pick(jnp.float32, 64) == pick(jnp.bfloat16, 64) == pick(jnp.bfloat16, 128) == "pallas_gpu"
    assert pick(jnp.float32, 128) == "xla"  # float32 intermediates at C = 128 do not fit (shared memory)
    assert pick(jnp.float64, 64) == "xla"  # the kernels compute in float32 at most
    assert pick(jnp.float32, None, "recurrent") == "xla"  # the decode kernel: not yet verified on a GPU
    monkeypatch.setattr(pallas_gpu, "DECODE_VERIFIED_ON_GPU", True)
    assert pick(jnp.float32, None, "recurrent") == "pallas_gpu"
    tf32 = pallas_gpu.Config(precision="tf32")
    assert pick(jnp.bfloat16, 128, config=tf32) == "xla"  # a float32 precision for bf16 inputs: float32 intermediates


def test_auto_on_gpu_runs_xla_where_the_kernels_do_not_fit(monkeypatch):
    """What backend="pallas_gpu" refuses, "auto" on a GPU computes with xla, to its precision."""
    case = CASE["chunk128"]
    args, kwargs = make_inputs(case, jnp.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(pallas_gpu, "VERIFIED_ON_GPU", True)
    with pytest.raises(ValueError, match="chunk_size: pallas_gpu with float32 intermediates"):
        chunk_kda_gpu(*args, **kwargs)
    auto, xla = (kdax.chunk_kda(*args, **kwargs, backend=b) for b in ("auto", "xla"))
    np.testing.assert_array_equal(auto[0], xla[0])
    with jax.enable_x64(True):
        args64 = [a.astype(jnp.float64) for a in args]
        o, _ = kdax.chunk_kda(*args64, **dict(kwargs, chunk_size=64))
        o_ref, _ = kdax.chunk_kda(*args64, **dict(kwargs, chunk_size=64), backend="naive")
        assert o.dtype == jnp.float64 and float(jnp.max(jnp.abs(o - o_ref))) < F64["out"]


# Shared memory (KiB) of one block of each kernel as the CUDA compiler built it for an H100
# (scripts/gpu_compile_report.py --T 2C --K K --V K --chunk-size C --dtype D, triton 3.9, the default blocks; float32 at
# C = 128, which the kernels refuse, with block_k 16): (dtype, C, K) -> {kernel: (stages, KiB)}.
_SMEM = {
    ("bf16", 32, 64): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 14),
        "output": (2, 6),
        "recompute": (1, 2),
        "dstate": (2, 16),
        "values": (1, 10),
        "keys": (1, 10),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 32, 128): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 26),
        "output": (2, 10),
        "recompute": (1, 2),
        "dstate": (2, 32),
        "values": (1, 10),
        "keys": (1, 10),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 32, 256): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 50),
        "output": (2, 20),
        "recompute": (1, 2),
        "dstate": (2, 64),
        "values": (1, 10),
        "keys": (1, 10),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 64, 64): {
        "diag": (1, 1),
        "intra": (1, 4),
        "state": (2, 32),
        "output": (2, 12),
        "recompute": (1, 6),
        "dstate": (2, 56),
        "values": (1, 30),
        "keys": (1, 24),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 64, 128): {
        "diag": (1, 1),
        "intra": (1, 4),
        "state": (2, 60),
        "output": (2, 24),
        "recompute": (1, 6),
        "dstate": (2, 92),
        "values": (1, 30),
        "keys": (1, 24),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 64, 256): {
        "diag": (1, 1),
        "intra": (1, 4),
        "state": (2, 116),
        "output": (2, 48),
        "recompute": (1, 6),
        "dstate": (2, 164),
        "values": (1, 30),
        "keys": (1, 24),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 128, 128): {
        "diag": (1, 1),
        "intra": (1, 5),
        "state": (2, 112),
        "output": (2, 40),
        "recompute": (1, 19),
        "dstate": (2, 208),
        "values": (1, 90),
        "keys": (1, 96),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 128, 64): {
        "diag": (1, 1),
        "intra": (1, 5),
        "state": (2, 64),
        "output": (2, 40),
        "recompute": (1, 19),
        "dstate": (2, 144),
        "values": (1, 90),
        "keys": (1, 96),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("bf16", 128, 256): {
        "diag": (1, 1),
        "intra": (1, 5),
        "state": (1, 80),
        "output": (2, 80),
        "recompute": (1, 19),
        "dstate": (1, 80),
        "values": (1, 90),
        "keys": (1, 96),
        "diag_grads": (1, 9),
        "levels": (1, 1),
    },
    ("f32", 64, 128): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 84),
        "output": (2, 32),
        "recompute": (1, 21),
        "dstate": (2, 132),
        "values": (1, 72),
        "keys": (1, 40),
        "diag_grads": (1, 33),
        "levels": (1, 2),
    },
    ("f32", 32, 64): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 26),
        "output": (2, 8),
        "recompute": (1, 7),
        "dstate": (2, 36),
        "values": (1, 20),
        "keys": (1, 12),
        "diag_grads": (1, 33),
        "levels": (1, 2),
    },
    ("f32", 32, 128): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 50),
        "output": (2, 16),
        "recompute": (1, 7),
        "dstate": (2, 68),
        "values": (1, 20),
        "keys": (1, 12),
        "diag_grads": (1, 33),
        "levels": (1, 2),
    },
    ("f32", 32, 256): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 98),
        "output": (2, 32),
        "recompute": (1, 7),
        "dstate": (2, 132),
        "values": (1, 20),
        "keys": (1, 12),
        "diag_grads": (1, 33),
        "levels": (1, 2),
    },
    ("f32", 64, 64): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (2, 44),
        "output": (2, 16),
        "recompute": (1, 21),
        "dstate": (2, 76),
        "values": (1, 72),
        "keys": (1, 40),
        "diag_grads": (1, 33),
        "levels": (1, 2),
    },
    ("f32", 64, 256): {
        "diag": (1, 1),
        "intra": (1, 3),
        "state": (1, 64),
        "output": (2, 64),
        "recompute": (1, 21),
        "dstate": (1, 64),
        "values": (1, 72),
        "keys": (1, 40),
        "diag_grads": (1, 33),
        "levels": (1, 2),
    },
    ("f32", 128, 128): {"dstate": (1, 64), "values": (1, 288)},
}


@pytest.mark.parametrize("key", list(_SMEM), ids=str)
def test_shared_memory_bounds_what_the_compiler_gave(key):
    dtype, C, K = key
    for kernel, (stages, kib) in _SMEM[key].items():
        bound = pallas_gpu.shared_memory(kernel, C, K, 32, 4 if dtype == "f32" else 2, stages) / 1024
        assert kib <= bound <= 1.6 * kib + 8, (kernel, kib, bound)  # an upper bound, not far above


def test_smaller_gpus_get_one_stage_or_xla(monkeypatch):
    """An sm_86 or sm_89 block may use 99 KiB of shared memory, an H100's 227: the state loops
    drop to one stage sooner, and what does not fit goes to xla ("auto") or raises."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(pallas_gpu, "VERIFIED_ON_GPU", True)
    assert pallas_gpu.chunk_fits(jnp.bfloat16, 128) is None  # here: an H100's limit
    monkeypatch.setattr(pallas_gpu.launch, "shared_memory_limit", lambda: (99 * 1024, "an RTX 4090"))
    why = pallas_gpu.chunk_fits(jnp.bfloat16, 128)
    assert why == "its values kernel needs about 116 KiB of shared memory a block, an RTX 4090 allows 99"
    assert pallas_gpu.chunk_fits(jnp.bfloat16, 64) is None and pallas_gpu.chunk_fits(jnp.float32, 64) is None
    backend, reason = kdax.explain_backend(jnp.bfloat16, 128)
    assert backend == "xla" and reason.endswith(why)
    # float32 tiles: 2 stages need 104 and 152 KiB
    cfg = pallas_gpu.launch.fit_launch(pallas_gpu.Config(block_v=16), 64, 128, 4)
    assert dict(cfg.launch) == {"state": (4, 1), "dstate": (4, 1)}
    case = CASE["chunk128"]
    args, kwargs = make_inputs(case, jnp.bfloat16)
    with pytest.raises(ValueError, match="chunk_size: pallas_gpu with bfloat16 intermediates at chunk_size=128"):
        kdax.chunk_kda(*args, **kwargs, backend="pallas_gpu", config=pallas_gpu.Config(interpret=True))


@pytest.mark.slow  # compiles every kernel for sm_90a with the triton package: about a minute a dtype
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compile_budget(dtype):
    """scripts/gpu_compile_report.py --check with the in-op options: every kernel compiles within
    the spill budget a thread (128 B with bf16 inputs, 512 B with float32) and --check passes."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    run = subprocess.run(
        [sys.executable, "scripts/gpu_compile_report.py", "--fla-options", "--check", "--dtype", dtype],
        cwd=root,
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        timeout=600,
    )
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    spill = {name.strip(): int(cells[3]) for name, *cells in rows}
    assert set(spill) == set(pallas_gpu.LAUNCH), run.stdout[-2000:] + run.stderr[-2000:]
    assert all(b <= {"bfloat16": 128, "float32": 512}[dtype] for b in spill.values()), spill
    assert run.returncode == 0, run.stdout[-2000:]
