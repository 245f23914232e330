"""The MLA layer (float32) against DeepSeek's formulas written out in NumPy (float64): the expanded
prefill, the absorbed decode over the latent cache, RoPE in the interleaved layout, the head-wise gate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax.bench.measure import rel_rms
from kdax.nn.mla import MLA
from tests.tolerances import F32


def _mla(q_lora_rank=None, rope_theta=None, output_gate=False, seed=0):
    mla = MLA(
        40,
        4,
        kv_lora_rank=12,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        q_lora_rank=q_lora_rank,
        rope_theta=rope_theta,
        output_gate=output_gate,
        rngs=nnx.Rngs(seed),
    )
    graphdef, state = nnx.split(mla)
    rng = np.random.default_rng(seed)  # norms away from ones, so a wrong norm shows
    state = jax.tree.map(lambda a: (a * (1 + 0.2 * rng.standard_normal(a.shape))).astype(a.dtype), state)
    return nnx.merge(graphdef, state)


def _rope_interleaved(x, positions, theta):
    """transformers' DeepSeek RoPE: features (2i, 2i+1) rotated together by angle pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = positions[:, :, None, None] * inv  # [B, T, 1, d/2]
    a, b = x[..., 0::2], x[..., 1::2]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)


def _reference(mla, x, positions, lengths):
    """Every head's keys and values expanded, causal softmax attention within each row's tokens."""
    p = lambda m: np.asarray(m.kernel[...], np.float64)
    rms = lambda z, w: z / np.sqrt(np.mean(z**2, -1, keepdims=True) + 1e-6) * np.asarray(w.weight[...], np.float64)
    B, T, _ = x.shape
    H, dn, dr, dv, r = 4, 6, 4, 5, 12
    q = x @ p(mla.q_proj) if mla.q_lora_rank is None else rms(x @ p(mla.q_a_proj), mla.q_a_layernorm) @ p(mla.q_b_proj)
    q = q.reshape(B, T, H, dn + dr)
    kv = x @ p(mla.kv_a_proj_with_mqa)
    c, kr = rms(kv[..., :r], mla.kv_a_layernorm), kv[..., r:][:, :, None]
    qr = q[..., dn:]
    if mla.rope_theta is not None:
        qr, kr = _rope_interleaved(qr, positions, mla.rope_theta), _rope_interleaved(kr, positions, mla.rope_theta)
    kvb = (c @ p(mla.kv_b_proj)).reshape(B, T, H, dn + dv)
    k = np.concatenate([kvb[..., :dn], np.broadcast_to(kr, (B, T, H, dr))], -1)
    qq = np.concatenate([q[..., :dn], qr], -1)
    s = np.einsum("bthd,bshd->bhts", qq, k) / np.sqrt(dn + dr)
    ok = (np.arange(T)[:, None] >= np.arange(T)) & (np.arange(T) < np.asarray(lengths)[:, None, None])
    s = np.where(ok[:, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhts,bshd->bthd", w / w.sum(-1, keepdims=True), kvb[..., dn:])
    if mla.g_proj is not None:
        o = o / (1 + np.exp(-(x @ p(mla.g_proj))))[..., None]
    return o.reshape(B, T, -1) @ p(mla.o_proj)


@pytest.mark.parametrize(
    ("q_lora_rank", "rope_theta", "output_gate"), [(None, None, False), (8, 10000.0, True), (None, 500.0, False)]
)
def test_prefill_and_absorbed_decode_match_the_formulas(q_lora_rank, rope_theta, output_gate):
    """Kimi's layout (no q LoRA, NoPE), Ling's (RoPE, gate) with a q LoRA; the prefill of a
    padded batch (segments) and then token-by-token decoding over the latent cache."""
    mla = _mla(q_lora_rank, rope_theta, output_gate)
    B, T, lengths = 2, 9, [9, 6]
    x = np.random.default_rng(1).standard_normal((B, T, 40))
    positions = np.broadcast_to(np.arange(T), (B, T))
    want = _reference(mla, x, positions, [T, T])
    y, _ = mla(jnp.asarray(x, jnp.float32))
    assert y.dtype == jnp.float32 and rel_rms(y, want) <= F32["out"]

    n0 = 4  # prefill the first n0 tokens (row 1 padded after 3) into a cache, then decode one by one
    seg = jnp.asarray(np.arange(n0)[None] >= np.array([[n0], [3]]), jnp.int32)
    cache = mla.init_cache(B, T)
    y, cache = mla(
        jnp.asarray(x[:, :n0], jnp.float32), positions=jnp.asarray(positions[:, :n0]), segment_ids=seg, cache=cache
    )
    assert rel_rms(y[0], want[0, :n0]) <= F32["out"] and rel_rms(y[1, :3], want[1, :3]) <= F32["out"]
    assert cache[0].shape == (B, T, 1, 12) and cache[1].shape == (B, T, 1, 4)  # (r + dr) numbers a token
    rows = [list(x[0, :n0]), list(x[1, :3])]
    for step in range(lengths[1] - 3):
        nxt = np.stack([x[0, n0 + step], x[1, 3 + step]])
        pos = jnp.asarray([[n0 + step], [3 + step]])
        y, cache = mla(jnp.asarray(nxt[:, None], jnp.float32), positions=pos, cache=cache)
        for b in range(B):
            rows[b].append(nxt[b])
            seq = np.stack(rows[b])[None]
            ref = _reference(mla, seq, np.arange(len(seq[0]))[None], [len(seq[0])])[0, -1]
            assert rel_rms(y[b, 0], ref) <= F32["out"]


def test_jit_and_grad():
    mla = _mla(8, 10000.0, True)
    x = jax.random.normal(jax.random.key(0), (2, 5, 40))
    y = nnx.jit(lambda m, x: m(x)[0])(mla, x)
    assert rel_rms(y, mla(x)[0]) <= F32["same"]
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(mla)
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"kv_lora_rank": 0}, "kv_lora_rank: expected a positive int"),
        ({"q_lora_rank": -1}, "q_lora_rank: expected a positive int"),
        ({"rope_theta": 0.0}, "rope_theta: expected None or a positive"),
        ({"rope_theta": 1e4, "qk_rope_head_dim": 3}, "qk_rope_head_dim: expected an even"),
    ],
)
def test_settings_are_checked(kwargs, says):
    args = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4} | kwargs
    with pytest.raises(ValueError, match=says):
        MLA(16, 2, **args, rngs=nnx.Rngs(0))
