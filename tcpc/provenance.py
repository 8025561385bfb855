"""Every op a pass creates inherits the source location of the op it lowers, whatever the
pass: one step around each pass, so that no pass has to carry locations itself.

Before a pass, `snapshot` notes every op and its operands. After it, `inherit_locations`
stamps each op the pass made with the pass's name around its location (dialects/locations.py):

- a copy of an op (xDSL's `clone`, or a pass's own copy, which keeps the location as a clone
  does) keeps its location inside the stamp: `loc("split-clusters"("lower-dispatch"(...)))`;
- a new op (without a location) gets the source locations the first of these rules finds,
  fused where there are several (`loc("lower-topk"(fused[...]))`):
  1. an op with regions (an `scf.for`, a `ve.chain`): those of the ops inside it;
  2. the op whose result it replaces: an op that read a value before the pass (it may since
     have been erased: xDSL keeps an erased op's operands) and reads this op's result in its
     place after it gives this op the location of that value's definition (an op, or a
     function argument: the `tcp.load` of an argument is located at the parameter). Each
     lowering of a chain of ops in one pass so keeps its own op's line;
  3. the ops that read its results, through other new ops: the rest of a lowering, the ops
     that compute the replacement value (a new op with regions that rule 1 left without any
     takes rule 2's, then this one's);
  4. the ops that make its operands (a store, what nothing reads);
  5. the op it is nested in. A terminator takes its region's op's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from xdsl.dialects.builtin import FileLineColLoc, ModuleOp, NameLoc, StringAttr, UnknownLoc
from xdsl.ir import Operation, OpResult, SSAValue
from xdsl.traits import IsTerminator

from dialects.locations import source_locations, stamped, value_location

Places = frozenset[FileLineColLoc]


@dataclass(frozen=True)
class Snapshot:
    """Every op of a module before a pass, and what it read."""

    operands: tuple[tuple[Operation, tuple[SSAValue, ...]], ...]
    located: bool
    """Whether any op had a source location (none had: nothing to inherit, e.g. hand-written IR)."""


def snapshot(module: ModuleOp) -> Snapshot:
    ops = tuple((op, tuple(op.operands)) for op in module.walk())
    return Snapshot(ops, any(not isinstance(op.location, UnknownLoc) for op, _ in ops))


def inherit_locations(module: ModuleOp, before: Snapshot, pass_name: str) -> None:
    """Stamp every op `pass_name` made in `module`, locating the new ones (the module
    docstring); `before` is the module's `snapshot` from before the pass."""
    if not before.located:
        return
    inside_first = list(module.walk(region_first=True))
    existed = {op for op, _ in before.operands}
    for op in inside_first:
        if op not in existed and source_locations(op.location):
            op.location = NameLoc(StringAttr(pass_name), op.location)
    new = {op for op in inside_first if isinstance(op.location, UnknownLoc) and op is not module}
    if not new:
        return
    terminators = {op for op in new if op.has_trait(IsTerminator)}
    found: dict[Operation, Places] = {}

    def places(op: Operation) -> Places:
        return found.get(op, Places()) if op in new else Places(source_locations(op.location))

    def inner(op: Operation) -> Places:
        return Places().union(*(places(o) for r in op.regions for b in r.blocks for o in b.ops if o not in terminators))

    def readers(op: Operation) -> Places:
        return Places().union(*(places(use.operation) for r in op.results for use in r.uses
                                if use.operation not in terminators))

    def writers(op: Operation) -> Places:
        return Places().union(*(places(v.op) if isinstance(v, OpResult) else Places(source_locations(v.location))
                                for v in op.operands))

    def settle(rule: Callable[[Operation], Places], todo: list[Operation]) -> None:
        """Grow each op's places by `rule` until nothing changes (what a rule reads may grow)."""
        changed = True
        while changed:
            changed = False
            for op in todo:
                had = found.get(op, Places())
                grown = had | rule(op)
                if grown != had:
                    found[op], changed = grown, True

    replaced: dict[Operation, Places] = {}
    for reader, was in before.operands:
        now = reader.operands
        if len(now) == len(was):
            for old, value in zip(was, now):
                if value is not old and isinstance(value, OpResult) and value.op in new:
                    replaced[value.op] = replaced.get(value.op, Places()).union(source_locations(value_location(old)))
    # Ops with regions inside first (nested ones are ready first), then the others readers first.
    ops = [op for op in inside_first if op.regions and op in new and op not in terminators]
    ops += [op for op in reversed(inside_first) if not op.regions and op in new and op not in terminators]
    found.update((op, replaced[op]) for op in ops if not op.regions and replaced.get(op))
    todo = [op for op in ops if op not in found]

    def inner_or_readers(op: Operation) -> Places:
        return inner(op) if op.regions else readers(op)

    settle(inner_or_readers, todo)
    settle(lambda op: replaced.get(op) or readers(op), [op for op in ops if op.regions and not found.get(op)])
    settle(inner_or_readers, todo)
    settle(writers, [op for op in ops if not found.get(op)])
    for op in module.walk():  # outermost first: a nested op takes its parent's, once that is known
        if op in new and not found.get(op) and (parent := op.parent_op()) is not None:
            found[op] = places(parent)
    for op, leaves in found.items():
        if leaves:
            op.location = stamped(pass_name, leaves)


@contextmanager
def locations_inherited(module: ModuleOp, pass_name: str) -> Iterator[None]:
    """Run a pass on `module` inside this: its new ops inherit locations when it returns."""
    before = snapshot(module)
    yield
    inherit_locations(module, before, pass_name)
