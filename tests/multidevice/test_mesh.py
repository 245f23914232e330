"""kdax on a mesh of 8 fake CPU devices, in one subprocess (the rest of the suite keeps one device;
one test, so that pytest-xdist starts the worker once): context-parallel chunk_kda against one
device, every op on batch- and head-sharded arrays without communication, and the model's sharded
training step and checkpoints against one device; by hand (slow), Kimi Linear and Ling with an
expert axis."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BAR = 1e-5  # fp32 rel. RMS of outputs, final states and every gradient


def _worker(*args) -> dict:
    """The worker's results, run on 8 fake CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"  # keeps conftest's
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.multidevice.worker", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_context_parallel_and_sharded_ops_on_8_devices():
    r = _worker()
    failures = []

    # (o, final, dq, dk, dv, dg, dbeta, dh0) against one device, GVA, K != V, a burst of strong decay:
    # two rows of T = 250 (padded to 8 x 32); sequences of 5, 0, 95, 1 and 155 tokens over devices of
    # 32 tokens with the gate (raw logits), l2norm and beta sigmoid in the kernel; the Pallas GPU kernels
    # (interpreted) as the local op on both sides, T = 128 over devices of 16 tokens
    for case in ("dense_T250_padded", "varlen_in_kernel_options", "pallas_gpu"):
        if len(r[case]) != 8 or max(r[case]) > BAR:
            failures.append(f"{case}: {r[case]}")
    # inside the caller's shard_map: dense rows (o, final, intermediate states, states [V, K]), then
    # packed sequences (o, final)
    if len(r["in_shard_map"]) != 5 or max(r["in_shard_map"]) > BAR:
        failures.append(f"in_shard_map: {r['in_shard_map']}")
    # one all-gather of the W pairs (W x HV x K x (K + V) float32), the same at T = 256 and 1024
    sizes = r["gathered_bytes"]
    if sizes["T256"] != [8 * 4 * 16 * (16 + 24) * 4] or sizes["T1024"] != sizes["T256"]:
        failures.append(f"gathered bytes: {sizes}")
    errors = r["errors"]
    if "context_parallel.axis" not in errors["axis"] or "'seq'" not in errors["axis"]:
        failures.append(f"axis not in the mesh: {errors['axis']}")
    if "cu_seqlens" not in errors["cu_seqlens_B2"]:
        failures.append(f"B > 1 with cu_seqlens: {errors['cu_seqlens_B2']}")
    if "multiple of chunk_size=16" not in errors["local_T"]:
        failures.append(f"local T: {errors['local_T']}")
    # batch over 2 devices x heads over 4: no collective in the compiled program, the same values
    for name, got in r["sharded_ops"].items():
        if got["collectives"] or got["rel_err"] > BAR:
            failures.append(f"{name} sharded: {got}")
    # the tiny hybrid on data=2 x model=2 x context=2 against one device: loss and every gradient; four
    # AdamW steps; resumed at step 2 from the sharded checkpoint onto data=4 x model=2
    m = r["model"]
    if m["loss_err"] > BAR or m["grad_err"] > 1e-4:
        failures.append(f"model loss / gradients on the mesh: {m['loss_err']}, {m['grad_err']}")
    # a padded batch (attention_mask) and packed sequences: XLA partitions the one-device code
    if m["mask_err"] > BAR or m["packed_err"] > BAR:
        failures.append(f"masked / packed logits on the mesh: {m['mask_err']}, {m['packed_err']}")
    for run, losses in (("mesh", m["mesh"]), ("resumed", m["resumed"])):
        want = m["one_device"][-len(losses) :]
        if len(losses) != {"mesh": 4, "resumed": 2}[run] or max(abs(a / b - 1) for a, b in zip(losses, want)) > BAR:
            failures.append(f"{run} losses {losses} vs one device {m['one_device']}")
    if m["restored_meshes"] != [str({"data": 4, "model": 2})]:
        failures.append(f"restored onto meshes {m['restored_meshes']}")
    for case, words in (
        ("mesh_size", "product is the 8 devices"),
        ("mesh_axis", "axes among"),
        ("heads", "num_heads=4"),
        ("explicit", "Auto axes"),
        ("batch_size", "batch_size"),
        ("seq_len", "multiple of 256"),
    ):
        if words not in m[case]:
            failures.append(f"{case}: {m[case]}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_kimi_linear_ling_and_glm5_with_an_expert_axis_on_8_devices():
    """Kimi Linear on data=2,expert=2,context=2, Ling and GLM-5.3 on data=2,model=2,expert=2 (KDA, MLA,
    DSA, MoE):
    loss and every gradient against one device, experts stored split; two AdamW steps of Kimi."""
    h = _worker("hybrids")
    failures = []
    for case, got in h.items():
        if case in ("one_device", "mesh"):
            continue
        if got["loss_err"] > BAR or got["grad_err"] > 1e-4 or got["expert_shards"] != ["P('expert', 'data')"]:
            failures.append(f"{case}: {got}")
    if max(abs(a / b - 1) for a, b in zip(h["mesh"], h["one_device"])) > BAR:
        failures.append(f"kimi AdamW steps on the mesh {h['mesh']} vs one device {h['one_device']}")
    assert not failures, "\n".join(failures)
