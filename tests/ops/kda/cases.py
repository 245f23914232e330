"""Shared KDA test cases and comparison helpers, written once for every backend.

A backend plugs in by name (``chunk_kda(..., backend=name)``); every case is checked
against the float64 token-by-token reference, outputs and all gradients.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from tests.tolerances import TOL


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    T: int = 63
    B: int = 2
    H: int = 2
    HV: int = 2
    K: int = 32
    V: int = 32
    lengths: tuple[int, ...] | None = None  # varlen: B = 1, T = sum(lengths)
    initial_state: bool = False
    g_min: float = -1.0  # per-step log decay drawn uniformly in [g_min, g_min / 100]
    options: tuple[tuple[str, object], ...] = ()  # in-op options passed to chunk_kda
    A_log_range: tuple[float, float] = (-1.0, 1.0)  # A_log uniform in it: decay rates exp(A_log) per token
    chunk_size: int = 64
    # The runs of this case behind the ``slow`` marker (:func:`runs`): interpreted Pallas runs whose
    # coverage a sibling keeps in CI (the same case on another backend, or a harder case on the
    # same one), for the 2-core CI's time; ``pytest -m slow`` runs them.
    slow: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name


# The cases the Pallas interpreters run in CI: the hardest (strong decay, in-kernel decay rates of
# 20-60 a token, K = 60 padding and empty sequences over variable lengths, K = 60 with V = 100, the
# bounded gate with negative eigenvalues); a Pallas backend's other runs are behind ``slow``, for
# the 2-core CI's time (the xla backend runs every case).
INTERPRETED_IN_CI = {
    "strong_decay_varlen",
    "strong_decay",
    "gate_rate_20_60_varlen",
    "gate_l2_varlen_K60",
    "varlen_empty",
    "K60_V100",
    "gate_lower_bound_neg_eigval",
}


def slow_if(case: Case, run: str):
    """The marks of ``case``'s run named ``run`` ("pallas_gpu", "pallas_gpu bf16", ...): ``slow``
    where ``case.slow`` names it, or where a Pallas backend runs a case not in
    :data:`INTERPRETED_IN_CI`."""
    interpreted = run.split()[0] in ("pallas_tpu", "pallas_gpu")
    return pytest.mark.slow if run in case.slow or (interpreted and case.name not in INTERPRETED_IN_CI) else ()


def runs(cases, backends, run: str = "") -> list:
    """pytest params (backend, case), id "case-backend", with :func:`slow_if` of the run named by
    the backend, followed by `` run`` where the test gives one ("pallas_gpu bf16")."""
    return [
        pytest.param(b, c, id=f"{c}-{b}", marks=slow_if(c, f"{b} {run}" if run else b)) for c in cases for b in backends
    ]


_GATE_L2_BETA = (
    ("use_qk_l2norm_in_kernel", True),
    ("use_gate_in_kernel", True),
    ("A_log", True),
    ("dt_bias", True),
    ("use_beta_sigmoid_in_kernel", True),
)
_RATE_20_60 = (float(np.log(20.0)), float(np.log(60.0)))

CASES = [
    Case("basic", slow=("pallas_tpu", "pallas_gpu")),  # shape-only cases: xla runs them in CI
    Case("T1", T=1, initial_state=True),  # without a state, g cannot act at T = 1 and dg is 0
    Case("T64", T=64, slow=("pallas_tpu", "pallas_gpu")),
    Case(
        "T65_gva_h0",
        T=65,
        HV=4,
        initial_state=True,
        slow=(
            "pallas_gpu bf16",
            "pallas_gpu fp16",
            "pallas_gpu states",
            "xla all_chunks",
            "pallas_gpu matmuls bf16",
            "pallas_gpu matmuls tf32",
            "pallas_gpu matmuls fp32",
        ),
    ),
    Case("K60_V100", T=70, B=1, K=60, V=100, initial_state=True, slow=("pallas_gpu", "pallas_gpu states")),
    Case("K128", T=130, B=1, H=1, K=128, V=128, slow=("pallas_tpu", "pallas_gpu")),
    Case(
        "T1000",
        T=1000,
        B=1,
        H=1,
        HV=2,
        K=32,
        V=32,
        initial_state=True,
        slow=("pallas_tpu", "pallas_gpu", "xla all_chunks"),
    ),
    Case(  # strong_decay_varlen and gate_l2_varlen_K60 keep the GPU kernels' varlen coverage in CI
        "varlen",
        lengths=(1, 17, 64, 300),
        H=1,
        HV=2,
        initial_state=True,
        slow=("pallas_gpu", "pallas_gpu bf16", "pallas_tpu staged"),
    ),
    Case("strong_decay", T=200, B=1, g_min=-20.0, initial_state=True, slow=("pallas_tpu", "pallas_gpu")),
    Case("varlen_empty", lengths=(0, 5, 0, 40, 0), H=1, HV=2, initial_state=True, chunk_size=16),
    Case(
        "strong_decay_varlen",
        lengths=(1, 17, 64, 118),
        H=1,
        HV=2,
        g_min=-20.0,
        initial_state=True,
        slow=("pallas_gpu matmuls bf16", "pallas_gpu matmuls tf32"),
    ),
    Case(
        "gate_softplus_l2_sigmoid",
        T=90,
        HV=4,
        initial_state=True,
        options=_GATE_L2_BETA,
        slow=("pallas_gpu", "pallas_gpu bf16"),
    ),
    Case(
        "gate_lower_bound_neg_eigval",
        T=90,
        initial_state=True,
        options=(
            ("use_gate_in_kernel", True),
            ("lower_bound", -5.0),
            ("dt_bias", True),
            ("use_beta_sigmoid_in_kernel", True),
            ("allow_neg_eigval", True),
            ("scale", 0.3),
        ),
        slow=("pallas_gpu safe_gate",),
    ),
    Case(
        "gate_lower_bound_A_log", T=40, options=(("use_gate_in_kernel", True), ("lower_bound", -3.0), ("A_log", True))
    ),
    Case(  # padding slots and key columns around gate logits, L2 norm and scale (the GPU kernels apply them)
        "gate_l2_varlen_K60",
        lengths=(1, 30, 64, 7),
        H=1,
        HV=2,
        K=60,
        initial_state=True,
        chunk_size=32,
        options=(
            ("use_gate_in_kernel", True),
            ("A_log", True),
            ("dt_bias", True),
            ("use_qk_l2norm_in_kernel", True),
            ("scale", 0.2),
        ),
        slow=("pallas_gpu states grads",),
    ),
    # Decay rates of 20-60 per token through the in-kernel gate: the gate's gradients (dg, dA_log,
    # dt_bias) sum terms far larger than themselves unless every exponent is a sum of steps and
    # every gate term spans only the steps it decays by (docs/kda_xla.md, Gate gradients).
    Case(
        "gate_rate_20_60",
        T=130,
        B=1,
        H=1,
        HV=2,
        initial_state=True,
        options=_GATE_L2_BETA,
        A_log_range=_RATE_20_60,
        slow=("pallas_tpu", "pallas_gpu"),
    ),
    Case(
        "gate_rate_20_60_varlen",
        lengths=(1, 17, 64, 118),
        H=1,
        HV=2,
        initial_state=True,
        options=_GATE_L2_BETA,
        A_log_range=_RATE_20_60,
        slow=("pallas_gpu matmuls fp32",),
    ),
    Case("chunk16", T=100, chunk_size=16, initial_state=True),
    Case("chunk32_varlen", lengths=(5, 33, 1, 40), chunk_size=32),
    Case("chunk128", T=300, B=1, chunk_size=128),
]
CASE = {c.name: c for c in CASES}


def make_inputs(case: Case, dtype=jnp.float32, seed: int = 0):
    """Random inputs for ``case``: (args, kwargs) for chunk_kda, float arrays in ``dtype``."""
    rng = np.random.default_rng(seed)
    B, T = (1, sum(case.lengths)) if case.lengths else (case.B, case.T)
    H, HV, K, V = case.H, case.HV, case.K, case.V
    opts = dict(case.options)
    N = len(case.lengths) if case.lengths else B
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if not opts.get("use_qk_l2norm_in_kernel"):
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # keep the delta rule contractive
    v = rng.standard_normal((B, T, HV, V))
    if opts.get("use_gate_in_kernel"):
        g = rng.standard_normal((B, T, HV, K))
    else:
        g = rng.uniform(case.g_min, case.g_min / 100, (B, T, HV, K))
    beta = rng.standard_normal((B, T, HV)) if opts.get("use_beta_sigmoid_in_kernel") else rng.uniform(0, 1, (B, T, HV))
    cast = lambda x: jnp.asarray(x, dtype)
    args = [cast(x) for x in (q, k, v, g, beta)]
    kwargs = {"output_final_state": True, "chunk_size": case.chunk_size}
    if case.initial_state:
        kwargs["initial_state"] = jnp.asarray(rng.standard_normal((N, HV, K, V)), jnp.float32)
    if case.lengths:
        kwargs["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(case.lengths)]), jnp.int32)
    for key, val in opts.items():
        if key == "A_log":
            kwargs["A_log"] = jnp.asarray(rng.uniform(*case.A_log_range, (HV,)), jnp.float32)
        elif key == "dt_bias":
            kwargs["dt_bias"] = jnp.asarray(rng.uniform(-1, 1, (HV * K,)), jnp.float32)
        else:
            kwargs[key] = val
    return args, kwargs


def diff_argnames(kwargs) -> list[str]:
    """Names of the differentiable array arguments present in ``kwargs``."""
    return [n for n in ("initial_state", "A_log", "dt_bias") if n in kwargs]


def run_with_grads(fn, args, kwargs, seed: int = 1):
    """Outputs (o, final_state and, with return_intermediate_states, the states entering the
    chunks) and gradients of a fixed random projection of all of them.

    Gradients are taken for q, k, v, g, beta and every float array keyword."""
    rng = np.random.default_rng(seed)
    B, _, _, K = args[0].shape
    _, _, HV, V = args[2].shape
    N = kwargs["cu_seqlens"].shape[0] - 1 if "cu_seqlens" in kwargs else B
    w_o = jnp.asarray(rng.standard_normal(args[2].shape))
    w_s = jnp.asarray(rng.standard_normal((N, HV, K, V)))

    def loss(args, extra):
        o, s, *h = fn(*args, **{**kwargs, **extra})
        total = jnp.sum(o.astype(jnp.float64) * w_o) + jnp.sum(s.astype(jnp.float64) * w_s)
        for x in h:  # its chunk count depends on the layout: weights drawn for the shape it has
            total = total + jnp.sum(x.astype(jnp.float64) * np.random.default_rng(seed + 1).standard_normal(x.shape))
        return total, (o, s, *h)

    extra = {n: kwargs[n] for n in diff_argnames(kwargs)}
    (_, outs), (ga, ge) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(list(args), extra)
    grads = dict(zip(["q", "k", "v", "g", "beta"], ga))
    grads.update(ge)
    return (*outs, grads)


def reference(args, kwargs):
    """The float64 token-by-token reference on the same (upcast) inputs."""
    args64 = [jnp.asarray(a, jnp.float64) for a in args]
    kw = {
        k: (jnp.asarray(v, jnp.float64) if k in ("initial_state", "A_log", "dt_bias") else v) for k, v in kwargs.items()
    }
    return run_with_grads(lambda *a, **k: kdax.chunk_kda(*a, **{**k, "backend": "naive"}), args64, kw)


def assert_close_to_reference(fn, case: Case, dtype=jnp.float32):
    """Run ``fn`` (chunk_kda-like) on ``case`` and compare o, final state and all grads."""
    args, kwargs = make_inputs(case, dtype)
    o, s, *h, grads = run_with_grads(fn, args, kwargs)
    o_ref, s_ref, *h_ref, g_ref = reference(args, kwargs)
    tol = TOL[dtype]
    assert o.dtype == args[0].dtype and o.shape == o_ref.shape
    errors = {"o": rel_rms(o, o_ref), "final_state": rel_rms(s, s_ref)}
    for x, ref in zip(h, h_ref):  # the states entering the chunks (return_intermediate_states)
        assert x.dtype == args[0].dtype and x.shape == ref.shape, (x.dtype, x.shape, ref.shape)
        errors["states"] = rel_rms(x, ref)
    errors.update({f"d{n}": rel_rms(grads[n], g_ref[n]) for n in g_ref})
    for name, err in errors.items():
        bound = tol["out"] if name in ("o", "final_state", "states") else tol["grad"]
        assert np.isfinite(err) and err <= bound, f"{case}: {name} rel. RMS error {err:.3g} > {bound:g} ({errors})"
    return errors
