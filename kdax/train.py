"""Train a small hybrid KDA language model on byte-level text (``kdax train``, examples/train_tiny.py).

Tokens are the text's bytes (vocab 256). AdamW with warmup and cosine decay, global-norm
clipping, one jit-compiled step, loss and tokens/s on a progress bar. With an ``out_dir``, the
training state goes through orbax to ``out_dir/state/<step>`` every ``checkpoint_every`` steps
(for ``resume``) and the final weights in FLA's format to ``out_dir/model`` (for
``from_pretrained``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from kdax.models import PRESETS, KDAForCausalLM, from_pretrained, generate, model_class, save_pretrained, sharding
from kdax.nn import KimiDeltaAttention


def load_corpus(path: str | None = None) -> np.ndarray:
    """The bytes of a text file as tokens.

    Args:
        path: the file (None: the public-domain text shipped with kdax).

    Returns:
        [n] uint8, one token per byte.
    """
    if path is None:
        data = resources.files("kdax").joinpath("data/corpus.txt").read_bytes()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return np.frombuffer(data, np.uint8)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the tokens' empirical distribution: the loss of the best model
    that ignores context.

    Args:
        tokens: [n] byte tokens (values below 256).

    Returns:
        The entropy in nats.
    """
    p = np.bincount(tokens, minlength=256) / tokens.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclasses.dataclass
class TrainConfig:
    """The settings of a training run; each field's ``help`` metadata (``kdax train --help``)
    says what it is.

    Raises:
        ValueError: naming the field, for an unknown preset, a checkpoint that is not a model
            directory or has fewer than 256 token ids, a holdout outside [0, 1), steps,
            batch_size, seq_len or keep below 1, lr not positive or checkpoint_every negative.
    """

    preset: str = dataclasses.field(default="tiny", metadata={"help": "the model: a preset of kdax.models.PRESETS"})
    checkpoint: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "fine-tune this model directory's weights (kdax.models.from_pretrained: kdax, FLA, Kimi Linear "
            "or Ling; a byte-level vocabulary of at least 256) instead of --preset's random ones"
        },
    )
    steps: int = dataclasses.field(default=300, metadata={"help": "optimizer steps"})
    batch_size: int = dataclasses.field(default=16, metadata={"help": "sequences per step"})
    seq_len: int = dataclasses.field(default=128, metadata={"help": "tokens per sequence"})
    lr: float = dataclasses.field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup: int = dataclasses.field(default=30, metadata={"help": "steps of linear warm-up, then cosine decay"})
    weight_decay: float = dataclasses.field(default=0.1, metadata={"help": "AdamW weight decay"})
    clip: float = dataclasses.field(default=1.0, metadata={"help": "global gradient-norm clip"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the weights and the batches"})
    holdout: float = dataclasses.field(
        default=0.0, metadata={"help": "share of the corpus, at its end, kept out of training (held-out text)"}
    )
    checkpoint_every: int = dataclasses.field(
        default=100, metadata={"help": "save the training state every N steps and at the last (0: never)"}
    )
    keep: int = dataclasses.field(default=3, metadata={"help": "training states kept (the newest)"})
    mesh: str = dataclasses.field(
        default="",
        metadata={
            "help": "a device mesh, e.g. data=2,model=2,context=2: FSDP and rows over data, heads over model, "
            "time over context (docs/scale.md); empty: one device"
        },
    )
    out_dir: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "where the run is saved: state/<step> (orbax, for --resume) and model (the final weights, "
            "kdax.models.save_pretrained's format); None: nowhere"
        },
    )

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {self.preset!r}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive float, got {self.lr}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected >= 0, got {self.checkpoint_every}")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout: expected a share in [0, 1), got {self.holdout}")
        if self.keep < 1:
            raise ValueError(f"keep: expected a positive int, got {self.keep}")
        if self.checkpoint is not None:
            path = os.path.join(self.checkpoint, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"checkpoint: expected a model directory with a config.json, got {self.checkpoint!r}")
            with open(path) as f:
                vocab = json.load(f).get("vocab_size", 0)
            if vocab < 256:
                raise ValueError(f"checkpoint: expected a vocab_size of at least 256 (byte-level text), got {vocab}")


# The settings a resumed run must share with the checkpoint's to continue it exactly.
_RUN_FIELDS = (
    "preset",
    "checkpoint",
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "warmup",
    "weight_decay",
    "clip",
    "seed",
    "holdout",
)


def loss_fn(model: KDAForCausalLM, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy.

    Args:
        model: the model.
        batch: [B, T + 1] token ids: inputs [:, :-1], targets [:, 1:].

    Returns:
        The loss in nats, a float32 scalar.
    """
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit
def train_step(model: KDAForCausalLM, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    """One optimizer step on ``batch`` [B, T + 1] (model and optimizer updated in place), compiled
    once per model structure and batch shape. Returns the loss before the step."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def device_memory() -> int:
    """Bytes a step may use on one device: an accelerator's limit, or the host's available
    memory (/proc/meminfo's MemAvailable, else all of it) on a CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        with open("/proc/meminfo") as f:
            return 1024 * next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def compiled_step(model: KDAForCausalLM, optimizer: nnx.Optimizer, batch: jax.Array):
    """:func:`train_step` compiled for ``batch``'s shape, its memory checked before it runs.

    Raises:
        ValueError: naming ``seq_len``: XLA's estimate of the step (arguments, outputs and
            temporaries on one device) exceeds :func:`device_memory`; says what seq_len would
            fit were the temporaries to grow linearly or quadratically with it.
    """
    step = train_step.lower(model, optimizer, batch).compile()
    use = step.memory_analysis()
    if use is None:  # a backend without the analysis: nothing to check
        return step
    kept = use.argument_size_in_bytes + use.output_size_in_bytes - use.alias_size_in_bytes
    need, have = kept + use.temp_size_in_bytes, device_memory()
    if need > have:
        B, T = batch.shape[0], batch.shape[1] - 1
        share = max(have - kept, 0) / max(use.temp_size_in_bytes, 1)  # of the temporaries that would fit
        gib = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
        raise ValueError(
            f"seq_len: a step of batch_size {B} x seq_len {T} needs about {gib(need)} on a device "
            f"({gib(use.temp_size_in_bytes)} of activations and temporaries, {gib(kept)} of weights, optimizer "
            f"state and batch), {gib(have)} is free; at batch_size {B} about seq_len {int(T * share)} fits if "
            f"the temporaries grow linearly with it, {int(T * share**0.5)} if quadratically (dense attention)"
        )
    return step


@functools.cache
def _optimizer(steps: int, lr: float, warmup: int, weight_decay: float, clip: float) -> optax.GradientTransformation:
    """AdamW with warm-up, cosine decay and clipping; one object per setting, so that runs with
    the same settings share the compiled step (the optimizer is part of what it is compiled for)."""
    warmup = min(warmup, steps - 1)  # the cosine part needs at least one step
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay))


def _windows(tokens: np.ndarray, rng: np.random.Generator, cfg: TrainConfig) -> np.ndarray:
    """[batch_size, seq_len + 1] random windows of ``tokens`` (every process draws the same)."""
    starts = rng.integers(0, tokens.size - cfg.seq_len - 1, cfg.batch_size)
    return np.stack([tokens[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int32)


def _on_mesh(model: KDAForCausalLM, cfg: TrainConfig):
    """The mesh of ``cfg.mesh`` with the model laid out on it (None without one)."""
    if not cfg.mesh:
        return None
    mesh = sharding.make_mesh(cfg.mesh)
    layout = sharding.Layout.of(mesh)
    if cfg.batch_size % layout.size(layout.data):
        raise ValueError(
            f"batch_size: expected a multiple of the data axis's {layout.size(layout.data)} devices, "
            f"got {cfg.batch_size}"
        )
    chunks = [b.attn.chunk_size for b in model.model.layers if isinstance(b.attn, KimiDeltaAttention)]
    tile = layout.size(layout.context) * max(chunks, default=1)
    if layout.context and cfg.seq_len % tile:
        raise ValueError(
            f"seq_len: expected a multiple of {tile} (the context axis's devices x the KDA chunk "
            f"size), got {cfg.seq_len}"
        )
    sharding.shard(model, mesh)
    return mesh


def _checkpoints(out_dir: str, keep: int, create: bool) -> ocp.CheckpointManager:
    """The orbax manager of ``out_dir/state``: each save is written to a temporary directory and
    renamed when complete, and only the newest ``keep`` are kept. A manager that saves
    (``create``) first removes the temporary directories of failed saves, here and before it
    returns: orbax would remove them in a background thread that races with whatever touches the
    directory next (another manager's clean-up, a save's own removal of a stale directory)."""
    directory = os.path.abspath(os.path.join(out_dir, "state"))
    if create and jax.process_index() == 0 and os.path.isdir(directory):
        for path in (os.path.join(directory, name) for name in os.listdir(directory)):
            if os.path.isdir(path) and ocp.utils.is_tmp_checkpoint(path):
                shutil.rmtree(path)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(keep), create=create, cleanup_tmp_directories=False
    )
    return ocp.CheckpointManager(directory, options=options)


def _save(
    manager: ocp.CheckpointManager,
    step: int,
    model: KDAForCausalLM,
    optimizer: nnx.Optimizer,
    rng: np.random.Generator,
    run: dict,
) -> None:
    """Parameters and optimizer state (arrays), the step, the batch generator's state and the run's settings."""
    arrays = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    progress = {"step": step, "data": rng.bit_generator.state, "run": run}
    manager.save(
        step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), progress=ocp.args.JsonSave(progress))
    )


def _restore(
    manager: ocp.CheckpointManager,
    model: KDAForCausalLM,
    optimizer: nnx.Optimizer,
    rng: np.random.Generator,
    run: dict,
) -> int:
    """Load the newest complete checkpoint into the model, optimizer and batch generator; returns
    its step (0 where there is none)."""
    step = manager.latest_step()
    if step is None:
        return 0
    target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    got = manager.restore(
        step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(target), progress=ocp.args.JsonRestore())
    )
    saved = got.progress["run"]
    differ = [
        f"{k}={saved.get(k)!r} (this run: {run.get(k)!r})" for k in {**saved, **run} if saved.get(k) != run.get(k)
    ]
    if differ:
        raise ValueError(
            f"resume: the checkpoint of step {step} in {manager.directory} was written with "
            f"{', '.join(differ)}; resume with its settings"
        )
    nnx.update(model, got.arrays["model"])
    nnx.update(optimizer, got.arrays["optimizer"])
    rng.bit_generator.state = got.progress["data"]
    return step


class Interrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C: ``step`` is the newest saved training state (None: none) in ``directory``."""

    def __init__(self, step: int | None, directory: str | None):
        super().__init__(step, directory)
        self.step, self.directory = step, directory

    def advice(self) -> str:
        """Where the newest training state is and how to continue it, for the user."""
        if self.step is None:
            return "interrupted before any training state was saved"
        return (
            f"interrupted; the training state of step {self.step} is in {self.directory}: "
            "continue with the same command and --resume"
        )


def check_checkpoints(cfg: TrainConfig, resume: bool, overwrite: bool = False) -> dict | None:
    """Whether ``cfg.out_dir`` fits the run: with ``resume`` it must hold a complete training
    state written with ``cfg``'s settings (``steps`` aside: a resumed run may go on to more steps,
    at least the state's); without, none, unless ``overwrite`` (the run replaces it).

    Returns:
        With ``resume``, the settings the newest state was written with; else None.

    Raises:
        ValueError: naming ``resume``, ``overwrite``, ``steps`` or ``out_dir``.
    """
    if resume and overwrite:
        raise ValueError("overwrite: expected it without resume (continue a run, or replace it)")
    state = None if cfg.out_dir is None else os.path.join(cfg.out_dir, "state")
    latest = saved = None
    if state is not None and os.path.isdir(state):
        with _checkpoints(cfg.out_dir, cfg.keep, create=False) as manager:
            latest = manager.latest_step()
            if resume and latest is not None:
                saved = manager.restore(latest, args=ocp.args.Composite(progress=ocp.args.JsonRestore())).progress
    if resume and latest is None:
        raise ValueError(f"resume: no training state in {state} to continue; train without resume to start one")
    if not resume and latest is not None and not overwrite:
        raise ValueError(
            f"out_dir: {cfg.out_dir!r} holds checkpoints up to step {latest}; continue them with resume "
            "(--resume on the command line), replace them with overwrite (--overwrite) or choose another out_dir"
        )
    if saved is None:
        return None
    if cfg.steps < latest:
        raise ValueError(
            f"steps: expected at least {latest}, the step of the training state to resume, got {cfg.steps}"
        )
    run = saved["run"]
    differ = [
        f"{k}={run.get(k)!r} (this run: {getattr(cfg, k)!r})"
        for k in _RUN_FIELDS
        if k != "steps" and run.get(k) != getattr(cfg, k)
    ]
    if differ:
        raise ValueError(
            f"resume: the checkpoint of step {latest} in {state} was written with {', '.join(differ)}; resume with its settings"
        )
    return run


def train(
    model: KDAForCausalLM,
    tokens: np.ndarray,
    cfg: TrainConfig,
    progress: bool = True,
    resume: bool = False,
    batches: Callable[[np.random.Generator], np.ndarray] | None = None,
    settings: dict | None = None,
    overwrite: bool = False,
) -> list[float]:
    """Train ``model`` in place on random windows of ``tokens`` (or on what ``batches`` draws).

    With ``cfg.out_dir``, orbax saves the training state (parameters, optimizer state, step and
    the batch generator's state) to ``out_dir/state/<step>`` every ``cfg.checkpoint_every``
    steps and at the last, keeping the newest ``cfg.keep``, and ``save_pretrained`` writes the
    final weights in FLA's format to ``out_dir/model``. With ``cfg.mesh``, the model is laid out
    on that mesh first (:func:`kdax.models.shard`; the optimizer state follows it) and each batch
    goes onto it, rows over the data axis.

    Args:
        model: the model to train.
        tokens: the corpus, a 1-D array of token ids.
        cfg: the run's settings.
        progress: show a progress bar.
        resume: continue from the newest complete checkpoint in ``out_dir/state``; the batches
            and updates after it are those of an uninterrupted run, on this run's mesh whatever
            the checkpoint's was. ``cfg.steps`` may exceed the state's run: the learning rate
            keeps the state's schedule, whose last value holds past its steps.
        batches: None (windows of ``tokens``), or the batch source: called with the batch
            generator (whose state the checkpoints keep), it returns the next step's token ids
            [batch_size, T + 1], T at most ``seq_len`` (one compilation per T).
        settings: further JSON settings of the run (those ``batches`` depends on), kept with each
            checkpoint and checked on resume like ``cfg``'s.
        overwrite: remove the training state in ``out_dir`` first (a new run in its place).

    Returns:
        The loss of every step this call ran.

    Raises:
        ValueError: the corpus is not longer than ``seq_len + 1`` tokens; ``cfg.mesh`` is
            malformed, does not match the devices, or does not divide ``batch_size`` (data axis),
            ``seq_len`` (context axis x chunk size) or the KDA heads (model axis); ``out_dir`` holds
            checkpoints and neither ``resume`` nor ``overwrite`` is on; ``resume`` is on and there is
            no checkpoint; the checkpoint to resume from was written with other settings, or at a
            step past ``cfg.steps``; the step would not fit in the device's memory (naming
            ``seq_len``, with the tokens a step would fit; checked before the first step).
        Interrupted: on Ctrl-C, naming the newest saved training state.
    """
    if tokens.size <= cfg.seq_len + 1:
        raise ValueError(f"corpus: expected more than seq_len + 1 = {cfg.seq_len + 1} tokens, got {tokens.size}")
    saved = check_checkpoints(cfg, resume, overwrite)
    if overwrite and cfg.out_dir is not None and jax.process_index() == 0:
        shutil.rmtree(os.path.join(cfg.out_dir, "state"), ignore_errors=True)
    schedule = cfg.steps if saved is None else saved["steps"]  # a resumed run keeps its state's schedule
    tx = _optimizer(schedule, cfg.lr, cfg.warmup, cfg.weight_decay, cfg.clip)
    mesh = _on_mesh(model, cfg)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # its state takes the parameters' shardings
    if mesh is not None:  # and its step counter goes onto the mesh (committed where a restore puts it)
        nnx.update(optimizer, sharding.place(nnx.state(optimizer), mesh))
    rng = np.random.default_rng(cfg.seed)
    run = {**{f: getattr(cfg, f) for f in _RUN_FIELDS}, "steps": schedule, **(settings or {})}
    saving = cfg.out_dir is not None and cfg.checkpoint_every > 0
    losses, start, first, steps = [], None, 0, {}
    with _checkpoints(cfg.out_dir, cfg.keep, saving) if saving or resume else contextlib.nullcontext() as manager:
        if resume:
            first = _restore(manager, model, optimizer, rng, run)
        shown = progress and jax.process_index() == 0  # one bar for a run over several hosts
        # the rate and ETA are the mean since the first step, whose compilation they leave out
        bar = tqdm(initial=first, total=cfg.steps, disable=not shown, desc="train: compiling the step", smoothing=0)
        try:
            for step in range(first + 1, cfg.steps + 1):
                batch = _windows(tokens, rng, cfg) if batches is None else batches(rng)
                placed = jnp.asarray(batch) if mesh is None else sharding.global_batch(batch, mesh)
                if placed.shape not in steps:  # compiled once per batch shape, its memory checked first
                    steps[placed.shape] = compiled_step(model, optimizer, placed)
                loss = float(steps[placed.shape](model, optimizer, placed))
                losses.append(loss)
                if start is None:  # the first step includes compilation
                    start, done = time.perf_counter(), 0
                    bar.reset(total=cfg.steps)
                    bar.initial = bar.n = step
                    bar.set_description("train")
                else:
                    done += batch.shape[0] * (batch.shape[1] - 1)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{done / (time.perf_counter() - start):,.0f}")
                if saving and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                    _save(manager, step, model, optimizer, rng, run)
        except KeyboardInterrupt:
            raise Interrupted(manager.latest_step() if saving else None, cfg.out_dir) from None
        finally:
            bar.close()
    if cfg.out_dir is not None:
        save_pretrained(model, os.path.join(cfg.out_dir, "model"))
    return losses


def main(
    cfg: TrainConfig, corpus: str | None = None, sample_tokens: int = 200, resume: bool = False, overwrite: bool = False
) -> KDAForCausalLM:
    """Train the model of ``cfg.preset`` (or fine-tune ``cfg.checkpoint``'s), print the loss against the
    unigram entropy, then a sample.

    Args:
        cfg: the run's settings.
        corpus: a text file (None: the text shipped with kdax).
        sample_tokens: tokens to generate after training (0: none).
        resume: continue from the newest checkpoint in ``cfg.out_dir`` (see :func:`train`).
        overwrite: replace the training state in ``cfg.out_dir`` (see :func:`train`).

    Returns:
        The trained model.
    """
    tokens = load_corpus(corpus)
    tokens = tokens[: tokens.size - int(cfg.holdout * tokens.size)]
    if cfg.checkpoint is not None:
        model = from_pretrained(cfg.checkpoint)
    else:
        config = PRESETS[cfg.preset]()
        model = model_class(config)(config, rngs=nnx.Rngs(cfg.seed))
    entropy = unigram_entropy(tokens)
    say = print if jax.process_index() == 0 else lambda *_: None  # every host runs this; one speaks
    say(f"corpus {tokens.size:,} bytes, unigram entropy {entropy:.3f} nats; model {model.num_parameters():,} params")
    losses = train(model, tokens, cfg, resume=resume, overwrite=overwrite)
    if losses:  # the steps this run ran: cfg.steps - len(losses) + 1 .. cfg.steps
        first, last = cfg.steps - len(losses) + 1, losses[-20:]
        say(
            f"loss: step {first} {losses[0]:.3f}, mean of steps {cfg.steps - len(last) + 1}-{cfg.steps} "
            f"{np.mean(last):.3f} nats"
        )
    if cfg.out_dir is not None:
        say(
            f"saved: the final weights in {os.path.join(cfg.out_dir, 'model')} (kdax.models.from_pretrained)"
            + (
                f", the training state in {os.path.join(cfg.out_dir, 'state')} (--resume)"
                if cfg.checkpoint_every
                else ""
            )
        )
    if sample_tokens:
        prompt = jnp.asarray(tokens[None, :64], jnp.int32)
        out = generate(model, prompt, sample_tokens)
        say(bytes(np.asarray(out[0], np.uint8)).decode("utf-8", errors="replace"))
    return model
