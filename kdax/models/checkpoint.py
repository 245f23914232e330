"""Checkpoints: HF-style directories with config.json and safetensors, dispatched on config.json's
``model_type``: "kda" holds FLA's ``KDAForCausalLM`` state dict (PyTorch names and layouts);
"kimi_linear" and "bailing_hybrid" the hub's tensors of Kimi Linear and the Ling hybrids
(:mod:`kdax.models.hybrids`). kdax models save to them and load from them, so FLA and
transformers checkpoints convert both ways.

FLA's names map mechanically: the NNX path joined by dots, ``layers.N`` inside nnx.Sequential
dropped to ``N``, ``kernel`` -> ``weight`` transposed ([in, out] -> torch's [out, in]),
``embedding`` -> ``weight``. Loading reads one parameter's tensors at a time (an MoE layer's experts together), cast to
the model's dtype and placed on its mesh as they are read."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdax.models import hybrids, sharding
from kdax.models.kda import KDAForCausalLM
from kdax.nn.moe import Buffer

_SEQUENTIAL = ("f_proj", "g_proj")


def _fla_name(path: tuple) -> tuple[str, bool]:
    """(FLA state-dict key, whether the tensor is transposed) of an NNX parameter path."""
    parts = [str(p) for p in path]
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "layers" and parts[i - 1] in _SEQUENTIAL:
            del parts[i]
    leaf = parts[-1]
    parts[-1] = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    return ".".join(parts), leaf == "kernel"


def _entries(model: KDAForCausalLM):
    """(path, abstract value, checkpoint names, kind) of every tensor the model's format holds
    (:func:`kdax.models.hybrids.hub_entries` for Kimi Linear and Ling, FLA's names otherwise)."""
    if isinstance(model, hybrids.HubCausalLM):
        yield from hybrids.hub_entries(model)
        return
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transpose = _fla_name(path)
        yield path, value, [name], "transposed" if transpose else "same"


def state_dict(model: KDAForCausalLM) -> dict[str, np.ndarray]:
    """The model's tensors under its checkpoint format's names and layouts: FLA's for a
    :class:`KDAForCausalLM`, the hub's for Kimi Linear and Ling.

    Args:
        model: the model.

    Returns:
        {name: float32 NumPy array} in torch's layouts (arrays spanning several hosts are
        gathered: every process calls this).
    """
    out = {}
    for _, value, names, kind in _entries(model):
        out.update(hybrids.to_checkpoint(kind, sharding.to_host(value[...]), names))
    return out


def load_state_dict(model: KDAForCausalLM, tensors: Mapping, mesh: jax.sharding.Mesh | None = None) -> KDAForCausalLM:
    """Set the model's parameters from a checkpoint's tensors, in place, one parameter's tensors at a time.

    Args:
        model: the model (concrete or abstract, from ``nnx.eval_shape``); each tensor is cast to
            its parameter's dtype.
        tensors: {name: array}, read on access (a lazy mapping keeps one tensor in host memory at
            a time): every tensor of the model's format with its shape (``lm_head.weight`` is
            ignored when embeddings are tied); Kimi Linear's dense MLPs under ``mlp`` or
            ``block_sparse_moe``; Ling's layers past ``num_hidden_layers`` (multi-token
            prediction) are kept as they are in ``model.mtp``; nothing else may be left over.
        mesh: None, or a mesh (:func:`kdax.models.sharding.make_mesh`) each array is placed on as
            :func:`kdax.models.shard` lays it out, each process holding its own shards only.

    Returns:
        The model.

    Raises:
        ValueError: naming the tensor that is missing, of the wrong shape, or left over.
    """
    names = {hybrids.canonical_name(k): k for k in tensors}
    if model.config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    specs = sharding.partition_specs(model, mesh) if mesh is not None else {}
    flat = []
    for path, value, wanted, kind in _entries(model):
        for name in wanted:
            if name not in names:
                raise ValueError(f"tensors: missing {name!r} (for parameter {'/'.join(map(str, path))})")
        a = hybrids.from_checkpoint(kind, {n: np.asarray(tensors[names.pop(n)]) for n in wanted}, wanted, value.shape)
        if a.shape != value.shape:
            raise ValueError(f"tensors[{wanted[0]!r}]: expected shape {tuple(value.shape)}, got {a.shape}")
        flat.append((path, _place(a.astype(value.dtype), mesh, specs.get(tuple(path)))))
    n_layers = model.config.num_hidden_layers
    later = [k for k in names if isinstance(model, hybrids.HubCausalLM) and hybrids.set_aside(k, n_layers)]
    extra = sorted(set(names) - set(later))
    if extra:
        raise ValueError(f"tensors: unexpected entries {extra[:8]} (the config may not match the checkpoint)")
    nnx.update(model, nnx.from_flat_state(flat))
    for name in later:
        model.mtp[name] = Buffer(_place(np.asarray(tensors[names[name]]), mesh, None))
    return model


def _place(a: np.ndarray, mesh, spec) -> jax.Array:
    """A host array on the default device, or over ``mesh`` as ``spec`` (replicated: None), each
    process placing its own devices' shards."""
    if mesh is None:
        return jnp.asarray(a)
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec or P()), lambda index: a[index])


def save_pretrained(model: KDAForCausalLM, directory: str) -> None:
    """Write config.json and model.safetensors (float32) into ``directory``: FLA's names for a
    :class:`KDAForCausalLM`, the hub's for Kimi Linear and Ling (what transformers loads).

    Args:
        model: the model to save (on several hosts, every process calls this; process 0 writes).
        directory: created if missing; files already there are overwritten.
    """
    tensors = state_dict(model)
    if jax.process_index() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    name = model.architecture() if isinstance(model, hybrids.HubCausalLM) else type(model).__name__
    fields = model.config.config_json() if hasattr(model.config, "config_json") else model.config.to_dict()
    config = {**fields, "architectures": [name]}
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


class _Tensors(Mapping):
    """The tensors of a checkpoint's safetensors files, each read from its file when looked up."""

    def __init__(self, directory: str):
        single = os.path.join(directory, "model.safetensors")
        index = single + ".index.json"
        if os.path.exists(single):
            files = [single]
        elif os.path.exists(index):
            files = [os.path.join(directory, f) for f in sorted(set(_read_json(index)["weight_map"].values()))]
        else:
            raise ValueError(f"directory: expected model.safetensors or model.safetensors.index.json in {directory!r}")
        self.files = {}
        for file in files:
            with self._open(file) as f:
                self.files.update(dict.fromkeys(f.keys(), file))

    @staticmethod
    def _open(file: str):
        try:
            return safetensors.safe_open(file, framework="numpy")
        except (safetensors.SafetensorError, OSError) as e:
            raise ValueError(f"directory: expected a complete safetensors file at {file!r}: {e}") from e

    def __getitem__(self, name: str) -> np.ndarray:
        with self._open(self.files[name]) as f:
            try:
                return f.get_tensor(name)
            except safetensors.SafetensorError as e:
                raise ValueError(f"directory: expected a complete safetensors file at {self.files[name]!r}: {e}") from e

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def _resolve(directory: str) -> str:
    """A checkpoint directory, or a Hugging Face hub id's local snapshot (configs, tokenizer, safetensors)."""
    if os.path.isdir(directory):
        return directory
    if os.path.exists(directory) or directory.count("/") != 1 or directory.startswith(("/", ".")):
        raise ValueError(f"directory: expected a checkpoint directory, {directory!r} is not a directory")
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError(
            f"directory: {directory!r} is neither a directory nor, without huggingface_hub installed, a "
            f"Hugging Face hub id (pip install huggingface_hub)"
        ) from None
    try:
        return huggingface_hub.snapshot_download(directory, allow_patterns=["*.json", "*.safetensors", "*.jinja"])
    except Exception as e:  # offline, not found, no access: every way the hub can say no
        raise ValueError(
            f"directory: {directory!r} is not a directory, and the Hugging Face hub did not give it "
            f"({type(e).__name__}: {e}); offline, pass a local directory"
        ) from e


def from_pretrained(directory: str, *, backend: str = "auto", dtype=None, mesh=None) -> KDAForCausalLM:
    """Load a checkpoint into a kdax model, by config.json's ``model_type``: "kda" (kdax or FLA's
    ``KDAForCausalLM``), "kimi_linear" (:class:`kdax.models.KimiLinearForCausalLM`),
    "bailing_hybrid" (:class:`kdax.models.BailingHybridForCausalLM`).

    Each parameter's tensors are read (an MoE layer's experts together) and cast to ``dtype``
    as they are read, so the host never holds the whole model (nor, with ``mesh``, a device
    more than its shards).

    Args:
        directory: holds config.json and model.safetensors (or its shards and their index); or
            a Hugging Face hub id ("org/name", fetched with ``huggingface_hub`` when installed).
        backend: the KDA layers' backend.
        dtype: if given, the weights' dtype (see :meth:`KDAForCausalLM.astype`).
        mesh: if given, the model is laid out on it as :func:`kdax.models.shard` does, each
            tensor placed as it is read.

    Returns:
        The model.

    Raises:
        ValueError: a file is missing, truncated or corrupt (the error names it), a hub id
            cannot be fetched, or a tensor is missing, left over or of the wrong shape (the
            error names the tensor).
    """
    directory = _resolve(directory)
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"directory: expected a config.json in {directory!r}")
    d = _read_json(path)
    model_type = d.get("model_type", "kda")
    if model_type != "kda" and model_type not in hybrids.MODELS:
        raise ValueError(
            f"directory: expected config.json's model_type in {('kda', *hybrids.MODELS)}, got {model_type!r} in {path!r}"
        )
    cls = KDAForCausalLM if model_type == "kda" else hybrids.MODELS[model_type]
    config = cls.config_class.from_dict(d)
    model = nnx.eval_shape(lambda: cls(config, backend=backend, rngs=nnx.Rngs(0)))
    if dtype is not None:
        model.astype(dtype)
    model = load_state_dict(model, _Tensors(directory), mesh)
    return model if mesh is None else sharding.shard(model, mesh)
