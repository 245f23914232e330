"""Property tests over shapes and sequence lengths against the float64 reference (a few examples
in CI; many with ``pytest -m slow``)."""

import functools

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdax
from tests.ops.kda.cases import Case, assert_close_to_reference

_SHAPES = given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=4),
    varlen=st.booleans(),
    H=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    K=st.sampled_from([8, 20, 60]),
    V=st.sampled_from([8, 36, 100]),
    chunk_size=st.sampled_from([16, 32, 64]),
    h0=st.booleans(),
)


def _matches_reference(lengths, varlen, H, groups, K, V, chunk_size, h0):
    if varlen:
        case = Case(
            "prop", lengths=tuple(lengths), H=H, HV=H * groups, K=K, V=V, chunk_size=chunk_size, initial_state=h0
        )
    else:
        case = Case("prop", T=lengths[0], B=2, H=H, HV=H * groups, K=K, V=V, chunk_size=chunk_size, initial_state=h0)
    assert_close_to_reference(functools.partial(kdax.chunk_kda, backend="xla"), case, jnp.float32)


def _examples(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


test_chunk_kda_matches_reference = _examples(4)(_SHAPES(_matches_reference))
test_chunk_kda_matches_reference_many = pytest.mark.slow(_examples(40)(_SHAPES(_matches_reference)))
