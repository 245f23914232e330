"""Compile vLLM's engine step on kdax (``kdax.integrations.vllm_tpu.step.forward``) for a TPU
without one, at a checkpoint's config with abstract weights, and report what a device holds:
weights, MLA pages and KDA state pools sized for the step's requests, the step's temporaries,
and its static cycles (docs/serving.md, "At scale").

    python scripts/vllm_tpu_scale.py --checkpoint tests/fixtures/hf/kimi_a --chips v6e
    python scripts/vllm_tpu_scale.py --config kimi-linear-48b --chips v6e,v5e

Needs libtpu (the ``tpu-check`` extra, Python 3.12). Steps: a decode step of ``--decode R x L``
(R requests, one token each, L tokens of context) and a prefill step of ``--prefill T @ L`` (one
request's chunk of T tokens ending at position L). Pages as tpu-inference lays MLA out: the latent
and the rope key each padded to 128 lanes. The caches are donated, as the engine donates them,
so the temporaries are the step's own. Static cycles count each loop of data-dependent trips once
(a lower bound; the MLA kernel's key loop and the KDA kernels' chunk loops)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HBM_GIB = {"v5e": 16, "v6e": 32, "tpu7x": 192}
CHIPS = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:1x1x1"}
GIB = 1 << 30


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint directory (its config.json is read)")
    src.add_argument("--config", choices=["kimi-linear-48b"], help="a released model's config (no files needed)")
    p.add_argument("--chips", default="v6e", help="comma-separated, of " + ", ".join(CHIPS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page", type=int, default=16, help="tokens a page")
    p.add_argument("--decode", default="64x32768", help="R x L: requests, context")
    p.add_argument("--prefill", default="8192@32768", help="T @ L: chunk tokens, its last position + 1")
    p.add_argument("--num-spec", type=int, default=0, help="draft tokens a request verifies")
    p.add_argument("--no-listings", action="store_true", help="no static cycles (faster)")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def _config(a):
    from kdax.models.hf_config import KimiLinearConfig
    from kdax.models.hybrids import MODELS

    if a.config == "kimi-linear-48b":
        return MODELS["kimi_linear"], KimiLinearConfig()
    with open(os.path.join(a.checkpoint, "config.json")) as f:
        d = json.load(f)
    cls = MODELS[d["model_type"]]
    return cls, cls.config_class.from_dict(d)


def steps(a):
    """(name, tokens, requests, context) of the two steps."""
    R, L = (int(x) for x in a.decode.split("x"))
    T, Lp = (int(x) for x in a.prefill.split("@"))
    return [(f"decode {R} x {L}", R, R, L), (f"prefill {T} @ {Lp}", T, 1, Lp)]


def build(cls, config, dtype, make, *, T, R, L, page, num_spec):
    """(fn, args, bytes of (weights, pages, states)) of one step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kdax.integrations.vllm_tpu.step import StateSlots, StepBatch, forward, kda_state_shapes
    from kdax.models.kda import is_kda

    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cast = lambda x: make(x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)
    state = jax.tree.map(cast, state)
    M = -(-L // page)
    slots = R * (num_spec + 1) + 1
    lanes = lambda n: -(-n // 128) * 128
    caches, layers, nbytes = [], [], {"weights": 0, "pages": 0, "states": 0}
    for x in jax.tree.leaves(state):
        nbytes["weights"] += x.size * x.dtype.itemsize
    i32 = jnp.int32
    for b in model.model.layers:
        if is_kda(b):
            shapes = kda_state_shapes(b.attn)
            cache = tuple(make((slots, *s), d) for s, d in zip(shapes, (dtype, jnp.float32, i32)))
            layers.append(StateSlots(make((R,), i32)))
            nbytes["states"] += sum(c.size * c.dtype.itemsize for c in cache)
        else:
            width = lanes(b.attn.kv_lora_rank) + lanes(b.attn.qk_rope_head_dim)
            cache = make((R * M + 1, page, width), dtype)
            layers.append(make((R, M), i32))
            nbytes["pages"] += cache.size * cache.dtype.itemsize
        caches.append(cache)
    batch = StepBatch(make((T,), i32), make((T,), i32), make((R + 1,), i32), make((R,), i32), tuple(layers))

    def fn(state, caches, batch):
        hidden, caches = forward(nnx.merge(graphdef, state), caches, batch, num_spec=num_spec, mla_backend="pallas_tpu")
        return hidden, caches

    return fn, (state, caches, batch), nbytes


def main(argv=None) -> int:
    a = _args(argv)
    dump = None if a.no_listings else tempfile.mkdtemp(prefix="kdax-scale-llo-")
    if dump:
        flags = f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=(final_bundles|original)"
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + flags).strip()
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    sys.path.insert(0, os.path.dirname(__file__))
    from tpu_compile_report import read_dump

    from kdax.ops.common.dispatch import building_for

    cls, config = _config(a)
    dtype = jnp.dtype(a.dtype)
    rows = []
    print(
        f"jax {jax.__version__}; {a.checkpoint or a.config}, {a.dtype}, pages of {a.page} tokens, num_spec {a.num_spec}"
    )
    print("| chip | step | weights GiB | pages GiB | states GiB | temporaries GiB | sum / HBM | static cycles |")
    print("|---|---|---|---|---|---|---|---|")
    for chip in a.chips.split(","):
        topo = topologies.get_topology_desc(platform="tpu", topology_name=CHIPS[chip])
        mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        make = lambda shape, dt, sharding=sharding: jax.ShapeDtypeStruct(tuple(shape), dt, sharding=sharding)
        for name, T, R, L in steps(a):
            fn, args, nbytes = build(cls, config, dtype, make, T=T, R=R, L=L, page=a.page, num_spec=a.num_spec)
            before = set(os.listdir(dump)) if dump else set()
            row = {"chip": chip, "step": name, **{k: v / GIB for k, v in nbytes.items()}}
            try:
                with building_for("tpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    compiled = jax.jit(fn, donate_argnums=(1,)).trace(*args).lower().compile()
                row["temporaries"] = compiled.memory_analysis().temp_size_in_bytes / GIB
            except Exception as e:  # the compiler's message is the result
                row["error"] = str(e).splitlines()[0][:300]
            if dump:
                new = [os.path.join(dump, f) for f in sorted(set(os.listdir(dump)) - before)]
                if "error" not in row:
                    programs = read_dump(new)
                    row["cycles"] = sum(p.cycles for p in programs)
                    row["cycles_lower_bound"] = any(p.unknown_loops for p in programs)
                for path in new:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            rows.append(row)
            held = sum(nbytes.values()) / GIB + row.get("temporaries", 0)
            cyc = (
                f"{row['cycles'] / 1e6:.2f} M{' (lower bound)' if row['cycles_lower_bound'] else ''}"
                if "cycles" in row
                else "-"
            )
            temp = f"{row['temporaries']:.3f}" if "temporaries" in row else f"fails: {row['error']}"
            print(
                f"| {chip} | {name} | {row['weights']:.3f} | {row['pages']:.3f} | {row['states']:.3f} | {temp} "
                f"| {held:.2f} / {HBM_GIB[chip]} | {cyc} |",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
