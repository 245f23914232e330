"""kdax's models inside serving engines: :mod:`kdax.integrations.vllm_tpu` (vLLM's TPU engine)."""
