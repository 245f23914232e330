"""The TPU kernel: one program per work item (:mod:`kdax.ops.mla.items`), its request's pages
copied from HBM into VMEM a key block at a time, two blocks in flight (docs/mla_paged.md).

Grid (W,), sequential: items of one query block are consecutive and share its output block,
which stays in VMEM between them; the block's first item writes zeros to the rows no item of it
owns (padding). Blocks: the query block [H * block_q, W] and the output block [H * block_q, W]
float32 (rows heads-major, :func:`kdax.ops.mla.items.to_blocks`); scratch: two key blocks
[block_k, W] in the pages' dtype and their DMA semaphores. A key block is ``block_k / page``
copies of one page each, addressed by the request's page table (in SMEM with the items). Scores
and the softmax in float32, the products on the MXU in the pages' dtype (float32 at HIGHEST).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kdax.ops.common import dispatch
from kdax.ops.common.arrays import LOG2E
from kdax.ops.common.capabilities import Capabilities
from kdax.ops.kascade import blocks as bl
from kdax.ops.mla.items import from_blocks, query_block, to_blocks, work_items


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the TPU kernel.

    Attributes:
        block_keys: the keys a step reads (rounded down to whole pages, at least one page).
        block_queries: the tokens of a query block (a power of two >= 8), or None: by the step's
            tokens a request (:func:`kdax.ops.mla.items.query_block`).
        interpret: run in the Pallas TPU interpreter (None: off a TPU).
    """

    block_keys: int = 512
    block_queries: int | None = None
    interpret: bool | None = None

    def resolved(self) -> Config:
        """This config, checked, with ``interpret`` None replaced by what it means here."""
        if self.block_keys < 1:
            raise ValueError(f"config.block_keys: expected a positive int, got {self.block_keys}")
        n = self.block_queries
        if n is not None and (n < 8 or n & (n - 1)):
            raise ValueError(f"config.block_queries: expected None or a power of two >= 8, got {n}")
        interpret = dispatch.platform() != "tpu" if self.interpret is None else self.interpret
        return dataclasses.replace(self, interpret=interpret)


def _kernel(
    block_ref, request_ref, first_ref, lo_ref, hi_ref, offset_ref, steps_ref, table_ref,
    q_ref, pages_hbm, o_ref, buf, sems, *, block_q, page, per, M, scale2, prec,
):  # fmt: skip
    """One item: its rows of q [rows, W] over its request's keys, folded into o [rows, W]."""
    w = pl.program_id(0)
    r, n = jnp.maximum(request_ref[w], 0), steps_ref[w]
    rows, bk = q_ref.shape[0], per * page
    tok = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (block_q - 1)
    member = (tok >= lo_ref[w]) & (tok < hi_ref[w])
    pos = tok + offset_ref[w]

    def copies(b, slot):
        for i in range(per):
            page_id = jnp.maximum(table_ref[r * M + jnp.minimum(b * per + i, M - 1)], 0)
            yield pltpu.make_async_copy(pages_hbm.at[page_id], buf.at[slot, pl.ds(i * page, page)], sems.at[slot])

    @pl.when(n > 0)
    def _():
        for c in copies(0, 0):
            c.start()

    q = q_ref[...]

    def step(b, state):
        slot = b % 2

        @pl.when(b + 1 < n)
        def _():
            for c in copies(b + 1, 1 - slot):
                c.start()

        for c in copies(b, slot):
            c.wait()
        kv = buf[slot]
        key = b * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        s2 = jnp.where(member & (key <= pos), bl.dot_nt(q, kv, prec) * scale2, -jnp.inf)
        return bl.softmax_step(state, s2, kv, prec)

    o, _ = bl.finish_softmax(lax.fori_loop(0, n, step, bl.start_softmax(rows, q.shape[1])))
    before = jnp.where(first_ref[w] == 1, 0.0, o_ref[...])
    o_ref[...] = jnp.where(member, o, before)


def paged_latent_attention_tpu(q, pages, page_table, query_start_loc, seq_lens, *, scale, cfg: Config):
    """:func:`kdax.ops.mla.api.paged_latent_attention` on the TPU kernel."""
    T, H, Wd = q.shape
    R, M = page_table.shape
    page = pages.shape[1]
    per = max(1, cfg.block_keys // page)
    block_q = cfg.block_queries or query_block(T, R, H)
    it = work_items(query_start_loc, seq_lens, T, block_q, per * page)
    qb = to_blocks(q.astype(pages.dtype), block_q)
    nb, rows, _ = qb.shape
    qb = qb.reshape(nb * rows, Wd)
    kernel = functools.partial(
        _kernel, block_q=block_q, page=page, per=per, M=M, scale2=scale * LOG2E, prec=bl.precision(pages.dtype)
    )
    at_block = lambda w, block, *_: (block[w], 0)
    with jax.enable_x64(False):
        o = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=8,
                grid=(it.block.shape[0],),
                in_specs=[pl.BlockSpec((rows, Wd), at_block), pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((rows, Wd), at_block),
                scratch_shapes=[pltpu.VMEM((2, per * page, Wd), pages.dtype), pltpu.SemaphoreType.DMA((2,))],
            ),
            out_shape=jax.ShapeDtypeStruct((nb * rows, Wd), jnp.float32),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=48 << 20),
            name="mla_paged_attention",
            interpret=pltpu.InterpretParams() if cfg.interpret else False,
        )(*it, page_table.reshape(-1).astype(jnp.int32), qb, pages)
    return from_blocks(o.reshape(nb, rows, Wd), T, H)


CAPABILITIES = Capabilities("pallas_tpu", config=Config, cores={"paged_latent_attention": paged_latent_attention_tpu})
