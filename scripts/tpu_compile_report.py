"""Compile every pallas_tpu kernel for TPU chips on a machine without a TPU, and report what the
compiler made of each: whether Mosaic accepts it, its VMEM, and its static cycles.

    python scripts/tpu_compile_report.py [--chips v5e,v6e,tpu7x] [--only REGEX] [--check]
        [--peers] [--json FILE]

Needs Python >= 3.12 and the ``tpu-check`` extra (``pip install -e ".[tpu-check]"``: jax 0.12 with
libtpu, and tokamax for ``--peers``). libtpu compiles for a TPU topology that has no devices
(``jax.experimental.topologies.get_topology_desc``): each case is ``jax.jit(f).trace(*args)
.lower().compile()`` with the ops built as on a TPU (``dispatch.building_for("tpu")``), which runs
Mosaic's compiler, where a real TPU rejects a kernel that the interpreter and the lowering accept.

The cases (:func:`cases`) cover every kernel at small shapes: KDA's chunked forward and backward
(fused and staged, bf16 and float32, dense and variable-length with empty and one-token
sequences, K = 64, 128 and 256 and K = 100 with V = 60, chunk_size 64 and 128, the in-op gate
with and without a lower bound, the L2 norm and beta sigmoid, grouped value heads, kept
intermediates, states in and out, [V, K] states), the decode kernel (one token and a row of
drafts, with and without a pool of state slots in both layouts), and Kascade's anchor, reuse and
two decode steps in both dtypes at D = 64 and 128, with selections of odd sizes.

Per case and chip it prints whether it compiled (else Mosaic's or XLA's first error line), and per
Mosaic kernel its scoped VMEM (the kernel's VMEM allocations: scratch, internal scratch and the
double-buffered windows of its blocks) and static cycles: its VLIW bundles after register
allocation, each weighted by the trip counts of the loops around it (:func:`kdax.bench.llo.static_cycles`). The
last column is the whole compiled program's static cycles, XLA's fusions included. Static cycles
count no memory stalls and take predicated regions as executed: compare like with like (same
shape, chip and counting), not with wall time.

``--peers`` adds the comparisons at a benchmark shape: chunk_kda at B = 1, T = 8192, K = V = 128,
bf16 q, k, v and beta and float32 log-space gates (H = 16 on v5e and v6e, 32 on TPU7x), on kdax's
pallas_tpu and xla backends and tokamax 0.0.17's Pallas Mosaic KDA; and Kascade at T = 16384,
H = 32, G = 8, D = 128 with 10% of the keys, pallas_tpu and xla against jax's dense causal
splash attention. ``--check`` exits 1 when any case fails to compile. ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time

from kdax.bench.llo import is_kernel, read_dump
from kdax.ops.kda.shapes import BENCHMARK, DECODE_STEP

CHIPS = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:1x1x1"}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chips", default="v5e,v6e,tpu7x", help="comma-separated, of " + ", ".join(CHIPS))
    p.add_argument("--only", default="", help="run the cases whose name matches this regex")
    p.add_argument("--check", action="store_true", help="exit 1 when a case fails to compile")
    p.add_argument(
        "--no-listings",
        action="store_true",
        help="compile only, without the LLO listings (no VMEM, cycles or bytes; about 40%% faster: CI's check)",
    )
    p.add_argument("--peers", action="store_true", help="also the benchmark-shape comparisons (slow: minutes)")
    p.add_argument("--no-cases", action="store_true", help="skip the small-shape cases (with --peers)")
    p.add_argument("--json", default=None, help="write every row to this file")
    p.add_argument(
        "--record", default=None, help="with --peers: write the costs table (kdax/ops/common/tpu_costs.json)"
    )
    a = p.parse_args(argv)
    chips = [c for c in a.chips.split(",") if c]
    if bad := [c for c in chips if c not in CHIPS]:
        p.error(f"--chips: expected names among {', '.join(CHIPS)}, got {', '.join(bad)}")
    a.chips = chips
    if a.no_listings and (a.peers or a.record):
        p.error("--no-listings: the comparisons (--peers, --record) need the listings")
    try:
        re.compile(a.only)
    except re.error as e:
        p.error(f"--only: expected a regular expression ({e})")
    return a


# ----------------------------------------------------------------------------- compiling


@dataclasses.dataclass
class Row:
    case: str
    chip: str
    ok: bool
    error: str = ""
    kernels: list = dataclasses.field(default_factory=list)  # [(name, vmem bytes, cycles, unknown loops)]
    cycles: int = 0  # the whole program
    unknown_loops: int = 0
    seconds: float = 0.0
    modelled: list = dataclasses.field(default_factory=list)  # ["kernel trips"]: see Compiler.compile
    hbm_bytes: int = 0  # the whole program's DMA bytes (static_cycles), modelled trips and shares included
    unknown_dmas: int = 0  # DMA waits of unknown size (the bytes a lower bound)


class Compiler:
    """Compiles for one chip at a time, each compile's LLO dump read and then removed."""

    def __init__(self, dump: str | None):
        self.dump = dump  # None: no listings (whether each case compiles, and how long it takes)

    def compile(
        self, case: str, chip: str, fn, args, mesh, *, kdax_ops=True, trips=None, shares=None, options=None
    ) -> Row:
        """Compile ``fn(*args)`` (kdax's ops built as on a TPU) within the chip's abstract mesh, which
        tells the kernels that ask which TPU they target. ``trips`` {kernel name: mean trips, or a
        tuple of them}: the kernel's loops of data-dependent trips (one, or as many as the tuple, in
        the listing's order) counted that many times (the mean the shape implies,
        :func:`kascade_trips`) instead of once; the row lists them under ``modelled``.
        ``shares`` {kernel name: share}: the kernel's cycles and bytes times the share of its grid
        steps that run (a causal mask's blocks, :func:`causal_share`), also under ``modelled``.
        ``options``: XLA compiler options (a raised scoped VMEM limit)."""
        import jax

        from kdax.ops.common.dispatch import building_for

        before = set(os.listdir(self.dump)) if self.dump else set()
        t0 = time.perf_counter()
        try:
            with building_for("tpu" if kdax_ops else None), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                jax.jit(fn).trace(*args).lower().compile(compiler_options=options)
            row = Row(case, chip, True)
        except Exception as e:  # the compiler's message is the result
            row = Row(case, chip, False, error=_first_error(str(e)))
        row.seconds = time.perf_counter() - t0
        new = [os.path.join(self.dump, f) for f in sorted(set(os.listdir(self.dump)) - before)] if self.dump else []
        if row.ok and self.dump:
            programs = read_dump(new)
            for p in programs:
                n = (trips or {}).get(p.name.rsplit(".", 1)[0])
                n = (n,) if isinstance(n, (int, float)) else n
                if n is not None and len(p.unknown_bodies) == len(n):
                    for k, cycles, nbytes in zip(n, p.unknown_bodies, p.unknown_body_bytes):
                        p.cycles += round((k - 1) * cycles)
                        p.dma_bytes += round((k - 1) * nbytes)
                    p.unknown_loops -= len(n)
                    row.modelled.append(f"{p.name} {', '.join(f'{k:.1f}' for k in n)}")
                share = (shares or {}).get(p.name.rsplit(".", 1)[0])
                if share is not None:
                    p.cycles, p.dma_bytes = round(p.cycles * share), round(p.dma_bytes * share)
                    row.modelled.append(f"{p.name} x {share:.3f}")
            row.kernels = [(p.name, p.vmem, p.cycles, p.unknown_loops) for p in programs if is_kernel(p.name)]
            row.cycles = sum(p.cycles for p in programs)
            row.unknown_loops = sum(p.unknown_loops for p in programs)
            row.hbm_bytes = sum(p.dma_bytes for p in programs)
            row.unknown_dmas = sum(p.unknown_dmas for p in programs)
        for path in new:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return row


def _first_error(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    head = lines[0] if lines else message
    op = next((ln for ln in lines if ln.startswith("%")), "")
    return (head + (f" [{op}]" if op else ""))[:400]


def topology_args(chip: str):
    """(make, topology): ``make(shape, dtype)`` gives a ShapeDtypeStruct on the chip's one device."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    topo = topologies.get_topology_desc(platform="tpu", topology_name=CHIPS[chip])
    mesh = Mesh(topo.devices[:1], ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    return (lambda shape, dtype: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)), mesh


# ----------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class KDA:
    """One chunk_kda case: forward, and forward and backward when ``grad``."""

    name: str
    dtype: str = "bfloat16"
    pipeline: str = "fused"
    varlen: bool = False
    T: int = 200
    H: int = 1
    HV: int = 2
    K: int = 128
    V: int = 128
    chunk_size: int = 64
    in_op: bool = True  # gate from raw logits with A_log and dt_bias, L2 norm, beta sigmoid
    lower_bound: float | None = None
    keep: bool = False  # disable_recompute
    states: bool = False  # initial and final states, intermediate states
    v_first: bool = False


def kda_cases() -> list[KDA]:
    out = []
    for pipeline in ("fused", "staged"):
        for dtype in ("bfloat16", "float32"):
            for varlen in (False, True):
                name = f"kda {pipeline} {dtype} {'varlen' if varlen else 'dense'}"
                out.append(KDA(name, dtype, pipeline, varlen))
    out += [
        KDA("kda K=64", K=64, V=64),
        KDA("kda K=256", K=256, V=256),
        KDA("kda K=100 V=60", K=100, V=60, varlen=True),
        KDA("kda chunk 128", chunk_size=128, T=300),
        KDA("kda chunk 128 staged float32", dtype="float32", pipeline="staged", chunk_size=128, T=300),
        KDA("kda lower_bound", lower_bound=-5.0),
        KDA("kda log-space gate", in_op=False, H=2),
        KDA("kda disable_recompute", keep=True),
        KDA("kda disable_recompute staged varlen", keep=True, pipeline="staged", varlen=True),
        KDA("kda states", states=True, varlen=True),
        KDA("kda states v_first", states=True, v_first=True),
    ]
    return out


CU = (0, 0, 1, 70, 200)  # an empty and a one-token sequence


def kda_call(c: KDA, make):
    """(fn of (q, k, v, g, beta[, h0]), args, grad fn): chunk_kda on pallas_tpu."""
    import jax
    import jax.numpy as jnp

    import kdax

    dt, f32 = jnp.dtype(c.dtype), jnp.float32
    B = 1 if c.varlen else 2
    N = len(CU) - 1 if c.varlen else B
    args = [make((B, c.T, c.H, c.K), dt), make((B, c.T, c.H, c.K), dt), make((B, c.T, c.HV, c.V), dt)]
    args += [make((B, c.T, c.HV, c.K), f32), make((B, c.T, c.HV), dt)]
    h0_shape = (N, c.HV, c.V, c.K) if c.v_first else (N, c.HV, c.K, c.V)
    if c.states:
        args.append(make(h0_shape, f32))
    opts = {
        "backend": "pallas_tpu",
        "chunk_size": c.chunk_size,
        "config": kdax.ops.kda.pallas_tpu.Config(pipeline=c.pipeline),
    }
    if c.varlen:
        opts["cu_seqlens"] = jnp.array(CU, jnp.int32)
    if c.in_op:
        opts.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        opts.update(A_log=jnp.linspace(-1.0, 1.0, c.HV), dt_bias=jnp.zeros((c.HV * c.K,)), lower_bound=c.lower_bound)
    if c.keep:
        opts["disable_recompute"] = True
    if c.states:
        opts.update(output_final_state=True, return_intermediate_states=True, state_v_first=c.v_first)

    def fwd(q, k, v, g, beta, h0=None):
        return kdax.chunk_kda(q, k, v, g, beta, initial_state=h0, **opts)

    def loss(*xs):
        outs = [o for o in fwd(*xs) if o is not None]
        return sum(jnp.sum(o.astype(f32) ** 2) for o in outs)

    return fwd, args, jax.grad(loss, argnums=tuple(range(len(args))))


def decode_cases():
    out = []
    for dtype in ("bfloat16", "float32"):
        for T in (1, 4):
            out.append((f"decode {dtype} T={T}", dtype, T, None))
            out.append((f"decode {dtype} T={T} slots", dtype, T, "kv"))
            out.append((f"decode {dtype} T={T} slots v_first", dtype, T, "vk"))
    return out


def decode_call(dtype: str, T: int, pool, make, B=3, H=2, HV=4, K=128, V=128):
    import jax.numpy as jnp

    import kdax

    dt, f32 = jnp.dtype(dtype), jnp.float32
    args = [make((B, T, H, K), dt), make((B, T, H, K), dt), make((B, T, HV, V), dt), make((B, T, HV, K), f32)]
    args.append(make((B, T, HV), dt))
    opts = {"backend": "pallas_tpu", "use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True}
    opts.update(use_beta_sigmoid_in_kernel=True, A_log=jnp.zeros((HV,)), dt_bias=jnp.zeros((HV * K,)))
    if pool is None:
        args.append(make((B, HV, K, V), f32))
        opts["output_final_state"] = True
    else:
        args.append(make((2 * B * T, HV, *((V, K) if pool == "vk" else (K, V))), f32))
        opts["state_v_first"] = pool == "vk"
        slots = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) + B * T
        # per-token slots; each row starts from slot b (written by no row)
        opts["ssm_state_indices"] = jnp.concatenate([slots, jnp.arange(B, dtype=jnp.int32)[:, None]], axis=1)
        opts["num_accepted_tokens"] = jnp.full((B,), T + 1, jnp.int32)

    def fn(q, k, v, g, beta, h0):
        return kdax.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, **opts)

    return fn, args


def kascade_cases():
    cases = [
        (f"kascade {op} {dtype} D={D}", op, dtype, D, 1)
        for op in ("anchor", "reuse", "anchor_decode", "reuse_decode")
        for dtype in ("bfloat16", "float32")
        for D in (64, 128)
    ]
    pooled = [("anchor", 16), ("anchor", 128), ("anchor_dense", 64), ("reuse", 16), ("reuse", 128)]
    pooled += [("anchor_decode", 16), ("reuse_decode", 128), ("anchor_decode", 128), ("anchor_decode_heads", 128)]
    pooled += [("reuse_decode_heads", 128)]
    return cases + [
        (f"kascade {op} {dtype} D=128 pool {P}", op, dtype, 128, P)
        for op, P in pooled
        for dtype in ("bfloat16", "float32")
    ]


def kascade_call(op: str, dtype: str, D: int, make, B=1, T=600, H=4, G=2, L=1000, pool_size=1):
    """T and L not multiples of the blocks, budgets not multiples of 8 or 128."""
    import jax
    import jax.numpy as jnp

    import kdax

    dt = jnp.dtype(dtype)
    q, k, v = make((B, T, H, D), dt), make((B, T, G, D), dt), make((B, T, G, D), dt)
    qd, kc, vc, lengths = make((B, H, D), dt), make((B, L, G, D), dt), make((B, L, G, D), dt), make((B,), jnp.int32)
    opts = {"backend": "pallas_tpu", "pool_size": pool_size}
    pct = 12.5 if pool_size < 64 else 40.0  # pools of 128 keys: some tiles select one
    anchor = lambda q, k, v: kdax.kascade_anchor(q, k, v, topk_percent=pct, min_k=40, **opts)
    anchor_decode = lambda q, k, v, n: kdax.kascade_anchor_decode(q, k, v, n, topk_percent=10.3, min_k=50, **opts)
    if op == "anchor":
        return anchor, [q, k, v]
    if op == "anchor_dense":
        return lambda q, k, v: kdax.kascade_anchor(q, k, v, topk_percent=pct, dense_output=True, **opts), [q, k, v]
    heads = [make((B, G, L, D), dt), make((B, G, L, D), dt)]  # heads-first caches
    if op == "anchor_decode":
        return anchor_decode, [qd, kc, vc, lengths]
    if op == "anchor_decode_heads":
        f = lambda q, k, v, n: kdax.kascade_anchor_decode(q, k, v, n, topk_percent=20, cache_layout="BGLD", **opts)
        return f, [qd, *heads, lengths]
    if op == "reuse_decode_heads":
        idx = jax.eval_shape(anchor_decode, qd, kc, vc, lengths)[0]
        f = lambda q, k, v, n, i: kdax.kascade_reuse_decode(q, k, v, n, i, cache_layout="BGLD", **opts)
        return f, [qd, *heads, lengths, make(idx.shape, idx.dtype)]
    if op == "reuse":
        idx = jax.eval_shape(anchor, q, k, v)[0]
        return lambda q, k, v, i: kdax.kascade_reuse(q, k, v, i, **opts), [q, k, v, make(idx.shape, idx.dtype)]
    idx = jax.eval_shape(anchor_decode, qd, kc, vc, lengths)[0]
    fn = lambda q, k, v, n, i: kdax.kascade_reuse_decode(q, k, v, n, i, **opts)
    return fn, [qd, kc, vc, lengths, make(idx.shape, idx.dtype)]


def cases(make):
    """(name, fn, args) of every small-shape case."""
    out = []
    for c in kda_cases():
        fwd, args, grad = kda_call(c, make)
        out += [(c.name + " fwd", fwd, args), (c.name + " fwd+bwd", grad, args)]
    for name, dtype, T, pool in decode_cases():
        out.append((name, *decode_call(dtype, T, pool, make)))
    for name, op, dtype, D, pool_size in kascade_cases():
        out.append((name, *kascade_call(op, dtype, D, make, pool_size=pool_size)))
    for dtype in ("bfloat16", "float32"):
        for T, R, width in ((16, 16, 640), (200, 2, 256)):  # a decode step, prompt chunks
            out.append((f"paged_latent_attention {dtype} T={T} R={R} W={width}", *mla_call(dtype, T, R, width, make)))
        out.append((f"indexed_attention {dtype} T=40 S=300 W=43", *dsa_call(dtype, make)))
        out.append((f"index_select {dtype} T=40 S=300 pools of 4", *index_call(dtype, make)))
    return out


def index_call(dtype: str, make, B=2, T=40, S=300, Hi=8, d=128):
    """DSA's selection (pallas_tpu: the index scores' kernel, the selection in XLA): 40 keys in pools
    of 4 and the tail, T queries over S keys a row."""
    import jax.numpy as jnp

    import kdax

    dt = jnp.dtype(dtype)
    args = [make((B, T, Hi, d), dt), make((B, T, Hi), jnp.float32), make((B, S, d), dt), make((B, S, d), dt)]
    args += [make((4, d), dt), make((B,), jnp.int32)]
    fn = lambda q, w, k, g, a, n: kdax.index_select(q, w, k, g, a, topk=40, kpool=4, lengths=n, backend="pallas_tpu")
    return fn, args


def dsa_call(dtype: str, make, B=2, T=40, S=300, H=8, D=128, W=43):
    """DSA's attention (pallas_tpu) as GLM-5.3's absorbed layers run it: H query heads over one latent
    head (k = v), W keys a query (pools of 4 up to 40 keys, then a tail of 3), S keys a row."""
    import jax.numpy as jnp

    import kdax

    dt, i32 = jnp.dtype(dtype), jnp.int32
    k = make((B, S, 1, D), dt)
    args = [make((B, T, H, D), dt), k, make((B, T, W), i32), make((B,), i32)]
    return lambda q, k, i, n: kdax.indexed_attention(q, k, k, i, lengths=n, backend="pallas_tpu"), args


def mla_call(dtype: str, T: int, R: int, width: int, make, H=4, page=16, M=64):
    """The MLA layers' paged attention (pallas_tpu) on a step of T tokens of R requests, entries of
    ``width`` (queries 64 narrower), M pages of ``page`` tokens a request."""
    import jax.numpy as jnp

    from kdax.ops.mla.api import paged_latent_attention

    dt = jnp.dtype(dtype)
    i32 = jnp.int32
    args = [make((T, H, width - 64), dt), make((R * M + 1, page, width), dt), make((R, M), i32)]
    args += [make((R + 1,), i32), make((R,), i32)]
    return lambda *a: paged_latent_attention(*a, scale=0.1, backend="pallas_tpu"), args


# ----------------------------------------------------------------------------- peers


@dataclasses.dataclass(frozen=True)
class Peer:
    """One compile at a benchmark shape: ``op`` (a kdax op name, or "dense attention") on
    ``backend`` (a kdax backend, "tokamax" or "splash"), for the costs table when a kdax op."""

    op: str
    dtype: str
    shape: str
    passes: str  # "fwd" or "fwd+bwd"
    backend: str
    fn: object
    args: list
    kdax_ops: bool = True
    trips: dict | None = None  # Compiler.compile's
    shares: dict | None = None  # Compiler.compile's
    options: dict | None = None  # Compiler.compile's
    layout: str | None = None  # a decode op's cache layout, where the row is the costs table's entry

    @property
    def name(self) -> str:
        return f"peer {self.op} {self.dtype} {self.shape} {self.passes} {self.backend}"


def peer_calls(chip: str, make) -> list[Peer]:
    """The benchmark-shape compiles: kdax's pallas_tpu and xla backends of every op with TPU
    kernels, in both dtypes, beside tokamax's KDA and jax's splash attention."""
    import jax
    import jax.numpy as jnp

    import kdax

    out, f32 = [], jnp.float32
    bench = dataclasses.replace(BENCHMARK, H=32) if chip == "tpu7x" else BENCHMARK  # TPU7x: two cores' worth
    B, T, H, K = bench.B, bench.T, bench.H, bench.K
    for dtype in ("bfloat16", "float32"):
        dt = jnp.dtype(dtype)
        args = [make((B, T, H, K), dt)] * 3 + [make((B, T, H, K), f32), make((B, T, H), dt)]
        shape = bench.label()
        for backend in ("pallas_tpu", "xla"):
            fwd = lambda q, k, v, g, b, backend=backend: kdax.chunk_kda(q, k, v, g, b, backend=backend)[0]
            loss = lambda *xs, fwd=fwd: jnp.sum(fwd(*xs).astype(f32) ** 2)
            grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
            out += [Peer("chunk_kda", dtype, shape, "fwd", backend, fwd, args)]
            out += [Peer("chunk_kda", dtype, shape, "fwd+bwd", backend, grad, args)]
        if dtype == "bfloat16":
            out += _tokamax(shape, make, H, B, T, K)
        Bd, Hd = DECODE_STEP.B, DECODE_STEP.H  # a decode step of 64 rows, one token each
        dargs = [make((Bd, 1, Hd, K), dt)] * 3 + [make((Bd, 1, Hd, K), f32), make((Bd, 1, Hd), dt)]
        dargs.append(make((Bd, Hd, K, K), f32))
        for backend in ("pallas_tpu", "xla"):
            step = lambda q, k, v, g, b, h, backend=backend: kdax.fused_recurrent_kda(
                q, k, v, g, b, initial_state=h, output_final_state=True, backend=backend
            )
            out.append(Peer("fused_recurrent_kda", dtype, "B=64 T=1 H=32 K=V=128", "fwd", backend, step, dargs))
        out += _paged_mla(dtype, make)
        out += _dsa(dtype, make)
    return out


def _dsa(dtype: str, make) -> list[Peer]:
    """GLM-5.3-Flash's DSA on one device holding a layer's heads (an attention group of one device):
    the attention's 64 heads over one latent head of 512 and the indexer's 32 heads of 128, pools
    of 16, 2048 keys and the tail a query; a prefill of 4,096 tokens and a decode step of 64 rows at
    32K. The attention kernel's loop counted at its mean trips over its programs (blocks of four
    queries in the prefill; one in the decode) with no pool shared by two queries of a program: the
    most key blocks a program reads, :func:`dsa_trips`."""
    import jax.numpy as jnp
    import numpy as np

    import kdax

    dt, i32, f32, out = jnp.dtype(dtype), jnp.int32, jnp.float32, []
    H, r, Hi, d, P, topk = 64, 512, 32, 128, 16, 2048
    W = topk + P - 1
    for B, T, S in ((1, 4096, 4096), (64, 1, 32768)):
        trips = {"kascade_indexed_attend": dsa_trips(np.arange(S - T, S), topk // P, P, 4 if T > 1 else 1, 512 // P)}
        shape = f"B={B} T={T} S={S} H={H} r={r} W={W}"
        args = [make((B, T, H, r), dt), make((B, S, 1, r), dt), make((B, T, W), i32), make((B,), i32)]
        for backend in ("pallas_tpu", "xla"):
            f = lambda q, k, i, n, backend=backend: kdax.indexed_attention(q, k, k, i, lengths=n, backend=backend)
            t = trips if backend == "pallas_tpu" else None
            out.append(Peer("indexed_attention", dtype, shape, "fwd", backend, f, args, trips=t))
        shape = f"B={B} T={T} S={S} Hi={Hi} d={d} pools of {P} topk={topk}"
        args = [make((B, T, Hi, d), dt), make((B, T, Hi), f32), make((B, S, d), dt), make((B, S, d), dt)]
        args += [make((P, d), dt), make((B, T), i32), make((B,), i32)]
        for backend in ("pallas_tpu", "xla"):
            f = lambda q, w, k, g, a, p, n, backend=backend: kdax.index_select(
                q, w, k, g, a, topk=topk, kpool=P, q_positions=p, lengths=n, backend=backend
            )
            out.append(Peer("index_select", dtype, shape, "fwd", backend, f, args))
    return out


def dsa_trips(positions, pools: int, P: int, bq: int, C: int) -> float:
    """The mean trips of ``kascade_indexed_attend``'s loop (steps of C key blocks of P keys) over
    its programs of ``bq`` queries at ``positions``, each query listing ``pools`` whole pools and
    its tail, no two queries of a program sharing a pool (the most a program reads: every key
    block the last query sees, or the queries' own blocks summed)."""
    import numpy as np

    own = np.minimum((positions + 1) // P, pools) + ((positions + 1) % P > 0)  # each query's blocks
    n = -(-len(positions) // bq)
    last = positions[np.minimum(np.arange(n) * bq + bq - 1, len(positions) - 1)]
    summed = np.add.reduceat(own, np.arange(n) * bq)
    blocks = np.minimum(-(-(last + 1) // P), summed)
    return float(np.mean(-(-blocks // C)))


def _paged_mla(dtype: str, make) -> list[Peer]:
    """The MLA layers' paged attention at Kimi Linear's entries over 8 devices (4 heads, width 640,
    pages of 16): a decode step of 64 requests at 32K context, and a prefill chunk of 8,192 tokens
    ending at 32K. The kernel's key loop counted at its mean trips over the work items."""
    import jax.numpy as jnp

    from kdax.ops.mla.api import paged_latent_attention
    from kdax.ops.mla.items import query_block

    dt, i32, out = jnp.dtype(dtype), jnp.int32, []
    H, W, page, L, bk = 4, 640, 16, 32768, 512
    for T, R in ((64, 64), (8192, 1)):
        M, bq = L // page, query_block(T, R, H)
        items = -(-T // bq) + R
        ends = [min(T, (j + 1) * bq) + L - T for j in range(-(-T // bq))] if R == 1 else [L] * R
        trips = sum(-(-e // bk) for e in ends) / items
        args = [make((T, H, 576), dt), make((R * M + 1, page, W), dt), make((R, M), i32), make((R + 1,), i32)]
        args.append(make((R,), i32))
        shape = f"T={T} R={R} L={L} H={H} W={W} page={page}"
        for backend in ("pallas_tpu", "xla"):
            f = lambda *a, backend=backend: paged_latent_attention(*a, scale=0.1, backend=backend)
            t = {"mla_paged_attention": trips} if backend == "pallas_tpu" else None
            out.append(Peer("paged_latent_attention", dtype, shape, "fwd", backend, f, args, trips=t))
    return out


def kascade_trips(
    T: int, topk_percent: float = 10, min_k: int = 128, tile_size: int = 128, pool_size: int = 128, R: int = 4
) -> dict:
    """The mean trips of the prefill kernels' loops of data-dependent trips, over the programs of one
    row of T tokens at the ops' defaults (pallas_tpu.Config's blocks). Tokens: the dense pass
    ``kascade_attend`` reads the blocks before its tile, the scoring kernel the 512-key blocks
    before it, the sparse pass its selection (the budget of the tile's keys, in blocks). Pools:
    ``kascade_pool_attend`` issues a copy a selected pool, then passes over them in chunks twice;
    ``kascade_pool_scores`` folds the key blocks before its query block, then those under it, then
    turns each block's sums into masses and zeroes the rest."""
    import numpy as np

    from kdax.ops.kascade import pallas_tpu
    from kdax.ops.kascade.checks import budget, percent_tenths, pool_count

    cfg = pallas_tpu.Config()
    starts = np.arange(-(-T // tile_size)) * tile_size
    mean = lambda x: float(np.mean(x))
    ceil = lambda n, d: mean(-(-n // d))
    tenths = percent_tenths(topk_percent)
    if pool_size > 1:
        P, W = pool_size, max(cfg.pool_keys, 8 * pool_size)
        pools = pool_count(starts, tenths, min_k, P)
        chunks = ceil(pools, max(1, cfg.pool_keys // P))
        Rp = -(-R // max(1, 128 // tile_size)) * max(1, 128 // tile_size)
        nq = max(
            1, min(cfg.pool_rows // (tile_size * Rp), cfg.pool_scratch // (-(-T // W) * W // P * tile_size * Rp * 4))
        )
        nq = min(1 << (nq.bit_length() - 1), len(starts))
        q0 = np.arange(0, T, nq * tile_size)
        before, total = q0 // W, -(-(q0 + nq * tile_size) // W)
        blocks = -(-T // max(W, nq * tile_size)) * max(W, nq * tile_size) // W
        return {
            "kascade_pool_attend": (mean(pools), chunks, chunks),
            "kascade_pool_scores": (mean(before), mean(total - before), mean(total), mean(blocks - total)),
        }
    budgets = budget(starts, tenths, min_k)
    return {
        "kascade_attend": ceil(starts, cfg.block_dense),
        "kascade_scores": ceil(starts, cfg.block_scores),
        "kascade_attend_sparse": ceil(budgets, cfg.block_k or pallas_tpu.sparse_block(int(budgets.max()))),
    }


def kascade_decode_trips(L: int, topk_percent: float = 10, min_k: int = 128, pool_size: int = 128) -> dict:
    """The trips of the decode kernels' loops of data-dependent trips for full rows of L keys at the
    ops' defaults, B * G >= 8 (one split). Tokens: the scores kernel reads every block of the cache,
    the attend kernel the blocks of the selection. Pools: the scores kernel reads every block; the
    attend kernel issues a copy a selected pool, then folds their whole steps of ``pool_keys``
    (the partial step runs apart); the one-kernel anchor does both. The anchor's loop over the
    blocks and the loop over whole steps are pipelined (step i + 1's scores beside step i's
    softmax), one trip short: the first step's scores come before the loop."""
    from kdax.ops.kascade import pallas_tpu
    from kdax.ops.kascade.checks import budget, percent_tenths, pool_count

    cfg = pallas_tpu.Config()
    tenths = percent_tenths(topk_percent)
    if pool_size >= 128:
        blocks = -(-L // pallas_tpu.decode_block(pool_size, cfg))
        n = int(pool_count(L, tenths, min_k, pool_size))
        S = max(1, cfg.pool_keys // pool_size)
        attend = (n, n // S - 1, n % S)  # copies, whole steps (the first's scores before the loop), the rest
        return {
            "kascade_pool_decode_scores": (blocks,),
            "kascade_pool_decode_attend": attend,
            "kascade_pool_decode_anchor": (blocks - 1, *attend),  # its first block runs before the loop
        }
    k = int(budget(L, tenths, min_k))
    return {"kascade_decode_scores": -(-L // cfg.block_decode), "kascade_decode_attend": -(-k // (cfg.block_k or 128))}


def _tokamax(shape, make, H, B, T, K) -> list[Peer]:
    """tokamax's Pallas Mosaic KDA on kdax's bf16 inputs, in its [H, B, T, D] layout (its kernels
    check for a TPU unless cross-compiling)."""
    try:
        import tokamax
        from tokamax._src import config as tokamax_config
    except ImportError:
        return []
    import jax
    import jax.numpy as jnp

    bf, f32 = jnp.bfloat16, jnp.float32
    args = [make((H, B, T, K), bf)] * 3 + [make((H, B, T, K), f32), make((H, B, T), bf)]

    def fwd(q, k, v, g, b):
        with tokamax_config.cross_compile(True):
            return tokamax.ops.kimi_delta_attention(q, k, v, g, b, implementation="mosaic")[0]

    loss = lambda *xs: jnp.sum(fwd(*xs).astype(f32) ** 2)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    return [
        Peer("chunk_kda", "bfloat16", shape, p, "tokamax", f, args, False) for p, f in (("fwd", fwd), ("fwd+bwd", grad))
    ]


# ----------------------------------------------------------------------------- Kascade against dense attention

KASCADE_T = (16384, 65536, 131072)  # prefill: B = 1, H = 32, G = 8, D = 128, 10% of the keys
KASCADE_L = (32768, 131072)  # decode: B = 16 rows over a full cache of L keys
KASCADE_VARIANTS = ((32, 1), (32, 128))  # beside the defaults: (tile size, pool size)
# splash attention's blocks tried for the dense yardstick: (queries = keys a grid step, keys a compute step)
SPLASH_BLOCKS = ((512, 512), (1024, 512), (1024, 1024), (2048, 512), (2048, 1024))
# jax's paged attention for dense decode: (tokens a page, pages a compute block)
PAGED_BLOCKS = ((128, 8), (256, 4), (512, 2), (512, 4))
SPLASH_KERNEL, PAGED_KERNEL = "splash_mha_fwd_no_residuals", "paged_attention"


def prefill_shape(T: int) -> str:
    return f"B=1 T={T} H=32 G=8 D=128"


def decode_shape(L: int) -> str:
    return f"B=16 L={L} H=32 G=8 D=128"


def kascade_calls(chip: str, make) -> list[Peer]:
    """Kascade's four ops at the benchmark shapes (:data:`KASCADE_T`, :data:`KASCADE_L`; both
    dtypes and the xla backend at the first of each) beside dense attention as users run it: jax's
    splash attention at each of :data:`SPLASH_BLOCKS` with a full mask, counted at the causal
    share of its grid steps (:func:`causal_share`), and jax's paged attention at each of
    :data:`PAGED_BLOCKS` and XLA's ``jax.nn.dot_product_attention`` for one token over the cache."""
    import jax
    import jax.numpy as jnp

    import kdax
    from kdax.ops.kascade import pallas_tpu
    from kdax.ops.kascade.checks import POOL_SIZE, TILE_SIZE

    H, G, D, out = 32, 8, 128, []
    for T in KASCADE_T:
        for dtype in ("bfloat16", "float32") if T == KASCADE_T[0] else ("bfloat16",):
            dt = jnp.dtype(dtype)
            q, k, v = make((1, T, H, D), dt), make((1, T, G, D), dt), make((1, T, G, D), dt)
            shape = prefill_shape(T)
            backends = ("pallas_tpu", "xla") if T == KASCADE_T[0] else ("pallas_tpu",)
            defaults = [(b, (TILE_SIZE, POOL_SIZE)) for b in backends]  # the ops' defaults, as "auto" runs them
            for backend, (tile, P) in defaults + [("pallas_tpu", tp) for tp in KASCADE_VARIANTS]:
                opts = {"backend": backend, "tile_size": tile, "pool_size": P}
                variant = backend + ("" if (tile, P) == (TILE_SIZE, POOL_SIZE) else f" tile {tile} pool {P}")
                trips = kascade_trips(T, tile_size=tile, pool_size=P)
                anchor = lambda q, k, v, opts=opts: kdax.kascade_anchor(q, k, v, topk_percent=10, **opts)
                idx = jax.eval_shape(anchor, q, k, v)[0]
                reuse = lambda q, k, v, i, opts=opts: kdax.kascade_reuse(q, k, v, i, **opts)
                out.append(Peer("kascade_anchor", dtype, shape, "fwd", variant, anchor, [q, k, v], trips=trips))
                idx_arg = make(idx.shape, idx.dtype)
                out.append(Peer("kascade_reuse", dtype, shape, "fwd", variant, reuse, [q, k, v, idx_arg], trips=trips))
            for bq, bkc in SPLASH_BLOCKS:
                share = {SPLASH_KERNEL: causal_share(T, bq, bq)}
                options = {"xla_tpu_scoped_vmem_limit_kib": 64 << 10} if bq > 1024 else None
                f = _splash(T, H, D, bq, bkc)
                backend = f"splash {bq}x{bkc}"
                out.append(
                    Peer(
                        "dense causal attention",
                        dtype,
                        shape,
                        "fwd",
                        backend,
                        f,
                        [q, k, v],
                        False,
                        None,
                        share,
                        options,
                    )
                )
    for L in KASCADE_L:
        for dtype in ("bfloat16", "float32") if L == KASCADE_L[0] else ("bfloat16",):
            dt = jnp.dtype(dtype)
            B, shape = 16, decode_shape(L)
            qd, kc, vc, n = make((B, H, D), dt), make((B, L, G, D), dt), make((B, L, G, D), dt), make((B,), jnp.int32)
            heads_first = [make((B, G, L, D), dt), make((B, G, L, D), dt)]
            backends = ("pallas_tpu", "xla") if L == KASCADE_L[0] else ("pallas_tpu",)
            defaults = [(b, layout, POOL_SIZE) for layout in ("BLGD", "BGLD") for b in backends]
            for backend, layout, P in defaults + [("pallas_tpu", "BLGD", 1)]:
                opts = {"backend": backend, "pool_size": P, "cache_layout": layout}
                variant = backend + ("" if (layout, P) == ("BLGD", POOL_SIZE) else f" {layout} pool {P}")
                caches = heads_first if layout == "BGLD" else [kc, vc]
                pooled = pallas_tpu._decode_pools(P, L, dt, G, layout)  # else the token kernels
                trips = kascade_decode_trips(L, pool_size=P if pooled else 1)
                ad = lambda q, k, v, n, opts=opts: kdax.kascade_anchor_decode(q, k, v, n, topk_percent=10, **opts)
                didx = jax.eval_shape(ad, qd, *caches, n)[0]
                rd = lambda q, k, v, n, i, opts=opts: kdax.kascade_reuse_decode(q, k, v, n, i, **opts)
                args = [qd, *caches, n]
                entry = layout if P == POOL_SIZE else None  # the costs table's entries: the default pools
                out.append(
                    Peer("kascade_anchor_decode", dtype, shape, "fwd", variant, ad, args, trips=trips, layout=entry)
                )
                args = [qd, *caches, n, make(didx.shape, didx.dtype)]
                out.append(
                    Peer("kascade_reuse_decode", dtype, shape, "fwd", variant, rd, args, trips=trips, layout=entry)
                )
            for page, pages in PAGED_BLOCKS:
                f, args = _paged(make, dt, B, L, H, G, D, page, pages)
                out.append(Peer("dense decode", dtype, shape, "fwd", f"paged {page}x{pages}", f, args, False))
            xla_decode = lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="xla"
            )[:, 0]
            out.append(Peer("dense decode", dtype, shape, "fwd", "xla", xla_decode, [qd, kc, vc, n], False))
    return out


def causal_share(T: int, block_q: int, block_kv: int) -> float:
    """The share of a [T, T] attention's (block_q x block_kv) grid steps that a causal mask keeps:
    the blocks with a key at or before a query of the block (splash skips the others' bodies and
    copies, which a static count of its full-mask program cannot see)."""
    nq, nk = -(-T // block_q), -(-T // block_kv)
    kept = sum(min(nk, -(-min(T, (i + 1) * block_q) // block_kv)) for i in range(nq))
    return kept / (nq * nk)


def _splash(T, H, D, block_q: int, block_kv_compute: int):
    """jax's splash attention over [1, T, H, D] queries and [1, T, G, D] keys and values (KV heads
    expanded to the query heads), ``block_q`` queries and keys a grid step, with a full mask: counted
    at :func:`causal_share` it is the causal attention's work (a causal mask's program counts the
    bodies of the skipped steps as run)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    sizes = sk.BlockSizes(block_q=block_q, block_kv=block_q, block_kv_compute=block_kv_compute)
    mask = sm.MultiHeadMask([sm.FullMask((T, T))] * H)
    kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)

    def f(q, k, v):
        rep = H // k.shape[2]
        heads = lambda x: jnp.swapaxes(x[0], 0, 1)  # [heads, T, D]
        kh, vh = (jnp.repeat(heads(x), rep, axis=0) for x in (k, v))
        return kernel(heads(q) * D**-0.5, kh, vh)

    return f


def _paged(make, dtype, B, L, H, G, D, page: int, pages: int):
    """jax's paged attention of one token per row over full caches of L keys in pages of ``page``
    tokens (its layout, [G, pages, page, D], row b's pages consecutive), ``pages`` a compute block,
    the sequence in its grid (static steps): (fn, args)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    n = L // page
    args = [make((B, H, D), dtype), make((G, B * n, page, D), dtype), make((G, B * n, page, D), dtype)]
    args += [make((B,), "int32"), make((B, n), "int32")]

    def f(q, k, v, lengths, table):
        return paged_attention(q, k, v, lengths, table, pages_per_compute_block=pages, inline_seq_dim=False)

    return f, args


@dataclasses.dataclass(frozen=True)
class Rates:
    """A chip's figures for the roofline, per device (one TensorCore): HBM bytes a second and bf16
    FLOPs a second (jax's ``pltpu.get_tpu_info_for_chip``), and the seconds of a static cycle: a
    bf16 [8192]^3 matmul's static cycles taken at the chip's bf16 peak (:func:`chip_rates`)."""

    hbm: float
    flops: float
    cycle: float

    def seconds(self, cycles: int, nbytes: int) -> tuple[float, str]:
        """The roofline: max(static cycles x cycle, bytes / HBM bandwidth), and which bounds it."""
        compute, memory = cycles * self.cycle, nbytes / self.hbm
        return max(compute, memory), ("cycles" if compute >= memory else "bytes")


CHIP_VERSIONS = {"v5e": "TPU_V5E", "v6e": "TPU_V6E", "tpu7x": "TPU_7X"}


def chip_rates(chip: str, compiler: Compiler, make, mesh) -> Rates:
    """:class:`Rates` of ``chip``, its static cycle calibrated on a compiled bf16 matmul."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, CHIP_VERSIONS[chip]), 1)
    n = 8192
    x = make((n, n), jnp.bfloat16)
    row = compiler.compile("matmul", chip, lambda a, b: a @ b, [x, x], mesh, kdax_ops=False)
    return Rates(
        info.mem_bw_bytes_per_second, info.bf16_ops_per_second, 2 * n**3 / info.bf16_ops_per_second / row.cycles
    )


def kascade_summary(rows: list[Row], peers: dict[str, Peer], rates: dict[str, Rates]) -> str:
    """Kascade's ops against dense attention, per chip, dtype and shape: static cycles, HBM bytes and
    roofline time of each, the dense yardstick the best of its variants by roofline time; prefill
    compared in static cycles (one anchor and three reuse layers against four dense layers too),
    decode in HBM bytes."""
    best, mine = {}, []
    for r in rows:
        p = peers.get(r.case)
        if p is None or not r.ok or not p.op.startswith(("kascade", "dense")):
            continue
        t, bound = rates[r.chip].seconds(r.cycles, r.hbm_bytes)
        key = (r.chip, p.dtype, p.shape)
        if p.op.startswith("dense"):
            if key not in best or t < best[key][1]:
                best[key] = (r, t, bound, p.backend)
        elif p.backend.startswith("pallas_tpu"):
            mine.append((key, p.op + p.backend.removeprefix("pallas_tpu"), r, t, bound))
    out = [
        "| chip | dtype | shape | op | static cycles | HBM bytes | roofline | vs dense: cycles | vs dense: bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ge = lambda unknown: " (≥)" if unknown else ""  # a lower bound: loops, or DMA waits, of unknown size
    gb = lambda r: f"{r.hbm_bytes / 1e9:,.3f} GB{ge(r.unknown_dmas)}"
    us = lambda t, b: f"{t * 1e6:,.0f} us ({b})"
    for key in sorted(best):
        d, td, bd, name = best[key]
        out.append(
            f"| {' | '.join(key)} | dense ({name}) | {_m(d.cycles)}{ge(d.unknown_loops)} | {gb(d)} | {us(td, bd)} | 1 | 1 |"
        )
        ops = {}
        for k2, op, r, t, bound in mine:
            if k2 == key:
                ops[op] = r
                ratio_c, ratio_b = r.cycles / d.cycles, r.hbm_bytes / max(d.hbm_bytes, 1)
                out.append(
                    f"| {' | '.join(key)} | {op} | {_m(r.cycles)}{ge(r.unknown_loops)} | {gb(r)} | {us(t, bound)} "
                    f"| {ratio_c:.2f} | {ratio_b:.2f} |"
                )
        for name, anchor in ops.items():
            reuse = ops.get(name.replace("kascade_anchor", "kascade_reuse"))
            if name.startswith("kascade_anchor") and "decode" not in name and reuse is not None:
                group = (anchor.cycles + 3 * reuse.cycles) / (4 * d.cycles)
                label = "anchor + 3 reuse" + name.removeprefix("kascade_anchor")
                out.append(f"| {' | '.join(key)} | {label}, vs 4 dense | | | | {group:.2f} | |")
    return "\n".join(out)


def costs_table(rows: list[Row], peers: dict[str, Peer]) -> list[dict]:
    """The entries of kdax/ops/common/tpu_costs.json from the peer rows: per chip, kdax op, dtype,
    shape and passes, the pallas_tpu and xla compiles' outcome and static cycles (one of the two
    where ``--only`` compiled one: :func:`record` merges it into the table's entry)."""
    entries = {}
    for r in rows:
        p = peers.get(r.case)
        if p is None:
            continue
        backend = p.backend.split()[0] if p.layout else p.backend  # "pallas_tpu BGLD pool 128": its layout's entry
        if backend not in ("pallas_tpu", "xla"):
            continue
        e = entries.setdefault((r.chip, p.op, p.dtype, p.shape, p.passes, p.layout), {})
        e[backend] = {"compiles": r.ok, "cycles": r.cycles, "lower_bound": bool(r.unknown_loops)}
    return [
        dict(chip=chip, op=op, dtype=dtype, shape=shape, passes=passes, **({"layout": layout} if layout else {}), **e)
        for (chip, op, dtype, shape, passes, layout), e in entries.items()
    ]


# ----------------------------------------------------------------------------- output


def _m(n: int) -> str:
    return f"{n / 1e6:,.2f} M" if n < 1e9 else f"{n / 1e9:,.2f} G"


def format_rows(rows: list[Row]) -> str:
    out = [
        "| case | chip | compiles | kernels: VMEM KiB, static cycles | program static cycles | HBM bytes | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.ok:
            ks = "; ".join(
                f"{n} {v / 1024:,.0f}, {_m(c)}" + (" (lower bound)" if u else "") for n, v, c, u in r.kernels
            )
            lb = " (lower bound)" if r.unknown_loops else ""
            lb += f" (modelled: {', '.join(r.modelled)})" if r.modelled else ""
            nbytes = f"{r.hbm_bytes / 1e6:,.1f} MB" + (" (lower bound)" if r.unknown_dmas else "")
            cycles = f"{_m(r.cycles)}{lb}"
            if not r.cycles:  # compiled without listings
                cycles, nbytes = "-", "-"
            out.append(f"| {r.case} | {r.chip} | yes | {ks or '-'} | {cycles} | {nbytes} | {r.seconds:.1f} |")
        else:
            out.append(f"| {r.case} | {r.chip} | **no**: {r.error.replace('|', '/')} | | | | {r.seconds:.1f} |")
    return "\n".join(out)


def record(path: str, entries: list[dict], argv: list[str]) -> None:
    """Write the costs table to ``path``, keeping what these entries do not replace: an existing
    entry (same chip, op, dtype, shape and passes) takes the backends an entry brings, so that a run
    with ``--only`` updates it; the table keeps the entries that have both backends. A run with
    ``--only`` adds its command to the recorded ones."""
    import jax

    key = lambda e: (e["chip"], e["op"], e["dtype"], e["shape"], e["passes"], e.get("layout", ""))
    old, table = {}, {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
        old = {key(e): e for e in table["entries"]}
    for e in entries:
        old[key(e)] = {**old.get(key(e), {}), **e}
    meta = {"jax": jax.__version__, "libtpu": _version("libtpu"), "date": time.strftime("%Y-%m-%d")}
    meta["command"] = "python scripts/tpu_compile_report.py " + shlex.join(argv)
    if "--only" in argv and table.get("command"):
        meta["command"] = f"{table['command']}; then {meta['command']}"
    merged = sorted((e for e in old.values() if "pallas_tpu" in e and "xla" in e), key=key)
    with open(path, "w") as f:
        json.dump({**meta, "entries": merged}, f, indent=1)
        f.write("\n")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def main(argv=None) -> int:
    a = _args(argv)
    dump = None if a.no_listings else tempfile.mkdtemp(prefix="kdax-tpu-llo-")
    if dump:  # the two listings read_dump reads, not every pass's (which would triple the compile time)
        flags = f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=(final_bundles|original)"
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + flags).strip()
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # beside another libtpu process
    import jax

    print(f"jax {jax.__version__}, libtpu {_version('libtpu')}, chips {', '.join(a.chips)}\n", flush=True)
    print("\n".join(format_rows([]).splitlines()[:2]), flush=True)
    compiler, rows, peers, rates = Compiler(dump), [], {}, {}
    only = re.compile(a.only)
    try:
        for chip in a.chips:
            make, mesh = topology_args(chip)
            todo = [] if a.no_cases else [(n, f, x, True, None, None, None) for n, f, x in cases(make)]
            if a.peers:
                chip_peers = peer_calls(chip, make) + kascade_calls(chip, make)
                peers.update({p.name: p for p in chip_peers})
                todo += [(p.name, p.fn, p.args, p.kdax_ops, p.trips, p.shares, p.options) for p in chip_peers]
                if any(only.search(p.name) and p.op.startswith(("kascade", "dense")) for p in chip_peers):
                    rates[chip] = chip_rates(chip, compiler, make, mesh)
            for name, fn, args, kdax_ops, trips, shares, options in todo:
                if only.search(name):
                    row = compiler.compile(
                        name, chip, fn, args, mesh, kdax_ops=kdax_ops, trips=trips, shares=shares, options=options
                    )
                    rows.append(row)
                    print(format_rows([row]).splitlines()[-1], flush=True)
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} compiled" + (f"; failed: {len(failed)}" if failed else ""))
    if rates:
        for chip, r in rates.items():
            print(
                f"{chip}: {r.hbm / 1e12:.2f} TB/s HBM, {r.flops / 1e12:,.0f} TFLOP/s bf16, {r.cycle * 1e9:.3f} ns a static cycle"
            )
        print("\n" + kascade_summary(rows, peers, rates))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    if a.record:
        record(a.record, costs_table(rows, peers), argv if argv is not None else sys.argv[1:])
    return 1 if a.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
