"""Serving KDA hybrids: the models' state in pools of slots and pages, one compiled step for a
mixed batch of prefill chunks, decode tokens and draft tokens to verify, and a small
continuous-batching scheduler over it (docs/serving.md)."""

from kdax.serving.scheduler import Scheduler, prompt_lookup
from kdax.serving.step import Batch, Pool, copy_slots, init_pool, step

__all__ = ["Batch", "Pool", "Scheduler", "copy_slots", "init_pool", "prompt_lookup", "step"]
