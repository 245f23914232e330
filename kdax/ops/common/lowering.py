"""Ahead-of-time lowering for an accelerator from any machine, a CPU-only one included."""

from __future__ import annotations

from collections.abc import Callable

import jax

from kdax.ops.common import dispatch
from kdax.ops.common.validation import fail

PLATFORMS = {"cuda": "gpu", "tpu": "tpu"}  # lowering platform -> the device platform it builds for


def lower(
    fn: Callable, *args, platform: str, device_kind: str = "NVIDIA H100", num_cores: int = 132, **jit_kwargs
) -> jax.stages.Lowered:
    """``jax.jit(fn, **jit_kwargs)`` lowered for ``platform`` with ``args`` (arrays or
    ``jax.ShapeDtypeStruct``), on any machine: kdax's ops inside ``fn`` build as they would on
    that device (``backend="auto"`` picks its kernels where it would there; Pallas kernels
    compile for it rather than for the interpreter), so their Mosaic (TPU) or Triton (CUDA)
    code can be inspected or the result serialized without the device.

    Args:
        fn: the function to lower.
        *args: its arguments.
        platform: "cuda" or "tpu".
        device_kind: with "cuda", the GPU to lower for (jax >= 0.11 asks which when none is
            present; Triton kernels are built for its compute capability).
        num_cores: with "cuda", that GPU's streaming multiprocessors.
        **jit_kwargs: passed to ``jax.jit``.

    Returns:
        The ``jax.stages.Lowered``: ``.as_text()`` holds ``tpu_custom_call`` or Triton calls.

    Raises:
        ValueError: ``platform`` is not "cuda" or "tpu".
    """
    if platform not in PLATFORMS:
        fail("platform", f"one of {tuple(PLATFORMS)}", repr(platform))
    with dispatch.building_for(PLATFORMS[platform]):
        traced = jax.jit(fn, **jit_kwargs)
        if platform != "cuda":
            return traced.trace(*args).lower(lowering_platforms=(platform,))
        gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("d",), abstract_device=gpu)):
            return traced.trace(*args).lower(lowering_platforms=(platform,))
