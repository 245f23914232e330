"""Run by test_vllm_step.py on 4 fake CPU devices: the engine step split as the engine splits it,
against the step on one device; prints JSON, a result per case:

- "heads": 2 devices, the weights split over the heads and the ops run per shard.
- "groups": 2 data-parallel attention groups of 2 devices, the heads split within a group (the
  attention weights also over the groups, gathered where used) and the MLPs over all 4: two
  groups' batches side by side, each group's pages and slots on its own devices, against each
  group's batch alone.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kdax.integrations.vllm_tpu.step import StateSlots, StepBatch, StepMesh, forward, init_caches
from kdax.models import from_pretrained
from kdax.models.kda import is_kda
from kdax.models.sharding import tensor_parallel_specs


def _caches(model, rng):
    return [
        tuple(jnp.asarray(rng.normal(size=c.shape) * 0.5, c.dtype) if c.dtype != jnp.int32 else c for c in cache)
        if isinstance(cache, tuple)
        else jnp.asarray(rng.normal(size=cache.shape), cache.dtype)
        for cache in init_caches(model, 8, 16, 4)
    ]


def _batch(model, rng, qsl, seq, pos, tables, slots):
    layers = tuple(
        StateSlots(jnp.asarray(slots, jnp.int32)) if is_kda(b) else jnp.asarray(tables, jnp.int32)
        for b in model.model.layers
    )
    tokens = jnp.asarray(rng.integers(3, 128, 16), jnp.int32)
    return StepBatch(
        tokens, jnp.asarray(pos, jnp.int32), jnp.asarray(qsl, jnp.int32), jnp.asarray(seq, jnp.int32), layers
    )


def _place(model, specs, mesh):
    state = nnx.state(model)
    for path, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, specs.get(tuple(path), P()))))
    nnx.update(model, state)
    return sum(any(s) for s in specs.values())


def compare(checkpoint: str, case: str) -> dict:
    """{"split": parameters split, "shard_maps": in the step's jaxpr, "max_rel": the largest relative
    error of hidden states and caches against one device}."""
    model = from_pretrained(checkpoint, backend="xla")
    rng = np.random.default_rng(0)
    # a decode row at position 9, a chunk of 9 tokens from 0, a verify row of 2 at positions 6 and 7, padding
    first = _batch(
        model,
        rng,
        [0, 1, 10, 12],
        [10, 9, 8],
        np.r_[9, np.arange(9), 6, 7, [0] * 4],
        [[0, 1, 2, -1], [3, 4, 5, -1], [6, 7, -1, -1]],
        [1, 3, 5],
    )
    caches = _caches(model, rng)
    run = lambda mesh: jax.jit(lambda c, b: forward(model, c, b, num_spec=1, mesh=mesh))
    if case == "heads":
        one = run(None)(caches, first)
        mesh = Mesh(jax.devices()[:2], ("model",))
        split = _place(model, tensor_parallel_specs(model, 2, "model"), mesh)
        step = StepMesh(mesh, heads="model", experts="model")
    else:
        # a chunk of 5 tokens after 3, a decode row at position 12, a padding request
        second = _batch(
            model,
            rng,
            [0, 5, 6, 6],
            [8, 13, 0],
            np.r_[np.arange(3, 8), 12, [0] * 10],
            [[2, 5, -1, -1], [0, 1, 3, 4], [-1] * 4],
            [2, 6, 0],
        )
        more = _caches(model, rng)
        alone = [run(None)(caches, first), run(None)(more, second)]
        one = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *alone)
        caches = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), caches, more)
        first = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, second)
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("attn_dp", "model"))  # Auto axes, as the engine's
        specs = tensor_parallel_specs(model, 4, ("attn_dp", "model"), attention=(2, "model"), gather=(2, "attn_dp"))
        split = _place(model, specs, mesh)
        step = StepMesh(mesh, heads="model", experts=("attn_dp", "model"), groups="attn_dp")
        caches = jax.device_put(caches, NamedSharding(mesh, P("attn_dp")))
    jaxpr = str(jax.make_jaxpr(lambda c, b: forward(model, c, b, num_spec=1, mesh=step))(caches, first))
    two = run(step)(caches, first)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))
    errs = [rel(a, np.asarray(b, np.float64)) for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(one))]
    return {"split": split, "shard_maps": jaxpr.count("shard_map"), "max_rel": max(errs)}


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(json.dumps({case: compare(sys.argv[1], case) for case in ("heads", "groups")}))
