"""Kascade's quality on a trained model: perplexity of held-out text and recall of dense attention
mass, dense against Kascade and against baselines with the same key budget.

Methods (every full-attention layer but the schedule's first, which stays dense):
  kascade          the schedule calibrated by output error: anchors select, reuse layers read
                   their anchor's heads by head map
  kascade_mass     the schedule calibrated by attention mass (the Kascade paper's objective)
  kascade_no_remap kascade's anchors, each reuse head reading the anchor head of its own index
  sink_window      the first 4 keys and the most recent keys before the tile, the same budget k_t
                   (with pools: the first pool and the latest whole pools before the tile's own block)
  random           k_t keys drawn uniformly from those before the tile (seeded; with pools, whole pools)
  oracle           every layer an anchor: each selects from its own exact attention (the most
                   mass a budget can keep; it costs the anchors' full attention in every layer)

Run: ``python -m kdax.bench.kascade_quality --checkpoint DIR`` (docs/kascade.md has the study).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kdax.models import KDAForCausalLM
from kdax.models.kascade import OBJECTIVES, calibrate, sparse_pass
from kdax.ops.kascade.checks import percent_tenths, pool_count, prefill_k_max
from kdax.ops.kascade.schedule import KascadeSchedule

SINKS = 4
METHODS = ("dense", "kascade", "kascade_mass", "kascade_no_remap", "sink_window", "random", "oracle")


def baseline_indices(kind: str, B: int, G: int, T: int, schedule: KascadeSchedule, seed: int = 0) -> np.ndarray:
    """A content-blind selection with Kascade's budgets: [B, G, NT, k_max] int32, ascending, -1-padded.

    Args:
        kind: "sink_window" (the first ``SINKS`` keys, or with pools the first pool, and the latest
            before the tile's own block) or "random".
        B, G, T: rows, KV heads, tokens.
        schedule: its topk_percent, min_k, tile_size and pool_size set the budgets.
        seed: the random selection's seed.
    """
    tile, P, tenths = schedule.tile_size, schedule.pool_size, percent_tenths(schedule.topk_percent)
    NT = -(-T // tile)
    k_max = prefill_k_max(T, tile, tenths, schedule.min_k, P)
    out = np.full((B, G, NT, k_max), -1, np.int32)
    rng = np.random.default_rng(seed)
    for t in range(NT):
        first = t * tile // P  # the whole pools before the tile's own block
        n = int(pool_count(t * tile, tenths, schedule.min_k, P))
        for b in range(B):
            for g in range(G):
                if kind == "sink_window":
                    sinks = min(-(-SINKS // P), n)
                    pools = np.r_[np.arange(sinks), np.arange(first - (n - sinks), first)]
                else:
                    pools = rng.choice(first, n, replace=False) if n else np.zeros(0, int)
                out[b, g, t, : n * P] = (np.sort(pools)[:, None] * P + np.arange(P)).ravel()
    return out


def _perplexity(logits, ids) -> float:
    nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
    return float(math.exp(float(jnp.mean(nll))))


def run_method(model: KDAForCausalLM, ids, method: str, schedule: KascadeSchedule, seed: int = 0):
    """One method on rows ``ids`` [B, T]: (logits [B, T, vocab], per full-attention layer the
    share of its attention mass the keys it attended keep, measured on this run:
    :func:`kdax.models.kascade.sparse_pass`). ``schedule`` is the calibrated one, at the budget (None for "dense")."""
    if method == "dense":
        return sparse_pass(model, ids)
    B, T = ids.shape
    G = model.model.layers[schedule.layers[0]].attn.num_kv_heads
    if method in ("kascade", "kascade_mass"):
        return sparse_pass(model, ids, schedule=schedule)
    if method == "kascade_no_remap":
        same = {layer: tuple(range(G)) for layer in schedule.head_maps}
        return sparse_pass(model, ids, schedule=dataclasses.replace(schedule, head_maps=same))
    if method == "oracle":
        return sparse_pass(model, ids, schedule=dataclasses.replace(schedule, anchors=schedule.layers, head_maps={}))
    idx = jnp.asarray(baseline_indices(method, B, G, T, schedule, seed))
    return sparse_pass(model, ids, schedule=schedule, fixed=dict.fromkeys(schedule.layers[1:], idx))


def evaluate(model: KDAForCausalLM, schedules: dict, ids, topk_percent: float, seed: int = 0) -> list[dict]:
    """Perplexity and per-layer recall of every method at one budget.

    Args:
        model: the trained model.
        schedules: the calibrated schedules by objective, "output" and "mass" (their budget is
            replaced by ``topk_percent``); "kascade_mass" runs the mass one, the other methods
            the output one's anchors and maps.
        ids: [B, T] held-out tokens.
        topk_percent: the budget.
        seed: the random baseline's seed.

    Returns:
        One dict per method: method, topk_percent, perplexity, recall (per full-attention layer, the
        kept share of its attention mass, measured on the method's own run).
    """
    rows = []
    for method in METHODS:
        sched = dataclasses.replace(
            schedules["mass" if method == "kascade_mass" else "output"], topk_percent=topk_percent
        )
        logits, kept = run_method(model, ids, method, sched, seed)
        rows.append(
            {
                "method": method,
                "topk_percent": topk_percent,
                "pool_size": sched.pool_size,
                "perplexity": _perplexity(logits, ids),
                "recall": [round(r, 4) for r in kept],
            }
        )
    return rows


def format_table(rows: list[dict], layers: list[int]) -> str:
    """The study as a markdown table."""
    head = "| budget | pool | method | perplexity | " + " | ".join(f"recall L{layer}" for layer in layers) + " |"
    lines = [head, "|" + "---|" * (4 + len(layers))]
    for r in rows:
        dense = r["method"] == "dense"
        budget_txt, pool_txt = ("-", "-") if dense else (f"{r['topk_percent']:g}%", str(r.get("pool_size", 1)))
        lines.append(
            f"| {budget_txt} | {pool_txt} | {r['method']} | {r['perplexity']:.3f} | "
            + " | ".join(f"{x:.3f}" for x in r["recall"])
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from kdax.models import from_pretrained
    from kdax.train import load_corpus

    p = argparse.ArgumentParser(
        prog="python -m kdax.bench.kascade_quality",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="the trained model (FLA format)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row, calibration and evaluation")
    p.add_argument("--calib-rows", type=int, default=4, help="calibration rows, from the start of the corpus")
    p.add_argument("--eval-rows", type=int, default=4, help="evaluation rows, from the held-out end of the corpus")
    p.add_argument("--holdout", type=float, default=0.1, help="the corpus share at its end kept out of training")
    p.add_argument("--anchors", type=int, default=2, help="anchors of the schedule")
    p.add_argument("--min-k", type=int, default=32, help="the least keys a tile keeps")
    p.add_argument("--tile-size", type=int, default=32, help="queries per tile")
    p.add_argument("--pool-sizes", default="1", help="keys per selected pool: 1 (tokens) and block sizes to compare")
    p.add_argument("--budgets", default="10,20", help="topk_percent values to evaluate")
    p.add_argument(
        "--schedule-out", default=None, help="write the first budget's output-calibrated schedule here (JSON)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ns = p.parse_args(argv)
    tokens = load_corpus(None)
    held = tokens[tokens.size - int(ns.holdout * tokens.size) :]
    L = ns.seq_len
    calib = np.stack([tokens[i * L : (i + 1) * L] for i in range(ns.calib_rows)]).astype(np.int32)
    if held.size < ns.eval_rows * L:
        raise SystemExit(f"the held-out text holds {held.size} tokens, fewer than --eval-rows x --seq-len")
    ev = jnp.asarray(np.stack([held[i * L : (i + 1) * L] for i in range(ns.eval_rows)]), jnp.int32)
    model = from_pretrained(ns.checkpoint)
    budgets = [float(b) for b in ns.budgets.split(",")]
    pools = [int(n) for n in ns.pool_sizes.split(",")]
    rows, schedules = [], {}
    for pct in budgets:
        for pool in pools:
            opts = {"topk_percent": pct, "min_k": ns.min_k, "tile_size": ns.tile_size, "pool_size": pool}
            for objective in OBJECTIVES:
                print(
                    f"calibrating by {objective} at {pct:g}%, pools of {pool}, on {ns.calib_rows} x {L} tokens...",
                    file=sys.stderr,
                    flush=True,
                )
                schedules[pct, pool, objective] = calibrate(model, calib, ns.anchors, objective=objective, **opts)
                print(f"  {schedules[pct, pool, objective]}", file=sys.stderr, flush=True)
            print(f"evaluating on {ns.eval_rows} x {L} held-out tokens...", file=sys.stderr, flush=True)
            got = evaluate(model, {o: schedules[pct, pool, o] for o in OBJECTIVES}, ev, pct)
            rows += [r for r in got if r["method"] != "dense" or not rows]
    first = schedules[budgets[0], pools[0], OBJECTIVES[0]]
    if ns.schedule_out:
        first.save(ns.schedule_out)
    meta = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "command": " ".join(sys.argv),
        "schedules": {f"{pct:g}% pool {n} {o}": json.loads(s.to_json()) for (pct, n, o), s in schedules.items()},
    }
    layers = list(first.layers)
    print(json.dumps({"meta": meta, "rows": rows}, indent=1) if ns.json else format_table(rows, layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
