"""Attention over a paged cache of MLA latents, for serving engines' ragged batches: references,
the portable XLA op, the TPU kernel, public API (docs/mla_paged.md)."""
