"""Run by test_vllm_step.py on 2 fake CPU devices: the engine step with the weights split over the
heads and the ops run per shard (``heads``), against the step on one device; prints JSON."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kdax.integrations.vllm_tpu.step import StateSlots, StepBatch, forward, init_caches
from kdax.models import from_pretrained
from kdax.models.kda import is_kda
from kdax.models.sharding import tensor_parallel_specs


def main(checkpoint: str) -> None:
    model = from_pretrained(checkpoint, backend="xla")
    rng = np.random.default_rng(0)
    caches = [
        tuple(jnp.asarray(rng.normal(size=c.shape) * 0.5, c.dtype) if c.dtype != jnp.int32 else c for c in cache)
        if isinstance(cache, tuple)
        else jnp.asarray(rng.normal(size=cache.shape), cache.dtype)
        for cache in init_caches(model, 8, 16, 4)
    ]
    # a decode row at position 9, a chunk of 9 tokens from 0, a verify row of 2 at positions 6 and 7, padding
    qsl = np.array([0, 1, 10, 12], np.int32)
    seq = np.array([10, 9, 8], np.int32)
    pos = np.concatenate([[9], np.arange(9), [6, 7], [0] * 4]).astype(np.int32)
    tables = np.array([[0, 1, 2, -1], [3, 4, 5, -1], [6, 7, -1, -1]], np.int32)
    slots = StateSlots(jnp.asarray([1, 3, 5], jnp.int32))
    layers = tuple(slots if is_kda(b) else jnp.asarray(tables) for b in model.model.layers)
    tokens = jnp.asarray(rng.integers(3, 128, 16), jnp.int32)
    batch = StepBatch(tokens, jnp.asarray(pos), jnp.asarray(qsl), jnp.asarray(seq), layers)
    one = jax.jit(lambda c, b: forward(model, c, b, num_spec=1))(caches, batch)
    mesh = Mesh(jax.devices()[:2], ("model",))
    specs = tensor_parallel_specs(model, 2, "model")
    state = nnx.state(model)
    for path, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, specs.get(tuple(path), P()))))
    nnx.update(model, state)
    split = sum(any(s) for s in specs.values())
    step = lambda c, b: forward(model, c, b, num_spec=1, heads=(mesh, "model"))
    jaxpr = str(jax.make_jaxpr(step)(caches, batch))
    two = jax.jit(step)(caches, batch)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))
    errs = [rel(a, np.asarray(b, np.float64)) for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(one))]
    print(json.dumps({"split": split, "shard_maps": jaxpr.count("shard_map"), "max_rel": max(errs)}))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1])
