"""FLOPs, HBM bytes and a roofline estimate of the Kascade kernels per layer (docs/kascade_gpu.md,
docs/kascade_tpu.md): prefill B=1, H=32, G=8, D=128 bf16 at T = 32K and 128K; decode B=64 over
caches of 32K to 128K; top-k 10%, min_k 128, tile 32. An estimate from counts, not a measurement.

    python scripts/kascade_costs.py [--peak-tflops 989] [--hbm-tbs 3.35] [--mxu 0.6] [--bw 0.8]
"""

from __future__ import annotations

import argparse

from kdax.ops.kascade.blocks import select_bands
from kdax.ops.kascade.checks import budget


def prefill(T, H=32, G=8, D=128, tile=32, tenths=100, min_k=128, item=2):
    """Per layer: (name, FLOPs, HBM bytes) of dense attention and of Kascade's anchor and reuse passes."""
    starts = range(0, T, tile)
    keys = sum(int(budget(s, tenths, min_k)) for s in starts)  # selected keys summed over tiles
    diag = (tile + 1) / 2  # keys of its own tile per query (mean over the tile)
    qkvo = 4 * T * H * D * item  # read q, write o (H heads) ...
    kv = 2 * T * G * D * item  # ... and K, V once
    dense_flops = 4 * H * D * T * (T + 1) / 2
    # reuse: each tile's queries (all heads) against its selected rows and its own block; every
    # tile reads its selected K/V rows from HBM (an upper bound: neighbouring tiles share rows in L2)
    reuse_flops = 4 * H * D * tile * (keys + len(starts) * diag)
    reuse_bytes = qkvo + keys * G * D * item * 2
    # anchor scoring: q K^T again for keys before the tile, exp, and the pooled scores written
    # (float32, only keys before each tile); the top-k in bands of tiles (blocks.banded_select)
    # reads each band's keys before its last tile and sorts them as (float32 value, int32 index)
    # pairs it first writes; one pass of the sort counted, then the indices written
    score_flops = 2 * H * D * T * T / 2
    NT = len(starts)
    banded = sum((t1 - t0) * (t1 - 1) * tile for t0, t1 in select_bands(NT))
    select_bytes = G * (sum(starts) * 4 + banded * (4 + 8) + NT * int(budget(starts[-1], tenths, min_k)) * 4)
    anchor = (dense_flops + score_flops + reuse_flops, qkvo + kv + select_bytes + reuse_bytes)
    return {"dense": (dense_flops, qkvo + kv), "reuse": (reuse_flops, reuse_bytes), "anchor": anchor}


def decode(L, B=64, H=32, G=8, D=128, tenths=100, min_k=128, item=2):
    """Per layer and step: (FLOPs, HBM bytes) of dense decode and Kascade's anchor and reuse steps."""
    k = int(budget(L, tenths, min_k))
    dense = (4 * B * H * D * L, 2 * B * L * G * D * item)
    reuse = (4 * B * H * D * k, 2 * B * k * G * D * item)
    scores = B * H * L * 4  # float32 log2 scores written, read by the selection
    anchor = (2 * B * H * D * L + reuse[0], B * L * G * D * item + 2 * scores + reuse[1])
    return {"dense": dense, "reuse": reuse, "anchor": anchor}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense matmul peak (H100 SXM)")
    p.add_argument("--hbm-tbs", type=float, default=3.35, help="HBM bandwidth, TB/s (H100 SXM)")
    p.add_argument("--mxu", type=float, default=0.6, help="share of the peak the attention kernels reach")
    p.add_argument("--bw", type=float, default=0.8, help="share of the HBM bandwidth reached")
    a = p.parse_args()

    def ms(flops, nbytes):
        return max(flops / (a.peak_tflops * 1e12 * a.mxu), nbytes / (a.hbm_tbs * 1e12 * a.bw)) * 1e3

    rows = [("prefill", n, prefill(n)) for n in (32768, 131072)]
    rows += [("decode B=64", n, decode(n)) for n in (32768, 65536, 131072)]
    print("| pass | T or cache | kind | GFLOP | HBM GB | estimate ms | vs dense |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for what, n, costs in rows:
        dense_ms = ms(*costs["dense"])
        for kind in ("dense", "anchor", "reuse"):
            f, b = costs[kind]
            t = ms(f, b)
            print(
                f"| {what} | {n // 1024}K | {kind} | {f / 1e9:,.0f} | {b / 1e9:.2f} | {t:.2f} | {dense_ms / t:.2f}x |"
            )
        avg = (5 * ms(*costs["anchor"]) + 27 * ms(*costs["reuse"])) / 32
        print(f"| {what} | {n // 1024}K | 32 layers, 5 anchors (mean) | | | {avg:.2f} | {dense_ms / avg:.2f}x |")


if __name__ == "__main__":
    main()
