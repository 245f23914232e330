"""The checks every KDA entry point makes of its arrays, the references' included."""

from __future__ import annotations

import jax
import numpy as np

from kdax.ops.common.validation import check_array, fail

CHUNK_SIZES = (16, 32, 64, 128)
MAX_HEAD_DIM = 256


def offsets(cu_seqlens):
    """cu_seqlens as an array: a list or tuple of offsets becomes a NumPy array (then checked)."""
    return np.asarray(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else cu_seqlens


def check_inputs(
    q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=None, state_v_first: bool = False
) -> int:
    """Check the arrays of a KDA call against each other.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV].
        scale: a Python number or None.
        initial_state: [N, HV, K, V] ([N, HV, V, K] with ``state_v_first``) or None.
        cu_seqlens: [N + 1] int offsets (B = 1), non-decreasing from 0 to T where concrete.
        chunk_size: one of :data:`CHUNK_SIZES`, or None where there is none.
        state_v_first: the layout of ``initial_state``.

    Returns:
        N, the number of sequences.

    Raises:
        ValueError: naming the first argument that is not as above.
    """
    check_array("q", q, 4)
    B, T, H, K = q.shape
    if B < 1 or H < 1:
        fail("q", "at least one sequence and one head (B, H >= 1)", f"shape {tuple(q.shape)}")
    check_array("k", k, 4, q.shape)
    check_array("v", v, 4)
    if tuple(v.shape[:2]) != (B, T):
        fail("v", f"shape ({B}, {T}, HV, V) matching q's batch and time", f"shape {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if HV < 1 or HV % H:
        fail("v", f"a number of value heads HV divisible by q's heads H={H}", f"HV={HV}")
    check_array("g", g, 4, (B, T, HV, K))
    check_array("beta", beta, 3, (B, T, HV))
    if T < 1:
        fail("q", "at least one token (T >= 1)", f"T={T}")
    if not 1 <= K <= MAX_HEAD_DIM:
        fail("q", f"head dim K in [1, {MAX_HEAD_DIM}]", f"K={K}")
    if V < 1:
        fail("v", "value dim V >= 1", f"V={V}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        fail("k, v", f"the dtype of q ({q.dtype})", f"k {k.dtype}, v {v.dtype}")
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        fail("scale", "a Python float or None", type(scale).__name__)
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        fail("chunk_size", f"one of {CHUNK_SIZES}", repr(chunk_size))
    N = B
    if cu_seqlens is not None:
        check_array("cu_seqlens", cu_seqlens, 1, integer=True)
        if cu_seqlens.shape[0] < 2:
            fail("cu_seqlens", "at least 2 entries [0, ..., T]", f"shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            fail("q", "batch size B=1 when cu_seqlens is given", f"B={B}")
        N = cu_seqlens.shape[0] - 1
        if not isinstance(cu_seqlens, jax.core.Tracer):
            cu = np.asarray(cu_seqlens)
            if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
                fail("cu_seqlens", f"non-decreasing offsets from 0 to T={T}", cu.tolist())
    if initial_state is not None:
        check_array("initial_state", initial_state, 4, (N, HV, V, K) if state_v_first else (N, HV, K, V))
    return N
