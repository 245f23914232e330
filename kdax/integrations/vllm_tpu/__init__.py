"""Serve kdax's Kimi Linear, Ling and GLM-5.3-Flash models on vLLM's TPU engine (tpu-inference),
as a vLLM plugin (docs/serving.md, "vLLM").

Installed with kdax, the ``vllm.general_plugins`` entry point ``kdax`` calls :func:`register`
in every vLLM process: it registers the ``KimiLinearForCausalLM``, ``BailingHybridForCausalLM``
and ``Glm5NextForConditionalGeneration`` architectures on :class:`~kdax.integrations.vllm_tpu.engine.KdaxForCausalLM`
and gives their KDA layers state pools in the engine's cache specs. The engine code it relies
on is tpu-inference's: :data:`TPU_INFERENCE_VERSION` is the release it is written against.
"""

from __future__ import annotations

import os

TPU_INFERENCE_VERSION = "0.32.0"


def register() -> None:
    """Register kdax's architectures with tpu-inference and vLLM (the plugin's entry point).

    A process without tpu-inference (vLLM on GPU, or no vLLM) is left alone. With
    ``KDAX_VLLM_CPU=1`` tpu-inference is also made to run on CPU devices
    (:func:`~kdax.integrations.vllm_tpu.engine.enable_cpu`).

    Raises:
        RuntimeError: tpu-inference is installed at another version than
            :data:`TPU_INFERENCE_VERSION`.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("tpu-inference")
    except PackageNotFoundError:
        return
    if found != TPU_INFERENCE_VERSION:
        raise RuntimeError(
            f"tpu-inference: kdax's vLLM plugin is written against tpu-inference {TPU_INFERENCE_VERSION} "
            f"(pip install vllm-tpu=={TPU_INFERENCE_VERSION}), found {found}"
        )
    from tpu_inference.models.common.model_loader import register_model

    from kdax.integrations.vllm_tpu import engine

    if os.environ.get("KDAX_VLLM_CPU") == "1":
        engine.enable_cpu()
    engine.register_configs()
    engine.patch_cache_specs()
    for arch in engine.ARCHITECTURES:
        register_model(arch, engine.KdaxForCausalLM)
