"""Python's cycle collector around work that makes many objects and frees few: a simulation,
a compile. Shared by the driver and the simulator, so it lives below both."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def without_gc_pauses() -> Iterator[None]:
    """Python's cycle collector off while the block runs. A simulation makes a few objects per
    executed op (trace records, tasks, slots) and keeps them all; a compile builds a module of
    tens of thousands of ops (an unrolled expert loop: Qwen3-30B-A3B's group order at T = 64
    has 32,793). Either way the collector would scan the growing heap again and again for
    garbage there is hardly any of (about a third of the time); values, records and most IR are
    freed by reference counting as always, and cycles (an erased op and its results) at the
    collector's next run after the block."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
