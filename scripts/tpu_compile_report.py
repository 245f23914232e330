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
allocation, each weighted by the trip counts of the loops around it (:func:`static_cycles`). The
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

CHIPS = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:1x1x1"}
KERNEL_PREFIXES = ("kda_", "kascade_")  # every pallas_call kdax names for TPU
# splash attention's cheapest blocks at the Kascade peer shape (v5e, bf16: 128 (its default) 301.7 M
# static cycles, 512 59.4 M, 512 queries x 1024 keys 47.0 M, 1024 46.3 M)
SPLASH_BLOCK = 1024


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chips", default="v5e,v6e,tpu7x", help="comma-separated, of " + ", ".join(CHIPS))
    p.add_argument("--only", default="", help="run the cases whose name matches this regex")
    p.add_argument("--check", action="store_true", help="exit 1 when a case fails to compile")
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
    try:
        re.compile(a.only)
    except re.error as e:
        p.error(f"--only: expected a regular expression ({e})")
    return a


# ----------------------------------------------------------------------------- LLO dump


_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:(?:LH|LB|LE|PB|PF|CT):\s*)?[:>]")
_REGION = re.compile(r"Start region (\d+)")
_BRANCH = re.compile(r"sbr\.rel \(([^)]*)\) target (?:bundleno = (\d+)|= \$region(\d+))")
# a branch's predicate defined by a compare of a counter with a constant: %p = scmp.ge %s, N
_COMPARE = re.compile(r"(%p\w+) = scmp\.(ge|lt|ne)\.s32\.totalorder (%s\w+), (\d+)")
_TRUE = re.compile(r"(%p\w+) = pmov 1 ")  # a constant predicate: a back branch on !%p is never taken
_EXIT = re.compile(r"scmp\.\w+\.s32\.totalorder (%s\w+), (\d+) /\* loop exit test \*/")
_STEP = re.compile(r"(%s\w+) = sadd\.s32 (\d+), %s\w+")  # an induction variable's increment
_LATCH = re.compile(r"scmp\.(?:lt|ne)\.s32\.totalorder %s\w+, (\d+)(?! /\*)")  # XLA's while loops: i + 1 < N
_VMEM = re.compile(r"#allocation\d+ \[shape = '[^']*', space=vmem, size = (0x[0-9a-f]+)")


_CALL = re.compile(r"\b(?:inlined_)?call\b[^;{}]*?/\* (?:%([\w.\-]+) = |(<[\w-]+>))")


@dataclasses.dataclass
class Listing:
    """One program's bundles, counted: its own static cycles, loops of unknown trips, and the
    programs it calls with the weight (the trips of the loops around each call site)."""

    cycles: int
    unknown_loops: int
    calls: list  # [(callee name, weight, under a loop of unknown trips)]
    unknown_bodies: list  # per loop of unknown trips, the cycles of one trip (its bundles, weighted)


def static_cycles(text: str) -> Listing:
    """Count one program's bundle listing.

    A bundle is a line that starts with its address. A branch back to an earlier bundle (by
    number, or to a region whose start an earlier bundle marks) closes a loop; the loop's trip
    count is the constant of the loop-exit test inside it and outside its inner loops (Mosaic
    marks it), else of the compare with a constant in its last 8 bundles (XLA's while loops:
    ``i + 1 < N``); an unrolled loop's induction variable steps by more than one, which divides
    the trips. Each bundle counts the product of the trips of the loops around it; a loop
    with neither (a data-dependent bound) counts once, which makes the total a lower bound. A
    ``call`` bundle names the program it runs (XLA's top-level program calls each fusion and
    kernel), which :func:`read_dump` adds at the call site's weight.
    """
    bundles, regions, branches, exits, latches, calls, steps, compares = [], {}, [], [], [], [], {}, {}
    for line in text.splitlines():
        m = _BUNDLE.match(line)
        if not m:
            continue
        addr = int(m.group(1), 0)
        bundles.append(addr)
        for r in _REGION.findall(line):
            regions.setdefault(int(r), addr)
        for pred, by_number, region in _BRANCH.findall(line):
            branches.append((addr, int(by_number) if by_number else ("region", int(region)), pred))
        compares.update((p, (op, reg, int(n))) for p, op, reg, n in _COMPARE.findall(line))
        compares.update((p, ("true", None, 1)) for p in _TRUE.findall(line))
        exits += [(addr, reg, int(n)) for reg, n in _EXIT.findall(line)]
        steps.update((reg, int(n)) for reg, n in _STEP.findall(line))
        latches += [(addr, int(n)) for n in _LATCH.findall(line)]
        calls += [(addr, a or b) for a, b in _CALL.findall(line)]
    trips_of = lambda reg, n: -(-n // max(1, steps.get(reg, 1)))
    loops, conditions = [], {}
    for addr, target, pred in branches:
        start = regions.get(target[1]) if isinstance(target, tuple) else target
        if start is not None and start <= addr:
            loops.append([start, addr, None])
            conditions[(start, addr)] = pred
    loops.sort(key=lambda lp: lp[1] - lp[0])  # innermost first
    for addr, reg, n in exits:
        for lp in loops:
            if lp[0] <= addr <= lp[1]:
                lp[2] = lp[2] or trips_of(reg, n)
                break
    for lp in loops:
        # back while !(i >= N), i < N or i != N: N trips (Mosaic's copy loops carry no exit marker)
        pred = conditions[(lp[0], lp[1])]
        op, reg, n = compares.get(pred.lstrip("!"), (None, None, 0))
        if lp[2] is None and (op, pred.startswith("!")) in (("ge", True), ("lt", False), ("ne", False), ("true", True)):
            lp[2] = trips_of(reg, n)
        if lp[2] is None:
            lp[2] = next((n for addr, n in reversed(latches) if lp[1] - 8 <= addr <= lp[1]), None)

    def weight(addr):  # (product of the trips around addr, whether one of them is unknown)
        w, unknown = 1, False
        for start, end, trips in loops:
            if start <= addr <= end:
                w *= trips or 1
                unknown |= trips is None
        return w, unknown

    total = sum(weight(addr)[0] for addr in bundles)
    called = [(name, *weight(addr)) for addr, name in calls]
    bodies = [sum(weight(a)[0] for a in bundles if s <= a <= e) for s, e, trips in loops if trips is None]
    return Listing(total, len(bodies), called, bodies)


@dataclasses.dataclass
class Program:
    name: str
    cycles: int  # its own bundles, weighted by its loops, times the calls that run it
    unknown_loops: int
    unknown_bodies: list  # Listing.unknown_bodies times the calls that run it
    vmem: int  # bytes of VMEM allocations (Mosaic kernels)


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
_HLO_NAME = re.compile(r"%([\w.\-]+)")


def hlo_signatures(text: str) -> dict:
    """{instruction: key} for the top-level computation of an HLO module's text, equal keys for
    instructions that compile to the same program: the opcode, the result's and operands' shapes
    and layouts, and the computations it calls with their names numbered by first use."""
    computations, body, shapes, entry = {}, None, {}, None
    for line in text.splitlines():
        if m := _HLO_COMPUTATION.match(line):
            body = computations[m.group(1)] = []
            entry = m.group(1) if line.startswith("ENTRY") else entry
        elif line.strip() == "}":
            body = None
        elif body is not None and (m := _HLO_INSTRUCTION.match(line.split(", metadata=")[0])):
            body.append(m.groups())
            shapes[m.group(1)] = m.group(2)

    def normal(name, seen=()):  # a computation's text, its names numbered, the computations it calls inlined
        numbers = {}

        def rename(m):
            callee = m.group(1)
            if callee in computations and callee not in seen and callee != name:
                return "{" + normal(callee, (*seen, name)) + "}"
            return "%" + str(numbers.setdefault(callee, len(numbers)))

        return ";".join(_HLO_NAME.sub(rename, " ".join((f"%{n}", *rest))) for n, *rest in computations[name])

    keys = {}
    for name, shape, op, operands, attrs in computations.get(entry, []):
        callees = [normal(c) for c in _HLO_NAME.findall(attrs) if c in computations]
        keys[name] = (shape, op, tuple(shapes.get(o) for o in _HLO_NAME.findall(operands)), tuple(callees))
    return keys


def read_dump(files: list[str]) -> list[Program]:
    """The programs of one compile's LLO dump files: per program its post-RA bundle listing
    (``*final_bundles.txt``) counted by :func:`static_cycles`, times the weight of the call sites
    that run it from the top-level program ("TLP"; once if none does), and its VMEM allocations
    (``*-original.txt``). XLA dumps one listing for instructions that compile to the same program
    (say the transposes of three gradients of one shape); a call of one without a listing runs
    the listing of its equal in the top-level HLO (``*-TLP-hlo.txt``, :func:`hlo_signatures`)."""
    final, original, keys = {}, {}, {}
    for path in files:
        if path.endswith("-TLP-hlo.txt"):
            with open(path, errors="replace") as f:
                keys = hlo_signatures(f.read())
        m = re.match(r"^\d+-(.+)-(\d+)-(final_bundles|original)\.txt$", os.path.basename(path))
        if m:
            (final if m.group(3) == "final_bundles" else original)[m.group(1)] = path
    listings = {}
    for name, path in final.items():
        with open(path, errors="replace") as f:
            listings[name] = static_cycles(f.read())
    same = {}  # signature -> the instruction whose listing was dumped
    for name in listings:
        if name in keys:
            same.setdefault(keys[name], name)
    runs = {}  # name -> (times run, whether under a loop of unknown trips)
    missing = []  # calls of programs with no listing and no equal: the total becomes a lower bound

    def visit(name, times, unknown):
        if name not in listings and name in keys:
            name = same.get(keys[name], name)
        if name not in listings:
            missing.append(name)
            return
        was = runs.get(name, (0, False))
        runs[name] = (was[0] + times, was[1] or unknown)
        for callee, w, u in listings[name].calls:
            visit(callee, times * w, unknown or u)

    visit("TLP", 1, False)
    out = []
    for name, listing in sorted(listings.items()):
        times, unknown = runs.get(name, (1, False))
        vmem = 0
        if name in original:
            with open(original[name], errors="replace") as f:
                vmem = sum(int(s, 16) for s in _VMEM.findall(f.read()))
        bodies = [b * times for b in listing.unknown_bodies]
        calls_missing = len(missing) if name == "TLP" else 0
        out.append(Program(name, listing.cycles * times, listing.unknown_loops + unknown + calls_missing, bodies, vmem))
    return out


def is_kernel(name: str) -> bool:
    return name.startswith(KERNEL_PREFIXES)


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


class Compiler:
    """Compiles for one chip at a time, each compile's LLO dump read and then removed."""

    def __init__(self, dump: str):
        self.dump = dump

    def compile(self, case: str, chip: str, fn, args, mesh, *, kdax_ops=True, trips=None) -> Row:
        """Compile ``fn(*args)`` (kdax's ops built as on a TPU) within the chip's abstract mesh, which
        tells the kernels that ask which TPU they target. ``trips`` {kernel name: mean trips}: the
        kernel's one loop of data-dependent trips counted that many times (the mean the shape
        implies, :func:`kascade_trips`) instead of once; the row lists it under ``modelled``."""
        import jax

        from kdax.ops.common.dispatch import building_for

        before = set(os.listdir(self.dump))
        t0 = time.perf_counter()
        try:
            with building_for("tpu" if kdax_ops else None), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                jax.jit(fn).trace(*args).lower().compile()
            row = Row(case, chip, True)
        except Exception as e:  # the compiler's message is the result
            row = Row(case, chip, False, error=_first_error(str(e)))
        row.seconds = time.perf_counter() - t0
        new = [os.path.join(self.dump, f) for f in sorted(set(os.listdir(self.dump)) - before)]
        if row.ok:
            programs = read_dump(new)
            for p in programs:
                n = (trips or {}).get(p.name.rsplit(".", 1)[0])
                if n is not None and len(p.unknown_bodies) == 1:
                    p.cycles += round((n - 1) * p.unknown_bodies[0])
                    p.unknown_loops -= 1
                    row.modelled.append(f"{p.name} {n:.1f}")
            row.kernels = [(p.name, p.vmem, p.cycles, p.unknown_loops) for p in programs if is_kernel(p.name)]
            row.cycles = sum(p.cycles for p in programs)
            row.unknown_loops = sum(p.unknown_loops for p in programs)
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
    return [
        (f"kascade {op} {dtype} D={D}", op, dtype, D)
        for op in ("anchor", "reuse", "anchor_decode", "reuse_decode")
        for dtype in ("bfloat16", "float32")
        for D in (64, 128)
    ]


def kascade_call(op: str, dtype: str, D: int, make, B=1, T=600, H=4, G=2, L=1000):
    """T and L not multiples of the blocks, budgets not multiples of 8 or 128."""
    import jax
    import jax.numpy as jnp

    import kdax

    dt = jnp.dtype(dtype)
    q, k, v = make((B, T, H, D), dt), make((B, T, G, D), dt), make((B, T, G, D), dt)
    qd, kc, vc, lengths = make((B, H, D), dt), make((B, L, G, D), dt), make((B, L, G, D), dt), make((B,), jnp.int32)
    opts = {"backend": "pallas_tpu"}
    anchor = lambda q, k, v: kdax.kascade_anchor(q, k, v, topk_percent=12.5, min_k=40, **opts)
    anchor_decode = lambda q, k, v, n: kdax.kascade_anchor_decode(q, k, v, n, topk_percent=10.3, min_k=50, **opts)
    if op == "anchor":
        return anchor, [q, k, v]
    if op == "anchor_decode":
        return anchor_decode, [qd, kc, vc, lengths]
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
    for name, op, dtype, D in kascade_cases():
        out.append((name, *kascade_call(op, dtype, D, make)))
    return out


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
    H = 32 if chip == "tpu7x" else 16
    B, T, K = 1, 8192, 128
    for dtype in ("bfloat16", "float32"):
        dt = jnp.dtype(dtype)
        args = [make((B, T, H, K), dt)] * 3 + [make((B, T, H, K), f32), make((B, T, H), dt)]
        shape = f"B=1 T={T} H={H} K=V=128"
        for backend in ("pallas_tpu", "xla"):
            fwd = lambda q, k, v, g, b, backend=backend: kdax.chunk_kda(q, k, v, g, b, backend=backend)[0]
            loss = lambda *xs, fwd=fwd: jnp.sum(fwd(*xs).astype(f32) ** 2)
            grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
            out += [Peer("chunk_kda", dtype, shape, "fwd", backend, fwd, args)]
            out += [Peer("chunk_kda", dtype, shape, "fwd+bwd", backend, grad, args)]
        if dtype == "bfloat16":
            out += _tokamax(shape, make, H, B, T, K)
        Bd, Hd = 64, 32  # a decode step of 64 rows, one token each
        dargs = [make((Bd, 1, Hd, K), dt)] * 3 + [make((Bd, 1, Hd, K), f32), make((Bd, 1, Hd), dt)]
        dargs.append(make((Bd, Hd, K, K), f32))
        for backend in ("pallas_tpu", "xla"):
            step = lambda q, k, v, g, b, h, backend=backend: kdax.fused_recurrent_kda(
                q, k, v, g, b, initial_state=h, output_final_state=True, backend=backend
            )
            out.append(Peer("fused_recurrent_kda", dtype, "B=64 T=1 H=32 K=V=128", "fwd", backend, step, dargs))
    T, H, G, D, L = 16384, 32, 8, 128, 32768  # decode: 16 rows over the cache (float32 K and V: 2 GiB each)
    for dtype in ("bfloat16", "float32"):
        dt = jnp.dtype(dtype)
        q, k, v = make((1, T, H, D), dt), make((1, T, G, D), dt), make((1, T, G, D), dt)
        qd, kc, vc, n = make((16, H, D), dt), make((16, L, G, D), dt), make((16, L, G, D), dt), make((16,), jnp.int32)
        prefill, decode = f"B=1 T={T} H={H} G={G} D={D}", f"B=16 L={L} H={H} G={G} D={D}"
        trips = kascade_trips(T)
        for backend in ("pallas_tpu", "xla"):
            anchor = lambda q, k, v, backend=backend: kdax.kascade_anchor(q, k, v, topk_percent=10, backend=backend)
            idx = jax.eval_shape(anchor, q, k, v)[0]
            reuse = lambda q, k, v, i, backend=backend: kdax.kascade_reuse(q, k, v, i, backend=backend)
            ad = lambda q, k, v, n, backend=backend: kdax.kascade_anchor_decode(
                q, k, v, n, topk_percent=10, backend=backend
            )
            didx = jax.eval_shape(ad, qd, kc, vc, n)[0]
            rd = lambda q, k, v, n, i, backend=backend: kdax.kascade_reuse_decode(q, k, v, n, i, backend=backend)
            out += [
                Peer("kascade_anchor", dtype, prefill, "fwd", backend, anchor, [q, k, v], trips=trips),
                Peer(
                    "kascade_reuse",
                    dtype,
                    prefill,
                    "fwd",
                    backend,
                    reuse,
                    [q, k, v, make(idx.shape, idx.dtype)],
                    trips=trips,
                ),
                Peer("kascade_anchor_decode", dtype, decode, "fwd", backend, ad, [qd, kc, vc, n]),
                Peer(
                    "kascade_reuse_decode",
                    dtype,
                    decode,
                    "fwd",
                    backend,
                    rd,
                    [qd, kc, vc, n, make(didx.shape, idx.dtype)],
                ),
            ]
        out.append(Peer("dense attention", dtype, prefill, "fwd", "splash", _splash(T, H, D), [q, k, v], False))
        tuned = _splash(T, H, D, SPLASH_BLOCK)
        out.append(Peer("dense attention", dtype, prefill, "fwd", f"splash {SPLASH_BLOCK}", tuned, [q, k, v], False))
    return out


def kascade_trips(T: int, topk_percent: float = 10, min_k: int = 128, tile_size: int = 32) -> dict:
    """The mean trips of the prefill kernels' loops over key blocks, over the query tiles of one
    row of T tokens at the ops' defaults (pallas_tpu.Config's blocks): the dense pass
    ``kascade_attend`` reads the blocks before its tile, the scoring kernel the 512-key blocks
    before it, the sparse pass its selection (the budget of the tile's keys, in blocks)."""
    import numpy as np

    from kdax.ops.kascade import pallas_tpu
    from kdax.ops.kascade.checks import budget, percent_tenths

    cfg = pallas_tpu.Config()
    starts = np.arange(-(-T // tile_size)) * tile_size
    ceil = lambda n, d: float(np.mean(-(-n // d)))
    budgets = budget(starts, percent_tenths(topk_percent), min_k)
    return {
        "kascade_attend": ceil(starts, cfg.block_dense),
        "kascade_scores": ceil(starts, cfg.block_scores),
        "kascade_attend_sparse": ceil(budgets, cfg.block_k or pallas_tpu.sparse_block(int(budgets.max()))),
    }


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


def _splash(T, H, D, block: int | None = None):
    """jax's splash attention, causal, the KV heads expanded to the query heads; its default blocks
    (128), or ``block`` queries and keys a grid step (keys computed 512 at a time)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    sizes = None if block is None else sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=512)
    mask = sm.MultiHeadMask([sm.CausalMask((T, T))] * H)
    kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)

    def f(q, k, v):
        rep = H // k.shape[2]
        heads = lambda x: jnp.swapaxes(x[0], 0, 1)  # [heads, T, D]
        kh, vh = (jnp.repeat(heads(x), rep, axis=0) for x in (k, v))
        return kernel(heads(q) * D**-0.5, kh, vh)

    return f


def costs_table(rows: list[Row], peers: dict[str, Peer]) -> list[dict]:
    """The entries of kdax/ops/common/tpu_costs.json from the peer rows: per chip, kdax op, dtype,
    shape and passes, the pallas_tpu and xla compiles' outcome and static cycles (one of the two
    where ``--only`` compiled one: :func:`record` merges it into the table's entry)."""
    entries = {}
    for r in rows:
        p = peers.get(r.case)
        if p is None or p.backend not in ("pallas_tpu", "xla"):
            continue
        e = entries.setdefault((r.chip, p.op, p.dtype, p.shape, p.passes), {})
        e[p.backend] = {"compiles": r.ok, "cycles": r.cycles, "lower_bound": bool(r.unknown_loops)}
    return [
        dict(chip=chip, op=op, dtype=dtype, shape=shape, passes=passes, **e)
        for (chip, op, dtype, shape, passes), e in entries.items()
    ]


# ----------------------------------------------------------------------------- output


def _m(n: int) -> str:
    return f"{n / 1e6:,.2f} M" if n < 1e9 else f"{n / 1e9:,.2f} G"


def format_rows(rows: list[Row]) -> str:
    out = [
        "| case | chip | compiles | kernels: VMEM KiB, static cycles | program static cycles | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.ok:
            ks = "; ".join(
                f"{n} {v / 1024:,.0f}, {_m(c)}" + (" (lower bound)" if u else "") for n, v, c, u in r.kernels
            )
            lb = " (lower bound)" if r.unknown_loops else ""
            lb += f" (mean trips: {', '.join(r.modelled)})" if r.modelled else ""
            out.append(f"| {r.case} | {r.chip} | yes | {ks or '-'} | {_m(r.cycles)}{lb} | {r.seconds:.1f} |")
        else:
            out.append(f"| {r.case} | {r.chip} | **no**: {r.error.replace('|', '/')} | | | {r.seconds:.1f} |")
    return "\n".join(out)


def record(path: str, entries: list[dict], argv: list[str]) -> None:
    """Write the costs table to ``path``, keeping what these entries do not replace: an existing
    entry (same chip, op, dtype, shape and passes) takes the backends an entry brings, so that a run
    with ``--only`` updates it; the table keeps the entries that have both backends. A run with
    ``--only`` adds its command to the recorded ones."""
    import jax

    key = lambda e: (e["chip"], e["op"], e["dtype"], e["shape"], e["passes"])
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
    dump = tempfile.mkdtemp(prefix="kdax-tpu-llo-")
    # the two listings read_dump reads, not every pass's (which would triple the compile time)
    flags = f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=(final_bundles|original)"
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + flags).strip()
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # beside another libtpu process
    import jax

    print(f"jax {jax.__version__}, libtpu {_version('libtpu')}, chips {', '.join(a.chips)}\n", flush=True)
    print("\n".join(format_rows([]).splitlines()[:2]), flush=True)
    compiler, rows, peers = Compiler(dump), [], {}
    only = re.compile(a.only)
    try:
        for chip in a.chips:
            make, mesh = topology_args(chip)
            todo = [] if a.no_cases else [(n, f, x, True, None) for n, f, x in cases(make)]
            if a.peers:
                chip_peers = peer_calls(chip, make)
                peers.update({p.name: p for p in chip_peers})
                todo += [(p.name, p.fn, p.args, p.kdax_ops, p.trips) for p in chip_peers]
            for name, fn, args, kdax_ops, trips in todo:
                if only.search(name):
                    row = compiler.compile(name, chip, fn, args, mesh, kdax_ops=kdax_ops, trips=trips)
                    rows.append(row)
                    print(format_rows([row]).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} compiled" + (f"; failed: {len(failed)}" if failed else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    if a.record:
        record(a.record, costs_table(rows, peers), argv if argv is not None else sys.argv[1:])
    return 1 if a.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
