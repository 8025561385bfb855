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

from xdsl.dialects.builtin import FileLineColLoc, LocationAttr, ModuleOp, NameLoc, StringAttr, UnknownLoc
from xdsl.ir import Attribute, Operation, OpResult, SSAValue
from xdsl.traits import IsTerminator

from dialects.locations import source_locations, stamped, value_location

Places = frozenset[FileLineColLoc]


@dataclass(frozen=True)
class Snapshot:
    """Every op of a module before a pass, and what it read."""

    operands: tuple[tuple[Operation, tuple[SSAValue, ...]], ...]
    located: bool
    """Whether any op had a source location (none had: nothing to inherit, e.g. hand-written IR)."""


def walked(op: Operation, region_first: bool = False) -> list[Operation]:
    """`list(op.walk(region_first=...))`, made without a generator per level of nesting (a
    pipeline walks its module a few times after every pass)."""
    found: list[Operation] = []

    def visit(o: Operation) -> None:
        if not region_first:
            found.append(o)
        for region in o.regions:
            for block in region.blocks:
                for inner in block.ops:
                    visit(inner)
        if region_first:
            found.append(o)

    visit(op)
    return found


def snapshot(module: ModuleOp) -> Snapshot:
    return _snapshot(walked(module))


def _snapshot(ops: list[Operation]) -> Snapshot:
    """The snapshot of a module whose ops (walked in any order) are `ops`. An op's operands are
    the tuple it holds, which xDSL replaces, never changes in place, when an operand changes."""
    read = tuple((op, op._operands) for op in ops)  # pyright: ignore[reportPrivateUsage]
    return Snapshot(read, any(not isinstance(op.location, UnknownLoc) for op in ops))


def inherit_locations(module: ModuleOp, before: Snapshot, pass_name: str) -> Snapshot:
    """Stamp every op `pass_name` made in `module`, locating the new ones (the module
    docstring); `before` is the module's `snapshot` from before the pass. Ops and locations
    are looked up by identity (`id`): the snapshot and the module hold them all meanwhile, and
    hashing an op or a nested location calls Python for every level of it. Returns the
    module's snapshot after the pass, the next pass's `before`: one walk of the module a pass
    rather than two (a candidate's compile walks its module after each of about 20 passes)."""
    if not before.located:
        return snapshot(module)
    inside_first = walked(module, region_first=True)
    existed = {id(op) for op, _ in before.operands}
    leaves: dict[int, Places] = {}

    def at(loc: Attribute) -> Places:
        """The source locations in `loc` (locations are shared by the ops a pass copies)."""
        known = leaves.get(id(loc))
        if known is None:
            known = leaves[id(loc)] = Places(source_locations(loc))
        return known

    name = StringAttr(pass_name)
    copies: dict[int, NameLoc] = {}
    """The stamp around each location a copy has (an attribute made once for all its copies)."""
    new: dict[int, Operation] = {}
    for op in inside_first:
        loc = op.location
        if isinstance(loc, UnknownLoc):
            if op is not module:
                new[id(op)] = op
        elif id(op) not in existed and at(loc):
            stamp = copies.get(id(loc))
            if stamp is None:
                stamp = copies[id(loc)] = NameLoc(name, loc)
            op.location = stamp
    if not new:
        return _snapshot(inside_first)
    terminators = {key for key, op in new.items() if op.has_trait(IsTerminator)}
    found: dict[int, Places] = {}

    def places(op: Operation) -> Places:
        return found.get(id(op), Places()) if id(op) in new else at(op.location)

    def inner(op: Operation) -> Places:
        return Places().union(*(places(o) for r in op.regions for b in r.blocks for o in b.ops
                                if id(o) not in terminators))

    def readers(op: Operation) -> Places:
        return Places().union(*(places(use.operation) for r in op.results for use in r.uses
                                if id(use.operation) not in terminators))

    def writers(op: Operation) -> Places:
        return Places().union(*(places(v.op) if isinstance(v, OpResult) else at(v.location) for v in op.operands))

    def settle(rule: Callable[[Operation], Places], todo: list[Operation]) -> None:
        """Grow each op's places by `rule` until nothing changes (what a rule reads may grow)."""
        changed = True
        while changed:
            changed = False
            for op in todo:
                had = found.get(id(op), Places())
                grown = had | rule(op)
                if grown != had:
                    found[id(op)], changed = grown, True

    replaced: dict[int, Places] = {}
    for reader, was in before.operands:
        now = reader._operands  # pyright: ignore[reportPrivateUsage]
        if now is not was and now != was and len(now) == len(was):  # `!=` compares the values by identity first
            for old, value in zip(was, now):
                if value is not old and isinstance(value, OpResult) and id(value.op) in new:
                    key = id(value.op)
                    replaced[key] = replaced.get(key, Places()).union(at(value_location(old)))
    # Ops with regions inside first (nested ones are ready first), then the others readers first.
    ops = [op for op in inside_first if op.regions and id(op) in new and id(op) not in terminators]
    ops += [op for op in reversed(inside_first) if not op.regions and id(op) in new and id(op) not in terminators]
    found.update((id(op), replaced[id(op)]) for op in ops if not op.regions and replaced.get(id(op)))
    todo = [op for op in ops if id(op) not in found]

    def inner_or_readers(op: Operation) -> Places:
        return inner(op) if op.regions else readers(op)

    settle(inner_or_readers, todo)
    settle(lambda op: replaced.get(id(op)) or readers(op), [op for op in ops if op.regions and not found.get(id(op))])
    settle(inner_or_readers, todo)
    settle(writers, [op for op in ops if not found.get(id(op))])
    if any(not found.get(key) for key in new):
        for op in walked(module):  # outermost first: a nested op takes its parent's, once that is known
            if id(op) in new and not found.get(id(op)) and (parent := op.parent_op()) is not None:
                found[id(op)] = places(parent)
    stamps: dict[Places, LocationAttr] = {}
    for key, op_leaves in found.items():
        if op_leaves:
            stamp = stamps.get(op_leaves)
            if stamp is None:
                stamp = stamps[op_leaves] = stamped(pass_name, op_leaves)
            new[key].location = stamp
    return _snapshot(inside_first)


class Locating:
    """Passes run one after another on a module inside `inherited`: their new ops inherit
    locations, each pass's snapshot the one its predecessor's `inherit_locations` left (the
    module does not change between passes)."""

    def __init__(self, module: ModuleOp):
        self._module = module
        self._before = snapshot(module)

    @contextmanager
    def inherited(self, pass_name: str) -> Iterator[None]:
        """Run a pass on the module inside this: its new ops inherit locations when it returns."""
        yield
        self._before = inherit_locations(self._module, self._before, pass_name)
