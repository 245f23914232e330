"""What the pallas_tpu kernels cost against the xla backend, compiled for TPU chips without a TPU:
the table ``backend="auto"`` consults on a TPU (docs/kda_tpu.md, "Compiled for chips").

``tpu_costs.json`` is written by ``python scripts/tpu_compile_report.py --peers --record
kdax/ops/common/tpu_costs.json``: per chip, op, dtype, benchmark shape and passes (forward, or
forward and backward), whether each backend's program compiled and its static cycles (VLIW bundles
weighted by the trip counts of the loops around them; a lower bound where a loop's trips depend on
the data; decode ops' entries also name the caches' layout). "auto" runs an op's TPU kernels for
inputs of a dtype (and a layout) only where every entry of that op and dtype (and layout) says
they compiled and cost fewer static cycles than xla; else xla, and :func:`kdax.explain_backend`
says why.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import jax.numpy as jnp


@functools.cache
def table() -> dict:
    """The recorded table: {"jax", "libtpu", "date", "command", "entries": [...]}."""
    return json.loads(resources.files("kdax.ops.common").joinpath("tpu_costs.json").read_text())


def _m(cycles: int) -> str:
    return f"{cycles / 1e6:,.1f} M"


def refuse(op: str, dtype, entries: list[dict] | None = None, layout: str | None = None) -> str | None:
    """Why "auto" on a TPU runs xla instead of ``op``'s pallas_tpu kernels for ``dtype`` inputs.

    Args:
        op: a public op's name ("chunk_kda", "kascade_reuse", ...).
        dtype: the inputs' dtype.
        entries: the table's entries (None: the recorded table's).
        layout: a decode op's cache layout ("BLGD" or "BGLD"); None for the other ops.

    Returns:
        The reason, or None where every entry of ``op`` and ``dtype`` has the kernels compiled and
        shown cheaper than xla: their exact static cycles below xla's (exact, or a lower bound),
        or xla's program not compiling.
    """
    name = jnp.dtype(dtype).name
    entries = table()["entries"] if entries is None else entries
    mine = [e for e in entries if e["op"] == op and e["dtype"] == name and e.get("layout") == layout]
    if not mine:
        what = f"{name} inputs" + (f" and {layout} caches" if layout else "")
        return f"no compiled cost of the TPU kernels for {what} (scripts/tpu_compile_report.py --peers)"
    for e in mine:
        kernel, xla, where = e["pallas_tpu"], e["xla"], f"{e['chip']}, {e['shape']}, {e['passes']}"
        costs = f"{_m(kernel['cycles'])} static cycles against xla's {_m(xla['cycles'])} ({where}; tpu_costs.json)"
        if not kernel["compiles"]:
            return f"the TPU kernels did not compile ({where})"
        if not xla["compiles"]:
            continue
        if kernel["cycles"] >= xla["cycles"] and not xla["lower_bound"]:
            return f"the TPU kernels cost {'at least ' if kernel['lower_bound'] else ''}{costs}"
        if kernel["cycles"] >= xla["cycles"] or kernel["lower_bound"]:  # a bound on either side decides nothing
            bounded = " and ".join(n for n, c in (("the kernels'", kernel), ("xla's", xla)) if c["lower_bound"])
            return f"the TPU kernels are not shown cheaper: {bounded} only bounded below, {costs}"
    return None
