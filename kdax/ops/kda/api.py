"""Public KDA entry points: argument validation, in-op preprocessing, backend dispatch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kdax.ops.common.varlen import chunk_layout
from kdax.ops.kda.gate import beta_activation, kda_gate, l2norm
from kdax.ops.kda.pallas_gpu import chunk_fits, chunk_kda_pallas_gpu
from kdax.ops.kda.pallas_tpu import chunk_kda_pallas_tpu
from kdax.ops.kda.recurrent import fused_recurrent_kda_xla
from kdax.ops.kda.reference import naive_recurrent_kda
from kdax.ops.kda.xla import chunk_kda_xla

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "naive")
CHUNK_SIZES = (16, 32, 64, 128)
MAX_HEAD_DIM = 256


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _check_array(name, x, ndim, shape=None, integer=False):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        _fail(name, "an array", type(x).__name__)
    if x.ndim != ndim:
        _fail(name, f"a {ndim}-d array", f"shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        _fail(name, f"shape {tuple(shape)}", f"shape {tuple(x.shape)}")
    kind = jnp.integer if integer else jnp.floating
    if not jnp.issubdtype(x.dtype, kind):
        _fail(name, "an integer dtype" if integer else "a floating dtype", f"dtype {x.dtype}")


def _validate(
    q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens, chunk_size, backend,
):  # fmt: skip
    """Raise ValueError naming the first bad argument; return the number of sequences N."""
    if backend not in BACKENDS:
        _fail("backend", f"one of {BACKENDS}", repr(backend))
    _check_array("q", q, 4)
    B, T, H, K = q.shape
    _check_array("k", k, 4, q.shape)
    _check_array("v", v, 4)
    if tuple(v.shape[:2]) != (B, T):
        _fail("v", f"shape ({B}, {T}, HV, V) matching q's batch and time", f"shape {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if HV % H:
        _fail("v", f"a number of value heads HV divisible by q's heads H={H}", f"HV={HV}")
    _check_array("g", g, 4, (B, T, HV, K))
    _check_array("beta", beta, 3, (B, T, HV))
    if T < 1:
        _fail("q", "at least one token (T >= 1)", f"T={T}")
    if not 1 <= K <= MAX_HEAD_DIM:
        _fail("q", f"head dim K in [1, {MAX_HEAD_DIM}]", f"K={K}")
    if V < 1:
        _fail("v", "value dim V >= 1", f"V={V}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        _fail("k, v", f"the dtype of q ({q.dtype})", f"k {k.dtype}, v {v.dtype}")
    if backend.startswith("pallas") and q.dtype == jnp.float64:
        _fail("q", f"float32 or bfloat16 inputs with backend={backend!r} (the kernels have no float64)", "float64")
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        _fail("scale", "a Python float or None", type(scale).__name__)
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        _fail("chunk_size", f"one of {CHUNK_SIZES}", repr(chunk_size))
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            _fail("A_log", "an array of shape (HV,) when use_gate_in_kernel and no lower_bound", None)
        if A_log is not None:
            _check_array("A_log", A_log, 1, (HV,))
        if dt_bias is not None:
            _check_array("dt_bias", dt_bias, 1, (HV * K,))
    else:
        for name, val in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if val is not None:
                _fail(name, "None unless use_gate_in_kernel=True", type(val).__name__)
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and lower_bound < 0):
        _fail("lower_bound", "a negative float (e.g. -5.0)", repr(lower_bound))
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _fail("allow_neg_eigval", "use_beta_sigmoid_in_kernel=True alongside it", "use_beta_sigmoid_in_kernel=False")
    N = B
    if cu_seqlens is not None:
        _check_array("cu_seqlens", cu_seqlens, 1, integer=True)
        if cu_seqlens.shape[0] < 2:
            _fail("cu_seqlens", "at least 2 entries [0, ..., T]", f"shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            _fail("q", "batch size B=1 when cu_seqlens is given", f"B={B}")
        N = cu_seqlens.shape[0] - 1
        if not isinstance(cu_seqlens, jax.core.Tracer):
            cu = np.asarray(cu_seqlens)
            if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
                _fail("cu_seqlens", f"non-decreasing offsets from 0 to T={T}", cu.tolist())
    if initial_state is not None:
        _check_array("initial_state", initial_state, 4, (N, HV, K, V))
    return N


def _preprocess(q, k, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                use_beta_sigmoid_in_kernel, allow_neg_eigval):  # fmt: skip
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, allow_neg_eigval)
    return q, k, g, beta


def _resolve_backend(backend: str, cores: dict, dtype, chunk_size: int | None) -> str:
    if backend == "auto":  # the fastest core this op has for the default device and these inputs, else xla
        kernels = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend())
        if kernels not in cores or dtype == jnp.float64:  # the kernels compute in float32 at most
            return "xla"
        return kernels if kernels != "pallas_gpu" or chunk_fits(dtype, chunk_size) else "xla"
    if backend != "naive" and backend not in cores:
        raise NotImplementedError(f"backend={backend!r}: not available for this op in this version")
    return backend


def _repeated_qk(core):
    """Adapt a core that takes q and k repeated to the HV value heads."""

    def run(q, k, v, *rest):
        groups = v.shape[2] // q.shape[2]
        return core(jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2), v, *rest)

    return run


def _run(core, q, k, v, g, beta, scale, initial_state, N, cu_seqlens, output_final_state):
    """Cast to the compute dtype, scale q (unless scale is None: the core scales it), call core."""
    B, _, _, K = q.shape
    HV, V = v.shape[2:]
    dt = jnp.promote_types(q.dtype, jnp.float32)
    qc = jnp.asarray(q, dt) if scale is None else jnp.asarray(q, dt) * scale
    kc, vc, gc, bc = (jnp.asarray(x, dt) for x in (k, v, g, beta))
    n_per_row = N // B  # 1 without cu_seqlens, N with it (B = 1)
    h0 = jnp.zeros((N, HV, K, V), dt) if initial_state is None else jnp.asarray(initial_state, dt)
    o, final = core(qc, kc, vc, gc, bc, h0.reshape(B, n_per_row, HV, K, V), cu_seqlens)
    final = final.reshape(N, HV, K, V).astype(jnp.promote_types(dt, jnp.float32))
    return o.astype(q.dtype), (final if output_final_state else None)


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    cu_seqlens=None, chunk_size=64, backend="auto",
):  # fmt: skip
    """Chunked Kimi Delta Attention (training and prefill).

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); g: [B, T, HV, K] log-space
    decay (raw logits when ``use_gate_in_kernel``); beta: [B, T, HV]; initial_state:
    [N, HV, K, V]; cu_seqlens: [N + 1] int offsets of packed sequences (B must be 1; checked
    when concrete, trusted when traced: malformed traced offsets give meaningless values).

    Returns ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] float32 or None)``.
    """
    args = dict(locals())

    def layout_then(core):
        def run(q, k, v, g, beta, h0, cu, **options):
            return core(q, k, v, g, beta, h0, chunk_layout(q.shape[1], chunk_size, cu), **options)

        return run

    cores = {
        "xla": _repeated_qk(layout_then(chunk_kda_xla)),
        "pallas_tpu": layout_then(chunk_kda_pallas_tpu),
        "pallas_gpu": layout_then(chunk_kda_pallas_gpu),
    }
    return _dispatch(cores, options_in_core=("pallas_gpu",), **args)


def fused_recurrent_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
    cu_seqlens=None, backend="auto",
):  # fmt: skip
    """Token-by-token Kimi Delta Attention (decoding, short T). Same contract as :func:`chunk_kda`."""
    return _dispatch({"xla": _repeated_qk(fused_recurrent_kda_xla)}, chunk_size=None, **locals())


def _dispatch(
    cores, *, options_in_core=(), q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens,
    chunk_size, backend,
):  # fmt: skip
    """Validate, apply the in-op options, and run the backend's core (or the naive reference).
    The cores of ``options_in_core`` get the raw gate logits and unnormalised, unscaled q and k,
    with keyword arguments saying how to apply the gate, the L2 norm and the scale themselves."""
    N = _validate(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                  use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens, chunk_size, backend)  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    backend = _resolve_backend(backend, cores, q.dtype, chunk_size)
    core = cores.get(backend)
    if backend in options_in_core:
        gate = (A_log, dt_bias, lower_bound) if use_gate_in_kernel else None
        core = functools.partial(core, input_dtype=q.dtype, g_dtype=g.dtype, gate=gate,
                                 l2norm_qk=use_qk_l2norm_in_kernel, scale=scale)  # fmt: skip
        use_qk_l2norm_in_kernel, use_gate_in_kernel, scale = False, False, None
    q, k, g, beta = _preprocess(q, k, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval)  # fmt: skip
    if backend == "naive":
        return _naive(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return _run(core, q, k, v, g, beta, scale, initial_state, N, cu_seqlens, output_final_state)


def _naive(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    if isinstance(cu_seqlens, jax.core.Tracer):
        _fail("cu_seqlens", "a concrete array with backend='naive' (the reference loops over sequences)", "a tracer")
    return naive_recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )  # fmt: skip
