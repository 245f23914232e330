"""Backend capability records: what a backend takes and does, recorded once in its module
(``CAPABILITIES``), so that the public ops and the layers ask the record and never compare a
backend's name (only :mod:`kdax.ops.common.dispatch` does, to choose one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What every backend's record says; an op family's record adds what its ops need.

    Attributes:
        name: the ``backend=`` name.
        config: its per-call config class (a frozen dataclass with ``resolved()``), or None.
        cores: {op: core} of the ops it has, each taking the arguments the family's xla core takes.
        portable: runs on any device in any dtype (float64 included).
        reference: the float64 reference: whole ops of their own signatures where ``cores`` lacks
            them, run as they are.
    """

    name: str
    config: type | None = None
    cores: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    portable: bool = False
    reference: bool = False
