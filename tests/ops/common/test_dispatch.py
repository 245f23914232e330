"""Backend choice: kdax.use_backend scopes what "auto" runs (ops, layers, models, generate),
the debug log says what it chose, and Pallas kernels off their device say they interpret."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdax
from kdax.bench.kda import make_inputs
from kdax.bench.measure import rel_rms
from kdax.models import KDAConfig, KDAForCausalLM, generate
from kdax.ops.common import dispatch
from tests.tolerances import F32


def _inputs():
    return make_inputs(1, 8, 1, 16, 16, jnp.float32)  # float32 (the tests run with float64 enabled)


def _runs_pallas(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_use_backend_scopes_what_auto_runs():
    assert kdax.explain_backend(jnp.float32)[0] == "xla"  # no accelerator here
    with kdax.use_backend("pallas_tpu"):
        assert kdax.explain_backend(jnp.float32) == ("pallas_tpu", "kdax.use_backend('pallas_tpu')")
        assert kdax.explain_backend(jnp.float64)[0] == "xla"  # no float64 kernels: "auto" falls back
        assert kdax.explain_backend(op="fused_recurrent_kda") == ("pallas_tpu", "kdax.use_backend('pallas_tpu')")
        assert _runs_pallas(lambda *a: kdax.chunk_kda(*a)[0], *_inputs())
        with kdax.use_backend("xla"):  # nested scopes: the innermost holds
            assert not _runs_pallas(lambda *a: kdax.chunk_kda(*a)[0], *_inputs())
        assert dispatch.scoped_backend() == "pallas_tpu"
    assert dispatch.scoped_backend() == "auto"
    assert not _runs_pallas(lambda *a: kdax.chunk_kda(*a)[0], *_inputs())
    with pytest.raises(ValueError, match="backend: expected one of"), kdax.use_backend("cuda"):
        pass


def test_auto_logs_its_choice_and_pallas_off_device_says_it_interprets(caplog):
    dispatch._note_interpreter.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="kdax"):
        kdax.chunk_kda(*_inputs())
        kdax.chunk_kda(*_inputs(), backend="pallas_tpu")
        kdax.chunk_kda(*_inputs(), backend="pallas_tpu")
    assert "chunk_kda: backend='auto' -> 'xla': no kernels for this device (cpu)" in caplog.text
    assert caplog.text.count("backend='pallas_tpu' on cpu: its kernels run in the Pallas interpreter") == 1


def _tiny(**kw):
    return KDAConfig(
        hidden_size=32,
        head_dim=8,
        num_heads=2,
        num_hidden_layers=2,
        vocab_size=40,
        attn={"layers": [1], "num_heads": 2},
        intermediate_size=48,
        **kw,
    )


def test_a_model_runs_the_scoped_backend_and_compiles_per_scope(caplog):
    model = KDAForCausalLM(_tiny(), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (1, 12), 0, 40, jnp.int32)
    with caplog.at_level(logging.DEBUG, logger="kdax"):
        with kdax.use_backend("pallas_tpu"):
            scoped = model(ids)
        assert "chunk_kda: backend='auto' -> 'pallas_tpu'" in caplog.text
        caplog.clear()
        plain = model(ids)  # not the scoped compilation again
        assert "chunk_kda: backend='auto' -> 'xla'" in caplog.text
    assert rel_rms(scoped, plain) <= F32["out"]  # float32 kernels against xla: the outputs' bar


def test_a_model_on_a_pallas_backend_decodes_on_it():
    """A layer built with pallas_tpu decodes with its decode kernel (no silent switch to another
    backend), to the same tokens as xla."""
    ids = jax.random.randint(jax.random.key(3), (2, 7), 0, 40, jnp.int32)
    models = {b: KDAForCausalLM(_tiny(), backend=b, rngs=nnx.Rngs(0)) for b in ("xla", "pallas_tpu")}
    layer = models["pallas_tpu"].model.layers[0].attn
    x = jax.random.normal(jax.random.key(4), (2, 1, 32), jnp.float32)
    cache = layer.init_cache(2)
    step = lambda x: layer(x, cache=cache, output_cache=True, mode="fused_recurrent")[0]
    assert "kda_fused_recurrent" in str(jax.make_jaxpr(step)(x))
    tokens = {b: generate(m, ids, 5) for b, m in models.items()}
    np.testing.assert_array_equal(tokens["pallas_tpu"], tokens["xla"])
