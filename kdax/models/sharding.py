"""A model on a device mesh (docs/scale.md): parameters FSDP over a ``data`` axis and tensor
parallel over heads on a ``model`` axis, rows over ``data``, time over ``context`` (KDA layers
context parallel, attention layers gathering keys and values over it).

Meshes have Auto axes: the parameters' shardings are placed, the activations constrained, and
XLA's partitioner inserts the FSDP gathers and tensor-parallel reductions; the KDA layers run
their own ``shard_map`` (the convolutions and the op need a layout XLA cannot infer)."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kdax.models.glm5 import Glm5Model
from kdax.models.kda import KDAForCausalLM, KDAModel
from kdax.nn import MLA, Attention, GatedMLP, KimiDeltaAttention, MoE
from kdax.nn.moe import Buffer
from kdax.ops.common.sharding import MESH_AXES, Layout


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """A mesh of Auto axes from ``"data=2,model=2,context=2"`` (``kdax train --mesh``).

    Args:
        spec: comma-separated ``axis=size``, axes among "data", "model", "context", "expert", the
            sizes' product the number of devices.

    Returns:
        The mesh over ``jax.devices()``.

    Raises:
        ValueError: naming ``mesh``, for a malformed spec, an unknown or repeated axis, or sizes
            whose product is not the device count.
    """
    sizes = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or name in sizes or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(
                f"mesh: expected comma-separated axis=size with axes among {MESH_AXES} (each once, "
                f"sizes positive), got {spec!r}"
            )
        sizes[name] = int(size)
    n, have = math.prod(sizes.values()), jax.device_count()
    if n != have:
        hint = f" (on a CPU host, XLA_FLAGS=--xla_force_host_platform_device_count={n} fakes {n})" if n > have else ""
        raise ValueError(
            f"mesh: expected axis sizes whose product is the {have} devices here, got {spec!r} = {n}{hint}"
        )
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def _rules(module: nnx.Module, L: Layout) -> dict[tuple, tuple]:
    """{parameter path within ``module``: its axes} for the layers that have sharded parameters."""
    D, M = L.data, L.model
    column = lambda m: {("kernel",): (D, m), ("bias",): (m,)}  # output features split (by heads where m)
    under = lambda name, rules: {(name, *path): axes for path, axes in rules.items()}
    if isinstance(module, KimiDeltaAttention):
        for what, n in (("num_heads", module.num_heads), ("num_v_heads", module.num_v_heads)):
            if n % L.size(M):
                raise ValueError(
                    f"mesh: expected a model axis dividing every KDA layer's heads, got {L.size(M)} "
                    f"devices for {what}={n}"
                )
        rules = {("A_log",): (M,), ("dt_bias",): (M,)}
        for name in ("q_proj", "k_proj", "v_proj", "b_proj"):
            rules |= under(name, column(M))
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            rules |= {(name, "weight"): (M, None, None), (name, "bias"): (M,)}
        for name in ("f_proj", "g_proj"):  # low rank: hidden -> head_v_dim (FSDP only) -> heads; or one linear
            rules[(name, "layers", 0, "kernel")] = (D, None)
            rules |= under(name, under("layers", under(1, column(M)))) | under(name, column(M))
        return rules | {("o_proj", "kernel"): (M, D)}
    if isinstance(module, MLA):  # the latent is every head's: FSDP only; the per-head projections by heads
        m = L.heads(module.num_heads)
        rules = {(name, "kernel"): (D, None) for name in ("q_a_proj", "kv_a_proj_with_mqa")}
        for name in ("q_proj", "q_b_proj", "kv_b_proj", "g_proj"):
            rules |= under(name, column(m))
        return rules | {("o_proj", "kernel"): (m, D)}
    if isinstance(module, MoE):  # experts over the expert axis, FSDP on their hidden side
        E = L.expert
        return {("gate_up",): (E, D, None), ("down",): (E, None, D), ("gate", "kernel"): (D, None)}
    if isinstance(module, Attention):
        mq, mkv = L.heads(module.num_heads), L.heads(module.num_kv_heads)
        rules = under("q_proj", column(mq)) | under("k_proj", column(mkv)) | under("v_proj", column(mkv))
        return rules | {("o_proj", "kernel"): (mq, D)}
    if isinstance(module, GatedMLP):
        m = L.heads(module.intermediate_size)
        return {("gate_proj", "kernel"): (D, m), ("up_proj", "kernel"): (D, m), ("down_proj", "kernel"): (m, D)}
    if isinstance(module, KDAForCausalLM):
        return {
            ("model", "embeddings", "embedding"): (None, D),
            ("lm_head", "kernel"): (D, L.heads(module.config.vocab_size)),
        }
    return {}


def partition_specs(model: KDAForCausalLM, mesh: jax.sharding.Mesh) -> dict[tuple, P]:
    """Each parameter's layout on ``mesh``: linears FSDP over "data" on their input features (or
    output, for those that end a block) and split over "model" by heads (KDA, attention and MLA
    projections, the MLP's hidden features, the vocabulary; MLA's latent projections FSDP only);
    experts over "expert" (FSDP on their hidden side); convolutions, A_log and dt_bias by heads;
    embeddings FSDP; norms replicated. A dim that an axis does not divide stays whole.

    Args:
        model: the model.
        mesh: axes named among "data", "model", "context", "expert".

    Returns:
        {parameter path: PartitionSpec}.

    Raises:
        ValueError: naming ``mesh``, for an axis of another name, or a model axis that does not
            divide a KDA layer's heads.
    """
    if set(mesh.axis_names) - set(MESH_AXES):
        raise ValueError(f"mesh: expected axes named among {MESH_AXES}, got {tuple(mesh.axis_names)}")
    return _partition(model, Layout.of(mesh))


_MIXERS = KimiDeltaAttention | MLA | Attention


def _partition(model: KDAForCausalLM, L: Layout, mixers: bool = True) -> dict[tuple, P]:
    """:func:`partition_specs` on ``L`` (the attention layers' parameters whole unless ``mixers``)."""
    rules = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and (mixers or not isinstance(module, _MIXERS)):
            rules |= {(*path, *p): axes for p, axes in _rules(module, L).items()}
    specs = {}
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = rules.get(tuple(path), ())
        specs[tuple(path)] = P(*(a if a and n % L.size(a) == 0 else None for a, n in zip(axes, value.shape)))
    return specs


def tensor_parallel_specs(model: KDAForCausalLM, n: int, axis, *, attention=None, gather=None) -> dict[tuple, P]:
    """Each parameter's layout for tensor parallelism alone over ``n`` devices (a serving engine's):
    :func:`partition_specs`' "model" split (projections by heads, the MLPs' hidden features, the
    vocabulary), the experts' split where that leaves a parameter whole, and the embedding's rows
    (where n divides the vocabulary), all over ``axis``.

    Args:
        model: the model.
        n: the devices of ``axis``.
        axis: a mesh axis name, or a tuple of them.
        attention: None, or (devices, axis) that split the attention layers' heads instead (an
            engine's data-parallel attention: heads split within a group, or (1, None): whole);
            the MLPs, experts and vocabulary stay over ``axis``.
        gather: None, or (devices, axis) that also split each attention weight of two or more
            dims on its first dim the heads leave whole (the groups' axis: stored once over the
            groups, each layer's weights gathered where they are used, as FSDP does).

    Returns:
        {parameter path: PartitionSpec}.
    """
    out = _split(model, n, axis, attention is None)
    embedding = ("model", "embeddings", "embedding")
    if n > 1 and model.config.vocab_size % n == 0:  # each device its rows: a lookup, then a sum over devices
        out[embedding] = P(axis, None)
    if attention is not None:
        heads = _split(model, *attention)
        mixers = [tuple(p) for p, m in nnx.iter_graph(model) if isinstance(m, _MIXERS)]
        out |= {k: heads[k] for k in out if any(k[: len(p)] == p for p in mixers)}
        if gather is not None:
            shapes = {tuple(k): v.get_value().shape for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
            for k in out:
                if any(k[: len(p)] == p for p in mixers) and len(shapes[k]) > 1:
                    out[k] = _gathered(out[k], shapes[k], *gather)
    return out


def _gathered(spec: P, shape: tuple, n: int, axis) -> P:
    """``spec`` with ``axis`` on the first dim it leaves whole that ``n`` divides (or as it is)."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    for i, (a, d) in enumerate(zip(spec, shape)):
        if a is None and d % n == 0:
            return P(*spec[:i], axis, *spec[i + 1 :])
    return P(*spec)


def _split(model: KDAForCausalLM, n: int, axis, mixers: bool = True) -> dict[tuple, P]:
    """:func:`tensor_parallel_specs` over one axis of ``n`` devices (the attention layers' whole
    unless ``mixers``)."""
    by_heads, by_experts = (
        _partition(model, Layout.of(jax.sharding.AbstractMesh((n,), (a,))), mixers) for a in ("model", "expert")
    )
    return {k: P(*(axis if a else None for a in (s if any(s) else by_experts[k]))) for k, s in by_heads.items()}


def shard(model: KDAForCausalLM, mesh: jax.sharding.Mesh) -> KDAForCausalLM:
    """Lay the model out on ``mesh`` in place (see :func:`partition_specs`): its parameters move to
    their shardings (recorded as each Param's ``out_sharding``, which ``nnx.Optimizer`` copies to
    its state), and its layers run on the mesh: ``model(ids)`` takes rows over "data" and time
    over "context" (B a multiple of the data axis, T of the context axis times the KDA chunk
    size), the KDA layers context parallel. Caches, ``attention_mask``, ``cu_seqlens`` and Kascade
    run the single-device code, partitioned by XLA.

    Args:
        model: the model (any parameters' placement).
        mesh: Auto axes named among "data", "model", "context", "expert" (:func:`make_mesh`); rows
            go over "data" alone, so "expert" splits the experts' weights and memory, not the rows.

    Returns:
        The model.

    Raises:
        ValueError: see :func:`partition_specs`; ``mesh`` with an Explicit or Manual axis.
    """
    if any(t != AxisType.Auto for t in mesh.axis_types):
        raise ValueError(f"mesh: expected Auto axes (kdax.models.make_mesh), got {mesh.axis_types}")
    specs = partition_specs(model, mesh)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        var.set_metadata(out_sharding=tuple(specs[tuple(path)]), mesh=mesh)
    layout = Layout.of(mesh)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, KimiDeltaAttention | Attention | KDAModel | Glm5Model):
            module.layout = layout
    nnx.update(model, place(nnx.state(model, nnx.Any(nnx.Param, Buffer)), mesh))  # buffers replicated
    return model


def to_host(a: jax.Array) -> np.ndarray:
    """``a`` as a float32 NumPy array on this host, gathered from every process where it spans several."""
    return np.asarray(a if a.is_fully_addressable else multihost_utils.process_allgather(a, tiled=True), np.float32)


def place(tree, mesh: jax.sharding.Mesh):
    """Arrays of an nnx state (e.g. an optimizer's) onto ``mesh`` by their Variables' ``out_sharding``
    (replicated without one)."""
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), nnx.get_partition_spec(tree)))


def global_batch(batch: np.ndarray, mesh: jax.sharding.Mesh) -> jax.Array:
    """A host batch [B, T] that every process holds whole, as one array over ``mesh`` with rows over
    "data" (time is split inside the model); each process places its own devices' rows, the
    multi-host form of ``device_put``."""
    rows = NamedSharding(mesh, P(Layout.of(mesh).data))
    return jax.make_array_from_callback(batch.shape, rows, lambda index: batch[index])
