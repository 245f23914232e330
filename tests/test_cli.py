"""The ``kdax bench`` command runs end to end on a tiny shape and prints its table / JSON."""

import json

from kdax.cli import main


def test_bench_table(capsys):
    assert main(["bench", "--T", "40", "--H", "1", "--K", "8", "--V", "8", "--repeats", "1", "--chunk-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "| shape" in out and "xla" in out and "naive" in out and "fwd+bwd" in out
    # a newcomer's reading: what each column is, which gradients, what "auto" runs and why
    header = next(line for line in out.splitlines() if line.startswith("| shape"))
    assert "median ms (IQR)" in header and "x faster than the naive scan" in header
    assert "rel. RMS error vs float64" in header and "worst of the five gradients" in out
    assert "# backend='auto' runs 'xla' here: no kernels for this device (cpu)" in out


def test_bench_json(capsys):
    main(["bench", "--T", "33", "--H", "1", "--K", "8", "--V", "8", "--repeats", "1", "--chunk-size", "16", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {("xla", "fwd"), ("xla", "fwd+bwd"), ("naive", "fwd"),
                                                          ("naive", "fwd+bwd")}  # fmt: skip
    assert all(r["rel_err"] < 1e-4 for r in rows)


def test_version_and_every_train_option_states_its_default(capsys):
    import dataclasses

    import pytest

    import kdax
    from kdax.train import TrainConfig

    with pytest.raises(SystemExit):
        main(["--version"])
    assert f"kdax {kdax.__version__}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help lines wrap
    for f in dataclasses.fields(TrainConfig):
        assert f"{f.metadata['help']} (default: {f.default})" in text, f.name
