"""A progress line for long simulations, on a terminal only.

`Progress` is an interpreter listener: it counts the ops the simulation has run against the
ops in the functions it can reach from the first op's function (counted when the run starts,
so after lowering; times `runs` when the function runs several times, as on every chip of a
mesh, where one Progress listens to every chip's thread), and redraws `simulating: done / total ops` on stderr at most
ten times a second, once the run has lasted a second (short runs print nothing). It writes only
when its stream is a terminal, so pipes, files and tests see no progress output.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation


class Progress:
    """An xDSL interpreter listener (duck-typed, so importing it does not load the interpreter)."""

    def __init__(self, total: int | None = None, stream: IO[str] | None = None, *, delay: float = 1.0,
                 interval: float = 0.1, force: bool = False, runs: int = 1):
        self.total = total
        self.runs = runs
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or bool(getattr(self.stream, "isatty", lambda: False)())
        self.delay = delay
        self.interval = interval
        self.done = 0
        self.start = time.monotonic()
        self.last = 0.0
        self.shown = False

    @staticmethod
    def count_ops(functions: list[func.FuncOp]) -> int:
        """The ops a run of `functions` executes once each (what `total` should be)."""
        return sum(1 for f in functions for op in f.walk() if op is not f)

    def _draw(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}")
        self.stream.flush()
        self.shown = True

    def will_interpret_op(self, op: Operation, args: Any) -> None:
        if self.total is None:
            from runtime_sim.perf.simulate import reachable_functions

            fn, module = op.parent_op(), op.get_toplevel_object()
            if isinstance(fn, func.FuncOp) and isinstance(module, ModuleOp):
                self.total = self.runs * self.count_ops(reachable_functions(module, fn))

    def did_interpret_op(self, op: Operation, results: Any) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay or now - self.last < self.interval:
            return
        self.last = now
        total = max(self.total or 1, 1)
        done = min(self.done, total)
        if done >= total:
            self._draw(f"simulating: {total:,} ops run; planning memory and scheduling")
        else:
            self._draw(f"simulating: {done:,} / {total:,} ops ({done / total:.0%})")

    def did_skip_ops(self, count: int) -> None:
        """`count` ops ran without being interpreted (a cost-only loop's copied iterations)."""
        self.done += count

    def close(self) -> None:
        """Erase the progress line (call when the simulation ends, however it ends)."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
