"""GLM-5.3-Flash's text model: the blocks of :class:`kdax.models.KDAModel` inside
hyper-connections (:class:`kdax.nn.HyperConnection`) over ``hc_mult`` residual streams, and DSA
indexed attention (:class:`kdax.nn.dsa.IndexedMLA`) on the "indexed_attention" layers.

The embeddings are copied into every stream; each sublayer reads the streams collapsed by its
hyper-connection, normalised, and writes back through the connection's ``post`` and ``comb``; the
final hidden state is the streams' plain mean, normalised. A "full" indexed layer passes its
selection to the next layer when that one is "shared".
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from kdax.models.kda import KDABlock, Segments, embed, is_kda
from kdax.nn import HyperConnection, RMSNorm
from kdax.ops.common.sharding import Layout


class HyperBlock(KDABlock):
    """A :class:`kdax.models.kda.KDABlock` whose mixer and MLP each sit in a hyper-connection:
    streams X [B, T, N, D] -> X.

    Args:
        attn, mlp, hidden_size, eps: as :class:`kdax.models.kda.KDABlock` (eps also the
            hyper-connections' RMSNorm epsilon).
        streams: N.
        sinkhorn_iters, hc_eps: the hyper-connections' (:class:`kdax.nn.HyperConnection`).
        rngs: the parameters' random keys.
    """

    def __init__(
        self, attn, mlp, hidden_size: int, *, eps: float, streams: int, sinkhorn_iters: int, hc_eps: float, rngs
    ):
        super().__init__(attn, mlp, hidden_size, eps=eps)
        hc = lambda: HyperConnection(
            hidden_size, streams, sinkhorn_iters=sinkhorn_iters, eps=hc_eps, norm_eps=eps, rngs=rngs
        )
        self.attn_hc, self.ffn_hc = hc(), hc()

    def __call__(self, x, seg: Segments, cache=None, output_cache=False, mode=None, indices=None):
        """Apply the block.

        Args:
            x: the streams [B, T, N, hidden_size].
            seg, cache, output_cache, mode: as :meth:`kdax.models.kda.KDABlock.mix`.
            indices: a shared indexed layer's selection (the previous layer's), or None.

        Returns:
            (the streams, the mixer's new cache or None, an indexed layer's selection or None).
        """
        h, post, comb = self.attn_hc(x)
        h = self.attn_norm(h)
        if is_kda(self):
            h, cache, indices = self.mix(h, seg, cache, output_cache, mode)
        else:
            h, cache, indices = self.attn(
                h, positions=seg.positions, segment_ids=seg.segment_ids, cache=cache, indices=indices
            )
        x = HyperConnection.combine(x, h, post, comb)
        h, post, comb = self.ffn_hc(x)
        return HyperConnection.combine(x, self.mlp(self.mlp_norm(h)), post, comb), cache, indices


class Glm5Model(nnx.Module):
    """Embeddings, ``num_hidden_layers`` :class:`HyperBlock`, the streams' mean, final RMSNorm.

    Args:
        config: a :class:`kdax.models.Glm5NextConfig`.
        layer: ``layer(config, i, backend=, rngs=) -> (mixer, mlp)`` of layer i.
        eps: the RMSNorms' epsilon.
        backend: the KDA layers' backend.
        rngs: the parameters' random keys.
    """

    def __init__(self, config, layer, *, eps: float, backend: str = "auto", rngs: nnx.Rngs):
        c = config
        self.embeddings = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
        hc = {"streams": c.hc_mult, "sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps}
        blocks = []
        for i in range(c.num_hidden_layers):
            attn, mlp = layer(c, i, backend=backend, rngs=rngs)
            blocks.append(HyperBlock(attn, mlp, c.hidden_size, eps=eps, rngs=rngs, **hc))
        self.layers = nnx.List(blocks)
        self.norm = RMSNorm(c.hidden_size, eps=eps)
        self.streams = c.hc_mult
        self.layout: Layout | None = None  # set by kdax.models.shard

    def __call__(
        self, input_ids, seg: Segments, caches=None, output_cache=False, mode=None, kascade=None, *, selections=False
    ):
        """Embed, run the blocks, collapse the streams, normalise.

        Args:
            input_ids: [B, T] ints.
            seg: how the tokens group into rows (no packed sequences).
            caches: per-layer caches, or None.
            output_cache: whether the KDA layers return their final states.
            mode: the KDA layers' mode (None: their own choice).
            kascade: None (the indexed layers select their own keys).
            selections: also return the full indexed layers' selections.

        Returns:
            (hidden [B, T, hidden_size], a tuple of per-layer caches), then with ``selections``
            {layer: [B, T, W] int32}.
        """
        spread, x = embed(self, input_ids, caches)
        x = jnp.broadcast_to(x[:, :, None], (*x.shape[:2], self.streams, x.shape[-1]))
        caches = (None,) * len(self.layers) if caches is None else caches
        new, chosen, indices = [], {}, None
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            shared = not is_kda(layer) and layer.attn.indexer is None
            x, cache, indices = layer(x, seg, cache, output_cache, mode, indices if shared else None)
            x = spread(x)
            if indices is not None and not shared:
                chosen[i] = indices
            new.append(cache)
        out = self.norm(x.mean(axis=-2)), tuple(new)
        return (*out, chosen) if selections else out
