"""Autoregressive generation: chunked prefill, then jit-compiled one-token decode steps with
preallocated caches (one compilation per batch shape, none per step)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdax.models.kda import KDAForCausalLM, _check_ids, align_rows
from kdax.ops.common import dispatch


def sample_logits(logits, rng, temperature: float, top_k: int | None, top_p: float | None):
    """Next tokens [B] from logits [B, vocab]: argmax when temperature == 0, else a sample
    of softmax(logits / temperature) restricted to the top_k tokens and to the smallest
    set whose probability reaches top_p."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


# The two steps of generate(), compiled; ``ctx``: the dispatch context to run under (part of the cache key).
@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7), static_argnames="ctx")
def prefill_sample(graphdef, state, ids, lengths, max_length, temperature, top_k, top_p, rng, ctx=("auto", None)):
    model = nnx.merge(graphdef, state)
    with dispatch.restored(ctx):
        logits, cache = model.prefill(ids, model.init_cache(ids.shape[0], max_length), lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return sample_logits(last, rng, temperature, top_k, top_p), cache


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6), static_argnames="ctx", donate_argnums=(3,))
def decode_sample(graphdef, state, tokens, cache, temperature, top_k, top_p, rng, ctx=("auto", None)):
    with dispatch.restored(ctx):
        logits, cache = nnx.merge(graphdef, state).decode(tokens, cache)
    return sample_logits(logits, rng, temperature, top_k, top_p), cache


def _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, rng):
    if not isinstance(model, KDAForCausalLM):
        raise ValueError(f"model: expected a KDAForCausalLM, got {type(model).__name__}")
    vocab = model.config.vocab_size
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected a non-negative int, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < np.inf:
        raise ValueError(f"temperature: expected a float >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(f"top_k: expected None or an int in [1, {vocab}], got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a float in (0, 1], got {top_p!r}")
    if eos_token_id is not None and not (isinstance(eos_token_id, int) and 0 <= eos_token_id < vocab):
        raise ValueError(f"eos_token_id: expected None or a token id in [0, {vocab}), got {eos_token_id!r}")
    if temperature > 0 and rng is None:
        raise ValueError("rng: expected a jax.random key when temperature > 0 (sampling)")


def generate(model: KDAForCausalLM, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             attention_mask=None, rng=None):  # fmt: skip
    """Extend each prompt by up to ``max_new_tokens`` tokens.

    input_ids: [B, T] ints; attention_mask: [B, T], 0 on padding (left or right; each row's
    tokens may sit anywhere); rng: a jax.random key, required when temperature > 0. Once a
    row emits ``eos_token_id`` it emits only eos_token_id; the loop stops when every row has.
    Returns [B, T + max_new_tokens] int32: input_ids as given, then the new tokens."""
    _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, rng)
    B, T = _check_ids(input_ids, model.config.vocab_size)
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if max_new_tokens == 0:
        return input_ids
    if attention_mask is None:
        ids, lengths = input_ids, jnp.full((B,), T, jnp.int32)
    else:
        _, order, lengths = align_rows(attention_mask, (B, T))
        ids = jnp.take_along_axis(input_ids, order, axis=1)
    rngs = jax.random.split(jax.random.key(0) if rng is None else rng, max_new_tokens)
    graphdef, state = nnx.split(model)
    options = (float(temperature), top_k, None if top_p is None else float(top_p))
    ctx = dispatch.context()
    token, cache = prefill_sample(graphdef, state, ids, lengths, T + max_new_tokens, *options, rngs[0], ctx=ctx)
    done = jnp.zeros((B,), bool)
    out = []
    for i in range(max_new_tokens):
        if eos_token_id is not None:
            token = jnp.where(done, eos_token_id, token)
            done = done | (token == eos_token_id)
        out.append(token)
        if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
            break
        token, cache = decode_sample(graphdef, state, token, cache, *options, rngs[i + 1], ctx=ctx)
    new = jnp.stack(out, axis=1)
    if new.shape[1] < max_new_tokens:
        new = jnp.pad(new, ((0, 0), (0, max_new_tokens - new.shape[1])), constant_values=eos_token_id)
    return jnp.concatenate([input_ids, new], axis=1)
