"""State slots (SPEC.md, "Serving interface"): ``ssm_state_indices`` and ``num_accepted_tokens``
against the float64 recurrence run sequence by sequence, with the pool read and written in Python."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from tests.tolerances import TOL

H, HV, K, V, S = 1, 2, 12, 20, 9
IN_OP = {
    "use_qk_l2norm_in_kernel": True,
    "use_gate_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
}


def inputs(B, T, seed=0, dtype=jnp.float32, in_op=False):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V))
    g = rng.standard_normal((B, T, HV, K)) if in_op else rng.uniform(-2, -0.02, (B, T, HV, K))
    beta = rng.standard_normal((B, T, HV)) if in_op else rng.uniform(0, 1, (B, T, HV))
    kw = dict(IN_OP, A_log=jnp.asarray(rng.uniform(np.log(20), np.log(60), HV), jnp.float32)) if in_op else {}
    pool = jnp.asarray(rng.standard_normal((S, HV, K, V)), jnp.float32)
    return [jnp.asarray(x, dtype) for x in (q, k, v, g, beta)], kw, pool


def pieces(args, cu):
    """Each sequence's arrays: rows, or the packed sequences of ``cu``."""
    if cu is None:
        return [[x[n : n + 1] for x in args] for n in range(args[0].shape[0])]
    return [[x[:, a:b] for x in args] for a, b in zip(cu[:-1], cu[1:])]


def f64(x):
    return jnp.asarray(x, jnp.float64)


def reference(args, kw, pool, idx, cu=None, accepted=None, state_v_first=False):
    """(o, pool) by the float64 recurrence per sequence, the pool as a NumPy array updated in Python."""
    kw64 = {n: (f64(x) if n == "A_log" else x) for n, x in kw.items()}
    run = functools.partial(kdax.fused_recurrent_kda, backend="naive", output_final_state=True, **kw64)
    new, outs = np.array(pool, np.float64), []
    flip = (lambda s: np.swapaxes(s, -1, -2)) if state_v_first else (lambda s: s)
    idx = np.asarray(idx)
    for n, xs in enumerate(pieces([f64(x) for x in args], cu)):
        start = idx[n] if idx.ndim == 1 else idx[n, (1 if accepted is None else accepted[n]) - 1]
        state = np.zeros(new.shape[1:]) if start < 0 else np.asarray(pool, np.float64)[start]
        state = jnp.asarray(flip(state))[None]
        T = xs[0].shape[1]
        if idx.ndim == 1:
            o, state = run(*xs, initial_state=state) if T else (jnp.zeros((1, 0, HV, V)), state)
            if idx[n] >= 0:
                new[idx[n]] = flip(np.asarray(state[0]))
        else:  # token by token, each state written to its slot
            o = []
            for t in range(T):
                o_t, state = run(*(x[:, t : t + 1] for x in xs), initial_state=state)
                o.append(o_t)
                if idx[n, t] >= 0:
                    new[idx[n, t]] = flip(np.asarray(state[0]))
            o = jnp.concatenate(o, 1) if o else jnp.zeros((1, 0, HV, V))
        outs.append(o)
    return np.concatenate(outs, axis=0 if cu is None else 1), new


def check(got, ref, pool, idx, dtype=jnp.float32):
    (o, new), (o_ref, new_ref) = got, ref
    tol = TOL[dtype]["out"]
    assert o.dtype == dtype and new.dtype == pool.dtype and new.shape == pool.shape
    assert rel_rms(o, o_ref) <= tol, rel_rms(o, o_ref)
    written = np.unique(np.asarray(idx)[np.asarray(idx) >= 0])
    assert rel_rms(np.asarray(new)[written], new_ref[written]) <= tol
    untouched = np.setdiff1d(np.arange(S), written)
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(pool)[untouched])  # bit-identical


OPS = {
    "chunk-xla": functools.partial(kdax.chunk_kda, backend="xla", chunk_size=16),
    "recurrent-xla": functools.partial(kdax.fused_recurrent_kda, backend="xla"),
    "recurrent-naive": functools.partial(kdax.fused_recurrent_kda, backend="naive"),
    "chunk-pallas_tpu": functools.partial(kdax.chunk_kda, backend="pallas_tpu", chunk_size=16),
    "chunk-pallas_gpu": functools.partial(kdax.chunk_kda, backend="pallas_gpu", chunk_size=16),
}


@pytest.mark.parametrize(
    "op, in_op",
    [
        ("chunk-xla", True),
        ("recurrent-xla", True),
        ("recurrent-naive", False),
        # interpreted kernels: the slots are read and written outside them, as for xla
        pytest.param("chunk-pallas_tpu", True, marks=pytest.mark.slow),
        pytest.param("chunk-pallas_gpu", True, marks=pytest.mark.slow),
    ],
)
def test_one_slot_per_row(op, in_op):
    """Rows start from their slots and write their final states there; a padding row reads zeros
    and writes nothing; every other slot is returned bit for bit."""
    args, kw, pool = inputs(4, 19, in_op=in_op)
    idx = jnp.asarray([3, -1, 7, 0], jnp.int32)
    got = OPS[op](*args, initial_state=pool, ssm_state_indices=idx, **kw)
    check(got, reference(args, kw, pool, idx), pool, idx)


@pytest.mark.parametrize("op", ["chunk-xla", pytest.param("recurrent-xla", marks=pytest.mark.slow)])
def test_packed_sequences_with_empty_and_one_token_ones(op):
    """cu_seqlens with an empty and a one-token sequence, grouped heads, [HV, V, K] states."""
    lengths = (7, 0, 1, 22)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    args, kw, pool = inputs(1, int(cu[-1]), seed=1)
    idx = jnp.asarray([5, 2, -1, 8], jnp.int32)
    pool_vk = jnp.swapaxes(pool, -1, -2)
    got = OPS[op](*args, initial_state=pool_vk, ssm_state_indices=idx, cu_seqlens=cu, state_v_first=True, **kw)
    o_ref, new_ref = reference(args, kw, pool, idx, cu)
    check((got[0], jnp.swapaxes(got[1], -1, -2)), (o_ref, new_ref), pool, idx)


def test_chunk_kda_slots_with_intermediate_states_and_bf16():
    """bf16 inputs into a float32 pool, and the states entering each chunk as a third output."""
    args, kw, pool = inputs(2, 40, seed=2, dtype=jnp.bfloat16, in_op=True)
    idx = jnp.asarray([6, 1], jnp.int32)
    o, new, h = kdax.chunk_kda(
        *args, initial_state=pool, ssm_state_indices=idx, return_intermediate_states=True, chunk_size=16, **kw
    )
    assert h.shape == (2, 3, HV, K, V) and h.dtype == jnp.bfloat16
    check((o, new), reference(args, kw, pool, idx), pool, idx, dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "backend, packed", [("xla", False), pytest.param("xla", True, marks=pytest.mark.slow), ("naive", True)]
)
def test_speculative_slots(backend, packed):
    """[N, Tmax] slots: each sequence starts from the slot of its last accepted token and writes
    the state after every token; a padding sequence and a padding column write nothing."""
    Tmax = 4
    lengths = (4, 1, 3, 2) if packed else (4,) * 4
    cu = np.concatenate([[0], np.cumsum(lengths)]) if packed else None
    args, kw, pool = inputs(1 if packed else 4, int(sum(lengths)) if packed else 4, seed=3, in_op=True)
    idx = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1], [8, -1, -1, -1]], np.int32)
    accepted = np.array([3, 1, 2, 4], np.int32)  # the last row starts from a padding column: zeros
    got = kdax.fused_recurrent_kda(
        *args,
        initial_state=pool,
        ssm_state_indices=jnp.asarray(idx),
        num_accepted_tokens=jnp.asarray(accepted),
        cu_seqlens=cu,
        backend=backend,
        **kw,
    )
    ref = reference(args, kw, pool, idx, cu, accepted)
    if packed:  # slots past a sequence's tokens are not written
        idx = np.where(np.arange(Tmax)[None] < np.asarray(lengths)[:, None], idx, -1)
    check(got, ref, pool, idx)


def test_rollback_equals_the_accepted_tokens_alone():
    """Run 4 draft tokens with per-token slots, accept 2: the next step, from the accepted slot,
    equals running the 2 accepted tokens and then the next ones without slots."""
    args, kw, pool = inputs(2, 6, seed=4, in_op=True)
    draft, nxt = [x[:, :4] for x in args], [x[:, 4:] for x in args]
    h0 = pool[:2]
    idx = jnp.arange(8, dtype=jnp.int32).reshape(2, 4) + 1  # rows [1, 2, 3, 4] and [5, 6, 7, 8]
    pool = pool.at[idx[:, 0]].set(h0)  # the draft step starts from column 0 (one accepted token)
    _, pool = kdax.fused_recurrent_kda(
        *draft, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=jnp.asarray([1, 1]), **kw
    )
    o, pool = kdax.fused_recurrent_kda(
        *nxt, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=jnp.asarray([2, 2]), **kw
    )
    plain = [jnp.concatenate([x[:, :2], y], 1) for x, y in zip(args, nxt)]
    o_plain, final = kdax.fused_recurrent_kda(*plain, initial_state=h0, output_final_state=True, **kw)
    np.testing.assert_allclose(o, o_plain[:, 2:], atol=1e-5)
    np.testing.assert_allclose(pool[idx[:, 1]], final, atol=1e-5)


def test_pool_gradients_match_the_reference():
    """Gradients through the pool's read and write, against the float64 reference's."""
    args, kw, pool = inputs(3, 5, seed=5)
    idx = jnp.asarray([4, -1, 0], jnp.int32)
    w = jnp.asarray(np.random.default_rng(9).standard_normal((S, HV, K, V)))

    def loss(pool, q, slotted):
        if slotted:
            o, new = kdax.fused_recurrent_kda(q, *args[1:], initial_state=pool, ssm_state_indices=idx, backend="xla")
        else:  # the reference: read and write by hand, the naive op in float64
            h0 = jnp.stack([pool[i] if i >= 0 else jnp.zeros_like(pool[0]) for i in np.asarray(idx)])
            o, final = kdax.fused_recurrent_kda(
                q, *(f64(x) for x in args[1:]), initial_state=h0, output_final_state=True, backend="naive"
            )
            new = pool
            for n, i in enumerate(np.asarray(idx)):
                new = new.at[i].set(final[n]) if i >= 0 else new
        return jnp.sum(o) + jnp.sum(new * w)

    got = jax.grad(loss, argnums=(0, 1))(pool, args[0], True)
    ref = jax.grad(loss, argnums=(0, 1))(f64(pool), f64(args[0]), False)
    for x, r in zip(got, ref):
        assert rel_rms(x, r) <= TOL[jnp.float32]["grad"]


def test_donated_pool_is_updated_in_place():
    """Under jit with the pool donated, the compiled step allocates nothing of the pool's size:
    the work is O(tokens), not O(S)."""
    pool = jnp.zeros((4096, HV, K, V), jnp.float32)
    args, _, _ = inputs(4, 1)
    idx = jnp.asarray([10, 4000, -1, 7], jnp.int32)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pool, q, k, v, g, beta):
        return kdax.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, backend="xla")

    compiled = step.lower(pool, *args).compile()
    mem = compiled.memory_analysis()
    assert mem.temp_size_in_bytes < pool.nbytes // 16, mem
    assert mem.alias_size_in_bytes >= pool.nbytes, mem  # the output pool is the donated input's buffer


@pytest.mark.parametrize(
    "call, match",
    [
        ({"ssm_state_indices": np.array([0, 9])}, r"ssm_state_indices: expected slots in \[0, 9\)"),
        ({"ssm_state_indices": np.array([3, 3])}, "ssm_state_indices: expected each slot written at most once"),
        ({"ssm_state_indices": np.array([0, 1, 2])}, r"ssm_state_indices: expected one row per sequence \(2\)"),
        ({"ssm_state_indices": np.array([0.0, 1.0])}, "ssm_state_indices: expected an integer dtype"),
        ({"ssm_state_indices": np.array([0, 1]), "initial_state": None}, "initial_state: expected the state pool"),
        (
            {"ssm_state_indices": np.array([0, 1]), "initial_state": np.zeros((S, HV, V, K), np.float32)},
            "initial_state",
        ),
        ({"ssm_state_indices": np.array([[0, 1, 2], [3, 4, 5]])}, r"Tmax >= the longest sequence \(4\)"),
        (
            {
                "ssm_state_indices": np.array([[0, 1, 2, 3, 7], [4, 5, 6, 8, 3]]),
                "num_accepted_tokens": np.array([1, 5]),
            },
            "sequence 1 starts from slot 3, which sequence 0 writes",
        ),
        (
            {"ssm_state_indices": np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), "num_accepted_tokens": np.array([0, 1])},
            r"num_accepted_tokens: expected counts in \[1, Tmax=4\]",
        ),
        (
            {"ssm_state_indices": np.array([0, 1]), "num_accepted_tokens": np.array([1, 1])},
            "num_accepted_tokens: expected None unless",
        ),
    ],
)
def test_bad_slots_raise(call, match):
    args, _, pool = inputs(2, 4)
    kw = {"initial_state": pool, **call}
    with pytest.raises(ValueError, match=match):
        kdax.fused_recurrent_kda(*args, **kw)


def test_concrete_slots_closed_over_under_jit():
    """Slots and accepted counts known while a jitted function is traced are checked as
    concrete ones, and give the eager call's results."""
    args, _, pool = inputs(2, 2, seed=4)
    idx, accepted = jnp.asarray([[0, 1, 5], [2, 3, 5]], jnp.int32), jnp.asarray([3, 1], jnp.int32)
    call = lambda pool: kdax.fused_recurrent_kda(
        *args, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=accepted, backend="xla"
    )
    (o, new), (o_eager, new_eager) = jax.jit(call)(pool), call(pool)
    np.testing.assert_allclose(o, o_eager, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new, new_eager, rtol=1e-6, atol=1e-6)
    bad = jnp.asarray([[0, 3, 9], [2, 1, 3]], jnp.int32)  # sequence 0 writes slot 3, where sequence 1 starts
    counts = jnp.asarray([1, 3], jnp.int32)
    with pytest.raises(ValueError, match="sequence 1 starts from slot 3, which sequence 0 writes"):
        jax.jit(
            lambda pool: kdax.fused_recurrent_kda(
                *args, initial_state=pool, ssm_state_indices=bad, num_accepted_tokens=counts
            )
        )(pool)


def test_chunk_kda_takes_one_slot_per_sequence_only():
    args, _, pool = inputs(2, 4)
    with pytest.raises(ValueError, match=r"ssm_state_indices: expected int \[2\] \(one slot per sequence\)"):
        kdax.chunk_kda(*args, initial_state=pool, ssm_state_indices=np.zeros((2, 4), np.int32))


@pytest.mark.parametrize("op", ["chunk-xla", pytest.param("recurrent-xla", marks=pytest.mark.slow)])
def test_prefill_from_a_cached_chunk_boundary_equals_the_full_prefill(op):
    """Prefix caching: the state entering chunk j (``return_intermediate_states``), put in a slot,
    continues the prefill from token j * C as the full prefill does."""
    args, kw, pool = inputs(2, 70, seed=6, in_op=True)
    o, final, h = kdax.chunk_kda(*args, output_final_state=True, return_intermediate_states=True, chunk_size=16, **kw)
    j = 3
    pool = pool.at[jnp.asarray([2, 5])].set(h[:, j].astype(jnp.float32))
    idx = jnp.asarray([2, 5], jnp.int32)
    o_rest, pool = OPS[op](*(x[:, j * 16 :] for x in args), initial_state=pool, ssm_state_indices=idx, **kw)
    assert rel_rms(o_rest, o[:, j * 16 :]) <= 1e-5
    assert rel_rms(pool[idx], final) <= 1e-5
