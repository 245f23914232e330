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
TOPOLOGIES = {"v5e": {1: "v5e:1x1", 8: "v5e:2x4"}, "v6e": {1: "v6e:1x1", 8: "v6e:2x4"}, "tpu7x": {1: "tpu7x:1x1x1"}}
GIB = 1 << 30


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint directory (its config.json is read)")
    src.add_argument("--config", choices=["kimi-linear-48b"], help="a released model's config (no files needed)")
    p.add_argument("--chips", default="v6e", help="comma-separated, of " + ", ".join(TOPOLOGIES))
    p.add_argument("--devices", type=int, default=1, choices=[1, 8], help="tensor-parallel devices (8: v5e, v6e)")
    p.add_argument("--layers", type=int, help="with --config: its first N layers (quicker compiles)")
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
        return MODELS["kimi_linear"], KimiLinearConfig(**({"num_hidden_layers": a.layers} if a.layers else {}))
    with open(os.path.join(a.checkpoint, "config.json")) as f:
        d = json.load(f)
    cls = MODELS[d["model_type"]]
    return cls, cls.config_class.from_dict(d)


def steps(a):
    """(name, tokens, requests, context) of the two steps."""
    R, L = (int(x) for x in a.decode.split("x"))
    T, Lp = (int(x) for x in a.prefill.split("@"))
    return [(f"decode {R} x {L}", R, R, L), (f"prefill {T} @ {Lp}", T, 1, Lp)]


def build(cls, config, dtype, make, *, T, R, L, page, num_spec, n, mesh):
    """(fn, args, per-device bytes of weights, pages and states) of one step, on ``n`` devices of
    mesh axis "model" as the plugin lays the model out (:func:`kdax.models.sharding.tensor_parallel_specs`)
    and tpu-inference its caches (MLA pages whole on each device under tensor parallelism alone,
    KDA states split by heads). ``make(shape, dtype, spec)`` gives an abstract array."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from kdax.integrations.vllm_tpu.step import StateSlots, StepBatch, forward, kda_state_shapes
    from kdax.models.kda import is_kda
    from kdax.models.sharding import tensor_parallel_specs

    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    specs = tensor_parallel_specs(model, n, "model") if n > 1 else {}
    nbytes = {"weights": 0, "pages": 0, "states": 0}

    def place(x, spec, kind):
        a = make(x.shape, x.dtype, spec)
        nbytes[kind] += a.size * a.dtype.itemsize // n ** sum(s is not None for s in spec)
        return a

    for path, var in nnx.to_flat_state(state):
        x = var.get_value()
        dt = dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        var.set_value(place(jax.ShapeDtypeStruct(x.shape, dt), specs.get(tuple(path), P()), "weights"))
    M = -(-L // page)
    slots = R * (num_spec + 1) + 1
    lanes = lambda d: -(-d // 128) * 128
    by = lambda d: "model" if n > 1 and d % n == 0 else None
    caches, layers = [], []
    i32 = jnp.int32
    for b in model.model.layers:
        if is_kda(b):
            (conv, width), state_shape, tag = kda_state_shapes(b.attn)
            cache = (
                place(jax.ShapeDtypeStruct((slots, conv, width), dtype), P(None, None, by(width)), "states"),
                place(jax.ShapeDtypeStruct((slots, *state_shape), jnp.float32), P(None, by(state_shape[0])), "states"),
                place(jax.ShapeDtypeStruct((slots, *tag), i32), P(), "states"),
            )
            layers.append(StateSlots(make((R,), i32, P())))
        else:
            width = lanes(b.attn.kv_lora_rank) + lanes(b.attn.qk_rope_head_dim)
            cache = place(jax.ShapeDtypeStruct((R * M + 1, page, width), dtype), P(), "pages")
            layers.append(make((R, M), i32, P()))
        caches.append(cache)
    batch = StepBatch(*(make(s, i32, P()) for s in ((T,), (T,), (R + 1,), (R,))), tuple(layers))

    heads = (mesh, "model") if n > 1 else None

    def fn(state, caches, batch):
        hidden, caches = forward(
            nnx.merge(graphdef, state), caches, batch, num_spec=num_spec, mla_backend="pallas_tpu", heads=heads
        )
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
        topo = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[chip][a.devices])
        mesh = jax.sharding.Mesh(topo.devices[: a.devices], ("model",))
        make = lambda shape, dt, spec, mesh=mesh: jax.ShapeDtypeStruct(
            tuple(shape), dt, sharding=jax.sharding.NamedSharding(mesh, spec)
        )
        for name, T, R, L in steps(a):
            fn, args, nbytes = build(
                cls, config, dtype, make, T=T, R=R, L=L, page=a.page, num_spec=a.num_spec, n=a.devices, mesh=mesh
            )
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
