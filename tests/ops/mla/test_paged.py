"""paged_latent_attention: every backend against the float64 reference on engine-shaped steps
(decode rows, prompt chunks crossing pages and query blocks, empty and one-token requests,
padding tokens, unallocated pages, entries wider than the queries, bf16), its errors, and its
temporaries (a step's pages, not a token's context)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax.ops.mla.api import paged_latent_attention
from kdax.ops.mla.items import query_block
from kdax.ops.mla.pallas_tpu import Config

PAGE = 4


def _step(seed, new, seq, T, H=3, D=20, W=24, P=48, M=6, dtype=jnp.float64):
    """A step's arguments: requests with ``new`` tokens each and ``seq`` tokens after it, in pages
    scattered over the pool (unallocated entries of the table -1), T tokens in all."""
    rng = np.random.default_rng(seed)
    R = len(seq)
    pages = rng.normal(size=(P, PAGE, W))
    perm = rng.permutation(P)
    table = np.full((R, M), -1)
    k = 0
    for r in range(R):
        n = -(-seq[r] // PAGE)
        table[r, :n] = perm[k : k + n]
        k += n
    qsl = np.concatenate([[0], np.cumsum(new)])
    q = rng.normal(size=(T, H, D))
    ints = lambda a: jnp.asarray(a, jnp.int32)
    return jnp.asarray(q, dtype), jnp.asarray(pages, dtype), ints(table), ints(qsl), ints(seq)


STEPS = {
    # decode rows, an empty request, a chunk from the middle of a page, a new one-token request, a
    # chunk from position 0 over three pages, padding tokens
    "mixed": ([1, 0, 5, 1, 11], [9, 3, 13, 1, 11], 24),
    "decode": ([1] * 6, [1, 4, 5, 8, 13, 24], 8),
    "one chunk": ([21], [23], 21),
    "padding only": ([0, 0], [3, 5], 5),
}


def _reference(q, pages, *rest):
    return paged_latent_attention(q, pages, *rest, scale=0.3, backend="naive")


@pytest.mark.parametrize("name", STEPS)
def test_xla_equals_the_reference(name):
    args = _step(0, *STEPS[name])
    want = _reference(*args)
    got = paged_latent_attention(*args, scale=0.3, backend="xla")
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)
    T = STEPS[name][2]
    padding = np.arange(T) >= int(args[3][-1])
    assert np.all(np.asarray(got)[padding] == 0)


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize("cfg", [Config(block_keys=8, block_queries=8), Config(block_keys=4, block_queries=16)])
def test_tpu_kernel_equals_the_reference(name, cfg):
    args = _step(1, *STEPS[name])
    want = _reference(*args)
    f32 = [a.astype(jnp.float32) for a in args[:2]]
    got = paged_latent_attention(*f32, *args[2:], scale=0.3, backend="pallas_tpu", config=cfg)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_bfloat16(backend):
    args = _step(2, *STEPS["mixed"], dtype=jnp.bfloat16)
    want = _reference(*(a.astype(jnp.float64) for a in args[:2]), *args[2:])
    got = paged_latent_attention(*args, scale=0.3, backend=backend)
    err = np.sqrt(np.mean((np.asarray(got, np.float64) - np.asarray(want)) ** 2) / np.mean(np.asarray(want) ** 2))
    assert err < 1e-2


def test_jit_and_traced_steps():
    """One compiled program serves steps of other request mixes (the lengths are traced)."""
    f = jax.jit(lambda *a: paged_latent_attention(*a, scale=0.3, backend="xla"))
    for seed, (new, seq) in enumerate((([1, 0, 5, 1, 11], [9, 3, 13, 1, 11]), ([2, 2, 2, 2, 2], [2, 24, 7, 3, 9]))):
        args = _step(seed, new, seq, 24)
        np.testing.assert_allclose(f(*args), _reference(*args), atol=1e-12, rtol=0)
    assert f._cache_size() == 1


def test_temporaries_are_a_steps_pages_not_each_tokens_context():
    """512 prompt tokens over 8,192 tokens of context: a per-token copy of the context would take
    512 x 8,192 x 64 x 4 B = 1 GiB; the op's temporaries stay under 64 MiB."""
    T, H, W, page, ctx = 512, 4, 64, 16, 8192
    M = ctx // page
    sds = jax.ShapeDtypeStruct
    args = (
        sds((T, H, W), jnp.float32),
        sds((M + 8, page, W), jnp.float32),
        sds((1, M), jnp.int32),
        sds((2,), jnp.int32),
        sds((1,), jnp.int32),
    )
    f = lambda *a: paged_latent_attention(*a, scale=0.1, backend="xla")
    temp = jax.jit(f).trace(*args).lower().compile().memory_analysis().temp_size_in_bytes
    assert temp < 64 << 20, temp / 2**20


def test_query_blocks_hold_at_most_1024_rows_of_tokens_and_heads():
    """The default block: a request's tokens (8 for decode rows, 128 for a chunk), capped at 1024
    rows of tokens x heads (32 heads on one device, an engine's attention group of one device:
    128 tokens x 32 heads overflowed the TPU kernel's VMEM)."""
    assert query_block(64, 64, 32) == 8 and query_block(8192, 1, 4) == 128
    assert query_block(1024, 1, 32) == 32 and query_block(1024, 1, 256) == 8


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: (a[0][0],) + a[1:], "q: expected floats \\[T, H, D\\]"),
        (lambda a: (jnp.zeros((24, 3, 30)),) + a[1:], "q: expected a last dim <= the entries' width 24"),
        (lambda a: a[:2] + (a[2][0],) + a[3:], "page_table: expected ints \\[R, M\\]"),
        (lambda a: a[:3] + (a[3][:-1],) + a[4:], "query_start_loc: expected ints \\[R \\+ 1 = 6\\]"),
        (lambda a: a[:4] + (a[4].astype(jnp.float32),), "seq_lens: expected ints \\[R = 5\\]"),
    ],
)
def test_bad_arguments_name_the_argument(change, match):
    args = change(_step(0, *STEPS["mixed"]))
    with pytest.raises(ValueError, match=match):
        paged_latent_attention(*args, scale=0.3)
