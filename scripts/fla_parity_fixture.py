"""Build the FLA parity fixtures in tests/fixtures (flash-linear-attention 0.6.0):

- fla_tiny/: a tiny random KDA hybrid made by FLA's own ``KDAForCausalLM``, saved with its
  ``save_pretrained``, with its float32 logits on a fixed input (tests/models/test_fla_parity.py);
- fla_kda_ops.npz: FLA's ``chunk_kda`` outputs and gradients of every input on hard cases
  (tests/ops/kda/test_fla_parity.py).

    pip install torch triton "transformers>=5.6.2,<6" flash-linear-attention==0.6.0 fla-core==0.6.0
    python scripts/fla_parity_fixture.py [OUT_DIR]          # about a minute on a 2-core CPU

It runs on the CPU: FLA's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set
here before triton is imported; float32 NumPy, no TF32), with the adjustments it needs:
autotuning keeps the first config (the interpreter cannot time kernels); Python ``range`` loops
inside kernels yield Triton scalars, as they do when compiled; module-level aliases of
``triton.language`` functions (FLA's ``gather = tl.gather``) get the interpreter's versions; and
FLA's ``bf16x3`` dot precision name becomes ``ieee`` (the interpreter computes every dot in
float32 and knows only the tf32/ieee names). FLA's softmax ``Attention`` layer calls
``flash_attn``, which is not installed: a stand-in with flash_attn's semantics (causal, GQA,
``window_size=(left, 0)``) written with ``torch.nn.functional.scaled_dot_product_attention``
takes its place. Everything else (the KDA layer and its kernels, short convolutions, norms,
rotary embedding, gated MLP, weight init, checkpoint format) is FLA's.
"""

import builtins
import json
import operator
import os
import sys

import numpy as np

os.environ["TRITON_INTERPRET"] = "1"  # FLA's Triton kernels run on the CPU, in float32 NumPy

import torch
from torch.nn import functional as F
from triton.runtime import autotuner, interpreter

CONFIG = {
    "hidden_size": 64,
    "head_dim": 16,
    "num_heads": 4,
    "num_v_heads": 8,
    "num_hidden_layers": 3,
    "vocab_size": 101,
    "intermediate_size": 96,
    "norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attn": {
        "layers": [1],
        "num_heads": 4,
        "num_kv_heads": 2,
        "qkv_bias": True,
        "window_size": 32,
        "rope_theta": 10000.0,
    },
}


def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)):
    """flash_attn's dense call: q [B, T, H, D], k, v [B, T, Hkv, D], keys j with i - left <= j <= i."""
    assert causal and window_size[1] in (-1, 0)
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    i = torch.arange(q.shape[1], device=q.device)[:, None]
    j = torch.arange(k.shape[1], device=q.device)[None, :]
    mask = (j <= i) & ((window_size[0] < 0) | (i - j <= window_size[0]))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return o.transpose(1, 2)


def flash_attn_varlen_func(*args, **kwargs):
    raise NotImplementedError("the fixture uses unpadded inputs only")


_prune, _patch_lang = autotuner.Autotuner.prune_configs, interpreter._patch_lang


def _tensor_range(*args):
    return (interpreter._implicit_cvt(i) for i in builtins.range(*map(operator.index, args)))


def _patch_lang_with_range(fn):
    scope = _patch_lang(fn)
    module = sys.modules[fn.__module__]
    patched = {id(old): getattr(obj, name) for obj, name, old in scope._changes}
    for name, value in list(vars(module).items()):  # aliases such as FLA's `gather = tl.gather`
        if id(value) in patched and callable(value):
            scope.set_attr(module, name, patched[id(value)])
    scope.set_attr(module, "range", _tensor_range)
    return scope


autotuner.Autotuner.prune_configs = lambda self, kwargs: _prune(self, kwargs)[:1]
interpreter._patch_lang = _patch_lang_with_range

import fla.layers.attn
import fla.ops.kda.chunk_intra
import triton.language as tl
from fla.models import KDAConfig, KDAForCausalLM
from fla.ops.kda import chunk_kda

fla.layers.attn.flash_attn_func, fla.layers.attn.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
fla.ops.kda.chunk_intra.SAFE_GATE_DOT_PRECISION = tl.constexpr("ieee")


# chunk_kda cases: (B, T, H, HV, K, V, cu_seqlens, lower_bound, allow_neg_eigval, A_log offset).
# Every in-kernel option of the contract on; the first has cumulative gates far below -88.
OP_CASES = {
    "gva_strong_decay": (1, 77, 1, 2, 60, 100, None, None, False, 1.5),
    "varlen_lower_bound": (1, 100, 1, 2, 32, 32, [0, 1, 2, 60, 61, 100], -5.0, True, 0.5),
}
OP_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def cotangent(shape):
    """The fixed weights of the loss sum(o * w_o) + sum(final_state * w_s), in float64."""
    return np.sin(0.7 * np.arange(np.prod(shape)) + 1.0).reshape(shape)


def ops_fixture(path: str) -> None:
    out = {}
    for name, (B, T, H, HV, K, V, cu, lower_bound, neg, a_off) in OP_CASES.items():
        rng = np.random.default_rng(0)
        N = B if cu is None else len(cu) - 1
        shapes = [(B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV, K), (B, T, HV), (HV,), (HV * K,), (N, HV, K, V)]
        x = {
            n: torch.tensor(rng.standard_normal(sh), dtype=torch.float32, requires_grad=True)
            for n, sh in zip(OP_ARGS, shapes, strict=True)
        }
        with torch.no_grad():
            x["A_log"] += a_off
        o, state = chunk_kda(
            *(x[n] for n in OP_ARGS[:5]),
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            initial_state=x["initial_state"],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=lower_bound,
            safe_gate=lower_bound is not None,
            allow_neg_eigval=neg,
            cu_seqlens=None if cu is None else torch.tensor(cu),
        )
        loss = (o.double() * torch.from_numpy(cotangent(o.shape))).sum()
        (loss + (state.double() * torch.from_numpy(cotangent(state.shape))).sum()).backward()
        meta = {"cu_seqlens": cu, "lower_bound": lower_bound, "allow_neg_eigval": neg}
        out[f"{name}/meta"] = np.array(json.dumps(meta))
        out[f"{name}/o"], out[f"{name}/final_state"] = o.detach().numpy(), state.detach().numpy()
        for n in OP_ARGS:
            out[f"{name}/{n}"], out[f"{name}/d{n}"] = x[n].detach().numpy(), x[n].grad.numpy()
    np.savez_compressed(path, **out)
    print(f"wrote {path}: {len(OP_CASES)} chunk_kda cases")


def model_fixture(out: str) -> None:
    torch.manual_seed(0)
    model = KDAForCausalLM(KDAConfig(**CONFIG)).float().eval()
    with torch.no_grad():  # FLA's init leaves norms at 1 and biases at 0: perturb every tensor
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # 77 tokens > 64: FLA's layer takes its chunk path
        logits = model(ids, use_cache=False).logits.numpy()
    model.save_pretrained(out)
    np.save(os.path.join(out, "input_ids.npy"), ids.numpy().astype(np.int32))
    np.save(os.path.join(out, "logits.npy"), logits)
    print(f"wrote {out}: logits {logits.shape}, rms {np.sqrt(np.mean(logits**2)):.4f}")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    model_fixture(os.path.join(out, "fla_tiny"))
    ops_fixture(os.path.join(out, "fla_kda_ops.npz"))
