"""Train a small hybrid KDA language model on byte-level text (``kdax train``, examples/train_tiny.py).

Tokens are the text's bytes (vocab 256). AdamW with warmup and cosine decay, global-norm
clipping, one jit-compiled step, loss and tokens/s on a progress bar, a checkpoint in FLA's
format every ``checkpoint_every`` steps."""

from __future__ import annotations

import dataclasses
import os
import time
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from kdax.models import KDAForCausalLM, generate, save_pretrained, tiny_config


def load_corpus(path: str | None = None) -> np.ndarray:
    """Bytes of ``path`` (default: the public-domain text shipped with kdax) as uint8 tokens."""
    if path is None:
        data = resources.files("kdax").joinpath("data/corpus.txt").read_bytes()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return np.frombuffer(data, np.uint8)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the tokens' empirical distribution: the loss of the best model
    that ignores context."""
    p = np.bincount(tokens, minlength=256) / tokens.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclasses.dataclass
class TrainConfig:
    steps: int = dataclasses.field(default=300, metadata={"help": "optimizer steps"})
    batch_size: int = dataclasses.field(default=16, metadata={"help": "sequences per step"})
    seq_len: int = dataclasses.field(default=128, metadata={"help": "tokens per sequence"})
    lr: float = dataclasses.field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup: int = dataclasses.field(default=30, metadata={"help": "steps of linear warm-up, then cosine decay"})
    weight_decay: float = dataclasses.field(default=0.1, metadata={"help": "AdamW weight decay"})
    clip: float = dataclasses.field(default=1.0, metadata={"help": "global gradient-norm clip"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the weights and the batches"})
    checkpoint_every: int = dataclasses.field(default=0, metadata={"help": "save every N steps (0: never)"})
    out_dir: str = dataclasses.field(default="checkpoints/tiny", metadata={"help": "where checkpoints go"})

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive float, got {self.lr}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected >= 0, got {self.checkpoint_every}")


def loss_fn(model: KDAForCausalLM, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of batch [B, T + 1]."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit
def train_step(model: KDAForCausalLM, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _batches(tokens: np.ndarray, cfg: TrainConfig):
    rng = np.random.default_rng(cfg.seed)
    span = cfg.seq_len + 1
    if tokens.size <= span:
        raise ValueError(f"corpus: expected more than seq_len + 1 = {span} tokens, got {tokens.size}")
    while True:
        starts = rng.integers(0, tokens.size - span, cfg.batch_size)
        yield jnp.asarray(np.stack([tokens[s : s + span] for s in starts]), jnp.int32)


def train(model: KDAForCausalLM, tokens: np.ndarray, cfg: TrainConfig, progress: bool = True) -> list[float]:
    """Train ``model`` in place on random windows of ``tokens``; returns the loss of every step."""
    warmup = min(cfg.warmup, cfg.steps - 1)  # the cosine part needs at least one step
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, cfg.steps, cfg.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), optax.adamw(schedule, weight_decay=cfg.weight_decay))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    batches = _batches(tokens, cfg)
    losses, start = [], None
    bar = tqdm(range(1, cfg.steps + 1), disable=not progress, desc="train")
    for step in bar:
        loss = float(train_step(model, optimizer, next(batches)))
        losses.append(loss)
        if start is None:  # the first step includes compilation
            start, done = time.perf_counter(), 0
        else:
            done += cfg.batch_size * cfg.seq_len
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{done / (time.perf_counter() - start):,.0f}")
        if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
            save_pretrained(model, os.path.join(cfg.out_dir, f"step_{step}"))
    return losses


def main(cfg: TrainConfig, corpus: str | None = None, sample_tokens: int = 200) -> KDAForCausalLM:
    """Train the tiny model, print the loss against the unigram entropy, then a sample."""
    tokens = load_corpus(corpus)
    model = KDAForCausalLM(tiny_config(), rngs=nnx.Rngs(cfg.seed))
    entropy = unigram_entropy(tokens)
    print(f"corpus {tokens.size:,} bytes, unigram entropy {entropy:.3f} nats; model {model.num_parameters():,} params")
    losses = train(model, tokens, cfg)
    print(f"loss: first {losses[0]:.3f}, mean of last 20 steps {np.mean(losses[-20:]):.3f} nats")
    if sample_tokens:
        prompt = jnp.asarray(tokens[None, :64], jnp.int32)
        out = generate(model, prompt, sample_tokens)
        print(bytes(np.asarray(out[0], np.uint8)).decode("utf-8", errors="replace"))
    return model
