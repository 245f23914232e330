"""``kdax bench serving``: continuous batching (:class:`kdax.serving.Scheduler`) against one
``generate()`` call per request, on a model preset with random weights: output tokens/s, the
median time per output token, and the compiled step's memory."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from kdax.bench import flags
from kdax.bench.measure import Timing
from kdax.models import PRESETS, generate, model_class
from kdax.serving import Scheduler, prompt_lookup


def workload(requests: int, prompt_min: int, prompt_max: int, new_tokens: int, vocab: int, seed: int = 0):
    """``requests`` prompts of lengths uniform in [prompt_min, prompt_max], random ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, rng.integers(prompt_min, prompt_max + 1)).tolist() for _ in range(requests)], [
        new_tokens
    ] * requests


def _serve(scheduler: Scheduler, prompts, new) -> tuple[float, list[float]]:
    """All requests queued at once; (wall seconds, each request's seconds per output token after its first)."""
    first, last, count = {}, {}, {}
    t0 = time.perf_counter()
    ids = [scheduler.add(p, n) for p, n in zip(prompts, new)]
    while not scheduler.idle:
        emitted, _ = scheduler.step()
        now = time.perf_counter()
        for i, toks in emitted.items():
            if toks:
                first.setdefault(i, now)
                last[i], count[i] = now, count.get(i, 0) + len(toks)
    wall = time.perf_counter() - t0
    return wall, [(last[i] - first[i]) / max(count[i] - 1, 1) for i in ids]


def _generate(model, prompts, new, temperature: float = 0.0) -> tuple[float, list[float]]:
    """One generate() call per request, one after another."""
    wall, per_token = 0.0, []
    for i, (p, n) in enumerate(zip(prompts, new)):
        t0 = time.perf_counter()
        rng = jax.random.key(i)
        jax.block_until_ready(generate(model, jnp.asarray([p], jnp.int32), n, temperature=temperature, rng=rng))
        dt = time.perf_counter() - t0
        wall += dt
        per_token.append(dt / n)
    return wall, per_token


def run(
    name: str,
    concurrency: int,
    requests: int,
    prompt_min: int,
    prompt_max: int,
    new_tokens: int,
    repeats: int,
    chunk_size: int = 64,
    draft: int = 0,
    temperature: float = 0.0,
    progress: bool = True,
) -> dict:
    """Time serving ``requests`` requests ``concurrency`` at a time, and generate() per request,
    each after an untimed warm-up run (which compiles every step bucket and prompt shape); greedy,
    or sampling at ``temperature`` (drafts verified by speculative sampling)."""
    if name not in PRESETS:
        raise ValueError(f"model: expected one of {tuple(PRESETS)}, got {name!r}")
    config = PRESETS[name]()
    model = model_class(config)(config, rngs=nnx.Rngs(0))
    prompts, new = workload(requests, prompt_min, prompt_max, new_tokens, config.vocab_size)
    max_length = prompt_max + new_tokens + draft
    max_length = -(-max_length // chunk_size) * chunk_size

    def scheduler():
        kw = {"draft": prompt_lookup, "num_draft": draft} if draft else {}
        return Scheduler(
            model,
            max_requests=concurrency,
            max_length=max_length,
            chunk_size=chunk_size,
            temperature=temperature,
            **kw,
        )

    bar = tqdm(total=2 * (repeats + 1), desc=f"kdax bench serving --preset {name}", disable=not progress, leave=False)
    served, baseline = [], []
    for i in range(repeats + 1):  # the first of each: warm-up (compilation)
        bar.set_postfix_str("serving" + (" (compiling)" if i == 0 else ""))
        s = scheduler()
        result = _serve(s, prompts, new)
        served += [result] if i else []
        bar.update()
        bar.set_postfix_str("generate() per request" + (" (compiling)" if i == 0 else ""))
        result = _generate(model, prompts, new, temperature)
        baseline += [result] if i else []
        bar.update()
    bar.close()
    out_tokens = sum(new)
    rate = lambda runs: Timing.of([out_tokens / w for w, _ in runs])
    tpot = lambda runs: Timing.of([1e3 * float(np.median(t)) for _, t in runs])
    memory = s.step_memory(concurrency, chunk_size)
    return {
        "model": name,
        "concurrency": concurrency,
        "requests": requests,
        "prompt_len": [prompt_min, prompt_max],
        "new_tokens": new_tokens,
        "draft": draft,
        "temperature": temperature,
        "served_tok_s": rate(served)._asdict(),
        "served_ms_per_token": tpot(served)._asdict(),
        "generate_tok_s": rate(baseline)._asdict(),
        "generate_ms_per_token": tpot(baseline)._asdict(),
        "steps": {f"{n}x{c}{' verify' if v else ''}": k for (n, c, v), k in sorted(s.steps.items())},
        "drafts_accepted": [s.accepted, s.drafted],
        "pool_mib": sum(x.nbytes for x in jax.tree.leaves(s.pool)) / 2**20,
        "step_temp_mib": memory / 2**20,
    }


def _spread(t: dict, fmt: str) -> str:
    return f"{t['median']:{fmt}} ({t['q25']:{fmt}}-{t['q75']:{fmt}})"


def _drafts(r: dict) -> str:  # " +draft 3 (412/1020 accepted), T=0.8"
    accepted, drafted = r["drafts_accepted"]
    text = f" +draft {r['draft']} ({accepted}/{drafted} accepted)" if r["draft"] else ""
    return text + (f", T={r['temperature']:g}" if r["temperature"] else "")


def format_rows(rows: list[dict]) -> str:
    head = (
        "| model | concurrent | requests | prompt | new | served tok/s | generate() tok/s | served ms/token "
        "| generate() ms/token | pool MiB | step temp MiB |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['model']}{_drafts(r)} | {r['concurrency']} "
            f"| {r['requests']} | {r['prompt_len'][0]}-{r['prompt_len'][1]} | {r['new_tokens']} "
            f"| {_spread(r['served_tok_s'], ',.0f')} | {_spread(r['generate_tok_s'], ',.0f')} "
            f"| {_spread(r['served_ms_per_token'], '.2f')} | {_spread(r['generate_ms_per_token'], '.2f')} "
            f"| {r['pool_mib']:.1f} | {r['step_temp_mib']:.1f} |"
        )
    return "\n".join(lines)


def register(sub) -> None:
    """``kdax bench serving``."""
    p = flags.command(
        sub,
        "serving",
        _command,
        "continuous batching of mixed-length requests against generate() per request, random weights",
    )
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the model (kdax.models.PRESETS)")
    p.add_argument(
        "--concurrency", type=flags.ints, default=(8,), help="requests served at once, a comma-separated list"
    )
    p.add_argument("--requests", type=flags.at_least(1), default=16, help="requests per run")
    p.add_argument("--prompt-min", type=flags.at_least(1), default=8, help="the shortest prompt")
    p.add_argument("--prompt-max", type=flags.at_least(1), default=128, help="the longest prompt")
    p.add_argument("--new-tokens", type=flags.at_least(1), default=32, help="tokens generated per request")
    p.add_argument("--chunk-size", type=flags.at_least(16), default=64, help="prompt tokens per step, a multiple of 16")
    p.add_argument("--draft", type=flags.at_least(0), default=0, help="prompt-lookup draft tokens per step (0: none)")
    p.add_argument(
        "--temperature",
        type=flags.number(float, lambda x: 0 <= x < float("inf"), "a finite float >= 0"),
        default=0.0,
        help="0: greedy; else sampling, drafts verified by speculative sampling",
    )
    flags.output(p, repeats=3)


def _command(ns, parser) -> int:
    if ns.prompt_max < ns.prompt_min:
        parser.error(f"--prompt-max: expected >= --prompt-min={ns.prompt_min}, got {ns.prompt_max}")
    if ns.chunk_size % 16:
        parser.error(f"--chunk-size: expected a multiple of 16 (the page size), got {ns.chunk_size}")
    rows = [
        run(
            ns.preset,
            c,
            ns.requests,
            ns.prompt_min,
            ns.prompt_max,
            ns.new_tokens,
            ns.repeats,
            chunk_size=ns.chunk_size,
            draft=ns.draft,
            temperature=ns.temperature,
            progress=not ns.json,
        )
        for c in ns.concurrency
    ]
    return flags.emit(ns, flags.meta(ns), "serving", rows, format_rows(rows))
