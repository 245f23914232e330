"""What each Kascade (and DSA) backend takes and does (:mod:`kdax.ops.common.capabilities`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kdax.ops.common import capabilities


@dataclasses.dataclass(frozen=True)
class Capabilities(capabilities.Capabilities):
    """One Kascade backend: ``cores`` among "anchor", "reuse", "anchor_decode", "reuse_decode",
    "index_select" and "indexed_attention".

    Attributes:
        forward_only: its cores have no backward: a derivative goes through xla's core when
            "auto" picked them, and is refused when they were asked for by name.
        kv_as_one: its indexed attention takes v of k's shape only and reads them once when they
            are one array (``shared=``).
        refuse: ``refuse(asked)``: why "auto" (``asked`` False) does not run its kernels here.
    """

    forward_only: bool = False
    kv_as_one: bool = False
    refuse: Callable[[bool], str | None] | None = None
