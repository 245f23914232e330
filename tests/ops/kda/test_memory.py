"""Long-sequence memory of the xla backward (heavy: run by hand with ``pytest -m slow``)."""

import pytest

from kdax.bench.kda import peak_memory


@pytest.mark.slow
def test_fwd_bwd_65536_tokens_under_8_gb():
    mem = peak_memory(B=1, T=65536, H=4, K=128, V=128, run_xla=True)
    assert mem["xla_peak_gb"] < 8.0, mem
    assert mem["naive_peak_gb"] > mem["xla_peak_gb"], mem
