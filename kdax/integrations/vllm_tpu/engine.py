"""kdax's Kimi Linear, Ling and GLM-5.3-Flash models as tpu-inference models (vLLM's TPU engine).

:class:`KdaxForCausalLM` is what tpu-inference's model runner builds and calls: constructed
as ``cls(vllm_config, rng, mesh)``, called with the engine's caches and
``AttentionMetadata`` (:mod:`kdax.integrations.vllm_tpu.step` runs the step), and asked for
``compute_logits(hidden)``. :func:`patch_cache_specs` makes the engine allocate a state pool for
each KDA layer: tpu-inference builds attention and MLA cache specs only for JAX models.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from kdax.integrations.vllm_tpu.step import StateSlots, StepBatch, StepMesh, forward, kda_state_shapes, page_width
from kdax.models import from_pretrained
from kdax.models.kda import is_kda
from kdax.ops.common.sharding import axis_size

ARCHITECTURES = ("KimiLinearForCausalLM", "BailingHybridForCausalLM", "Glm5NextForConditionalGeneration")


class KdaxForCausalLM(nnx.Module):
    """A Hugging Face checkpoint of Kimi Linear, Ling or GLM-5.3-Flash (its text model) served by
    tpu-inference on kdax's model.

    Args:
        vllm_config: the engine's config (model path and dtype, cache mode, drafts).
        rng_key: unused (the weights come from the checkpoint).
        mesh: the engine's device mesh: the weights are placed on it by :func:`_placements`, and the
            step split over it by a :class:`StepMesh` (heads, MLPs, attention groups).

    Raises:
        ValueError: an engine setting the step does not take (a transposed MLA cache).
    """

    # load_format="dummy": tpu-inference builds the model as it is (random weights); otherwise it
    # builds it abstractly and calls load_weights
    _self_manages_sharding = True

    # vLLM's hybrid-model interface: the engine keeps a state pool for the KDA layers
    is_hybrid = True
    has_inner_state = True
    supports_mamba_prefix_caching = True

    def __init__(self, vllm_config, rng_key=None, mesh=None):
        mc = vllm_config.model_config
        self.path, self.mesh = mc.model, mesh
        cls, config = _family(mc.hf_config)
        self.model = cls(config, rngs=nnx.Rngs(0) if rng_key is None else nnx.Rngs(rng_key))
        self.model.astype(jnp.dtype(mc.dtype))
        # the engine's logits are the vocabulary padded to the tensor-parallel size (its runner's rule)
        tp = vllm_config.parallel_config.tensor_parallel_size if vllm_config.parallel_config is not None else 1
        self.vocab_width = -(-config.vocab_size // tp) * tp
        cache = vllm_config.cache_config
        spec = vllm_config.speculative_config
        self.num_spec = int(spec.num_speculative_tokens) if spec is not None else 0
        self.align = getattr(cache, "mamba_cache_mode", "none") == "align"
        self.state_block = int(cache.mamba_block_size or 0) if self.align else 0
        self.page_size = int(cache.block_size)
        options = (getattr(vllm_config, "additional_config", None) or {}).get("kdax", {})
        self.gather = bool(options.get("gather_attention_weights", False))
        from tpu_inference import envs

        if envs.MLA_TRANSPOSE_KV_CACHE:
            raise ValueError("MLA_TRANSPOSE_KV_CACHE: expected it unset (kdax reads pages [page, token, entry])")

    def __call__(
        self,
        kv_caches,
        input_ids,
        attention_metadata,
        inputs_embeds=None,
        input_positions=None,
        layer_name_to_kvcache_index=None,
        lora_metadata=None,
        intermediate_tensors=None,
        is_first_rank=True,
        is_last_rank=True,
    ):
        """One engine step: (kv_caches, hidden [T, hidden_size], [], None)."""
        index = dict(layer_name_to_kvcache_index)
        metadata = lambda i: (
            attention_metadata[f"layer.{i}"] if isinstance(attention_metadata, dict) else attention_metadata
        )
        first = metadata(0)
        layers, caches = [], []
        for i, b in enumerate(self.model.model.layers):
            md, cache = metadata(i), kv_caches[index[f"layer.{i}"]]
            R = md.seq_lens.shape[0]
            table = md.block_tables.reshape(R, -1)
            if is_kda(b):
                layers.append(self._slots(md, table))
                caches.append(tuple(cache))
            else:
                layers.append(table)
                caches.append(cache.reshape(cache.shape[0], self.page_size, -1))
        batch = StepBatch(input_ids, first.input_positions, first.query_start_loc, first.seq_lens, tuple(layers))
        hidden, new = forward(self.model, caches, batch, num_spec=self.num_spec, mesh=self._step_mesh())
        out = list(kv_caches)
        for i, c in enumerate(new):
            j = index[f"layer.{i}"]
            out[j] = c if isinstance(c, tuple) else c.reshape(kv_caches[j].shape)
        return out, hidden, [], None

    def _step_mesh(self) -> StepMesh | None:
        """How the engine's mesh splits the step (:func:`_axes`), or None on one device."""
        if self.mesh is None or self.mesh.size == 1:
            return None
        return StepMesh(self.mesh, *(a if axis_size(self.mesh, a) > 1 else None for a in _axes()))

    def _slots(self, md, table) -> StateSlots:
        """The KDA slots of the requests: the engine's slot per request, or in align mode the
        slots of the state blocks holding the last computed and the last new token."""
        if not self.align:
            return StateSlots(md.mamba_state_indices.astype(jnp.int32))
        groups = 1 if self.mesh is None else axis_size(self.mesh, _axes()[2])  # each group's offsets start at 0
        qsl = md.query_start_loc.reshape(groups, -1)
        lengths = (qsl[:, 1:] - qsl[:, :-1]).reshape(-1)
        computed = md.seq_lens - lengths
        col = lambda n: jnp.clip(jnp.maximum(n - 1, 0) // self.state_block, 0, table.shape[1] - 1)[:, None]
        read = jnp.take_along_axis(table, col(computed), 1)[:, 0]
        write = jnp.take_along_axis(table, col(md.seq_lens), 1)[:, 0]
        return StateSlots(write.astype(jnp.int32), read.astype(jnp.int32))

    def load_weights(self, rng_key=None) -> None:
        """Read the checkpoint's weights into host memory, then place each on the mesh, split
        over the engine's tensor-parallel axis (:func:`_placements`)."""
        mesh = None
        if self.mesh is not None:
            shardings = _placements(self.model, self.mesh, gather=self.gather)
            mesh = self.mesh
        with jax.default_device(jax.devices("cpu")[0]):  # host memory, then each tensor to its shards
            state = nnx.state(from_pretrained(self.path, dtype=self.model.dtype))
        if mesh is not None:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            for path, var in nnx.to_flat_state(state):
                var.set_value(jax.device_put(var.get_value(), shardings.get(tuple(path), replicated)))
        nnx.update(self.model, state)

    def modules(self):
        """None: vLLM walks a model's torch submodules at shutdown; this one has none."""
        return ()

    def compute_logits(self, hidden):
        """Logits [T, vocab_width] float32 of hidden states [T, hidden_size]: the vocabulary's,
        then -inf up to the engine's width (the vocabulary padded to the tensor-parallel size),
        which no sampling picks."""
        logits = self.model._logits(hidden)
        pad = self.vocab_width - logits.shape[-1]
        return jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else logits

    # vLLM's hybrid-model interface, read from the Hugging Face config before a model exists
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return kda_state_shapes(_kda_layer(vllm_config.model_config.hf_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        import torch

        dtype = vllm_config.model_config.dtype
        return (dtype if isinstance(dtype, torch.dtype) else torch.bfloat16, torch.float32, torch.int32)

    @classmethod
    def get_mamba_state_copy_func(cls):
        from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec

        return (get_temporal_copy_spec,) * 3


def _axes():
    """The engine's (heads, MLPs and experts, attention groups) axes: tpu-inference's ATTN_HEAD,
    MLP_TENSOR and ATTN_DATA."""
    from tpu_inference.layers.common.sharding import ShardingAxisName

    return ShardingAxisName.ATTN_HEAD, ShardingAxisName.MLP_TENSOR, ShardingAxisName.ATTN_DATA


def _placements(model, mesh, gather: bool = False) -> dict:
    """{parameter path: NamedSharding} on the engine's mesh: kdax's tensor-parallel layout
    (:func:`kdax.models.sharding.tensor_parallel_specs`): the attention layers' projections by
    heads over the engine's attention-head axis (whole on each device of an attention group of
    one), the MLPs' hidden features, the experts, the vocabulary and the embedding's rows over its
    MLP axis. With ``gather`` (``--additional-config '{"kdax": {"gather_attention_weights":
    true}}'``) the attention weights are split over the attention groups too and gathered by each
    layer where it runs: less memory (what fits Kimi Linear 48B's decode on v5e-8), more traffic."""
    from kdax.models.sharding import tensor_parallel_specs

    heads, mlp, groups = _axes()
    g = axis_size(mesh, groups)
    specs = tensor_parallel_specs(
        model,
        axis_size(mesh, mlp),
        mlp,
        attention=(axis_size(mesh, heads), heads),
        gather=(g, groups) if gather and g > 1 else None,
    )
    return {p: jax.sharding.NamedSharding(mesh, s) for p, s in specs.items()}


def _layer_kinds(hf_config) -> tuple[bool, ...]:
    """Whether each layer of a Hugging Face config is a KDA layer."""
    return tuple(t == "linear_attention" for t in _family(hf_config)[1].layer_types)


def _family(hf_config):
    """(kdax's model class, its config) of a Hugging Face config."""
    from kdax.models.hybrids import MODELS

    cls = MODELS[hf_config.model_type]
    return cls, cls.config_class.from_dict(hf_config.to_dict())


def _kda_layer(hf_config):
    """A KDA layer of the config's shapes (abstract: no weights are made)."""
    cls, config = _family(hf_config)
    i = _layer_kinds(hf_config).index(True)
    return nnx.eval_shape(lambda: cls.layer(config, i, backend="xla", rngs=nnx.Rngs(0))[0])


def patch_cache_specs() -> None:
    """Make tpu-inference's ``KVCacheManager.get_kv_cache_spec`` give each KDA layer of kdax's
    architectures a ``MambaSpec`` (the state pool of :func:`kda_state_shapes`), every spec padded
    to one page size as vLLM's hybrid allocator requires. The MLA layers keep the engine's MLA
    specs (Kimi Linear), or, where vLLM takes the family for plain attention (Ling), get pages
    of one head as wide as a latent and rope key (the engine would size them by the config's
    key-value heads). Other models keep the engine's specs."""
    from tpu_inference.runner.kv_cache_manager import KVCacheManager

    original = KVCacheManager.get_kv_cache_spec
    if getattr(original, "_kdax", False):
        return

    @functools.wraps(original)
    def get_kv_cache_spec(self):
        specs = original(self)
        hf = self.runner.model_config.hf_config
        if getattr(hf, "architectures", [None])[0] not in ARCHITECTURES:
            return specs
        kinds = _layer_kinds(hf)
        cls, config = _family(hf)
        width = page_width(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))))
        # a family vLLM does not know as MLA (Ling), or whose entries are wider than an MLA page
        # (GLM-5.3: the indexer's keys beside the latents): pages of one head of the entries' width
        if not self.use_mla or width > config.kv_lora_rank + config.qk_rope_head_dim:
            from tpu_inference import utils
            from tpu_inference.layers.common.sharding import ShardingAxisName

            heads = utils.get_padded_num_heads(
                1, utils.get_mesh_shape_product(self.runner.mesh, ShardingAxisName.ATTN_HEAD)
            )
            width = utils.get_padded_head_dim(width)
            for i, kda in enumerate(kinds):
                if not kda:
                    specs[f"layer.{i}"] = self._create_attention_spec(self.runner.cache_config.block_size, heads, width)
        specs, sizes = _with_state_specs(self.runner.vllm_config, specs, kinds)
        # the engine's own sizing of the state pool (one slot a request and draft, align mode's blocks)
        self._maybe_set_compact_mamba_num_blocks_override(*sizes, kinds.count(False), kinds.count(True))
        return specs

    get_kv_cache_spec._kdax = True
    KVCacheManager.get_kv_cache_spec = get_kv_cache_spec


def _with_state_specs(vllm_config, specs: dict, kinds: tuple[bool, ...]):
    """``specs`` with a MambaSpec for each KDA layer, all padded to one page size; and (an
    attention layer's page bytes, a KDA slot's bytes)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    cache = vllm_config.cache_config
    shapes = KdaxForCausalLM.get_mamba_state_shape_from_config(vllm_config)
    dtypes = KdaxForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
    spec = vllm_config.speculative_config
    state = MambaSpec(
        shapes=shapes,
        dtypes=dtypes,
        block_size=cache.mamba_block_size or vllm_config.model_config.max_model_len,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=getattr(cache, "mamba_cache_mode", "none"),
        num_speculative_blocks=int(spec.num_speculative_tokens) if spec is not None else 0,
    )
    names = [f"layer.{i}" for i in range(len(kinds))]
    attention = [n for n, kda in zip(names, kinds) if not kda]
    num_attn, num_kda = len(attention), len(names) - len(attention)
    attn_page = max(specs[n].page_size_bytes for n in attention)
    # vLLM splits each kind into groups of `group` layers; one tensor holds a layer of every group
    group = max(num_attn, num_kda) if max(num_attn, num_kda) < 1.5 * min(num_attn, num_kda) else min(num_attn, num_kda)
    page = -(-num_attn // group) * attn_page + -(-num_kda // group) * state.page_size_bytes
    out = {}
    for n, kda in zip(names, kinds):
        s = state if kda else specs[n]
        out[n] = dataclasses.replace(s, page_size_padded=page)
    cache.mamba_page_size_padded = page
    return out, (attn_page, state.page_size_bytes)


def register_configs() -> None:
    """Let vLLM read Ling's ``bailing_hybrid`` and GLM-5.3's ``glm5_next`` config.json where the
    installed transformers does not know them (vllm-tpu 0.32.0 pins transformers < 5.20): plain
    ``PretrainedConfig``s of their fields (GLM's text fields as its ``text_config``, a flat file's
    too), which is all the engine reads (kdax reads the checkpoint's config itself)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "bailing_hybrid" not in CONFIG_MAPPING:

        class BailingHybridConfig(PretrainedConfig):
            model_type = "bailing_hybrid"

        AutoConfig.register("bailing_hybrid", BailingHybridConfig)
    if "glm5_next" not in CONFIG_MAPPING:

        class Glm5NextTextConfig(PretrainedConfig):
            model_type = "glm5_next_text"

        class Glm5NextConfig(PretrainedConfig):
            model_type = "glm5_next"
            sub_configs = {"text_config": Glm5NextTextConfig}

            def __init__(self, text_config=None, vision_config=None, **kwargs):
                text = {k: v for k, v in kwargs.items() if k not in ("architectures", "dtype", "torch_dtype")}
                text = text_config if text_config is not None else text
                self.text_config = text if isinstance(text, PretrainedConfig) else Glm5NextTextConfig(**text)
                self.vision_config = vision_config
                super().__init__(**kwargs)

        AutoConfig.register("glm5_next_text", Glm5NextTextConfig)
        AutoConfig.register("glm5_next", Glm5NextConfig)


def enable_cpu() -> None:
    """Let tpu-inference run on CPU devices (tests and trying the plugin out): a nominal memory
    limit a device (``KDAX_VLLM_CPU_MEMORY`` bytes, default 1 GiB), none of the TPU compiler
    options of its step and sampling functions, and synchronous CPU dispatch (with JAX's
    asynchronous CPU dispatch the engine's tokens were wrong from the fourth step in one run of
    two: it reuses host buffers between steps, which CPU arrays may alias). Called by
    :func:`kdax.integrations.vllm_tpu.register` when ``KDAX_VLLM_CPU=1``, before the engine
    loads its runner.

    Raises:
        RuntimeError: tpu-inference's sampling module was loaded before (its jitted sampler then
            holds the TPU options).
    """
    import sys

    from tpu_inference import utils
    from tpu_inference.models.common import compiler_options

    if "tpu_inference.layers.jax.sample.sampling" in sys.modules:
        raise RuntimeError("KDAX_VLLM_CPU: expected it to take effect before tpu-inference loads its sampler")
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    utils.get_device_hbm_limit = lambda: int(os.environ.get("KDAX_VLLM_CPU_MEMORY", 1 << 30))
    compiler_options.get_step_fn_compiler_options = dict
    compiler_options.get_sampling_compiler_options = dict
    loader = sys.modules.get("tpu_inference.models.common.model_loader")
    if loader is not None:
        loader.get_step_fn_compiler_options = dict
