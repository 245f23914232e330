"""Backend choice for the public ops of every op family: what ``backend="auto"`` runs and
why, the scoped default (:func:`use_backend`), and the per-call kernel configs."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp

from kdax.ops.common import tpu_costs
from kdax.ops.common.validation import fail

log = logging.getLogger("kdax")

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "naive")
PORTABLE = ("xla", "naive")  # run on any device
DEVICE_KERNELS = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}  # platform() -> its kernels

_SCOPED = contextvars.ContextVar("kdax_backend", default="auto")
_TARGET = contextvars.ContextVar("kdax_target_platform", default=None)  # set by kdax.lower


def platform() -> str:
    """The platform the ops build for.

    Returns:
        That of :func:`kdax.lower` while it lowers, else ``jax.default_backend()`` ("cpu",
        "gpu" or "tpu").
    """
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Within the ``with`` block, ops called with ``backend="auto"`` (layers and models built
    with it too) run ``backend`` where the op has it, else fall back as "auto" does (logged).

    Read when an op is called or traced: a function already traced under ``jax.jit`` keeps
    the backend of its first trace, so enter the block before the first call.

    Args:
        backend: one of "auto", "xla", "naive", "pallas_tpu", "pallas_gpu".

    Raises:
        ValueError: ``backend`` is any other name.
    """
    if backend not in BACKENDS:
        fail("backend", f"one of {BACKENDS}", repr(backend))
    token = _SCOPED.set(backend)
    try:
        yield
    finally:
        _SCOPED.reset(token)


def scoped_backend() -> str:
    """The scoped default backend.

    Returns:
        The backend :func:`use_backend` set for this context ("auto" outside it).
    """
    return _SCOPED.get()


@contextlib.contextmanager
def building_for(target: str | None) -> Iterator[None]:
    """Within the ``with`` block, :func:`platform` is ``target``.

    Args:
        target: "gpu" or "tpu"; None: the default device.
    """
    token = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(token)


def context() -> tuple[str, str | None]:
    """What the ops' choices depend on besides their arguments.

    A function compiled with ``jax.jit`` that calls kdax ops takes it as a static argument and
    runs under :func:`restored`, so that it compiles once per context instead of keeping the
    choices of its first trace.

    Returns:
        (the :func:`use_backend` scope, the platform being built for or None).
    """
    return _SCOPED.get(), _TARGET.get()


@contextlib.contextmanager
def restored(ctx: tuple[str, str | None]) -> Iterator[None]:
    """Within the ``with`` block, run under a saved context.

    Args:
        ctx: a value of :func:`context`.

    Raises:
        ValueError: ``ctx[0]`` is not a backend name (see :func:`use_backend`).
    """
    with use_backend(ctx[0]), building_for(ctx[1]):
        yield


@dataclasses.dataclass(frozen=True)
class OpBackends:
    """The backends of one public op.

    Attributes:
        op: the op's name, for messages.
        cores: the backends with a core for this op (besides "naive", which every op has).
        configs: each kernel backend's per-call config class (a frozen dataclass with
            ``resolved()``), also for backends this op lacks: a config names its backend.
        refuse: ``refuse(kernels, dtype, config, asked, **options)``: why these kernels do
            not take the inputs (None: they do); ``asked`` is True when a config or
            :func:`use_backend` asked for them rather than the device. On a TPU, "auto" also
            runs the kernels only where :func:`kdax.ops.common.tpu_costs.refuse` finds them
            compiled and cheaper than xla.
    """

    op: str
    cores: tuple[str, ...]
    configs: Mapping[str, type]
    refuse: Callable[..., str | None] = lambda kernels, dtype, config, asked, **options: None

    def explain(self, dtype, config=None, **options) -> tuple[str, str]:
        """What "auto" runs for inputs of ``dtype`` here, and why.

        Args:
            dtype: the inputs' dtype.
            config: a backend's kernel config, which asks for that backend's kernels, or None.
            **options: passed to ``refuse``.

        Returns:
            (backend, reason), e.g. ("xla", "no kernels for this device (cpu)").

        Raises:
            ValueError: ``config`` is not a config of one of ``configs``.
        """
        if config is not None:
            kernels = next((n for n, cls in self.configs.items() if isinstance(config, cls)), None)
            if kernels is None:
                fail("config", f"None or a config of one of {tuple(self.configs)}", type(config).__name__)
            where = "the config's kernels"
        elif (scoped := _SCOPED.get()) != "auto":
            kernels, where = scoped, f"kdax.use_backend({scoped!r})"
        else:
            kernels, where = DEVICE_KERNELS.get(platform()), "the device's kernels"
            if kernels is None:
                return "xla", f"no kernels for this device ({platform()})"
        if kernels in PORTABLE:
            return kernels, where
        if kernels not in self.cores:
            return "xla", f"the op has no {kernels} kernels"
        if dtype == jnp.float64:
            return "xla", "float64 inputs (the kernels compute in float32 at most)"
        asked = where != "the device's kernels"
        if why := self.refuse(kernels, dtype, config, asked, **options):
            return "xla", why
        layout = options.get("cache_layout")
        if kernels == "pallas_tpu" and not asked and (why := tpu_costs.refuse(self.op, dtype, layout=layout)):
            return "xla", why
        return kernels, where

    def resolve(self, backend: str, dtype, config=None, **options):
        """The backend to run and its config.

        Args:
            backend: a backend name; "auto" runs what :meth:`explain` says (logged at debug
                level by the ``kdax`` logger).
            dtype: the inputs' dtype.
            config: the backend's kernel config, or None for its default.
            **options: passed to ``refuse``.

        Returns:
            (backend, config): ``backend`` itself or "auto"'s choice, and its config checked
            and resolved for this device (None for a backend without one).

        Raises:
            NotImplementedError: ``backend`` is neither portable nor among ``cores``.
            ValueError: ``config`` is not a config of ``backend`` (of no backend, with "auto").
        """
        if backend == "auto":
            backend, why = self.explain(dtype, config, **options)
            log.debug("%s: backend='auto' -> %r: %s", self.op, backend, why)
            if not isinstance(config, self.configs.get(backend, ())):
                config = None  # "auto" fell back from the config's backend (logged just above)
        elif backend not in PORTABLE and backend not in self.cores:
            raise NotImplementedError(f"backend={backend!r}: not available for {self.op} in this version")
        return backend, self._checked(config, backend)

    def _checked(self, config, backend: str):
        """The backend's config (its default for None), checked and resolved for this device."""
        cls = self.configs.get(backend)
        if config is None:
            config = None if cls is None else cls()
        elif cls is None or not isinstance(config, cls):
            expected = f"None or a {cls.__module__}.{cls.__name__}" if cls else "None"
            fail("config", f"{expected} for backend={backend!r}", type(config).__name__)
        if config is None:
            return None
        resolved = config.resolved()
        if getattr(config, "interpret", False) is None and resolved.interpret:
            _note_interpreter(backend, platform())
        return resolved


@functools.cache
def _note_interpreter(backend: str, platform: str) -> None:  # once per backend and device
    log.warning(
        "backend=%r on %s: its kernels run in the Pallas interpreter (slow; meant for tests)", backend, platform
    )


REGISTRY: dict[str, OpBackends] = {}  # every public op's backends, by op name (filled as the op families load)


def register(op: OpBackends) -> OpBackends:
    """Record an op's backends for :func:`explain_backend`; returns ``op``."""
    REGISTRY[op.op] = op
    return op


def explain_backend(
    dtype=jnp.float32,
    chunk_size: int | None = 64,
    config=None,
    op: str = "chunk_kda",
    head_dims: tuple[int, int] = (128, 128),
    cache_layout: str = "BLGD",
    platform: str | None = None,
) -> tuple[str, str]:
    """Which backend ``backend="auto"`` runs for an op's inputs of ``dtype`` here (or on
    ``platform``), and why.

    "auto" takes the kernels a config names, else those :func:`kdax.use_backend` names,
    else the default device's, where the op has them and they take the inputs (a TPU's only
    where they compiled and cost less than xla: :mod:`kdax.ops.common.tpu_costs`); else xla.

    Args:
        dtype: the inputs' dtype.
        chunk_size: chunk_kda's chunk size (None for fused_recurrent_kda; other ops ignore it).
        config: a backend's kernel config, which asks for that backend's kernels.
        op: a public op's name: "chunk_kda", "fused_recurrent_kda", "kascade_anchor",
            "kascade_reuse", "kascade_anchor_decode", "kascade_reuse_decode" or
            "paged_latent_attention".
        head_dims: (K, V), KDA's key and value head dims (other ops ignore them).
        cache_layout: the Kascade decode ops' caches, "BLGD" or "BGLD" (other ops ignore it).
        platform: "cpu", "gpu" or "tpu": answer for that device from this one (a TPU's answer
            from the recorded costs); None: the default device (or :func:`kdax.lower`'s target).

    Returns:
        (backend, reason): e.g. ("xla", "no kernels for this device (cpu)").

    Raises:
        ValueError: for an unknown op or platform, or a config of no backend.
    """
    if op not in REGISTRY:
        fail("op", f"one of {tuple(REGISTRY)}", repr(op))
    if cache_layout not in ("BLGD", "BGLD"):
        fail("cache_layout", "'BLGD' or 'BGLD'", repr(cache_layout))
    if platform not in (None, "cpu", "gpu", "tpu"):
        fail("platform", "None, 'cpu', 'gpu' or 'tpu'", repr(platform))
    layout = {"cache_layout": cache_layout} if op.endswith("_decode") else {}
    with building_for(platform) if platform else contextlib.nullcontext():
        return REGISTRY[op].explain(dtype, config, chunk_size=chunk_size, head_dims=head_dims, **layout)
