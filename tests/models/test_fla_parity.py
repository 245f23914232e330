"""kdax against a tiny KDA hybrid saved by FLA's own KDAForCausalLM (tests/fixtures/fla_tiny,
made by scripts/fla_parity_fixture.py with flash-linear-attention 0.6.0)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from kdax.bench.measure import rel_rms
from kdax.models import from_pretrained, save_pretrained
from tests.tolerances import F32

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "fla_tiny")


@pytest.mark.parametrize("backend", ["xla", "naive"])
def test_fla_checkpoint_logits(backend):
    model = from_pretrained(FIXTURE, backend=backend)
    ids = jnp.asarray(np.load(os.path.join(FIXTURE, "input_ids.npy")))
    assert rel_rms(model(ids), np.load(os.path.join(FIXTURE, "logits.npy"))) <= F32["grad"]


def test_save_pretrained_writes_fla_checkpoint(tmp_path):
    save_pretrained(from_pretrained(FIXTURE, backend="xla"), str(tmp_path))
    ours, fla = (load_file(os.path.join(d, "model.safetensors")) for d in (tmp_path, FIXTURE))
    assert sorted(ours) == sorted(fla)
    for name, value in fla.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    with open(os.path.join(tmp_path, "config.json")) as f, open(os.path.join(FIXTURE, "config.json")) as g:
        ours, fla = json.load(f), json.load(g)
    skip = {"dtype", "transformers_version"}  # written by transformers, not part of the model
    assert {k: ours.get(k) for k in fla if k not in skip} == {k: v for k, v in fla.items() if k not in skip}
