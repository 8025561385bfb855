"""Expert choices outside [0, E) in a run of lowered IR, counted as they happen.

The reference rejects such a routing (`moe.scatter: expert index ... is outside [0, E)`); the
lowered routing, like the hardware, matches the index to no expert and drops its pair, so a
plain simulation would give an answer silently missing those pairs. `RoutingRangeCheck` is an
interpreter listener that reads the choices where `lower-routing` marked them
(`tcpc.expert_indices`, dialects/annotations.py) and keeps the count and the first one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from xdsl.ir import Operation

from dialects.annotations import expert_indices


@dataclass
class OutOfRange:
    """The expert choices of one routing that name no expert."""

    experts: int
    count: int
    total: int
    first: tuple[int, ...]
    """The position of the first bad choice ([token, choice])."""
    value: int

    def describe(self) -> str:
        where = ", ".join(f"{n} {i}" for n, i in zip(("token", "choice"), self.first))
        return (f"{self.count} of {self.total} expert choices are outside [0, {self.experts}) "
                f"(the first: {where} chose {self.value}); the lowered routing drops those pairs, "
                "the reference rejects them")


class RoutingRangeCheck:
    """An xDSL interpreter listener (duck-typed, as tcpc.progress.Progress is)."""

    def __init__(self) -> None:
        self.found: list[OutOfRange] = []

    def will_interpret_op(self, op: Operation, args: tuple[Any, ...]) -> None:
        experts = expert_indices(op)
        if experts is None or not args or not isinstance(args[0], np.ndarray):
            return
        choices = np.asarray(args[0])
        bad = (choices < 0) | (choices >= experts)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            self.found.append(OutOfRange(experts, int(bad.sum()), int(choices.size), first, int(choices[first])))

    def did_interpret_op(self, op: Operation, results: Any) -> None:
        pass
