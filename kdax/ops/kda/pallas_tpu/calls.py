"""The pallas_tpu backend's block specs and pallas_calls: the forward (fused or staged) and the
backward, on head-major padded inputs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.kda.pallas_tpu.config import (
    LOCKSTEP,
    Config,
    heads_per_step,
    interpret_params,
    scaled,
    tiles_for,
    vmem_limit,
)
from kdax.ops.kda.pallas_tpu.kernels import (
    BY_V,
    OPERANDS,
    STAGED,
    bwd_kernel,
    fused_kernel,
    intra_kernel,
    output_kernel,
    state_kernel,
)


def _field(name: str, C: int, Kp: int, Vp: int) -> tuple[int, int]:
    """(rows per chunk, width) of the head-major array [B, HV, NC * rows, width] of a field of the
    intra stage, or of v_new."""
    rows = 8 if name == "decay" else C
    return rows, C if name in ("Aqk", "Kkk", "T") else Vp if name in BY_V else Kp


def _qk_spec(n: int, groups: int, C: int, Kp: int, where):
    """The q or k block of a step of n value heads: n / groups q/k heads when groups divides n, else
    the one q/k head all n share (n divides groups). where: grid indices -> (b, head block, chunk)."""

    def index(*grid):
        b, h, c = where(*grid)
        return (b, h, c, 0) if n % groups == 0 else (b, lax.div(h * n, jnp.int32(groups)), c, 0)

    return pl.BlockSpec((1, max(n // groups, 1), C, Kp), index)


def _beta_spec(HV: int, C: int, where):
    """A [1, 1, C, HV] block of beta, [B, 1, L, HV] (every step reads all heads' betas, the tokens'
    row as it comes), or of dbeta, [B, HV / n, L, HV] (a step writes its heads' columns, zeros
    elsewhere; summed over axis 1 in XLA). A block of n columns would need a transpose in XLA
    to [B, HV / n, L, n], a copy for float32 whose loops the compile report cannot bound.
    where: grid indices -> (b, block, chunk)."""

    def index(*grid):
        b, h, c = where(*grid)
        return (b, h, c, 0)

    return pl.BlockSpec((1, 1, C, HV), index)


def _tokens(C: int, width: int, n: int, where):
    """A token-major block [1, C, n * width] of chunk c; where: grid indices -> (b, lane block, chunk)."""

    def index(*grid):
        b, h, c = where(*grid)
        return (b, c, h)

    return pl.BlockSpec((1, C, n * width), index)


@dataclasses.dataclass(frozen=True)
class _Forward:
    """What both forward pipelines share: the sizes, the block specs on the grid (b, h, v-block, c)
    with the schedule (first, last, seq) prefetched, and the outputs' shapes."""

    B: int
    HV: int
    L: int  # padded slots
    NC: int
    Kp: int
    Vp: int
    BV: int
    groups: int  # value heads per q/k head
    cfg: Config  # resolved: cfg.heads the value heads a grid step takes
    o_dtype: jnp.dtype  # o's, the caller's (the op's output is cast to it)

    @property
    def C(self) -> int:
        return self.L // self.NC

    @property
    def interpret(self):
        return interpret_params(self.cfg)

    @property
    def n(self) -> int:  # value heads a grid step
        return self.cfg.heads

    def spec(self, width):  # a [n, C, width] block of chunk c, all columns
        return pl.BlockSpec((1, self.n, self.C, width), lambda b, h, vb, c, *_: (b, h, c, 0))

    def beta(self):  # every head's beta [C, HV] of chunk c (:func:`_beta_spec`)
        return _beta_spec(self.HV, self.C, lambda b, h, vb, c, *_: (b, 0, c))

    def v_block(self):  # a [n, C, BV] block of chunk c, value columns of V-block vb
        return pl.BlockSpec((1, self.n, self.C, self.BV), lambda b, h, vb, c, *_: (b, h, c, vb))

    def o(self):  # the token-major o block [C, n BV]: V-block vb (one head a step where BV < Vp)
        blocks = self.Vp // self.BV
        return _tokens(self.C, self.BV, self.n, lambda b, h, vb, c, *_: (b, h * blocks + vb, c))

    def qk(self):  # q and k: the q/k heads of the step's value heads
        return _qk_spec(self.n, self.groups, self.C, self.Kp, lambda b, h, vb, c, *_: (b, h, c))

    def state(self):  # a sequence's state [n, BV, Kp] (initial or final), the schedule naming the sequence
        return pl.BlockSpec(
            (1, 1, self.n, self.BV, self.Kp), lambda b, h, vb, c, first, last, seq: (b, seq[c], h, vb, 0)
        )

    def s_in(self):  # the state entering chunk c
        return pl.BlockSpec((1, self.n, 1, self.BV, self.Kp), lambda b, h, vb, c, *_: (b, h, c, vb, 0))

    def shape(self, name: str, chunks: int | None = None):
        """An output's ShapeDtypeStruct: "o", "s_in" or a field (of NC chunks, or ``chunks``)."""
        f32 = jnp.float32
        if name == "o":
            return jax.ShapeDtypeStruct((self.B, self.L, self.HV * self.Vp), self.o_dtype)
        if name == "s_in":
            return jax.ShapeDtypeStruct((self.B, self.HV, self.NC, self.Vp, self.Kp), f32)
        rows, width = _field(name, self.C, self.Kp, self.Vp)
        dtype = (tiles_for(self.cfg).operands or f32) if name in OPERANDS else f32
        return jax.ShapeDtypeStruct((self.B, self.HV, (chunks or self.NC) * rows, width), dtype)

    def sequential(self):
        return pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit()
        )


def forward(q, k, v, g, beta, h0t, sched, groups: int, cfg: Config, save_states: bool, keep: tuple[str, ...], o_dtype):
    """Head-major padded inputs: q, k [B, H, L, Kp]; v [B, HV, L, Vp]; g [B, HV, L, Kp] (natural log);
    beta [B, 1, L, HV] (:func:`_beta_spec`); h0t [B, N, HV, Vp, Kp]; sched (first, last, seq) int32 [NC].
    Returns o [B, L, HV Vp] (token-major, in o_dtype), final [B, N, HV, Vp, Kp], S_in [B, HV, NC, Vp, Kp] or None, and
    {name: field} of the fields named in ``keep`` (:func:`_field`; SAVED, KEPT or none)."""
    B, HV, L, Vp = v.shape
    Kp = k.shape[-1]
    kernel = "keeping" if "w" in keep else "saving" if save_states or keep else "forward"
    n = 1 if cfg.block_v < Vp else heads_per_step(HV, groups, L // sched[0].shape[0], Kp, Vp, cfg, kernel, B)
    fw = _Forward(B, HV, L, sched[0].shape[0], Kp, Vp, cfg.block_v, groups, dataclasses.replace(cfg, heads=n), o_dtype)
    run = _fused if cfg.pipeline == "fused" else _staged
    return run(fw, q, k, v, g, beta, h0t, sched, save_states, keep)


def _fused(fw: _Forward, q, k, v, g, beta, h0t, sched, save_states, keep):
    """One kernel per (batch, head, V-block) walking the chunks, everything on chip."""

    # The fields of value columns by V-block; the others are written by V-block 0, the later V-blocks
    # writing theirs to a spare chunk past the last (so that no block is visited twice).
    spare = fw.Vp > fw.BV

    def kept_spec(name):
        rows, width = _field(name, fw.C, fw.Kp, fw.Vp)
        if name in BY_V:
            return pl.BlockSpec((1, fw.n, rows, fw.BV), lambda b, h, vb, c, *_: (b, h, c, vb))
        return pl.BlockSpec((1, fw.n, rows, width), lambda b, h, vb, c, *_: (b, h, jnp.where(vb == 0, c, fw.NC), 0))

    def kept_shape(name):
        return fw.shape(name, None if name in BY_V else fw.NC + spare)

    fin_shape = jax.ShapeDtypeStruct(h0t.shape, jnp.float32)
    v_spec = fw.v_block()
    outs = pl.pallas_call(
        functools.partial(fused_kernel, tiles_for(fw.cfg), save_states, keep),
        name="kda_fused",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(fw.B, fw.HV // fw.n, fw.Vp // fw.BV, fw.NC),
            in_specs=[fw.qk(), fw.qk(), v_spec, fw.spec(fw.Kp), fw.beta(), fw.state()],
            out_specs=[fw.o(), fw.state()] + [fw.s_in()] * save_states + [kept_spec(n) for n in keep],
            scratch_shapes=[pltpu.VMEM((fw.n, fw.BV, fw.Kp), jnp.float32)],
        ),
        out_shape=[fw.shape("o"), fin_shape] + [fw.shape("s_in")] * save_states + [kept_shape(n) for n in keep],
        compiler_params=fw.sequential(),
        interpret=fw.interpret,
    )(*sched, q, k, v, g, beta, h0t)
    return outs[0], outs[1], (outs[2] if save_states else None), dict(zip(keep, outs[2 + save_states :]))


def _staged(fw: _Forward, q, k, v, g, beta, h0t, sched, save_states, keep):
    """Intra (parallel over chunks) -> state (sequential over chunks) -> output (parallel), through HBM."""
    B, HV, NC, C, Kp, Vp, BV, n = fw.B, fw.HV, fw.NC, fw.C, fw.Kp, fw.Vp, fw.BV, fw.n
    spec3 = lambda d: pl.BlockSpec((1, n, C, d), lambda b, h, c: (b, h, c, 0))

    def chunk_spec(name):  # a field's block of one chunk on grid (b, h, c)
        rows, width = _field(name, C, Kp, Vp)
        return pl.BlockSpec((1, n, rows, width), lambda b, h, c: (b, h, c, 0))

    names = STAGED + tuple(n for n in keep if n not in STAGED and n != "v_new")
    staged = pl.pallas_call(
        functools.partial(intra_kernel, tiles_for(fw.cfg), names),
        name="kda_intra",
        grid=(B, HV // n, NC),
        in_specs=[_qk_spec(n, fw.groups, C, Kp, lambda b, h, c: (b, h, c))] * 2
        + [spec3(Vp), spec3(Kp), _beta_spec(HV, C, lambda b, h, c: (b, 0, c))],
        out_specs=[chunk_spec(n) for n in names],
        out_shape=[fw.shape(n) for n in names],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3, vmem_limit_bytes=vmem_limit()),
        interpret=fw.interpret,
    )(q, k, v, g, beta)
    f = dict(zip(names, staged))
    dec_spec = pl.BlockSpec((1, n, 8, Kp), lambda b, h, vb, c, *_: (b, h, c, 0))
    v_spec, k_spec = fw.v_block(), fw.spec(Kp)
    v_new, s_in, final = pl.pallas_call(
        functools.partial(state_kernel, tiles_for(fw.cfg)),
        name="kda_state",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, HV // n, Vp // BV, NC),
            in_specs=[k_spec, v_spec, k_spec, dec_spec, fw.state()],
            out_specs=[v_spec, fw.s_in(), fw.state()],
            scratch_shapes=[pltpu.VMEM((n, BV, Kp), jnp.float32)],
        ),
        out_shape=[fw.shape("v_new"), fw.shape("s_in"), jax.ShapeDtypeStruct(h0t.shape, jnp.float32)],
        compiler_params=fw.sequential(),
        interpret=fw.interpret,
    )(*sched, f["w"], f["u"], f["k_d"], f["decay"], h0t)
    o = pl.pallas_call(
        functools.partial(output_kernel, tiles_for(fw.cfg)),
        name="kda_output",
        grid=(B, HV // n, NC, Vp // BV),
        in_specs=[
            pl.BlockSpec((1, n, C, C), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((1, n, C, Kp), lambda b, h, c, vb: (b, h, c, 0)),
            pl.BlockSpec((1, n, C, BV), lambda b, h, c, vb: (b, h, c, vb)),
            pl.BlockSpec((1, n, 1, BV, Kp), lambda b, h, c, vb: (b, h, c, vb, 0)),
        ],
        out_specs=_tokens(C, BV, n, lambda b, h, c, vb: (b, h * (Vp // BV) + vb, c)),
        out_shape=fw.shape("o"),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 4, vmem_limit_bytes=vmem_limit()),
        interpret=fw.interpret,
    )(f["Aqk"], f["q_g"], v_new, s_in)
    kept = {**f, "v_new": v_new}
    return o, final, (s_in if save_states else None), {n: kept[n] for n in keep}


def backward(q, k, v, g, beta, sched, S_in, kept, do, dfinal_t, dS_in, groups: int, cfg: Config, dv_dtype):
    """Cotangents of the padded inputs of :func:`_forward`, token-major ([B, L, heads, D]; dq, dk
    summed over each group's value heads; dv in dv_dtype, the others float32), dbeta [B, 1, L, HV].
    kept: {name: field} of the forward's (:func:`_forward`); do: [B, L, HV Vp]; dfinal_t:
    [B, N, HV, Vp, Kp]; dS_in: cotangent of S_in or None."""
    B, HV, L, Vp = v.shape
    H, Kp = k.shape[1], k.shape[-1]
    NC = sched[0].shape[0]
    C = L // NC
    n = heads_per_step(HV, groups, C, Kp, Vp, cfg, "reading" if "w" in kept else "backward", B)
    lockstep = scaled(LOCKSTEP[cfg.precision], C, Kp, Vp)
    f32 = jnp.float32

    def spec(d, rows=C):
        return pl.BlockSpec((1, n, rows, d), lambda b, h, c, *_: (b, h, NC - 1 - c, 0))

    tok = lambda d: _tokens(C, d, n, lambda b, h, c, *_: (b, h, NC - 1 - c))
    beta_in = _beta_spec(HV, C, lambda b, h, c, *_: (b, 0, NC - 1 - c))
    dbeta_out = _beta_spec(HV, C, lambda b, h, c, *_: (b, h, NC - 1 - c))

    qk = _qk_spec(n, groups, C, Kp, lambda b, h, c, *_: (b, h, NC - 1 - c))
    st = pl.BlockSpec((1, 1, n, Vp, Kp), lambda b, h, c, first, last, seq: (b, seq[NC - 1 - c], h, 0, 0))
    sin = pl.BlockSpec((1, n, 1, Vp, Kp), lambda b, h, c, *_: (b, h, NC - 1 - c, 0, 0))
    fields = [spec(w, rows=r) for r, w in (_field(n, C, Kp, Vp) for n in kept)]
    dh = [] if dS_in is None else [dS_in]
    dq, dk, dv, dg, dbeta, dh0t = pl.pallas_call(
        functools.partial(bwd_kernel, tiles_for(cfg), lockstep, dS_in is not None, tuple(kept)),
        name="kda_backward",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, HV // n, NC),
            in_specs=[qk, qk, spec(Vp), spec(Kp), beta_in, sin, tok(Vp), st] + [sin] * len(dh) + fields,
            out_specs=[tok(Kp), tok(Kp), tok(Vp), tok(Kp), dbeta_out, st],
            scratch_shapes=[pltpu.VMEM((n, Vp, Kp), f32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, L, HV * d), t) for d, t in ((Kp, f32), (Kp, f32), (Vp, dv_dtype), (Kp, f32))
        ]
        + [jax.ShapeDtypeStruct((B, HV // n, L, HV), f32), jax.ShapeDtypeStruct(dfinal_t.shape, f32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit()
        ),
        interpret=interpret_params(cfg),
    )(*sched, q, k, v, g, beta, S_in, do, dfinal_t, *dh, *kept.values())
    dq, dk = (x.reshape(B, L, H, groups, Kp).sum(3) for x in (dq, dk))
    dv, dg = dv.reshape(B, L, HV, Vp), dg.reshape(B, L, HV, Kp)
    return dq, dk, dv, dg, dbeta.sum(1, keepdims=True), dh0t
