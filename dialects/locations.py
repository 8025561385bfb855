"""Source locations on IR: which `.moe` line an op came from, and which pass made it.

Every op the builder makes carries MLIR's `FileLineColLoc` of its expression in the `.moe`
file (`loc("examples/mixtral.moe":7:19)`); every op a pass creates carries the location of the
op it lowers, wrapped in a `NameLoc` naming the pass (`loc("lower-topk"("examples/mixtral.moe":7:19))`),
`fused[...]` when it stands for ops of several places. tcpc/provenance.py gives passes' ops
their locations; the simulator reads them back here to attribute cycles to source lines and to
label its trace. Locations are printed only when asked (`--debug-locations`, xDSL's
`print_debuginfo`), so the default IR is the same with them as without.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from xdsl.dialects.builtin import (
    CallSiteLoc,
    FileLineColLoc,
    FusedLoc,
    IntAttr,
    LocationAttr,
    NameLoc,
    NoneAttr,
    StringAttr,
)
from xdsl.ir import Attribute, BlockArgument, Operation, SSAValue

BUILDER = "builder"
"""The creator of an op whose location is a bare `FileLineColLoc`: the `.moe` frontend
(tcpc/builder.py), or a hand-written `.mlir` file's own locations."""


def file_location(filename: str, line: int, column: int) -> FileLineColLoc:
    """`loc("file":line:column)`."""
    return FileLineColLoc(StringAttr(filename), IntAttr(line), IntAttr(column))


@lru_cache(maxsize=1 << 14)
def source_locations(loc: Attribute) -> tuple[FileLineColLoc, ...]:
    """The file locations inside `loc`, in order, without repeats: the location itself, a
    name's or a call site's callee's, each of a fused location's. (Cached: the passes and the
    simulator ask again for the same locations, which attributes make hashable.)"""
    found: dict[FileLineColLoc, None] = {}
    todo = [loc]
    while todo:
        item = todo.pop(0)
        if isinstance(item, FileLineColLoc):
            found[item] = None
        elif isinstance(item, NameLoc):
            todo.insert(0, item.location)
        elif isinstance(item, CallSiteLoc):
            todo.insert(0, item.callee)
        elif isinstance(item, FusedLoc):
            todo[:0] = list(item.locations)  # type: ignore[call-overload]
    return tuple(found)


def value_location(value: SSAValue) -> Attribute:
    """Where a value was defined: its op's location, or a block argument's own."""
    return value.location if isinstance(value, BlockArgument) else value.owner.location  # type: ignore[union-attr]


def created_by(op: Operation) -> tuple[str, ...]:
    """The passes that made `op`, first to last: the one that lowered a source op into it, then
    each that copied it (the names a pass stamps around a location); (BUILDER,) for an op
    located in a source file but made by no pass, () for an op without a source location."""
    loc: Attribute = op.location
    names: list[str] = []
    while isinstance(loc, NameLoc) and not isinstance(loc.location, NoneAttr):
        names.append(loc.desc.data)
        loc = loc.location
    if not source_locations(loc):
        return ()
    return tuple(reversed(names)) or (BUILDER,)


def stamped(pass_name: str, leaves: Iterable[FileLineColLoc]) -> LocationAttr:
    """The location of an op `pass_name` made for the source locations `leaves`: the pass's
    name around the one location, or around all of them fused (in file, line, column order)."""
    ordered = sorted(set(leaves), key=lambda f: (f.filename.data, f.line.data, f.column.data))
    assert ordered, "a stamped location needs a source location"
    inner: LocationAttr = ordered[0] if len(ordered) == 1 else FusedLoc(tuple(ordered), NoneAttr())
    return NameLoc(StringAttr(pass_name), inner)


def describe(leaf: FileLineColLoc) -> str:
    """`file:line:col`, as compilers print a place."""
    return f"{leaf.filename.data}:{leaf.line.data}:{leaf.column.data}"


def op_places(op: Operation) -> tuple[str, ...]:
    """`file:line:col` of every source location of `op` (none for an op without one)."""
    return tuple(describe(f) for f in source_locations(op.location))
