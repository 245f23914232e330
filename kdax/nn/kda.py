"""FLA's ``KimiDeltaAttention`` layer in Flax NNX (same parameters and initialisation)."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdax.nn.conv import ShortConvolution, from_previous_device, short_conv
from kdax.nn.norm import GatedRMSNorm
from kdax.ops.common.dispatch import scoped_backend
from kdax.ops.common.sharding import Layout
from kdax.ops.common.validation import LayoutWarning
from kdax.ops.kda import slots as pool_slots
from kdax.ops.kda.api import capabilities, chunk_kda, fused_recurrent_kda
from kdax.ops.kda.context_parallel import ContextParallel
from kdax.ops.kda.decode import MAX_TOKENS as MAX_DECODE_TOKENS

MODES = ("chunk", "fused_recurrent")
RECURRENT_MAX_TOKENS = 64  # FLA's rule: inference on <= 64 new tokens uses the recurrent kernel


class KDACache(NamedTuple):
    """Per-sequence decoding state of a :class:`KimiDeltaAttention` layer.

    Attributes:
        recurrent: [N, HV, K, V] float32 (float64 with float64 inputs), the delta-rule state.
        conv: the q, k and v convolution caches, each [N, D, conv_size] (D: H * K for q and
            k, HV * V for v), or None without short convolutions.
    """

    recurrent: jax.Array
    conv: tuple[jax.Array, jax.Array, jax.Array] | None


class KimiDeltaAttention(nnx.Module):
    """Kimi Delta Attention (FLA's layer, same parameters and initialisation): x [B, T,
    hidden_size] -> [B, T, hidden_size].

    Heads: num_heads query/key heads of dim head_dim (K), num_v_heads value heads (HV,
    default num_heads) of dim head_dim * expand_v (V). ``deterministic`` (set by
    ``model.eval()`` / ``model.train()``) selects FLA's rule (:meth:`pick_mode`): in
    inference, inputs of <= 64 tokens run the recurrent kernel; everything else runs ``mode``
    (the chunked form by default). ``backend`` and ``chunk_size`` are passed to
    :func:`kdax.chunk_kda`, ``backend`` to :func:`kdax.fused_recurrent_kda` too. The recurrent
    op's Pallas kernels (the decode kernels) take rows of at most
    ``kdax.ops.kda.decode.MAX_TOKENS`` tokens: on a Pallas backend (the layer's own or
    :func:`kdax.use_backend`'s) packed or longer inputs decode with that backend's chunked
    kernels, and per-token slots with the xla recurrence.

    Args:
        hidden_size: the input and output size.
        expand_v: V / K; head_dim * expand_v must be an int.
        head_dim: K, the query/key head dim.
        num_heads: H, the query/key heads.
        num_v_heads: HV, the value heads, a multiple of ``num_heads`` (default ``num_heads``).
        mode: "chunk" or "fused_recurrent": the form for training and for inference inputs of
            more than 64 tokens (FLA's rule).
        use_short_conv: a :class:`ShortConvolution` (SiLU) on q, k and v, else SiLU alone.
        allow_neg_eigval: beta = 2 * sigmoid (in [0, 2)) instead of sigmoid.
        safe_gate: FLA's bounded gate: A_log starts at 0 and ``lower_bound`` is required.
        lower_bound: None, or a negative float: the gate becomes
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (see :func:`kdax.kda_gate`).
        conv_size: the short convolutions' kernel size.
        conv_bias: whether the short convolutions have a bias.
        low_rank_gates: the gate and output-gate projections through rank head_v_dim (FLA and
            Kimi Linear: ``f_proj``, ``g_proj`` are two-linear ``nnx.Sequential``), else one
            linear each (the Ling hybrids).
        output_gate_bias: whether the output gate's last linear has a bias (FLA: yes; Kimi
            Linear, Ling: no).
        layer_idx: stored, the layer's index in a model.
        norm_eps: the output norm's epsilon.
        backend: the ops' backend ("auto", "xla", "naive", "pallas_tpu", "pallas_gpu").
        chunk_size: :func:`kdax.chunk_kda`'s chunk size.
        rngs: the parameters' random keys.

    Raises:
        ValueError: ``mode`` is not "chunk" or "fused_recurrent"; ``num_heads`` or ``head_dim`` is not
            positive; ``num_v_heads`` is not a multiple of ``num_heads``; ``expand_v`` does not
            make head_dim * expand_v a positive int; ``lower_bound`` is not None or negative,
            or is None with ``safe_gate``.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1.0,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        low_rank_gates: bool = True,
        output_gate_bias: bool = True,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        *,
        backend: str = "auto",
        chunk_size: int = 64,
        rngs: nnx.Rngs,
    ):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = round(head_dim * expand_v)
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads, head_dim: expected positive ints, got {num_heads}, {head_dim}")
        if num_v_heads < 1 or num_v_heads % num_heads:
            raise ValueError(f"num_v_heads: expected a multiple of num_heads={num_heads}, got {num_v_heads}")
        if head_v_dim < 1 or not math.isclose(head_dim * expand_v, head_v_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v: expected head_dim * expand_v to be a positive int, got {head_dim * expand_v}")
        if lower_bound is not None and not lower_bound < 0:
            raise ValueError(f"lower_bound: expected None or a negative float, got {lower_bound}")
        if safe_gate and lower_bound is None:
            raise ValueError("lower_bound: required (e.g. -5.0) when safe_gate=True")
        self.hidden_size, self.mode, self.layer_idx = hidden_size, mode, layer_idx
        self.num_heads, self.num_v_heads = num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_dim, head_v_dim
        self.use_short_conv, self.conv_size = use_short_conv, conv_size
        self.allow_neg_eigval, self.safe_gate, self.lower_bound = allow_neg_eigval, safe_gate, lower_bound
        self.backend, self.chunk_size, self.deterministic = backend, chunk_size, False
        self.layout: Layout | None = None  # set by kdax.models.shard
        key_dim, value_dim, gate_dim = num_heads * head_dim, num_v_heads * head_v_dim, num_v_heads * head_dim
        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)
        self.q_proj, self.k_proj = linear(hidden_size, key_dim), linear(hidden_size, key_dim)
        self.v_proj = linear(hidden_size, value_dim)
        if use_short_conv:
            conv = lambda d: ShortConvolution(d, conv_size, bias=conv_bias, activation="silu", rngs=rngs)
            self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(key_dim), conv(key_dim), conv(value_dim)
        if low_rank_gates:
            self.f_proj = nnx.Sequential(linear(hidden_size, head_v_dim), linear(head_v_dim, gate_dim))
        else:
            self.f_proj = linear(hidden_size, gate_dim)
        self.b_proj = linear(hidden_size, num_v_heads)
        a = jax.random.uniform(rngs.params(), (num_v_heads,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.zeros((num_v_heads,)) if safe_gate else jnp.log(a))
        u = jax.random.uniform(rngs.params(), (gate_dim,), jnp.float32)
        dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001)), 1e-4)
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))  # softplus(dt_bias) = dt
        if low_rank_gates:
            self.g_proj = nnx.Sequential(
                linear(hidden_size, head_v_dim), linear(head_v_dim, value_dim, bias=output_gate_bias)
            )
        else:
            self.g_proj = linear(hidden_size, value_dim, bias=output_gate_bias)
        self.o_norm = GatedRMSNorm(head_v_dim, activation="sigmoid", eps=norm_eps)
        self.o_proj = linear(value_dim, hidden_size)

    def init_cache(self, num_seqs: int, dtype=jnp.float32) -> KDACache:
        """Zero state for ``num_seqs`` sequences.

        Args:
            num_seqs: N, the sequences.
            dtype: the convolution caches' dtype.

        Returns:
            A :class:`KDACache`: recurrent [N, HV, K, V] float32 zeros, conv caches
            [N, D, conv_size] zeros in ``dtype`` (None without short convolutions).
        """
        K, V, HV = self.head_k_dim, self.head_v_dim, self.num_v_heads
        conv = None
        if self.use_short_conv:
            conv = tuple(
                jnp.zeros((num_seqs, c.hidden_size, self.conv_size), dtype)
                for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            )
        return KDACache(jnp.zeros((num_seqs, HV, K, V), jnp.float32), conv)

    def pick_mode(self, num_tokens: int) -> str:
        """FLA's kernel choice for an input of ``num_tokens`` tokens.

        Args:
            num_tokens: T.

        Returns:
            "fused_recurrent" in inference (``deterministic``) for T <= 64, else the layer's ``mode``.
        """
        return "fused_recurrent" if self.deterministic and num_tokens <= RECURRENT_MAX_TOKENS else self.mode

    def __call__(
        self,
        x,
        *,
        cu_seqlens=None,
        cache: KDACache | None = None,
        output_cache: bool = False,
        mode: str | None = None,
        slots=None,
        accepted=None,
    ):
        """Run the layer over each sequence, continuing from ``cache``.

        Args:
            x: [B, T, hidden_size].
            cu_seqlens: [N + 1] int offsets of sequences packed in one row (B = 1), or None
                (N = B, one sequence per row).
            cache: the :class:`KDACache` each sequence starts from, or None (zeros).
            output_cache: whether to return the final state.
            mode: "chunk" or "fused_recurrent"; None: :meth:`pick_mode`'s choice.
            slots: None, or the sequences' slots in ``cache``, which is then a pool of S states
                (:meth:`init_cache` of S) read and written as :func:`kdax.fused_recurrent_kda`'s
                ``ssm_state_indices`` says, the convolution caches too: [N] (one per sequence), or
                [N, Tmax] (the state after each token, for speculative decoding: the recurrent
                form, on the xla backend where the layer's is a Pallas one).
            accepted: None, or with [N, Tmax] slots :func:`kdax.fused_recurrent_kda`'s
                ``num_accepted_tokens`` [N]: each sequence starts from slot column accepted - 1.

        Returns:
            (y [B, T, hidden_size] in the dtype x and the weights promote to, the final
            :class:`KDACache` if ``output_cache`` else None; with ``slots`` the updated pool).

        Raises:
            ValueError: ``x``'s last dim is not hidden_size; ``mode`` is not None, "chunk" or
                "fused_recurrent"; a ``cu_seqlens`` or ``cache`` that does not fit (raised by
                the short convolutions or the KDA ops).
        """
        B, T, D = x.shape
        if D != self.hidden_size:
            raise ValueError(f"x: expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        per_token = slots is not None and slots.ndim == 2
        mode = "fused_recurrent" if per_token else self.pick_mode(T) if mode is None else mode
        if slots is not None and cache is None:
            raise ValueError("cache: expected the pool of states (init_cache(S)) that slots index, got None")
        if mode not in MODES:
            raise ValueError(f"mode: expected None or one of {MODES}, got {mode!r}")
        K, HV = self.head_k_dim, self.num_v_heads
        options = {
            "A_log": self.A_log[...],
            "dt_bias": self.dt_bias[...],
            "lower_bound": self.lower_bound,
            "use_qk_l2norm_in_kernel": True,
            "use_gate_in_kernel": True,
            "use_beta_sigmoid_in_kernel": True,
            "allow_neg_eigval": self.allow_neg_eigval,
        }
        raw = [proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        g, beta = self.f_proj(x), self.b_proj(x)
        if self.layout is not None and mode == "chunk" and cache is None and cu_seqlens is None and not output_cache:
            o, final = self._on_mesh(*raw, g, beta, options), None
        else:
            if self.use_short_conv:
                conv_in = (None,) * 3 if cache is None else cache.conv
                if slots is not None:
                    conv_in = tuple(pool_slots.read(c, slots, accepted) for c in cache.conv)
                convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
                save = output_cache or slots is not None
                outs = [conv(r, c, save, cu_seqlens, per_token) for conv, r, c in zip(convs, raw, conv_in)]
                (q, _), (k, _), (v, _) = outs
                conv_out = tuple(o[1] for o in outs)
                if per_token:
                    conv_out = tuple(
                        pool_slots.write_tokens(p, slots, c, cu_seqlens) for p, c in zip(cache.conv, conv_out)
                    )
                elif slots is not None:
                    conv_out = tuple(pool_slots.write(p, slots, c) for p, c in zip(cache.conv, conv_out))
            else:
                q, k, v = (jax.nn.silu(r) for r in raw)
                conv_out = None
            q, k = q.reshape(B, T, self.num_heads, K), k.reshape(B, T, self.num_heads, K)
            v = v.reshape(B, T, HV, self.head_v_dim)
            options.update(
                initial_state=None if cache is None else cache.recurrent,
                output_final_state=output_cache,
                cu_seqlens=cu_seqlens,
                ssm_state_indices=slots,
            )
            backend = scoped_backend() if self.backend == "auto" else self.backend
            g = g.reshape(B, T, HV, K)
            # the recurrent op runs where its backend takes the inputs (the decode kernels: rows of few tokens)
            caps = capabilities(backend)  # None: "auto"
            takes = not (caps and caps.decode) or (cu_seqlens is None and T <= MAX_DECODE_TOKENS)
            if per_token:  # the recurrent form alone writes a state per token
                backend = self.backend if takes else "xla"
                o, final = fused_recurrent_kda(
                    q, k, v, g, beta, backend=backend, num_accepted_tokens=accepted, **options
                )
            elif mode == "fused_recurrent" and takes:
                o, final = fused_recurrent_kda(q, k, v, g, beta, backend=self.backend, **options)
            else:  # the chunked form; on a Pallas backend decoding inputs its decode kernels do not take
                with warnings.catch_warnings():  # prompts shorter than the heads are meant
                    warnings.simplefilter("ignore", LayoutWarning)
                    o, final = chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size, backend=self.backend, **options)
        gate = self.g_proj(x).reshape(B, T, HV, self.head_v_dim)
        y = self.o_proj(self.o_norm(o, gate).reshape(B, T, HV * self.head_v_dim))
        return y, (KDACache(final, conv_out) if output_cache or slots is not None else None)

    def _on_mesh(self, q, k, v, g, beta, options):
        """The chunked form on this layer's :class:`Layout`, under ``jax.shard_map``: each device
        convolves and runs ``chunk_kda`` on its rows (data axis), heads (model axis) and time slice
        (context axis: the convolutions take the previous device's last inputs, the op is context
        parallel). Nothing else crosses devices.

        Args:
            q, k, v: [B, T, H * K], [B, T, H * K], [B, T, HV * V], the projections before the convolutions.
            g: [B, T, HV * K]; beta: [B, T, HV], raw gate and beta logits.
            options: the in-kernel options of :func:`kdax.chunk_kda` (A_log and dt_bias global).

        Returns:
            o [B, T, HV, V].

        Raises:
            ValueError: B is not a multiple of the data axis's devices, or T of the context axis's
                devices times ``chunk_size``.
        """
        L, (B, T) = self.layout, q.shape[:2]
        if B % L.size(L.data):
            raise ValueError(
                f"x: expected a batch size that is a multiple of the {L.size(L.data)} devices of mesh "
                f"axis {L.data!r}, got {B}"
            )
        if L.context and T % (L.size(L.context) * self.chunk_size):
            raise ValueError(
                f"x: expected a length that is a multiple of {L.size(L.context) * self.chunk_size} (the "
                f"{L.size(L.context)} devices of mesh axis {L.context!r} x chunk_size), got {T}"
            )
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d) if self.use_short_conv else ()
        weights = [(c.weight[...], None if c.bias is None else c.bias[...]) for c in convs]
        A_log, dt_bias = options.pop("A_log"), options.pop("dt_bias")
        K = self.head_k_dim

        def local(q, k, v, g, beta, weights, A_log, dt_bias):
            xs = (q, k, v)
            if convs:
                xs = [
                    short_conv(
                        x, w, b, c.activation, from_previous_device(x, L.context, c.kernel_size) if L.context else None
                    )[0]
                    for x, (w, b), c in zip(xs, weights, convs)
                ]
            else:
                xs = [jax.nn.silu(x) for x in xs]
            Bl, Tl = q.shape[:2]
            q, k, v = (x.reshape(Bl, Tl, -1, d) for x, d in zip(xs, (K, K, self.head_v_dim)))
            cp = ContextParallel(L.context) if L.context else None
            with warnings.catch_warnings():  # a device's rows may be shorter than its heads
                warnings.simplefilter("ignore", LayoutWarning)
                out = chunk_kda(
                    q,
                    k,
                    v,
                    g.reshape(Bl, Tl, -1, K),
                    beta,
                    A_log=A_log,
                    dt_bias=dt_bias,
                    context_parallel=cp,
                    chunk_size=self.chunk_size,
                    backend=self.backend,
                    **options,
                )
            return out[0]

        rows, heads = P(L.data, L.context, L.model), P(L.model)
        return jax.shard_map(
            local,
            mesh=L.mesh,
            in_specs=(rows,) * 5 + (heads, heads, heads),
            out_specs=P(L.data, L.context, L.model, None),
            check_vma=False,
        )(q, k, v, g, beta, weights, A_log, dt_bias)
