"""Continuous batching over :func:`kdax.serving.step`: requests join and leave between steps,
prompts are prefilled in chunks beside other requests' decode tokens, pages are allocated as
requests grow, and (optionally) draft tokens are verified and prompts' prefixes cached.
Greedy decoding or sampling (drafts verified by speculative sampling); the host-side
bookkeeping of a small engine (docs/serving.md)."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdax.models.generation import filtered_logits, sample_logits
from kdax.models.kda import KDAForCausalLM, is_kda
from kdax.ops.common import dispatch
from kdax.serving.step import Batch, _compiled, copy_slots, init_pool


@dataclasses.dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    eos: int | None
    group: int = -1  # its slots: group * width .. + width - 1
    pos: int = 0  # tokens in its cache
    source: int = -1  # the slot its next step starts from
    pages: list[int] = dataclasses.field(default_factory=list)
    out: list[int] = dataclasses.field(default_factory=list)

    def done(self) -> bool:
        return len(self.out) >= self.max_new_tokens or (bool(self.out) and self.out[-1] == self.eos)


_sample = jax.jit(sample_logits, static_argnums=(2, 3, 4))


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def speculative_sample(logits, tokens, counts, rng, temperature: float, top_k: int | None, top_p: float | None):
    """Verify draft tokens so that the tokens emitted are distributed as plain decoding's
    (:func:`kdax.models.generation.sample_logits` token by token), whatever the draft.

    A row holds its last emitted token, then ``counts - 1`` draft tokens proposed with certainty
    (a draft without probabilities, as :func:`prompt_lookup`). Let p_i be the distribution
    sampling draws from at row position i (one-hot at the argmax when greedy). The draft token
    after position i is accepted with probability p_i(draft); at the first rejection a token is
    drawn from p_i without the draft token (the residual max(p - q, 0) of a one-hot q,
    renormalised), and if every draft token is accepted one more is drawn from the next p_i.

    Args:
        logits: [N, C, vocab] at every row position.
        tokens: [N, C] the rows' tokens; counts: [N] in [1, C], the tokens of each row.
        rng: a jax.random key.
        temperature, top_k, top_p: as :func:`kdax.models.generation.sample_logits`.

    Returns:
        (accepted [N] int32: the row tokens whose states are kept, 1 + the drafts accepted;
        new [N, C] int32: the tokens emitted, the first ``accepted`` of each row).
    """
    N, C, V = logits.shape
    if temperature == 0:
        logp = jnp.where(jax.nn.one_hot(jnp.argmax(logits, -1), V) > 0, 0.0, -jnp.inf)
    else:
        logp = jax.nn.log_softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1)
    drafts = jnp.concatenate([tokens[:, 1:], jnp.zeros((N, 1), tokens.dtype)], axis=1)  # checked at position i
    p_draft = jnp.exp(jnp.take_along_axis(logp, drafts[..., None], axis=-1)[..., 0])
    at_draft = jnp.arange(C)[None] < (counts - 1)[:, None]
    take, draw = jax.random.split(rng)
    ok = at_draft & (jax.random.uniform(take, (N, C)) < p_draft)
    j = jnp.argmin(ok, axis=1)  # the first position that accepts nothing (its draft rejected, or none left)
    logp_j = jnp.take_along_axis(logp, j[:, None, None], axis=1)[:, 0]
    rejected = jnp.take_along_axis(at_draft, j[:, None], axis=1)
    drop = rejected & (jnp.arange(V)[None] == jnp.take_along_axis(drafts, j[:, None], axis=1))
    last = jax.random.categorical(draw, jnp.where(drop, -jnp.inf, logp_j), axis=-1)
    pos = jnp.arange(C)[None]
    new = jnp.where(pos < j[:, None], drafts, jnp.where(pos == j[:, None], last[:, None], 0))
    return (j + 1).astype(jnp.int32), new.astype(jnp.int32)


def prompt_lookup(tokens: Sequence[int], k: int, n: int = 2) -> list[int]:
    """A draft without a draft model: the k tokens that followed the last earlier occurrence of
    the context's last ``n`` tokens (empty if none).

    Args:
        tokens: the request's tokens so far (prompt and output).
        k: the most draft tokens.
        n: the n-gram to match.

    Returns:
        Up to k token ids.
    """
    tail = list(tokens[-n:])
    for i in range(len(tokens) - n - 1, -1, -1):
        if list(tokens[i : i + n]) == tail:
            return list(tokens[i + n : i + n + k])
    return []


class Scheduler:
    """Serve requests with one compiled :func:`kdax.serving.step` per step.

    Each step takes every running request (at most ``max_requests``): a request still in its
    prompt contributes its next ``chunk_size`` tokens, a decoding one its last token (and, with
    ``draft``, up to ``num_draft`` draft tokens to verify when no prompt is in the step; a step in
    which the draft proposes nothing is a plain decode step). Steps
    compile once per (rows, tokens per row) bucket: rows one of ``row_buckets``, tokens per row 1,
    ``num_draft + 1`` or ``chunk_size``.

    Args:
        model: the model.
        max_requests: the requests served at once (others wait).
        max_length: the most tokens (prompt and output) of a request.
        page_size: tokens per page of the softmax layers' caches.
        chunk_size: the prompt tokens a request prefills per step, a multiple of ``page_size``.
        num_pages: the pages per softmax layer (default: enough for ``max_requests`` requests
            of ``max_length`` tokens and the prefix cache's).
        draft: None, or ``draft(tokens, k) -> list[int]`` proposing up to k next tokens
            (:func:`prompt_lookup`); verification (:func:`speculative_sample`) keeps the tokens
            distributed as plain decoding's: greedy decoding's own tokens, or samples of its
            distribution.
        num_draft: the most draft tokens per step.
        prefix_cache: the prompt prefixes kept (0: none): after a prefill chunk, the state at
            that boundary (KDA and convolution states, and the pages before it, shared) is kept;
            a later prompt with the same prefix starts there.
        row_buckets: the rows a step may have, increasing, the last ``max_requests`` (default:
            the powers of two below it, then it): a step runs the least that holds its requests.
        temperature, top_k, top_p: 0 for greedy decoding, else sampling as
            :func:`kdax.models.generate` samples (:func:`kdax.models.generation.sample_logits`),
            with drafts too.
        seed: the sampling's random seed.

    Raises:
        ValueError: a size that is not a positive int, ``chunk_size`` not a multiple of
            ``page_size``, ``row_buckets`` not increasing up to ``max_requests``, or sampling
            options out of range.
    """

    def __init__(
        self,
        model: KDAForCausalLM,
        *,
        max_requests: int = 8,
        max_length: int = 512,
        page_size: int = 16,
        chunk_size: int = 64,
        num_pages: int | None = None,
        draft: Callable[[list[int], int], list[int]] | None = None,
        num_draft: int = 4,
        prefix_cache: int = 0,
        row_buckets: Sequence[int] | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
    ):
        for name, n in (("max_requests", max_requests), ("max_length", max_length), ("page_size", page_size)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{name}: expected a positive int, got {n!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size % page_size:
            raise ValueError(f"chunk_size: expected a positive multiple of page_size={page_size}, got {chunk_size!r}")
        if draft is not None and (not isinstance(num_draft, int) or num_draft < 1):
            raise ValueError(f"num_draft: expected a positive int with a draft, got {num_draft!r}")
        if not isinstance(prefix_cache, int) or prefix_cache < 0:
            raise ValueError(f"prefix_cache: expected an int >= 0, got {prefix_cache!r}")
        if row_buckets is None:
            row_buckets = [1 << i for i in range(max_requests.bit_length()) if 1 << i < max_requests] + [max_requests]
        row_buckets = tuple(row_buckets)
        if (
            not row_buckets
            or row_buckets[-1] != max_requests
            or any(a >= b for a, b in zip(row_buckets, row_buckets[1:]))
        ):
            raise ValueError(
                f"row_buckets: expected increasing ints ending at max_requests={max_requests}, got {row_buckets}"
            )
        self.row_buckets = row_buckets
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
            raise ValueError(f"temperature: expected a finite float >= 0, got {temperature!r}")
        if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= model.config.vocab_size):
            raise ValueError(f"top_k: expected None or an int in [1, {model.config.vocab_size}], got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p: expected None or a float in (0, 1], got {top_p!r}")
        self._sampling = (float(temperature), top_k, None if top_p is None else float(top_p))
        self._rng = jax.random.key(seed)
        self.model, self.max_requests, self.max_length = model, max_requests, max_length
        self.page_size, self.chunk_size = page_size, chunk_size
        self.draft, self.num_draft = draft, num_draft if draft is not None else 0
        self.width = self.num_draft + 1  # slots per request: one per verified token
        self.max_pages = -(-max_length // page_size)
        kept = prefix_cache * (-(-max_length // chunk_size)) * (chunk_size // page_size)
        num_pages = max_requests * self.max_pages + kept if num_pages is None else num_pages
        self.prefix_slots = range(
            max_requests * self.width, max_requests * self.width + prefix_cache
        )  # after the groups'
        self.pool = init_pool(model, self.prefix_slots.stop, num_pages, page_size)
        self.has_pages = any(not is_kda(b) for b in model.model.layers)
        self._graphdef, self._state = nnx.split(model)
        self._free_groups = list(range(max_requests))
        self._free_pages = list(range(num_pages))
        self._refs = collections.Counter()
        self._prefixes: collections.OrderedDict[tuple, tuple[int, list[int]]] = collections.OrderedDict()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._next_id = 0
        self.steps = collections.Counter()  # steps run per (rows, tokens per row, verify)
        self.prefix_hits = 0
        self.drafted = self.accepted = 0  # draft tokens proposed and accepted

    def add(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None) -> int:
        """Queue a request; it joins at the next step with room.

        Args:
            prompt: its token ids (at least one).
            max_new_tokens: the tokens to generate, >= 1.
            eos_token_id: None, or the token that ends it.

        Returns:
            The request's id.

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary, or more than max_length tokens.
        """
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt: expected at least one token id in [0, {vocab}), got {prompt[:8]}...")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens + self.num_draft > self.max_length:
            raise ValueError(
                f"prompt: expected len(prompt) + max_new_tokens + num_draft <= max_length={self.max_length}, "
                f"got {len(prompt)} + {max_new_tokens} + {self.num_draft}"
            )
        request = _Request(self._next_id, prompt, max_new_tokens, eos_token_id)
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    @property
    def idle(self) -> bool:
        """Whether no request is waiting or running."""
        return not self._waiting and not self._running

    def run(self) -> dict[int, list[int]]:
        """Step until every request is done.

        Returns:
            {request id: its generated tokens} for the requests done in these steps.
        """
        done: dict[int, list[int]] = {}
        while not self.idle:
            done.update(self.step()[1])
        return done

    def step(self) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Admit waiting requests, run one compiled step, retire finished requests.

        Returns:
            ({request id: the tokens it emitted in this step}, {request id: all its tokens} for
            the requests that finished).
        """
        self._admit()
        if not self._running:
            return {}, {}
        prefilling = any(r.pos < len(r.prompt) for r in self._running)
        rows = []
        for r in self._running:
            if r.pos < len(r.prompt):
                tokens = r.prompt[r.pos : r.pos + self.chunk_size]
            else:
                tokens = [r.out[-1]]
                if self.draft is not None and not prefilling:
                    budget = min(self.num_draft, r.max_new_tokens - len(r.out) - 1)
                    tokens += list(self.draft(r.prompt + r.out, budget))[: max(budget, 0)] if budget > 0 else []
            self._grow(r, r.pos + len(tokens))
            rows.append(tokens)
        verify = not prefilling and any(len(tokens) > 1 for tokens in rows)  # no draft tokens: a plain decode step
        C = self.chunk_size if prefilling else self.width if verify else 1
        N = next(n for n in self.row_buckets if n >= len(rows))
        batch = self._batch(rows, N, C)
        self.steps[(N, C, verify)] += 1
        logits, self.pool = _compiled(self._graphdef, self._state, self.pool, batch, verify, dispatch.context())
        self._rng, key = jax.random.split(self._rng)
        if verify:
            accepted, new = map(
                np.asarray, speculative_sample(logits, batch.tokens, batch.counts, key, *self._sampling)
            )
            predicted = [row[:a] for row, a in zip(new, accepted)]
        else:
            predicted = np.asarray(_sample(logits, key, *self._sampling))[:, None]
        emitted = {}
        for n, (r, tokens) in enumerate(zip(self._running, rows)):
            emitted[r.id] = self._advance(r, tokens, predicted[n])
        finished = {r.id: r.out for r in self._running if r.done()}
        for r in [r for r in self._running if r.done()]:
            self._retire(r)
        return emitted, finished

    def _advance(self, r: _Request, tokens: list[int], predicted) -> list[int]:
        """Move a request past its row's tokens, given the tokens the step emits for it (one, or
        in a verify step 1 + the drafts accepted); the tokens it emits."""
        base = r.group * self.width
        r.source = base
        if r.pos < len(r.prompt):
            r.pos += len(tokens)
            self._keep_prefix(r)
            new = [int(predicted[0])] if r.pos == len(r.prompt) else []
        else:
            accepted = len(predicted)  # the row's last emitted token and the drafts kept
            new = [int(t) for t in predicted]
            self.drafted, self.accepted = self.drafted + len(tokens) - 1, self.accepted + accepted - 1
            r.pos += accepted
            r.source = base + accepted - 1  # the state after the last accepted token
        new = new[: r.max_new_tokens - len(r.out)]
        if r.eos is not None and r.eos in new:
            new = new[: new.index(r.eos) + 1]
        r.out.extend(new)
        return new

    def _batch(self, rows: list[list[int]], N: int, C: int) -> Batch:
        tokens = np.zeros((N, C), np.int32)
        counts, slots, sources, starts = (np.zeros(N, np.int32) for _ in range(4))
        slots[:], sources[:] = -1, -1
        pages = np.full((N, self.max_pages), -1, np.int32)
        for n, (r, row) in enumerate(zip(self._running, rows)):
            tokens[n, : len(row)] = row
            counts[n], slots[n], sources[n], starts[n] = len(row), r.group * self.width, r.source, r.pos
            pages[n, : len(r.pages)] = r.pages
        return Batch(*(jnp.asarray(x) for x in (tokens, counts, slots, sources, starts, pages)))

    def _admit(self) -> None:
        while self._waiting and self._free_groups:
            r = self._waiting.popleft()
            r.group = self._free_groups.pop(0)
            r.source = -1  # a fresh state (the group's slots hold an earlier request's)
            hit = self._lookup(r.prompt)
            if hit is not None:
                length, (slot, pages) = hit
                r.pos, r.source, r.pages = length, slot, list(pages)
                self._refs.update(pages)
                self.prefix_hits += 1
            self._running.append(r)

    def _grow(self, r: _Request, length: int) -> None:
        """Give the request the pages that hold ``length`` tokens."""
        if not self.has_pages:
            return
        while len(r.pages) * self.page_size < length:
            if not self._free_pages:
                self._evict_prefix()
            page = self._free_pages.pop(0)
            self._refs[page] += 1
            r.pages.append(page)

    def _release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                self._free_pages.append(p)

    def _retire(self, r: _Request) -> None:
        self._running.remove(r)
        self._release(r.pages)
        self._free_groups.append(r.group)

    def _lookup(self, prompt: list[int]):
        """The longest kept prefix shorter than the prompt: (its length, (slot, pages)), or None."""
        for length in range((len(prompt) - 1) // self.chunk_size * self.chunk_size, 0, -self.chunk_size):
            entry = self._prefixes.get(tuple(prompt[:length]))
            if entry is not None:
                self._prefixes.move_to_end(tuple(prompt[:length]))
                return length, entry
        return None

    def _keep_prefix(self, r: _Request) -> None:
        """After a prefill chunk that ends at a chunk boundary inside the prompt, keep the state there."""
        if not self.prefix_slots or r.pos % self.chunk_size or r.pos >= len(r.prompt):
            return
        key = tuple(r.prompt[: r.pos])
        if key in self._prefixes:
            return
        if len(self._prefixes) == len(self.prefix_slots):
            self._evict_prefix()
        used = {slot for slot, _ in self._prefixes.values()}
        slot = next(s for s in self.prefix_slots if s not in used)
        self.pool = copy_slots(self.pool, jnp.asarray([r.group * self.width]), jnp.asarray([slot]))
        pages = r.pages[: r.pos // self.page_size]
        self._refs.update(pages)
        self._prefixes[key] = (slot, pages)

    def step_memory(self, rows: int, tokens: int, verify: bool = False) -> int:
        """The compiled step's temporary bytes for ``rows`` rows of ``tokens`` tokens (beyond the
        pool, which is donated and updated in place; compiles the step if not yet compiled)."""
        batch = self._batch([], rows, tokens)  # idle rows: the step's shapes
        lowered = _compiled.lower(self._graphdef, self._state, self.pool, batch, verify, dispatch.context())
        return lowered.compile().memory_analysis().temp_size_in_bytes

    def _evict_prefix(self) -> None:
        if not self._prefixes:
            raise RuntimeError("out of pages: raise num_pages")
        _, (_, pages) = self._prefixes.popitem(last=False)
        self._release(pages)
