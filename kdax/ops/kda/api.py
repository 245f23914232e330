"""Public KDA entry points: argument validation, in-op preprocessing, backend dispatch."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kdax.ops.common.dispatch import BACKENDS, OpBackends, register
from kdax.ops.common.sharding import heads_axis, per_shard
from kdax.ops.common.validation import LayoutWarning, check_array, check_traced, fail
from kdax.ops.common.varlen import chunk_layout, valid_offsets
from kdax.ops.kda import context_parallel, decode, pallas_gpu, pallas_tpu, reference, slots, xla
from kdax.ops.kda.capabilities import Capabilities
from kdax.ops.kda.checks import check_inputs, offsets
from kdax.ops.kda.context_parallel import ContextParallel
from kdax.ops.kda.gate import in_op
from kdax.ops.kda.reference import naive_recurrent_kda, naive_token_states

RECORDS: dict[str, Capabilities] = {
    c.name: c for c in (xla.CAPABILITIES, pallas_tpu.CAPABILITIES, pallas_gpu.CAPABILITIES, reference.CAPABILITIES)
}  # every backend's capabilities, by name
CONFIGS = {name: c.config for name, c in RECORDS.items() if c.config}  # per-call kernel configs


def capabilities(backend: str) -> Capabilities | None:
    """The capability record of a KDA backend (None for "auto" or an unknown name)."""
    return RECORDS.get(backend)


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one KDA call, as :func:`chunk_kda` takes them (``op``: "chunk" or
    "recurrent"): once :func:`_validate` passed them, hashable, the compiled call's static argument."""

    op: str = "chunk"
    backend: str = "auto"
    config: xla.Config | pallas_tpu.Config | pallas_gpu.Config | None = None
    scale: float | None = None
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    lower_bound: float | None = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    disable_recompute: bool = False
    return_intermediate_states: bool = False
    state_v_first: bool = False
    chunk_size: int | None = 64
    check_offsets: bool = False  # traced cu_seqlens under kdax.debug_checks(): checkify.check them
    token_states: bool = False  # a third output: the state after each token (per-token slots)

    def keywords(self) -> dict:
        """The options as the public op (``op``'s: chunk_kda or fused_recurrent_kda) takes them."""
        skip = _INTERNAL + (("chunk_size", "config") if self.op == "recurrent" else ())
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


_INTERNAL = ("op", "check_offsets", "token_states")  # Options that are no public op's arguments


def _validate(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, o: Options) -> int:
    """Raise ValueError naming the first bad argument; return the number of sequences N."""
    if o.backend not in BACKENDS:
        fail("backend", f"one of {BACKENDS}", repr(o.backend))
    for name in ("safe_gate", "disable_recompute", "return_intermediate_states", "state_v_first"):
        if not isinstance(val := getattr(o, name), (bool, np.bool_)):
            fail(name, "a bool", f"{type(val).__name__} {val!r}")
    N = check_inputs(
        q,
        k,
        v,
        g,
        beta,
        scale=o.scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        chunk_size=o.chunk_size,
        state_v_first=o.state_v_first,
    )
    if (caps := capabilities(o.backend)) and not caps.portable and q.dtype == jnp.float64:
        fail("q", f"float32 or bfloat16 inputs with backend={o.backend!r} (the kernels have no float64)", "float64")
    HV, K = g.shape[2:]
    lower_bound = o.lower_bound
    if o.use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            fail("A_log", "an array of shape (HV,) when use_gate_in_kernel and no lower_bound", None)
        if A_log is not None:
            check_array("A_log", A_log, 1, (HV,))
        if dt_bias is not None:
            check_array("dt_bias", dt_bias, 1, (HV * K,))
    else:
        for name, val in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if val is not None:
                fail(name, "None unless use_gate_in_kernel=True", type(val).__name__)
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and lower_bound < 0):
        fail("lower_bound", "a negative float (e.g. -5.0)", repr(lower_bound))
    if o.safe_gate and o.use_gate_in_kernel and not (isinstance(lower_bound, (int, float)) and -5 <= lower_bound < 0):
        fail("lower_bound", "a float in [-5, 0) with safe_gate=True and use_gate_in_kernel=True", repr(lower_bound))
    if o.allow_neg_eigval and not o.use_beta_sigmoid_in_kernel:
        fail("allow_neg_eigval", "use_beta_sigmoid_in_kernel=True alongside it", "use_beta_sigmoid_in_kernel=False")
    return N


def _preprocess(q, k, g, beta, A_log, dt_bias, o: Options):
    """The in-op transforms ``o`` asks for, in XLA."""
    flags = {"lower_bound": o.lower_bound, "allow_neg_eigval": o.allow_neg_eigval}
    flags.update(
        l2norm_qk=o.use_qk_l2norm_in_kernel, gate=o.use_gate_in_kernel, beta_sigmoid=o.use_beta_sigmoid_in_kernel
    )
    return in_op(q, k, g, beta, A_log, dt_bias, **flags)


def _refuse(kernels, dtype, config, asked, chunk_size=None, head_dims=(128, 128)) -> str | None:
    """Why these kernels do not take the inputs (None: they do); see OpBackends.refuse."""
    refuse = RECORDS[kernels].refuse
    return refuse(dtype, config, asked, chunk_size, head_dims) if refuse else None


def _refuse_recurrent(kernels, dtype, config, asked, tokens=1, packed=False, **_) -> str | None:
    """Why the decode kernels do not take the inputs of a ``fused_recurrent_kda`` call (None: they
    do); :func:`kdax.explain_backend` asks for rows of one token (and passes chunk_kda's options)."""
    if packed:
        return "packed sequences (cu_seqlens): the decode kernels take rows"
    if tokens > decode.MAX_TOKENS:
        return f"{tokens} tokens a row: the decode kernels take at most {decode.MAX_TOKENS} (use chunk_kda)"
    refuse = RECORDS[kernels].refuse_decode
    return refuse(asked) if refuse else None


_OPS = {
    "chunk_kda": register(OpBackends("chunk_kda", tuple(CONFIGS), CONFIGS, _refuse)),
    "fused_recurrent_kda": register(OpBackends("fused_recurrent_kda", tuple(CONFIGS), CONFIGS, _refuse_recurrent)),
}


def _repeated_qk(core):
    """Adapt a core that takes q and k repeated to the HV value heads."""

    def run(q, k, v, *rest):
        groups = v.shape[2] // q.shape[2]
        return core(jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2), v, *rest)

    return run


def _run(core, o: Options, N, q, k, v, g, beta, initial_state, cu_seqlens):
    """Cast to the compute dtype, scale q (unless ``o.scale`` is None: the core scales it), call core."""
    B, _, _, K = q.shape
    HV, V = v.shape[2:]
    dt = jnp.promote_types(q.dtype, jnp.float32)
    qc = jnp.asarray(q, dt) if o.scale is None else jnp.asarray(q, dt) * o.scale
    kc, vc, gc, bc = (jnp.asarray(x, dt) for x in (k, v, g, beta))
    n_per_row = N // B  # 1 without cu_seqlens, N with it (B = 1)
    h0 = jnp.zeros((N, HV, K, V), dt) if initial_state is None else jnp.asarray(initial_state, dt)
    cu = None if cu_seqlens is None else valid_offsets(cu_seqlens, q.shape[1], check=o.check_offsets)
    o_, final, *states = core(qc, kc, vc, gc, bc, h0.reshape(B, n_per_row, HV, K, V), cu)
    final = final.reshape(N, HV, K, V).astype(jnp.promote_types(dt, jnp.float32))
    states_dtype = final.dtype if o.token_states else q.dtype  # FLA's h in q's dtype; token states as final
    return o_.astype(q.dtype), (final if o.output_final_state else None), *(h.astype(states_dtype) for h in states)


def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | Sequence[int] | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    config: xla.Config | pallas_tpu.Config | pallas_gpu.Config | None = None,
    context_parallel: ContextParallel | None = None,
    ssm_state_indices: jax.Array | None = None,
    cu_seqlens_cpu: Sequence[int] | np.ndarray | None = None,
    cp_context: None = None,
    transpose_state_layout: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Chunked Kimi Delta Attention (training and prefill), with FLA's ``chunk_kda`` keywords.

    Compiled once per shape, dtype and static option (``jax.jit``), so an eager call costs what a
    jitted one does. Differentiable in every float array argument.

    Args:
        q, k: [B, T, H, K] queries and keys.
        v: [B, T, HV, V] values, HV a multiple of H (value head h reads q/k head h // (HV // H)).
        g: [B, T, HV, K] log-space decay; raw gate logits with ``use_gate_in_kernel``.
        beta: [B, T, HV]; raw logits with ``use_beta_sigmoid_in_kernel``.
        scale: the scale of q; K ** -0.5 when None.
        initial_state: [N, HV, K, V], N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: return the final states.
        use_qk_l2norm_in_kernel: L2-normalise q and k.
        use_gate_in_kernel: g = -exp(A_log) softplus(g + dt_bias), or with ``lower_bound``
            lower_bound sigmoid(exp(A_log) (g + dt_bias)).
        A_log: [HV], for ``use_gate_in_kernel``.
        dt_bias: [HV * K], for ``use_gate_in_kernel``.
        lower_bound: a negative float, for ``use_gate_in_kernel``.
        use_beta_sigmoid_in_kernel: beta = sigmoid(beta).
        allow_neg_eigval: beta = 2 sigmoid(beta) (requires ``use_beta_sigmoid_in_kernel``).
        safe_gate: FLA's promise that the gates are bounded (with ``use_gate_in_kernel`` it
            requires ``lower_bound`` in [-5, 0)); changes no result.
        disable_recompute: the backward reads the forward's intermediates instead of recomputing
            them: more memory, for speed where recomputing costs more than reading (what each
            backend keeps, and the xla backend's measured trade: docs/kda_xla.md). Changes no
            result beyond float32 rounding (xla: bit for bit under XLA's default CPU emitters).
        return_intermediate_states: return a third output, FLA's ``h``: the state entering each
            chunk. Differentiable (gradients flow through it), unlike FLA's inference-only ``h``.
        state_v_first: initial, final and intermediate states as [.., V, K] instead of [.., K, V].
        cu_seqlens: [N + 1] int offsets of N packed sequences (B must be 1), an array or a list;
            checked when concrete; traced, made valid (clipped to [0, T], a running maximum,
            the first 0 and the last T: ``kdax.ops.common.varlen.valid_offsets``).
        chunk_size: 16, 32, 64 or 128.
        backend: "auto", "xla", "pallas_tpu", "pallas_gpu" or "naive" (:func:`kdax.explain_backend` says
            what "auto" picks).
        config: the backend's kernel config (``kdax.ops.kda.<backend>.Config``), None for its
            default; with backend "auto" a config picks its own backend.
        context_parallel: a :class:`kdax.ContextParallel` to split the time axis over a device
            mesh axis (each device runs its slice; one all-gather of HV x K x (K + V) floats per
            device and row, whatever T): with its mesh, on global arrays; without, inside the
            caller's ``jax.shard_map`` on each device's slice (docs/scale.md). Same results as
            one device to float32 rounding, gradients included.
        ssm_state_indices: [N] int slots of a state pool (serving): ``initial_state`` is then the
            pool [S, HV, K, V] (float32), sequence n starts from ``initial_state[idx[n]]`` and its
            final state is written there; a negative index is a padding row (zero state, nothing
            written). The second output is the updated pool (``output_final_state`` is implied),
            every other slot unchanged; under ``jax.jit`` with the pool donated it is updated in
            place. Concrete slots must be < S and distinct (ValueError); traced ones out of range
            read zeros and write nothing.
        cu_seqlens_cpu, cp_context, transpose_state_layout: FLA 0.6's names, so its calls port
            as they are: the offsets' host copy (``cu_seqlens`` when that is None, else equal to
            it), FLA's context-parallel context (None only: kdax's is ``context_parallel``), and
            ``state_v_first``.

    A q of fewer tokens than heads (T < H) warns, as FLA does: [B, H, T, K] head-first inputs
    pass every shape check when T and H agree elsewhere (:class:`kdax.LayoutWarning`).

    Returns:
        ``(o, final_state)`` (``(o, pool)`` with ``ssm_state_indices``), and with
        ``return_intermediate_states`` ``(o, final_state, h)``:
        o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] in float32 (float64 for float64
        inputs), or None without ``output_final_state``; h in q's dtype (as FLA's, in k's),
        [B, NT, HV, K, V] with NT = ceil(T / chunk_size), or with ``cu_seqlens`` [1, NT, HV, K, V]
        with NT the sum of ceil(L_n / chunk_size) over the sequences, each sequence's chunks in
        turn (FLA's layout). With traced ``cu_seqlens`` NT is the static bound
        (T + N (chunk_size - 1)) // chunk_size and the chunks past the sequences' are 0.

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    cu_seqlens, state_v_first = _fla_names(
        cu_seqlens, cu_seqlens_cpu, cp_context, state_v_first, transpose_state_layout
    )
    if len(getattr(q, "shape", ())) == 4 and q.shape[1] < q.shape[2]:
        warnings.warn(
            f"chunk_kda: q has fewer tokens ({q.shape[1]}) than heads ({q.shape[2]}); inputs are [B, T, H, K] "
            "(head-first [B, H, T, K] ones pass the shape checks where T and H agree elsewhere)",
            LayoutWarning,
            stacklevel=2,
        )
    cu_seqlens = offsets(cu_seqlens)
    opts = Options(
        op="chunk",
        backend=backend,
        config=config,
        scale=scale,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states,
        state_v_first=state_v_first,
        chunk_size=chunk_size,
        check_offsets=check_traced(cu_seqlens),
    )
    if ssm_state_indices is not None:
        arrays = (q, k, v, g, beta, initial_state, ssm_state_indices, None, cu_seqlens, A_log, dt_bias)
        return _slotted(opts, *arrays, context_parallel=context_parallel)
    if context_parallel is not None:
        return _context_parallel(context_parallel, opts, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    N = _validate(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, opts)
    head_dims = (q.shape[-1], v.shape[-1])
    backend, config = _OPS["chunk_kda"].resolve(backend, q.dtype, config, chunk_size=chunk_size, head_dims=head_dims)
    out = _call(
        dataclasses.replace(opts, backend=backend, config=config),
        N,
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        A_log,
        dt_bias,
        cu_seqlens,
    )
    if return_intermediate_states and cu_seqlens is not None and not isinstance(cu_seqlens, jax.core.Tracer):
        n_chunks = int(np.sum(-(-np.diff(np.asarray(cu_seqlens)) // chunk_size)))  # FLA's NT: sum of ceil(L_n / C)
        out = (*out[:2], out[2][:, :n_chunks])
    return out


def _fla_names(cu_seqlens, cu_seqlens_cpu, cp_context, state_v_first, transpose_state_layout):
    """FLA 0.6's keywords as kdax's: (cu_seqlens, state_v_first).

    Raises:
        ValueError: a cp_context, a non-bool transpose_state_layout, or host offsets that are not
            the offsets' values.
    """
    if cp_context is not None:
        fail(
            "cp_context", "None (kdax splits the time axis with context_parallel=kdax.ContextParallel(...))", cp_context
        )
    if not isinstance(transpose_state_layout, (bool, np.bool_)):
        fail("transpose_state_layout", "a bool", f"{type(transpose_state_layout).__name__} {transpose_state_layout!r}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            cu_seqlens = cu_seqlens_cpu
        elif not isinstance(cu_seqlens, jax.core.Tracer) and not np.array_equal(
            np.asarray(cu_seqlens), np.asarray(cu_seqlens_cpu)
        ):
            fail(
                "cu_seqlens_cpu",
                f"cu_seqlens' values {np.asarray(cu_seqlens).tolist()}",
                np.asarray(cu_seqlens_cpu).tolist(),
            )
    return cu_seqlens, state_v_first if transpose_state_layout is False else True


def _context_parallel(cp, opts: Options, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias):
    """chunk_kda with its time axis over ``cp.axis`` (see :mod:`kdax.ops.kda.context_parallel`)."""
    context_parallel.check(cp, q.shape[1], opts.chunk_size)
    intermediate = opts.return_intermediate_states
    if intermediate and cu_seqlens is not None:
        fail(
            "return_intermediate_states",
            "False with cu_seqlens under context_parallel (a sequence's chunks "
            "restart at each device boundary, so FLA's chunk list does not apply)",
            "True",
        )
    T = q.shape[1] * (lax.axis_size(cp.axis) if cp.mesh is None else 1)  # the global time axis
    spec = lambda x: jax.ShapeDtypeStruct((x.shape[0], T, *x.shape[2:]), x.dtype)
    _validate(*(spec(x) for x in (q, k, v, g, beta)), initial_state, A_log, dt_bias, cu_seqlens, opts)
    if initial_state is not None and opts.state_v_first:
        initial_state = jnp.swapaxes(initial_state, -1, -2)
    local_opts = dataclasses.replace(opts, output_final_state=True, state_v_first=False).keywords()

    def local(q, k, v, g, beta, params, h0, cu):
        with warnings.catch_warnings():  # a device's slice may be shorter than the heads
            warnings.simplefilter("ignore", LayoutWarning)
            return chunk_kda(
                q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, A_log=params[0], dt_bias=params[1], **local_opts
            )

    if cp.mesh is None:
        out = context_parallel.on_device(
            local,
            cp.axis,
            q,
            k,
            v,
            g,
            beta,
            (A_log, dt_bias),
            initial_state,
            cu_seqlens,
            return_intermediate_states=intermediate,
            final_states=opts.output_final_state,
        )
    else:
        out = context_parallel.sharded(
            local,
            cp,
            q,
            k,
            v,
            g,
            beta,
            (A_log, dt_bias),
            initial_state,
            cu_seqlens,
            pad_gate=-jnp.inf if opts.use_gate_in_kernel else 0.0,
            chunk_size=opts.chunk_size,
            return_intermediate_states=intermediate,
            final_states=opts.output_final_state,
        )
    o, final, *h = out
    if opts.state_v_first:
        final = None if final is None else jnp.swapaxes(final, -1, -2)
        h = [jnp.swapaxes(x, -1, -2) for x in h]
    return (o, final, *h)


def fused_recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | Sequence[int] | None = None,
    backend: str = "auto",
    ssm_state_indices: jax.Array | None = None,
    num_accepted_tokens: jax.Array | None = None,
    cu_seqlens_cpu: Sequence[int] | np.ndarray | None = None,
    transpose_state_layout: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Token-by-token Kimi Delta Attention (decoding, short T), with FLA's ``fused_recurrent_kda`` keywords.

    Differentiable by autodiff through the scan over tokens, which stores one state per token.

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, safe_gate, state_v_first, cu_seqlens: as :func:`chunk_kda`.
        disable_recompute, return_intermediate_states: accepted (validated) and ignored, as
            FLA's ``fused_recurrent_kda`` takes and ignores them: nothing is recomputed, and
            there are no chunks (two outputs whatever ``return_intermediate_states`` says).
        backend: "auto", "xla", "naive", "pallas_tpu" or "pallas_gpu" (the decode kernels: rows of
            at most ``kdax.ops.kda.decode.MAX_TOKENS`` tokens, no ``cu_seqlens``; "auto" runs
            them on their device where they take the inputs, :func:`kdax.explain_backend`).
        ssm_state_indices: slots of a state pool ``initial_state`` [S, HV, K, V], as
            :func:`chunk_kda` takes them ([N]), or [N, Tmax] for speculative decoding: the state
            after token t of sequence n (at most Tmax tokens) is written to ``idx[n, t]``, and
            the sequence starts from ``idx[n, num_accepted_tokens[n] - 1]`` (column 0 without
            ``num_accepted_tokens``): the state after the last token the previous step accepted.
            No sequence may start from a slot another sequence of the call writes (the decode
            kernels read and write the pool in place; ValueError when concrete). The decode
            kernels address the pool themselves where it is float32 with K and V as they pad
            them (128 on TPU, powers of two >= 16 on GPU); otherwise the states are gathered
            before the op and scattered after it.
        num_accepted_tokens: [N] ints in [1, Tmax], with [N, Tmax] ``ssm_state_indices``
            (traced counts are clipped to that range).
        cu_seqlens_cpu, transpose_state_layout: FLA 0.6's names, as :func:`chunk_kda` takes them.

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] float32 or None)``, or
        ``(o, pool)`` with ``ssm_state_indices``.

    Raises:
        ValueError: a bad argument, named, with what was expected and what came.
        NotImplementedError: a backend this op lacks.
    """
    cu_seqlens, state_v_first = _fla_names(cu_seqlens, cu_seqlens_cpu, None, state_v_first, transpose_state_layout)
    cu_seqlens = offsets(cu_seqlens)
    opts = Options(
        op="recurrent",
        backend=backend,
        scale=scale,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states,
        state_v_first=state_v_first,
        chunk_size=None,
        check_offsets=check_traced(cu_seqlens),
    )
    if ssm_state_indices is not None:
        arrays = (q, k, v, g, beta, initial_state, ssm_state_indices, num_accepted_tokens, cu_seqlens, A_log, dt_bias)
        return _slotted(opts, *arrays)
    N = _validate(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, opts)
    backend, config = _recurrent_backend(backend, q, cu_seqlens)
    opts = dataclasses.replace(
        opts, backend=backend, config=config, disable_recompute=False, return_intermediate_states=False
    )
    return _call(opts, N, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens)


def _slotted(opts: Options, q, k, v, g, beta, pool, idx, accepted, cu, A_log, dt_bias, context_parallel=None):
    """A public op's call (``opts.op``) with state slots ``idx`` of ``pool`` (``accepted``: the
    recurrent op's num_accepted_tokens): a decode kernel on the pool in place where it takes it,
    else each sequence's state read from the pool, the op run as without slots, the states written
    back (:mod:`kdax.ops.kda.slots`). Returns the op's outputs with the updated pool second."""
    op = opts.op
    opts = dataclasses.replace(opts, output_final_state=True)
    N = _validate(q, k, v, g, beta, None, A_log, dt_bias, cu, opts)
    HV, V, K = *v.shape[2:], q.shape[-1]
    lengths = None if isinstance(cu, jax.core.Tracer) else np.full(N, q.shape[1]) if cu is None else np.diff(cu)
    state = (HV, V, K) if opts.state_v_first else (HV, K, V)
    slots.check(pool, idx, accepted, N=N, state_shape=state, per_token=op == "recurrent", lengths=lengths)
    if op == "recurrent" and cu is None and (fast := _in_kernel_slots(opts, q, pool, idx)):
        o = dataclasses.replace(
            opts, backend=fast[0], config=fast[1], scale=K**-0.5 if opts.scale is None else opts.scale
        )
        read, write = slots.kernel_tables(pool.shape[0], idx, accepted, q.shape[1])
        return _compiled_slots(o, heads_axis(), q, k, v, g, beta, pool, read, write, A_log, dt_bias)
    h0 = slots.read(pool, idx, accepted)
    if idx.ndim == 1:
        keywords = {n: x for n, x in opts.keywords().items() if n != "output_final_state"}
        keywords.update(cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias)
        if op == "chunk":
            keywords["context_parallel"] = context_parallel
        run = chunk_kda if op == "chunk" else fused_recurrent_kda
        with warnings.catch_warnings():  # the caller's call warned already
            warnings.simplefilter("ignore", LayoutWarning)
            o, final, *h = run(q, k, v, g, beta, initial_state=h0, output_final_state=True, **keywords)
        return (o, slots.write(pool, idx, final), *h)
    backend, config = _recurrent_backend(opts.backend, q, cu)
    opts = dataclasses.replace(
        opts,
        backend=backend,
        config=config,
        disable_recompute=False,
        return_intermediate_states=False,
        token_states=True,
    )
    o, _, states = _call(opts, N, q, k, v, g, beta, h0, A_log, dt_bias, cu)
    return o, slots.write_tokens(pool, idx, states, cu)


def _in_kernel_slots(opts: Options, q, pool, idx):
    """(backend, config) where a decode kernel runs the call on the pool in place
    (:func:`kdax.ops.kda.decode.in_place`), else None (the states gathered and scattered around
    the op)."""
    backend, config = _recurrent_backend(opts.backend, q, None)
    if RECORDS[backend].decode_slots is None:
        return None
    fits = q.shape[1] and decode.in_place(pool, RECORDS[backend].decode_slots[0], opts.state_v_first)
    return (backend, config) if fits else None


def _recurrent_backend(backend: str, q, cu_seqlens):
    """fused_recurrent_kda's backend and config: "auto" as :func:`kdax.explain_backend` says; a
    Pallas backend asked for by name must take the inputs (ValueError otherwise)."""
    options = {"tokens": q.shape[1], "packed": cu_seqlens is not None}
    backend, config = _OPS["fused_recurrent_kda"].resolve(backend, q.dtype, **options)
    if RECORDS[backend].decode and (why := _refuse_recurrent(backend, q.dtype, None, True, **options)):
        fail("backend", f"inputs the {backend} decode kernel takes, not {why}", repr(backend))
    return backend, config


def _call(o: Options, N, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens):
    """Run a validated call: the naive reference as it is (it loops over concrete sequences),
    every other backend compiled once per shape and static option."""
    o = dataclasses.replace(o, scale=q.shape[-1] ** -0.5 if o.scale is None else float(o.scale))
    if RECORDS[o.backend].reference:
        return _apply(o, N, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens)
    return _compiled(o, N, heads_axis(), q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens)


def _core(o: Options):
    """(q, k, v, g, beta, h0, cu_seqlens, **in-core options) -> (o, final[, states entering each chunk]) of a
    backend."""
    caps = RECORDS[o.backend]
    if o.op == "recurrent" and caps.decode:
        return functools.partial(caps.decode, cfg=o.config)
    if o.op == "recurrent":
        core = functools.partial(caps.cores["recurrent"], token_states=o.token_states)
    else:

        def core(q, k, v, g, beta, h0, cu, **options):
            layout = chunk_layout(q.shape[1], o.chunk_size, cu)
            return caps.cores["chunk"](
                q,
                k,
                v,
                g,
                beta,
                h0,
                layout,
                cfg=o.config,
                disable_recompute=o.disable_recompute,
                intermediate_states=o.return_intermediate_states,
                **options,
            )

    return _repeated_qk(core) if caps.repeats_qk else core


def _decode_options(o: Options) -> decode.Options:
    """What the decode kernels apply in the op."""
    return decode.Options(
        gate=o.use_gate_in_kernel,
        lower_bound=o.lower_bound,
        l2norm=o.use_qk_l2norm_in_kernel,
        beta_sigmoid=o.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=o.allow_neg_eigval,
        scale=o.scale,
        token_states=o.token_states,
    )


def _apply(o: Options, N, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens):
    """Apply the in-op options and run the backend's core (or the naive reference). pallas_gpu
    gets the raw gate logits and unnormalised, unscaled q and k, with keyword arguments saying
    how to apply the gate, the L2 norm and the scale itself. States in and out are [N, HV, V, K]
    with ``state_v_first``; so are the states entering each chunk (``return_intermediate_states``)."""
    if o.state_v_first and initial_state is not None:
        initial_state = jnp.swapaxes(initial_state, -1, -2)
    caps = RECORDS[o.backend]
    core = None if caps.reference else _core(o)
    if o.op == "recurrent" and caps.decode:  # the gate, norm, beta and scale in the kernel
        core = functools.partial(core, opt=_decode_options(o), gate_params=(A_log, dt_bias))
        o = dataclasses.replace(
            o, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, scale=None
        )
    elif caps.raw_inputs:
        gate = (A_log, dt_bias, o.lower_bound) if o.use_gate_in_kernel else None
        core = functools.partial(core, g_dtype=g.dtype, gate=gate, l2norm_qk=o.use_qk_l2norm_in_kernel, scale=o.scale)
        o = dataclasses.replace(o, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, scale=None)
    if caps.input_dtype and o.op == "chunk":
        core = functools.partial(core, input_dtype=q.dtype)
    q, k, g, beta = _preprocess(q, k, g, beta, A_log, dt_bias, o)
    if caps.reference and o.token_states:
        out = naive_token_states(q, k, v, g, beta, scale=o.scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    elif caps.reference:
        out = naive_recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            scale=o.scale,
            initial_state=initial_state,
            output_final_state=o.output_final_state,
            cu_seqlens=cu_seqlens,
            return_intermediate_states=o.return_intermediate_states,
            chunk_size=o.chunk_size or 64,
        )
    else:
        out = _run(core, o, N, q, k, v, g, beta, initial_state, cu_seqlens)
    return out[0], *(jnp.swapaxes(x, -1, -2) if o.state_v_first and x is not None else x for x in out[1:])


def _apply_per_shard(o: Options, N, heads, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens):
    """:func:`_apply`, per shard of the batch and head axes where the inputs' types shard them (or
    of the heads over ``heads``, :func:`kdax.ops.common.sharding.heads_axis`)."""
    rows = "batch" if cu_seqlens is None else None  # packed sequences: one row, N sequences
    bthd, bth = ("batch", None, "heads", None), ("batch", None, "heads")
    roles = (bthd, bthd, bthd, bthd, bth, (rows, "heads", None, None), ("heads",), ("heads",), None)
    outs = (bthd, (rows, "heads", None, None) if o.output_final_state else None)
    outs += (("batch", None, "heads", None, None),) if o.return_intermediate_states or o.token_states else ()

    def local(q, k, v, g, beta, h0, A_log, dt_bias, cu):
        n = q.shape[0] if cu is None else N  # sequences on this shard
        return _apply(o, n, q, k, v, g, beta, h0, A_log, dt_bias, cu)

    return per_shard(local, (q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens), roles, outs, heads)


_compiled = jax.jit(_apply_per_shard, static_argnums=(0, 1, 2))


def _apply_slots(o: Options, heads, q, k, v, g, beta, pool, read, write, A_log, dt_bias):
    """A decode kernel's call on a state pool in place (``read``, ``write``:
    :func:`kdax.ops.kda.slots.kernel_tables`), per shard of the head axis where the inputs'
    types shard it. Returns (o in q's dtype, the pool)."""
    dt = jnp.promote_types(q.dtype, jnp.float32)
    kernel = functools.partial(
        RECORDS[o.backend].decode_slots[1], opt=_decode_options(o), cfg=o.config, v_first=o.state_v_first
    )

    def local(q, k, v, g, beta, pool, read, write, A_log, dt_bias):
        xs = (jnp.asarray(x, dt) for x in (q, k, v, g, beta))
        out, pool = kernel(*xs, pool, read, write, gate_params=(A_log, dt_bias))
        return out.astype(q.dtype), pool

    thd, states = (None, None, "heads", None), (None, "heads", None, None)
    roles = (thd, thd, thd, thd, (None, None, "heads"), states, None, None, ("heads",), ("heads",))
    return per_shard(local, (q, k, v, g, beta, pool, read, write, A_log, dt_bias), roles, (thd, states), heads)


_compiled_slots = jax.jit(_apply_slots, static_argnums=(0, 1))
