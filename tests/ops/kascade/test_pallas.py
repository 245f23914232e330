"""The Kascade Pallas kernels of both platforms in the Pallas interpreter against the float64
definitions (small shapes: CI time), and lowered for their platform on this machine."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench.measure import rel_rms
from kdax.ops.kascade import blocks as bl
from kdax.ops.kascade import pallas_gpu, pallas_tpu, reference
from kdax.ops.kascade.checks import prefill_k_max
from tests.tolerances import BF16, F32

# Small blocks, so every loop takes several steps (TPU's lane-sized blocks cover these T at once).
# Compiled on their device (scripts/gpu_session.sh kascade), in the interpreter elsewhere.
KERNELS = {
    "pallas_tpu": pallas_tpu.Config(block_k=8, block_dense=16),
    "pallas_gpu": pallas_gpu.Config(block_k=16, block_scores=16, block_decode=16, splits=2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    T: int = 40  # not a multiple of the tile
    H: int = 4
    G: int = 2
    D: int = 16
    tile_size: int = 16
    lengths: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return self.name


CASES = [Case("gqa_lengths_40_23", lengths=(40, 23)), Case("mha_D60", B=1, T=50, G=4, D=60)]
OPTIONS = {"topk_percent": 20, "min_k": 4, "pool_size": 1}  # token selection (pools: the tests below)


def inputs(case: Case, dtype, seed=0):
    """q, k, v rounded to ``dtype`` and the same values in float64 (peaked attention: clear margins)."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((case.B, case.T, case.H, case.D)) * 1.5
    k, v = (r.standard_normal((case.B, case.T, case.G, case.D)) for _ in range(2))
    low = [jnp.asarray(x, dtype) for x in (q, k, v)]
    return low, [x.astype(jnp.float64) for x in low]


def _lengths(case):
    return None if case.lengths is None else jnp.asarray(case.lengths, jnp.int32)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_definition_in_fp32(backend, case):
    """Anchor (sparse and dense output) and reuse with a head map that permutes the KV heads."""
    (q, k, v), exact = inputs(case, jnp.float32)
    lengths, opts = _lengths(case), dict(OPTIONS, tile_size=case.tile_size)
    want_idx, want = reference.naive_kascade_anchor(*exact, **opts, lengths=lengths)
    head_map = np.arange(case.G)[::-1].copy()
    want_reuse = reference.naive_kascade_reuse(
        *exact, want_idx, head_map=head_map, tile_size=case.tile_size, pool_size=1, lengths=lengths
    )
    want_dense = reference.naive_attention(*exact, lengths=lengths)
    cfg = KERNELS[backend]
    idx, o = kdax.kascade_anchor(q, k, v, **opts, lengths=lengths, backend=backend, config=cfg)
    np.testing.assert_array_equal(idx, want_idx)
    assert o.dtype == jnp.float32 and rel_rms(o, want) <= F32["out"]
    if lengths is not None:  # the dense output once per backend (CI time)
        _, dense = kdax.kascade_anchor(q, k, v, **opts, lengths=lengths, dense_output=True, backend=backend, config=cfg)
        assert rel_rms(dense, want_dense) <= F32["out"]
    o = kdax.kascade_reuse(
        q,
        k,
        v,
        want_idx,
        head_map=head_map,
        tile_size=case.tile_size,
        pool_size=1,
        lengths=lengths,
        backend=backend,
        config=cfg,
    )
    assert rel_rms(o, want_reuse) <= F32["out"]
    if lengths is not None:
        assert not np.asarray(o)[np.arange(case.T)[None, :] >= np.asarray(lengths)[:, None]].any()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_decode_matches_definition(backend, dtype):
    """Anchor (sparse, dense) and reuse decode over rows of different lengths, an empty one too."""
    case = Case("decode", B=3, T=40, G=2)
    (q, k, v), exact = inputs(case, dtype)
    lengths = jnp.asarray([40, 1, 0], jnp.int32)
    head_map = np.asarray([1, 0])
    want_idx, want = reference.naive_kascade_anchor_decode(exact[0][:, 9], *exact[1:], lengths, **OPTIONS)
    _, want_dense = reference.naive_kascade_anchor_decode(
        exact[0][:, 9], *exact[1:], lengths, **OPTIONS, dense_output=True
    )
    want_reuse = reference.naive_kascade_reuse_decode(
        exact[0][:, 9], *exact[1:], lengths, want_idx, head_map=head_map, pool_size=1
    )
    cfg, bar = KERNELS[backend], 1e-5 if dtype == jnp.float32 else 1e-2
    idx, o = kdax.kascade_anchor_decode(q[:, 9], k, v, lengths, **OPTIONS, backend=backend, config=cfg)
    np.testing.assert_array_equal(idx, want_idx)
    assert o.dtype == dtype and rel_rms(o, want) <= bar and not np.asarray(o[2]).any()
    _, dense = kdax.kascade_anchor_decode(
        q[:, 9], k, v, lengths, **OPTIONS, dense_output=True, backend=backend, config=cfg
    )
    assert rel_rms(dense, want_dense) <= bar
    o = kdax.kascade_reuse_decode(
        q[:, 9], k, v, lengths, want_idx, head_map=head_map, pool_size=1, backend=backend, config=cfg
    )
    assert rel_rms(o, want_reuse) <= bar


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_tpu_pooled_pass_on_whole_blocks_reads_the_inputs_in_place(dtype):
    """At the defaults (tiles and pools of 128) with T a multiple of them and D = 128, the TPU
    sparse pass reads q, k, v as the caller lays them out (no padded copy) and equals the float64
    definition: anchor and reuse, tiles choosing several pools, a row cut short."""
    case = Case("whole", B=2, T=512, H=4, G=2, D=128)
    (q, k, v), exact = inputs(case, dtype)
    lengths = jnp.asarray([512, 300], jnp.int32)
    opts = {"topk_percent": 70, "min_k": 0}
    bar = F32["out"] if dtype == jnp.float32 else BF16["out"]
    want_idx, want = reference.naive_kascade_anchor(*exact, **opts, lengths=lengths)
    assert (np.asarray(want_idx) >= 0).sum(-1).max() >= 2 * 128  # a tile with two pools
    idx, o = kdax.kascade_anchor(q, k, v, **opts, lengths=lengths, backend="pallas_tpu")
    np.testing.assert_array_equal(idx, want_idx)
    assert rel_rms(o, want) <= bar
    head_map = np.asarray([1, 0])
    want = reference.naive_kascade_reuse(*exact, want_idx, head_map=head_map, lengths=lengths)
    reuse = lambda q, k, v: kdax.kascade_reuse(
        q, k, v, want_idx, head_map=head_map, lengths=lengths, backend="pallas_tpu"
    )
    o = reuse(q, k, v)
    assert rel_rms(o, want) <= bar and not np.asarray(o)[1, 300:].any()
    assert "stablehlo.pad" not in kdax.lower(reuse, q, k, v, platform="tpu").as_text()


_POOLED = [(jnp.float32, 32, 16), (jnp.bfloat16, 32, 16), (jnp.float32, 16, 64)]
_POOLED_IN_CI = {("pallas_tpu", 1), ("pallas_tpu", 2), ("pallas_gpu", 0)}  # the others behind slow: CI's time


@pytest.mark.parametrize(
    ("backend", "dtype", "tile", "pool"),
    [
        pytest.param(
            b,
            *p,
            id=f"{jnp.dtype(p[0]).name}-{p[1]}-{p[2]}-{b}",
            marks=() if (b, i) in _POOLED_IN_CI else pytest.mark.slow,
        )
        for i, p in enumerate(_POOLED)
        for b in KERNELS
    ],
)
def test_pooled_selection_matches_definition(backend, dtype, tile, pool):
    """Pools of 16 keys under tiles of 32 and of 64 under 16, and of 32 keys in decode: the
    selection equals the float64 definition's from the same values (the kernels pool in float32),
    the outputs within bars; reuse with a head map, rows past their length 0."""
    case = Case("pools", T=150, lengths=(150, 45), tile_size=tile)
    (q, k, v), exact = inputs(case, dtype)
    lengths, cfg = _lengths(case), KERNELS[backend]
    opts = {"topk_percent": 40 if pool < 64 else 90, "min_k": 16, "tile_size": tile, "pool_size": pool}
    bar = F32["out"] if dtype == jnp.float32 else BF16["out"]
    want_idx, want = reference.naive_kascade_anchor(*exact, **opts, lengths=lengths)
    assert (np.asarray(want_idx) >= 0).sum(-1).max() >= 2 * pool  # tiles with several pools
    idx, o = kdax.kascade_anchor(q, k, v, **opts, lengths=lengths, backend=backend, config=cfg)
    np.testing.assert_array_equal(idx, want_idx)
    assert rel_rms(o, want) <= bar
    idx, dense = kdax.kascade_anchor(q, k, v, **opts, lengths=lengths, dense_output=True, backend=backend, config=cfg)
    np.testing.assert_array_equal(idx, want_idx)
    assert rel_rms(dense, reference.naive_attention(*exact, lengths=lengths)) <= bar
    head_map, pools = np.asarray([1, 0]), {"tile_size": tile, "pool_size": pool}
    want = reference.naive_kascade_reuse(*exact, want_idx, head_map=head_map, lengths=lengths, **pools)
    o = kdax.kascade_reuse(q, k, v, want_idx, head_map=head_map, lengths=lengths, backend=backend, config=cfg, **pools)
    assert rel_rms(o, want) <= bar and not np.asarray(o)[1, 45:].any()
    dec = {"topk_percent": 70, "min_k": 16, "pool_size": 32}  # 3 pools of row 0, 1 of row 1
    rows = jnp.asarray([150, 70], jnp.int32)
    want_idx, want = reference.naive_kascade_anchor_decode(exact[0][:, 9], *exact[1:], rows, **dec)
    idx, o = kdax.kascade_anchor_decode(q[:, 9], k, v, rows, **dec, backend=backend, config=cfg)
    np.testing.assert_array_equal(idx, want_idx)
    assert rel_rms(o, want) <= bar
    want = reference.naive_kascade_reuse_decode(exact[0][:, 9], *exact[1:], rows, want_idx, pool_size=32)
    o = kdax.kascade_reuse_decode(q[:, 9], k, v, rows, want_idx, pool_size=32, backend=backend, config=cfg)
    assert rel_rms(o, want) <= bar


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("layout", ["BLGD", "BGLD"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_decode_over_pools_of_128_matches_definition(backend, layout, dtype):
    """Decode with pools of 128 keys (the TPU's pooled kernels: a copy a pool of one head), both cache
    layouts, rows of different lengths (the last pool partial or empty, an empty row), the dense
    output too; a cache not a multiple of the pool."""
    case = Case("decode", B=4, T=600, G=2, D=32)
    (q, k, v), exact = inputs(case, dtype)
    lengths = jnp.asarray([600, 384, 131, 0], jnp.int32)
    opts = {"topk_percent": 40, "min_k": 0, "pool_size": 128}
    cfg, bar = KERNELS[backend], 1e-5 if dtype == jnp.float32 else 1e-2
    caches = (k, v) if layout == "BLGD" else (k.swapaxes(1, 2), v.swapaxes(1, 2))
    qt, layouts = q[:, 9], {"cache_layout": layout, "backend": backend, "config": cfg}
    for dense in (False, True):
        want_idx, want = reference.naive_kascade_anchor_decode(
            exact[0][:, 9], *exact[1:], lengths, **opts, dense_output=dense
        )
        idx, o = kdax.kascade_anchor_decode(qt, *caches, lengths, **opts, dense_output=dense, **layouts)
        np.testing.assert_array_equal(idx, want_idx)
        assert rel_rms(o, want) <= bar and not np.asarray(o[3]).any()
    head_map = np.asarray([1, 0])
    want = reference.naive_kascade_reuse_decode(
        exact[0][:, 9], *exact[1:], lengths, want_idx, head_map=head_map, pool_size=128
    )
    o = kdax.kascade_reuse_decode(qt, *caches, lengths, want_idx, head_map=head_map, pool_size=128, **layouts)
    assert rel_rms(o, want) <= bar


def test_anchor_decode_in_one_kernel_selects_as_the_definition():
    """The TPU anchor decode that keeps a row's keys in VMEM and selects in the kernel, and the two
    kernels it falls back to for longer rows (``decode_keys_bytes=0``): the selection equals the
    float64 definition's where six pools of one key block tie exactly for four places (the
    smaller ids win), with four pools of a cut row from both key blocks, and none of a row
    shorter than two pools."""
    B, L, H, G, D = 3, 2048, 4, 2, 32
    r = np.random.default_rng(3)
    q = r.standard_normal((B, H, D)) * 1.5
    k, v = r.standard_normal((B, L, G, D)), r.standard_normal((B, L, G, D))
    aligned = lambda b: r.standard_normal((128, G, D)) + q[b].reshape(G, H // G, D).mean(1)  # every head's largest
    k[0, 128:896] = np.tile(aligned(0), (6, 1, 1))  # pools 1..6 of the first key block: equal masses
    k[1, 256:384], k[1, 1536:1664] = aligned(1), aligned(1)  # a selection across both key blocks
    (q, k, v), exact = [jnp.asarray(x, jnp.float32) for x in (q, k, v)], [q, k, v]
    lengths = jnp.asarray([2048, 1900, 129], jnp.int32)
    opts = {"topk_percent": 30, "min_k": 0, "pool_size": 128}
    want_idx, want = reference.naive_kascade_anchor_decode(*exact, lengths, **opts)
    pools = np.asarray(want_idx[:2, :, ::128])
    assert (pools[0] == [128, 256, 384, 512]).all() and ((pools[1] == 256) & (pools[1, :, -1] == 1536)[:, None]).any(
        1
    ).all()
    configs = [pallas_tpu.Config(), pallas_tpu.Config(decode_keys_bytes=0)]
    configs.append(pallas_tpu.Config(block_decode_pools=1024))  # two key blocks, each selected from
    for cfg in configs:
        idx, o = kdax.kascade_anchor_decode(q, k, v, lengths, **opts, backend="pallas_tpu", config=cfg)
        np.testing.assert_array_equal(idx, want_idx)
        assert rel_rms(o, want) <= 1e-5


def test_anchor_decode_over_many_key_blocks():
    """The one-kernel anchor decode's pass over five key blocks of 1024 (the next block's scores
    taken beside the last block's softmax, copies two blocks ahead), rows ending inside the last
    block, inside the second, and on a block boundary: selections equal the float64 definition's."""
    B, L, H, G, D = 3, 4352, 4, 1, 32
    r = np.random.default_rng(5)
    q, k, v = r.standard_normal((B, H, D)) * 2, r.standard_normal((B, L, G, D)), r.standard_normal((B, L, G, D))
    (q, k, v), exact = [jnp.asarray(x, jnp.float32) for x in (q, k, v)], [q, k, v]
    lengths = jnp.asarray([4352, 1500, 3072], jnp.int32)
    opts = {"topk_percent": 10, "min_k": 0, "pool_size": 128}
    want_idx, want = reference.naive_kascade_anchor_decode(*exact, lengths, **opts)
    cfg = pallas_tpu.Config(block_decode_pools=1024)
    idx, o = kdax.kascade_anchor_decode(q, k, v, lengths, **opts, backend="pallas_tpu", config=cfg)
    np.testing.assert_array_equal(idx, want_idx)
    assert rel_rms(o, want) <= 1e-5


# The GQA case where bf16 pooled scores changed the selection: H = 8 over G = 2 at top-k 10%.
BF16_CASES = [
    Case("bf16_gqa_300", B=1, T=300, H=8, G=2, D=32, tile_size=32),
    Case("bf16_lengths", G=1, lengths=(40, 30)),
]


@pytest.mark.parametrize("backend", ["xla", *KERNELS])
@pytest.mark.parametrize("case", CASES + BF16_CASES, ids=str)
def test_bf16_selections_equal_the_definitions(backend, case):
    """bfloat16 inputs: every backend selects the keys the float64 definition selects from the
    same bf16 values (the kernels pool in float32), and the sparse output is within 1e-2."""
    (q, k, v), exact = inputs(case, jnp.bfloat16)
    lengths = _lengths(case)
    opts = {"topk_percent": 10, "min_k": 8, "tile_size": case.tile_size, "pool_size": 1}
    want_idx, want = reference.naive_kascade_anchor(*exact, **opts, lengths=lengths)
    cfg = {"config": KERNELS[backend]} if backend in KERNELS else {}
    idx, o = kdax.kascade_anchor(q, k, v, **opts, lengths=lengths, backend=backend, **cfg)
    assert o.dtype == jnp.bfloat16
    np.testing.assert_array_equal(idx, want_idx)
    assert rel_rms(o, want) <= BF16["out"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_tpu_sparse_gathers_from_vmem_and_by_dma(dtype):
    """The TPU sparse pass gathers selected rows with vector loads from the KV head kept in VMEM
    (``KERNELS``: within ``resident_bytes``) or with a DMA per row from HBM (``resident_bytes=0``):
    both give the definition's output, with padded (-1) selection entries and rows past their length."""
    case = CASES[0]
    (q, k, v), exact = inputs(case, dtype)
    lengths, opts = _lengths(case), dict(OPTIONS, tile_size=case.tile_size)
    idx, _ = reference.naive_kascade_anchor(*exact, **opts, lengths=lengths)
    assert (np.asarray(idx) < 0).any()
    want = reference.naive_kascade_reuse(*exact, idx, tile_size=case.tile_size, pool_size=1, lengths=lengths)
    bar = F32["out"] if dtype == jnp.float32 else BF16["out"]
    for cfg in (KERNELS["pallas_tpu"], dataclasses.replace(KERNELS["pallas_tpu"], resident_bytes=0)):
        o = kdax.kascade_reuse(
            q, k, v, idx, tile_size=case.tile_size, pool_size=1, lengths=lengths, backend="pallas_tpu", config=cfg
        )
        assert rel_rms(o, want) <= bar, cfg


def test_tpu_sparse_block_follows_the_selection_width():
    """The TPU sparse pass's default keys a step: a third of the widest tile's selection, in
    multiples of 128 from 128 to 512 (its docstring)."""
    got = [pallas_tpu.sparse_block(k) for k in (1, 409, 767, 768, 1638, 1 << 20)]
    assert got == [128, 128, 128, 256, 512, 512]


def test_tpu_packed_rows_round_trip():
    """The TPU sparse pass gathers bfloat16 K and V as one uint32 row (k's bits high, v's low) and
    unpacks them in VMEM: every value comes back bit for bit (signed zeros and infinities too)."""
    r = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e30, -1e-30, 3.0e38])
    k, v = (jnp.asarray(np.concatenate([special, r.standard_normal(121) * 10.0]), jnp.bfloat16) for _ in range(2))
    v = v[::-1]
    packed = pallas_tpu._pack_kv(k, v)
    assert packed.dtype == jnp.uint32
    bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))
    for got, want in zip(jax.jit(pallas_tpu._unpack_kv)(packed), (k, v)):
        np.testing.assert_array_equal(bits(got), bits(want))


def test_banded_selection_equals_the_whole_rectangle():
    """The kernels' top-k in bands of tiles (over the keys before each band's last tile) selects
    what one top-k over the whole [NT, T] rectangle does, ties included, for NT not a multiple
    of the bands and rows past their length."""
    plan = bl.Plan(T=600, H=2, G=2, D=16, Rp=1, Dp=16, Tp=608, tile_size=32, scale2=1.0)
    r = np.random.default_rng(1)
    P = jnp.asarray(r.integers(0, 50, (2, 2, plan.NT, plan.Tp)), jnp.float32)  # many ties
    lengths = jnp.asarray([600, 250], jnp.int32)
    budget = {"tenths": 150, "min_k": 8, "k_max": prefill_k_max(plan.T, plan.tile_size, 150, 8)}
    starts = jnp.arange(plan.NT, dtype=jnp.int32) * plan.tile_size
    want = bl.select(P[..., : plan.T], starts, lengths, **budget)
    banded = jax.jit(lambda P, lengths: bl.banded_select(P, lengths, plan, **budget))
    np.testing.assert_array_equal(banded(P, lengths), want)


def test_kernels_are_forward_only_with_a_clear_error():
    case = Case("grad", B=1, T=16)
    (q, k, v), _ = inputs(case, jnp.float32)
    idx = -jnp.ones((1, case.G, 1, 4), jnp.int32)
    loss = lambda q: kdax.kascade_reuse(
        q, k, v, idx, tile_size=16, pool_size=1, backend="pallas_gpu", config=KERNELS["pallas_gpu"]
    ).sum()
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(loss)(q)


def _all_ops(q, k, v, qt, kc, vc, lengths, *, tiles, layout):
    idx, o = kdax.kascade_anchor(q, k, v, **tiles)
    dense = kdax.kascade_anchor(q, k, v, dense_output=True, **tiles)[1]
    reuse = kdax.kascade_reuse(q, k, v, idx, **tiles)
    decode = {"pool_size": tiles["pool_size"], "cache_layout": layout}
    d_idx, d = kdax.kascade_anchor_decode(qt, kc, vc, lengths, **decode)
    return o, dense, reuse, d, kdax.kascade_reuse_decode(qt, kc, vc, lengths, d_idx, **decode)


# per (platform, selection): the kernels the four ops call, and how many calls in all
LOWERED = {
    ("tpu", "tokens"): (("kascade_attend", "kascade_scores", "kascade_decode_scores", "kascade_decode_attend"), 9),
    ("tpu", "pools"): (
        ("kascade_pool_scores", "kascade_pool_attend", "kascade_pool_decode_anchor", "kascade_pool_decode_attend"),
        6,
    ),
    ("cuda", "tokens"): (("kascade_attend", "kascade_scores", "kascade_decode_scores", "kascade_decode_attend"), 9),
    ("cuda", "pools"): (("kascade_attend", "kascade_scores", "kascade_decode_scores", "kascade_decode_attend"), 9),
}


@pytest.mark.parametrize("selection", ["tokens", "pools"])
@pytest.mark.parametrize(
    ("dtype", "D", "G"), [(jnp.bfloat16, 128, 4), (jnp.float32, 64, 1)], ids=["bf16_D128_G4", "fp32_D64_G1"]
)
@pytest.mark.parametrize(("platform", "marker"), [("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton")])
def test_every_kernel_lowers_for_its_platform(platform, marker, dtype, D, G, selection):
    """The four ops with the platform's kernels asked for (on a GPU they are not yet verified, and
    on a TPU "auto" takes them only where they cost less than xla), lowered from this CPU-only
    machine: token selection (tiles of 32), and the defaults (tiles of 128 choosing pools of 128,
    heads-first decode caches on the TPU: its pooled kernels; the GPU's token kernels)."""
    B, T, H, L = 1, 1000, 8, 4096
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    heads_first = platform == "tpu" and selection == "pools"
    cache = (2, G, L, D) if heads_first else (2, L, G, D)
    args = (s(B, T, H, D), s(B, T, G, D), s(B, T, G, D), s(2, H, D), s(*cache), s(*cache))
    args += (jax.ShapeDtypeStruct((2,), jnp.int32),)
    tiles = {"tile_size": 32, "pool_size": 1} if selection == "tokens" else {"tile_size": 128, "pool_size": 128}
    fn = functools.partial(_all_ops, tiles=tiles, layout="BGLD" if heads_first else "BLGD")
    with kdax.use_backend("pallas_gpu" if platform == "cuda" else "pallas_tpu"):
        text = kdax.lower(fn, *args, platform=platform).as_text()
    names, calls = LOWERED[platform, selection]
    assert text.count(marker) == calls and all(n in text for n in names)


@pytest.mark.slow  # compiles every kernel for sm_90a with the triton package: about a minute with float32
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compile_budget(dtype):
    """scripts/gpu_compile_report.py --op kascade --check: all six kernels of the four ops compile,
    each within the spill budget a thread (128 B with bf16 inputs, 512 B with float32), and --check
    passes."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    command = [sys.executable, "scripts/gpu_compile_report.py", "--op", "kascade", "--check", "--dtype", dtype]
    env = {**os.environ, "PYTHONPATH": root}
    run = subprocess.run(command, cwd=root, check=False, capture_output=True, text=True, env=env, timeout=600)
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    spill = {label.strip(): int(cells[3]) for label, *cells in rows}
    assert len(spill) == 6 and {label.split(" (")[0] for label in spill} == set(pallas_gpu.LAUNCH), (
        run.stdout[-2000:] + run.stderr[-2000:]
    )
    assert all(b <= {"bfloat16": 128, "float32": 512}[dtype] for b in spill.values()), spill
    assert run.returncode == 0, run.stdout[-2000:]


def test_auto_differentiates_forward_only_kernels_through_xla(monkeypatch):
    """Where "auto" picks the TPU kernels (forward-only), a derivative is xla's (the same op); asked
    for by name, the kernels refuse one."""
    from kdax.ops.common import dispatch, tpu_costs

    monkeypatch.setattr(tpu_costs, "refuse", lambda *a, **k: None)  # the kernels pay, whatever the table says
    case = CASES[0]
    (q, k, v), _ = inputs(case, jnp.float32)
    lengths, opts = _lengths(case), dict(OPTIONS, tile_size=case.tile_size)
    idx, _ = kdax.kascade_anchor(q, k, v, **opts, lengths=lengths, backend="xla")
    loss = lambda backend: (
        lambda q, k, v: jnp.sum(
            kdax.kascade_reuse(q, k, v, idx, tile_size=case.tile_size, pool_size=1, lengths=lengths, backend=backend)
            ** 2
        )
    )
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    with dispatch.building_for("tpu"):
        assert kdax.explain_backend(jnp.float32, op="kascade_reuse")[0] == "pallas_tpu"
        got = jax.grad(loss("auto"), argnums=(0, 1, 2))(q, k, v)
        with pytest.raises(NotImplementedError, match="forward-only"):
            jax.grad(loss("pallas_tpu"), argnums=(0, 1, 2))(q, k, v)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
