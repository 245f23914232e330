"""scripts/tpu_compile_report.py's costs table and causal model (its listing counter,
kdax.bench.llo, is tests/test_llo.py's)."""

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("tpu_compile_report", os.path.join(ROOT, "scripts/tpu_compile_report.py"))
report = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # dataclasses look it up
spec.loader.exec_module(report)


def test_record_with_only_updates_the_backend_it_compiled(tmp_path):
    """A run with --only that compiled one backend's program updates that backend of the entry and
    keeps the other, and the table's command lists both runs."""
    path = str(tmp_path / "costs.json")
    where = {"chip": "v5e", "op": "chunk_kda", "dtype": "bfloat16", "shape": "B=1", "passes": "fwd"}
    cost = lambda n: {"compiles": True, "cycles": n, "lower_bound": False}
    report.record(path, [dict(where, pallas_tpu=cost(3), xla=cost(9))], ["--peers"])
    report.record(path, [dict(where, pallas_tpu=cost(2))], ["--peers", "--only", "pallas_tpu$"])
    table = json.load(open(path))
    assert table["entries"] == [dict(where, pallas_tpu=cost(2), xla=cost(9))]
    assert table["command"].count("scripts/tpu_compile_report.py") == 2


def test_causal_share_counts_the_blocks_on_and_below_the_diagonal():
    assert report.causal_share(4096, 1024, 1024) == 10 / 16  # 1 + 2 + 3 + 4 of 16
    assert report.causal_share(4096, 2048, 1024) == 6 / 8  # query blocks of two key blocks: 2 + 4 of 8
    assert report.causal_share(1000, 512, 512) == 3 / 4  # a partial last block
