"""`return-waves`: a mesh chip's waves of a2a's split pairs sent while its expert loop computes.

shard-experts{waves=W} returns a2a's split pairs (a token's pairs on several chips, one row each)
in W all-to-alls, wave w holding the pairs of the w-th range of the receiver's experts, and tags
each start with the receiver's blocks that hold its pairs at most (`ccl.wave_blocks`: blocks go
in expert order). Issued after the expert loop, they all waited for its last block, and under a
skewed routing the hot chip's return (DeepSeek-V3 on 8 chips at 16 tokens a chip: 7.5 MB, 252
us of its link) followed its loop while every other chip waited for it.

Last at the schedule level, this pass cuts the routed expert loop (one loop, not chunked) after
each wave's blocks with interleave-shared's `split`, and moves the wave's gather of the blocks'
rows, its all-to-all start and the index work they read to the end of that piece, reading that
piece's results, in which those blocks are final: the link sends the wave while the next
pieces compute. A wave whose blocks reach the loop's end stays after it. Each op reads the same
values as before, so the outputs keep their bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func, scf
from xdsl.dialects.builtin import IntegerAttr, ModuleOp
from xdsl.ir import Block, Operation
from xdsl.passes import ModulePass

from dialects import ccl
from dialects.annotations import phase_of
from passes._loop_builder import constant_index, op_of_block
from passes.schedule.interleave_chunks import _between, _read_by, _reads
from passes.schedule.interleave_shared import split
from passes.schedule.split_clusters import expert_loops


def _wave_starts(block: Block) -> list[ccl.AllToAllStartOp]:
    return [op for op in block.ops if isinstance(op, ccl.AllToAllStartOp) and ccl.WAVE_BLOCKS_ATTR in op.attributes]


def _wave_blocks(start: ccl.AllToAllStartOp) -> int:
    attr = start.attributes[ccl.WAVE_BLOCKS_ATTR]
    assert isinstance(attr, IntegerAttr)
    return attr.value.data


def send_waves(block: Block) -> None:
    """`block`'s routed expert loop cut after each wave's blocks, the wave issued there (the
    module docstring); nothing where the loop is not one or no wave ends inside it."""
    starts = _wave_starts(block)
    loops = [loop for loop in expert_loops(block) if phase_of(loop) == "experts"]
    if not starts or len(loops) != 1:
        return
    loop = loops[0]
    lb, ub, step = (constant_index(v) for v in (loop.lb, loop.ub, loop.step))
    if lb is None or ub is None or step != 1:
        return
    cuts = sorted({_wave_blocks(s) for s in starts if lb < _wave_blocks(s) < ub})
    if not cuts:
        return
    pieces = split(loop, [lb, *cuts, ub])
    last = pieces[-1]
    for start in starts:
        if _wave_blocks(start) not in cuts:
            continue
        at = cuts.index(_wave_blocks(start))
        after = _between(last, None)
        moved = _reads([start], after, block)
        ops = [op for op in after if op in moved]
        if not _only_read_by([op for op in ops if op is not start], moved, last, block):
            continue
        for op in ops:
            for nested in op.walk():
                for i, v in enumerate(nested.operands):
                    if v.owner is last:
                        nested.operands[i] = pieces[at].results[v.index]  # type: ignore[attr-defined]
            op.detach()
        block.insert_ops_before(ops, pieces[at + 1].ub.owner)  # type: ignore[arg-type]  # right before the next piece


def _only_read_by(ops: list[Operation], moved: set[Operation], last: scf.ForOp, block: Block) -> bool:
    """Whether the ops of `ops` (a wave's, short of its start) that read the loop's results,
    directly or through each other, are read by nothing but `moved`: else the others would read
    an earlier piece's (a tile loop that gathers several waves' rows)."""
    return all(op_of_block(use.operation, block) in moved
               for op in _read_by({last}, ops) for r in op.results for use in r.uses)


@dataclass(frozen=True)
class ReturnWavesPass(ModulePass):
    """The waves of a2a's split pairs -> inside the expert loop, each after its blocks (the
    module docstring)."""

    name = "return-waves"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks and ccl.CHUNKS_ATTR not in fn.attributes:
                send_waves(fn.body.block)
