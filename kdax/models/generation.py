"""Autoregressive generation: chunked prefill, then jit-compiled one-token decode steps with
preallocated caches (one compilation per batch size and bucket of lengths, none per step)."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdax.models.kda import KDAForCausalLM, _check_ids, _check_mask
from kdax.ops.common import dispatch


def sample_logits(logits, rng, temperature: float, top_k: int | None, top_p: float | None):
    """Pick the next tokens: argmax when temperature == 0, else a sample of
    softmax(logits / temperature) (in float32) restricted to the top_k tokens and to the
    smallest set whose probability reaches top_p. The arguments are not checked
    (:func:`generate` checks them).

    Args:
        logits: [B, vocab].
        rng: a jax.random key (unused when temperature == 0).
        temperature: >= 0.
        top_k: None, or the number of highest logits to keep, in [1, vocab].
        top_p: None, or the nucleus' probability mass, in (0, 1].

    Returns:
        [B] int32 token ids.
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, filtered_logits(logits, temperature, top_k, top_p), axis=-1).astype(jnp.int32)


def filtered_logits(logits, temperature: float, top_k: int | None, top_p: float | None):
    """The logits :func:`sample_logits` samples from (temperature > 0): float32, divided by the
    temperature, -inf outside the top_k tokens and the top_p nucleus. logits: [..., vocab]."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


# The two steps of generate(), compiled; ``ctx``: the dispatch context to run under (part of the cache key).
@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7), static_argnames=("ctx", "kascade"))
def prefill_sample(
    graphdef, state, ids, lengths, max_length, temperature, top_k, top_p, rng, ctx=("auto", None), kascade=None
):
    """:meth:`KDAForCausalLM.prefill` of ``ids`` [B, T] (row b's ``lengths[b]`` tokens first) into
    a fresh cache of ``max_length`` tokens, then :func:`sample_logits` at each row's last token.

    Returns:
        (tokens [B] int32, the :class:`ModelCache`).
    """
    model = nnx.merge(graphdef, state)
    with dispatch.restored(ctx):
        logits, cache = model.prefill(ids, model.init_cache(ids.shape[0], max_length), lengths, kascade)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return sample_logits(last, rng, temperature, top_k, top_p), cache


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6), static_argnames=("ctx", "kascade"), donate_argnums=(3,))
def decode_sample(graphdef, state, tokens, cache, temperature, top_k, top_p, rng, ctx=("auto", None), kascade=None):
    """:meth:`KDAForCausalLM.decode` of ``tokens`` [B], then :func:`sample_logits`; ``cache`` is
    donated.

    Returns:
        (tokens [B] int32, the advanced :class:`ModelCache`).
    """
    with dispatch.restored(ctx):
        logits, cache = nnx.merge(graphdef, state).decode(tokens, cache, kascade)
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


def buckets(prompt_length: int, max_new_tokens: int) -> tuple[int, int]:
    """The padded shapes :func:`generate` compiles for: (prompt bucket, cache length), powers of
    two (at least 16 and 64), so prompts and ``max_new_tokens`` within a bucket reuse one
    compiled prefill and decode step."""
    prompt = max(16, 1 << (prompt_length - 1).bit_length())
    total = max(prompt, prompt_length + max_new_tokens)
    return prompt, max(64, 1 << (total - 1).bit_length())


def stream(model: KDAForCausalLM, input_ids, max_new_tokens: int, **options):
    """:func:`generate`, one step at a time: returns an iterator over each step's new tokens,
    [B] int32 jax arrays (up to ``max_new_tokens`` of them, fewer when every row has emitted
    ``eos_token_id``). ``options`` are generate()'s keywords, with its defaults; the arguments
    and errors are generate()'s, checked at the call."""
    keywords = {n: p.default for n, p in inspect.signature(generate).parameters.items() if p.kind is p.KEYWORD_ONLY}
    if set(options) - set(keywords):
        raise ValueError(f"options: expected generate()'s keywords {sorted(keywords)}, got {sorted(options)}")
    return _start(model, input_ids, max_new_tokens, **{**keywords, **options})


def _start(model, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, attention_mask, rng, kascade):
    """:func:`stream` with every option given."""
    _check_args(model, max_new_tokens, temperature, top_k, top_p, eos_token_id, rng)
    model._check_kascade(kascade)
    B, T = _check_ids(input_ids, model.config.vocab_size)
    ids = np.asarray(input_ids).astype(np.int32)  # prepared on the host: nothing here compiles per shape
    if attention_mask is None:
        lengths = np.full((B,), T, np.int32)
    else:
        mask = _check_mask(attention_mask, (B, T))
        ids = np.take_along_axis(ids, np.argsort(~mask, axis=1, kind="stable"), axis=1)
        lengths = mask.sum(axis=1).astype(np.int32)
    prompt, max_length = buckets(T, max_new_tokens)
    ids = np.pad(ids, ((0, 0), (0, prompt - T)))  # each row's tokens first, then padding: lengths say where
    options = (float(temperature), top_k, None if top_p is None else float(top_p))
    rng = jax.random.key(0) if rng is None else rng
    return _steps(model, ids, lengths, max_length, max_new_tokens, options, eos_token_id, rng, kascade)


def _steps(model, ids, lengths, max_length, max_new_tokens, options, eos_token_id, rng, kascade):
    """:func:`stream`'s iterator, on checked and padded inputs."""
    if max_new_tokens == 0:
        return
    graphdef, state = nnx.split(model)
    ctx = dispatch.context()
    token, cache = prefill_sample(
        graphdef, state, ids, lengths, max_length, *options, jax.random.fold_in(rng, 0), ctx=ctx, kascade=kascade
    )
    done = jnp.zeros((ids.shape[0],), bool)
    for i in range(1, max_new_tokens + 1):
        if eos_token_id is not None:
            token = jnp.where(done, eos_token_id, token)
            done = done | (token == eos_token_id)
        yield token
        if i == max_new_tokens or (eos_token_id is not None and bool(done.all())):
            return
        key = jax.random.fold_in(rng, i)
        token, cache = decode_sample(graphdef, state, token, cache, *options, key, ctx=ctx, kascade=kascade)


def generate(
    model: KDAForCausalLM,
    input_ids,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    attention_mask=None,
    rng=None,
    kascade=None,
):
    """Extend each prompt by up to ``max_new_tokens`` tokens: a chunked prefill, then one
    compiled decode step per token.

    Compiled once per bucket (:func:`buckets`): prompts are padded to a power of two and the
    caches hold a power of two of tokens, so another prompt length or ``max_new_tokens`` in the
    same bucket (and batch size and options) compiles nothing. :func:`stream` yields the tokens
    as they come.

    Once a row emits ``eos_token_id`` it emits only eos_token_id; the loop stops when every
    row has (the remaining columns are eos_token_id).

    Args:
        model: the :class:`KDAForCausalLM`.
        input_ids: [B, T] ints in [0, vocab_size).
        max_new_tokens: the tokens to add, an int >= 0.
        temperature: a finite float >= 0: 0 for greedy decoding, else the sampling
            temperature (see :func:`sample_logits`).
        top_k: None, or keep the top_k most likely tokens, in [1, vocab_size].
        top_p: None, or keep the smallest set of tokens whose probability reaches top_p, in
            (0, 1].
        eos_token_id: None, or the token in [0, vocab_size) that ends a row
            (``model.config.eos_token_id`` is not used).
        attention_mask: [B, T], 1 on tokens and 0 on padding (left or right; each row's
            tokens may sit anywhere), or None.
        rng: a jax.random key, required when temperature > 0 (step i samples with
            ``fold_in(rng, i)``).
        kascade: a :class:`kdax.KascadeSchedule` of the model's full-attention layers: its
            anchors select keys in the prefill and in every decode step, the layers between
            reuse them; None: dense attention.

    Returns:
        [B, T + max_new_tokens] int32: input_ids as given, then the new tokens.

    Raises:
        ValueError: ``model`` is not a KDAForCausalLM; ``max_new_tokens``, ``temperature``,
            ``top_k``, ``top_p`` or ``eos_token_id`` is out of the range above; ``rng`` is
            None with temperature > 0; ``input_ids`` is not a [B, T] integer array with
            T >= 1 and ids in [0, vocab_size); ``attention_mask`` is not [B, T] or has a row
            without a token; ``kascade`` is not a schedule of the model's full-attention layers.
    """
    steps = stream(
        model,
        input_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id,
        attention_mask=attention_mask,
        rng=rng,
        kascade=kascade,
    )
    new = [np.asarray(t) for t in list(steps)]  # stacked on the host: no compile per length
    ids = np.asarray(input_ids).astype(np.int32)
    new = np.stack(new, axis=1) if new else np.zeros((ids.shape[0], 0), np.int32)
    if new.shape[1] < max_new_tokens:
        new = np.pad(new, ((0, 0), (0, max_new_tokens - new.shape[1])), constant_values=eos_token_id)
    return jax.device_put(np.concatenate([ids, new], axis=1))
