"""Test configuration: float64 on, so the references can run as the gold standard."""

import jax
import pytest

from kdax.ops.kda import api

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def _fresh_compiled_ops(request):
    """The public ops are compiled once per shape and static option: a test that patches
    kdax's internals (or what they read, e.g. the default device) must neither meet ops
    compiled before its patch nor leave its own behind."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    api._compiled.clear_cache()
    yield
    api._compiled.clear_cache()
