"""The collectives of one compiled training step (loss and gradients) of a preset on a device mesh,
at two sequence lengths, so that what grows with T stands out (docs/scale.md). On a CPU host it
fakes the devices the mesh needs.

    python scripts/mesh_collectives.py [--preset tiny] [--mesh data=2,model=2,context=2] [--B 4] [--T 256,512]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--mesh", default="data=2,model=2,context=2")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", default="256,512", help="two comma-separated lengths")
    a = p.parse_args()
    devices = math.prod(int(part.split("=")[1]) for part in a.mesh.split(","))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"

    import jax
    import numpy as np
    from flax import nnx

    from kdax import train
    from kdax.models import PRESETS, KDAForCausalLM, sharding

    mesh = sharding.make_mesh(a.mesh)
    lengths = [int(t) for t in a.T.split(",")]
    counts = {}
    for T in lengths:
        graph, state = nnx.split(sharding.shard(KDAForCausalLM(PRESETS[a.preset](), rngs=nnx.Rngs(0)), mesh))
        batch = sharding.global_batch(np.zeros((a.B, T + 1), np.int32), mesh)
        step = jax.jit(jax.value_and_grad(lambda s, b, graph=graph: train.loss_fn(nnx.merge(graph, s), b)))
        text = step.lower(state, batch).compile().as_text()
        ops = "all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all"
        counts[T] = collections.Counter(re.findall(rf"= (\w+\[[\d,]*\])[^=\n]*? ({ops})\(", text))
    print(f"# {a.preset} on {a.mesh}, B={a.B}, per-device shapes in the compiled step; jax {jax.__version__}")
    print(f"| collective | T={lengths[0]}: shape x count | T={lengths[1]}: shape x count |")
    print("|---|---|---|")
    for op in sorted({op for c in counts.values() for _, op in c}):
        cells = [", ".join(f"{s} x{n}" for (s, o), n in sorted(counts[T].items()) if o == op) for T in lengths]
        print(f"| {op} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
