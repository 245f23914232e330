"""One vLLM engine run on CPU devices through kdax's plugin, in its own process (run by
tests/integrations/test_vllm_engine.py): ``python vllm_engine_worker.py CHECKPOINT SCENARIO``
prints one JSON line: the generated tokens of each prompt, and each step's (computed, new tokens,
state slot, attention group) of each scheduled request (the model's call records them)."""

import json
import os
import sys

os.environ.update(
    JAX_PLATFORMS="cpu",
    KDAX_VLLM_CPU="1",
    SKIP_JAX_PRECOMPILE="1",
    NEW_MODEL_DESIGN="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
)
if {"tp2", "dp2"} & set(sys.argv[2].split("+")):  # a scenario's parts: e.g. "dp2+align"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kdax.integrations.vllm_tpu import engine  # noqa: E402

STEPS = []
_call = engine.KdaxForCausalLM.__call__


def _recording_call(self, kv_caches, input_ids, attention_metadata, *args, **kwargs):
    md = attention_metadata["layer.0"] if isinstance(attention_metadata, dict) else attention_metadata

    def record(qsl, seq_lens, slots):
        groups = len(qsl) - len(seq_lens)  # data-parallel attention: each group's requests, offsets from 0
        lengths = np.diff(np.asarray(qsl).reshape(groups, -1), axis=1).reshape(-1)
        group = np.arange(len(seq_lens)) // (len(seq_lens) // groups)
        rows = zip(np.asarray(seq_lens), lengths, np.asarray(slots), group)
        STEPS.append([(int(s - n), int(n), int(slot), int(g)) for s, n, slot, g in rows if n > 0])

    slots = md.mamba_state_indices if md.mamba_state_indices is not None else -md.seq_lens  # none in align mode
    jax.debug.callback(record, md.query_start_loc, md.seq_lens, slots)
    return _call(self, kv_caches, input_ids, attention_metadata, *args, **kwargs)


engine.KdaxForCausalLM.__call__ = _recording_call

from vllm import LLM, SamplingParams  # noqa: E402


def main(checkpoint: str, scenario: str, prompts: list[list[int]], max_tokens: int) -> None:
    options = {"enable_prefix_caching": False}
    sharding = {"device_indexes": [0], "enable_dp_attention": True}
    parts = set(scenario.split("+"))
    if "spec" in parts:
        options["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
    extra = {"sharding": {"sharding_strategy": sharding}}
    if "gather" in parts:  # attention weights split over the attention groups, gathered where used
        extra["kdax"] = {"gather_attention_weights": True}
    if "align" in parts:
        options = {"enable_prefix_caching": True, "mamba_cache_mode": "align"}
    if parts & {"tp2", "dp2"}:
        options["tensor_parallel_size"] = 2
        del sharding["device_indexes"]
        if "dp2" in parts:  # two attention groups of one device each
            sharding["attn_dp_size"] = 2
    llm = LLM(
        model=checkpoint,
        skip_tokenizer_init=True,
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        block_size=16,
        num_gpu_blocks_override=64,
        dtype="float32",
        additional_config=extra,
        **options,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)  # as generate()
    if "align" in parts:  # one after the other: the second finds the first's blocks cached
        out = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts]
    else:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [list(o.outputs[0].token_ids) for o in out]
    print("RESULT " + json.dumps({"tokens": tokens, "steps": STEPS}), flush=True)


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    main(sys.argv[1], sys.argv[2], request["prompts"], request["max_tokens"])
