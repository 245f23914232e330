"""backend="auto" on a TPU runs an op's Pallas kernels only where they compiled for the chips and
cost fewer static cycles than xla (kdax/ops/common/tpu_costs.json, written by
scripts/tpu_compile_report.py --peers --record); otherwise xla, saying why."""

import jax.numpy as jnp
import pytest

import kdax
from kdax.ops.common import dispatch, tpu_costs

TPU_OPS = ("chunk_kda", "fused_recurrent_kda", "kascade_anchor", "kascade_reuse", "kascade_anchor_decode")
TPU_OPS += ("kascade_reuse_decode", "paged_latent_attention", "index_select", "indexed_attention")


def _entry(kernel_cycles, xla_cycles, compiles=True, lower_bound=False, dtype="float32", xla_bound=False):
    return {
        "chip": "v5e",
        "op": "chunk_kda",
        "dtype": dtype,
        "shape": "B=1 T=8192",
        "passes": "fwd",
        "pallas_tpu": {"compiles": compiles, "cycles": kernel_cycles, "lower_bound": lower_bound},
        "xla": {"compiles": True, "cycles": xla_cycles, "lower_bound": xla_bound},
    }


def test_the_table_covers_every_op_with_tpu_kernels_in_both_dtypes():
    table = tpu_costs.table()
    assert {"jax", "libtpu", "date", "command", "entries"} <= set(table)
    covered = {(e["op"], e["dtype"]) for e in table["entries"]}
    assert {(op, dt) for op in TPU_OPS for dt in ("bfloat16", "float32")} <= covered
    assert set(TPU_OPS) == {name for name, op in dispatch.REGISTRY.items() if "pallas_tpu" in op.cores}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", TPU_OPS)
def test_auto_on_a_tpu_runs_the_kernels_only_where_they_compiled_and_cost_less(op, dtype):
    """Per dtype, and for the decode ops per cache layout (their entries name it)."""
    for layout in ("BLGD", "BGLD") if op.endswith("_decode") else (None,):
        entries = [
            e
            for e in tpu_costs.table()["entries"]
            if e["op"] == op and e["dtype"] == jnp.dtype(dtype).name and e.get("layout") == layout
        ]
        assert entries
        pays = all(
            e["pallas_tpu"]["compiles"]
            and (
                not e["xla"]["compiles"]
                or (not e["pallas_tpu"]["lower_bound"] and e["pallas_tpu"]["cycles"] < e["xla"]["cycles"])
            )
            for e in entries
        )
        layouts = {"cache_layout": layout} if layout else {}
        asked_from_here = kdax.explain_backend(dtype, op=op, platform="tpu", **layouts)
        with dispatch.building_for("tpu"):
            backend, why = kdax.explain_backend(dtype, op=op, **layouts)
            assert (backend, why) == asked_from_here  # platform= answers for a TPU from this CPU
            assert (backend == "pallas_tpu") == pays, why
            if not pays:
                assert "TPU kernels" in why
            with kdax.use_backend("pallas_tpu"):  # asked for, the kernels run all the same
                assert kdax.explain_backend(dtype, op=op, **layouts)[0] == "pallas_tpu"
        assert kdax.explain_backend(dtype, op=op, **layouts)[0] == "xla"  # no TPU here


def test_the_rule_on_made_up_costs():
    cheaper, dearer = [_entry(5, 9)], [_entry(9, 9)]
    assert tpu_costs.refuse("chunk_kda", jnp.float32, cheaper) is None
    assert "cost 0.0 M static cycles against xla's 0.0 M" in tpu_costs.refuse("chunk_kda", jnp.float32, dearer)
    assert "did not compile" in tpu_costs.refuse("chunk_kda", jnp.float32, [_entry(5, 9, compiles=False)])
    assert "the kernels' only bounded below" in tpu_costs.refuse(
        "chunk_kda", jnp.float32, [_entry(5, 9, lower_bound=True)]
    )
    assert "cost at least" in tpu_costs.refuse("chunk_kda", jnp.float32, [_entry(9, 5, lower_bound=True)])
    assert tpu_costs.refuse("chunk_kda", jnp.float32, [_entry(5, 9, xla_bound=True)]) is None  # 5 < 9 <= xla's
    assert "xla's only bounded below" in tpu_costs.refuse("chunk_kda", jnp.float32, [_entry(9, 5, xla_bound=True)])
    assert "no compiled cost" in tpu_costs.refuse("chunk_kda", jnp.float16, cheaper)
    assert tpu_costs.refuse("chunk_kda", jnp.float32, cheaper + dearer) is not None  # every entry must pay
    heads_first = [{**_entry(5, 9), "layout": "BGLD"}, {**_entry(9, 5), "layout": "BLGD"}]  # a decode op's
    assert tpu_costs.refuse("chunk_kda", jnp.float32, heads_first, layout="BGLD") is None
    assert "cost" in tpu_costs.refuse("chunk_kda", jnp.float32, heads_first, layout="BLGD")
    assert "and BGLD caches" in tpu_costs.refuse("chunk_kda", jnp.float32, cheaper, layout="BGLD")
    with pytest.raises(ValueError, match="cache_layout"):
        kdax.explain_backend(op="kascade_reuse_decode", cache_layout="BTGD")
    with pytest.raises(ValueError, match="platform: expected None, 'cpu', 'gpu' or 'tpu'"):
        kdax.explain_backend(platform="cuda")


def test_auto_follows_the_table(monkeypatch):
    """The choice reads the table, not a fixed answer: cheaper kernels are taken."""
    monkeypatch.setattr(tpu_costs, "table", lambda: {"entries": [_entry(5, 9), _entry(5, 9, dtype="bfloat16")]})
    with dispatch.building_for("tpu"):
        assert kdax.explain_backend(jnp.float32) == ("pallas_tpu", "the device's kernels")
        assert kdax.explain_backend(jnp.bfloat16) == ("pallas_tpu", "the device's kernels")
        assert kdax.explain_backend(jnp.float32, op="kascade_reuse")[0] == "xla"  # no entry
