"""scripts/vllm_tpu_scale.py on the test fixture: the engine step at 32K context (64 decode rows; a
chunk of 8,192 tokens) compiles for a v6e with temporaries under 0.25 GiB (slow; needs libtpu,
the ``tpu-check`` extra)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.slow
def test_engine_step_at_32k_context_fits_in_small_temporaries(tmp_path):
    pytest.importorskip("libtpu")
    out = tmp_path / "rows.json"
    fixture = os.path.join(ROOT, "tests", "fixtures", "hf", "kimi_a")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "vllm_tpu_scale.py"), "--checkpoint", fixture]
    subprocess.run([*cmd, "--chips", "v6e", "--no-listings", "--json", str(out)], check=True, timeout=1200)
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["decode 64 x 32768", "prefill 8192 @ 32768"]
    for r in rows:
        assert r["temporaries"] < 0.25, r
