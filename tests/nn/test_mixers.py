"""KimiDeltaAttention and Attention: FLA's parameter layout, modes, caches, varlen, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax.bench.measure import rel_rms
from kdax.nn import Attention, KimiDeltaAttention
from tests.tolerances import F32


def _kda(**kw):
    args = {"hidden_size": 48, "head_dim": 16, "num_heads": 2, "num_v_heads": 4, "expand_v": 1.25}
    return KimiDeltaAttention(**{**args, "backend": "xla", "chunk_size": 16, **kw}, rngs=nnx.Rngs(0))


def _x(B, T, D=48, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)


def test_kda_parameters_follow_fla_layout():
    layer = _kda()
    shapes = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    K, HV, Vd, D = 16, 4, 20, 48
    assert shapes == {
        "q_proj.kernel": (D, 2 * K),
        "k_proj.kernel": (D, 2 * K),
        "v_proj.kernel": (D, HV * Vd),
        "q_conv1d.weight": (2 * K, 1, 4),
        "k_conv1d.weight": (2 * K, 1, 4),
        "v_conv1d.weight": (HV * Vd, 1, 4),
        "f_proj.layers.0.kernel": (D, Vd),
        "f_proj.layers.1.kernel": (Vd, HV * K),
        "b_proj.kernel": (D, HV),
        "A_log": (HV,),
        "dt_bias": (HV * K,),
        "g_proj.layers.0.kernel": (D, Vd),
        "g_proj.layers.1.kernel": (Vd, HV * Vd),
        "g_proj.layers.1.bias": (HV * Vd,),
        "o_norm.weight": (Vd,),
        "o_proj.kernel": (HV * Vd, D),
    }
    a = np.exp(np.asarray(layer.A_log[...]))
    assert np.all((a >= 1) & (a <= 16))
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert np.all((dt >= 1e-4 - 1e-9) & (dt <= 0.1 + 1e-6))


@pytest.mark.parametrize("use_short_conv", [True, False])
def test_kda_recurrent_mode_equals_chunk_mode(use_short_conv):
    layer = _kda(use_short_conv=use_short_conv)
    x = _x(2, 37)
    y_chunk, c_chunk = layer(x, mode="chunk", output_cache=True)
    y_rec, c_rec = layer(x, mode="fused_recurrent", output_cache=True)
    assert y_chunk.shape == x.shape
    assert rel_rms(y_rec, y_chunk) <= F32["out"]
    assert rel_rms(c_rec.recurrent, c_chunk.recurrent) <= F32["out"]


def test_kda_mode_rule_follows_fla():
    layer = _kda()
    assert layer.pick_mode(8) == "chunk"  # training: always chunk
    layer.eval()
    assert (layer.pick_mode(64), layer.pick_mode(65)) == ("fused_recurrent", "chunk")
    layer.train()
    assert layer.pick_mode(8) == "chunk"
    recurrent = _kda(mode="fused_recurrent")  # the layer's mode wherever the rule does not pick recurrent
    assert recurrent.pick_mode(8) == recurrent.pick_mode(1000) == "fused_recurrent"


def test_kda_cache_prefill_then_decode_equals_full_run():
    layer = _kda()
    x = _x(2, 29)
    full, _ = layer(x)
    y, cache = layer(x[:, :20], output_cache=True)
    ys = [y]
    for t in range(20, 29):
        y, cache = layer(x[:, t : t + 1], cache=cache, output_cache=True, mode="fused_recurrent")
        ys.append(y)
    assert rel_rms(jnp.concatenate(ys, axis=1), full) <= F32["out"]


def test_kda_varlen_equals_per_sequence_runs():
    layer = _kda()
    lengths = [1, 17, 0, 6, 1]
    x = _x(1, sum(lengths))
    cu = jnp.array(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    y, cache = layer(x, cu_seqlens=cu, output_cache=True)
    for n, L in enumerate(lengths):
        s = int(cu[n])
        if L:
            y_n, c_n = layer(x[:, s : s + L], output_cache=True)
            assert rel_rms(y[:, s : s + L], y_n) <= F32["out"]
            assert rel_rms(cache.recurrent[n], c_n.recurrent[0]) <= F32["out"]
            assert rel_rms(cache.conv[2][n], c_n.conv[2][0]) <= F32["same"]
        else:
            assert float(jnp.abs(cache.recurrent[n]).max()) == 0.0


def test_kda_grad_and_jit():
    layer = _kda(lower_bound=-5.0, allow_neg_eigval=True)
    x = _x(1, 21)

    @nnx.jit
    def loss(layer, x):
        return jnp.mean(layer(x)[0] ** 2)

    grads = nnx.grad(loss)(layer, x)
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g[...] if hasattr(g, "__getitem__") else g)
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, path


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"mode": "parallel"}, "mode"),
        ({"num_v_heads": 3}, "num_v_heads"),
        ({"expand_v": 0.3}, "expand_v"),
        ({"lower_bound": 1.0}, "lower_bound"),
        ({"safe_gate": True}, "lower_bound"),
    ],
)
def test_kda_bad_arguments_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _kda(**kw)


def _attention_reference(x, layer, window):
    """Per row and head, explicit causal softmax with GQA and window."""
    B, T, _ = x.shape
    H, Hkv, Dh = layer.num_heads, layer.num_kv_heads, layer.head_dim
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    from kdax.nn.attention import rope

    q = np.asarray(rope(layer.q_proj(x).reshape(B, T, H, Dh), pos, layer.rope_theta), np.float64)
    k = np.asarray(rope(layer.k_proj(x).reshape(B, T, Hkv, Dh), pos, layer.rope_theta), np.float64)
    v = np.asarray(layer.v_proj(x).reshape(B, T, Hkv, Dh), np.float64)
    o = np.zeros((B, T, H, Dh))
    for b in range(B):
        for h in range(H):
            kh = h // (H // Hkv)
            for i in range(T):
                js = [j for j in range(i + 1) if window is None or i - j < window]
                s = np.array([q[b, i, h] @ k[b, j, kh] for j in js]) / np.sqrt(Dh)
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                o[b, i, h] = p @ v[b, js, kh]
    return np.asarray(layer.o_proj(jnp.asarray(o.reshape(B, T, H * Dh), jnp.float32)))


@pytest.mark.parametrize("window", [None, 3])
def test_attention_matches_explicit_softmax(window):
    layer = Attention(32, num_heads=4, num_kv_heads=2, window_size=window, qkv_bias=True, rngs=nnx.Rngs(0))
    x = _x(2, 9, 32)
    assert rel_rms(layer(x)[0], _attention_reference(x, layer, window)) <= F32["out"]


def test_attention_rope_is_relative():
    """Shifting every position by the same offset leaves the output unchanged."""
    layer = Attention(32, num_heads=2, rngs=nnx.Rngs(0))
    x = _x(1, 7, 32)
    pos = jnp.arange(7)[None]
    assert rel_rms(layer(x, positions=pos + 1000)[0], layer(x, positions=pos)[0]) <= F32["grad"]  # angles near 1000


@pytest.mark.parametrize("window", [None, 4])
def test_attention_cache_decode_equals_full_run(window):
    """A 7-token prompt, a 3-token continuation, then single tokens: each call attends to
    the cache as the full run does; a windowed layer caches only window_size slots."""
    layer = Attention(32, num_heads=4, num_kv_heads=1, window_size=window, rngs=nnx.Rngs(0))
    x = _x(2, 14, 32)
    full, _ = layer(x)
    cache = layer.init_cache(2, 16)
    assert cache[0].shape == (2, 16 if window is None else window, 1, 8)
    ys = []
    for a, b in [(0, 7), (7, 10)] + [(t, t + 1) for t in range(10, 14)]:
        y, cache = layer(x[:, a:b], positions=jnp.broadcast_to(jnp.arange(a, b), (2, b - a)), cache=cache)
        ys.append(y)
    assert rel_rms(jnp.concatenate(ys, axis=1), full) <= F32["out"]


@pytest.mark.parametrize("window", [None, 4])
def test_attention_cache_skips_padding(window):
    """Rows padded after 2 and 6 tokens (segment 1): the padding is not cached, so decoding
    from each row's length matches the full run of that row."""
    layer = Attention(32, num_heads=4, num_kv_heads=2, window_size=window, rngs=nnx.Rngs(0))
    x, lengths = _x(2, 9, 32), [2, 6]
    full, _ = layer(x)
    seg = (jnp.arange(7)[None] >= jnp.array(lengths)[:, None]).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    y, cache = layer(x[:, :7], positions=pos, segment_ids=seg, cache=layer.init_cache(2, 12))
    for b, n in enumerate(lengths):
        assert rel_rms(y[b, :n], full[b, :n]) <= F32["out"]
    for step in range(3):
        p = jnp.array(lengths) + step
        y, cache = layer(x[jnp.arange(2), p][:, None], positions=p[:, None], cache=cache)
        assert rel_rms(y[:, 0], full[jnp.arange(2), p]) <= F32["out"]


def test_attention_segments_equal_separate_sequences():
    layer = Attention(32, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
    x = _x(1, 10, 32)
    seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    y, _ = layer(x, positions=pos, segment_ids=seg)
    assert rel_rms(y[:, :4], layer(x[:, :4])[0]) <= F32["out"]
    assert rel_rms(y[:, 4:], layer(x[:, 4:])[0]) <= F32["out"]


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"num_heads": 5}, "num_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"window_size": 0}, "window_size"),
        ({"rope_theta": -1.0}, "rope_theta"),
    ],
)
def test_attention_bad_arguments_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        Attention(**{"hidden_size": 32, "num_heads": 4, **kw}, rngs=nnx.Rngs(0))
