"""The pallas_tpu backend's config, its tables and the one place it is resolved (:func:`plan`).

Tuning (``pipeline``, ``block_v``, ``heads``), numerics (``precision``) and run mode
(``interpret``, ``detect_races``) are resolved together by :func:`plan` once per call: precision
"auto" by the inputs' dtype, ``block_v`` to the padded V, ``interpret`` None to "off a TPU". The
tables give the value heads a grid step takes per kernel (:func:`heads_per_step`) and the kernels'
VMEM limit per chip.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common import dispatch
from kdax.ops.common.arrays import round_up
from kdax.ops.kda.tiles import BF16_HIGH, BF16X2, BF16X3, Tiles

LANE = 128
PRECISIONS = ("highest", "bf16")  # Config.precision, besides "auto" (docs/kda_tpu.md, Precision)


@dataclasses.dataclass(frozen=True)
class Config:
    """The pallas_tpu backend's per-call config (``chunk_kda(..., config=pallas_tpu.Config(...))``).

    Attributes:
        pipeline: how the forward runs, "fused" (one kernel) or "staged" (intra, state, output).
        block_v: None (all of V in one block) or a multiple of 128 below V, which splits V over
            grid programs of one value head each.
        precision: of the matmuls, "highest" (float32: six bfloat16 passes), "bf16" (every
            matmul on bfloat16 operands, one pass, float32 accumulation, but the triangular
            inverse's: two bfloat16 parts of each operand, three products) or "auto" (bf16 for
            bfloat16 inputs, highest for the others). The 0/1 sums (exponents, cumsums) take three
            bfloat16 parts of their operand, exact products, in every mode.
        heads: value heads a grid step takes, forward and backward (a batch of independent chains
            of matmuls, which hide each other's latency); None: :data:`HEADS` (:data:`ROOMY` on
            chips with 64 MiB of VMEM a core or more) at K = V = 128, fewer for wider states, more
            than :data:`PAIRED` on two cores a device (v4, v5p) only where two parallel programs
            remain.
            Lowered to a count that divides the value heads and fits the groups of value
            heads per q/k head.
        interpret: run in the Pallas TPU interpreter; None: unless on a TPU (or lowering for one).
        detect_races: in the interpreter, check the kernels for data races.

    Raises:
        ValueError: from :meth:`resolved`, naming the field that is out of range.
    """

    pipeline: str = "fused"
    block_v: int | None = None
    precision: str = "auto"
    heads: int | None = None
    interpret: bool | None = None
    detect_races: bool = False

    def resolved(self) -> Config:
        """This config, its fields checked, with ``interpret`` None replaced by what it means here."""
        if self.pipeline not in ("fused", "staged"):
            raise ValueError(f"config.pipeline: expected 'fused' or 'staged', got {self.pipeline!r}")
        if self.block_v is not None and (not isinstance(self.block_v, int) or self.block_v < 1 or self.block_v % LANE):
            raise ValueError(f"config.block_v: expected None or a positive multiple of {LANE}, got {self.block_v!r}")
        if self.heads is not None and (not isinstance(self.heads, int) or self.heads < 1):
            raise ValueError(f"config.heads: expected None or a positive int, got {self.heads!r}")
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(f"config.precision: expected 'auto' or one of {PRECISIONS}, got {self.precision!r}")
        interpret = dispatch.platform() != "tpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


def tiles_for(cfg: Config) -> Tiles:
    """The chunk math's matmuls for ``cfg.precision`` (resolved: not "auto")."""
    hi = lax.Precision.HIGHEST
    if cfg.precision == "bf16":
        return Tiles(
            precision=lax.Precision.DEFAULT,
            operands=jnp.bfloat16,
            sums=BF16X2,
            wide_precision=BF16_HIGH,
            stacked=True,
            wide_levels=False,
            paired=True,
        )
    return Tiles(precision=hi, sums=BF16X3, stacked=True, paired=mxu_width() == 128)


def mxu_width() -> int:
    """The MXU's width on the chip the kernels are built for (128 on v5e and older, 256 on v6e and
    TPU7x), 128 where no TPU is known (the interpreter). Heads in pairs (``Tiles.paired``) pay under
    "highest" on a 128-wide MXU (v5e float32 forward 6.48 -> 5.58 M static cycles), not on a 256-wide
    one (TPU7x 7.58 -> 8.14 M; bf16 gains on both, docs/kda_tpu.md)."""
    try:
        return pltpu.get_tpu_info().mxu_column_size
    except ValueError:
        return 128


def plan(cfg: Config, input_dtype, K: int, V: int) -> Config:
    """``cfg`` checked and resolved for inputs of ``input_dtype`` with K key and V value columns:
    precision "auto" -> "bf16" for bfloat16 inputs, else "highest"; block_v -> at most V padded to
    it (a multiple of 128); interpret None -> off a TPU.

    Raises:
        ValueError: naming the config field that is out of range, or ``heads`` above 1 with a
            block_v below V (a grid step then takes one value head).
    """
    cfg = cfg.resolved()
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16" if jnp.dtype(input_dtype) == jnp.bfloat16 else "highest"
    Vp = round_up(V, max(LANE, cfg.block_v or LANE))
    cfg = dataclasses.replace(cfg, precision=precision, block_v=min(cfg.block_v or Vp, Vp))
    if cfg.block_v < Vp and cfg.heads not in (None, 1):
        raise ValueError(f"config.heads: with block_v below V a grid step takes one value head, got {cfg.heads}")
    return cfg


def interpret_params(cfg: Config):
    """The pallas_call ``interpret`` argument of a resolved config."""
    return pltpu.InterpretParams(detect_races=cfg.detect_races) if cfg.interpret else False


# Value heads a grid step takes by default at C = 64, K = V = 128, per precision and kernel: the
# forward; the forward saving products and states for the backward; the forward keeping its fields
# too (disable_recompute); the backward; the backward reading the kept fields. Each as many as fit
# the VMEM limit and gain (docs/kda_tpu.md, Layout), fewer for wider states or chunks; ROOMY where the
# limit is ROOMY_LIMIT. The backward takes its heads LOCKSTEP at a time (more in lockstep spill past
# the limit). On chips with two TensorCores a device (v4, v5p), which split the grid's parallel axes
# between them, a step takes more than PAIRED heads only where the grid keeps two parallel programs
# (B HV / n >= 2).
KERNELS = ("forward", "saving", "keeping", "backward", "reading")
HEADS = {"bf16": dict(zip(KERNELS, (32, 16, 16, 16, 16))), "highest": dict(zip(KERNELS, (8, 8, 8, 8, 8)))}
ROOMY = {"bf16": {"saving": 32, "backward": 32}, "highest": {"backward": 16}}
LOCKSTEP = {"bf16": 8, "highest": 4}
PAIRED = 8
# The chunk kernels' scoped VMEM limit: ROOMY_LIMIT on chips with at least 64 MiB of VMEM a core
# (v5e and v6e have 128 MiB, v5p and TPU7x 64 MiB), else VMEM_LIMIT (and off a TPU).
VMEM_LIMIT, ROOMY_LIMIT = 32 << 20, 56 << 20


def vmem_limit() -> int:
    """The chunk kernels' scoped VMEM limit on the chip they are built for (:data:`ROOMY_LIMIT` or
    :data:`VMEM_LIMIT`)."""
    try:
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    except ValueError:
        return VMEM_LIMIT
    return ROOMY_LIMIT if capacity >= 64 << 20 else VMEM_LIMIT


def scaled(top: int, C: int, Kp: int, Vp: int) -> int:  # top at C = 64, K = V = 128
    return max(1, min(top, top * LANE * LANE * 64 // (Kp * Vp * C)))


def cores_per_device() -> int:
    """The TensorCores of one device of the chip the kernels are built for (2 on v4 and v5p), 2 where
    no TPU is known (the interpreter)."""
    try:
        return pltpu.get_tpu_info().num_cores
    except ValueError:
        return 2


def heads_per_step(
    HV: int,
    groups: int,
    C: int,
    Kp: int,
    Vp: int,
    cfg: Config,
    kernel: str,
    B: int = 1,
    cores: int | None = None,
    vmem: int | None = None,
) -> int:
    """The value heads a grid step of ``kernel`` (one of :data:`KERNELS`) takes: ``cfg.heads``
    (None: :data:`HEADS` of the precision, or :data:`ROOMY` where the VMEM limit ``vmem`` (None:
    :func:`vmem_limit`) is :data:`ROOMY_LIMIT`, scaled down by the state's size over 128 x 128 and
    the chunk's over 64, and above :data:`PAIRED` on two cores a device (``cores``, None:
    :func:`cores_per_device`) only where B HV / n >= 2), lowered to the largest count that divides
    HV and that groups divides or that divides groups (q and k come in whole blocks)."""
    asked = cfg.heads
    if asked is None:
        roomy = (vmem_limit() if vmem is None else vmem) >= ROOMY_LIMIT
        table = {**HEADS[cfg.precision], **(ROOMY[cfg.precision] if roomy else {})}
        top = scaled(table[kernel], C, Kp, Vp)
    else:
        top = asked
    fits = [n for n in range(1, min(top, HV) + 1) if HV % n == 0 and (n % groups == 0 or groups % n == 0)]
    if asked is not None or (cores_per_device() if cores is None else cores) == 1:
        return max(fits)
    return max([n for n in fits if n <= PAIRED or B * HV // n >= 2] or fits)
