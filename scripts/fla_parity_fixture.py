"""Build tests/fixtures/fla_tiny: a tiny random KDA hybrid made by FLA's own ``KDAForCausalLM``
(flash-linear-attention 0.6.0), saved with FLA's ``save_pretrained``, with its float32 logits
on a fixed input. tests/models/test_fla_parity.py checks that kdax reproduces them.

    pip install torch triton "transformers>=5.6.2,<6" flash-linear-attention==0.6.0 fla-core==0.6.0
    python scripts/fla_parity_fixture.py [OUT_DIR]          # about 75 s on a 2-core CPU

It runs on the CPU: FLA's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set
here before triton is imported; float32 NumPy, no TF32), with two adjustments it needs: autotuning
keeps the first config (the interpreter cannot time kernels), and Python ``range`` loops inside
kernels yield Triton scalars, as they do when compiled. FLA's softmax ``Attention`` layer calls
``flash_attn``, which is not installed: a stand-in with flash_attn's semantics (causal, GQA,
``window_size=(left, 0)``) written with ``torch.nn.functional.scaled_dot_product_attention``
takes its place. Everything else (the KDA layer and its kernels, short convolutions, norms,
rotary embedding, gated MLP, weight init, checkpoint format) is FLA's.
"""

import builtins
import operator
import os
import sys

import numpy as np

os.environ["TRITON_INTERPRET"] = "1"  # FLA's Triton kernels run on the CPU, in float32 NumPy

import torch
from torch.nn import functional as F
from triton.runtime import autotuner, interpreter

CONFIG = {"hidden_size": 64, "head_dim": 16, "num_heads": 4, "num_v_heads": 8, "num_hidden_layers": 3,
          "vocab_size": 101, "intermediate_size": 96, "norm_eps": 1e-6, "tie_word_embeddings": False,
          "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True, "window_size": 32,
                   "rope_theta": 10000.0}}  # fmt: skip


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
    scope.set_attr(sys.modules[fn.__module__], "range", _tensor_range)
    return scope


autotuner.Autotuner.prune_configs = lambda self, kwargs: _prune(self, kwargs)[:1]
interpreter._patch_lang = _patch_lang_with_range

import fla.layers.attn
from fla.models import KDAConfig, KDAForCausalLM

fla.layers.attn.flash_attn_func, fla.layers.attn.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func


def main(out: str) -> None:
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
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/fla_tiny")
