"""Kascade where long-range retrieval decides: a small hybrid trained on the shipped text with
key-value records planted early in each document and queried at its end, then dense attention,
Kascade (both calibrations) and the baselines of :mod:`kdax.bench.kascade_quality` compared on
recall accuracy and text perplexity at several document lengths.

A document of ``length`` bytes is a window of the text in which ``records`` records
``{kkkk|vvvv}`` (4 lowercase letters, 4 digits; the braces and the bar never occur in the text)
replace the text at random places in its first quarter; its last ``queries`` records repeat
keys planted earlier, each with its value. A query is recalled when the model's greedy
prediction of all 4 value bytes is right (teacher-forced). Text perplexity is over the
document's text bytes only (not the records).

    python -m kdax.bench.kascade_retrieval train --out runs/retrieval
    python -m kdax.bench.kascade_retrieval study --checkpoint runs/retrieval/model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kdax.bench import flags
from kdax.bench.kascade_quality import METHODS, run_method
from kdax.models import KDAForCausalLM, from_pretrained
from kdax.models.kascade import OBJECTIVES, calibrate
from kdax.models.kda import full_attention_layers
from kdax.models.presets import attn8_config
from kdax.ops.common.validation import fail

KEY, VALUE = 4, 4
RECORD = KEY + VALUE + 3


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: tokens [length] uint8; values [queries, VALUE] the positions of the queried
    value bytes; text [length] bool, the bytes that are text (not records)."""

    tokens: np.ndarray
    values: np.ndarray
    text: np.ndarray


def _record(rng: np.random.Generator) -> tuple[bytes, bytes]:
    key = bytes(rng.integers(ord("a"), ord("z") + 1, KEY).tolist())
    return key, bytes(rng.integers(ord("0"), ord("9") + 1, VALUE).tolist())


def document(text: np.ndarray, length: int, rng: np.random.Generator, records: int = 16, queries: int = 8) -> Document:
    """A document of ``length`` bytes from a random window of ``text`` (see the module docstring).

    Raises:
        ValueError: the records and queries do not fit the document, or the text is shorter.
    """
    if queries > records or records * RECORD > length // 4 or length > text.size:
        fail("length", f"room for {records} records in its first quarter and at most {text.size} bytes", length)
    start = int(rng.integers(0, text.size - length + 1))
    tokens = text[start : start + length].copy()
    is_text = np.ones(length, bool)
    pairs = {}
    while len(pairs) < records:
        key, value = _record(rng)
        pairs.setdefault(key, value)
    pairs = list(pairs.items())
    early = np.sort(rng.choice(length // 4 // RECORD, records, replace=False)) * RECORD
    asked = rng.choice(records, queries, replace=False)
    late = length - queries * RECORD + np.arange(queries) * RECORD
    for (key, value), at in [*zip(pairs, early), *((pairs[i], at) for i, at in zip(asked, late))]:
        tokens[at : at + RECORD] = np.frombuffer(b"{" + key + b"|" + value + b"}", np.uint8)
        is_text[at : at + RECORD] = False
    values = late[:, None] + KEY + 2 + np.arange(VALUE)
    return Document(tokens, values, is_text)


def split_text(holdout: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(training text, held-out text): the shipped corpus and its last ``holdout`` share."""
    from kdax.train import load_corpus

    tokens = load_corpus(None)
    cut = tokens.size - int(holdout * tokens.size)
    return tokens[:cut], tokens[cut:]


def train_model(
    out: str,
    *,
    steps: int,
    batch_size: int,
    lengths: tuple[int, ...],
    lr: float,
    seed: int = 0,
    checkpoint_every: int = 500,
    resume: bool = False,
    progress: bool = True,
) -> list[float]:
    """Train the attn8 preset on retrieval documents of the training text, a length from
    ``lengths`` drawn per step (one compilation per length), with :func:`kdax.train.train`: the
    training state in ``out/state`` every ``checkpoint_every`` steps, ``lengths`` among its
    settings (``resume`` continues it exactly), the weights in ``out/model``.

    Returns:
        The loss of every step this call ran.

    Raises:
        ValueError: as :func:`kdax.train.train` (``out`` holds a training state and ``resume``
            is off, or none and it is on; settings, ``lengths`` included, that differ from the
            checkpoint's).
    """
    from kdax.train import TrainConfig, train

    train_text, _ = split_text()
    cfg = TrainConfig(
        preset="attn8",
        steps=steps,
        batch_size=batch_size,
        seq_len=max(lengths),
        lr=lr,
        warmup=min(50, steps // 10),
        weight_decay=0.01,
        seed=seed,
        checkpoint_every=checkpoint_every,
        out_dir=out,
    )

    def batches(rng: np.random.Generator) -> np.ndarray:
        n = int(rng.choice(lengths))
        return np.stack([document(train_text, n + 1, rng).tokens for _ in range(batch_size)]).astype(np.int32)

    model = KDAForCausalLM(attn8_config(), rngs=nnx.Rngs(seed))
    settings = {"lengths": list(lengths)}
    return train(model, train_text, cfg, progress=progress, resume=resume, batches=batches, settings=settings)


def _scores(logits, doc: Document) -> tuple[float, int, int, int]:
    """(text negative log-likelihood summed, over how many bytes; queries recalled, of how many)."""
    logits = np.asarray(logits, np.float32)
    ids = doc.tokens.astype(np.int32)
    nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits[:-1], ids[1:]))
    text = doc.text[1:] & doc.text[:-1]  # a text byte predicted from text
    guess = logits.argmax(-1)
    recalled = int((guess[doc.values - 1] == ids[doc.values]).all(-1).sum())
    return float(nll[text].sum()), int(text.sum()), recalled, len(doc.values)


def study(
    model: KDAForCausalLM,
    *,
    lengths,
    budgets,
    calib_docs: int,
    eval_docs: int,
    anchors: int,
    min_k: int,
    tile: int,
    pool_size: int = 1,
    methods=METHODS,
) -> tuple[list[dict], dict]:
    """Every method at every length and budget: recall accuracy, text perplexity and, per layer,
    the share of the layer's attention mass the method's keys keep, measured on the method's run.
    Calibration: per budget and objective, on ``calib_docs`` documents of the training text at
    the shortest length. Returns (rows, schedules by (budget, objective))."""
    train_text, held = split_text()
    rng = np.random.default_rng(0)
    calib = np.stack([document(train_text, min(lengths), rng).tokens for _ in range(calib_docs)]).astype(np.int32)
    schedules = {}
    for pct in budgets if set(methods) - {"dense"} else []:
        for objective in OBJECTIVES:
            t0 = time.perf_counter()
            schedules[pct, objective] = calibrate(
                model,
                calib,
                anchors,
                topk_percent=pct,
                min_k=min_k,
                tile_size=tile,
                pool_size=pool_size,
                objective=objective,
            )
            print(
                f"{pct:g}% {objective}: {time.perf_counter() - t0:.0f} s, {schedules[pct, objective]}", file=sys.stderr
            )
    rows = []
    for length in lengths:
        docs = [document(held, length, np.random.default_rng((length, i))) for i in range(eval_docs)]
        for pct in budgets:
            for method in methods:
                if method == "dense" and pct != budgets[0]:
                    continue
                sched = schedules.get((pct, "mass" if method == "kascade_mass" else "output"))
                nll = count = hit = asked = 0
                kept = []
                for doc in docs:
                    ids = jnp.asarray(doc.tokens[None].astype(np.int32))
                    logits, recall = run_method(model, ids, method, sched)
                    a, b, c, d = _scores(logits[0], doc)
                    nll, count, hit, asked = nll + a, count + b, hit + c, asked + d
                    kept.append(recall)
                rows.append(
                    {
                        "length": length,
                        "method": method,
                        "topk_percent": None if method == "dense" else pct,
                        "recall_accuracy": hit / asked,
                        "text_perplexity": math.exp(nll / count),
                        "mass_recall": [round(float(x), 4) for x in np.mean(kept, axis=0)],
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows, schedules


def format_table(rows: list[dict], layers: list[int]) -> str:
    """The study as a markdown table."""
    head = "| T | budget | method | recall accuracy | text perplexity | " + " | ".join(f"mass L{x}" for x in layers)
    lines = [head + " |", "|" + "---|" * (5 + len(layers))]
    for r in rows:
        pct = "-" if r["topk_percent"] is None else f"{r['topk_percent']:g}%"
        cells = [str(r["length"]), pct, r["method"], f"{r['recall_accuracy']:.3f}", f"{r['text_perplexity']:.3f}"]
        lines.append("| " + " | ".join(cells + [f"{x:.3f}" for x in r["mass_recall"]]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kdax.bench.kascade_retrieval", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the attn8 preset on retrieval documents")
    t.add_argument("--out", required=True, help="where the run is saved: state/<step> (for --resume) and model")
    t.add_argument("--steps", type=flags.at_least(1), default=400)
    t.add_argument("--batch-size", type=flags.at_least(1), default=2)
    t.add_argument("--lengths", type=flags.ints, default="1024,2048", help="document lengths, one drawn per step")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-every", type=flags.at_least(0), default=500, help="save the training state (0: never)")
    t.add_argument("--resume", action="store_true", help="continue the newest training state in --out")
    s = sub.add_parser("study", help="compare the methods on held-out retrieval documents")
    s.add_argument("--checkpoint", required=True, help="the trained model (FLA format)")
    s.add_argument("--lengths", type=flags.ints, default="2048,4096,8192", help="document lengths to evaluate")
    s.add_argument("--budgets", default="10,20", help="topk_percent values")
    s.add_argument("--calib-docs", type=flags.at_least(1), default=2, help="calibration documents (training text)")
    s.add_argument("--eval-docs", type=flags.at_least(1), default=8, help="evaluation documents (held-out text)")
    s.add_argument("--anchors", type=flags.at_least(1), default=2)
    s.add_argument("--min-k", type=int, default=32)
    s.add_argument("--tile-size", type=int, default=32)
    s.add_argument("--pool-size", type=int, default=1, help="keys per selected pool (1: tokens)")
    s.add_argument("--methods", default=",".join(METHODS), help="the methods to run, of " + ", ".join(METHODS))
    s.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ns = p.parse_args(argv)
    ns.command_line = " ".join(["python -m kdax.bench.kascade_retrieval", *(sys.argv[1:] if argv is None else argv)])
    if ns.command == "train":
        from kdax.train import Interrupted

        t0 = time.perf_counter()
        try:
            losses = train_model(
                ns.out,
                steps=ns.steps,
                batch_size=ns.batch_size,
                lengths=ns.lengths,
                lr=ns.lr,
                seed=ns.seed,
                checkpoint_every=ns.checkpoint_every,
                resume=ns.resume,
            )
        except ValueError as e:
            p.error(str(e))
        except Interrupted as stop:
            print(f"\n{stop.advice()}", file=sys.stderr)
            return 130
        tail = losses[-20:]
        print(
            f"trained {len(losses)} steps in {(time.perf_counter() - t0) / 60:.1f} min; loss {losses[0]:.3f} -> "
            f"{sum(tail) / len(tail):.3f} (mean of the last {len(tail)}); saved to {ns.out}/model"
        )
        return 0
    methods = tuple(ns.methods.split(","))
    if set(methods) - set(METHODS):
        p.error(f"--methods: expected names among {', '.join(METHODS)}, got {ns.methods!r}")
    model = from_pretrained(ns.checkpoint)
    rows, schedules = study(
        model,
        lengths=ns.lengths,
        budgets=[float(b) for b in ns.budgets.split(",")],
        calib_docs=ns.calib_docs,
        eval_docs=ns.eval_docs,
        anchors=ns.anchors,
        min_k=ns.min_k,
        tile=ns.tile_size,
        pool_size=ns.pool_size,
        methods=methods,
    )
    m = {**flags.meta(ns), "schedules": {f"{pct:g}% {o}": json.loads(x.to_json()) for (pct, o), x in schedules.items()}}
    return flags.emit(ns, m, "rows", rows, format_table(rows, full_attention_layers(model)))


if __name__ == "__main__":
    sys.exit(main())
