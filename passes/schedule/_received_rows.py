"""A mesh receiver's combine over the rows it received (schedule-tokens' helper): a receive
buffer holds each sender's rows at the head of its slice, so its tiles would span several
senders' slices, each a few rows then padding, and none could be skipped. The received rows
are packed first, and the sums go back packed when the return's all-to-all reads them alone.
"""

from __future__ import annotations

from xdsl.dialects.builtin import StringAttr, TensorType, i32
from xdsl.ir import Operation, SSAValue

from dialects import ccl, tcp, ve
from dialects.annotations import PHASE_ATTR
from dialects.tensor_types import shape_of
from passes._loop_builder import leading


def returning_all_to_all(escaping: list[SSAValue]) -> ccl.AllToAllExchange | None:
    """The all-to-all that sends a mesh receiver's combine results `escaping` back (its sums,
    [chips, rows per sender, ...] through views); None when none does."""
    for r in escaping:
        pending = [r]
        while pending:
            for use in pending.pop().uses:
                user = use.operation
                if isinstance(user, tcp.ViewOp):
                    pending.append(user.result)
                elif isinstance(user, ccl.AllToAllExchange) and use.index == 0:  # what it sends
                    return user
    return None


def back_source(back: ccl.AllToAllExchange) -> SSAValue:
    """What `back` sends, before the views that shape it into slices: a packed send is
    possible only when that value is read by `back` alone."""
    value = back.input
    while isinstance(value.owner, tcp.ViewOp) and value.uses.get_length() == 1:
        value = value.owner.input
    return value


def pack_received(ops: list[Operation], indices: SSAValue, counts: SSAValue,
                  per_sender: int) -> tuple[list[Operation], SSAValue, SSAValue]:
    """The combine of a mesh receiver over its received rows packed first: a receive buffer
    holds each sender's rows at the head of its slice (`counts` of its `per_sender`), so under
    balanced decode routing every tile of several slices holds a few rows and none could be
    skipped (DeepSeek-V3 on 32 chips, 16 tokens a chip: 512 static rows, 16 received, one in
    every other slice; 16 tiles of 32 rows ran). The received rows are packed in order
    (`ve.filter` of their row numbers, and of the gather's `indices`, padded with -1: a packed
    tile past them has no pair and its guard skips it), every other row input of `ops`
    gathered by the packed row numbers (a DMA gather; -1 gives a zero row, which no received
    row reads); `ops` then read the packed inputs, row for row the same numbers, and their
    results hold the senders' rows one after another, as a packed all-to-all sends them.
    Returns the packing ops, the packed row numbers (where each result row belongs in the
    buffer) and the packed indices."""
    senders = shape_of(counts.type)[0]
    tokens = senders * per_sender
    i32_rows = TensorType(i32, [tokens])
    made: list[Operation] = []

    def add(op: Operation, name: str | None = None) -> SSAValue:
        op.attributes[PHASE_ATTR] = StringAttr("combine")
        made.append(op)
        if name is not None:
            op.results[0].name_hint = name
        return op.results[0]

    pairs = shape_of(indices.type)[1]
    place = add(ve.IotaOp(TensorType(i32, [senders, per_sender]), 1))
    received = add(ve.TagOp("lt", place, add(ve.BroadcastOp(counts, 1, per_sender))), "received")
    has = add(tcp.ViewOp(received, [tokens]))
    packed_rows = add(ve.FilterOp(add(ve.IotaOp(i32_rows, 0)), has, [1], 0, tokens, -1), "packed_rows")
    spread = add(ve.BroadcastOp(has, 1, pairs))
    packed_indices = add(ve.FilterOp(indices, spread, [1], 0, tokens, -1), f"{indices.name_hint or 'indices'}_packed")
    inside = set(ops)
    packed: dict[SSAValue, SSAValue] = {indices: packed_indices}
    for op in ops:
        for i, v in enumerate(op.operands):
            if v.owner in inside or leading(v) != tokens or (isinstance(op, tcp.DmaGatherOp) and i == 0):
                continue
            if v not in packed:
                packed[v] = add(tcp.DmaGatherOp(v, packed_rows), f"{v.name_hint}_packed" if v.name_hint else None)
            op.operands[i] = packed[v]
    return made, packed_rows, packed_indices
