"""Long-sequence memory of the backward, xla and the naive scan (heavy: run by hand with ``pytest -m slow``)."""

import pytest

from kdax.bench.kda import peak_memory


@pytest.mark.slow
def test_fwd_bwd_65536_tokens_under_8_gb():
    mem = peak_memory(B=1, T=65536, H=4, K=128, V=128, run_xla=True)
    assert mem["xla_peak_gb"] < 8.0, mem
    # the naive scan's gradient keeps a state per chunk of 64 tokens, not per token (50 GiB here)
    assert mem["naive_peak_gb"] < 4.0, mem
