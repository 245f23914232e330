"""Checkpoints in FLA's format: an HF-style directory with config.json and safetensors holding
FLA's ``KDAForCausalLM`` state dict (PyTorch names and layouts). kdax models save to it and
load from it, so FLA checkpoints convert both ways.

Names map mechanically: the NNX path joined by dots, ``layers.N`` inside nnx.Sequential
dropped to ``N``, ``kernel`` -> ``weight`` transposed ([in, out] -> torch's [out, in]),
``embedding`` -> ``weight``."""

from __future__ import annotations

import json
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from kdax.models.config import KDAConfig
from kdax.models.kda import KDAForCausalLM

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}  # fmt: skip
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}
_SEQUENTIAL = ("f_proj", "g_proj")


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write ``tensors`` (name -> array) to a safetensors file."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _CODES:
            raise ValueError(f"tensors[{name!r}]: dtype {a.dtype} has no safetensors code")
        header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.writelines(blobs)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Read every tensor of a safetensors file into NumPy arrays."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        raw = data[8 + n + begin : 8 + n + end]
        out[name] = np.frombuffer(raw, _DTYPES[info["dtype"]]).reshape(info["shape"]).copy()
    return out


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
    """The model's parameters under FLA's state-dict names and layouts (float32 NumPy)."""
    out = {}
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transpose = _fla_name(path)
        a = np.asarray(value[...], np.float32)
        out[name] = a.T if transpose else a
    return out


def load_fla_state_dict(model: KDAForCausalLM, tensors: dict[str, np.ndarray]) -> KDAForCausalLM:
    """Set the model's parameters from an FLA state dict (in place; returns the model).
    Every parameter must be present with its shape, and no tensor may be left over
    (``lm_head.weight`` is ignored when embeddings are tied)."""
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
    """Write config.json and model.safetensors (FLA's names, float32) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    config = {**model.config.to_dict(), "architectures": ["KDAForCausalLM"]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(directory, "model.safetensors"), fla_state_dict(model))


def _read_weights(directory: str) -> dict[str, np.ndarray]:
    single = os.path.join(directory, "model.safetensors")
    index = single + ".index.json"
    if os.path.exists(single):
        return read_safetensors(single)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for s in shards for k, v in read_safetensors(os.path.join(directory, s)).items()}
    raise ValueError(f"directory: expected model.safetensors or model.safetensors.index.json in {directory!r}")


def from_pretrained(directory: str, *, backend: str = "auto", dtype=None) -> KDAForCausalLM:
    """Load a kdax or FLA ``KDAForCausalLM`` checkpoint directory into a kdax model, its
    weights cast to ``dtype`` if given (see :meth:`KDAForCausalLM.astype`)."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"directory: expected a config.json in {directory!r}")
    with open(path) as f:
        config = KDAConfig.from_dict(json.load(f))
    model = nnx.eval_shape(lambda: KDAForCausalLM(config, backend=backend, rngs=nnx.Rngs(0)))
    model = load_fla_state_dict(model, _read_weights(directory))
    return model if dtype is None else model.astype(dtype)
