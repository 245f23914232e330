"""The ``kdax`` command line: ``kdax bench`` times KDA backends (or a model) and prints a table;
``kdax train`` trains the tiny hybrid; ``kdax kascade calibrate`` writes a Kascade schedule."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp

import kdax
from kdax import train
from kdax.bench import kda
from kdax.models import PRESETS
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


def _bench(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    meta = {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "command": "kdax " + " ".join(sys.argv[1:]),
    }
    given = {d: getattr(ns, d) for d in "BTHKV" if getattr(ns, d) is not None}
    if ns.gpu_compare_fla:  # the workers use the GPU; this process need not
        from kdax.bench import fla_compare

        result = fla_compare.compare(
            ns.shapes or fla_compare.SHAPES, ns.repeats, python=ns.fla_python, workdir=ns.workdir
        )
        result["meta"].update(date=meta["date"], command=meta["command"])
        print(json.dumps(result, indent=2) if ns.json else fla_compare.format_compare(result))
        return 0
    if ns.cp and ns.cp_devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # before the first device query: fake devices on a CPU host (no effect on accelerators)
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ns.cp_devices}"
        ).strip()
    meta["device"] = f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()})"
    if ns.gpu_tune:  # its own default shape (B=1 T=8192 H=16 K=V=128) where none is given
        from kdax.bench import gpu_tune

        kernels = None if ns.tune_kernels == "all" else [k for k in ns.tune_kernels.split(",") if k != "none"]
        blocks = None if ns.tune_blocks is None else ns.tune_blocks[0]
        result = gpu_tune.tune(**given, repeats=ns.repeats, kernels=kernels, blocks=blocks)
        print(json.dumps({"meta": meta, "tuned": result}, indent=2))
        return 0
    B, T, H, K, V = (DEFAULT_SHAPE | given).values()
    if ns.model:
        from kdax.bench import model

        B, T = given.get("B", 1), given.get("T", 1024)  # the model's prompt: B x T tokens
        row = model.run(ns.model, B, T, ns.decode_steps, ns.repeats, ns.dtype, progress=not ns.json)
        print(
            json.dumps({"meta": meta, "model": row}, indent=2)
            if ns.json
            else f"# {meta['device']}, jax {meta['jax']}, {meta['date']}\n{model.format_row(row)}"
        )
        return 0
    if ns.kascade:
        from kdax.bench import kascade

        if ns.dtype == "float16" and jax.default_backend() == "cpu":
            parser.error(
                "--dtype: float16 with --kascade needs an accelerator (the dense baseline, "
                "jax.nn.dot_product_attention, has no float16 on CPU)"
            )

        T, H = given.get("T", 4096), given.get("H", 8)
        print(
            f"compiling and timing dense, anchor and reuse layers (T={T}, cache {ns.cache_len})...",
            file=sys.stderr,
            flush=True,
        )
        rows = kascade.run(
            given.get("B", 1),
            T,
            ns.cache_len,
            H,
            ns.kv_heads,
            ns.head_dim,
            ns.topk_percent,
            ns.min_k,
            ns.tile_size,
            ns.dtype,
            ns.repeats,
            progress=not ns.json,
            backends=ns.kascade_backends and ns.kascade_backends.split(","),
            decode_batch=ns.decode_batch,
        )
        B = given.get("B", 1)
        shape = (
            f"# B={B} H={H} G={ns.kv_heads} D={ns.head_dim} {ns.dtype}, top-k {ns.topk_percent:g}% (at least "
            f"{ns.min_k} keys), tile {ns.tile_size}; decode: batch {ns.decode_batch or B}, cache {ns.cache_len} keys"
        )
        print(
            json.dumps({"meta": meta, "kascade": [dataclasses.asdict(r) for r in rows]}, indent=2)
            if ns.json
            else f"# {meta['device']}, jax {meta['jax']}, {meta['date']}\n{shape}\n{kascade.format_table(rows)}"
        )
        return 0
    if ns.cp:
        from kdax.bench import cp

        T, H, K, V = given.get("T", 262144), given.get("H", 4), given.get("K", 128), given.get("V", 128)
        print(
            f"compiling and timing chunk_kda forward+backward over 1 to {len(jax.devices())} devices (T={T})...",
            file=sys.stderr,
            flush=True,
        )
        rows = cp.run(T, H, K, V, ns.chunk_size, ns.repeats, ns.cp_weak_T, progress=not ns.json)
        meta["devices"] = len(jax.devices())
        print(
            json.dumps({"meta": meta, "cp": [dataclasses.asdict(r) for r in rows]}, indent=2)
            if ns.json
            else f"# {meta['device']} x {meta['devices']}, jax {meta['jax']}, {meta['date']}\n{cp.format_table(rows)}\n"
            f"peak memory per device, most devices / one device at T={T}: {cp.peak_ratio(rows):.3f}"
        )
        return 0
    if ns.eager:
        from kdax.bench import eager

        rows = eager.run(ns.repeats)
        print(
            json.dumps({"meta": meta, "eager": rows}, indent=2)
            if ns.json
            else f"# {meta['device']}, jax {meta['jax']}, {meta['date']}\n{eager.format_table(rows)}"
        )
        return 0
    if ns.memory:
        result = {"meta": meta, "memory": kda.peak_memory(B, T, H, K, V, ns.chunk_size)}
        print(json.dumps(result, indent=2))
        return 0
    rows = kda.run(
        B,
        T,
        H,
        K,
        V,
        ns.dtype,
        ns.chunk_size,
        ns.backends.split(","),
        ns.repeats,
        check_error=not ns.no_error,
        progress=not ns.json,
    )
    if ns.json:
        print(json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))
    else:
        auto, why = kdax.explain_backend(jnp.dtype(ns.dtype), ns.chunk_size)
        print(f"# {meta['device']}, jax {meta['jax']}, {meta['date']}")
        if not given:
            print("# The default shape, T = 4096 with head dims 128: long enough that the chunked form's")
            print("# matmuls beat the token-by-token scan (at T = 1024, K = V = 64 its forward is not faster).")
        print(f"# backend='auto' runs {auto!r} here: {why}")
        print(kda.format_table(rows))
    return 0


DEFAULT_SHAPE = {"B": 1, "T": 4096, "H": 4, "K": 128, "V": 128}


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
    print(f"calibrating on {ns.rows} x {ns.seq_len} tokens from token {start}...", file=sys.stderr, flush=True)
    schedule = calibrate(
        model,
        np.stack(rows).astype(np.int32),
        anchors,
        topk_percent=ns.topk_percent,
        min_k=ns.min_k,
        tile_size=ns.tile_size,
    )
    schedule.save(ns.out)
    print(f"anchors {list(schedule.anchors)} of layers {list(schedule.layers)} -> {ns.out}")
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
        train.check_checkpoints(cfg, ns.resume)
    except ValueError as e:
        parser.error(_flag(e))
    if ns.corpus is not None and not os.path.isfile(ns.corpus):
        parser.error(f"--corpus: expected a text file, {ns.corpus!r} is not one")
    if ns.sample_tokens < 0:
        parser.error(f"--sample-tokens: expected an int >= 0, got {ns.sample_tokens}")
    try:
        train.main(cfg, ns.corpus, ns.sample_tokens, ns.resume)
    except train.Interrupted as stop:
        if stop.step is None:
            print("\nkdax train: interrupted before any training state was saved", file=sys.stderr)
        else:
            print(
                f"\nkdax train: interrupted; the training state of step {stop.step} is in {stop.directory}: "
                f"continue with the same command and --resume",
                file=sys.stderr,
            )
        return 130
    return 0


def _pairs(text: str) -> list[tuple[int, int]]:  # "1x2048,8x8192" -> [(1, 2048), (8, 8192)]
    try:
        pairs = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected AxB[,AxB...] of positive integers, got {text!r}")
    return pairs


def _number(cast, ok, expected: str):
    """An argparse type: ``cast(text)`` where ``ok`` of it holds (argparse names the flag in its error)."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def _at_least(low: int):  # an int >= low
    return _number(int, lambda n: n >= low, f"an int >= {low}")


_percent = _number(float, lambda x: 0 < x <= 100, "a percentage in (0, 100]")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Help that states each option's default, where it has one (not for flags, nor None)."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdax", description="kdax: Kimi Delta Attention for JAX")
    parser.add_argument("--version", action="version", version=f"kdax {kdax.__version__} (jax {jax.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="time KDA backends against the naive scan (or Kascade against dense attention)",
        formatter_class=_Help,
    )
    modes = b.add_mutually_exclusive_group()  # what to time: one of them, or the KDA ops' table
    b.add_argument("--B", type=_at_least(1), help="batch (default 1; --gpu-tune: B=1 T=8192 H=16 K=V=128)")
    b.add_argument("--T", type=_at_least(1), help="tokens (default 4096; --model: 1024)")
    b.add_argument("--H", type=_at_least(1), help="heads (default 4)")
    b.add_argument("--K", type=_at_least(1), help="key head dim (default 128)")
    b.add_argument("--V", type=_at_least(1), help="value head dim (default 128)")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="input dtype")
    b.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64, 128), help="chunk_size of chunk_kda")
    b.add_argument("--backends", default="xla,naive", help="comma-separated backends to time")
    b.add_argument(
        "--repeats", type=_at_least(1), default=5, help="timed calls per measurement (the median is reported)"
    )
    b.add_argument("--no-error", action="store_true", help="skip the float64 reference")
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    modes.add_argument("--memory", action="store_true", help="peak memory of forward+backward (default T: use --T)")
    modes.add_argument(
        "--gpu-compare-fla",
        action="store_true",
        help="on a CUDA GPU: kdax pallas_gpu and xla against FLA's chunk_kda (separate processes)",
    )
    b.add_argument("--shapes", type=_pairs, help="--gpu-compare-fla: BxT,... (default: B 1, 8 x T 2048, 8192, 32768)")
    b.add_argument("--workdir", help="--gpu-compare-fla: keep the workers' results here")
    modes.add_argument("--gpu-tune", action="store_true", help="on a CUDA GPU: measure the pallas_gpu launch table")
    b.add_argument("--tune-kernels", default="all", help="--gpu-tune: kernels whose launch to sweep (a,b,...|none)")
    b.add_argument("--tune-blocks", type=_pairs, help="--gpu-tune: block_v x block_k to keep (e.g. 32x16), not sweep")
    b.add_argument("--fla-python", default=sys.executable, help="python that runs the workers (FLA and kdax)")
    modes.add_argument(
        "--model",
        choices=list(PRESETS),
        help="prefill (--B x --T prompt) and decode (--decode-steps) tokens/s of a model, random weights",
    )
    b.add_argument(
        "--decode-steps", type=_at_least(1), default=32, help="--model: decode steps timed after the prefill"
    )
    modes.add_argument(
        "--eager", action="store_true", help="eager calls of the ops and the tiny model against jitted ones"
    )
    modes.add_argument(
        "--kascade",
        action="store_true",
        help="Kascade dense / anchor / reuse layers, prefill (--T, default 4096; --H, default 8) and decode",
    )
    b.add_argument("--cache-len", type=_at_least(1), default=16384, help="--kascade: the decode cache length")
    b.add_argument("--kv-heads", type=_at_least(1), default=2, help="--kascade: KV heads G")
    b.add_argument("--head-dim", type=_at_least(1), default=128, help="--kascade: head dim D")
    b.add_argument("--topk-percent", type=_percent, default=10, help="--kascade: keys kept, percent")
    b.add_argument("--min-k", type=_at_least(0), default=128, help="--kascade: the least keys a tile keeps")
    b.add_argument("--tile-size", type=int, default=32, choices=(16, 32, 64, 128), help="--kascade: queries per tile")
    modes.add_argument("--cp", action="store_true", help="context-parallel chunk_kda fwd+bwd: time, memory per device")
    b.add_argument(
        "--cp-devices", type=_at_least(0), default=8, help="--cp: devices to fake on a CPU host (0: as they are)"
    )
    b.add_argument(
        "--cp-weak-T", type=_at_least(1), help="--cp: tokens per device, weak scaling (default: T / devices)"
    )
    b.add_argument("--decode-batch", type=_at_least(1), help="--kascade: decode rows (default: --B)")
    b.add_argument("--kascade-backends", help="--kascade: comma-separated backends (default: xla, the device kernels)")
    t = sub.add_parser(
        "train", help="train the tiny hybrid on byte-level text, then print a sample", formatter_class=_Help
    )
    for f in dataclasses.fields(TrainConfig):
        default = TRAIN_DEFAULTS.get(f.name, f.default)
        t.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default, help=f.metadata["help"])
    t.add_argument("--corpus", default=None, help="a text file (None: the public-domain text shipped with kdax)")
    t.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate after training")
    t.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --out-dir (same settings)"
    )
    t.add_argument(
        "--distributed",
        metavar="auto|ADDRESS:PORT/PROCESSES/ID",
        help="several hosts, each running this command: jax.distributed.initialize from the cluster's "
        "environment (auto) or with the coordinator's address, the process count and this one's id",
    )
    k = sub.add_parser("kascade", help="Kascade sparse attention tools", formatter_class=_Help)
    ksub = k.add_subparsers(dest="kascade_command", required=True)
    c = ksub.add_parser(
        "calibrate", help="choose a Kascade schedule for a checkpoint from calibration text", formatter_class=_Help
    )
    c.add_argument("--checkpoint", required=True, help="a model directory in FLA's format (kdax train's out_dir/model)")
    c.add_argument("--text", default=None, help="calibration text file (None: the text shipped with kdax)")
    c.add_argument("--offset", type=_at_least(0), default=0, help="the first calibration token (byte) of the text")
    c.add_argument("--rows", type=_at_least(1), default=4, help="calibration rows")
    c.add_argument("--seq-len", type=_at_least(1), default=2048, help="tokens per calibration row")
    c.add_argument(
        "--anchors",
        type=int,
        help="anchor layers to place, the first full-attention layer one of them "
        "(default: 2, or 1 where the model has one full-attention layer)",
    )
    c.add_argument(
        "--topk-percent", type=_percent, default=10, help="keys kept per query tile, percent of those before it"
    )
    c.add_argument("--min-k", type=_at_least(0), default=128, help="the least keys a tile keeps")
    c.add_argument(
        "--tile-size", type=int, default=32, choices=(16, 32, 64, 128), help="queries per tile (16, 32, 64 or 128)"
    )
    c.add_argument("--out", default="kascade_schedule.json", help="where to write the schedule (JSON)")
    ns = parser.parse_args(argv)
    if ns.command == "kascade":
        return _calibrate(ns, c)
    if ns.command == "train":
        return _train(ns, t)
    return _bench(ns, b)


if __name__ == "__main__":
    sys.exit(main())
