"""Run on 8 fake CPU devices by tests/multidevice/test_mesh.py (XLA_FLAGS set there): context-parallel
chunk_kda against one device, the ops on batch- and head-sharded arrays, and the tiny model trained on a
mesh, printed as one JSON object."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kdax
from kdax import train
from kdax.bench.measure import rel_rms
from kdax.models import KDAForCausalLM, sharding, tiny_config

C = 16  # chunk size: 2 chunks a device at T = 256
MESH = jax.make_mesh((8,), ("context",))
CP = kdax.ContextParallel("context", MESH)


def inputs(B, T, N=None, H=2, HV=4, K=16, V=24, seed=0):
    """GVA (HV = 2H), K != V; strong decay in places; an initial state per sequence."""
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    q, k = f(B, T, H, K), f(B, T, H, K) / 4
    v, g, beta = f(B, T, HV, V), -jnp.abs(f(B, T, HV, K)) * 0.3, jax.nn.sigmoid(f(B, T, HV))
    g = g.at[:, T // 3 : T // 3 + 5].add(-30.0)  # decay of 30 per token for 5 tokens
    return q, k, v, g, beta, f(N or B, HV, K, V)


def compare(args, **kw):
    """rel. RMS of (o, final, dq, dk, dv, dg, dbeta, dh0): context parallel (mesh form) vs one device."""

    def loss(q, k, v, g, b, h0, cp):
        o, fin = kdax.chunk_kda(
            q, k, v, g, b, initial_state=h0, output_final_state=True, chunk_size=C, context_parallel=cp, **kw
        )
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(fin)), (o, fin)

    grad = jax.value_and_grad(loss, argnums=range(6), has_aux=True)
    (_, want), dwant = jax.jit(grad, static_argnums=6)(*args, None)
    (_, got), dgot = jax.jit(grad, static_argnums=6)(*args, CP)
    return [rel_rms(a, b) for a, b in zip((*got, *dgot), (*want, *dwant))]


def in_shard_map():
    """The form without a mesh, inside the caller's shard_map: dense rows with states [V, K] and the
    intermediate states, then packed sequences. rel. RMS of (o, final, h), then (o, final)."""
    time = P(None, "context")
    out = []
    for B, cu, more in ((2, None, {"return_intermediate_states": True}), (1, np.array([0, 40, 41, 256]), {})):
        q, k, v, g, beta, h0 = inputs(B, 256, N=None if cu is None else 3, seed=3)
        opts = dict(
            initial_state=jnp.swapaxes(h0, -1, -2),
            output_final_state=True,
            chunk_size=C,
            cu_seqlens=cu,
            state_v_first=True,
            **more,
        )
        want = kdax.chunk_kda(q, k, v, g, beta, **opts)
        local = lambda *a, opts=opts: kdax.chunk_kda(*a, **opts, context_parallel=kdax.ContextParallel("context"))
        specs = (time, P(), time)[: len(want)]
        args = (jax.device_put(x, NamedSharding(MESH, time)) for x in (q, k, v, g, beta))  # the caller's layout
        got = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=(time,) * 5, out_specs=specs, check_vma=False))(*args)
        out += [rel_rms(a, b) for a, b in zip(got, want)]
    return out


def gathered_bytes(T):
    """The bytes of every all-gather in the compiled context-parallel forward at length T."""
    q, k, v, g, beta, _ = inputs(1, T)
    f = jax.jit(lambda *a: kdax.chunk_kda(*a, output_final_state=True, chunk_size=C, context_parallel=CP))
    text = f.lower(q, k, v, g, beta).compile().as_text()
    sizes = []
    for shape in re.findall(r"= (\w+)\[([\d,]*)\][^=]*? all-gather", text):
        sizes.append(
            int(np.prod([int(d) for d in shape[1].split(",") if d])) * np.dtype(shape[0].replace("f", "float")).itemsize
        )
    return sorted(sizes)


def messages(cases):
    """{name: the ValueError that calling the case raised, or 'no error'}."""
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def errors():
    """Each bad input's ValueError message (or 'no error')."""
    q, k, v, g, beta, _ = inputs(2, 256)
    cases = {
        "axis": lambda: kdax.chunk_kda(q, k, v, g, beta, context_parallel=kdax.ContextParallel("seq", MESH)),
        "cu_seqlens_B2": lambda: kdax.chunk_kda(
            q, k, v, g, beta, cu_seqlens=np.array([0, 100, 256]), context_parallel=CP
        ),
        "local_T": lambda: jax.shard_map(
            lambda *a: kdax.chunk_kda(*a, chunk_size=C, context_parallel=kdax.ContextParallel("context"))[0],
            mesh=MESH,
            in_specs=(P(None, "context"),) * 5,
            out_specs=P(None, "context"),
            check_vma=False,
        )(*(jax.device_put(x[:, :200], NamedSharding(MESH, P(None, "context"))) for x in (q, k, v, g, beta))),
    }
    return messages(cases)


def sharded_ops():
    """Each op on inputs sharded over batch (data) and heads (model) of a 2 x 4 mesh: the collectives in
    its compiled HLO and its worst rel. RMS difference from the same op on unsharded inputs."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    q, k, v, g, beta, _ = inputs(4, 64, H=4, HV=8)
    bth, bt = P("data", None, "model", None), P("data", None, "model")
    qa, ka, va = (jnp.asarray(np.random.default_rng(5).standard_normal((4, 64, h, 16)), jnp.float32) for h in (8, 4, 4))
    idx, _ = kdax.kascade_anchor(qa, ka, va, min_k=8, tile_size=16)
    didx, _ = kdax.kascade_anchor_decode(qa[:, 0], ka, va, jnp.full((4,), 64), min_k=8)
    n = jnp.asarray([64, 1, 30, 0], jnp.int32)
    cases = {
        "chunk_kda": (
            lambda *a: kdax.chunk_kda(*a, output_final_state=True, chunk_size=C),
            (q, k, v, g, beta),
            (bth,) * 4 + (bt,),
        ),
        "chunk_kda_grad": (
            jax.grad(lambda *a: jnp.sum(kdax.chunk_kda(*a, chunk_size=C)[0] ** 2), argnums=(0, 1, 2, 3, 4)),
            (q, k, v, g, beta),
            (bth,) * 4 + (bt,),
        ),
        "fused_recurrent_kda": (
            lambda *a: kdax.fused_recurrent_kda(*a, output_final_state=True),
            (q, k, v, g, beta),
            (bth,) * 4 + (bt,),
        ),
        "kascade_anchor": (lambda *a: kdax.kascade_anchor(*a, min_k=8, tile_size=16), (qa, ka, va), (bth,) * 3),
        "kascade_reuse": (
            lambda *a: kdax.kascade_reuse(*a, tile_size=16),
            (qa, ka, va, idx),
            (bth,) * 3 + (P("data", "model"),),
        ),
        "kascade_anchor_decode": (
            lambda *a: kdax.kascade_anchor_decode(*a, min_k=8),
            (qa[:, 0], ka, va, n),
            (P("data", "model"), bth, bth, P("data")),
        ),
        "kascade_reuse_decode": (
            kdax.kascade_reuse_decode,
            (qa[:, 0], ka, va, n, didx),
            (P("data", "model"), bth, bth, P("data"), P("data", "model")),
        ),
    }
    out = {}
    for name, (fn, args, specs) in cases.items():
        sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        text = jax.jit(fn).lower(*sharded).compile().as_text()
        found = [
            c for c in ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter") if c in text
        ]
        got, want = (jax.tree.leaves(jax.jit(fn)(*a)) for a in (sharded, args))
        out[name] = {"collectives": found, "rel_err": max(rel_rms(a, b) for a, b in zip(got, want))}
    return out


def model_on_mesh():
    """The tiny hybrid (4 heads, T = 128, B = 4): its loss and gradients on a data=2,model=2,context=2
    mesh against one device; 4 AdamW steps on one device, on that mesh with checkpoints every 2 steps,
    and resumed from step 2 onto a data=4,model=2 mesh; logits of a padded batch and of packed
    sequences on the mesh; the bad meshes' and configs' errors."""
    from flax import nnx

    tokens = train.load_corpus()
    fresh = lambda seed=0: KDAForCausalLM(tiny_config(), rngs=nnx.Rngs(seed))
    mesh = sharding.make_mesh("data=2,model=2,context=2")
    batch = np.random.default_rng(0).integers(0, 256, (4, 129)).astype(np.int32)
    grad = nnx.jit(nnx.value_and_grad(train.loss_fn))
    (l1, g1), (l8, g8) = (
        grad(fresh(), jnp.asarray(batch)),
        grad(sharding.shard(fresh(), mesh), sharding.global_batch(batch, mesh)),
    )
    pairs = zip(nnx.to_flat_state(g1), nnx.to_flat_state(g8))
    out = {
        "loss_err": abs(float(l8) / float(l1) - 1),
        "grad_err": max(rel_rms(b.get_value(), a.get_value()) for (_, a), (_, b) in pairs),
    }
    # the paths that run the one-device code on the sharded weights: a padded batch, packed sequences
    one, on_mesh = fresh(), sharding.shard(fresh(), mesh)
    ids = jnp.asarray(batch[:, :100])
    mask = jnp.asarray(np.arange(100)[None] < np.array([100, 50, 1, 77])[:, None])
    cu = jnp.array([0, 30, 31, 100])
    out["mask_err"] = rel_rms(on_mesh(ids, attention_mask=mask), one(ids, attention_mask=mask))
    out["packed_err"] = rel_rms(on_mesh(ids[:1], cu_seqlens=cu), one(ids[:1], cu_seqlens=cu))
    cfg = {"steps": 4, "batch_size": 4, "seq_len": 128, "warmup": 1}
    with tempfile.TemporaryDirectory() as d:
        out["one_device"] = train.train(fresh(), tokens, train.TrainConfig(**cfg), progress=False)
        on_mesh = train.TrainConfig(**cfg, mesh="data=2,model=2,context=2", checkpoint_every=2, out_dir=d)
        out["mesh"] = train.train(fresh(), tokens, on_mesh, progress=False)
        shutil.rmtree(os.path.join(d, "state", "4"))  # resume from step 2, on another mesh, other initial weights
        model = fresh(1)
        other = train.TrainConfig(**cfg, mesh="data=4,model=2", checkpoint_every=2, out_dir=d)
        out["resumed"] = train.train(model, tokens, other, progress=False, resume=True)
    arrays = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    out["restored_meshes"] = sorted({str(dict(a.sharding.mesh.shape)) for a in arrays})
    cases = {
        "mesh_size": lambda: sharding.make_mesh("data=2,model=2"),
        "mesh_axis": lambda: sharding.make_mesh("data=2,seq=4"),
        "heads": lambda: sharding.shard(fresh(), sharding.make_mesh("model=8")),
        "explicit": lambda: sharding.shard(fresh(), jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Explicit,))),
        "batch_size": lambda: train.train(
            fresh(), tokens, train.TrainConfig(**{**cfg, "batch_size": 3}, mesh="data=2,model=4"), progress=False
        ),
        "seq_len": lambda: train.train(
            fresh(), tokens, train.TrainConfig(**{**cfg, "seq_len": 100}, mesh="data=2,context=4"), progress=False
        ),
    }
    return out | messages(cases)


def hybrids_on_mesh():
    """The tiny Kimi Linear, Ling and GLM-5.3 models (KDA, MLA, DSA, MoE; 4 heads, 8 experts): loss and
    gradients on a data=2,expert=2,context=2 (Kimi) and a data=2,model=2,expert=2 (Ling, GLM) mesh against
    one device, and
    two AdamW steps of Kimi on its mesh against one device."""
    from flax import nnx

    from kdax.models import glm5_tiny_config, kimi_tiny_config, ling_tiny_config, model_class

    batch = np.random.default_rng(1).integers(0, 256, (4, 129)).astype(np.int32)
    grad = nnx.jit(nnx.value_and_grad(train.loss_fn))
    out = {}
    cases = (
        ("kimi", kimi_tiny_config(), "data=2,expert=2,context=2"),
        ("ling", ling_tiny_config(), "data=2,model=2,expert=2"),
        ("glm5", glm5_tiny_config(), "data=2,model=2,expert=2"),
    )
    for name, config, spec in cases:
        fresh = lambda config=config: model_class(config)(config, rngs=nnx.Rngs(0))
        l1, g1 = grad(fresh(), jnp.asarray(batch))
        mesh = sharding.make_mesh(spec)
        model = sharding.shard(fresh(), mesh)
        l8, g8 = grad(model, sharding.global_batch(batch, mesh))
        pairs = zip(nnx.to_flat_state(g1), nnx.to_flat_state(g8))
        experts = [v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if p[-1] == "gate_up"]
        out[f"{name} {spec}"] = {
            "loss_err": abs(float(l8) / float(l1) - 1),
            "grad_err": max(rel_rms(b.get_value(), a.get_value()) for (_, a), (_, b) in pairs),
            "expert_shards": sorted({str(e.get_value().sharding.spec) for e in experts}),
        }
    cfg = {"steps": 2, "batch_size": 4, "seq_len": 128, "warmup": 1, "preset": "kimi-tiny"}
    tokens = train.load_corpus()
    fresh = lambda: model_class(kimi_tiny_config())(kimi_tiny_config(), rngs=nnx.Rngs(0))
    out["one_device"] = train.train(fresh(), tokens, train.TrainConfig(**cfg), progress=False)
    out["mesh"] = train.train(
        fresh(), tokens, train.TrainConfig(**cfg, mesh="data=2,expert=2,context=2"), progress=False
    )
    return out


def main():
    results = {
        "dense_T250_padded": compare(inputs(2, 250)),
        "varlen_in_kernel_options": compare(  # raw gate logits: g of -30 is a decay rate of about 30 a token
            inputs(1, 256, N=5, seed=1),
            cu_seqlens=np.array([0, 5, 5, 100, 101, 256]),
            use_gate_in_kernel=True,
            A_log=jnp.linspace(-1.0, 1.0, 4),
            dt_bias=jnp.linspace(-2.0, 2.0, 64),
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
        ),
        # the GPU kernels (Pallas interpreter) as the local op: small, the interpreter is slow
        "pallas_gpu": compare(inputs(1, 128, H=1, HV=2, K=16, V=16), backend="pallas_gpu"),
        "in_shard_map": in_shard_map(),
        "gathered_bytes": {"T256": gathered_bytes(256), "T1024": gathered_bytes(1024)},
        "errors": errors(),
        "sharded_ops": sharded_ops(),
        "model": model_on_mesh(),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:] == ["hybrids"]:  # the slow test's part
        print(json.dumps(hybrids_on_mesh()))
    else:
        main()
