"""Training: the tiny hybrid learns the shipped corpus; checkpoints resume a run exactly; ``kdax train``
and ``kdax bench model`` run."""

import json
import os
import re

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import kdax.train
from kdax.cli import main
from kdax.models import KDAForCausalLM, from_pretrained, tiny_config
from kdax.train import TrainConfig, load_corpus, train, unigram_entropy

HF_TINY = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "kimi_a")  # vocab_size 128


def test_loss_falls_well_below_unigram_entropy():
    tokens = load_corpus()
    assert tokens.size > 10_000
    entropy = unigram_entropy(tokens)
    config = tiny_config(hidden_size=64, head_dim=16, num_hidden_layers=2, attn={"layers": [1], "num_heads": 4})
    model = KDAForCausalLM(config, backend="xla", rngs=nnx.Rngs(0))
    losses = train(model, tokens, TrainConfig(steps=200, batch_size=8, seq_len=64), progress=False)
    assert losses[0] > entropy  # starts near log(256) = 5.5
    assert np.mean(losses[-20:]) < 0.75 * entropy, (entropy, np.mean(losses[-20:]))


def _small_config():
    """One attention layer: checkpoints do not depend on the layer kinds, and its training step
    compiles in 4 s on 2 cores where a KDA layer's takes 15 s."""
    return tiny_config(
        hidden_size=16, head_dim=8, num_heads=2, num_hidden_layers=1, attn={"layers": [0], "num_heads": 2}
    )


def _small_model():
    return KDAForCausalLM(_small_config(), backend="xla", rngs=nnx.Rngs(0))


@pytest.fixture
def small_preset(monkeypatch):
    """kdax train's default preset as :func:`_small_config`: the command line's behaviour, not the model, is tested."""
    monkeypatch.setitem(kdax.train.PRESETS, "tiny", _small_config)


def _small_run(out_dir, **kw):  # out_dir None: nothing saved
    out_dir = None if out_dir is None else str(out_dir)
    return TrainConfig(**{"steps": 20, "batch_size": 2, "seq_len": 16, "warmup": 4, "out_dir": out_dir, **kw})


def _params(model):
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def straight_run():
    """The parameters and losses of 20 steps without a checkpoint."""
    model = _small_model()
    losses = train(model, load_corpus(), _small_run(None), progress=False)
    return _params(model), losses


def _assert_same_run(model, losses, straight_run, resumed_from):
    """Exact equality: on CPU the resumed steps run the same compiled step on the restored bytes
    and the same batches, so nothing may differ, not even by rounding (on a GPU, atomics in
    reductions could make a run differ from itself at float32 rounding)."""
    params, straight_losses = straight_run
    assert losses == straight_losses[resumed_from:]
    for name, value in _params(model).items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)


def _raising_at(n: int, error: BaseException):
    """A kdax.train.compiled_step whose steps raise ``error`` at the n-th step (a crash, Ctrl-C)."""
    real, calls = kdax.train.compiled_step, []

    def compiled(*args):
        step = real(*args)

        def run(*a):
            calls.append(1)
            if len(calls) == n:
                raise error
            return step(*a)

        return run

    return compiled


def test_resume_continues_a_run_exactly(tmp_path, monkeypatch, straight_run):
    """20 steps straight equal 10 steps, a crash, a resume from the step-10 checkpoint and 10 more."""
    cfg = _small_run(tmp_path, checkpoint_every=5, keep=2)
    monkeypatch.setattr(kdax.train, "compiled_step", _raising_at(11, RuntimeError("killed")))
    with pytest.raises(RuntimeError, match="killed"):
        train(_small_model(), load_corpus(), cfg, progress=False)
    assert sorted(os.listdir(tmp_path / "state")) == ["10", "5"] and not (tmp_path / "model").exists()
    monkeypatch.undo()
    model = _small_model()  # fresh weights: the checkpoint's must replace them
    losses = train(model, load_corpus(), cfg, progress=False, resume=True)
    _assert_same_run(model, losses, straight_run, 10)
    assert sorted(os.listdir(tmp_path / "state")) == ["15", "20"]  # the newest `keep`
    _assert_same_run(from_pretrained(str(tmp_path / "model"), backend="xla"), [], straight_run, 20)
    with pytest.raises(ValueError, match="out_dir: .* holds checkpoints up to step 20"):
        train(_small_model(), load_corpus(), cfg, progress=False)
    with pytest.raises(ValueError, match="resume: .* written with batch_size=2 \\(this run: 3\\)"):
        train(_small_model(), load_corpus(), _small_run(tmp_path, batch_size=3, checkpoint_every=5), resume=True)


def test_interrupted_save_loses_no_complete_checkpoint(tmp_path, monkeypatch, straight_run):
    """A save that fails part-way (here its JSON item cannot be encoded, while its arrays are
    written) leaves orbax's temporary directory, never a step directory; a resume restores the
    last complete checkpoint and the run ends as if nothing had happened."""
    cfg = _small_run(tmp_path, checkpoint_every=5)
    json_save = ocp.args.JsonSave
    monkeypatch.setattr(
        ocp.args, "JsonSave", lambda item: json_save({**item, "x": object()} if item["step"] == 15 else item)
    )
    with pytest.raises(TypeError, match="JSON serializable"):
        train(_small_model(), load_corpus(), cfg, progress=False)
    left = os.listdir(tmp_path / "state")  # 5, 10 and orbax's temporary directory of 15
    assert {"5", "10"} <= set(left) and "15" not in left and any(name.startswith("15.") for name in left), left
    kdax.train.check_checkpoints(cfg, resume=True)  # a read-only look removes nothing
    assert sorted(os.listdir(tmp_path / "state")) == sorted(left)
    monkeypatch.setattr(ocp.args, "JsonSave", json_save)
    model = _small_model()
    losses = train(model, load_corpus(), cfg, progress=False, resume=True)
    _assert_same_run(model, losses, straight_run, 10)
    assert sorted(os.listdir(tmp_path / "state")) == ["10", "15", "20"]  # the half-written 15 replaced


def test_kdax_train_cli_writes_checkpoints(small_preset, tmp_path, capsys):
    out = str(tmp_path / "ckpt")
    args = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "1", "--keep", "1"]
    assert main([*args, "--out-dir", out, "--sample-tokens", "4"]) == 0
    assert "unigram entropy" in capsys.readouterr().out
    assert os.listdir(f"{out}/state") == ["2"]
    model = from_pretrained(f"{out}/model")
    assert model.config.vocab_size == 256
    assert main([*args, "--out-dir", out, "--sample-tokens", "0", "--resume"]) == 0  # at its last step already


def test_kdax_train_cli_extends_a_finished_run_and_overwrites_one(small_preset, tmp_path, capsys):
    """--resume with more --steps goes on from the state (its learning-rate schedule kept); fewer
    steps than the state's, a changed setting, or --overwrite with --resume: one-line errors before
    any work; --overwrite replaces the state with a new run."""
    out = str(tmp_path / "ckpt")
    args = ["train", "--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "1", "--keep", "1", "--out-dir", out]
    args += ["--sample-tokens", "0"]
    assert main([*args, "--steps", "2"]) == 0
    assert main([*args, "--steps", "3", "--resume"]) == 0
    assert "loss: step 3 " in capsys.readouterr().out and os.listdir(f"{out}/state") == ["3"]
    for extra, says in [
        (["--steps", "2", "--resume"], "--steps: expected at least 3, the step of the training state to resume, got 2"),
        (["--steps", "4", "--resume", "--lr", "0.5"], "--resume: the checkpoint of step 3 in"),
        (["--steps", "4", "--resume", "--overwrite"], "--overwrite: expected it without resume"),
        (["--steps", "4"], "replace them with overwrite (--overwrite)"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main([*args, *extra])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # the error is one line, after the usage
        assert exit.value.code == 2 and last.startswith("kdax train: error: ") and says in last, err
    assert main([*args, "--steps", "1", "--overwrite"]) == 0
    assert "loss: step 1 " in capsys.readouterr().out and os.listdir(f"{out}/state") == ["1"]


def test_kdax_train_cli_saves_the_final_weights_by_default_and_says_where(small_preset, tmp_path, capsys, monkeypatch):
    """No --checkpoint-every: the training state every 100 steps and at the last, the final weights
    always; the loss summary names the steps this run ran; the bar names the first step's compile."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--sample-tokens", "0"]) == 0
    out, err = capsys.readouterr()
    assert "train: compiling the step:   0%" in err and "train: 100%" in err  # the first call's wait is named
    assert "loss: step 1 " in out and "mean of steps 1-3" in out
    assert "saved: the final weights in checkpoints/tiny/model" in out and "checkpoints/tiny/state (--resume)" in out
    assert os.listdir("checkpoints/tiny/state") == ["3"] and from_pretrained("checkpoints/tiny/model")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--steps", "-1"], "--steps: expected a positive int, got -1"),
        (["--batch-size", "0"], "--batch-size: expected a positive int, got 0"),
        (["--lr", "-1"], "--lr: expected a positive float"),
        (["--holdout", "1.5"], "--holdout: expected a share in [0, 1), got 1.5"),
        (["--keep", "0"], "--keep: expected a positive int"),
        (["--checkpoint-every", "-2"], "--checkpoint-every: expected >= 0"),
        (["--preset", "nonexistent"], "--preset: expected one of"),
        (["--corpus", "/nonexistent.txt"], "--corpus: expected a text file, '/nonexistent.txt' is not one"),
        (["--mesh", "garbage"], "--mesh: expected comma-separated axis=size"),
        (["--mesh", "data=2"], "--mesh: expected axis sizes whose product is the 1 devices here"),
        (["--sample-tokens", "-1"], "argument --sample-tokens: expected an int >= 0, got '-1'"),
        (["--resume"], "--resume: no training state in"),
        (["--checkpoint", "/nonexistent"], "--checkpoint: expected a model directory with a config.json"),
        (["--checkpoint", HF_TINY], "--checkpoint: expected a vocab_size of at least 256 (byte-level text), got 128"),
    ],
    ids=lambda x: x[0] if isinstance(x, list) else "",
)
def test_kdax_train_cli_refuses_bad_flags_before_any_work(args, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["train", "--out-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"kdax train: error: {says}" in err, err
    assert not (tmp_path / "run").exists()


def test_kdax_train_cli_ctrl_c_names_the_saved_step_and_resumes(small_preset, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kdax.train, "compiled_step", _raising_at(4, KeyboardInterrupt()))
    args = [
        "train",
        "--steps",
        "5",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--sample-tokens",
        "0",
        "--checkpoint-every",
        "2",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert (
        f"interrupted; the training state of step 2 is in {tmp_path}: continue with the same command and --resume"
        in err
    )
    assert not (tmp_path / "model").exists()
    with pytest.raises(SystemExit):  # the same command without --resume: refused, naming the saved step
        main(args)
    assert "--out-dir: " in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0
    assert "loss: step 3 " in capsys.readouterr().out and (tmp_path / "model").exists()


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="resume: no training state in .*state to continue"):
        train(_small_model(), load_corpus(), _small_run(tmp_path), progress=False, resume=True)


def test_kdax_train_fine_tunes_a_kimi_linear_checkpoint(tmp_path, capsys):
    """--checkpoint: a Kimi Linear model (KDA, MLA, MoE) trains from its weights and is saved in the
    hub's format, which loads back as the same family."""
    from kdax.models import KimiLinearForCausalLM, kimi_tiny_config, save_pretrained

    layers = {"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"]}
    start = KimiLinearForCausalLM(kimi_tiny_config(num_hidden_layers=2, **layers), rngs=nnx.Rngs(0))
    save_pretrained(start, str(tmp_path / "start"))
    out = str(tmp_path / "run")
    args = ["train", "--checkpoint", str(tmp_path / "start"), "--steps", "2", "--batch-size", "2", "--seq-len", "16"]
    assert main([*args, "--out-dir", out, "--sample-tokens", "0"]) == 0
    assert "loss: step 1 " in capsys.readouterr().out
    tuned = from_pretrained(f"{out}/model")
    assert isinstance(tuned, KimiLinearForCausalLM)
    moved = [k for k, v in _params(tuned).items() if not np.array_equal(v, _params(start)[k])]
    assert any("gate_up" in k for k in moved) and any("kv_b_proj" in k for k in moved)


def test_bench_model_cli(capsys):
    args = ["model", "--preset", "tiny", "--B", "2", "--T", "16", "--decode-steps", "2", "--repeats", "1"]
    args += ["--dtype", "bfloat16"]
    assert main(["bench", *args, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["model"]
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["params"] > 1e6 and row["dtype"] == "bfloat16"
    assert main(["bench", *args]) == 0  # the table, with progress on stderr
    out, err = capsys.readouterr()
    assert "| tiny | bfloat16 |" in out and "kdax bench model --preset tiny" in err and "compiling" in err


@pytest.mark.slow  # test_bench_model_cli covers the command in CI; the families' models are tested in tests/models
@pytest.mark.parametrize("preset", ["kimi-tiny", "ling-tiny"])
def test_bench_model_runs_the_hugging_face_families(preset, capsys):
    args = ["model", "--preset", preset, "--B", "1", "--T", "16", "--decode-steps", "2", "--repeats", "1", "--json"]
    assert main(["bench", *args]) == 0
    row = json.loads(capsys.readouterr().out)["model"]
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["model"] == preset


def test_train_config_errors_name_the_field():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="keep"):
        TrainConfig(keep=0)
    with pytest.raises(ValueError, match="holdout"):
        TrainConfig(holdout=1.0)
    with pytest.raises(ValueError, match="preset"):
        TrainConfig(preset="huge")


def test_a_mesh_that_does_not_fit_the_devices_or_a_bad_launch_spec_is_a_value_error():
    """On one device, a mesh of two is refused before anything runs, saying how to fake devices on a CPU
    host; ``--distributed`` takes "auto" or ADDRESS:PORT/PROCESSES/ID. (The mesh runs themselves:
    tests/multidevice.)"""
    model = KDAForCausalLM(tiny_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mesh: .* product is the 1 devices .*xla_force_host_platform_device_count=2"):
        train(model, load_corpus(), TrainConfig(steps=1, mesh="data=2"), progress=False)
    with pytest.raises(ValueError, match="distributed: expected 'auto' or ADDRESS:PORT/PROCESSES/ID"):
        main(["train", "--distributed", "localhost:1234/two/0"])


@pytest.mark.slow
def test_bench_serving_cli(capsys):
    args = ["serving", "--requests", "3", "--concurrency", "2", "--prompt-max", "20", "--new-tokens", "4"]
    args += ["--chunk-size", "16", "--draft", "2", "--repeats", "1", "--json", "--temperature", "0.8"]
    assert main(["bench", *args]) == 0
    (row,) = json.loads(capsys.readouterr().out)["serving"]
    assert row["served_tok_s"]["median"] > 0 and row["generate_tok_s"]["median"] > 0 and row["step_temp_mib"] > 0
    assert row["drafts_accepted"][0] <= row["drafts_accepted"][1] and row["temperature"] == 0.8
    with pytest.raises(SystemExit):
        main(["bench", "serving", "--temperature", "-1"])
    assert "--temperature: expected a finite float >= 0, got '-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serving", "--prompt-min", "30", "--prompt-max", "20"])
    assert "--prompt-max: expected >= --prompt-min=30" in capsys.readouterr().err


def test_a_step_that_does_not_fit_is_a_one_line_error_before_it_runs(small_preset, tmp_path, capsys, monkeypatch):
    """XLA's memory analysis of the compiled step against the device's memory (here 512 KiB, where
    the small model's step takes 0.7 MiB: 0.4 MiB of arguments and outputs, 0.3 MiB of temporaries)."""
    assert kdax.train.device_memory() > 2**28  # the real one: this machine's free memory
    monkeypatch.setattr(kdax.train, "device_memory", lambda: 2**19)
    args = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--sample-tokens", "0"]
    with pytest.raises(SystemExit) as stop:
        main([*args, "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert "kdax train: error: --seq-len: a step of batch_size 2 x seq_len 16 needs about " in err
    fits = re.search(r"needs about 0\.\d MiB .* 0\.5 MiB is free; at batch_size 2 about seq_len (\d+) fits", err)
    assert fits and 0 < int(fits.group(1)) < 16, err
    assert not os.listdir(tmp_path / "run" / "state") and not (tmp_path / "run" / "model").exists()  # nothing ran
