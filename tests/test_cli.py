"""The ``kdax bench`` commands run end to end on tiny shapes and print their tables / JSON; bad flags
are argparse's one-line errors naming the flag."""

import json

import pytest

from kdax.cli import main
from tests.tolerances import F32, F64

TINY = "--T 40 --H 1 --K 8 --V 8 --repeats 1 --chunk-size 16".split()


def test_bench_table(capsys):
    assert main(["bench", *TINY]) == 0  # `kdax bench` runs `kdax bench kda`
    out = capsys.readouterr().out
    assert "| shape" in out and "xla" in out and "naive" in out and "fwd+bwd" in out
    # a newcomer's reading: what each column is, which gradients, what "auto" runs and why
    header = next(line for line in out.splitlines() if line.startswith("| shape"))
    assert "median ms (IQR)" in header and "x faster than the naive scan" in header
    assert "rel. RMS error vs float64" in header and "worst of the five gradients" in out
    assert "# backend='auto' runs 'xla' here: no kernels for this device (cpu)" in out


def test_bench_json(capsys):
    main(["bench", "kda", *TINY, "--T", "33", "--json"])
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {(b, m) for b in ("xla", "naive") for m in ("fwd", "fwd+bwd")}
    assert all(r["rel_err"] < F32["grad"] for r in rows)
    assert result["meta"]["command"] == "kdax bench kda " + " ".join([*TINY, "--T", "33", "--json"])


def test_the_version_follows_the_changelog():
    """pyproject.toml, kdax.__version__ and CHANGELOG.md's newest section name one version."""
    import pathlib
    import re
    import tomllib

    import kdax

    root = pathlib.Path(__file__).parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    newest = re.search(r"^## (\S+)", (root / "CHANGELOG.md").read_text(), re.M).group(1)
    assert project == kdax.__version__ == newest


def test_version_and_every_train_option_states_its_default(capsys):
    import dataclasses

    import pytest

    import kdax
    from kdax.cli import TRAIN_DEFAULTS
    from kdax.train import TrainConfig

    with pytest.raises(SystemExit):
        main(["--version"])
    assert f"kdax {kdax.__version__}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help lines wrap
    for f in dataclasses.fields(TrainConfig):
        default = TRAIN_DEFAULTS.get(f.name, f.default)
        stated = "" if default is None else f" (default: {default})"  # flags.Help states no None
        assert f"{f.metadata['help']}{stated}" in text, f.name


def test_bench_kascade_table_and_json(capsys):
    import json

    args = ["bench", "kascade", *"--T 96 --cache-len 128 --H 2 --head-dim 16 --min-k 8 --repeats 1".split()]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "| phase" in out and "x faster than dense" in out and "32-layer average (5 anchors)" in out
    shape = "# B=1 H=2 G=2 D=16 float32, top-k 10% (at least 8 keys), tile 128, pools of 128; decode: batch 1, cache"
    assert shape + " 128 keys" in out
    assert "| prefill | 96 | - | dense |" in out and "| decode | 128 | - | dense |" in out
    for layer in ("anchor (dense output)", "anchor", "reuse"):  # xla, the CPU's only Kascade backend
        assert f"| prefill | 96 | xla | {layer} |" in out and f"| decode | 128 | xla | {layer} |" in out
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["kascade"]
    assert len(rows) == 10 and all(r["median_ms"] > 0 for r in rows)
    assert all(r["rel_err"] < F32["out"] for r in rows if r["rel_err"] is not None)  # float32 against float64


def test_kascade_calibrate_help_states_defaults(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["kascade", "calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 2048)" in text and "(default: kascade_schedule.json)" in text


def test_bench_refuses_bad_flags_in_one_line(capsys):
    """Every bad value of every subcommand is argparse's one-line error (exit 2) before any work."""
    import pytest

    for args, says in [
        ("--T -5", "kda: error: argument --T: expected an int >= 1, got '-5'"),
        ("kda --repeats 0", "kda: error: argument --repeats: expected an int >= 1, got '0'"),
        ("--chunk-size 48", "kda: error: argument --chunk-size: invalid choice: 48"),
        ("--backends xla,cuda", "kda: error: argument --backends: expected a comma-separated list of auto, xla,"),
        ("memory --K 0", "memory: error: argument --K: expected an int >= 1, got '0'"),
        ("model --preset huge", "model: error: argument --preset: invalid choice: 'huge'"),
        ("kascade --topk-percent 200", "kascade: error: argument --topk-percent: expected a percentage in (0, 100]"),
        ("kascade --dtype float16", "kascade: error: --dtype: float16 needs an accelerator"),
        ("kascade --backends naive", "kascade: error: argument --backends: expected a comma-separated list of xla,"),
        ("cp --devices -1", "cp: error: argument --devices: expected an int >= 0, got '-1'"),
        ("eager --repeats x", "eager: error: argument --repeats: expected an int >= 1, got 'x'"),
        ("gpu-compare --shapes 1x0", "gpu-compare: error: argument --shapes: expected AxB[,AxB...] of positive"),
        ("gpu-tune --kernels keys,bogus", "gpu-tune: error: argument --kernels: expected a comma-separated list of"),
        ("gpu-tune --blocks 32", "gpu-tune: error: argument --blocks: expected AxB[,AxB...] of positive integers"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main(["bench", *args.split()])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and f"kdax bench {says}" in err, err


def test_unknown_and_abbreviated_flags_get_the_subcommands_usage(capsys):
    """An unknown flag, or a prefix of a real one (--step for --steps), is the subcommand's one-line
    error under its own usage (exit 2), before any work."""
    import pytest

    cases = [
        ("train --step 5", "kdax train", "--step 5"),
        ("train --bogus", "kdax train", "--bogus"),
        ("bench kda --rep 3", "kdax bench kda", "--rep 3"),
    ]
    for args, prog, unknown in cases:
        with pytest.raises(SystemExit) as exit:
            main(args.split())
        err = capsys.readouterr().err
        assert exit.value.code == 2 and f"usage: {prog} " in err, err
        assert f"{prog}: error: unrecognized arguments: {unknown}" in err, err


def test_bench_float16(capsys):
    assert main(["bench", *TINY, "--dtype", "float16"]) == 0
    assert "B=1 T=40 H=1 K=8 V=8 float16" in capsys.readouterr().out


def test_bench_reference_is_the_float64_scan_to_1e_10():
    """kdax bench's error column compares against chunk_kda's xla backend in float64: within 1e-10
    of the float64 token scan, outputs and the five gradients, strong decay included."""
    import jax
    import jax.numpy as jnp

    from kdax.bench.kda import _fns, make_inputs
    from kdax.bench.measure import rel_rms

    with jax.enable_x64(True):
        a = make_inputs(1, 200, 2, 32, 16, jnp.float64)
        for decay in (1.0, 40.0):  # g in [-40, -0.4]: cumulative gates far below -88 within a chunk
            args = [*a[:3], a[3] * decay, a[4]]
            (fx, bx), (fn, bn) = _fns("xla", 64), _fns("naive", 64)
            assert rel_rms(fx(*args), fn(*args)) < F64["out"]
            assert max(rel_rms(x, y) for x, y in zip(bx(*args), bn(*args))) < F64["out"]


def test_bench_times_tokamax_beside_kdax():
    """--peers tokamax: tokamax's KDA on the same inputs in its [H, B, T, D] layout, its outputs
    moved back for the error column (here its token recurrence; on a TPU its Mosaic kernels)."""
    pytest.importorskip("tokamax")
    from kdax.bench.kda import run

    shape = {"B": 1, "T": 40, "H": 2, "K": 8, "V": 8}
    rows = run(**shape, backends=("xla",), repeats=1, progress=False, peers=("tokamax",), tokamax_implementation="xla")
    assert [(r.backend, r.mode) for r in rows] == [(b, m) for b in ("xla", "tokamax") for m in ("fwd", "fwd+bwd")]
    assert all(r.rel_err < F32["grad"] for r in rows), rows


def test_bench_peer_needs_tokamax(capsys):
    import importlib.util

    if importlib.util.find_spec("tokamax") is not None:
        pytest.skip("tokamax is installed")
    with pytest.raises(SystemExit) as exit:
        main(["bench", *TINY, "--peers", "tokamax"])
    assert exit.value.code == 2 and "--peers: tokamax is not installed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def kimi_with_tokenizer(tmp_path_factory):
    """A tiny random Kimi Linear checkpoint with a BPE tokenizer.json trained by `tokenizers` on
    kdax's text, its config and a chat template as the hub writes them."""
    import tokenizers
    from flax import nnx

    from kdax import train
    from kdax.models import KimiLinearForCausalLM, kimi_tiny_config, save_pretrained

    out = tmp_path_factory.mktemp("kimi")
    layers = {"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"]}
    save_pretrained(KimiLinearForCausalLM(kimi_tiny_config(num_hidden_layers=2, **layers), rngs=nnx.Rngs(0)), str(out))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|im_end|>"])
    tok.train_from_iterator([bytes(train.load_corpus()[:20000]).decode("utf-8", "ignore")], trainer)
    tok.save(str(out / "tokenizer.json"))
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}<|assistant|>"
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    return out


def test_kdax_generate_streams_text_through_the_checkpoints_tokenizer(kimi_with_tokenizer, capsys):
    import tokenizers

    args = ["generate", "--checkpoint", str(kimi_with_tokenizer), "--max-new-tokens", "12"]
    assert main([*args, "--prompt", "It was the best of times"]) == 0
    out, err = capsys.readouterr()
    tok = tokenizers.Tokenizer.from_file(str(kimi_with_tokenizer / "tokenizer.json"))
    assert out.strip() and "tokenizer.json tokenizer" in err and "compiling for prompts up to 16 tokens" in err
    assert len(tok.encode(out.rstrip("\n")).ids) <= 12  # text of the model's ids, decoded
    assert main([*args, "--prompt", "Hello", "--chat", "--system", "Be brief.", "--temperature", "0.8"]) == 0
    assert "prompt tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", ""], "--prompt: expected text that gives at least one token"),
        (["--prompt", "x", "--top-p", "2"], "argument --top-p: expected a float in (0, 1]"),
        (["--prompt", "x", "--checkpoint", "/nonexistent"], "--directory: expected a checkpoint directory"),
    ],
)
def test_kdax_generate_errors_are_one_line(kimi_with_tokenizer, capsys, extra, message):
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--checkpoint", str(kimi_with_tokenizer), *extra])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and "Traceback" not in err


def test_kdax_generate_without_a_chat_template_or_tokenizer(tmp_path, capsys):
    from flax import nnx

    from kdax.models import KDAForCausalLM, save_pretrained, tiny_config

    save_pretrained(KDAForCausalLM(tiny_config(num_hidden_layers=1, attn=None), rngs=nnx.Rngs(0)), str(tmp_path))
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "abc", "--max-new-tokens", "3"]
    assert main(args) == 0 and "bytes tokenizer" in capsys.readouterr().err  # kdax train's models: bytes
    with pytest.raises(SystemExit):
        main([*args, "--chat"])
    assert "--chat: the checkpoint has no chat template" in capsys.readouterr().err
