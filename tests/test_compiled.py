"""The public ops and the model's forward compile once per shape and static option, so eager
calls cost what jitted ones do (``kdax bench eager`` times them)."""

import jax
import jax.numpy as jnp
from flax import nnx

import kdax
from kdax.bench.kda import make_inputs
from kdax.models import KDAConfig, KDAForCausalLM, kda
from kdax.ops.kda import api
from tests.tolerances import F32


def test_ops_compile_once_per_shape_and_option():
    args = make_inputs(1, 40, 2, 16, 16, jnp.float32)
    api._compiled.clear_cache()
    o, _ = kdax.chunk_kda(*args)
    assert api._compiled._cache_size() == 1
    o_again, _ = kdax.chunk_kda(*args)
    kdax.fused_recurrent_kda(*args)
    kdax.fused_recurrent_kda(*args)
    assert api._compiled._cache_size() == 2  # one more for the recurrent op, none for the repeats
    kdax.chunk_kda(*args, chunk_size=32)
    kdax.chunk_kda(*[a[:, :20] for a in args])
    assert api._compiled._cache_size() == 4  # a static option and a shape: one compilation each
    assert (o_again == o).all()


def test_model_forward_compiles_once_and_matches_nnx_jit():
    config = KDAConfig(
        hidden_size=32,
        head_dim=16,
        num_heads=2,
        num_hidden_layers=2,
        vocab_size=64,
        attn={"layers": [1], "num_heads": 2},
    )
    model = KDAForCausalLM(config, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(0), (2, 24), 0, 64, jnp.int32)
    kda._forward.clear_cache()
    logits = model(ids)
    model(ids)
    assert kda._forward._cache_size() == 1
    jitted = nnx.jit(lambda m, x: m(x))(model, ids)
    assert jnp.allclose(jitted, logits, atol=F32["same"], rtol=F32["same"])
    grads = nnx.grad(lambda m: jnp.mean(m(ids) ** 2))(model)  # differentiable through the compiled forward
    leaves = jax.tree.leaves(nnx.state(grads))
    assert all(jnp.isfinite(x).all() for x in leaves) and all(jnp.abs(x).max() > 0 for x in leaves)
