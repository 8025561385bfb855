"""The values cost-only runs compute, remembered across runs of the same routing.

A cost-only run computes only the values its costs read (cost_only.py): the routing's index
generation (one-hot, histogram, cumsum, a block's expert id, a guard), from the routing
arguments and static tables. Every candidate of a choice (tcpc/autotune.py: top-k strategies,
loop orders, row blocks) runs the same index generation on the same routing, as a new module:
DeepSeek-V3 at T = 4096 computed it 9 times, 2.2 of its 15.5 CPU s.

So each thunk (an op whose operands are all real) has a *key* that names its value whatever
the module: the op's name, properties, attributes and types (an op with a region: its
printed form), and the keys of its operands (a thunk's result, or a real value by content: a
routing argument, a constant, a loop index). Ops of the symbolic dialects compute a function
of their operands and the op alone, so equal keys give equal values. `ValueMemo` interns the
keys into integers (a key is a flat tuple of small ones, however long the chain of ops) and
keeps the values that were read (`Lazy.force`: a cost's data operand, a branch's condition,
a guard probe's table), when small (at most VALUE_BYTES each, MEMO_BYTES in all): a thunk
whose key is kept takes its values and computes nothing, nor anything it reads. The tables
they are made of ([T K, E]) are not kept, so a later run computes neither, and holds less:
DeepSeek-V3 at T = 4096 (`benchmarks/sim_speed.py --schedule`) keeps 7.5 MB, and its peak RSS
fell 319 -> 286 MB.
"""

from __future__ import annotations

import hashlib
import io
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from xdsl.ir import Operation
from xdsl.printer import Printer

VALUE_BYTES = 1 << 20
"""The largest value kept (a DeepSeek-V3 T = 4096 block table of [T K] indices is 256 KB)."""
MEMO_BYTES = 64 << 20
"""The most bytes of values kept; past it, everything is forgotten (and keys start afresh)."""
KEYS_KEPT = 1 << 17
"""The most keys interned (a few hundred bytes each); past it, everything is forgotten. A
DeepSeek-V3 T = 4096 row of benchmarks/schedule.md interns about 15,000 over its 9 runs."""
CONTENT_BYTES = 4 << 20
"""The largest real operand named by its content (a routing argument: [T, K] indices)."""


class ValueMemo:
    """Keys of thunks (module docstring) and the small values computed under them."""

    def __init__(self) -> None:
        self._ids: dict[tuple[Any, ...], int] = {}
        self._next = itertools.count()
        """Ids are never reused, so a key interned before `clear` never names a later value."""
        self._values: dict[int, tuple[Any, ...]] = {}
        self._bytes = 0
        self.hits = 0
        """Values taken from the memo (tests/test_cost_only.py counts them)."""

    def clear(self) -> None:
        self._ids.clear()
        self._values.clear()
        self._bytes = 0

    def _intern(self, key: tuple[Any, ...]) -> int:
        found = self._ids.get(key)
        if found is None:
            if len(self._ids) >= KEYS_KEPT:
                self.clear()
            found = self._ids[key] = next(self._next)
        return found

    def op_key(self, op: Operation) -> int:
        """The op's part of its thunks' keys: what its semantics read of it besides operands."""
        if op.regions:
            printer = Printer(stream=io.StringIO())
            printer.print_op(op)  # isolated from above (ve.chain): the same text for the same op
            return self._intern(("op", printer.stream.getvalue()))
        return self._intern(("op", op.name, tuple(op.properties.items()), tuple(op.attributes.items()),
                             tuple(v.type for v in op.operands), tuple(r.type for r in op.results)))

    def key(self, op_key: int, inputs: Sequence[Any], lazy: type) -> int | None:
        """The key of a thunk of the op of `op_key` on `inputs` (`lazy`: cost_only.Lazy, a
        thunk's result); None when an input cannot be named."""
        parts: list[Any] = [op_key]
        for v in inputs:
            if isinstance(v, lazy):
                if v.thunk.key is None:
                    return None
                parts.append((v.thunk.key, v.index))
            elif isinstance(v, (bool, int, float)):
                parts.append((type(v).__name__, v))
            elif isinstance(v, (np.ndarray, np.generic)) and v.nbytes <= CONTENT_BYTES:
                data = np.ascontiguousarray(v)
                parts.append((data.dtype.str, data.shape, hashlib.blake2b(data.data, digest_size=16).digest()))
            else:
                return None
        return self._intern(tuple(parts))

    def get(self, key: int) -> tuple[Any, ...] | None:
        values = self._values.get(key)
        if values is not None:
            self.hits += 1
        return values

    def keep(self, key: int, values: tuple[Any, ...]) -> None:
        """Keep `values`, computed under `key`, if each is a small array or number: as a
        read-only copy (a view would keep the table it views alive)."""
        if key in self._values:
            return
        kept: list[Any] = []
        size = 0
        for v in values:
            if isinstance(v, np.ndarray):
                v = np.array(v)
                v.flags.writeable = False
            elif not isinstance(v, (bool, int, float, np.generic)):
                return
            kept.append(v)
            size += getattr(v, "nbytes", 8)
        if size > VALUE_BYTES:
            return
        if self._bytes + size > MEMO_BYTES:
            self._values.clear()
            self._bytes = 0
        self._values[key] = tuple(kept)
        self._bytes += size


VALUES = ValueMemo()
"""The process's memo: the candidates of a choice run one after another in one process."""
