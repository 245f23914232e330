"""kdax.serving: continuous batching, speculative decoding and prefix caching give the tokens of
plain greedy generation; the pools after rollback equal the plain run's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdax
from kdax.models import (
    BailingHybridForCausalLM,
    KDAForCausalLM,
    KimiLinearForCausalLM,
    generate,
    generation,
    kimi_tiny_config,
    ling_tiny_config,
    tiny_config,
)
from kdax.models.kda import is_kda
from kdax.ops.kda import decode
from kdax.serving import Batch, Scheduler, init_pool, prompt_lookup, step
from kdax.serving.scheduler import speculative_sample

LENGTHS = (5, 17, 40, 1, 37, 9, 33, 20)
NEW = (6, 9, 4, 12, 5, 8, 7, 10)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(
        hidden_size=64,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=64,
        attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2},
    )
    return KDAForCausalLM(cfg, rngs=nnx.Rngs(0))


def prompts(seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in LENGTHS]


def greedy(model, prompts, new):
    """Each prompt's greedy continuation, by one generate() call over the left-padded batch."""
    T = max(map(len, prompts))
    ids = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], mask[i, T - len(p) :] = p, 1
    out = np.asarray(generate(model, jnp.asarray(ids), max(new), attention_mask=jnp.asarray(mask)))
    return [out[i, T : T + n].tolist() for i, n in enumerate(new)]


def serve(scheduler, prompts, new):
    """Requests join two at a time between steps; their outputs in order."""
    ids, out = [], {}
    for i, (p, n) in enumerate(zip(prompts, new)):
        ids.append(scheduler.add(p, n))
        if i % 2:
            out.update(scheduler.step()[1])
    out.update(scheduler.run())
    return [out[i] for i in ids]


@pytest.fixture(scope="module")
def reference(model):
    return greedy(model, prompts(), NEW)


def test_continuous_batching_gives_the_tokens_of_generate(model, reference):
    """8 requests of 1 to 40 prompt tokens joining at different steps, 4 at a time, prompts
    prefilled in chunks of 16 beside other requests' decode tokens, pages of 8 tokens."""
    s = Scheduler(model, max_requests=4, max_length=64, page_size=8, chunk_size=16, row_buckets=[4])
    assert serve(s, prompts(), NEW) == reference
    assert {C for _, C, _ in s.steps} == {1, 16}  # mixed and decode-only steps
    assert s.idle and len(s._free_pages) == s.pool.layers[1][0].shape[0]  # every page returned


def half_right_draft(reference):
    """Drafts that are right, partly right and wrong: the reference with every third token altered."""
    full = {tuple(p): r for p, r in zip(prompts(), reference)}

    def draft(tokens, k):
        for p, r in full.items():
            if tuple(tokens[: len(p)]) == p:
                done = len(tokens) - len(p)
                guess = r[done : done + k]
                return [(t + 1) % 64 if (done + i) % 3 == 2 else t for i, t in enumerate(guess)]
        return []

    return draft


def test_speculative_decoding_gives_the_tokens_of_greedy_decoding(model, reference):
    """With drafts right, partly right and wrong, the verified tokens are plain greedy decoding's."""
    s = Scheduler(
        model,
        max_requests=4,
        max_length=64,
        page_size=8,
        chunk_size=16,
        draft=half_right_draft(reference),
        num_draft=3,
        row_buckets=[4],
    )
    assert serve(s, prompts(), NEW) == reference
    assert sum(n for (_, _, verify), n in s.steps.items() if verify) > 0
    s = Scheduler(
        model, max_requests=4, max_length=64, page_size=8, chunk_size=16, draft=lambda t, k: [], row_buckets=[4]
    )
    assert serve(s, prompts(), NEW) == reference
    assert not any(verify for _, _, verify in s.steps) and s.drafted == 0  # nothing proposed: plain decode steps


@pytest.mark.parametrize("top_k", [None, 3])
def test_speculative_sampling_draws_what_plain_sampling_draws(top_k):
    """speculative_sample on 200,000 rows of a fixed 6-token distribution per position: the first
    emitted token follows position 0's distribution, and after an accepted draft the second
    follows position 1's (to 0.006, about 5 standard errors), whether the drafts are likely,
    unlikely, or (with top_k) outside what sampling may draw."""
    rows, V, temperature = 200_000, 6, 0.7
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, V)) * 2, jnp.float32)
    p = np.asarray(jax.nn.softmax(generation.filtered_logits(logits, temperature, top_k, None), axis=-1))
    for drafts in ([int(np.argmax(p[0])), int(np.argmax(p[1]))], [int(np.argmin(logits[0])), 2]):
        tokens = jnp.asarray([[0, *drafts]] * rows, jnp.int32)
        counts = jnp.full((rows,), 3, jnp.int32)
        accepted, new = map(
            np.asarray,
            speculative_sample(
                jnp.broadcast_to(logits, (rows, 3, V)), tokens, counts, jax.random.key(1), temperature, top_k, None
            ),
        )
        first = np.bincount(new[:, 0], minlength=V) / rows
        np.testing.assert_allclose(first, p[0], atol=6e-3)
        took = new[:, 0] == drafts[0]
        np.testing.assert_array_equal(accepted > 1, took)
        if took.sum() > 20_000:
            second = np.bincount(new[took, 1], minlength=V) / took.sum()
            np.testing.assert_allclose(second, p[1], atol=6e-3 * np.sqrt(rows / took.sum()))
    greedy = speculative_sample(
        logits[None],
        jnp.asarray([[0, int(np.argmax(logits[0])), 5]]),
        jnp.asarray([3]),
        jax.random.key(2),
        0.0,
        None,
        None,
    )
    expect_second = int(np.argmax(logits[1]))
    assert np.asarray(greedy[1])[0, :2].tolist() == [int(np.argmax(logits[0])), expect_second]
    assert int(greedy[0][0]) == (3 if expect_second == 5 else 2)


def test_prefix_cache_hit_gives_the_tokens_without_it(model):
    """Prompts sharing 32 or 16 leading tokens: the later ones start from the kept state (KDA,
    convolution and shared pages) and generate what they generate without the cache."""
    rng = np.random.default_rng(1)
    head = rng.integers(1, 64, 40).tolist()
    ps = [head + rng.integers(1, 64, n).tolist() for n in (3, 0, 9)] + [head[:20] + [5, 6]]
    new = [5, 6, 4, 7]
    s = Scheduler(model, max_requests=2, max_length=64, page_size=8, chunk_size=16, prefix_cache=3, row_buckets=[2])
    assert serve(s, ps, new) == greedy(model, ps, new)
    assert s.prefix_hits >= 2


@pytest.mark.parametrize("backend", ["xla", "pallas_gpu"])
def test_rollback_leaves_the_pool_of_the_plain_run(model, backend, monkeypatch):
    """A verify step of 4 tokens of which 3 are accepted, then the rollback (the next step's
    source): the request's KDA and convolution states and its cached keys equal those of 3 plain
    decode steps. With pallas_gpu the decode and verify steps run the decode kernel (interpreted)
    on the pools in place."""
    kernel_calls = []
    monkeypatch.setattr(decode, "fused_recurrent_slots", _counted(decode.fused_recurrent_slots, kernel_calls))
    prompt = jnp.asarray(prompts(2)[2][:16], jnp.int32)[None]
    pages = jnp.arange(8, dtype=jnp.int32)[None]

    def batch(tokens, start, source=0):
        tokens = jnp.asarray(tokens, jnp.int32)[None]
        n = jnp.asarray([tokens.shape[1]], jnp.int32)
        return Batch(tokens, n, jnp.asarray([0]), jnp.asarray([source]), jnp.asarray([start]), pages)

    pool = init_pool(model, 4, 8, 8)
    logits, pool = step(model, pool, batch(prompt[0], 0))
    tokens = [int(jnp.argmax(logits[0]))]
    plain = jax.tree.map(jnp.copy, pool)
    with kdax.use_backend(backend):
        for i in range(3):
            logits, plain = step(model, plain, batch(tokens[-1:], 16 + i))
            tokens.append(int(jnp.argmax(logits[0])))
        draft = tokens[:3] + [(tokens[3] + 1) % 64]  # the last draft token is wrong
        logits, pool = step(model, pool, batch(draft, 16), verify=True)
        assert [int(t) for t in jnp.argmax(logits[0], -1)[:3]] == tokens[1:4]
        # the next step starts from slot 2, the state after the 3rd token
        logits, pool = step(model, pool, batch(tokens[3:4], 19, source=2))
        logits_plain, plain = step(model, plain, batch(tokens[3:4], 19))
    np.testing.assert_allclose(logits, logits_plain, atol=1e-5)
    kda_layers = sum(is_kda(b) for b in model.model.layers)
    assert len(kernel_calls) == (2 * kda_layers if backend == "pallas_gpu" else 0)  # traced: decode, verify
    for mine, theirs in zip(pool.layers, plain.layers):
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            mine_, theirs_ = (x[0] if x.shape[0] == 4 else x.reshape(-1, *x.shape[2:])[:20] for x in (a, b))
            np.testing.assert_allclose(mine_, theirs_, atol=1e-5)


def _counted(fn, calls):
    def run(*args, **kw):
        calls.append(1)
        return fn(*args, **kw)

    return run


@pytest.mark.slow  # the scheduler's prefix-cache test covers it in CI, through the step
def test_prefill_in_two_parts_equals_the_whole_prefill(model):
    """Model-level prefix caching: a cache saved after 32 tokens continues as the whole prompt's
    prefill does (logits and every state, the convolution caches included)."""
    ids = jnp.asarray([prompts(3)[2][:40], prompts(4)[2][:40]], jnp.int32)
    whole, cache = model.prefill(ids, model.init_cache(2, 48))
    _, part = model.prefill(ids[:, :32], model.init_cache(2, 48))
    rest, part = model.prefill(ids[:, 32:], part)
    np.testing.assert_allclose(rest, whole[:, 32:], atol=1e-4)
    for a, b in zip(jax.tree.leaves(part), jax.tree.leaves(cache)):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["kimi", "ling"])
def test_hugging_face_families_serve_the_tokens_of_generate(family):
    """Kimi Linear and Ling: MLA's latent pages (Ling's with RoPE and the output gate), MoE, their gates."""
    if family == "kimi":
        model = KimiLinearForCausalLM(kimi_tiny_config(vocab_size=64), rngs=nnx.Rngs(0))
    else:
        model = BailingHybridForCausalLM(ling_tiny_config(vocab_size=64), rngs=nnx.Rngs(0))
    ps = prompts(5)
    s = Scheduler(model, max_requests=4, max_length=64, page_size=8, chunk_size=16, draft=prompt_lookup, num_draft=2)
    assert serve(s, ps, NEW) == greedy(model, ps, NEW)


@pytest.mark.parametrize("drafts", [False, True])
def test_sampling_with_top_k_1_is_greedy_and_a_seed_repeats(model, reference, drafts):
    sizes = {"max_requests": 4, "max_length": 64, "page_size": 8, "chunk_size": 16, "row_buckets": [4]}
    if drafts:
        sizes.update(draft=half_right_draft(reference), num_draft=3)
    s = Scheduler(model, **sizes, temperature=0.8, top_k=1)
    assert serve(s, prompts(), NEW) == reference
    assert not drafts or 0 < s.accepted < s.drafted  # drafts kept and drafts rejected
    runs = [serve(Scheduler(model, **sizes, temperature=1.0, seed=3), prompts()[:4], NEW[:4]) for _ in range(2)]
    assert runs[0] == runs[1] and all(0 <= t < 64 for r in runs[0] for t in r)
    assert [len(r) for r in runs[0]] == list(NEW[:4])


def test_bad_requests_and_batches_raise(model):
    s = Scheduler(model, max_requests=2, max_length=32, page_size=8, chunk_size=16)
    with pytest.raises(ValueError, match="prompt: expected at least one token id"):
        s.add([], 3)
    with pytest.raises(ValueError, match="prompt: expected at least one token id in"):
        s.add([64], 3)
    with pytest.raises(ValueError, match="max_length=32"):
        s.add([1] * 30, 3)
    with pytest.raises(ValueError, match="chunk_size: expected a positive multiple of page_size=8"):
        Scheduler(model, page_size=8, chunk_size=12)
    with pytest.raises(ValueError, match="row_buckets: expected increasing ints ending at max_requests=6"):
        Scheduler(model, max_requests=6, row_buckets=[4, 2, 6])
    assert Scheduler(model, max_requests=6, max_length=32).row_buckets == (1, 2, 4, 6)
    with pytest.raises(ValueError, match="temperature: expected a finite float >= 0"):
        Scheduler(model, draft=prompt_lookup, temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p: expected None or a float in \(0, 1\]"):
        Scheduler(model, top_p=0.0)
    pool = init_pool(model, 2, 4, 8)
    bad = Batch(jnp.zeros((2, 1), jnp.int32), *(jnp.zeros((3,), jnp.int32),) * 4, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"batch.counts: expected shape \(2,\)"):
        step(model, pool, bad)
    with pytest.raises(ValueError, match="num_slots: expected a positive int"):
        init_pool(model, 0, 4, 8)
