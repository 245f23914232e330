"""``kdax bench cp``: context-parallel chunk_kda forward+backward against one device: time and
peak memory per device (XLA's buffer assignment of the compiled step), strong scaling (T fixed,
1 to W devices) and weak scaling (T per device fixed). On CPU, ``--devices N`` fakes N devices."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kdax
from kdax.bench import flags
from kdax.bench.kda import make_inputs
from kdax.bench.measure import time_calls


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured configuration: W devices on the context axis (W = 1: plain chunk_kda)."""

    scaling: str  # "strong" or "weak"
    devices: int
    T: int
    median_ms: float
    iqr_ms: tuple[float, float]
    peak_mib_per_device: float  # arguments + outputs + temporaries of the compiled step, per device


def _step(cp, chunk_size: int):
    """jit(grad of 0.5 sum(o^2) w.r.t. q, k, v, g, beta), context-parallel with ``cp`` (None: one device)."""

    def loss(q, k, v, g, beta):
        o, _ = kdax.chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, context_parallel=cp)
        return 0.5 * jnp.sum(jnp.square(o.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def measure(W: int, T: int, H: int, K: int, V: int, chunk_size: int, repeats: int, scaling: str) -> Row:
    """Time and peak memory per device of one forward+backward at length T over W devices."""
    args = make_inputs(1, T, H, K, V, jnp.float32)
    cp = None
    if W > 1:  # the inputs already split over time, as a sharded model hands them over
        mesh = jax.make_mesh((W,), ("context",), devices=jax.devices()[:W])
        cp = kdax.ContextParallel("context", mesh)
        args = [jax.device_put(x, NamedSharding(mesh, P(None, "context"))) for x in args]
    step = _step(cp, chunk_size)
    m = step.lower(*args).compile().memory_analysis()  # of one device's program
    peak = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes) / 2**20
    t = time_calls(lambda: step(*args), repeats)
    return Row(scaling, W, T, t.median, (t.q25, t.q75), peak)


def run(T=262144, H=4, K=128, V=128, chunk_size=64, repeats=3, weak_T=None, progress=True) -> list[Row]:
    """Strong scaling at T over 1, 2, 4, ... devices, then weak scaling at ``weak_T`` tokens per device.

    Args:
        T: the strong-scaling length (a multiple of the device count times chunk_size pads less).
        H, K, V, chunk_size: the op's shape.
        repeats: timed calls per configuration (after one that compiles).
        weak_T: tokens per device of the weak-scaling rows (None: T / devices).
        progress: print each row to stderr as it is measured.

    Returns:
        The rows, strong then weak.
    """
    n = len(jax.devices())
    counts = [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= n]
    per = weak_T or T // counts[-1]
    rows = []
    for scaling, shapes in (("strong", [(w, T) for w in counts]), ("weak", [(w, w * per) for w in counts])):
        for w, t in shapes:
            rows.append(measure(w, t, H, K, V, chunk_size, repeats, scaling))
            if progress:
                print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    head = ("scaling", "devices", "T", "median ms (IQR)", "peak MiB per device")
    lines = [
        (
            r.scaling,
            str(r.devices),
            str(r.T),
            f"{r.median_ms:.0f} ({r.iqr_ms[0]:.0f}-{r.iqr_ms[1]:.0f})",
            f"{r.peak_mib_per_device:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    fmt = lambda cols: "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |"
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(x) for x in lines])


def peak_ratio(rows: list[Row]) -> float:
    """Peak memory per device of the most devices over one device's, at the strong-scaling T."""
    strong = [r for r in rows if r.scaling == "strong"]
    return strong[-1].peak_mib_per_device / strong[0].peak_mib_per_device


def register(sub) -> None:
    """``kdax bench cp``."""
    p = flags.command(
        sub,
        "cp",
        _command,
        "context-parallel chunk_kda forward+backward over 1, 2, 4, ... devices: time, memory per device",
    )
    flags.shape(p, T=262144, H=4, K=128, V=128)
    p.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64, 128), help="chunk_size of chunk_kda")
    p.add_argument(
        "--devices", type=flags.at_least(0), default=8, help="devices to fake on a CPU host (0: as they are)"
    )
    p.add_argument("--weak-T", type=flags.at_least(1), help="tokens per device, weak scaling (default: --T / devices)")
    flags.output(p, repeats=3)


def _command(ns, parser) -> int:
    if ns.devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # before the first device query: fake devices on a CPU host (no effect on accelerators)
        flag = f"--xla_force_host_platform_device_count={ns.devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    m = flags.meta(ns)
    m["devices"] = len(jax.devices())
    if not ns.json:
        print(
            f"compiling and timing chunk_kda forward+backward over 1 to {m['devices']} devices (T={ns.T})...",
            file=sys.stderr,
            flush=True,
        )
    shape = {"T": ns.T, "H": ns.H, "K": ns.K, "V": ns.V, "chunk_size": ns.chunk_size}
    rows = run(**shape, repeats=ns.repeats, weak_T=ns.weak_T, progress=not ns.json)
    table = "\n".join(
        [
            f"# B=1 H={ns.H} K={ns.K} V={ns.V} float32, chunk {ns.chunk_size}: forward+backward of 0.5 sum(o^2)",
            format_table(rows),
            f"peak memory per device, most devices / one device at T={ns.T}: {peak_ratio(rows):.3f}",
        ]
    )
    m["device"] += f" x {m['devices']}"
    return flags.emit(ns, m, "cp", [dataclasses.asdict(r) for r in rows], table)
