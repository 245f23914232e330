"""The suite's error bars, one table: relative RMS error (``kdax.bench.measure.rel_rms``) against a
reference, or ``rtol`` of an element-wise comparison, by the computation's dtype and by what is
compared:

- "out", "grad": outputs and gradients against a float64 reference (for float64 itself: float64
  results of another schedule, e.g. the chunked form against the token scan);
- "same": the same computation compiled apart, vectorised, or reassociated: rounding only.
"""

import jax.numpy as jnp

TOL = {
    jnp.float64: {"out": 1e-10, "same": 1e-12},
    jnp.float32: {"out": 1e-5, "grad": 1e-4, "same": 1e-6},
    jnp.bfloat16: {"out": 1e-2, "grad": 2e-2},
    jnp.float16: {"out": 1e-3, "grad": 2e-3},  # about 2 units of float16 rounding (2^-11)
}
F64, F32, BF16 = TOL[jnp.float64], TOL[jnp.float32], TOL[jnp.bfloat16]
