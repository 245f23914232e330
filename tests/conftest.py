"""Test configuration: float64 on, so the references can run as the gold standard."""

import jax

jax.config.update("jax_enable_x64", True)
