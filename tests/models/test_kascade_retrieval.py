"""The retrieval study's documents and scoring (kdax.bench.kascade_retrieval); the study itself
is run by hand (docs/kascade.md, "Long-range retrieval")."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kdax.bench.kascade_retrieval import KEY, RECORD, _scores, document, split_text, train_model


def test_documents_plant_records_early_and_query_them_at_the_end():
    train_text, held = split_text()
    assert not set(b"{|}") & set(train_text.tolist())  # the record bytes never occur in the text
    doc = document(held, 2048, np.random.default_rng(3))
    text = doc.tokens.tobytes()
    records = [text[i : i + RECORD] for i in range(len(text)) if text[i] == ord("{")]
    assert len(records) == 16 + 8 and all(r[KEY + 1] == ord("|") and r[-1] == ord("}") for r in records)
    early = dict(r[1:-1].split(b"|") for r in records[:16])
    assert all(text.index(r) < 512 for r in records[:16])  # the first quarter
    for n, r in enumerate(records[16:]):
        key, value = r[1:-1].split(b"|")
        assert early[key] == value and text.endswith(b"".join(records[16:]))
        assert doc.tokens[doc.values[n]].tobytes() == value
    assert doc.text.sum() == 2048 - 24 * RECORD and not doc.text[doc.values].any()


def test_scores_count_recalled_queries_and_text_bytes_only():
    _, held = split_text()
    doc = document(held, 1024, np.random.default_rng(1), records=4, queries=2)
    logits = np.full((1024, 256), -10.0, np.float32)
    logits[np.arange(1023), doc.tokens[1:]] = 10.0  # every next byte right
    nll, count, recalled, asked = _scores(logits, doc)
    assert (recalled, asked) == (2, 2) and count == (doc.text[1:] & doc.text[:-1]).sum() and nll < 1e-3 * count
    logits[doc.values[0, 1] - 1] = 0.0  # one value byte of the first query wrong
    assert _scores(logits, doc)[2:] == (1, 2)


def test_documents_too_short_for_their_records_raise():
    _, held = split_text()
    with pytest.raises(ValueError, match="length: expected room for 16 records"):
        document(held, 400, np.random.default_rng(0))


@pytest.mark.slow  # 120 s on the 2-core CI; tests/test_train.py keeps exact resumption in CI
def test_training_resumes_exactly(tmp_path):
    """4 steps straight equal 2 steps, a stop, a resume from the step-2 state and 2 more: the
    documents drawn after the checkpoint are the same (the batch generator's state is kept)."""
    kwargs = {"steps": 4, "batch_size": 1, "lengths": (704,), "lr": 3e-3, "progress": False, "checkpoint_every": 2}
    straight = train_model(str(tmp_path / "a"), **kwargs)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "state" / "4")  # a run stopped after its step-2 checkpoint
    with pytest.raises(ValueError, match="out_dir: .* holds checkpoints up to step 2"):
        train_model(str(tmp_path / "b"), **kwargs)
    with pytest.raises(ValueError, match=r"resume: .* written with lengths=\[704\] \(this run: \[700, 704\]\)"):
        train_model(str(tmp_path / "b"), resume=True, **{**kwargs, "lengths": (700, 704)})
    resumed = train_model(str(tmp_path / "b"), resume=True, **kwargs)
    assert len(straight) == 4 and resumed == straight[2:]
