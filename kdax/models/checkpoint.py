"""Checkpoints: HF-style directories with config.json and safetensors, dispatched on config.json's
``model_type``: "kda" holds FLA's ``KDAForCausalLM`` state dict (PyTorch names and layouts);
"kimi_linear" and "bailing_hybrid" the hub's tensors of Kimi Linear and the Ling hybrids
(:mod:`kdax.models.hybrids`). kdax models save to them and load from them, so FLA and
transformers checkpoints convert both ways.

FLA's names map mechanically:
the NNX path joined by dots, ``layers.N`` inside nnx.Sequential
dropped to ``N``, ``kernel`` -> ``weight`` transposed ([in, out] -> torch's [out, in]),
``embedding`` -> ``weight``."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx
from jax.experimental import multihost_utils

from kdax.models import hybrids
from kdax.models.kda import KDAForCausalLM

_SEQUENTIAL = ("f_proj", "g_proj")


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file ``path`` as NumPy arrays (bfloat16 through ml_dtypes);
    a truncated or corrupt file raises ValueError naming it."""
    try:
        return safetensors.numpy.load_file(path)
    except safetensors.SafetensorError as e:
        raise ValueError(f"directory: expected a complete safetensors file at {path!r}: {e}") from e


def _fla_name(path: tuple) -> tuple[str, bool]:
    """(FLA state-dict key, whether the tensor is transposed) of an NNX parameter path."""
    parts = [str(p) for p in path]
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "layers" and parts[i - 1] in _SEQUENTIAL:
            del parts[i]
    leaf = parts[-1]
    parts[-1] = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    return ".".join(parts), leaf == "kernel"


def fla_state_dict(model: KDAForCausalLM) -> dict[str, np.ndarray]:
    """The model's parameters under FLA's state-dict names and layouts.

    Args:
        model: the model.

    Returns:
        {FLA name: float32 NumPy array}, Linear kernels transposed to torch's [out, in] (arrays
        spanning several hosts are gathered: every process calls this).
    """
    out = {}
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transpose = _fla_name(path)
        a = value[...]
        a = np.asarray(a if a.is_fully_addressable else multihost_utils.process_allgather(a, tiled=True), np.float32)
        out[name] = np.ascontiguousarray(a.T) if transpose else a  # safetensors writes the buffer as it lies
    return out


def load_fla_state_dict(model: KDAForCausalLM, tensors: dict[str, np.ndarray]) -> KDAForCausalLM:
    """Set the model's parameters from an FLA state dict, in place.

    Args:
        model: the model whose parameters to set.
        tensors: {FLA name: array}; every parameter must be present with its shape, and no
            tensor may be left over (``lm_head.weight`` is ignored when embeddings are tied).

    Returns:
        The model.

    Raises:
        ValueError: naming the tensor that is missing, of the wrong shape, or left over.
    """
    state = nnx.state(model, nnx.Param)
    left = dict(tensors)
    if model.config.tie_word_embeddings:
        left.pop("lm_head.weight", None)
    flat = []
    for path, value in nnx.to_flat_state(state):
        name, transpose = _fla_name(path)
        if name not in left:
            raise ValueError(f"tensors: missing {name!r} (for parameter {'/'.join(map(str, path))})")
        a = np.asarray(left.pop(name))
        a = a.T if transpose else a
        if a.shape != value.shape:
            raise ValueError(f"tensors[{name!r}]: expected shape {tuple(value.shape)}, got {a.shape}")
        flat.append((path, jnp.asarray(a, value.dtype)))
    if left:
        raise ValueError(f"tensors: unexpected entries {sorted(left)[:8]} (the config may not match the checkpoint)")
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def save_pretrained(model: KDAForCausalLM, directory: str) -> None:
    """Write config.json and model.safetensors (float32) into ``directory``: FLA's names for a
    :class:`KDAForCausalLM`, the hub's for Kimi Linear and Ling (what transformers loads).

    Args:
        model: the model to save (on several hosts, every process calls this; process 0 writes).
        directory: created if missing; files already there are overwritten.
    """
    tensors = hybrids.hub_state_dict(model) if type(model) in hybrids.MODELS.values() else fla_state_dict(model)
    if jax.process_index() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    safetensors.numpy.save_file(tensors, os.path.join(directory, "model.safetensors"))


def _read_json(path: str):
    """The JSON file ``path``; a truncated or corrupt one is a ValueError naming it."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"directory: expected valid JSON in {path!r}: {e}") from e


def _read_weights(directory: str) -> dict[str, np.ndarray]:
    single = os.path.join(directory, "model.safetensors")
    index = single + ".index.json"
    if os.path.exists(single):
        return _read_safetensors(single)
    if os.path.exists(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return {k: v for s in shards for k, v in _read_safetensors(os.path.join(directory, s)).items()}
    raise ValueError(f"directory: expected model.safetensors or model.safetensors.index.json in {directory!r}")


def from_pretrained(directory: str, *, backend: str = "auto", dtype=None) -> KDAForCausalLM:
    """Load a checkpoint directory into a kdax model, by config.json's ``model_type``: "kda" (kdax
    or FLA's ``KDAForCausalLM``), "kimi_linear" (:class:`kdax.models.KimiLinearForCausalLM`),
    "bailing_hybrid" (:class:`kdax.models.BailingHybridForCausalLM`).

    Args:
        directory: holds config.json and model.safetensors (or its shards and their index).
        backend: the KDA layers' backend.
        dtype: if given, the weights are cast to it (see :meth:`KDAForCausalLM.astype`).

    Returns:
        The model.

    Raises:
        ValueError: a file is missing, truncated or corrupt (the error names it), or a tensor
            is missing, left over or of the wrong shape (the error names the tensor).
    """
    if not os.path.isdir(directory):
        raise ValueError(f"directory: expected a checkpoint directory, {directory!r} is not a directory")
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"directory: expected a config.json in {directory!r}")
    d = _read_json(path)
    model_type = d.get("model_type", "kda")
    if model_type == "kda":
        cls, load = KDAForCausalLM, load_fla_state_dict
    elif model_type in hybrids.MODELS:
        cls, load = hybrids.MODELS[model_type], hybrids.load_hub_state_dict
    else:
        raise ValueError(
            f"directory: expected config.json's model_type in {('kda', *hybrids.MODELS)}, got {model_type!r} in {path!r}"
        )
    config = cls.config_class.from_dict(d)
    model = nnx.eval_shape(lambda: cls(config, backend=backend, rngs=nnx.Rngs(0)))
    model = load(model, _read_weights(directory))
    return model if dtype is None else model.astype(dtype)
