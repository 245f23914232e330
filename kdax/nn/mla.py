"""Multi-head latent attention (MLA, DeepSeek-V2/V3), the full-attention layers of Kimi Linear and
the Ling hybrids.

Keys and values come from one compressed latent per token, ``c = RMSNorm(x W_a)`` of width
``kv_lora_rank`` (r), plus one key part ``k_rope`` of width ``qk_rope_head_dim`` shared by all
heads (with RoPE on it and on the queries' matching part, or none: Kimi's NoPE). Head h's key is
``[c W_uk[h], k_rope]`` and its value ``c W_uv[h]`` (``kv_b_proj`` = [W_uk | W_uv] per head).

Prefill runs the expanded form (per-head keys and values, what the FLOPs favour over many
queries). The cache keeps only ``c`` and ``k_rope``, (r + dr) numbers a token instead of
``num_heads * (qk_head_dim + v_head_dim)``, and decoding runs the absorbed form over it: the
query's no-RoPE part is moved into latent space (``q W_uk[h]^T``, [r] per head), scores are
``q_lat . c + q_rope . k_rope``, the softmax-weighted latents are moved back by ``W_uv[h]``.
The two forms differ by float rounding only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdax.nn.attention import KascadeStep, _slot_positions, kascade_attend, kascade_keys, rope, store_tokens
from kdax.nn.norm import RMSNorm
from kdax.ops.mla.api import paged_latent_attention


class MLA(nnx.Module):
    """Multi-head latent attention: x [B, T, hidden_size] -> [B, T, hidden_size], causal,
    scores and softmax in float32 (float64 for float64 inputs), scale ``qk_head_dim ** -0.5``.

    Parameters carry transformers' names (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, ``g_proj``).

    Args:
        hidden_size: the input and output size.
        num_heads: the attention heads.
        kv_lora_rank: r, the latent's width.
        qk_nope_head_dim: the per-head key/query part without RoPE.
        qk_rope_head_dim: dr, the shared key part (and the queries' matching part).
        v_head_dim: the value head dim.
        q_lora_rank: None (one query projection) or the rank of the low-rank query
            (``q_b_proj(RMSNorm(q_a_proj(x)))``).
        rope_theta: None (no RoPE: Kimi Linear) or RoPE's base, applied to the rope parts in
            DeepSeek's interleaved layout (pairs of adjacent features).
        output_gate: a head-wise gate ``sigmoid(g_proj(x))`` on each head's output (Ling).
        attention_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
        layer_idx: stored, the layer's index in a model.
        norm_eps: the epsilon of the latent projections' RMSNorms (q_a, kv_a; GLM-5: 1e-5).
        rngs: the parameters' random keys.

    Raises:
        ValueError: a size that is not a positive int (``qk_rope_head_dim`` may be 0 without
            RoPE), an odd ``qk_rope_head_dim`` with RoPE, ``rope_theta`` not None or positive.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope_theta: float | None = None,
        output_gate: bool = False,
        attention_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-6,
        rngs: nnx.Rngs,
    ):
        sizes = {
            "hidden_size": hidden_size,
            "num_heads": num_heads,
            "kv_lora_rank": kv_lora_rank,
            "qk_nope_head_dim": qk_nope_head_dim,
            "v_head_dim": v_head_dim,
        }
        if q_lora_rank is not None:
            sizes["q_lora_rank"] = q_lora_rank
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if rope_theta is not None and not rope_theta > 0:
            raise ValueError(f"rope_theta: expected None or a positive float, got {rope_theta!r}")
        if qk_rope_head_dim < 0 or (rope_theta is not None and (qk_rope_head_dim < 2 or qk_rope_head_dim % 2)):
            raise ValueError(f"qk_rope_head_dim: expected an even positive int with RoPE, got {qk_rope_head_dim}")
        self.num_heads, self.kv_lora_rank, self.v_head_dim = num_heads, kv_lora_rank, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_theta, self.layer_idx = rope_theta, layer_idx
        self.num_kv_heads, self.window_size = num_heads, None  # what the model's Kascade checks read
        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)
        q_dim = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = linear(hidden_size, q_dim)
        else:
            self.q_a_proj = linear(hidden_size, q_lora_rank, attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = linear(q_lora_rank, q_dim)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = linear(hidden_size, kv_lora_rank + qk_rope_head_dim, attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = linear(num_heads * v_head_dim, hidden_size, attention_bias)
        self.g_proj = linear(hidden_size, num_heads) if output_gate else None

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
        """Zeroed latent cache for rows of up to ``max_length`` tokens.

        Returns:
            (latent [batch_size, max_length, 1, kv_lora_rank], k_rope [batch_size, max_length, 1,
            qk_rope_head_dim]) zeros in ``dtype``.
        """
        shape = (batch_size, max_length, 1)
        return jnp.zeros((*shape, self.kv_lora_rank), dtype), jnp.zeros((*shape, self.qk_rope_head_dim), dtype)

    def latents(self, x: jax.Array, positions: jax.Array):
        """Queries and the cached latents of ``x`` ([B, T, hidden_size]) at ``positions`` ([B, T]).

        Returns:
            (q_nope [B, T, heads, qk_nope_head_dim], q_rope [B, T, heads, dr], latent [B, T, 1, r],
            k_rope [B, T, 1, dr]), RoPE applied.
        """
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, T, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : self.kv_lora_rank])[:, :, None]
        k_rope = kv[..., self.kv_lora_rank :][:, :, None]
        if self.rope_theta is not None:
            q_rope, k_rope = (rope(_halves(r), positions, self.rope_theta) for r in (q_rope, k_rope))
        return q_nope, q_rope, latent, k_rope

    def expand(self, latent: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-head keys [B, S, heads, qk_head_dim] and values [B, S, heads, v_head_dim] of cached
        latents ([B, S, 1, r] and [B, S, 1, dr])."""
        w_uk, w_uv = (w.astype(latent.dtype) for w in self._kv_b())
        c, (B, S) = latent[:, :, 0], latent.shape[:2]
        k_nope = jnp.einsum("bsr,rhd->bshd", c, w_uk)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (B, S, self.num_heads, self.qk_rope_head_dim))], -1)
        return k, jnp.einsum("bsr,rhd->bshd", c, w_uv)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The expanded queries, keys and values of ``x`` ([B, T, hidden_size]) at ``positions``
        ([B, T]), as :meth:`kdax.nn.Attention.project` gives them.

        Returns:
            (q, k [B, T, heads, qk_head_dim], v [B, T, heads, v_head_dim]).
        """
        q_nope, q_rope, latent, k_rope = self.latents(x, positions)
        return jnp.concatenate([q_nope, q_rope], -1), *self.expand(latent, k_rope)

    def _kv_b(self):
        """kv_b_proj's kernel as (W_uk [r, heads, qk_nope_head_dim], W_uv [r, heads, v_head_dim])."""
        w = self.kv_b_proj.kernel[...].reshape(self.kv_lora_rank, self.num_heads, -1)
        return w[..., : self.qk_nope_head_dim], w[..., self.qk_nope_head_dim :]

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None, kascade=None):
        """Attend causally within each row (or segment), optionally continuing from a cache; the
        same contract as :meth:`kdax.nn.Attention.__call__` (one token over a cache runs the
        absorbed form, everything else the expanded one).

        Args:
            x: [B, T, hidden_size].
            positions: [B, T] int positions (default 0..T-1).
            segment_ids: [B, T] ints, or None; tokens attend only within their segment.
            cache: None, or the (latent, k_rope) of :meth:`init_cache` (or of an earlier call).
            kascade: None (dense attention), or the :class:`kdax.nn.KascadeStep` this layer runs
                over the expanded keys and values (values padded to the key width): over the
                tokens of ``x`` (prefill; an empty cache), or one token over the cache (decode,
                T = 1; the cache is expanded for the op).

        Returns:
            (y [B, T, hidden_size] in the dtype x and the weights promote to, the updated cache
            or None without ``cache``); with ``kascade``, a third item: an anchor's selection
            (None for a reuse layer).
        """
        B, T, _ = x.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        q_nope, q_rope, latent, k_rope = self.latents(x, positions)
        if kascade is not None:
            return self._kascade(x, q_nope, q_rope, latent, k_rope, positions, segment_ids, cache, kascade)
        if cache is None:
            allowed = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
            allowed = jnp.broadcast_to(allowed, (B, T, T))
            if segment_ids is not None:
                allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
        else:
            cache, n = store_tokens(positions, segment_ids, cache, (latent, k_rope))
            key_pos = _slot_positions(positions[:, :1] + n - 1, cache[0].shape[1])
            latent, k_rope = (c.astype(x.dtype) for c in cache)
            allowed = (positions[:, :, None] >= key_pos[:, None, :]) & (key_pos >= 0)[:, None, :]
        f32 = lambda a: a.astype(jnp.promote_types(x.dtype, jnp.float32))  # float32, or float64 inputs' own
        if cache is not None and T == 1:  # absorbed: the query moves to latent space, the cache stays compressed
            w_uk, w_uv = (f32(w) for w in self._kv_b())
            c = f32(latent[:, :, 0])  # [B, S, r]
            q_lat = jnp.einsum("bthd,rhd->bthr", f32(q_nope), w_uk)
            scores = jnp.einsum("bthr,bsr->bhts", q_lat, c) + jnp.einsum(
                "bthd,bsd->bhts", f32(q_rope), f32(k_rope[:, :, 0])
            )
        else:  # expanded: per-head keys and values from the latents
            k, v = self.expand(f32(latent), f32(k_rope))
            scores = jnp.einsum("bthd,bshd->bhts", f32(jnp.concatenate([q_nope, q_rope], -1)), k)
        p = jax.nn.softmax(jnp.where(allowed[:, None], scores * self.qk_head_dim**-0.5, -jnp.inf), axis=-1)
        if cache is not None and T == 1:
            o = jnp.einsum("bthr,rhd->bthd", jnp.einsum("bhts,bsr->bthr", p, c), w_uv)
        else:
            o = jnp.einsum("bhts,bshd->bthd", p, v)
        return self._out(x, o), cache

    def paged(self, x, q_nope, q_rope, pages, page_table, query_start_loc, seq_lens, *, backend: str = "auto"):
        """The absorbed form over a paged cache, for a serving engine's step of ragged requests
        (:func:`kdax.ops.mla.api.paged_latent_attention`; the step's own entries in the pages already).

        Args:
            x: [1, T, hidden_size], the layer's input (the output gate reads it).
            q_nope, q_rope: [1, T, heads, ...] of :meth:`latents`.
            pages: [P, page, W], entries ``[latent, k_rope]`` then padding (W >= r + dr).
            page_table, query_start_loc, seq_lens: the requests' pages [R, M], tokens [R + 1] and
                lengths after the step [R].
            backend: the op's backend.

        Returns:
            y [1, T, hidden_size].
        """
        f32 = lambda a: a.astype(jnp.promote_types(x.dtype, jnp.float32))
        w_uk, w_uv = (f32(w) for w in self._kv_b())
        q = jnp.concatenate([jnp.einsum("thd,rhd->thr", f32(q_nope[0]), w_uk), f32(q_rope[0])], -1)
        scale = self.qk_head_dim**-0.5
        o = paged_latent_attention(q, pages, page_table, query_start_loc, seq_lens, scale=scale, backend=backend)
        return self._out(x, jnp.einsum("thr,rhd->thd", o[..., : self.kv_lora_rank], w_uv)[None])

    def _out(self, x, o):
        """The output projection of the heads' outputs o [B, T, heads, v_head_dim] (gated)."""
        if self.g_proj is not None:
            o = o * jax.nn.sigmoid(self.g_proj(x).astype(o.dtype))[..., None]
        return self.o_proj(o.reshape(*x.shape[:2], -1).astype(x.dtype))

    def _kascade(self, x, q_nope, q_rope, latent, k_rope, positions, segment_ids, cache, step: KascadeStep):
        """The Kascade path of :meth:`__call__`: keys and values expanded, values zero-padded (or
        queries and keys, whichever is narrower) to one width D, the scale kept qk_head_dim ** -0.5."""
        lengths, decode, cache = kascade_keys(positions, segment_ids, cache, (latent, k_rope))
        if decode:
            latent, k_rope = (c.astype(x.dtype) for c in cache)
        k, v = self.expand(latent, k_rope)
        q = jnp.concatenate([q_nope, q_rope], -1)
        D = max(self.qk_head_dim, self.v_head_dim)
        q, k, v = (jnp.pad(a, [(0, 0)] * 3 + [(0, D - a.shape[-1])]) for a in (q, k, v))
        o, indices = kascade_attend(q, k, v, lengths, step, decode=decode, scale=self.qk_head_dim**-0.5)
        return self._out(x, o[..., : self.v_head_dim]), cache, indices


def _halves(x: jax.Array) -> jax.Array:
    """DeepSeek's interleaved RoPE layout as the halves one: features (0, 2, 4, ..., 1, 3, 5, ...)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
