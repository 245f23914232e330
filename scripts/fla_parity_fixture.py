"""Build tests/fixtures/fla_tiny: a tiny random KDA hybrid made of FLA's PyTorch modules, saved
in FLA's checkpoint layout with its float32 logits on a fixed input. Needs a CUDA GPU, torch
and fla-core / flash-linear-attention (the wheels in ../shared/wheels); run from the repo root:

    python scripts/fla_parity_fixture.py [OUT_DIR]

FLA's ``KDAForCausalLM`` class needs ``transformers`` and its ``Attention`` needs
``flash_attn``; neither is assumed here (``fla.layers.kda`` is imported without the
``fla.layers`` package init, which imports transformers). The model is assembled from FLA's
``KimiDeltaAttention``, ``RMSNorm``, ``GatedMLP`` and ``RotaryEmbedding`` with the same module
tree as ``KDAForCausalLM`` (hence the same state-dict names), the attention layer written
with ``torch.nn.functional.scaled_dot_product_attention`` in place of flash_attn, and FLA's
``_init_weights`` rule (normal(0, 0.02) linears, convolutions, embeddings; zero biases).
tests/models/test_fla_parity.py checks that kdax reproduces the logits on CPU.
"""

import json
import os
import sys
import types

import fla
import numpy as np
import torch
from torch import nn

if not hasattr(fla, "layers"):  # fla.layers/__init__ needs transformers: load fla.layers.kda alone
    layers = types.ModuleType("fla.layers")
    layers.__path__ = [os.path.join(os.path.dirname(fla.__file__), "layers")]
    sys.modules["fla.layers"] = layers

from fla.layers.kda import KimiDeltaAttention
from fla.modules import GatedMLP, RMSNorm, RotaryEmbedding

CONFIG = {"hidden_size": 64, "head_dim": 16, "num_heads": 4, "num_v_heads": 8, "num_hidden_layers": 3,
          "vocab_size": 101, "intermediate_size": 96, "norm_eps": 1e-6,
          "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": None, "rope_theta": 10000.0}}  # fmt: skip


class Attention(nn.Module):
    def __init__(self, d, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.dh = heads, kv_heads, d // heads
        self.q_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.rotary = RotaryEmbedding(dim=self.dh, base=CONFIG["attn"]["rope_theta"])

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.dh)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.dh)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.dh)
        q, k = self.rotary(q, k, seqlen_offset=0, max_seqlen=T)
        g = self.heads // self.kv_heads
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        o = nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        c = CONFIG
        d = c["hidden_size"]
        self.attn_norm, self.mlp_norm = RMSNorm(d, eps=c["norm_eps"]), RMSNorm(d, eps=c["norm_eps"])
        if i in c["attn"]["layers"]:
            self.attn = Attention(d, c["attn"]["num_heads"], c["attn"]["num_kv_heads"])
        else:
            self.attn = KimiDeltaAttention(hidden_size=d, head_dim=c["head_dim"], num_heads=c["num_heads"],
                                           num_v_heads=c["num_v_heads"], layer_idx=i, norm_eps=c["norm_eps"])  # fmt: skip
        self.mlp = GatedMLP(hidden_size=d, intermediate_size=c["intermediate_size"], hidden_act="swish")

    def forward(self, x):
        h = self.attn(self.attn_norm(x))
        x = x + (h[0] if isinstance(h, tuple) else h)
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        c = CONFIG
        self.model = nn.Module()
        self.model.embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.model.layers = nn.ModuleList([Block(i) for i in range(c["num_hidden_layers"])])
        self.model.norm = RMSNorm(c["hidden_size"], eps=c["norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, ids):
        x = self.model.embeddings(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def main(out: str) -> None:
    from kdax.models.checkpoint import write_safetensors

    torch.manual_seed(0)
    model = Model()
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    model = model.cuda().float().train()  # training mode: FLA's layer runs its chunk kernel
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids.cuda()).float().cpu().numpy()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"model_type": "kda", **CONFIG}, f, indent=2)
    tensors = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    write_safetensors(os.path.join(out, "model.safetensors"), tensors)
    np.save(os.path.join(out, "input_ids.npy"), ids.numpy().astype(np.int32))
    np.save(os.path.join(out, "logits.npy"), logits)
    print(f"wrote {out}: {len(tensors)} tensors, logits {logits.shape}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/fla_tiny")
