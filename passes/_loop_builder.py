"""Building blocks of the schedule level's loops, shared by its passes: which ops work row by
row along a tensor's first axis, choosing the ops a loop can absorb without a cycle through
the ops it leaves outside, tile types, moving an absorbed op's outside readers after the
loop, and skipping an iteration's whole body on a runtime condition."""

from __future__ import annotations

from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IndexType, IntegerAttr, TensorType
from xdsl.ir import Attribute, Block, BlockArgument, Operation, OpResult, Region, SSAValue, SSAValues, Use
from xdsl.traits import Pure

from dialects import tcp, tile, ve
from dialects.annotations import placed_in_hbm

ZERO_OPERAND_VE = (ve.ConstOp, ve.IotaOp, ve.PositionTagOp)
"""`ve` ops without operands: a splat, a numbering or a position tag along another axis."""


def clone_op(op: Operation, mapping: dict[SSAValue, SSAValue]) -> Operation:
    """`op.clone(value_mapper=mapping)` for an op whose regions read each value after its
    definition (SSA order, as an `scf.for` body's), in one pass: xDSL's generic clone creates each
    op through its IRDL defaults and walks the copy again to set its operands, most of
    interleave-shared's time (it copies the routed loop's body per piece: Llama-4-Scout at
    T = 2048, about 11k ops). The copy shares its properties', attributes' and result types'
    objects and value names with `op`, as a clone does (op_trace's `cloned_loop_ops` relies on it)."""
    assert not op.successors
    cls = type(op)
    new = cls.__new__(cls)
    operands = SSAValues(mapping.get(v, v) for v in op.operands)
    uses = tuple(Use(new, i) for i in range(len(operands)))
    for value, use in zip(operands, uses):
        value.add_use(use)
    new._operands, new._operand_uses = operands, uses  # pyright: ignore[reportPrivateUsage]
    new._successors, new._successor_uses = (), ()  # pyright: ignore[reportPrivateUsage]
    new.results = SSAValues(OpResult(r.type, new, i) for i, r in enumerate(op.results))
    for old, result in zip(op.results, new.results):
        result.name_hint = old.name_hint
        mapping[old] = result
    new.properties = op.properties.copy()
    new.attributes = op.attributes.copy()
    new.location = op.location
    new.regions = ()
    for region in op.regions:
        new.add_region(clone_region(region, mapping))
    return new


def clone_region(region: Region, mapping: dict[SSAValue, SSAValue] | None = None) -> Region:
    """`region.clone()` by `clone_op`: its blocks' arguments and ops copied, `mapping` extended."""
    mapping = {} if mapping is None else mapping
    made = Region()
    for block in region.blocks:
        copy = Block()
        for i, arg in enumerate(block.args):
            copy.insert_arg(arg.type, i, arg.location).name_hint = arg.name_hint
            mapping[arg] = copy.args[i]
        made.add_block(copy)
        for op in block.ops:
            copy.add_op(clone_op(op, mapping))
    return made


def leading(value: SSAValue) -> int | None:
    t = value.type
    if isinstance(t, TensorType) and len(t.get_shape()) >= 1:
        return t.get_shape()[0]
    return None


def axis_of(op: Operation) -> int | None:
    """The axis a `ve` op works along (a reduce, scan, filter, broadcast), None without one."""
    attr = op.properties.get("axis")
    if attr is None:  # not `or`: an IntegerAttr of 0 is falsy
        attr = op.attributes.get("axis")
    return getattr(getattr(attr, "value", None), "data", None)


def works_along_axis_zero(op: Operation) -> bool:
    return axis_of(op) == 0


def in_hbm(value: SSAValue) -> bool:
    """Whether `value` lives in HBM: a function argument, an HBM buffer, a `tcp.store` or a
    command placed in HBM, through views, stores into a buffer and the loops that carry one
    (the combine's gather reads the expert loop's HBM result buffer through a view), and the
    branches that yield one (the then branch's)."""
    while True:
        owner = value.owner
        if isinstance(owner, tcp.ViewOp):
            value = owner.input
        elif isinstance(owner, (tile.StoreOp, tile.GatherIntoOp)):
            value = owner.dest
        elif isinstance(owner, scf.ForOp) and isinstance(value, OpResult):
            value = owner.iter_args[value.index]
        elif isinstance(owner, scf.IfOp) and isinstance(value, OpResult):
            value = owner.true_region.block.last_op.operands[value.index]  # type: ignore[union-attr]
        else:
            break
    if isinstance(value, BlockArgument) and isinstance(owner, Block):
        return isinstance(owner.parent_op(), func.FuncOp)
    if isinstance(owner, tile.BufferOp):
        return owner.space.data == "hbm"
    return isinstance(owner, tcp.StoreOp) or (isinstance(owner, Operation) and placed_in_hbm(owner))


def is_row_parallel_ve(op: Operation, extent: int) -> bool:
    """A `ve` op whose every operand and result has `extent` rows on its first axis and that
    does not reduce, scan, filter or number along that axis: row i of its results depends on
    row i of its operands alone."""
    if op.dialect_name() != "ve" or not op.results or works_along_axis_zero(op):
        return False
    if any(leading(r) != extent for r in op.results):
        return False
    return isinstance(op, ZERO_OPERAND_VE) or (bool(op.operands) and all(leading(v) == extent for v in op.operands))


def index_constant(value: int) -> arith.ConstantOp:
    """An `index` constant: a loop bound, step or tile offset."""
    return arith.ConstantOp.from_int_and_width(value, IndexType())


def constant_index(value: SSAValue) -> int | None:
    """The value of an integer `arith.constant` (a loop's bound or step), else None."""
    owner = value.owner
    if isinstance(owner, arith.ConstantOp) and isinstance(owner.value, IntegerAttr):
        return owner.value.value.data
    return None


def erase_unread(value: SSAValue) -> None:
    """Erase the pure op that made `value`, and those that made its operands, as far as nothing
    reads them (one token's row -> token index and lower-dispatch's scatter of its marks, a
    DMA command nobody waits for that would still hold an engine; a split or unrolled loop's
    bound constants)."""
    owner = value.owner
    if (not isinstance(owner, Operation) or owner.parent is None or any(r.uses for r in owner.results)
            or not owner.has_trait(Pure)):
        return
    operands = list(owner.operands)
    owner.detach()
    owner.erase()
    for v in dict.fromkeys(operands):
        erase_unread(v)


def tile_type(t: Attribute, rows: int = 1) -> Attribute:
    """`t` with `rows` rows on its first axis."""
    assert isinstance(t, TensorType)
    return TensorType(t.get_element_type(), [rows, *t.get_shape()[1:]])


def select_ops(block: Block, candidates: list[Operation]) -> list[Operation]:
    """`candidates` (ops of `block`, in order) minus those that must follow an outside op which
    itself reads one of them: they cannot be in one loop without a cycle."""
    chosen = list(candidates)
    while True:
        inside = set(chosen)
        # The outside ops that read, anywhere in them, a result of an inside op or of one of
        # these: followed along the results' uses (an op reads only values made before it, so
        # this is every such op), not by walking every outside op (an unrolled expert loop).
        tainted: set[Operation] = set()
        todo = list(chosen)
        while todo:
            for result in todo.pop().results:
                for use in result.uses:
                    reader = op_of_block(use.operation, block)
                    if reader is not None and reader not in inside and reader not in tainted:
                        tainted.add(reader)
                        todo.append(reader)
        keep = [op for op in chosen
                if not any(isinstance(v.owner, Operation) and v.owner in tainted for v in op.operands)]
        if len(keep) == len(chosen):
            return chosen
        chosen = keep


def connected(candidates: list[Operation], seeds: list[Operation]) -> list[Operation]:
    """The `candidates` linked to `seeds` (among them) by def-use edges through candidates, in
    order: one chunk's ops where a mesh chip computes several chunks of the same shape
    (shard-experts' `chunks`), which phase and row count alone cannot tell apart."""
    inside = set(candidates)
    found = {op for op in seeds if op in inside}
    pending = list(found)
    while pending:
        op = pending.pop()
        near = [v.owner for v in op.operands if isinstance(v.owner, Operation)]
        near += [u.operation for r in op.results for u in r.uses]
        for other in near:
            if other in inside and other not in found:
                found.add(other)
                pending.append(other)
    return [op for op in candidates if op in found]


def op_of_block(op: Operation, block: Block) -> Operation | None:
    """The op of `block` that is `op` or holds it; None when `op` is not in `block`."""
    while op.parent is not block:
        parent = op.parent_op()
        if parent is None:
            return None
        op = parent
    return op


def split_shared_constants(ops: list[Operation]) -> list[Operation]:
    """`ops` (chosen for a loop) without the constants that outside ops read: an escaping
    constant would be stored into a whole-extent buffer for nothing (DeepSeek-V3's [T, 256, 256]
    rank tie-breaks, 512 MB at T = 2048, when a contraction split its router into two loops).

    A constant is an operand-less op (splat, numbering) or an op reading only constants. One
    that an outside op reads leaves the loop (and so, in turn, may the constants it reads); an
    operand-less one that ops on both sides read is copied, the copy the loop's own."""
    inside = set(ops)
    constant: set[Operation] = set()
    for op in ops:
        if isinstance(op, ZERO_OPERAND_VE) or (op.operands and all(v.owner in constant for v in op.operands)):
            constant.add(op)

    def read_outside(op: Operation) -> bool:
        return any(u.operation not in inside for r in op.results for u in r.uses)

    def read_inside(op: Operation) -> bool:
        return any(u.operation in inside for r in op.results for u in r.uses)

    changed = True
    while changed:
        changed = False
        for op in ops:
            if op in inside and op in constant and read_outside(op):
                if isinstance(op, ZERO_OPERAND_VE) and read_inside(op):
                    continue
                inside.discard(op)
                changed = True
    chosen: list[Operation] = []
    for op in ops:
        if op not in inside:
            continue
        if isinstance(op, ZERO_OPERAND_VE) and read_outside(op):
            own = op.clone()
            block = op.parent_block()
            assert block is not None
            block.insert_op_before(own, op)
            for old, new in zip(op.results, own.results):
                new.name_hint = old.name_hint
                old.replace_uses_with_if(new, lambda use: use.operation in inside)
            op = own
        chosen.append(op)
    return chosen


def move_readers_after(block: Block, anchor: Operation, produced: list[SSAValue], inside: set[Operation]) -> None:
    """Outside ops that stood among a loop's absorbed ops (`inside`) and read its results
    (`produced`, directly or through each other) now follow `anchor`, in their order. Found
    from the values' uses, not by walking every op before `anchor` (interleave-shared's anchor
    follows the routed loop's pieces, whose bodies hold thousands of ops)."""
    before: set[Operation] = set()
    for op in block.ops:
        if op is anchor:
            break
        before.add(op)
    moved: set[Operation] = set()
    pending = list(produced)
    while pending:
        for use in pending.pop().uses:
            op = op_of_block(use.operation, block)  # a loop reads inside its body too
            if op is not None and op in before and op not in inside and op not in moved:
                moved.add(op)
                pending.extend(op.results)
    ordered = [op for op in block.ops if op in moved]
    for op in ordered:
        op.detach()
        block.insert_op_after(op, anchor)
        anchor = op


def load_chain(value: SSAValue) -> list[Operation]:
    """The `tcp.load` that `value` is, through views, and those views, in program order; empty
    when `value` is not a load's (through views)."""
    chain: list[Operation] = []
    while isinstance(value.owner, tcp.ViewOp):
        chain.append(value.owner)
        value = value.owner.input
    return [value.owner, *reversed(chain)] if isinstance(value.owner, tcp.LoadOp) else []


def sink_to_first_reader(block: Block, chain: list[Operation], unless: Operation | None = None) -> None:
    """Move `chain` (ops of `block` in program order: a whole `tcp.load` and the views around
    it) to just before the first other op of `block` that reads one of their results (in its
    body too), as load-arguments places a load: the copy then takes SRAM from that reader on.
    No move when nothing reads them, that reader comes before the chain's first op, or
    `unless` reads them."""
    inside = set(chain)
    ordered = list(block.ops)
    readers = [op_of_block(use.operation, block) for op in chain for r in op.results for use in r.uses]
    if unless is not None and unless in readers:
        return
    first = min((ordered.index(o) for o in readers if o is not None and o not in inside), default=None)
    if first is None or first <= ordered.index(chain[0]):
        return
    for op in chain:
        op.detach()
    block.insert_ops_before(chain, ordered[first])


def escaping_results(ops: list[Operation]) -> list[SSAValue]:
    """The results of `ops` read outside them: what a loop over them must store and return."""
    inside = set(ops)
    return [r for op in ops for r in op.results if any(u.operation not in inside for u in r.uses)]


def clone_rows(op: Operation, operands: list[SSAValue], rows: int) -> Operation:
    """`op` on `operands`, its results with `rows` rows on their first axis (one block, or a
    tile of tokens), keeping its properties, attributes, location and result names."""
    new = type(op).create(operands=operands, result_types=[tile_type(r.type, rows) for r in op.results],
                          properties=dict(op.properties), attributes=dict(op.attributes), location=op.location)
    for old, r in zip(op.results, new.results):
        r.name_hint = old.name_hint
    return new


def replace_by_loop(block: Block, ops: list[Operation], escaping: list[SSAValue], results: list[SSAValue],
                    new_ops: list[Operation]) -> None:
    """Put `new_ops` (the loop and what it needs) right after the last of the absorbed `ops`,
    let outside readers of `escaping` read `results` instead (moving those that stood among
    `ops` after the loop), and erase `ops`."""
    inside = set(ops)
    for r, result in zip(escaping, results):
        result.name_hint = r.name_hint
    block.insert_ops_after(new_ops, ops[-1])
    for r, result in zip(escaping, results):
        r.replace_uses_with_if(result, lambda use: use.operation not in inside)
    move_readers_after(block, new_ops[-1], results, inside)
    for op in reversed(ops):
        op.detach()
        op.erase()


def reopen_otherwise(branch: scf.IfOp) -> tuple[Block, list[SSAValue]]:
    """The else block of a `skip_unless` branch without its yield, and what that yielded (the
    carried values), for ops to be added there before a new yield."""
    otherwise = branch.false_region.block
    skipped = otherwise.last_op
    assert isinstance(skipped, scf.YieldOp)
    carried = list(skipped.operands)
    skipped.detach()
    skipped.erase()
    return otherwise, carried


def skip_unless(body: Block, condition: SSAValue) -> scf.IfOp:
    """Move every op of a loop body after `condition`'s producer, up to the body's yield, into
    an `scf.if %condition`: an iteration whose condition is false yields its carried values
    unchanged (the body's arguments after the index), so it does no work at all; the loop
    yields the branch's results."""
    loop_yield = body.last_op
    assert isinstance(loop_yield, scf.YieldOp) and isinstance(condition.owner, Operation)
    moved: list[Operation] = []
    op = condition.owner.next_op
    while op is not None and op is not loop_yield:
        moved.append(op)
        op = op.next_op
    for op in moved:
        op.detach()
    carried = list(loop_yield.operands)
    then = Block([*moved, scf.YieldOp(*carried)])
    otherwise = Block([scf.YieldOp(*body.args[1:])])
    branch = scf.IfOp(condition, [v.type for v in carried], [then], [otherwise])
    body.insert_op_before(branch, loop_yield)
    body.insert_op_before(scf.YieldOp(*branch.results), loop_yield)
    loop_yield.detach()
    loop_yield.erase()
    return branch
