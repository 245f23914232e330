"""Ops on arrays sharded over their batch and head axes (on a mesh of Explicit axes, where the
sharding is part of the arrays' types): each device runs its own rows and heads under
``jax.shard_map``, with no communication. Other sharded axes are gathered first (time: use
``context_parallel`` instead). On Auto axes the types say nothing and XLA partitions the ops.
Also the :class:`Layout` that a sharded model's layers read (:func:`kdax.models.shard`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = (
    "data",
    "model",
    "context",
    "expert",
)  # a sharded model's axes: batch, heads, time, experts (docs/scale.md)
ROLES = ("batch", "heads")  # the axes an op may be split over without communication


_HEADS = contextvars.ContextVar("kdax_heads_axis", default=None)


@contextlib.contextmanager
def heads_over(mesh, axis, *, experts=None) -> Iterator[None]:
    """Within the ``with`` block, the ops that take it (KDA's, ``paged_latent_attention``) run per
    shard of their head axes over ``axis`` of ``mesh`` where their arrays' types say nothing: a
    serving engine's tensor parallelism on Auto axes, which Pallas kernels need made explicit
    (XLA cannot partition a Mosaic call). A mixture of experts runs each device's experts over
    ``experts`` and adds their sums (:class:`kdax.nn.MoE`). Read when an op is traced.

    Args:
        mesh: the device mesh (or an abstract one).
        axis: a mesh axis name, or a tuple of them, that splits the heads; None: heads whole.
        experts: the axis (or tuple) that splits the experts (default ``axis``).
    """
    token = _HEADS.set((mesh, axis, axis if experts is None else experts))
    try:
        yield
    finally:
        _HEADS.reset(token)


def axis_names(axis) -> tuple:
    """The mesh axis names of ``axis``: a name, a tuple of names, or None (none)."""
    return () if axis is None else axis if isinstance(axis, tuple) else (axis,)


def axis_size(mesh, axis) -> int:
    """The devices along ``axis`` of ``mesh`` (a name, or a tuple of names: their product)."""
    size = 1
    for name in axis_names(axis):
        size *= mesh.shape[name]
    return size


def heads_axis():
    """The (mesh, heads axis) of :func:`heads_over`, or None outside it or where it keeps heads whole."""
    found = _HEADS.get()
    return None if found is None or found[1] is None else found[:2]


def experts_axis():
    """The (mesh, experts axis) of :func:`heads_over`, or None outside it."""
    found = _HEADS.get()
    return None if found is None or found[2] is None else (found[0], found[2])


def per_shard(fn: Callable, arrays: Sequence, roles: Sequence, out_roles, heads=None):
    """``fn(*arrays)``, per shard of the batch and head axes where the arrays' types shard them
    (or, where they do not, of the head axes over ``heads``, a :func:`heads_axis` value).

    Args:
        fn: the op on whole or local arrays.
        arrays: its arguments (None for an absent one).
        roles: per argument, a tuple naming each of its dims ("batch", "heads" or None), or None
            for an argument that every device takes whole.
        out_roles: the outputs' roles, as a pytree prefix of fn's outputs (a tuple of tuples;
            None for an output that is None).
        heads: None, or (mesh, axis): split the "heads" dims over that axis, the arrays as they
            come (XLA moves them to the split).

    Returns:
        fn's outputs, sharded over the same mesh axes as the inputs' batch and head dims.
    """
    axes, mesh = {}, None
    for x, role in zip(arrays, roles):
        if x is None or role is None:
            continue
        sharding = jax.typeof(x).sharding
        for dim, name in enumerate(role):
            axis = sharding.spec[dim] if dim < len(sharding.spec) else None
            if name in ROLES and axis is not None and name not in axes:
                axes[name], mesh = axis, sharding.mesh
    typed = mesh is not None
    if not typed and heads is not None and any(r is not None and "heads" in r for r in roles):
        mesh, axes = heads[0], {"heads": heads[1]}
        context = jax.sharding.get_abstract_mesh()
        if not context.empty and context.manual_axes:  # within a shard_map over other axes (attention groups)
            mesh = context
    if mesh is None:
        return fn(*arrays)
    spec = lambda role: P() if role is None else P(*(axes.get(name) for name in role))
    present = [i for i, x in enumerate(arrays) if x is not None]
    local = [jax.reshard(arrays[i], NamedSharding(mesh, spec(roles[i]))) if typed else arrays[i] for i in present]

    def run(*xs):
        full = list(arrays)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full)

    out_specs = jax.tree.map(
        spec,
        out_roles,
        is_leaf=lambda r: r is None or isinstance(r, tuple) and all(isinstance(n, (str, type(None))) for n in r),
    )
    return jax.shard_map(
        run, mesh=mesh, in_specs=tuple(spec(roles[i]) for i in present), out_specs=out_specs, check_vma=False
    )(*local)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a sharded model's activations lie (:func:`kdax.models.shard`): rows over ``data``,
    heads over ``model``, time over ``context``, a mixture's experts over ``expert``. Each is the
    mesh axis of that name, or None where the mesh lacks it or it has one device.

    Attributes:
        mesh: the device mesh (its axes named among "data", "model", "context", "expert").
        data, model, context, expert: the axes' names or None.
    """

    mesh: jax.sharding.Mesh
    data: str | None
    model: str | None
    context: str | None
    expert: str | None

    @classmethod
    def of(cls, mesh: jax.sharding.Mesh) -> Layout:
        """The layout of ``mesh`` (axes of other names are refused by :func:`kdax.models.shard`)."""
        role = lambda name: name if name in mesh.axis_names and mesh.shape[name] > 1 else None
        return cls(mesh, *(role(n) for n in MESH_AXES))

    def size(self, axis: str | None) -> int:
        """Devices along ``axis`` (1 for None)."""
        return 1 if axis is None else self.mesh.shape[axis]

    def heads(self, n: int) -> str | None:
        """The model axis where it divides ``n`` heads (each device a whole number of them), else None."""
        return self.model if n % self.size(self.model) == 0 else None

    def constrain(self, x: jax.Array, *spec) -> jax.Array:
        """``x`` laid out as ``PartitionSpec(*spec)`` on the mesh (a constraint for XLA's partitioner)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))
