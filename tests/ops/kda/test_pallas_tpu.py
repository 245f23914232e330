"""Pallas TPU kernels, in the TPU interpreter on CPU, and their lowering for TPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.common import tpu_costs
from kdax.ops.common.arrays import LOG2E
from kdax.ops.kda import pallas_tpu, xla
from kdax.ops.kda.tiles import unpair
from tests.ops.kda.cases import CASE, Case, assert_close_to_reference, slow_if
from tests.tolerances import F32

PIPELINES = ["fused", "staged"]
# The fused pipeline runs every shared case through tests/ops/kda/test_chunk.py; here the
# staged one, the K = V = 256 case and what only these kernels have.
STAGED_CASES = [
    pytest.param(CASE[n], id=n, marks=slow_if(CASE[n], "pallas_tpu staged"))
    for n in ("T65_gva_h0", "K60_V100", "varlen", "strong_decay_varlen", "chunk16")
]

chunk_kda_tpu = functools.partial(kdax.chunk_kda, backend="pallas_tpu")


def test_chunk_intra_matches_xla():
    """The full-tile chunk math equals the xla backend's per-chunk stage (float64 there), on a
    stack of two heads (one grid step's tiles), a mild and a strong decay."""
    rng = np.random.default_rng(0)
    C, K, V = 64, 128, 96
    heads = []
    for g_min in (-1.0, -20.0):
        q, k = rng.standard_normal((2, C, K))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        heads.append((q, k, rng.standard_normal((C, V)), rng.uniform(g_min, g_min / 100, (C, K)), rng.uniform(0, 1, C)))
    q, k, v, g, beta = (np.stack(x) for x in zip(*heads))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    tiles = pallas_tpu.tiles_for(pallas_tpu.Config(precision="highest"))
    got = jax.jit(tiles.intra)(f32(q), f32(k), f32(v), f32(g * LOG2E), f32(beta[..., None]))
    got = got._replace(Aqk=unpair(got.Aqk))  # the two heads' [C, C] tiles side by side (Tiles.paired)
    for h in range(2):
        ref = xla._intra(*(jnp.asarray(x[h]) for x in (q, k, v, g, beta)))
        for name in ("Aqk", "w", "u", "q_g", "k_d"):
            assert rel_rms(getattr(got, name)[h], getattr(ref, name)) < 2e-6, (h, name)
        # decay is exp2 of a float32 sum of C gates: its relative error is the sum's absolute error,
        # within (C - 1) u sum |g| (u = 2^-24; the order of the sum is the CPU's dot), plus exp2's
        # rounding; below float32's range it flushes to 0
        bound = ((C - 1) * np.abs(g[h] * LOG2E).sum(0) + 4) * 2.0**-24 * np.log(2)
        assert np.all(np.abs(np.asarray(got.decay[h, 0], np.float64) - ref.decay) <= bound * ref.decay + 1e-30), h


@pytest.mark.parametrize("precision", ["highest", "bf16"])
def test_paired_heads_match_unpaired(precision):
    """Tiles.paired (two heads' [C, C] tiles side by side, each product's right factor a block
    diagonal) computes the same Aqk, Kkk, T, w and u as head by head: the same products of the same
    operands, in one matmul for both heads, so equal to float32 rounding."""
    rng = np.random.default_rng(1)
    n, C, K, V = 4, 64, 128, 128
    q, k = rng.standard_normal((2, n, C, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    args = [rng.standard_normal((n, C, V)), rng.uniform(-3.0, -0.01, (n, C, K)), rng.uniform(0, 1, (n, C, 1))]
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, *args)]
    tiles = pallas_tpu.tiles_for(pallas_tpu.Config(precision=precision))
    assert tiles.paired
    got = jax.jit(tiles.intra)(*args)
    want = jax.jit(dataclasses.replace(tiles, paired=False).intra)(*args)
    assert got.T.shape == (n // 2, C, 2 * C)
    for name in ("Aqk", "Kkk", "T", "w", "u"):
        x, y = getattr(got, name), getattr(want, name)
        x = unpair(x) if name in ("Aqk", "Kkk", "T") else x
        assert rel_rms(x, y) < 1e-6, name


def test_stacked_levels_backward_matches_per_product():
    """Tiles.grads_levels stacked (each level's dq and dk shares as one matmul of the masked
    [[dAqk, 0], [dKkk + dKkk^T, dAqk^T]] against [k e; q e]) gives the dq, dk and dg of the four
    separate products a level, to float32 rounding."""
    rng = np.random.default_rng(2)
    n, C, K = 2, 64, 128
    q, k = (jnp.asarray(x, jnp.float32) for x in rng.standard_normal((2, n, C, K)))
    g = jnp.asarray(rng.uniform(-3.0, -0.01, (n, C, K)), jnp.float32)
    lower = np.tril(np.ones((C, C)))
    dAqk = jnp.asarray(rng.standard_normal((n, C, C)) * lower, jnp.float32)
    dKkk = jnp.asarray(rng.standard_normal((n, C, C)) * np.tril(lower, -1), jnp.float32)
    tiles = pallas_tpu.tiles_for(pallas_tpu.Config(precision="highest"))
    assert tiles.stacked
    got = jax.jit(tiles.grads_levels)(q, k, g, dAqk, dKkk)
    want = jax.jit(dataclasses.replace(tiles, stacked=False).grads_levels)(q, k, g, dAqk, dKkk)
    for name, x, y in zip(("dq", "dk", "dg"), got, want):
        assert rel_rms(x, y) < 1e-5, name


@pytest.mark.parametrize("corr", [0.5, 0.9])
def test_bf16_inverse_newton_step(corr):
    """Precision "bf16" inverts I + beta Kkk by the doubling at one bfloat16 pass and one Newton
    step with its residual at BF16_HIGH: about 16 bits on an ill-conditioned matrix (L2-normalised
    keys near a common direction, beta 0.99: cond 34 and 79), where the doubling alone keeps 8 (5e-3)."""
    rng = np.random.default_rng(0)
    C = K = 64
    k = corr * rng.standard_normal(K) + (1 - corr) * rng.standard_normal((C, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    A = 0.99 * np.tril(k @ k.T, -1)
    exact = np.linalg.inv(np.eye(C) + A)
    tiles = pallas_tpu.tiles_for(pallas_tpu.Config(precision="bf16"))
    assert rel_rms(jax.jit(tiles.unit_lower_inverse)(jnp.asarray(A, jnp.float32)), exact) < 1e-4


@pytest.mark.parametrize(("H", "heads"), [(2, 1), (2, 2), (1, 2)])
def test_heads_per_step_with_grouped_value_heads(H, heads, monkeypatch):
    """Grid steps of one or two of four value heads, q and k shared by two or four of them (a q/k
    block of one head per step, or one head all the step's value heads share)."""
    assert pallas_tpu.heads_per_step(4, 4 // H, 64, 128, 128, pallas_tpu.Config(heads=heads), "forward") == heads
    case = Case("gva_heads", T=70, B=1, H=H, HV=4, initial_state=True, lengths=None)
    fn = functools.partial(kdax.chunk_kda, backend="pallas_tpu", config=pallas_tpu.Config(heads=heads))
    assert_close_to_reference(fn, case, jnp.float32)


def test_backward_takes_a_steps_heads_in_lockstep_groups(monkeypatch):
    """Eight value heads a step over two q/k heads; in float32 the backward takes them four at a time
    (two groups, each with its own slice of q and k, state cotangents and token-major columns)."""
    assert pallas_tpu.scaled(pallas_tpu.LOCKSTEP["highest"], 16, 128, 128) == 4
    case = Case("lockstep", T=40, B=1, H=2, HV=8, initial_state=True, lengths=None, chunk_size=16)
    fn = functools.partial(kdax.chunk_kda, backend="pallas_tpu", config=pallas_tpu.Config(heads=8))
    assert_close_to_reference(fn, case, jnp.float32)


def test_heads_per_step_fits_groups_and_state_size():
    bf16, f32 = pallas_tpu.Config(precision="bf16"), pallas_tpu.Config(precision="highest")
    heads = functools.partial(pallas_tpu.heads_per_step, cores=1)  # v5e, v6e, TPU7x: one core a device
    assert pallas_tpu.cores_per_device() == 2  # no TPU here: as if the grid were split between two
    # two cores a device: more than eight heads a step only where two parallel programs remain (B HV / n >= 2)
    assert pallas_tpu.heads_per_step(16, 1, 64, 128, 128, bf16, "forward") == 8
    assert pallas_tpu.heads_per_step(16, 1, 64, 128, 128, bf16, "forward", B=2) == 16
    assert pallas_tpu.heads_per_step(32, 1, 64, 128, 128, bf16, "forward") == 16
    assert pallas_tpu.heads_per_step(16, 1, 64, 128, 128, bf16, "backward") == 8
    assert heads(16, 1, 64, 128, 128, bf16, "forward") == heads(16, 1, 64, 128, 128, bf16, "backward") == 16
    assert heads(16, 1, 64, 128, 128, f32, "backward") == 8
    assert heads(32, 1, 64, 128, 128, bf16, "forward") == 32 and heads(32, 1, 64, 128, 128, bf16, "saving") == 16
    assert heads(16, 1, 64, 256, 256, bf16, "forward") == 8
    assert heads(16, 1, 128, 128, 128, bf16, "backward") == 8
    assert heads(16, 1, 128, 128, 128, f32, "backward") == 4
    assert heads(32, 1, 32, 128, 128, bf16, "backward") == 16  # at most HEADS
    assert pallas_tpu.vmem_limit() == pallas_tpu.VMEM_LIMIT  # no TPU here
    # with a 56 MiB limit (chips with 64 MiB of VMEM a core or more): 32 saving and backward, but
    # disable_recompute's forward and backward keep 16 (their kept fields take the room)
    roomy = functools.partial(heads, vmem=pallas_tpu.ROOMY_LIMIT)
    assert [roomy(32, 1, 64, 128, 128, bf16, kernel) for kernel in pallas_tpu.KERNELS] == [32, 32, 16, 32, 16]
    assert [heads(32, 1, 64, 128, 128, bf16, kernel) for kernel in pallas_tpu.KERNELS] == [32, 16, 16, 16, 16]
    assert roomy(32, 1, 64, 128, 128, f32, "backward") == 16 and roomy(32, 1, 64, 128, 128, f32, "saving") == 8
    assert heads(12, 3, 64, 128, 128, bf16, "forward") == 12  # 3 divides 12
    assert pallas_tpu.heads_per_step(12, 3, 64, 128, 128, bf16, "forward") == 6  # 3 divides 6
    asked = pallas_tpu.Config(heads=4)
    assert pallas_tpu.heads_per_step(6, 6, 64, 128, 128, asked, "forward") == 3  # 3 divides 6 (the group)
    inputs = (*(jnp.ones((1, 4, 1, 8), jnp.float32),) * 4, jnp.ones((1, 4, 1), jnp.float32))
    for config, field in ((pallas_tpu.Config(heads=0), "heads"), (pallas_tpu.Config(precision="tf32"), "precision")):
        with pytest.raises(ValueError, match=f"config.{field}"):
            kdax.chunk_kda(*inputs, backend="pallas_tpu", config=config)


@pytest.mark.parametrize("case", STAGED_CASES)
def test_staged_pipeline_fp32(case, monkeypatch):
    chunk_kda_tpu = functools.partial(kdax.chunk_kda, backend="pallas_tpu", config=pallas_tpu.Config(pipeline="staged"))
    assert_close_to_reference(chunk_kda_tpu, case, jnp.float32)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_head_dim_256(pipeline, monkeypatch):
    chunk_kda_tpu = functools.partial(kdax.chunk_kda, backend="pallas_tpu", config=pallas_tpu.Config(pipeline=pipeline))
    case = Case("K256_V256", T=70, B=1, H=1, HV=1, K=256, V=256, initial_state=True)
    assert_close_to_reference(chunk_kda_tpu, case, jnp.float32)


def test_state_carries_across_grid_steps_without_races(monkeypatch):
    """Six chunks of one sequence, two V blocks: the state (and in the backward its
    cotangent) lives in VMEM scratch across the sequential grid axis; the interpreter's
    race detector watches every access."""
    chunk_kda_tpu = functools.partial(
        kdax.chunk_kda, backend="pallas_tpu", config=pallas_tpu.Config(block_v=128, detect_races=True)
    )
    case = Case("six_chunks", T=6 * 16 - 5, B=1, H=1, HV=1, K=32, V=200, initial_state=True, chunk_size=16)
    errors = assert_close_to_reference(chunk_kda_tpu, case, jnp.float32)
    assert errors["final_state"] < F32["out"] and errors["dinitial_state"] < F32["grad"]
    assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found


def test_float64_inputs_are_rejected():
    x = jnp.zeros((1, 16, 1, 8), jnp.float64)
    with pytest.raises(ValueError, match="q: expected float32 or bfloat16 inputs"):
        chunk_kda_tpu(x, x, x, x, jnp.zeros((1, 16, 1), jnp.float64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_lowers_for_tpu(pipeline, dtype, dim, varlen, monkeypatch):
    """Forward alone, and forward (storing states) + backward: every kernel lowers to Mosaic."""
    _assert_lowers_for_tpu(pipeline, dtype, dim, varlen)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_kept_intermediates_and_chunk_states_lower_for_tpu(pipeline, monkeypatch):
    """The kernels that write the intra stage for the backward, read it there, and take the
    cotangent of the states entering the chunks."""
    _assert_lowers_for_tpu(pipeline, jnp.float32, 128, True, disable_recompute=True, return_intermediate_states=True)


def _assert_lowers_for_tpu(pipeline, dtype, dim, varlen, **options):
    chunk_kda_tpu = functools.partial(kdax.chunk_kda, config=pallas_tpu.Config(pipeline=pipeline))
    B, T, H, HV = (1, 130, 2, 4) if varlen else (2, 130, 2, 4)
    cu = jnp.asarray([0, 1, 100, 130], jnp.int32) if varlen else None
    shapes = [(B, T, H, dim), (B, T, H, dim), (B, T, HV, dim), (B, T, HV, dim), (B, T, HV)]
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    fwd = lambda *a: chunk_kda_tpu(*a, cu_seqlens=cu, output_final_state=True, **options)
    n_fwd = 1 if pipeline == "fused" else 3
    assert kdax.lower(fwd, *args, platform="tpu").as_text().count("tpu_custom_call") == n_fwd

    def loss(*a):  # squares: every output is used (no dead kernel)
        return sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in fwd(*a))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    text = kdax.lower(grad, *args, platform="tpu").as_text()
    assert text.count("tpu_custom_call") == n_fwd + 1
    names = ("fused",) if pipeline == "fused" else ("intra", "state", "output")
    assert all(f"kda_{name}" in text for name in (*names, "backward"))  # every pallas_call named


def test_auto_on_tpu_takes_the_tpu_kernels_only_where_they_pay(monkeypatch):
    """On a TPU "auto" runs the kernels where the compiled costs say they are cheaper than xla
    (tests/ops/common/test_tpu_costs.py); asked for, they run regardless."""
    ops = {"chunk": "chunk_kda", "recurrent": "fused_recurrent_kda"}
    pick = lambda dtype, op="chunk": kdax.explain_backend(dtype, 64, op=ops[op])[0]
    assert pick(jnp.float32) == "xla"  # this machine has no TPU
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    for dtype in (jnp.float32, jnp.bfloat16):
        for op in ops:
            assert pick(dtype, op) == ("xla" if tpu_costs.refuse(ops[op], dtype) else "pallas_tpu")
    assert pick(jnp.float64) == "xla"  # the kernels compute in float32 at most
    with kdax.use_backend("pallas_tpu"):
        assert pick(jnp.float32) == pick(jnp.bfloat16, "recurrent") == "pallas_tpu"
