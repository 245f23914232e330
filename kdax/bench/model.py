"""``kdax bench model``: prefill and decode tokens/s of a hybrid KDA model with random weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from kdax.bench import flags
from kdax.bench.measure import time_calls
from kdax.models import PRESETS, model_class
from kdax.models.generation import decode_sample, prefill_sample


def run(
    name: str,
    batch: int,
    prompt_len: int,
    decode_steps: int,
    repeats: int,
    dtype: str = "float32",
    progress: bool = True,
) -> dict:
    """Median wall time of a jit-compiled prefill of [batch, prompt_len] tokens and of
    ``decode_steps`` single-token steps after it (greedy, caches preallocated), with the
    weights in ``dtype`` (:meth:`KDAForCausalLM.astype`); ``progress``: a progress bar on stderr."""
    if name not in PRESETS:
        raise ValueError(f"model: expected one of {tuple(PRESETS)}, got {name!r}")
    bar = tqdm(total=5, desc=f"kdax bench model --preset {name}", disable=not progress, leave=False)
    step = lambda what: (bar.set_postfix_str(what), bar.update())
    bar.set_postfix_str("building the model")
    config = PRESETS[name]()
    model = model_class(config)(config, rngs=nnx.Rngs(0)).astype(dtype)
    step("prefill: compiling")
    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (batch, prompt_len), 0, config.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    key = jax.random.key(0)
    prefill = lambda: prefill_sample(graphdef, state, ids, lengths, prompt_len + decode_steps, 0.0, None, None, key)
    token, cache = jax.block_until_ready(prefill())  # compiles
    step("decode step: compiling")

    def decode(tok, c):
        for _ in range(decode_steps):
            tok, c = decode_sample(graphdef, state, tok, c, 0.0, None, None, key)
        return tok

    fresh = lambda: (token, jax.tree.map(jnp.copy, cache))  # decode_sample donates its cache
    jax.block_until_ready(decode(*fresh()))  # compiles
    step(f"prefill: {repeats} timed calls")
    t_prefill = time_calls(prefill, repeats).median / 1e3
    step(f"decode: {repeats} timed runs of {decode_steps} steps")
    t_decode = time_calls(decode, repeats, fresh).median / 1e3
    step("done")
    bar.close()
    return {
        "model": name,
        "dtype": dtype,
        "params": model.num_parameters(),
        "batch": batch,
        "prompt_len": prompt_len,
        "decode_steps": decode_steps,
        "prefill_ms": 1e3 * t_prefill,
        "prefill_tok_s": batch * prompt_len / t_prefill,
        "decode_ms_per_step": 1e3 * t_decode / decode_steps,
        "decode_tok_s": batch * decode_steps / t_decode,
    }


def _rate(x: float) -> str:
    """Tokens/s: whole numbers from 100 up, three significant digits below (0.488, 7.27)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def format_row(r: dict) -> str:
    head = "| model | dtype | params | batch | prompt | prefill ms | prefill tok/s | decode ms/step | decode tok/s |"
    rule = "|" + "---|" * 9
    row = (
        f"| {r['model']} | {r['dtype']} | {r['params'] / 1e6:.1f}M | {r['batch']} | {r['prompt_len']} "
        f"| {r['prefill_ms']:.1f} | {_rate(r['prefill_tok_s'])} | {r['decode_ms_per_step']:.2f} "
        f"| {_rate(r['decode_tok_s'])} |"
    )
    return f"{head}\n{rule}\n{row}"


def register(sub) -> None:
    """``kdax bench model``."""
    p = flags.command(
        sub, "model", _command, "prefill (--B x --T prompt) and decode tokens/s of a model preset, random weights"
    )
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the model (kdax.models.PRESETS)")
    flags.shape(p, B=1, T=1024)
    p.add_argument("--decode-steps", type=flags.at_least(1), default=32, help="decode steps timed after the prefill")
    p.add_argument("--dtype", default="float32", choices=flags.DTYPES, help="the weights' dtype")
    flags.output(p, repeats=5)


def _command(ns, parser) -> int:
    options = {"decode_steps": ns.decode_steps, "repeats": ns.repeats, "dtype": ns.dtype}
    row = run(ns.preset, batch=ns.B, prompt_len=ns.T, **options, progress=not ns.json)
    return flags.emit(ns, flags.meta(ns), "model", row, format_row(row))
