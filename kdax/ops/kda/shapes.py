"""KDA's benchmark shapes, each written once and used by every comparison: the FLA comparison and
GPU tuning (``kdax bench gpu-compare``, ``gpu-tune``), the TPU and GPU compile reports
(scripts/tpu_compile_report.py, scripts/gpu_compile_report.py). The small hard cases the tests
check every backend on are tests/ops/kda/cases.py's."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    """Inputs q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K], beta [B, T, H] (H value heads, one
    per q/k head), bfloat16 q, k, v and beta, chunks of ``chunk_size``."""

    B: int
    T: int
    H: int
    K: int = 128
    V: int = 128
    chunk_size: int = 64

    def dims(self) -> dict[str, int]:
        """{"B": B, "T": T, "H": H, "K": K, "V": V}: as ``kdax bench``'s shape flags take them."""
        return {"B": self.B, "T": self.T, "H": self.H, "K": self.K, "V": self.V}

    def label(self) -> str:
        """ "B=1 T=8192 H=16 K=V=128" (K and V apart where they differ)."""
        kv = f"K=V={self.K}" if self.K == self.V else f"K={self.K} V={self.V}"
        return f"B={self.B} T={self.T} H={self.H} {kv}"


# FLA's benchmark shape for KDA (its benchmarks' B = 1, T = 8192, 16 heads of 128): every
# comparison of kdax's kernels with FLA's and tokamax's, and the compile reports, at one shape.
BENCHMARK = Shape(B=1, T=8192, H=16)
# The FLA comparison's sweep (H, K, V of BENCHMARK): short and long sequences, one row and eight.
FLA_SWEEP = tuple(dataclasses.replace(BENCHMARK, B=B, T=T) for B in (1, 8) for T in (2048, 8192, 32768))
# A decode step: 64 rows of one token each, 32 heads (the compile report's fused_recurrent_kda).
DECODE_STEP = Shape(B=64, T=1, H=32)
