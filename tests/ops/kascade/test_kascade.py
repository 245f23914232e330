"""Kascade ops against their float64 definitions: selections, outputs, decode, options, transforms."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.common import dispatch, tpu_costs
from kdax.ops.kascade import api, pallas_gpu, pallas_tpu, reference, xla
from tests.tolerances import F64


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    T: int = 100  # not a multiple of any tile size
    H: int = 4
    G: int = 2
    D: int = 16
    tile_size: int = 16
    topk_percent: float = 20
    min_k: int = 4
    lengths: tuple[int, ...] | None = None
    block_bytes: int = 1  # one tile per block: every block boundary is met
    pool_size: int = 1

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("gqa"),
    Case("mha_one_block", G=4, block_bytes=1 << 30),
    Case("one_kv_head_D60", G=1, D=60, tile_size=32),
    Case("D100_tile64", T=200, D=100, tile_size=64, topk_percent=12.5, min_k=0),
    Case("lengths_0_1_37_100", B=4, lengths=(0, 1, 37, 100)),
    Case("min_k_over_T", min_k=1000),  # every key before a tile: sparse == dense
    Case("T_under_tile", T=10, tile_size=32),  # one tile, nothing to select (k_max = 0)
    Case("tile128", T=300, tile_size=128, G=1, H=2, topk_percent=10, min_k=8),
]


TOKENS = {"pool_size": 1}  # token selection, where a test is about it (the ops' default selects pools)
TILES32 = {"tile_size": 32, "pool_size": 1}  # tiles of 32 selecting tokens (T = 100: 4 tiles)


def inputs(case: Case, dtype=jnp.float64, seed=0):
    r = np.random.default_rng(seed)
    B, T, H, G, D = case.B, case.T, case.H, case.G, case.D
    q = r.standard_normal((B, T, H, D)) * 1.5  # peaked attention: selections matter
    k, v = r.standard_normal((B, T, G, D)), r.standard_normal((B, T, G, D))
    lengths = None if case.lengths is None else jnp.asarray(case.lengths, jnp.int32)
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), lengths)


def options(case: Case):
    return {
        "topk_percent": case.topk_percent,
        "min_k": case.min_k,
        "tile_size": case.tile_size,
        "pool_size": case.pool_size,
    }


# Block selection: pools of P keys, P above and below the tile, T and the rows' lengths off the pools.
POOL_CASES = [
    Case("pools16_tile32", T=150, tile_size=32, pool_size=16, topk_percent=25, min_k=16),
    Case("pools64_tile16_lengths", B=3, T=200, pool_size=64, topk_percent=40, min_k=0, lengths=(200, 1, 130)),
    Case("pools32_tile32_gqa_D60", T=300, H=6, G=3, D=60, tile_size=32, pool_size=32, topk_percent=20, min_k=32),
]


@pytest.mark.parametrize(
    ("case", "dense_output"),
    [(c, False) for c in CASES + POOL_CASES] + [(CASES[0], True), (CASES[4], True), (POOL_CASES[1], True)],
    ids=str,
)
def test_anchor_matches_definition_in_float64(case, dense_output):
    q, k, v, lengths = inputs(case)
    want_idx, want = reference.naive_kascade_anchor(
        q, k, v, **options(case), dense_output=dense_output, lengths=lengths
    )
    idx, o = kdax.kascade_anchor(
        q, k, v, **options(case), dense_output=dense_output, lengths=lengths, config=xla.Config(case.block_bytes)
    )
    assert idx.dtype == jnp.int32 and idx.shape == want_idx.shape
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(o, want, atol=F64["same"])
    if case.lengths is not None:
        past = np.arange(case.T)[None, :] >= np.asarray(case.lengths)[:, None]
        assert not np.asarray(o)[past].any()


@pytest.mark.parametrize("case", CASES[:5] + POOL_CASES, ids=str)
def test_reuse_matches_definition_with_a_head_map(case):
    q, k, v, lengths = inputs(case)
    anchor_idx, _ = reference.naive_kascade_anchor(*inputs(case, seed=1)[:3], **options(case), lengths=lengths)
    head_map = np.arange(case.G)[::-1].copy()
    tiles = {"tile_size": case.tile_size, "pool_size": case.pool_size}
    want = reference.naive_kascade_reuse(q, k, v, anchor_idx, head_map=head_map, lengths=lengths, **tiles)
    o = kdax.kascade_reuse(
        q, k, v, anchor_idx, head_map=list(head_map), lengths=lengths, config=xla.Config(case.block_bytes), **tiles
    )
    np.testing.assert_allclose(o, want, atol=F64["same"])


def test_selection_is_the_definition():
    """Brute force on one tile: the selected keys are the k_t largest pooled probabilities."""
    case = Case("one", B=1, T=64, H=2, G=1, tile_size=16, topk_percent=25, min_k=0)
    q, k, v, _ = inputs(case)
    idx, _ = kdax.kascade_anchor(q, k, v, **options(case))
    s = np.einsum("thd,sd->hts", np.asarray(q[0]), np.asarray(k[0, :, 0])) / 4.0
    s = np.where(np.arange(64)[None, None, :] <= np.arange(64)[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).sum(0)  # [T, S] pooled over the heads
    for t, start in enumerate(range(0, 64, 16)):
        budget = min(start, start * 25 // 100)
        pooled = p[start : start + 16, :start].sum(0)
        want = np.sort(np.argsort(-pooled, kind="stable")[:budget])
        got = np.asarray(idx[0, 0, t])
        np.testing.assert_array_equal(got[:budget], want)
        assert (got[budget:] == -1).all()


def test_pool_selection_and_output_are_the_definition():
    """Brute force in NumPy: pools of 32 keys under tiles of 16. Tile t keeps the
    min(b_t / 32, budget(s_t) // 32) pools of largest summed pooled probability among the whole
    pools before its pool boundary b_t = floor(s_t / 32) 32, and each query attends them and the
    keys from b_t to itself."""
    case = Case("pools", B=1, T=200, H=2, G=1, tile_size=16, topk_percent=30, min_k=0, pool_size=32)
    q, k, v, _ = inputs(case)
    idx, o = kdax.kascade_anchor(q, k, v, **options(case))
    T, P = case.T, 32
    s = np.einsum("thd,sd->hts", np.asarray(q[0]), np.asarray(k[0, :, 0])) / 4.0
    s = np.where(np.arange(T)[None, None, :] <= np.arange(T)[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).sum(0)  # [T, S] pooled over the heads
    allowed = np.zeros((T, T), bool)
    for t, start in enumerate(range(0, T, 16)):
        b = start // P * P
        n = min(b // P, (start * 30 // 100) // P)
        pooled = p[start : start + 16, :b].sum(0).reshape(-1, P).sum(-1)
        pools = np.sort(np.argsort(-pooled, kind="stable")[:n])
        want = (pools[:, None] * P + np.arange(P)).ravel()
        got = np.asarray(idx[0, 0, t])
        np.testing.assert_array_equal(got[: n * P], want)
        assert (got[n * P :] == -1).all()
        for i in range(start, min(start + 16, T)):
            allowed[i, want] = True
            allowed[i, b : i + 1] = True
    scores = np.einsum("thd,sd->hts", np.asarray(q[0]), np.asarray(k[0, :, 0])) / 4.0
    scores = np.where(allowed[None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    want_o = np.einsum("hts,sd->thd", w / w.sum(-1, keepdims=True), np.asarray(v[0, :, 0]))
    np.testing.assert_allclose(o[0], want_o, atol=F64["same"])


@pytest.mark.parametrize("pool_size", [16, 64])
@pytest.mark.parametrize("lengths", [(100, 1, 37), (0, 64, 100)], ids=["long_short", "empty_row"])
def test_pooled_decode_matches_definition(pool_size, lengths):
    """Decode with pools: whole pools of the row selected (the budget in whole pools), its last,
    partial pool always attended; reuse with a head map."""
    case = Case("decode", B=3)
    q, k, v, _ = inputs(case)
    lengths = jnp.asarray(lengths, jnp.int32)
    qt, opts = q[:, 7], {"topk_percent": 40, "min_k": 4, "pool_size": pool_size}
    want_idx, want = reference.naive_kascade_anchor_decode(qt, k, v, lengths, **opts)
    idx, o = kdax.kascade_anchor_decode(qt, k, v, lengths, **opts)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(o, want, atol=F64["same"])
    n = np.minimum(np.asarray(lengths) // pool_size, np.maximum(4, np.asarray(lengths) * 4 // 10) // pool_size)
    np.testing.assert_array_equal((np.asarray(idx) >= 0).sum(-1)[:, 0], n * pool_size)
    head_map = jnp.asarray([1, 0])
    want = reference.naive_kascade_reuse_decode(qt, k, v, lengths, want_idx, head_map=head_map, pool_size=pool_size)
    got = kdax.kascade_reuse_decode(qt, k, v, lengths, idx, head_map=head_map, pool_size=pool_size)
    np.testing.assert_allclose(got, want, atol=F64["same"])


@pytest.mark.parametrize("backend", ["xla", "naive"])
def test_heads_first_caches_decode_as_the_default_layout(backend):
    """cache_layout="BGLD" ([B, G, L, D], as TPU paged attention keeps its pages) gives what the
    default [B, L, G, D] layout gives, token and pool selections alike."""
    case = Case("decode", B=3, G=2)
    q, k, v, _ = inputs(case)
    lengths = jnp.asarray([100, 1, 37], jnp.int32)
    heads = {"cache_layout": "BGLD", "backend": backend}
    for opts in ({"topk_percent": 20, "min_k": 4, **TOKENS}, {"topk_percent": 50, "min_k": 4, "pool_size": 16}):
        idx, o = kdax.kascade_anchor_decode(q[:, 3], k, v, lengths, **opts)
        got_idx, got = kdax.kascade_anchor_decode(q[:, 3], k.swapaxes(1, 2), v.swapaxes(1, 2), lengths, **opts, **heads)
        np.testing.assert_array_equal(got_idx, idx)
        np.testing.assert_allclose(got, o, atol=F64["same"])
        reuse = {"pool_size": opts["pool_size"], "head_map": [1, 0]}
        want = kdax.kascade_reuse_decode(q[:, 3], k, v, lengths, idx, **reuse)
        got = kdax.kascade_reuse_decode(q[:, 3], k.swapaxes(1, 2), v.swapaxes(1, 2), lengths, idx, **reuse, **heads)
        np.testing.assert_allclose(got, want, atol=F64["same"])


def test_full_budget_is_dense_attention_and_reuse_of_own_selection_is_the_anchor():
    case = Case("full", min_k=10_000)
    q, k, v, _ = inputs(case)
    idx, o = kdax.kascade_anchor(q, k, v, **options(case))
    np.testing.assert_allclose(o, reference.naive_attention(q, k, v), atol=F64["same"])
    case = Case("sparse")
    idx, o = kdax.kascade_anchor(q, k, v, **options(case))
    reused = kdax.kascade_reuse(q, k, v, idx, tile_size=case.tile_size, pool_size=case.pool_size)
    np.testing.assert_allclose(reused, o, atol=F64["same"])
    assert np.abs(np.asarray(o - reference.naive_attention(q, k, v))).max() > 1e-3  # it is sparse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_within_bars(dtype):
    """Low-precision inputs, float32 softmax and accumulation: the reuse output (the selection held
    fixed) within bars of float64; the anchor's selection keeps what the float64 one keeps, up to
    near-ties (its pooled mass within rounding)."""
    case = Case("prec", T=130, lengths=(130, 77))
    q, k, v, lengths = inputs(case)
    idx64, _ = reference.naive_kascade_anchor(q, k, v, **options(case), lengths=lengths)
    want = reference.naive_kascade_reuse(q, k, v, idx64, tile_size=case.tile_size, pool_size=1, lengths=lengths)
    low = [x.astype(dtype) for x in (q, k, v)]
    o = kdax.kascade_reuse(*low, idx64, tile_size=case.tile_size, pool_size=1, lengths=lengths)
    assert o.dtype == dtype
    assert rel_rms(o, want) < (1e-5 if dtype == jnp.float32 else 1e-2)
    idx, _ = kdax.kascade_anchor(*low, **options(case), lengths=lengths)
    P = reference.pooled_probabilities(
        *[x.astype(jnp.float64) for x in low[:2]], tile_size=case.tile_size, lengths=lengths
    )

    def mass(sel):
        return np.take_along_axis(np.asarray(P), np.maximum(np.asarray(sel), 0), -1).sum(-1, where=np.asarray(sel) >= 0)

    np.testing.assert_array_equal(np.asarray(idx) >= 0, np.asarray(idx64) >= 0)  # the same budgets
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    assert (mass(idx) >= mass(idx64) - tol * np.maximum(mass(idx64), 1)).all()


@pytest.mark.parametrize("lengths", [(100, 1, 37), (0, 64, 100)], ids=["long_short", "empty_row"])
@pytest.mark.parametrize("dense_output", [False, True])
def test_decode_matches_definition(lengths, dense_output):
    case = Case("decode", B=3)
    q, k, v, _ = inputs(case)
    lengths = jnp.asarray(lengths, jnp.int32)
    qt = q[:, 7]
    want_idx, want = reference.naive_kascade_anchor_decode(
        qt, k, v, lengths, topk_percent=20, min_k=4, dense_output=dense_output, **TOKENS
    )
    idx, o = kdax.kascade_anchor_decode(
        qt, k, v, lengths, **TOKENS, topk_percent=20, min_k=4, dense_output=dense_output
    )
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(o, want, atol=F64["same"])
    assert idx.shape == (3, 2, 20)
    np.testing.assert_array_equal((idx >= 0).sum(-1)[:, 0], np.minimum(lengths, np.maximum(4, lengths // 5)))
    if lengths[0] == 0:
        assert not np.asarray(o[0]).any()
    head_map = jnp.asarray([1, 0])
    want = reference.naive_kascade_reuse_decode(qt, k, v, lengths, want_idx, head_map=head_map, **TOKENS)
    np.testing.assert_allclose(
        kdax.kascade_reuse_decode(qt, k, v, lengths, idx, head_map=head_map, **TOKENS), want, atol=F64["same"]
    )


def test_decode_with_the_whole_cache_selected_is_dense():
    case = Case("decode")
    q, k, v, _ = inputs(case)
    lengths = jnp.asarray([100, 40], jnp.int32)
    _, dense = kdax.kascade_anchor_decode(q[:, 3], k, v, lengths, dense_output=True, **TOKENS)
    _, sparse = kdax.kascade_anchor_decode(q[:, 3], k, v, lengths, topk_percent=100, min_k=0, **TOKENS)
    np.testing.assert_allclose(sparse, dense, atol=F64["same"])


def test_jit_vmap_and_grad():
    case = Case("transforms", T=40)
    q, k, v, _ = inputs(case)
    idx, o = kdax.kascade_anchor(q, k, v, **options(case))
    jitted = jax.jit(lambda q, k, v: kdax.kascade_anchor(q, k, v, **options(case)))(q, k, v)
    np.testing.assert_array_equal(jitted[0], idx)
    mapped = jax.vmap(lambda q, k, v: kdax.kascade_anchor(q[None], k[None], v[None], **options(case))[1][0])(q, k, v)
    np.testing.assert_allclose(mapped, o, atol=F64["same"])

    def loss(backend):
        reuse = functools.partial(kdax.kascade_reuse, tile_size=16, pool_size=1, backend=backend)
        return lambda q, k, v: jnp.sum(jnp.sin(reuse(q, k, v, idx)))

    grads = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)  # differentiable with the selection held fixed
    want = jax.grad(loss("naive"), argnums=(0, 1, 2))(q, k, v)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref, atol=10 * F64["same"])


def test_ops_compile_once_per_shape_and_option():
    case = Case("compile", T=40)
    q, k, v, _ = inputs(case, jnp.float32)
    api._compiled.clear_cache()
    kdax.kascade_anchor(q, k, v, **options(case))
    kdax.kascade_anchor(q, k, v, **options(case))
    assert api._compiled._cache_size() == 1
    kdax.kascade_anchor(q, k, v, **options(case), dense_output=True)
    assert api._compiled._cache_size() == 2


def test_anchor_memory_is_one_block_of_scores():
    """At T = 4096 the [T, T] float32 scores of one head are 64 MiB; the anchor's temporaries stay
    near its block budget (plus O(T (H D + G k_max)) for inputs, indices and gathered rows)."""
    B, T, H, G, D = 1, 4096, 4, 2, 32
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, G, D), jnp.float32)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    o = api.Options("xla", xla.Config(block_bytes=4 << 20), 0.2, tile_size=32, tenths=100, min_k=128)
    anchor = api._compiled.lower("anchor", o, q, kv, kv, lengths).compile()
    temp = anchor.memory_analysis().temp_size_in_bytes
    assert temp < 32 << 20, temp / 2**20  # dense scores of all heads: 256 MiB


def test_lengths_may_be_a_list():
    q, k, v, _ = inputs(Case("list"))
    idx, o = kdax.kascade_anchor(q, k, v, lengths=[60, 100])
    idx_a, o_a = kdax.kascade_anchor(q, k, v, lengths=jnp.asarray([60, 100]))
    np.testing.assert_array_equal(idx, idx_a)
    np.testing.assert_array_equal(o, o_a)


def test_traced_lengths_are_clipped_to_the_tokens():
    q, k, v, _ = inputs(Case("traced"))  # T = 100
    f = jax.jit(lambda n: kdax.kascade_anchor(q, k, v, lengths=n))
    idx, o = f(jnp.asarray([-4, 130]))
    idx_c, o_c = kdax.kascade_anchor(q, k, v, lengths=[0, 100])
    np.testing.assert_array_equal(idx, idx_c)
    np.testing.assert_allclose(o, o_c, rtol=F64["same"], atol=F64["same"] / 100)  # float64, compiled apart
    n = jnp.asarray([1, 500])
    qd = q[:, 0]
    decoded = jax.jit(kdax.kascade_anchor_decode)(qd, k, v, n)[1]
    np.testing.assert_allclose(
        decoded, kdax.kascade_anchor_decode(qd, k, v, [1, 100])[1], rtol=F64["same"], atol=F64["same"] / 100
    )


def test_debug_checks_raise_on_traced_lengths_out_of_range():
    from jax.experimental import checkify

    q, k, v, _ = inputs(Case("traced"))  # T = 100
    with kdax.debug_checks():
        f = checkify.checkify(jax.jit(lambda n: kdax.kascade_anchor(q, k, v, lengths=n)[1]))
        err, _ = f(jnp.asarray([3, 130]))
        assert "lengths: expected ints in [0, 100], got [  3 130]" in err.get()
        err, o = f(jnp.asarray([3, 100]))
        assert err.get() is None
        np.testing.assert_allclose(
            o, kdax.kascade_anchor(q, k, v, lengths=[3, 100])[1], rtol=F64["same"], atol=F64["same"] / 100
        )
        reuse = lambda n: kdax.kascade_reuse_decode(q[:, 0], k, v, n, jnp.zeros((2, 2, 4), int), **TOKENS)
        g = checkify.checkify(jax.jit(reuse))
        assert "lengths: expected ints in [0, 100]" in g(jnp.asarray([-1, 5]))[0].get()


def _f32(*xs):  # the kernels' configs are checked for inputs the kernels take (x64 is on in tests)
    return [x.astype(jnp.float32) for x in xs]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda q, k, v: kdax.kascade_anchor(q, k, v[:, :, :1]), "v: expected shape"),
        (
            lambda q, k, v: kdax.kascade_anchor(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)),
            "k: expected a number of KV heads",
        ),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v.astype(jnp.float32)), "k, v: expected the dtype of q"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, topk_percent=0), "topk_percent"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, topk_percent=10.25), "topk_percent"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, min_k=-1), "min_k"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, tile_size=24), "tile_size"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, pool_size=8), "pool_size: expected one of"),
        (
            lambda q, k, v: kdax.kascade_reuse(
                q, k, v, jnp.zeros((2, 2, 4, 16), jnp.int32), tile_size=32, pool_size=16
            ),
            "indices: expected whole pools of 16 keys",
        ),
        (
            lambda q, k, v: kdax.kascade_reuse(q, k, v, jnp.full((2, 2, 4, 24), -1), tile_size=32, pool_size=16),
            "indices: expected shape",
        ),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, dense_output=1), "dense_output"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, lengths=jnp.asarray([3, 101])), "lengths: expected values"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, lengths=jnp.asarray([3.0, 1.0])), "lengths: expected an integer"),
        (lambda q, k, v: kdax.kascade_anchor(q[:0], k[:0], v[:0]), "q: expected at least one row"),
        (lambda q, k, v: kdax.kascade_anchor(q[:, :, :0], k, v), "q: expected at least one head"),
        (lambda q, k, v: kdax.kascade_anchor_decode(q[:, 0, :0], k, v, [1, 1]), "q: expected at least one head"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, lengths=[3, 101]), "lengths: expected values in \\[0, 100\\]"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, backend="cuda"), "backend"),
        (lambda q, k, v: kdax.kascade_anchor(q, k, v, config=object()), "config"),
        (
            lambda q, k, v: kdax.kascade_anchor(
                *_f32(q, k, v), backend="pallas_tpu", config=pallas_tpu.Config(block_dense=100)
            ),
            "config.block_dense: expected a multiple of 8",
        ),
        (
            lambda q, k, v: kdax.kascade_anchor(
                *_f32(q, k, v), backend="pallas_tpu", config=pallas_tpu.Config(block_k=12)
            ),
            "config.block_k: expected None or a multiple of 8",
        ),
        (
            lambda q, k, v: kdax.kascade_reuse(
                *_f32(q, k, v),
                jnp.zeros((2, 2, 4, 4), jnp.int32),
                **TILES32,
                backend="pallas_tpu",
                config=pallas_tpu.Config(resident_bytes=-1),
            ),
            "config.resident_bytes: expected an int >= 0",
        ),
        (
            lambda q, k, v: kdax.kascade_reuse(q, k, v, jnp.zeros((2, 2, 3, 4), jnp.int32), **TILES32),
            "indices: expected shape",
        ),
        (
            lambda q, k, v: kdax.kascade_reuse(q, k, v, jnp.full((2, 2, 4, 4), 100), **TILES32),
            "indices: expected values",
        ),
        (
            lambda q, k, v: kdax.kascade_reuse(q, k, v, jnp.zeros((2, 2, 4, 4), jnp.int32), head_map=[0, 2], **TILES32),
            "head_map",
        ),
        (lambda q, k, v: kdax.kascade_anchor_decode(q, k, v, jnp.asarray([1, 1])), "q: expected a 3-d"),
        (
            lambda q, k, v: kdax.kascade_anchor_decode(q[:, 0], k, v, [1, 1], cache_layout="LBGD"),
            "cache_layout: expected one of",
        ),
        (lambda q, k, v: kdax.kascade_anchor_decode(q[:, 0], k, v, jnp.asarray([1])), "lengths: expected shape"),
        (
            lambda q, k, v: kdax.kascade_reuse_decode(
                q[:, 0], k, v, jnp.asarray([1, 1]), jnp.zeros((2, 1, 3), jnp.int32), **TOKENS
            ),
            "indices: expected shape",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_arguments_raise_value_errors_naming_them(call, match):
    q, k, v, _ = inputs(Case("bad"))  # T = 100, tile 32 (the default): 4 tiles
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


def test_references_check_their_inputs_as_the_ops_do():
    q, k, v, _ = inputs(Case("bad"))
    with pytest.raises(ValueError, match="k, v: expected the dtype of q"):
        reference.naive_kascade_anchor(q, k, v.astype(jnp.float32))
    with pytest.raises(ValueError, match="tile_size"):
        reference.naive_kascade_reuse(q, k, v, jnp.zeros((2, 2, 4, 4), jnp.int32), tile_size=20)


def test_auto_picks_the_devices_kernels_and_names_kascade_ops():
    assert kdax.explain_backend(op="kascade_anchor") == ("xla", "no kernels for this device (cpu)")
    with kdax.use_backend("pallas_gpu"):
        assert kdax.explain_backend(op="kascade_reuse_decode") == ("pallas_gpu", "kdax.use_backend('pallas_gpu')")
    with dispatch.building_for("tpu"):  # the kernels where they compiled and cost less than xla
        expected = "xla" if tpu_costs.refuse("kascade_anchor_decode", jnp.float32, layout="BLGD") else "pallas_tpu"
        assert kdax.explain_backend(op="kascade_anchor_decode")[0] == expected
        assert kdax.explain_backend(jnp.float64, op="kascade_anchor")[0] == "xla"
    with dispatch.building_for("tpu"), kdax.use_backend("pallas_tpu"):
        assert kdax.explain_backend(op="kascade_anchor_decode") == ("pallas_tpu", "kdax.use_backend('pallas_tpu')")
    with dispatch.building_for("gpu"):  # not yet verified on a GPU: asked for, not chosen
        assert kdax.explain_backend(op="kascade_reuse")[0] == ("pallas_gpu" if pallas_gpu.VERIFIED_ON_GPU else "xla")
    with pytest.raises(ValueError, match="q: expected float32 or bfloat16 inputs with backend='pallas_tpu'"):
        kdax.kascade_reuse(
            *inputs(Case("x"))[:3], jnp.zeros((2, 2, 7, 4), jnp.int32), tile_size=16, pool_size=1, backend="pallas_tpu"
        )


def test_a_planted_key_is_kept_by_kascade_and_lost_by_a_window():
    """Long-range retrieval: key 40 of 512 matches the last tile's queries in two layers. Anchor
    and reuse layers at 10% attend it and return its value; a sliding window of the same budget
    cannot see it."""
    r = np.random.default_rng(0)
    T, D, p, tile = 512, 32, 40, 32
    u = r.standard_normal(D)
    u /= np.linalg.norm(u)

    def layer():
        q, k, v = (r.standard_normal((1, T, n, D)) * 0.3 for n in (2, 1, 1))
        k[0, p, 0] = 8 * u
        q[0, -tile:] += 8 * u  # the last tile asks for the planted key
        v[0, p, 0] = 5 * np.eye(D)[0]
        return [jnp.asarray(x, jnp.float32) for x in (q, k, v)]

    first, second = layer(), layer()
    idx, o_anchor = kdax.kascade_anchor(*first, topk_percent=10, min_k=0, tile_size=tile, **TOKENS)
    assert p in np.asarray(idx[0, 0, -1])
    o_reuse = kdax.kascade_reuse(*second, idx, tile_size=tile, **TOKENS)
    k_last = int((np.asarray(idx[0, 0, -1]) >= 0).sum())
    window = np.full(idx.shape, -1, np.int32)
    window[0, 0, -1, :k_last] = np.arange(T - tile - k_last, T - tile)
    o_window = kdax.kascade_reuse(*second, jnp.asarray(window), tile_size=tile, **TOKENS)

    def retrieved(o):  # the planted value's share in the last tile's outputs
        return float(np.mean(np.asarray(o)[0, -tile:, :, 0])) / 5

    assert retrieved(reference.naive_attention(*second)) > 0.9  # dense attention finds it
    assert retrieved(o_anchor) > 0.9 and retrieved(o_reuse) > 0.9
    assert retrieved(o_window) < 0.1


@pytest.mark.parametrize("draws", [15, pytest.param(50, marks=pytest.mark.slow)])
def test_threshold_selection_equals_the_sorting_one(draws):
    """The pools' selection without a sort (bisection on the scores' bits, ties toward the smaller
    index) picks what a sort picks: rows of ties, -inf entries, budgets from 0 to the width (each
    draw a new width and budget, so a compile each: 15 draws in CI, 50 by hand)."""
    r = np.random.default_rng(0)
    both = jax.jit(lambda x, keep, k: (xla.threshold_top(x, k, keep), xla.top(x, k, keep)), static_argnums=2)
    for _ in range(draws):
        n = int(r.integers(1, 300))
        k = int(r.integers(0, n + 1))
        x = np.where(r.random((4, n)) < 0.5, r.integers(-3, 3, (4, n)), r.standard_normal((4, n))).astype(np.float32)
        x[r.random((4, n)) < 0.2] = -np.inf
        keep = jnp.asarray(r.integers(0, k + 1, (4,)))
        np.testing.assert_array_equal(*both(jnp.asarray(x), keep, k))


def test_compaction_of_nothing_fills_every_slot():
    """An empty selection (a decode budget below one pool) compacts to the fill value."""
    valid = jnp.zeros((2, 3, 0), bool)
    np.testing.assert_array_equal(xla.compact(jnp.zeros((2, 3, 0), jnp.int32), valid, 2, -1), -np.ones((2, 3, 2)))
