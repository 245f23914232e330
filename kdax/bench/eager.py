"""``kdax bench eager``: what a call costs without ``jax.jit`` around it.

For chunk_kda (B=1 T=1024 H=4 K=V=64), fused_recurrent_kda (one token, the decode step), the
tiny model's forward (B=1 T=128) and generate() (16 new tokens), the median time of an eager
call after the first against the same call under ``jax.jit``; for generate(), its first call
(which compiles) against a repeat with the same shapes and settings.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import kdax
from kdax.bench import flags
from kdax.bench.kda import make_inputs
from kdax.bench.measure import time_calls
from kdax.models import KDAForCausalLM, generate, tiny_config


def run(repeats: int = 20) -> list[dict]:
    """Rows of {what, eager_ms, jit_ms: [median, p25, p75], ratio of the medians}; generate's row
    compares its first call (one time) with repeated ones."""
    rows = []

    def row(what, eager, jitted):
        e, j = time_calls(eager, repeats), time_calls(jitted, repeats)
        rows.append({"what": what, "eager_ms": e, "jit_ms": j, "ratio": e[0] / j[0]})

    args = make_inputs(1, 1024, 4, 64, 64, jnp.float32)
    chunk, recurrent = jax.jit(kdax.chunk_kda), jax.jit(kdax.fused_recurrent_kda)
    row("chunk_kda B=1 T=1024 H=4 K=V=64", lambda: kdax.chunk_kda(*args), lambda: chunk(*args))
    one = [a[:, :1] for a in args]
    row("fused_recurrent_kda, one token", lambda: kdax.fused_recurrent_kda(*one), lambda: recurrent(*one))
    model = KDAForCausalLM(tiny_config(), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(0), (1, 128), 0, model.config.vocab_size, jnp.int32)
    forward = nnx.jit(lambda m, x: m(x))
    row("tiny model forward B=1 T=128", lambda: model(ids), lambda: forward(model, ids))
    prompt = ids[:, :32]
    t0 = time.perf_counter()
    jax.block_until_ready(generate(model, prompt, 16))
    first = 1e3 * (time.perf_counter() - t0)
    again = time_calls(lambda: generate(model, prompt, 16), repeats)
    rows.append(
        {
            "what": "generate() 32 + 16 tokens: first call vs repeats",
            "eager_ms": [first] * 3,
            "jit_ms": again,
            "ratio": first / again[0],
        }
    )
    return rows


def format_table(rows: list[dict]) -> str:
    ms = lambda t: f"{t[0]:.2f} ({t[1]:.2f}-{t[2]:.2f})" if t[1] != t[2] else f"{t[0]:.0f}"
    lines = ["| call | eager ms, median (IQR) | under jax.jit ms, median (IQR) | eager / jit |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {ms(r['eager_ms'])} | {ms(r['jit_ms'])} | {r['ratio']:.1f}x |")
    return "\n".join(lines)


def register(sub) -> None:
    """``kdax bench eager``."""
    p = flags.command(sub, "eager", _command, "eager calls of the ops and the tiny model against jitted ones")
    flags.output(p, repeats=20)


def _command(ns, parser) -> int:
    if not ns.json:
        print("kdax bench eager: compiling each call, then timing it eager and jitted...", file=sys.stderr, flush=True)
    rows = run(ns.repeats)
    return flags.emit(ns, flags.meta(ns), "eager", rows, format_table(rows))
