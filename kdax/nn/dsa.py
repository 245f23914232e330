"""DSA indexed attention (GLM-5.3-Flash's "indexed_attention" layers): NoPE multi-head latent
attention over the keys a lightning indexer selects.

The indexer scores pools of ``kpool`` keys per query (:func:`kdax.index_select`): its own query
heads (from the MLA's low-rank query), one key head normalised by a LayerNorm, per-head weights,
and a learned per-channel softmax pooling of each pool's keys. Each query attends the keys of its
``topk / kpool`` best pools and of its own incomplete pool (:func:`kdax.indexed_attention`), in the
absorbed form: the query is moved into latent space, the keys and values are the cached latents
(one "head" shared by all query heads), and the weighted latents are moved back per head. A layer
whose indexer is "shared" reuses the selection of the layer before it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdax.nn.attention import _row_tokens, store_tokens
from kdax.nn.mla import MLA
from kdax.ops.kascade.api import index_select, indexed_attention


class Indexer(nnx.Module):
    """The lightning indexer's parameters and projections (transformers' names).

    Args:
        hidden_size: the layer's input size.
        q_lora_rank: the MLA's low-rank query width (the indexer's queries come from it).
        heads: Hi, the index heads.
        head_dim: d, the index head dim.
        kpool: keys per pool.
        rngs: the parameters' random keys.

    Parameters: ``wq_b`` [q_lora_rank, Hi d], ``wk`` [hidden, d], ``k_norm`` (LayerNorm, epsilon
    1e-6), ``weights_proj`` [hidden, Hi], ``index_kpool_compress_ape`` [kpool, d] (zeros) and
    ``index_kpool_compress_gate`` [d, hidden] (ones), as the checkpoints store the last two.
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, kpool: int, *, rngs: nnx.Rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        self.heads, self.head_dim, self.kpool = heads, head_dim, kpool
        self.wq_b = linear(q_lora_rank, heads * head_dim)
        self.wk = linear(hidden_size, head_dim)
        self.k_norm = nnx.LayerNorm(head_dim, epsilon=1e-6, rngs=rngs)
        self.weights_proj = linear(hidden_size, heads)
        self.index_kpool_compress_ape = nnx.Param(jnp.zeros((kpool, head_dim)))
        self.index_kpool_compress_gate = nnx.Param(jnp.ones((head_dim, hidden_size)))

    def keys(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, hidden] -> (index keys, pooling logits), each [B, T, 1, d] (a cache's layout)."""
        k = self.k_norm(self.wk(x))
        gates = jnp.einsum("btc,dc->btd", x, self.index_kpool_compress_gate[...].astype(x.dtype))
        return k[:, :, None], gates.astype(k.dtype)[:, :, None]

    def queries(self, x: jax.Array, q_resid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(index queries [B, T, Hi, d], head weights [B, T, Hi] float32, scaled by Hi ** -0.5)."""
        B, T, _ = x.shape
        q = self.wq_b(q_resid).reshape(B, T, self.heads, self.head_dim)
        return q, self.weights_proj(x).astype(jnp.float32) * self.heads**-0.5


class IndexedMLA(MLA):
    """NoPE MLA over the keys an indexer selects: x [B, T, hidden_size] -> [B, T, hidden_size].

    Args:
        hidden_size, num_heads, kv_lora_rank, qk_nope_head_dim, v_head_dim, q_lora_rank,
            attention_bias, layer_idx, norm_eps: as :class:`kdax.nn.MLA` (no RoPE).
        index_heads, index_head_dim: the indexer's heads and head dim.
        index_topk: the keys selected in whole pools, a multiple of ``index_kpool``.
        index_kpool: keys per pool.
        index_tail: each query also attends its own incomplete pool.
        shared: the layer has no indexer and reuses the previous layer's selection.
        rngs: the parameters' random keys.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int,
        index_heads: int,
        index_head_dim: int,
        index_topk: int,
        index_kpool: int,
        index_tail: bool = True,
        shared: bool = False,
        attention_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        rngs: nnx.Rngs,
    ):
        super().__init__(
            hidden_size,
            num_heads,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=0,
            v_head_dim=v_head_dim,
            q_lora_rank=q_lora_rank,
            attention_bias=attention_bias,
            layer_idx=layer_idx,
            norm_eps=norm_eps,
            rngs=rngs,
        )
        self.index_topk, self.index_kpool, self.index_tail = index_topk, index_kpool, index_tail
        indexer = (
            None if shared else Indexer(hidden_size, q_lora_rank, index_heads, index_head_dim, index_kpool, rngs=rngs)
        )
        self.indexer = nnx.data(indexer)

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> tuple[jax.Array, ...]:
        """Zeroed caches: :meth:`kdax.nn.MLA.init_cache`'s (latent, k_rope), and with an indexer its
        index keys and pooling logits [batch_size, max_length, 1, d] (per token, as transformers
        keeps them; a pool's key is recomputed from them)."""
        cache = super().init_cache(batch_size, max_length, dtype)
        if self.indexer is None:
            return cache
        d = self.indexer.head_dim
        return (*cache, *(jnp.zeros((batch_size, max_length, 1, d), dtype) for _ in range(2)))

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None, indices=None):
        """Attend each query's selected keys: those of this call (no cache), or of the cache with
        this call's tokens stored (prefill into it, or decode).

        Args:
            x: [B, T, hidden_size].
            positions: [B, T] int positions (default 0..T-1); keys are each row's first segment.
            segment_ids: [B, T] ints, or None; row b's tokens are the segment of its first token.
            cache: None, or the tuple of :meth:`init_cache` (or of an earlier call).
            indices: a shared layer's selection [B, T, W] (from the layer before it); None with
                an indexer.

        Returns:
            (y [B, T, hidden_size], the updated cache or None, the selection [B, T, W] int32).
        """
        B, T, _ = x.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        q_resid, q_nope, new = self.entries(x)
        if cache is None:
            keys, lengths = new, _row_tokens(positions, segment_ids)[:, 0]
        else:
            cache, n = store_tokens(positions, segment_ids, cache, new)
            keys, lengths = cache, positions[:, 0] + n[:, 0]
        if self.indexer is not None:
            index_keys, gates = (a[:, :, 0] for a in keys[2:])
            indices = self.select(x, q_resid, index_keys, gates, positions, lengths)
        elif indices is None:
            raise ValueError(f"indices: layer {self.layer_idx} shares the previous layer's selection; got None")
        return self.attend(x, q_nope, keys[0], indices, lengths), cache, indices

    def entries(self, x: jax.Array):
        """The projections of x [B, T, hidden_size]: (the low-rank query q_resid [B, T, q_lora_rank],
        q_nope [B, T, heads, qk_nope_head_dim], the tokens' cache entries: latent [B, T, 1, r],
        k_rope [B, T, 1, 0], and with an indexer its keys and pooling logits [B, T, 1, d])."""
        B, T, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q_nope = self.q_b_proj(q_resid).reshape(B, T, self.num_heads, self.qk_head_dim)
        kv = self.kv_a_proj_with_mqa(x)
        new = (self.kv_a_layernorm(kv[..., : self.kv_lora_rank])[:, :, None], kv[..., self.kv_lora_rank :][:, :, None])
        if self.indexer is not None:
            new = (*new, *self.indexer.keys(jax.lax.stop_gradient(x)))
        return q_resid, q_nope, new

    def select(self, x, q_resid, index_keys, gates, positions, lengths, key_rows=None) -> jax.Array:
        """The indexer's selection (:func:`kdax.index_select`, no gradient) for the queries of x
        [B, T, hidden_size] at ``positions`` [B, T] over keys [Bk, S, d] (each row's first
        ``lengths`` [Bk] valid; ``key_rows`` [B, T]: the row each query reads, default its own):
        indices [B, T, W] int32."""
        stop = jax.lax.stop_gradient
        q_idx, weights = self.indexer.queries(stop(x), stop(q_resid))
        index_keys, gates = (stop(a).astype(q_idx.dtype) for a in (index_keys, gates))
        return index_select(
            q_idx,
            weights,
            index_keys,
            gates,
            self.indexer.index_kpool_compress_ape[...].astype(q_idx.dtype),
            topk=self.index_topk,
            kpool=self.index_kpool,
            tail=self.index_tail,
            q_positions=positions,
            lengths=lengths,
            key_rows=key_rows,
        )

    def attend(self, x, q_nope, latent, indices, lengths=None) -> jax.Array:
        """The layer's output [B, T, hidden_size]: each query over the latents [B, S, 1, r] its row of
        ``indices`` [B, T, W] lists (:func:`kdax.indexed_attention`, absorbed form; the queries moved
        into latent space in float32 and cast to the latents' dtype, so a cache is read as it is)."""
        dt = jnp.promote_types(x.dtype, jnp.float32)
        w_uk, w_uv = (w.astype(dt) for w in self._kv_b())
        q_lat = jnp.einsum("bthd,rhd->bthr", q_nope.astype(dt), w_uk).astype(latent.dtype)
        o = indexed_attention(q_lat, latent, latent, indices, scale=self.qk_head_dim**-0.5, lengths=lengths)
        return self._out(x, jnp.einsum("bthr,rhd->bthd", o.astype(dt), w_uv))
