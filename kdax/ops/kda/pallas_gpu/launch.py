"""The GPU kernels' configuration: the precisions, :class:`Config`, the launch table as data,
the shared-memory model that fits launches to the GPU, and the matmuls (:class:`Tiles`) a call
gets (docs/kda_gpu.md, "Precision" and "Shared memory and the launch table")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kdax.ops.common import dispatch
from kdax.ops.kda.tiles import TF32X2, Tiles

PRECISIONS = {
    "ieee": (lax.Precision.HIGHEST, None),
    "tf32x3": (lax.DotAlgorithmPreset.TF32_TF32_F32_X3, None),
    "tf32": (lax.Precision.DEFAULT, None),
    "bf16": (lax.Precision.DEFAULT, jnp.bfloat16),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The pallas_gpu backend's per-call config (``chunk_kda(..., config=pallas_gpu.Config(...))``).

    Attributes:
        block_v: V block of the state, output, state-cotangent, values and keys kernels; None:
            32 with bfloat16 intermediates, 16 with float32 ones (whose three-pass TF32 products
            spill the state cotangent's loop at 32: docs/kda_gpu.md).
        block_k: K block of the diag, intra, recompute, values, keys, diag grads and levels kernels
            (both blocks powers of two >= 16); None: each kernel's from :data:`BLOCK_K`.
        precision: of the matmuls, "ieee" (float32 on the FMA units), "tf32x3" (float32 as
            three TF32 tensor-core products), "tf32", "bf16" (bulk matmuls on bfloat16 operands
            and intermediates stored in bfloat16; TF32 for the triangular inverse and the
            pairwise factorisation's backward) or "auto" (bf16 for bfloat16 inputs, tf32x3 for
            float32 and float16). In the interpreter, float32 matmuls are exact whatever the
            precision.
        launch: ((kernel, (num_warps, num_stages)), ...) overriding :data:`LAUNCH`; a launch
            named here is taken as it is (no shared-memory fitting).
        interpret: run in the Pallas interpreter; None: unless on a GPU (or lowering for one).

    Raises:
        ValueError: from :meth:`resolved`, naming the field that is out of range.
    """

    block_v: int | None = None
    block_k: int | None = None
    precision: str = "auto"
    launch: tuple[tuple[str, tuple[int, int]], ...] = ()
    interpret: bool | None = None

    def resolved(self) -> Config:
        """This config, its fields checked, with ``interpret`` None replaced by what it means here."""
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(f"config.precision: expected 'auto' or one of {tuple(PRECISIONS)}, got {self.precision!r}")
        for name in ("block_v", "block_k"):
            if (n := getattr(self, name)) is not None and (n < 16 or n & (n - 1)):
                raise ValueError(f"config.{name}: expected a power of two >= 16, got {n}")
        if unknown := set(dict(self.launch)) - set(LAUNCH):
            raise ValueError(f"config.launch: expected kernels among {tuple(LAUNCH)}, got {sorted(unknown)}")
        interpret = dispatch.platform() != "gpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


# (num_warps, num_stages) per kernel at C = 64, K = V = 128, from the compiled code (docs/kda_gpu.md,
# "Shared memory and the launch table"), not yet timed on a GPU: the 16-row kernels at 1 warp (more
# warps would each compute the same 16 x 16 products), intra at 2 (1 spills), values and keys at 4,
# one warp group for their 64-row products.
LAUNCH = {
    "diag": (1, 1),
    "intra": (2, 1),
    "recompute": (1, 1),
    "state": (4, 2),
    "output": (4, 2),
    "dstate": (4, 2),
    "values": (4, 1),
    "keys": (4, 1),
    "diag_grads": (1, 1),
    "levels": (1, 1),
}


# Key-column block per kernel (Config.block_k None) by the intermediates' dtype, from the compile
# report at C = 64, K = 128 and 256 (docs/kda_gpu.md): 32 where the kernel stays within the spill
# budget and issues 15-32% fewer instructions than at 16; keys, diag grads and levels spill past it
# at 32, recompute at K = 256, and with float32 intermediates intra too.
BLOCK_K = {
    "bf16": {"diag": 32, "intra": 32, "recompute": 16, "values": 32, "keys": 16, "diag_grads": 16, "levels": 16},
    "float32": {"diag": 16, "intra": 16, "recompute": 16, "values": 16, "keys": 16, "diag_grads": 16, "levels": 16},
}


# Shared memory one block may use (CUDA's opt-in maximum), KiB, by compute capability.
SHARED_MEMORY_KIB = {"8.0": 163, "8.6": 99, "8.7": 163, "8.9": 99, "9.0": 227, "10.0": 227, "12.0": 99}


def shared_memory_limit() -> tuple[int, str]:
    """Shared memory a block may use on the default GPU.

    Returns:
        (bytes, a description of the GPU): by compute capability (:data:`SHARED_MEMORY_KIB`),
        an H100's where no GPU is present (the interpreter, :func:`kdax.lower`).
    """
    device = jax.devices()[0]
    if device.platform != "gpu":
        return 227 * 1024, "an H100 (no GPU here)"
    cc = str(getattr(device, "compute_capability", ""))
    kib = SHARED_MEMORY_KIB.get(cc)
    if kib is None:  # a GPU not in the table: Hopper's from sm_90 up, else the least of the table
        kib = 227 if cc and float(cc) >= 9 else 99
    return kib * 1024, f"{device.device_kind} (compute capability {cc or 'unknown'})"


def shared_memory(kernel: str, C: int, Kp: int, BV: int, itemsize: int, stages: int = 1) -> int:
    """An upper bound on the shared memory (bytes) of one block of ``kernel`` at chunk size C,
    padded key dim Kp, V block BV, intermediates of ``itemsize`` bytes and ``stages`` pipeline
    stages, from its [C, Kp] and [C, C] tiles: fitted over what the CUDA compiler gave at C = 32
    to 128, K = 64 to 256, bfloat16 and float32 (``scripts/gpu_compile_report.py``; the
    measurements are in tests/ops/kda/test_pallas_gpu.py, which checks the bound against them)."""
    t, c = C * Kp * itemsize, C * C
    f32 = itemsize == 4
    return {
        "diag": 4096,
        "recompute": c * (6 if f32 else 2) + 2048,
        "intra": C * 32 + 2048,
        "state": 4 * t + 4096 if stages > 1 else t + c * itemsize // 2,
        "output": max(t, c * itemsize) + BV * max(Kp, C) * 2,
        "dstate": 5 * t + 2 * c * itemsize if stages > 1 else t + c * itemsize // 2,
        "values": c * (20 if f32 else 7) + 4096,
        "keys": c * (10 if f32 else 6) + 8192,
        "diag_grads": (36 if f32 else 10) * 1024,
        "levels": 2048,
    }[kernel]


def fit_launch(cfg: Config, C: int, Kp: int, itemsize: int) -> Config:
    """The state loops' software pipeline keeps each stage's tiles in shared memory: where two
    stages would overflow this GPU's shared memory (:func:`shared_memory`; on an H100 past 32 KiB
    a [C, Kp] tile: float32 at K = 256, bf16 at C = 128 and K = 256), those loops get one stage
    unless cfg.launch names them."""
    launch, (limit, _) = dict(cfg.launch), shared_memory_limit()
    for name in ("state", "dstate"):
        if shared_memory(name, C, Kp, cfg.block_v, itemsize, stages=2) > limit:
            launch.setdefault(name, (LAUNCH[name][0], 1))
    return dataclasses.replace(cfg, launch=tuple(launch.items()))


def too_large(cfg: Config, tiles: Tiles, C: int, K: int, V: int) -> str | None:
    """Why the kernels do not fit this GPU's shared memory at these sizes (None: they do). A
    launch the config names is taken as it is (the compiler says if it does not fit)."""
    Kp, itemsize = pow2(K), jnp.dtype(stored_dtype(tiles)).itemsize
    cfg = blocks(cfg, tiles, K, V)
    BV = cfg.block_v
    launch = dict(fit_launch(cfg, C, Kp, itemsize).launch)
    limit, gpu = shared_memory_limit()
    named = dict(cfg.launch)
    for name in (n for n in LAUNCH if n not in named):
        need = shared_memory(name, C, Kp, BV, itemsize, launch.get(name, LAUNCH[name])[1])
        if need > limit:
            kib = -(-need // 1024)
            return f"its {name} kernel needs about {kib} KiB of shared memory a block, {gpu} allows {limit // 1024}"
    return None


def blocks(cfg: Config, tiles: Tiles, K: int, V: int) -> Config:  # block_v as the kernels take it, block_k <= Kp
    block_v = cfg.block_v or (32 if tiles.operands else 16)
    block_k = cfg.block_k and min(cfg.block_k, pow2(K))
    return dataclasses.replace(cfg, block_v=min(block_v, pow2(V)), block_k=block_k)


def block_k(cfg: Config, tiles: Tiles, kernel: str, Kp: int) -> int:
    """The key-column block of ``kernel``: ``cfg.block_k`` if given, else :data:`BLOCK_K`'s, at most Kp."""
    return min(cfg.block_k or BLOCK_K["bf16" if tiles.operands else "float32"][kernel], Kp)


def params(cfg: Config, kernel: str) -> pltriton.CompilerParams:
    num_warps, num_stages = dict(cfg.launch).get(kernel, LAUNCH[kernel])
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def interpreted(cfg: Config) -> bool:
    return cfg.resolved().interpret


def stored_dtype(tiles: Tiles):  # dtype of the intermediates that feed only bulk matmuls
    return tiles.operands or jnp.float32


def tiles_for(cfg: Config, input_dtype) -> Tiles:
    name = cfg.precision
    if name == "auto":
        name = "bf16" if input_dtype == jnp.bfloat16 else "tf32x3"  # bf16 would lose float16's 3 extra bits
    precision, operands = PRECISIONS[name]
    sums = TF32X2  # the 0/1 sums on the tensor cores (docs/kda_gpu.md)
    if interpreted(cfg):  # no such algorithm on CPU; float32 there is exact anyway
        precision = lax.Precision.HIGHEST if isinstance(precision, lax.DotAlgorithmPreset) else precision
        sums = lax.Precision.HIGHEST
    return Tiles(precision=precision, matmul_reductions=False, operands=operands, sums=sums)


def pow2(n: int) -> int:  # smallest power of two >= max(n, 16)
    return max(16, 1 << (n - 1).bit_length())
