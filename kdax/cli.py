"""The ``kdax`` command line: ``kdax bench [kda|memory|model|serving|kascade|cp|eager|gpu-compare|gpu-tune]``
prints a benchmark's table (each subcommand's flags are its module's, :mod:`kdax.bench`);
``kdax train`` trains the tiny hybrid; ``kdax generate`` continues a prompt with a checkpoint;
``kdax kascade calibrate`` writes a Kascade schedule."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax

import kdax
from kdax import train
from kdax.bench import cp, eager, fla_compare, flags, gpu_tune, kascade, kda, model, serving
from kdax.models.sharding import make_mesh
from kdax.train import TrainConfig


def _initialize(spec: str) -> None:
    """``jax.distributed.initialize`` for ``kdax train --distributed`` (before anything touches a device)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts' collectives across processes
    if spec == "auto":
        jax.distributed.initialize()
        return
    parts = spec.split("/")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"distributed: expected 'auto' or ADDRESS:PORT/PROCESSES/ID, got {spec!r}")
    jax.distributed.initialize(parts[0], int(parts[1]), int(parts[2]))


def _calibrate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """kdax kascade calibrate: the flags and the checkpoint checked before the calibration pass."""
    import numpy as np

    from kdax.models import from_pretrained
    from kdax.models.kascade import calibrate
    from kdax.models.kda import full_attention_layers

    if ns.text is not None and not os.path.isfile(ns.text):
        parser.error(f"--text: expected a text file, {ns.text!r} is not one")
    if not os.path.isfile(os.path.join(ns.checkpoint, "config.json")):
        parser.error(
            f"--checkpoint: expected a model directory with a config.json (kdax train's out_dir/model), "
            f"got {ns.checkpoint!r}"
        )
    tokens = train.load_corpus(ns.text)
    start = ns.offset
    rows = [tokens[start + i * ns.seq_len : start + (i + 1) * ns.seq_len] for i in range(ns.rows)]
    if any(len(r) < ns.seq_len for r in rows):
        parser.error(
            f"--rows: the text holds {tokens.size} tokens, fewer than --offset + --rows x --seq-len = "
            f"{start + ns.rows * ns.seq_len}"
        )
    model = from_pretrained(ns.checkpoint)
    if model.config.vocab_size < 256:
        parser.error(
            f"--checkpoint: its vocab_size {model.config.vocab_size} is too small for byte-level text (256 ids)"
        )
    attention = len(full_attention_layers(model))
    anchors = min(2, attention) if ns.anchors is None else ns.anchors
    if not 1 <= anchors <= attention:
        parser.error(
            f"--anchors: expected an int in [1, {attention}] (the checkpoint's full-attention layers), got {anchors}"
        )
    print(
        f"calibrating by {ns.objective} on {ns.rows} x {ns.seq_len} tokens from token {start}...",
        file=sys.stderr,
        flush=True,
    )
    schedule = calibrate(
        model,
        np.stack(rows).astype(np.int32),
        anchors,
        topk_percent=ns.topk_percent,
        min_k=ns.min_k,
        tile_size=ns.tile_size,
        pool_size=ns.pool_size,
        objective=ns.objective,
    )
    schedule.save(ns.out)
    print(f"anchors {list(schedule.anchors)} of layers {list(schedule.layers)} -> {ns.out}")
    return 0


def _generate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """kdax generate: the checkpoint and its tokenizer loaded, the prompt continued on stdout as
    it is generated; what waits (loading, compiling) and the rates on stderr."""
    import time

    import numpy as np

    from kdax.models import checkpoint, generation
    from kdax.models.tokenizer import Tokenizer

    say = lambda text: print(f"kdax generate: {text}", file=sys.stderr, flush=True)
    try:
        directory = checkpoint._resolve(ns.checkpoint)
        say(f"loading {directory}")
        model = checkpoint.from_pretrained(directory, backend=ns.backend, dtype=ns.dtype)
        tokenizer = Tokenizer(directory, model.config.vocab_size)
        kascade = None if ns.kascade is None else kdax.KascadeSchedule.load(ns.kascade)
        prompt = sys.stdin.read() if ns.prompt == "-" else ns.prompt
        if ns.chat:
            messages = [{"role": "system", "content": ns.system}] if ns.system else []
            ids = tokenizer.chat([*messages, {"role": "user", "content": prompt}])
        else:
            ids = tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt: expected text that gives at least one token")
        rng = jax.random.key(ns.seed)
        steps = generation.stream(
            model,
            np.asarray([ids], np.int32),
            ns.max_new_tokens,
            temperature=ns.temperature,
            top_k=ns.top_k,
            top_p=ns.top_p,
            rng=rng,
            kascade=kascade,
        )
    except ValueError as e:
        parser.error(_flag(e))
    prompt_bucket, cache = generation.buckets(len(ids), ns.max_new_tokens)
    say(
        f"{type(model).__name__}, {model.num_parameters():,} parameters, {tokenizer.name} tokenizer; "
        f"{len(ids)} prompt tokens; compiling for prompts up to {prompt_bucket} tokens and {cache} cached"
    )
    new, shown, start = [], "", time.perf_counter()
    for token in steps:
        token = int(token[0])
        if token in tokenizer.eos_token_ids:
            break
        if not new:
            first = time.perf_counter()
        new.append(token)
        text = tokenizer.decode(new)
        print(text[len(shown) :], end="", flush=True)
        shown = text
    print()
    end = time.perf_counter()
    rate = f", then {(len(new) - 1) / (end - first):.1f} tokens/s" if len(new) > 1 else ""
    say(f"{len(new)} tokens: the first after {first - start if new else end - start:.1f} s (compile included){rate}")
    return 0


# kdax train's defaults where they are not TrainConfig's: the command line always saves the run.
TRAIN_DEFAULTS = {"out_dir": "checkpoints/tiny"}


def _flag(error: ValueError) -> str:  # "steps: expected ..." -> "--steps: expected ..."
    name, _, rest = str(error).partition(": ")
    return f"--{name.replace('_', '-')}: {rest}" if rest and name.isidentifier() else str(error)


def _train(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """kdax train: every setting checked before any work (argparse's one-line error, exit 2)."""
    if ns.distributed:
        _initialize(ns.distributed)
    try:
        cfg = TrainConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)})
        if cfg.mesh:
            make_mesh(cfg.mesh)
        train.check_checkpoints(cfg, ns.resume, ns.overwrite)
    except ValueError as e:
        parser.error(_flag(e))
    if ns.corpus is not None and not os.path.isfile(ns.corpus):
        parser.error(f"--corpus: expected a text file, {ns.corpus!r} is not one")
    try:
        train.main(cfg, ns.corpus, ns.sample_tokens, ns.resume, ns.overwrite)
    except ValueError as e:  # found once the model is built: the step's memory, the corpus's length
        parser.error(_flag(e))
    except train.Interrupted as stop:
        print(f"\nkdax train: {stop.advice()}", file=sys.stderr)
        return 130
    return 0


BENCHES = (kda, model, serving, kascade, cp, eager, fla_compare, gpu_tune)  # each registers its subcommands


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kdax", description="kdax: Kimi Delta Attention for JAX", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"kdax {kdax.__version__} (jax {jax.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="benchmarks: KDA backends (the default), memory, a model, Kascade, context parallelism, ...",
        description="Benchmarks; `kdax bench` alone (or with kda's flags) runs `kdax bench kda`.",
        allow_abbrev=False,
    )
    bench = b.add_subparsers(dest="bench")
    for module in BENCHES:
        module.register(bench)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in (*bench.choices, "-h", "--help")):
        argv.insert(1, "kda")  # kdax bench [kda's flags]
    t = flags.command(sub, "train", _train, "train the tiny hybrid on byte-level text, then print a sample")
    for f in dataclasses.fields(TrainConfig):
        default = TRAIN_DEFAULTS.get(f.name, f.default)
        kind = str if default is None else type(default)
        t.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default, help=f.metadata["help"])
    t.add_argument("--corpus", default=None, help="a text file (None: the public-domain text shipped with kdax)")
    t.add_argument("--sample-tokens", type=flags.at_least(0), default=200, help="tokens to generate after training")
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out-dir (same settings; --steps may grow)",
    )
    t.add_argument("--overwrite", action="store_true", help="replace the training state in --out-dir with a new run")
    t.add_argument(
        "--distributed",
        metavar="auto|ADDRESS:PORT/PROCESSES/ID",
        help="several hosts, each running this command: jax.distributed.initialize from the cluster's "
        "environment (auto) or with the coordinator's address, the process count and this one's id",
    )
    g = flags.command(sub, "generate", _generate, "continue a prompt with a checkpoint, streaming the text")
    g.add_argument("--checkpoint", required=True, help="a model directory (any family kdax loads) or a hub id")
    g.add_argument("--prompt", required=True, help="the text to continue ('-': read it from stdin)")
    g.add_argument("--max-new-tokens", type=flags.at_least(0), default=128, help="tokens to generate at most")
    g.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn in the checkpoint's chat template"
    )
    g.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    g.add_argument(
        "--temperature",
        type=flags.number(float, lambda x: x >= 0, "a float >= 0"),
        default=0.0,
        help="0: greedy; else the sampling temperature",
    )
    g.add_argument("--top-k", type=flags.at_least(1), default=None, help="sample among the k most likely tokens")
    g.add_argument(
        "--top-p",
        type=flags.number(float, lambda x: 0 < x <= 1, "a float in (0, 1]"),
        default=None,
        help="sample within the smallest set of tokens of this probability",
    )
    g.add_argument("--seed", type=int, default=0, help="the sampling seed")
    g.add_argument("--backend", default="auto", help="the kernels' backend (auto, xla, pallas_tpu, pallas_gpu)")
    g.add_argument("--dtype", default=None, choices=flags.DTYPES, help="cast the weights (default: as stored)")
    g.add_argument("--kascade", default=None, help="a Kascade schedule (kdax kascade calibrate's JSON) to decode with")
    k = sub.add_parser("kascade", help="Kascade sparse attention tools", formatter_class=flags.Help, allow_abbrev=False)
    ksub = k.add_subparsers(dest="kascade_command", required=True)
    c = flags.command(ksub, "calibrate", _calibrate, "choose a Kascade schedule for a checkpoint from calibration text")
    c.add_argument("--checkpoint", required=True, help="a model directory in FLA's format (kdax train's out_dir/model)")
    c.add_argument("--text", default=None, help="calibration text file (None: the text shipped with kdax)")
    c.add_argument("--offset", type=flags.at_least(0), default=0, help="the first calibration token (byte) of the text")
    c.add_argument("--rows", type=flags.at_least(1), default=4, help="calibration rows")
    c.add_argument("--seq-len", type=flags.at_least(1), default=2048, help="tokens per calibration row")
    c.add_argument(
        "--anchors",
        type=int,
        help="anchor layers to place, the first full-attention layer one of them "
        "(default: 2, or 1 where the model has one full-attention layer)",
    )
    c.add_argument(
        "--topk-percent", type=flags.percent, default=10, help="keys kept per query tile, percent of those before it"
    )
    c.add_argument("--min-k", type=flags.at_least(0), default=128, help="the least keys a tile keeps")
    c.add_argument(
        "--tile-size", type=int, default=128, choices=(16, 32, 64, 128), help="queries per tile (16, 32, 64 or 128)"
    )
    c.add_argument(
        "--pool-size",
        type=int,
        default=128,
        choices=(1, 16, 32, 64, 128, 256),
        help="keys per selected unit: 1 selects tokens, more select whole key blocks",
    )
    c.add_argument(
        "--objective",
        default="output",
        choices=("output", "mass"),
        help="what ranks anchor heads and anchors: the error of each layer's output, or the attention mass kept",
    )
    c.add_argument("--out", default="kascade_schedule.json", help="where to write the schedule (JSON)")
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        ns.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    ns.command_line = " ".join(["kdax", *argv])
    return ns.run(ns, ns.parser)


if __name__ == "__main__":
    sys.exit(main())
