"""Compile every pallas_gpu kernel for an H100 (sm_90a) on a machine without a GPU, and report
what the compiler made of it: registers per thread, spill stack, shared memory, the
instruction mix (tensor-core HGMMA/HMMA, FFMA, exp2 on MUFU, local-memory LDL/STL), the
matmuls and how many of them are replicated (a result tile smaller than the one the warps
tile together, e.g. 16 x 16 at 8 warps, so that several warps compute the same product), and
the instructions one program issues (its SASS, each loop body once, times the warps; "loops":
each loop of one warp's SASS as trips x instructions), and from them the least time the
kernel's grid takes if instruction issue binds ("issue us": each instruction counted once per
trip of the loops around it, the warps' instructions of every program issued at an H100's
4 a cycle an SM, 132 SMs at 1.75 GHz) and if HBM bandwidth does ("bytes us": its operands
and results read or written once, at 3.35 TB/s). Neither counts the latency of the two
state loops' dependent steps, which bounds those kernels at B = 1; the closing lines sum
the larger of the two floors over the forward's kernels and the backward's.

    python scripts/gpu_compile_report.py [--T 8192] [--K 128 --V 128 --chunk-size 64]
        [--dtype bfloat16] [--fla-options] [--kernels intra keys]

JAX lowers the forward and the backward of ``chunk_kda(backend="pallas_gpu")`` at B = 1,
H = 16 (K = V = 128 unless given) for CUDA (``lowering_platforms=("cuda",)``), g the log
decay or, with ``--fla-options``, the in-kernel options ``kdax bench gpu-compare``
runs (raw gate logits with A_log and dt_bias, the L2 norm of q and k, the beta sigmoid); each kernel's Triton IR is then
compiled with the ``triton`` package (``pip install triton``), with the (num_warps,
num_stages) the kernels get (``pallas_gpu.LAUNCH`` fitted to the tiles), and the cubin
inspected with the ``cuobjdump`` that ships with it. The Triton inside XLA (what runs on a
GPU) is a different build, so counts can differ a little; shared memory over the 227 KiB
an H100 block may use means the kernel cannot launch. Exit status 1 when a kernel is over
that limit, and with ``--check`` when one spills more than the compile budget
(:data:`SPILL_BUDGET`: 128 B a thread with bf16 inputs, 512 B with float32). The closing
lines also give the warp-instructions each pass issues, beside FLA's at the default shape.

    python scripts/gpu_compile_report.py --op kascade [--T 32768 --H 32 --kv-heads 8 --head-dim 128]
        [--tile-size 32 --decode-batch 64 --cache-len 32768] [--dtype bfloat16] [--block-k 64] [--check]

``--op kascade`` does the same for the Kascade kernels (``kdax.ops.kascade.pallas_gpu``, forward
only): four calls with ``backend="pallas_gpu"`` lowered for CUDA, a prefill anchor with the dense
output, a prefill reuse, a decode anchor with the dense output and one with the sparse output
(:func:`kascade_modules`), one row per kernel named by its launch-table name and its call, held to
the same :data:`SPILL_BUDGET`. Their loops' trips depend on the tile or split, so "loops" and
"issued" give a program's at the mean trips over the grid (programs x issued is the grid's total);
"MB" leaves out what a kernel never touches (scores past each tile, cache rows not selected). The
closing lines sum each call's kernels.

    python scripts/gpu_compile_report.py --op decode [--decode-batch 64 --T 1 --H 32 --K 128 --V 128] [--check]

``--op decode`` reports the decode kernel (``fused_recurrent_kda`` on ``backend="pallas_gpu"``,
:mod:`kdax.ops.kda.decode`) on --decode-batch rows of --T tokens with the in-op gate, L2 norm and
beta sigmoid, held to the same budget; then the same kernel on a pool of --decode-batch slots
(``ssm_state_indices``, one a row) in both state layouts.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import triton
from jax._src.pallas.triton import pallas_call_registration
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

import kdax
from kdax.ops.common import dispatch
from kdax.ops.common.arrays import round_up
from kdax.ops.kascade import pallas_gpu as kascade_gpu
from kdax.ops.kascade.checks import budget, decode_k_max, prefill_k_max
from kdax.ops.kda import api, pallas_gpu
from kdax.ops.kda.api import chunk_kda
from kdax.ops.kda.shapes import BENCHMARK

SMEM_LIMIT = 227 * 1024  # bytes of shared memory one H100 block may use
ISSUE_PER_S = 132 * 4 * 1.75e9  # warp-instructions an H100 issues a second at most: 132 SMs, 4 a cycle each
BYTES_PER_S = 3.35e12  # an H100 SXM's HBM bandwidth
FORWARD = ("diag", "intra", "state", "output")  # the forward's kernels, in order
# The compile budget (--check): spill bytes a thread any kernel may have, by input dtype (float32 inputs
# run three-pass TF32 products, which need more registers).
SPILL_BUDGET = {"bfloat16": 128, "float32": 512}
# Warp-instructions FLA 0.6.0's Triton chunk_kda issues per pass at B=1 T=8192 H=16 K=V=128 bf16 with the
# in-op options, compiled for sm_90a the same way (its first autotune configs; ../shared/tools/compare_sass.py).
FLA_ISSUED = {"forward": 203e6, "backward": 521e6}
KERNELS = {
    "kda_diag": "diag",
    "kda_intra": "intra",
    "kda_recompute": "recompute",
    "kda_state": "state",
    "kda_output": "output",
    "kda_state_cotangent": "dstate",
    "kda_values": "values",
    "kda_keys": "keys",
    "kda_diag_grads": "diag_grads",
    "kda_levels": "levels",
}
KASCADE_KERNELS = {f"kascade_{name}": name for name in kascade_gpu.LAUNCH}  # --op kascade's, as KERNELS


def lowered_kernels(fn, args, names: dict[str, str]) -> list[tuple[str, str, tuple[int, int], int, int]]:
    """(launch-table name, Triton IR text, (num_warps, num_stages) its pallas_call got, programs in
    its grid, bytes of its operands and results) of each kernel ``fn(*args)`` lowers to for CUDA, in
    order; ``names`` maps each pallas_call's name to its launch-table name."""
    mods, calls = [], []
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        mods.append((names[jaxpr.debug_info.func_name], result.module.operation.get_asm()))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        kdax.lower(fn, *args, platform="cuda")
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower

    def walk(jaxpr):  # each pallas_call's launch (its launch table fitted to the tiles), grid and bytes, in order
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                p = eqn.params["compiler_params"]
                calls.append(
                    (
                        names[eqn.params["jaxpr"].debug_info.func_name],
                        (p.num_warps, p.num_stages),
                        math.prod(eqn.params["grid_mapping"].grid),
                        sum(v.aval.size * v.aval.dtype.itemsize for v in (*eqn.invars, *eqn.outvars)),
                    )
                )
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    with dispatch.building_for("gpu"):  # the kernels as kdax.lower built them
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
    assert [name for name, _ in mods] == [name for name, *_ in calls], "lowered and traced kernels differ"
    return [(name, ttir, *call[1:]) for (name, ttir), call in zip(mods, calls)]


def triton_modules(
    T: int, dtype, cfg: pallas_gpu.Config, fla_options: bool = False, K: int = 128, V: int = 128, chunk_size: int = 64
) -> list[tuple[str, str, tuple[int, int], int, int]]:
    """:func:`lowered_kernels` of the forward and backward of ``chunk_kda``, in order."""
    B, H = BENCHMARK.B, BENCHMARK.H
    options = (
        {
            "use_gate_in_kernel": True,
            "A_log": jnp.zeros((H,)),
            "dt_bias": jnp.zeros((H * K,)),
            "use_qk_l2norm_in_kernel": True,
            "use_beta_sigmoid_in_kernel": True,
        }
        if fla_options
        else {}
    )

    def loss(*a):
        o, s = chunk_kda(*a, config=cfg, output_final_state=True, chunk_size=chunk_size, **options)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s**2)  # squares: jax >= 0.12 drops kernels of unused o, s

    args = [jax.ShapeDtypeStruct(s, dtype) for s in [(B, T, H, K)] * 2 + [(B, T, H, V), (B, T, H, K), (B, T, H)]]
    api._compiled.clear_cache()  # traced afresh, so that every kernel is lowered through the capture
    return lowered_kernels(jax.grad(loss, argnums=range(5)), args, KERNELS)


def loop_trips(T: int, K: int, V: int, chunk_size: int, cfg: pallas_gpu.Config, dtype) -> dict[str, tuple[int, ...]]:
    """Trips of each kernel's loops by depth, outermost first, as pallas_gpu writes them at B = 1
    (LLVM unrolls some: the intra kernel's last walk, the values kernel's walk over key blocks). The
    intra and recompute kernels' walk over value blocks (Vp / block_v trips) is counted at the key
    walks' trips, which it shares a depth with: exact where those are equal (bf16 at K = V = 128:
    4 and 4), else off by the difference x that loop's instructions x the warps a program."""
    Kp, Vp, tiles = pallas_gpu.pow2(K), pallas_gpu.pow2(V), pallas_gpu.tiles_for(cfg, dtype)
    keys = {name: Kp // pallas_gpu.launch.block_k(cfg, tiles, name, Kp) for name in pallas_gpu.BLOCK_K["bf16"]}
    values, chunks = Vp // min(cfg.block_v, Vp), -(-T // chunk_size)
    return {
        "diag": (keys["diag"],),
        "intra": (keys["intra"],),
        "recompute": (keys["recompute"],),
        "state": (chunks,),
        "output": (),
        "dstate": (chunks,),
        "values": (values, keys["values"]),
        "keys": (keys["keys"], values),
        "diag_grads": (keys["diag_grads"],),
        "levels": (),
    }


def kascade_modules(
    T: int, H: int, G: int, D: int, batch: int, L: int, dtype, tile_size: int, cfg: kascade_gpu.Config
) -> list[tuple[str, str, str, tuple[int, int], int, int, tuple]]:
    """(call, launch-table name, Triton IR, launch, programs, bytes, loop trips) of each kernel of four
    Kascade calls with ``backend="pallas_gpu"`` (top-k 10%, min_k 128), in order: a prefill anchor with
    the dense output (the dense attend, the scores), a prefill reuse (the sparse attend over an anchor's
    selection, [1, G, NT, k_max]), a decode anchor with the dense output (decode scores with the softmax
    partial) and one with the sparse output (decode scores only, then the decode attend the reuse decode
    runs). Prefill at B = 1 over T tokens, decode ``batch`` rows over a full cache of L keys.

    Trips: each kernel's one loop as it runs there, the mean over its grid's programs (to 2 decimals;
    B and G repeat the same trips), so that programs x issued is the grid's total: ceil(s_t / block_k)
    key blocks before tile t (dense attend), ceil(s_t / block_scores) (scores), ceil(k_t / block_k)
    selected blocks with k_t the tile's top-k budget as an anchor selects it (sparse attend), and a
    split's share of the L keys or of the k_max selected rows in blocks of block_decode (decode).
    Bytes: of the operands and results, less the large parts a kernel never touches there: the pooled scores
    past each tile's blocks, the selection past its last block, the cache rows not selected."""
    s = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
    q, kv, q1, cache, lengths = s(1, T, H, D), s(1, T, G, D), s(batch, H, D), s(batch, L, G, D), s(batch, dt=jnp.int32)
    tenths, min_k, item, cdiv = 100, 128, jnp.dtype(dtype).itemsize, lambda n, d: -(-n // d)
    plan = kascade_gpu._plan(q, kv, tile_size, 1.0, cfg)
    starts = np.arange(plan.NT) * tile_size  # each query tile's first token
    k_max, bk, bs, bd = prefill_k_max(T, tile_size, tenths, min_k), cfg.block_k, cfg.block_scores, cfg.block_decode
    selected = cdiv(budget(starts, tenths, min_k), bk)  # blocks of each tile's selection
    _, Dp, S, Ls = kascade_gpu._decode_plan(q1, cache, cfg, L)  # decode scores: S splits of Ls keys
    k_row = decode_k_max(L, tenths, min_k)  # a full row's selection
    _, _, Sa, Ks = kascade_gpu._decode_plan(q1, cache, cfg, k_row)  # decode attend: Sa splits of Ks rows
    split_keys = np.clip(cdiv(np.maximum(L - np.arange(S) * Ls, 0), bd), 0, Ls // bd)
    split_rows = np.clip(cdiv(k_row, bd) - np.arange(Sa) * (Ks // bd), 0, Ks // bd)
    # per kernel: (its loop's trips in each program of one (b, g), bytes of its operands and results it never touches)
    dense = (cdiv(starts, bk), 0)
    scores = (cdiv(starts, bs), G * (plan.NT * plan.Tp - cdiv(starts, bs).sum() * bs) * item)
    sparse = (selected, G * (plan.NT * round_up(k_max, bk) - selected.sum() * bk) * 4)
    decode_attend = (split_rows, batch * G * (2 * (round_up(L, bd) - k_row) * Dp * item + (Sa * Ks - k_row) * 4))
    opts = {"backend": "pallas_gpu", "config": cfg}
    anchor = {"topk_percent": tenths / 10, "min_k": min_k, **opts}
    calls = {
        "anchor, dense output": (
            lambda q, k, v: kdax.kascade_anchor(q, k, v, tile_size=tile_size, dense_output=True, **anchor),
            (q, kv, kv),
            [dense, scores],
        ),
        "reuse": (
            lambda q, k, v, i: kdax.kascade_reuse(q, k, v, i, tile_size=tile_size, **opts),
            (q, kv, kv, s(1, G, plan.NT, k_max, dt=jnp.int32)),
            [sparse],
        ),
        "anchor decode, dense output": (
            lambda *a: kdax.kascade_anchor_decode(*a, dense_output=True, **anchor),
            (q1, cache, cache, lengths),
            [(split_keys, 0)],
        ),
        "anchor decode": (
            lambda *a: kdax.kascade_anchor_decode(*a, **anchor),
            (q1, cache, cache, lengths),
            [(split_keys, 0), decode_attend],
        ),
    }
    modules = []
    for call, (fn, args, kernels) in calls.items():
        lowered = lowered_kernels(fn, args, KASCADE_KERNELS)
        assert len(lowered) == len(kernels), f"{call}: {len(lowered)} kernels lowered, {len(kernels)} expected"
        for (*kernel, nbytes), (trips, untouched) in zip(lowered, kernels):
            mean = round(float(np.mean(trips)), 2)
            modules.append((call, *kernel, nbytes - int(untouched), (int(mean) if mean.is_integer() else mean,)))
    return modules


MMA_LAYOUT = re.compile(
    r"^(#\w+) = #ttg\.nvidia_mma<\{[^}]*warpsPerCTA = \[([\d, ]+)\], instrShape = \[([\d, ]+)\]", re.MULTILINE
)
SASS = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.MULTILINE)
DOT = re.compile(r"(?:tt\.dot|ttng\.warp_group_dot) .*-> tensor<(\d+)x(\d+)x\w+, (#\w+)>")


def replicated_dots(ttgir: str) -> list[int]:
    """For each matmul of a kernel's TritonGPU IR, how many warps compute each element of its
    result: an MMA layout with warpsPerCTA [wm, wn] and instrShape [im, in, ...] tiles
    [wm * im, wn * in] per step; a smaller result is repeated across the warps that overhang it.
    An IEEE float32 dot (the exact 0/1 sums) runs on the FMA units in a blocked layout: 1."""
    layouts = {
        name: ([int(x) for x in warps.split(",")], [int(x) for x in instr.split(",")][:2])
        for name, warps, instr in MMA_LAYOUT.findall(ttgir)
    }
    factors = []
    for rows, cols, layout in DOT.findall(ttgir):
        if layout not in layouts:  # an IEEE float32 dot on the FMA units: a blocked layout, no MMA tiles to repeat
            factors.append(1)
            continue
        warps, instr = layouts[layout]
        factors.append(math.prod(max(1, w * i // int(n)) for n, w, i in zip((rows, cols), warps, instr)))
    return factors


def _run_ttir_passes(path: str, target: GPUTarget, options: dict) -> None:
    """Rewrite the .ttir file at path after the TTIR passes (canonicalize, combine, CSE, ...), which
    XLA runs on the kernels it compiles and triton.compile skips for a .ttir file."""
    backend = make_backend(target)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(path, context)
    module.context = context
    with open(path, "w") as f:
        f.write(str(backend.make_ttir(module, {}, backend.parse_options(options), target.arch)))


def compile_report(name: str, ttir: str, launch: tuple[int, int], workdir: str, trips: tuple[int, ...]) -> dict:
    """Compile one kernel for sm_90a and read its resource usage, SASS instruction mix, loops
    (trips x instructions, ``trips`` by loop depth) and the warp-instructions one program issues."""
    num_warps, num_stages = launch
    target, options = GPUTarget("cuda", 90, 32), {"num_warps": num_warps, "num_stages": num_stages}
    path = os.path.join(workdir, f"{name}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    _run_ttir_passes(path, target, options)
    kernel = triton.compile(path, target=target, options=options)
    cubin = os.path.join(workdir, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    sass_ops = [(int(addr, 16), op, rest) for addr, op, rest in SASS.findall(sass)]
    ops = collections.Counter(op.split(".")[0] for _, op, _ in sass_ops)
    # loops: the address ranges of backward branches
    loops = [
        (int(to, 16), addr)
        for addr, op, rest in sass_ops
        if op == "BRA"
        for to in re.findall(r"0x([0-9a-f]+)", rest)
        if int(to, 16) < addr
    ]
    depth = [sum(a <= addr <= b for a, b in loops) for addr, _, _ in sass_ops]
    if max(depth, default=0) > len(trips):
        raise ValueError(f"{name}: loops {max(depth)} deep in the SASS, trips given for {len(trips)}")
    issued = sum(math.prod(trips[:d]) for d in depth)  # by one warp
    sizes = [sum(a <= addr <= b for addr, _, _ in sass_ops) for a, b in loops]
    nesting = [sum(c <= a and b <= d for c, d in loops) for a, b in loops]  # 1 = outermost
    loop_text = " ".join(f"{trips[n - 1]}x{size}" for n, size in sorted(zip(nesting, sizes))) or "-"
    repeats = replicated_dots(kernel.asm["ttgir"])
    rep = sorted(r for r in repeats if r > 1)
    replicated = f"{len(rep)} ({'-'.join(map(str, sorted({rep[0], rep[-1]})))}x)" if rep else "0"
    return dict(
        kernel=name,
        warps=num_warps,
        stages=num_stages,
        dots=len(repeats),
        replicated=replicated,
        warp_instrs=len(sass_ops) * num_warps,
        loops=loop_text,
        issued=round(issued * num_warps),
        regs=int(re.search(r"REG:(\d+)", usage).group(1)),
        spill=int(re.search(r"STACK:(\d+)", usage).group(1)),
        smem=kernel.metadata.shared,
        **{op: ops[op] for op in ("HGMMA", "HMMA", "FFMA", "MUFU", "LDL", "STL")},
    )


COLUMNS = [
    "kernel",
    "warps",
    "stages",
    "regs",
    "spill B",
    "smem KiB",
    "HGMMA",
    "HMMA",
    "FFMA",
    "MUFU",
    "LDL",
    "STL",
    "dots",
    "replicated",
    "warp-instrs",
    "loops",
    "issued",
    "issue us",
    "MB",
    "bytes us",
]
# Per --op: its options (absent from the other op's command line) with their defaults.
OP_OPTIONS = {
    "kda": {
        "T": BENCHMARK.T,
        "K": BENCHMARK.K,
        "V": BENCHMARK.V,
        "chunk_size": BENCHMARK.chunk_size,
        "precision": pallas_gpu.Config.precision,
        "block_v": pallas_gpu.Config.block_v,
        "block_k": pallas_gpu.Config.block_k,
        "fla_options": False,
    },
    "kascade": {
        "T": 32768,
        "H": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "tile_size": 32,
        "decode_batch": 64,
        "cache_len": 32768,
        "block_k": kascade_gpu.Config.block_k,
        "block_scores": kascade_gpu.Config.block_scores,
        "block_decode": kascade_gpu.Config.block_decode,
    },
    "decode": {"T": 1, "H": 32, "K": 128, "V": 128, "decode_batch": 64},
}
LAUNCHES = {
    "kda": pallas_gpu.LAUNCH,
    "kascade": kascade_gpu.LAUNCH,
    "decode": {"fused_recurrent": pallas_gpu.DECODE_LAUNCH},
}


def report(rows, workdir: str, dtype: str, kernels) -> tuple[dict, dict, list[str], list[str]]:
    """Compile and print one table row per (label, launch-table name, Triton IR, launch, programs,
    bytes, trips, part) in ``rows`` whose name is in ``kernels``. Returns, per part, the sum of the
    kernels' larger floors (us) and their warp-instructions issued, and the kernels over the spill
    budget and over the shared-memory limit."""
    spills, over, floors, issued = [], [], collections.defaultdict(float), collections.defaultdict(float)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for label, name, ttir, launch, programs, nbytes, trips, part in rows:
        if name not in kernels:
            continue
        r = compile_report(name, ttir, launch, workdir, trips)
        issue_us, bytes_us = programs * r["issued"] / ISSUE_PER_S * 1e6, nbytes / BYTES_PER_S * 1e6
        floors[part] += max(issue_us, bytes_us)
        issued[part] += programs * r["issued"]
        print(
            f"| {label} | {r['warps']} | {r['stages']} | {r['regs']} | {r['spill']} | {r['smem'] / 1024:.0f} | "
            f"{r['HGMMA']} | {r['HMMA']} | {r['FFMA']} | {r['MUFU']} | {r['LDL']} | {r['STL']} | {r['dots']} | "
            f"{r['replicated']} | {r['warp_instrs']} | {r['loops']} | {r['issued']} | {issue_us:.0f} | "
            f"{nbytes / 1e6:.0f} | {bytes_us:.0f} |",
            flush=True,
        )
        if r["smem"] > SMEM_LIMIT:
            over.append(label)
        if r["spill"] > SPILL_BUDGET[dtype]:
            spills.append(f"{label} ({r['spill']} B)")
    return floors, issued, spills, over


def kda_rows(a, cfg: pallas_gpu.Config):
    """report()'s rows for the forward and backward of chunk_kda."""
    trips = loop_trips(a.T, a.K, a.V, a.chunk_size, cfg, jnp.dtype(a.dtype))
    modules = triton_modules(a.T, jnp.dtype(a.dtype), cfg, a.fla_options, a.K, a.V, a.chunk_size)
    for i, (name, *module) in enumerate(modules):
        backward = i >= len(FORWARD)  # the forward's kernels come first, then the backward's (its own intra)
        label = f"{name}, backward" if backward and name in FORWARD else name
        yield label, name, *module, trips[name], "backward" if backward else "forward"


def decode_rows(a):
    """report()'s row for the decode kernel: fused_recurrent_kda(backend="pallas_gpu") on --decode-batch
    rows of --T tokens, --H heads, the gate, L2 norm and beta sigmoid in the op (its loop: T trips)."""
    dtype = jnp.dtype(a.dtype)
    s = lambda *shape, dt=None: jax.ShapeDtypeStruct(shape, dt or dtype)
    B, T, H, K, V = a.decode_batch, a.T, a.H, a.K, a.V
    gate = {"A_log": jnp.zeros((H,)), "dt_bias": jnp.zeros((H * K,)), "use_gate_in_kernel": True}
    in_op = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, **gate}

    def step(q, k, v, g, beta, h0):
        return kdax.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="pallas_gpu", **in_op
        )

    args = (s(B, T, H, K), s(B, T, H, K), s(B, T, H, V), s(B, T, H, K), s(B, T, H), s(B, H, K, V, dt=jnp.float32))
    for name, *module in lowered_kernels(step, args, {"kda_fused_recurrent": "fused_recurrent"}):
        yield name, name, *module, (T,), "decode step"
    # on a pool of B slots, one a row (so the pool's bytes are what a step reads and writes), in both layouts
    for v_first in (False, True):

        def slotted(q, k, v, g, beta, pool, idx, v_first=v_first):
            return kdax.fused_recurrent_kda(
                q,
                k,
                v,
                g,
                beta,
                initial_state=pool,
                ssm_state_indices=idx,
                state_v_first=v_first,
                backend="pallas_gpu",
                **in_op,
            )

        pool = s(B, H, V, K, dt=jnp.float32) if v_first else args[-1]
        kernels = lowered_kernels(
            slotted, (*args[:-1], pool, s(B, dt=jnp.int32)), {"kda_fused_recurrent_slots": "fused_recurrent"}
        )
        layout = "[V, K]" if v_first else "[K, V]"
        for name, *module in kernels:
            yield f"{name}, slots {layout}", name, *module, (T,), f"decode step, slots {layout}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hide = argparse.SUPPRESS  # an op's options are absent unless given: main checks they fit --op, then sets defaults
    p.add_argument("--op", default="kda", choices=tuple(OP_OPTIONS), help="the kernels to report (default kda)")
    p.add_argument("--T", type=int, default=hide, help="tokens (default 8192; kascade: 32768)")
    p.add_argument("--K", type=int, default=hide, help="kda: key head dim (default 128)")
    p.add_argument("--V", type=int, default=hide, help="kda: value head dim (default 128)")
    p.add_argument("--chunk-size", type=int, default=hide, help="kda (default 64)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--precision", default=hide, choices=("auto", *pallas_gpu.PRECISIONS), help="kda (default auto)")
    p.add_argument("--block-v", type=int, default=hide, help="kda (default: by dtype)")
    p.add_argument("--block-k", type=int, default=hide, help="by --op, its Config's default")
    p.add_argument(
        "--fla-options",
        action="store_true",
        default=hide,
        help="kda: gate, L2 norm and beta sigmoid in the op, as vs FLA",
    )
    p.add_argument("--H", type=int, default=hide, help="kascade: query heads; decode: heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=hide, help="kascade: KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=hide, help="kascade (default 128)")
    p.add_argument("--tile-size", type=int, default=hide, help="kascade: queries per tile (default 32)")
    p.add_argument("--decode-batch", type=int, default=hide, help="kascade, decode: decode rows (default 64)")
    p.add_argument("--cache-len", type=int, default=hide, help="kascade: decode cache keys (default 32768)")
    p.add_argument("--block-scores", type=int, default=hide, help="kascade (default: its Config's)")
    p.add_argument("--block-decode", type=int, default=hide, help="kascade (default: its Config's)")
    p.add_argument(
        "--launch",
        nargs="*",
        default=[],
        metavar="KERNEL=WARPS,STAGES",
        help="override the --op's launch table (pallas_gpu.LAUNCH)",
    )
    p.add_argument("--kernels", nargs="*", help="launch-table names (default: all of the --op's)")
    p.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when a kernel spills more than the budget a thread {SPILL_BUDGET} (by --dtype)",
    )
    a = p.parse_args(argv)
    for other in (op for op in OP_OPTIONS if op != a.op):
        if wrong := sorted(set(vars(a)) & set(OP_OPTIONS[other]) - set(OP_OPTIONS[a.op])):
            p.error(f"--{wrong[0].replace('_', '-')} is an option of --op {other}, not of --op {a.op}")
    if a.op == "decode" and a.launch:
        p.error("--launch: --op decode runs pallas_gpu.DECODE_LAUNCH")
    for name, default in OP_OPTIONS[a.op].items():
        setattr(a, name, getattr(a, name, default))
    launches = LAUNCHES[a.op]
    if unknown := sorted(set(a.kernels or ()) - set(launches)):
        p.error(f"--kernels: expected names among {tuple(launches)} (--op {a.op}), got {unknown}")
    given = {}
    for item in a.launch:
        name, _, ws = item.partition("=")
        if name not in launches or not re.fullmatch(r"\d+,\d+", ws):
            p.error(f"--launch: expected KERNEL=WARPS,STAGES with KERNEL among {tuple(launches)}, got {item!r}")
        given[name] = tuple(int(x) for x in ws.split(","))
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    versions = f"sm_90a, triton {triton.__version__}, jax {jax.__version__}"
    try:  # a bad block or launch: the Config's own message
        if a.op == "decode":
            cfg = None
        elif a.op == "kda":
            cfg = pallas_gpu.Config(
                block_v=a.block_v,
                block_k=a.block_k,
                precision=a.precision,
                launch=tuple(given.items()),
                interpret=False,
            ).resolved()
            cfg = pallas_gpu.blocks(cfg, pallas_gpu.tiles_for(cfg, jnp.dtype(a.dtype)), a.K, a.V)  # block_v as run
        else:
            cfg = kascade_gpu.Config(
                block_k=a.block_k,
                block_scores=a.block_scores,
                block_decode=a.block_decode,
                launch=tuple(given.items()),
                interpret=False,
            ).resolved()
            cfg = kascade_gpu.for_dtype(cfg, jnp.dtype(a.dtype))  # the prefill blocks as run
    except ValueError as e:
        p.error(str(e))
    with tempfile.TemporaryDirectory() as workdir:
        if a.op == "kda":
            print(
                f"{versions}, B={BENCHMARK.B} T={a.T} H={BENCHMARK.H} K={a.K} V={a.V} C={a.chunk_size} {a.dtype}, "
                f"precision={a.precision} block_v={cfg.block_v} block_k={cfg.block_k or 'per kernel'} "
                f"fla_options={a.fla_options}"
            )
            rows = kda_rows(a, cfg)
        elif a.op == "decode":
            print(f"{versions}, decode B={a.decode_batch} T={a.T} H={a.H} K={a.K} V={a.V} {a.dtype}, in-op options")
            rows = decode_rows(a)
        else:
            print(
                f"{versions}, prefill B=1 T={a.T}, decode B={a.decode_batch} over {a.cache_len} keys, H={a.H} "
                f"G={a.kv_heads} D={a.head_dim} {a.dtype}, tile {a.tile_size}, top-k 10% min_k 128, "
                f"block_k={cfg.block_k} block_scores={cfg.block_scores} block_decode={cfg.block_decode}"
            )
            modules = kascade_modules(
                a.T, a.H, a.kv_heads, a.head_dim, a.decode_batch, a.cache_len, jnp.dtype(a.dtype), a.tile_size, cfg
            )
            rows = ((f"{name} ({call})", name, *module, call) for call, name, *module in modules)
        floors, issued, spills, over = report(rows, workdir, a.dtype, a.kernels or list(launches))
    for part, us in floors.items():
        if a.op == "kda":
            print(
                f"{part}: {us:.0f} us, larger floors of the kernels shown (no state-loop latency, no XLA passes); "
                f"{issued[part] / 1e6:.1f} M warp-instructions issued (FLA: {FLA_ISSUED[part] / 1e6:.0f} M at "
                f"T=8192 bf16 with its in-op options)"
            )
        else:
            print(
                f"{part}: {us:.0f} us, larger floors of the kernels shown (not the XLA steps around them); "
                f"{issued[part] / 1e6:.1f} M warp-instructions issued"
            )
    if spills:
        print(f"over the spill budget of {SPILL_BUDGET[a.dtype]} B a thread: {', '.join(spills)}")
    if over:
        print(f"over the {SMEM_LIMIT // 1024} KiB shared-memory limit (cannot launch): {', '.join(over)}")
    return 1 if over or (a.check and spills) else 0


if __name__ == "__main__":
    sys.exit(main())
