"""chunk_kda against FLA's own chunk_kda (tests/fixtures/fla_kda_ops.npz, written by
scripts/fla_parity_fixture.py with flash-linear-attention 0.6.0): outputs, final states and
the gradients of every input, on GVA with K = 60, V = 100 and cumulative gates far below -88,
and on varlen with single-token sequences, the lower-bound gate and negative eigenvalues."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from tests.tolerances import TOL

FIXTURE = np.load(os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "fla_kda_ops.npz"))
CASES = sorted({key.split("/")[0] for key in FIXTURE.files})
ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def cotangent(shape):
    """The loss weights the fixture's gradients were taken with (scripts/fla_parity_fixture.py)."""
    return np.sin(0.7 * np.arange(np.prod(shape)) + 1.0).reshape(shape)


SLOW = {("varlen_lower_bound", "pallas_gpu")}  # behind ``slow``: the GPU interpreter runs the other fixture in CI
_RUNS = [
    pytest.param(case, backend, id=f"{case}-{backend}", marks=pytest.mark.slow if (case, backend) in SLOW else ())
    for case in CASES
    for backend in ("xla", "pallas_gpu", "pallas_tpu")
]


@pytest.mark.parametrize(("case", "backend"), _RUNS)
def test_matches_fla(case, backend):
    meta = json.loads(str(FIXTURE[f"{case}/meta"]))
    cu = None if meta["cu_seqlens"] is None else jnp.asarray(meta["cu_seqlens"], jnp.int32)

    def loss(x):
        o, s = kdax.chunk_kda(
            *x[:5],
            A_log=x[5],
            dt_bias=x[6],
            initial_state=x[7],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=meta["lower_bound"],
            allow_neg_eigval=meta["allow_neg_eigval"],
            cu_seqlens=cu,
            backend=backend,
        )
        total = jnp.sum(o.astype(jnp.float64) * cotangent(o.shape))
        return total + jnp.sum(s.astype(jnp.float64) * cotangent(s.shape)), (o, s)

    x = [jnp.asarray(FIXTURE[f"{case}/{n}"]) for n in ARGS]
    (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    errors = {"o": rel_rms(o, FIXTURE[f"{case}/o"]), "final_state": rel_rms(s, FIXTURE[f"{case}/final_state"])}
    errors.update({f"d{n}": rel_rms(d, FIXTURE[f"{case}/d{n}"]) for n, d in zip(ARGS, grads, strict=True)})
    bars = TOL[jnp.float32]
    for name, err in errors.items():
        bound = bars["out"] if name in ("o", "final_state") else bars["grad"]
        assert err <= bound, f"{case} {backend}: {name} differs from FLA by {err:.3g} > {bound:g} ({errors})"
