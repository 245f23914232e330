"""kdax reproduces the logits of a tiny KDA hybrid built from FLA's PyTorch modules
(tests/fixtures/fla_tiny, made on a GPU by scripts/fla_parity_fixture.py)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from kdax.models import from_pretrained
from tests.ops.kda.cases import rel_rms

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "fla_tiny")


@pytest.mark.skipif(not os.path.exists(FIXTURE), reason="fixture not built yet: scripts/fla_parity_fixture.py on a GPU")
def test_fla_checkpoint_logits():
    model = from_pretrained(FIXTURE, backend="xla")
    ids = jnp.asarray(np.load(os.path.join(FIXTURE, "input_ids.npy")))
    assert rel_rms(model(ids), np.load(os.path.join(FIXTURE, "logits.npy"))) <= 1e-4
