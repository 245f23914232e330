"""Training: the tiny hybrid learns the shipped corpus; ``kdax train`` and ``kdax bench --model`` run."""

import json

import numpy as np
import pytest
from flax import nnx

from kdax.cli import main
from kdax.models import KDAForCausalLM, from_pretrained, tiny_config
from kdax.train import TrainConfig, load_corpus, train, unigram_entropy


def test_loss_falls_well_below_unigram_entropy():
    tokens = load_corpus()
    assert tokens.size > 10_000
    entropy = unigram_entropy(tokens)
    config = tiny_config(hidden_size=64, head_dim=16, num_hidden_layers=2, attn={"layers": [1], "num_heads": 4})
    model = KDAForCausalLM(config, backend="xla", rngs=nnx.Rngs(0))
    losses = train(model, tokens, TrainConfig(steps=200, batch_size=8, seq_len=64), progress=False)
    assert losses[0] > entropy  # starts near log(256) = 5.5
    assert np.mean(losses[-20:]) < 0.75 * entropy, (entropy, np.mean(losses[-20:]))


def test_kdax_train_cli_writes_checkpoints(tmp_path, capsys):
    out = str(tmp_path / "ckpt")
    args = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "1"]
    assert main([*args, "--out-dir", out, "--sample-tokens", "4"]) == 0
    assert "unigram entropy" in capsys.readouterr().out
    model = from_pretrained(f"{out}/step_2")
    assert model.config.vocab_size == 256


def test_bench_model_cli(capsys):
    args = ["--model", "tiny", "--B", "2", "--T", "16", "--decode-steps", "2", "--repeats", "1", "--dtype", "bfloat16"]
    assert main(["bench", *args, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["model"]
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["params"] > 1e6 and row["dtype"] == "bfloat16"


def test_train_config_errors_name_the_field():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0.0)
