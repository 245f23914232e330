"""``kdax bench gpu-compare`` and ``gpu-tune`` off GPU: the kdax worker on a tiny shape (pallas_gpu in the
interpreter), and the comparison and table with the FLA worker stood in for by a copy of
the kdax xla results (FLA itself needs a CUDA GPU)."""

import json
import os

import numpy as np
import pytest

from kdax.bench import fla_compare
from tests.tolerances import BF16


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(fla_compare, "H", 1)
    monkeypatch.setattr(fla_compare, "K", 16)
    monkeypatch.setattr(fla_compare, "V", 32)
    monkeypatch.setattr(fla_compare, "SMALL", (1, 40, 2))
    monkeypatch.setattr(fla_compare, "PROFILE_CALLS", 1)


def test_counts_scale():
    f = fla_compare.flops(1, 8192, 16, 128, 128)
    assert fla_compare.flops(2, 8192, 16, 128, 128) == 2 * f == fla_compare.flops(1, 16384, 16, 128, 128)
    assert fla_compare.flops(1, 8192, 16, 128, 128, backward=True) == 3 * f
    # 128 chunks x 16 heads x (4 C^2 K + 2 C^2 (K + V) + 6 C K V + 2 C^2 V) at C = 64
    assert f == 128 * 16 * (4 * 64 * 64 * 128 + 2 * 64 * 64 * 256 + 6 * 64 * 128 * 128 + 2 * 64 * 64 * 128)
    assert fla_compare.min_bytes(1, 8192, 16, 128, 128) == 8192 * 16 * 2 * (3 * 128 + 2 * 128 + 1)


@pytest.mark.slow  # a minute on CPU; run by hand (pytest -m slow) before a GPU session
def test_kdax_worker_saves_rows_and_the_comparison_table_reads_them(tiny, tmp_path, monkeypatch, capsys):
    kd = fla_compare._kdax_worker([(1, 40)], 1, str(tmp_path / "kd"))
    assert {(r["impl"], r["mode"]) for r in kd["rows"]} == {
        (f"kdax {b}", m) for b in ("pallas_gpu", "xla") for m in ("fwd", "fwd+bwd")
    }
    assert all(r["ms"] > 0 and r["error"] is None and r["compile_s"] > 0 for r in kd["rows"])
    assert json.loads((tmp_path / "kd.json").read_text()) == kd  # saved after each shape
    # off GPU the trace has no GPU streams: the profile reports that, and the timings stand
    assert kd["profile"]["B"] == 1 and kd["profile"]["T"] == 40
    assert all(kd["profile"][m].startswith("ValueError: no GPU stream lines") for m in ("fwd", "fwd+bwd"))

    def worker(impl, shapes, repeats, out, python):
        if impl == "kdax":
            os.replace(tmp_path / "kd.npz", out + ".npz")
            return kd
        small = np.load(tmp_path / "kd.npz")  # stand-in for FLA: the xla backend's results
        np.savez(out + ".npz", **{f"fla_{i}": small[f"xla_{i}"] for i in range(6)})
        rows = [dict(r, impl="fla", compile_s=None) for r in kd["rows"] if r["impl"] == "kdax xla"]
        profile = {"B": 1, "T": 40, "calls": 1, "fwd": fla_compare.kernel_profile(FLA_EVENTS, 1), "fwd+bwd": "stand-in"}
        return {"rows": rows, "peak_tflops": 900.0, "copy_gbs": 3000.0, "device": "stand-in", "profile": profile}

    monkeypatch.setattr(fla_compare, "_worker", worker)
    res = fla_compare.compare(shapes=[(1, 40)], repeats=1)
    json.dumps(res)
    assert res["errors"]["xla"]["vs_fla"] == 0.0
    for name in ("pallas_gpu", "xla", "fla"):  # bf16 inputs against the float64 reference
        assert res["errors"][name]["vs_fp64"] < BF16["grad"], name
    assert res["errors"]["pallas_gpu"]["vs_fla"] < BF16["grad"]
    assert {r["vs_fla"] for r in res["rows"] if r["impl"] == "fla"} == {1.0}
    table = fla_compare.format_compare(res)
    assert "kdax pallas_gpu" in table and "time / FLA" in table and "vs fp64 reference" in table
    fla_row = next(line for line in table.splitlines() if "| fwd | fla |" in line)
    assert fla_row.endswith("| 1.00 |  |")  # no compile time for FLA (Triton compiles inside its timed warm-up)
    fla_fwd = table.split("\nfla fwd, B=1 T=40, 1 calls traced: 0.100 ms of device time per call in 3 kernels")[1]
    assert fla_fwd.splitlines()[3:6] == [
        "| chunk_fwd | 95.0 | 1 | 95% |",
        "| l2norm | 4.8 | 2 | 5% |",
        "| other kernels (1) | 0.2 | 1 | 0% |",
    ]  # under 1% of the time
    assert "fla fwd+bwd, B=1 T=40, 1 calls traced: the profile failed: stand-in" in table
    assert "kdax pallas_gpu fwd, B=1 T=40, 1 calls traced: the profile failed: ValueError: no GPU" in table


FLA_EVENTS = [("chunk_fwd", 95.0), ("l2norm", 4.5), ("l2norm", 0.3), ("gate", 0.2)]


def test_kernel_profile_from_a_gpu_trace():
    """The device time per kernel of a trace: GPU stream lines only (no host plane, no CUPTI
    overhead), summed per kernel name and divided by the calls traced."""
    import jax

    def meta(*names):
        return " ".join(
            f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for i, n in enumerate(names, 1)
        )

    def events(*pairs):  # (metadata id, µs)
        return " ".join(f"events {{ metadata_id: {m} offset_ps: 0 duration_ps: {int(us * 1e6)} }}" for m, us in pairs)

    trace = f"""
    planes {{ id: 1 name: "/host:CPU" lines {{ id: 1 name: "python" {events((1, 50.0))} }} {meta("host_op")} }}
    planes {{ id: 2 name: "/device:GPU:0"
      lines {{ id: 7 name: "Stream #13(Kernel)" {events((1, 30.0), (2, 0.5), (1, 40.0))} }}
      lines {{ id: 8 name: "Stream #14(MemcpyD2D)" {events((3, 2.0))} }}
      lines {{ id: 9 name: "CUPTI overhead" {events((4, 99.0))} }}
      {meta("_state_kernel", "loop_fusion", "Memcpy DtoD", "overhead")} }}"""
    data = jax.profiler.ProfileData.from_text_proto(trace)
    assert sorted(fla_compare.gpu_stream_events(data)) == sorted(
        [("_state_kernel", 30.0), ("loop_fusion", 0.5), ("_state_kernel", 40.0), ("Memcpy DtoD", 2.0)]
    )
    assert fla_compare.kernel_profile(fla_compare.gpu_stream_events(data), calls=2) == [
        {"kernel": "_state_kernel", "us": 35.0, "launches": 1.0},
        {"kernel": "Memcpy DtoD", "us": 1.0, "launches": 0.5},
        {"kernel": "loop_fusion", "us": 0.25, "launches": 0.5},
    ]
    host_only = jax.profiler.ProfileData.from_text_proto(trace.split("planes { id: 2")[0])
    with pytest.raises(ValueError, match="no GPU stream lines"):
        fla_compare.gpu_stream_events(host_only)


@pytest.mark.slow
def test_gpu_tune_runs_its_sweep(monkeypatch):
    """The launch-table sweep off GPU, cut to one value per axis: it runs, each config timed once."""
    from kdax.bench import gpu_tune
    from kdax.ops.kda import pallas_gpu

    monkeypatch.setattr(gpu_tune, "BLOCK_V", (16,))
    monkeypatch.setattr(gpu_tune, "BLOCK_K", (16,))
    monkeypatch.setattr(gpu_tune, "WARPS", (2,))
    monkeypatch.setattr(gpu_tune, "STAGES", (3,))
    lines = []
    res = gpu_tune.tune(B=1, T=20, H=1, K=16, V=16, repeats=1, log=lines.append)
    assert res["block_v"] == res["block_k"] == 16 and res["launch"] == dict.fromkeys(pallas_gpu.LAUNCH, (2, 3))
    assert res["fwd_bwd_ms"] > 0 and len(lines) == 1 + len(pallas_gpu.LAUNCH)  # each config timed once
    lines.clear()
    res = gpu_tune.tune(B=1, T=20, H=1, K=16, V=16, repeats=1, kernels=(), blocks=(32, 16), log=lines.append)
    assert (res["block_v"], res["block_k"], res["launch"]) == (32, 16, {}) and len(lines) == 1  # blocks kept, no sweep
    with pytest.raises(ValueError, match="kernels"):
        gpu_tune.tune(kernels=["state", "nope"])
