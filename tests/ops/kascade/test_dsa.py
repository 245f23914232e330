"""DSA's ops (GLM-5.3's indexed attention): kdax.index_select and kdax.indexed_attention against
their float64 definitions, the selection's rules checked by hand, transforms and errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.kascade import pallas_tpu, reference, xla
from tests.tolerances import F64


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    T: int = 37  # not a multiple of the pools
    S: int | None = None  # keys (a cache) when not T
    offset: int = 0  # the first query's position
    Hi: int = 4
    d: int = 8
    kpool: int = 4
    topk: int = 8
    tail: bool = True
    lengths: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("pools4"),
    Case("tokens", kpool=1, topk=5),
    Case("pools16_d60", T=100, d=60, kpool=16, topk=32),
    Case("no_tail", tail=False),
    Case("lengths_0_1_37", B=3, lengths=(0, 1, 37)),
    Case("cache_of_64", T=5, S=64, offset=40, lengths=(45, 45)),  # a prefill's next part
    Case("decode", B=3, T=1, S=50, offset=30, lengths=(31, 31, 31), kpool=2, topk=6),
    Case("budget_over_pools", T=20, topk=40),  # every complete pool selected
]


def inputs(case: Case, dtype=jnp.float64, seed=0):
    r = np.random.default_rng(seed)
    B, T, S = case.B, case.T, case.S or case.T
    arrays = (
        r.standard_normal((B, T, case.Hi, case.d)),
        r.standard_normal((B, T, case.Hi)),
        r.standard_normal((B, S, case.d)),
        r.standard_normal((B, S, case.d)),
        r.standard_normal((case.kpool, case.d)),
    )
    positions = jnp.broadcast_to(case.offset + jnp.arange(T, dtype=jnp.int32), (B, T))
    lengths = None if case.lengths is None else jnp.asarray(case.lengths, jnp.int32)
    return (*(jnp.asarray(x, dtype) for x in arrays), positions, lengths)


def select(case, arrays, backend, **over):
    q, w, keys, gates, ape, positions, lengths = arrays
    options = {"topk": case.topk, "kpool": case.kpool, "tail": case.tail, "q_positions": positions, "lengths": lengths}
    return kdax.index_select(q, w, keys, gates, ape, backend=backend, **options | over)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_xla_selection_is_the_definition(case):
    """Exactly the float64 reference's keys, over blocks of queries of every size down to one."""
    arrays = inputs(case)
    want = select(case, arrays, "naive")
    W = case.topk + (case.kpool - 1 if case.tail else 0)
    assert want.shape == (case.B, case.T, W) and want.dtype == jnp.int32
    for block_bytes in (1, 1 << 30):
        got = select(case, arrays, "xla", config=xla.Config(block_bytes=block_bytes))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", ["naive", "xla"])
def test_queries_of_a_flat_batch_read_their_rows_of_keys(backend):
    """key_rows: a serving step's tokens in one row, each scoring the pools of its request's keys,
    select what each request's queries select alone."""
    case = Case("rows", B=3, T=12, S=40, offset=0, lengths=(40, 9, 25))
    q, w, keys, gates, ape, _, lengths = inputs(case)
    # request r's tokens: the last few positions of its keys (a decode token, a chunk, a verify step)
    take = [(0, 39, 1), (1, 5, 4), (2, 18, 7)]  # (request, first position, tokens)
    rows = jnp.concatenate([jnp.full((n,), r, jnp.int32) for r, _, n in take])[None]
    pos = jnp.concatenate([jnp.arange(p, p + n, dtype=jnp.int32) for _, p, n in take])[None]
    flat_q = jnp.concatenate([q[r, :n] for r, _, n in take])[None]
    flat_w = jnp.concatenate([w[r, :n] for r, _, n in take])[None]
    options = {"topk": 8, "kpool": 4, "lengths": lengths, "backend": backend}
    got = kdax.index_select(flat_q, flat_w, keys, gates, ape, q_positions=pos, key_rows=rows, **options)
    at = 0
    for r, p, n in take:
        alone = kdax.index_select(
            q[r : r + 1, :n],
            w[r : r + 1, :n],
            keys[r : r + 1],
            gates[r : r + 1],
            ape,
            q_positions=jnp.arange(p, p + n, dtype=jnp.int32)[None],
            **options | {"lengths": lengths[r : r + 1]},
        )
        np.testing.assert_array_equal(got[0, at : at + n], alone[0])
        at += n
    with pytest.raises(ValueError, match="key_rows"):
        kdax.index_select(flat_q, flat_w, keys, gates, ape, key_rows=rows + 3, topk=8, kpool=4)


def _as_sets(indices):
    return [[{int(i) for i in row if i >= 0} for row in b] for b in np.asarray(indices)]


def test_selection_rules_by_hand():
    """Small budgets: a query at position q picks the topk / kpool best complete pools ending at or
    before q (checked against scores computed here), plus keys q + 1 - (q + 1) % kpool .. q; with
    a budget over every pool the keys are the causal prefix; ties (all scores 0) go to the smaller
    pools; queries past their row's length select nothing."""
    case = Case("hand", B=1, T=23, kpool=4, topk=8, lengths=(21,))
    q, w, keys, gates, ape, positions, lengths = arrays = inputs(case)
    got = _as_sets(select(case, arrays, "naive"))[0]
    pooled = reference.pooled_index_keys(keys, gates, ape, 4)[0]  # [5, d]
    s = jnp.einsum("thd,pd->thp", q[0], pooled) * case.d**-0.5
    scores = np.asarray(jnp.einsum("th,thp->tp", w[0], jnp.maximum(s, 0)))
    for t in range(23):
        if t >= 21:
            assert got[t] == set()
            continue
        complete = [p for p in range(5) if 4 * p + 3 <= t and 4 * p + 4 <= 21]
        best = sorted(complete, key=lambda p: -scores[t, p])[:2]
        want = {4 * p + j for p in best for j in range(4)} | set(range(t + 1 - (t + 1) % 4, t + 1))
        assert got[t] == want, t
    everything = _as_sets(select(case, arrays, "naive", topk=24))[0]
    assert all(everything[t] == set(range(t + 1)) for t in range(21))
    ties = _as_sets(select(case, (q, jnp.zeros_like(w), keys, gates, ape, positions, lengths), "naive"))[0]
    assert ties[22 - 2] == set(range(8)) | {20}  # pools 0 and 1 of the 5 complete ones, then the tail


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[5]], ids=str)
def test_indexed_attention_is_the_definition_with_gradients(case):
    """xla against the float64 reference (GQA, Dv != D, lengths, queries with no key), values and
    gradients in q, k and v."""
    arrays = inputs(case)
    indices = select(case, arrays, "naive")
    B, T, S = case.B, case.T, case.S or case.T
    r = np.random.default_rng(1)
    q = jnp.asarray(r.standard_normal((B, T, 6, 12)))
    k, v = jnp.asarray(r.standard_normal((B, S, 2, 12))), jnp.asarray(r.standard_normal((B, S, 2, 5)))
    lengths = arrays[-1]
    run = lambda backend, cfg=None: (
        lambda q, k, v: kdax.indexed_attention(q, k, v, indices, lengths=lengths, backend=backend, config=cfg)
    )
    want = run("naive")(q, k, v)
    assert want.shape == (B, T, 6, 5)
    for cfg in (xla.Config(block_bytes=1), None):
        assert rel_rms(run("xla", cfg)(q, k, v), want) <= F64["out"]
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for g, h in zip(jax.grad(loss(run("xla")), (0, 1, 2))(q, k, v), jax.grad(loss(run("naive")), (0, 1, 2))(q, k, v)):
        assert rel_rms(g, h) <= F64["out"]
    empty = np.asarray(indices).max(-1) < 0
    if empty.any():
        assert np.all(np.asarray(want)[empty] == 0)


@pytest.mark.parametrize(
    "case, dtype",
    [
        (CASES[0], jnp.float32),
        (CASES[6], jnp.bfloat16),
        *(pytest.param(c, d, marks=pytest.mark.slow) for c, d in ((CASES[4], jnp.float32), (CASES[4], jnp.bfloat16))),
        *(pytest.param(c, d, marks=pytest.mark.slow) for c, d in ((CASES[0], jnp.bfloat16), (CASES[6], jnp.float32))),
    ],
    ids=lambda x: str(x) if isinstance(x, Case) else jnp.dtype(x).name,
)
def test_tpu_kernel_is_the_definition(case, dtype):
    """pallas_tpu (blocks of queries over the key blocks they list, interpreted here): GQA, rows of
    0 and 1 keys, a decode step over a cache; float32 and bfloat16; gradients through xla's core."""
    arrays = inputs(case)
    indices = select(case, arrays, "naive")
    B, T, S = case.B, case.T, case.S or case.T
    r = np.random.default_rng(4)
    q = jnp.asarray(r.standard_normal((B, T, 4, 16)), dtype)
    k, v = (jnp.asarray(r.standard_normal((B, S, 2, 16)), dtype) for _ in range(2))
    lengths = arrays[-1]
    got = kdax.indexed_attention(q, k, v, indices, lengths=lengths, backend="pallas_tpu")
    f64 = lambda x: x.astype(jnp.float64)
    want = kdax.indexed_attention(f64(q), f64(k), f64(v), indices, lengths=lengths, backend="naive")
    assert got.dtype == dtype and rel_rms(got, want) <= (1e-2 if dtype == jnp.bfloat16 else 1e-5)
    if dtype == jnp.float32:
        grad = lambda backend: jax.grad(
            lambda q: jnp.sum(jnp.sin(kdax.indexed_attention(q, k, v, indices, lengths=lengths, backend=backend)))
        )(q)
        assert rel_rms(grad("pallas_tpu"), grad("xla")) <= 1e-6
    with pytest.raises(ValueError, match="v: expected k's shape"):
        kdax.indexed_attention(q, k, v[..., :8], indices, backend="pallas_tpu")


def test_key_blocks_of_query_blocks_are_the_lists():
    """The TPU kernel's reads (pallas_tpu.indexed_blocks): each block of queries' distinct key blocks
    of 16 ascending, and per query the bits of the keys it lists, rebuilt here key by key."""
    r = np.random.default_rng(2)
    B, T, W, S, bq = 2, 7, 9, 70, 3
    keys = np.stack([[r.permutation(S)[:W] for _ in range(T)] for _ in range(B)])  # distinct keys a query
    indices = np.where(r.random((B, T, W)) < 0.2, -1, keys)
    lengths = np.array([70, 41])
    ids, counts, bits = pallas_tpu.indexed_blocks(jnp.asarray(indices), jnp.asarray(lengths), bq=bq, cap=5)
    for b in range(B):
        for n in range(-(-T // bq)):
            lists = [
                {int(x) for x in indices[b, t] if 0 <= x < lengths[b]} for t in range(n * bq, min(T, (n + 1) * bq))
            ]
            blocks = sorted({x // 16 for keys in lists for x in keys})
            assert counts[b, n] == len(blocks) and list(ids[b, n, : len(blocks)]) == blocks
            assert not np.any(ids[b, n, len(blocks) :])
            for u, blk in enumerate(blocks):
                for i in range(bq):
                    keys = lists[i] if i < len(lists) else set()
                    assert bits[b, n, u * bq + i] == sum(1 << (x % 16) for x in keys if x // 16 == blk)


def test_tpu_kernel_shares_key_blocks_across_queries():
    """pallas_tpu with v = k (read once), DSA's pools of 16 and tails (a block of 16 keys a copy),
    D = 60 (padded), queries two a program over blocks two a step (many steps, a last one part
    filled): the float64 definition."""
    case = CASES[2]
    arrays = inputs(case)
    indices = select(case, arrays, "naive")
    r = np.random.default_rng(5)
    q, k = (
        jnp.asarray(r.standard_normal((2, case.T, 4, 60)), jnp.float32),
        jnp.asarray(r.standard_normal((2, case.T, 1, 60)), jnp.float32),
    )
    config = pallas_tpu.Config(index_rows=8, pool_keys=32)
    got = kdax.indexed_attention(q, k, k, indices, backend="pallas_tpu", config=config)
    want = kdax.indexed_attention(
        q.astype(jnp.float64), k.astype(jnp.float64), k.astype(jnp.float64), indices, backend="naive"
    )
    assert rel_rms(got, want) <= 1e-5


def test_full_selection_is_dense_causal_attention():
    """With every earlier key selected, indexed attention is causal attention."""
    case = Case("dense", B=2, T=30, topk=32)
    arrays = inputs(case)
    indices = select(case, arrays, "xla")
    r = np.random.default_rng(2)
    q, k, v = (jnp.asarray(r.standard_normal((2, 30, 4, 16))) for _ in range(3))
    got = kdax.indexed_attention(q, k, v, indices, backend="xla")
    assert rel_rms(got, reference.naive_attention(q, k, v)) <= F64["out"]


def test_low_precision_runs_close_to_float32():
    case = CASES[0]
    arrays32 = inputs(case, jnp.float32)
    want = select(case, arrays32, "xla")
    got = select(case, inputs(case, jnp.bfloat16), "xla")
    assert got.shape == want.shape  # bf16 keys may reorder near ties; the selection's form holds
    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.standard_normal((2, 37, 4, 16)), jnp.float32) for _ in range(3))
    o32 = kdax.indexed_attention(q, k, v, want, backend="xla")
    o16 = kdax.indexed_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), want, backend="xla")
    assert o16.dtype == jnp.bfloat16 and rel_rms(o16, o32) < 1e-2


def test_jit_and_vmap():
    case = CASES[0]
    q, w, keys, gates, ape, positions, _ = inputs(case, jnp.float32)
    f = lambda q, w, k, g: kdax.index_select(q, w, k, g, ape, topk=8, kpool=4)
    want = f(q, w, keys, gates)
    np.testing.assert_array_equal(jax.jit(f)(q, w, keys, gates), want)
    per_row = jax.vmap(lambda *a: f(*(x[None] for x in a))[0])(q, w, keys, gates)
    np.testing.assert_array_equal(per_row, want)


def _bad(**over):
    case = CASES[0]
    q, w, keys, gates, ape, positions, _ = inputs(case, jnp.float32)
    args = {"q": q, "weights": w, "keys": keys, "gates": gates, "ape": ape, "topk": 8, "kpool": 4} | over
    return lambda: kdax.index_select(**args)


@pytest.mark.parametrize(
    "call, match",
    [
        (_bad(q=jnp.zeros((2, 37, 4))), "q: expected a 4-d array"),
        (_bad(weights=jnp.zeros((2, 37, 3))), "weights: expected shape"),
        (_bad(keys=jnp.zeros((2, 37, 7))), "keys: expected shape"),
        (_bad(gates=jnp.zeros((2, 36, 8))), "gates: expected shape"),
        (_bad(ape=jnp.zeros((3, 8))), "ape: expected shape"),
        (_bad(topk=6), "topk: expected a positive multiple of kpool=4"),
        (_bad(kpool=0), "kpool: expected a positive int"),
        (_bad(lengths=jnp.array([40, 3])), "lengths: expected values in"),
        (_bad(q_positions=jnp.zeros((2, 37))), "q_positions: expected an integer dtype"),
        (_bad(backend="pallas"), "backend: expected one of"),
        (
            lambda: kdax.indexed_attention(
                jnp.zeros((1, 3, 2, 4)), jnp.zeros((1, 5, 1, 4)), jnp.zeros((1, 5, 1, 4)), jnp.array([[[0], [5], [1]]])
            ),
            r"indices: expected values in \[-1, 5\)",
        ),
        (
            lambda: kdax.indexed_attention(
                jnp.zeros((1, 3, 2, 4)), jnp.zeros((1, 5, 3, 4)), jnp.zeros((1, 5, 3, 4)), jnp.zeros((1, 3, 2), int)
            ),
            "k: expected shape",
        ),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "case", [CASES[0], CASES[6], *(pytest.param(c, marks=pytest.mark.slow) for c in CASES[1:2] + CASES[4:6])], ids=str
)
def test_tpu_selection_is_the_definition(case):
    """pallas_tpu's scores (interpreted) select exactly the reference's keys; float32 and bf16."""
    arrays = inputs(case, jnp.float32)
    np.testing.assert_array_equal(select(case, arrays, "pallas_tpu"), select(case, arrays, "xla"))
    bf16 = inputs(case, jnp.bfloat16)
    assert select(case, bf16, "pallas_tpu").shape == select(case, bf16, "xla").shape


def test_the_tpu_selection_leaves_key_rows_to_xla():
    q, w, keys, gates, ape, _, _ = inputs(CASES[0], jnp.float32)
    rows = jnp.zeros(q.shape[:2], jnp.int32)
    with pytest.raises(NotImplementedError, match="key_rows"):
        kdax.index_select(q, w, keys, gates, ape, topk=8, kpool=4, key_rows=rows, backend="pallas_tpu")
    assert kdax.explain_backend(op="index_select")[0] == "xla"  # on this CPU
