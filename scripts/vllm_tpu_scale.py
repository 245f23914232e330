"""Compile vLLM's engine step on kdax (``kdax.integrations.vllm_tpu.step.forward``) for a TPU
without one, at a checkpoint's config with abstract weights, and report what a device holds:
weights, MLA pages and KDA state pools sized for the step's requests, the step's temporaries,
and its static cycles (docs/serving.md, "At scale").

    python scripts/vllm_tpu_scale.py --checkpoint tests/fixtures/hf/kimi_a --chips v6e
    python scripts/vllm_tpu_scale.py --config kimi-linear-48b --chips v6e,v5e

Needs libtpu (the ``tpu-check`` extra, Python 3.12). Steps: a decode step of ``--decode R x L``
(R requests, one token each, L tokens of context) and a prefill step of ``--prefill T @ L`` (a
chunk of T tokens ending at position L). On 8 devices the step runs as tpu-inference runs an MLA
model: in data-parallel attention groups (bf16: eight of one device), the requests and tokens
split evenly over them (a prefill chunk of T / 8 tokens in each group), each group's pages and
KDA slots on its own devices, the MLPs and experts over all. Pages as tpu-inference lays MLA out: the latent
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
    p.add_argument("--attn-dp", type=int, help="data-parallel attention groups (default: as tpu-inference makes them)")
    p.add_argument(
        "--gather-attention", dest="gather", action="store_true", help="attention weights split over the groups too"
    )
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


def groups(a, dtype) -> int:
    """The data-parallel attention groups tpu-inference makes of ``--devices`` for an MLA model:
    ``--attn-dp``, or its own rule (the devices over the one cache head's share, 2 / the values a
    32-bit word packs: bf16 one group a device)."""
    if a.attn_dp:
        if a.devices % a.attn_dp:
            raise ValueError(f"--attn-dp: expected a divisor of --devices={a.devices}, got {a.attn_dp}")
        return a.attn_dp
    per_device = max(1.0, 2 / (4 // dtype.itemsize))
    return max(int(a.devices // per_device), 1)


def steps(a, g: int):
    """(name, tokens a group, requests a group, context) of the two steps: the decode rows and the
    prefill tokens split evenly over the ``g`` groups (a prefill chunk in each)."""
    R, L = (int(x) for x in a.decode.split("x"))
    T, Lp = (int(x) for x in a.prefill.split("@"))
    for what, n in (("--decode requests", R), ("--prefill tokens", T)):
        if n % g:
            raise ValueError(f"{what}: expected a multiple of the {g} attention groups, got {n}")
    return [(f"decode {R} x {L}", R // g, R // g, L), (f"prefill {T} @ {Lp}", T // g, 1, Lp)]


def build(cls, config, dtype, make, *, T, R, L, page, num_spec, mesh, gather=False):
    """(fn, args, per-device bytes of weights, pages and states) of one step on ``mesh`` (axes
    "attn_dp": the attention groups, "model": a group's devices), each group ``T`` tokens of ``R``
    requests, as the plugin lays the model out (:func:`kdax.models.sharding.tensor_parallel_specs`:
    heads over "model", the MLPs over both) and tpu-inference its caches (each group's pages and
    KDA slots on its devices, the KDA states split by heads within the group).
    With ``gather`` the attention weights are split over the groups too, gathered where used
    (:func:`kdax.models.sharding.tensor_parallel_specs`' ``gather``).
    ``make(shape, dtype, spec)`` gives an abstract array."""
    import math

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from kdax.integrations.vllm_tpu.step import StateSlots, StepBatch, StepMesh, forward, kda_state_shapes
    from kdax.models.kda import is_kda
    from kdax.models.sharding import tensor_parallel_specs
    from kdax.ops.common.sharding import axis_size

    g, h = mesh.shape["attn_dp"], mesh.shape["model"]
    every = ("attn_dp", "model")
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))).astype(dtype)  # as the engine casts it
    graphdef, state = nnx.split(model)
    gathered = (g, "attn_dp") if gather and g > 1 else None
    specs = tensor_parallel_specs(model, g * h, every, attention=(h, "model"), gather=gathered)
    nbytes = {"weights": 0, "pages": 0, "states": 0}

    def place(x, spec, kind):
        a = make(x.shape, x.dtype, spec)
        nbytes[kind] += a.size * a.dtype.itemsize // math.prod(axis_size(mesh, s) for s in spec if s)
        return a

    for path, var in nnx.to_flat_state(state):
        var.set_value(place(var.get_value(), specs.get(tuple(path), P()), "weights"))
    M = -(-L // page)
    slots = g * (R * (num_spec + 1) + 1)
    lanes = lambda d: -(-d // 128) * 128
    by = lambda d: "model" if h > 1 and d % h == 0 else None
    caches, layers = [], []
    i32 = jnp.int32
    for b in model.model.layers:
        if is_kda(b):
            (conv, width), state_shape, tag = kda_state_shapes(b.attn)
            cache = (
                place(jax.ShapeDtypeStruct((slots, conv, width), dtype), P("attn_dp", None, by(width)), "states"),
                place(
                    jax.ShapeDtypeStruct((slots, *state_shape), jnp.float32), P("attn_dp", by(state_shape[0])), "states"
                ),
                place(jax.ShapeDtypeStruct((slots, *tag), i32), P(), "states"),  # the engine keeps tags whole
            )
            layers.append(StateSlots(make((g * R,), i32, P("attn_dp"))))
        else:
            width = lanes(b.attn.kv_lora_rank) + lanes(b.attn.qk_rope_head_dim)
            cache = place(jax.ShapeDtypeStruct((g * (R * M + 1), page, width), dtype), P("attn_dp"), "pages")
            layers.append(make((g * R, M), i32, P("attn_dp")))
        caches.append(cache)
    shapes = ((g * T,), (g * T,), (g * (R + 1),), (g * R,))
    batch = StepBatch(*(make(s, i32, P("attn_dp")) for s in shapes), tuple(layers))
    step = StepMesh(mesh, "model" if h > 1 else None, every, "attn_dp" if g > 1 else None)

    def fn(state, caches, batch):
        return forward(
            nnx.merge(graphdef, state), caches, batch, num_spec=num_spec, mla_backend="pallas_tpu", mesh=step
        )

    return fn, (state, caches, batch), nbytes


def main(argv=None) -> int:
    a = _args(argv)
    dump = None if a.no_listings else tempfile.mkdtemp(prefix="kdax-scale-llo-")
    if dump:
        flags = f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=(final_bundles|original)"
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + flags).strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies

    from kdax.bench.llo import read_dump
    from kdax.ops.common.dispatch import building_for

    cls, config = _config(a)
    dtype = jnp.dtype(a.dtype)
    g = groups(a, dtype)
    rows = []
    print(
        f"jax {jax.__version__}; {a.checkpoint or a.config}, {a.dtype}, pages of {a.page} tokens, num_spec {a.num_spec}, "
        f"{a.devices} devices in {g} attention groups"
    )
    print("| chip | step | weights GiB | pages GiB | states GiB | temporaries GiB | sum / HBM | static cycles |")
    print("|---|---|---|---|---|---|---|---|")
    for chip in a.chips.split(","):
        topo = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[chip][a.devices])
        devices = np.array(topo.devices[: a.devices]).reshape(g, a.devices // g)
        mesh = jax.sharding.Mesh(devices, ("attn_dp", "model"))
        make = lambda shape, dt, spec, mesh=mesh: jax.ShapeDtypeStruct(
            tuple(shape), dt, sharding=jax.sharding.NamedSharding(mesh, spec)
        )
        for name, T, R, L in steps(a, g):
            fn, args, nbytes = build(
                cls, config, dtype, make, T=T, R=R, L=L, page=a.page, num_spec=a.num_spec, mesh=mesh, gather=a.gather
            )
            before = set(os.listdir(dump)) if dump else set()
            row = {"chip": chip, "step": name, "groups": g, **{k: v / GIB for k, v in nbytes.items()}}
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
