"""Serve a stream of requests with continuous batching: requests arrive while others decode.

    python examples/serve.py                          # the tiny preset, random weights
    python examples/serve.py --checkpoint checkpoints/tiny/model --draft 4 --prefix-cache 8
    python examples/serve.py --checkpoint checkpoints/tiny/model --draft 4 --temperature 0.8

Each loop iteration admits the requests that have arrived, runs one compiled step
(``kdax.serving.Scheduler.step``: prompt chunks beside decode tokens, or draft tokens to verify)
and prints what each request emitted. An engine would put its own queue, sampling and
streaming around the same calls (docs/serving.md).
"""

import argparse

import numpy as np
from flax import nnx

from kdax.models import from_pretrained, tiny_config
from kdax.models.kda import KDAForCausalLM
from kdax.serving import Scheduler, prompt_lookup

PROMPTS = [b"ROMEO:", b"JULIET: O Romeo, Romeo!", b"To be, or not to be", b"KING LEAR:\nBlow, winds", b"First Citizen:"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a model directory (kdax train's out_dir/model); default: random weights")
    p.add_argument("--requests", type=int, default=12, help="requests in the stream")
    p.add_argument("--concurrency", type=int, default=4, help="requests served at once")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--draft", type=int, default=0, help="prompt-lookup draft tokens per step (0: none)")
    p.add_argument("--prefix-cache", type=int, default=0, help="prompt prefixes kept (0: none)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampling (drafts too)")
    ns = p.parse_args()
    model = from_pretrained(ns.checkpoint) if ns.checkpoint else KDAForCausalLM(tiny_config(), rngs=nnx.Rngs(0))
    draft = {"draft": prompt_lookup, "num_draft": ns.draft} if ns.draft else {}
    scheduler = Scheduler(
        model,
        max_requests=ns.concurrency,
        max_length=256,
        chunk_size=16,
        prefix_cache=ns.prefix_cache,
        temperature=ns.temperature,
        **draft,
    )
    rng = np.random.default_rng(0)
    arrivals = np.sort(rng.integers(0, 3 * ns.requests, ns.requests))  # the step each request arrives at
    texts, step = {}, 0
    while step <= arrivals[-1] or not scheduler.idle:
        for i in np.flatnonzero(arrivals == step):
            prompt = PROMPTS[i % len(PROMPTS)]
            rid = scheduler.add(list(prompt), ns.new_tokens)
            texts[rid] = bytearray(prompt)
            print(f"step {step:3d}: request {rid} arrives ({len(prompt)} prompt bytes)")
        emitted, finished = scheduler.step()
        for rid, tokens in emitted.items():
            texts[rid] += bytes(t % 256 for t in tokens)
        for rid in finished:
            print(f"step {step:3d}: request {rid} done: {bytes(texts[rid]).decode(errors='replace')!r}")
        step += 1
    print(f"{step} steps; compiled step shapes (rows, tokens per row, verify): {dict(scheduler.steps)}")
    print(
        f"prefix-cache hits: {scheduler.prefix_hits}; draft tokens accepted: {scheduler.accepted}/{scheduler.drafted}"
    )


if __name__ == "__main__":
    main()
