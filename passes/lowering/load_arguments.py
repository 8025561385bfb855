"""`load-arguments`: a function argument that an engine computes on is loaded into SRAM first.

The layer's inputs and weights arrive in HBM. DMA commands (`tcp.dma_gather`, `dma_scatter`,
`load`, `store`) read HBM directly, but the contraction and vector engines read SRAM, so an
argument they read (the activations, the router, a shared expert's weights) needs a `tcp.load`,
which the simulator costs on the DMA engines and places in SRAM. Without it the IR would read
HBM for free. The pass runs last in the full pipeline:

    %0 = tcp.contract "mk,kn->mn" %x_f32, %router ...

becomes

    %router_sram = tcp.load %router : tensor<64x8xf32> -> tensor<64x8xf32>
    %0 = tcp.contract "mk,kn->mn" %x_f32, %router_sram ...

One load per argument, placed just before its first reader so the buffer lives no longer than
needed; loads before the same reader are issued smallest first (`by_size`): a load of at most one
DMA piece runs on one engine, and issued after a large load spread over all of them it waits
for that engine's part (the router's 512 KB behind Qwen3-30B-A3B's 8 MB of tokens at T = 2048:
2,797 cycles after the tokens' 5,593); issued first, it runs beside the large one, which takes
the engines left (the scheduler's choice of spread, runtime_sim/perf/scheduler.py). Views of the
argument (`tcp.view`, `ve.broadcast`, `ve.bitcast` move no data; `tile.slice` addresses some of
its rows, a mesh chip's chunk of its tokens) read the loaded copy when an engine consumes them, so
a broadcast bias loads its own bytes, not the broadcast's. Arguments read only by DMA commands
(the expert weights, gathered per block; the tokens whose chunks a mesh chip's dispatch scatters,
which a whole SRAM copy kept for the chunks made wait behind the router: Qwen3-30B-A3B ep=8,
4,096 tokens a chip in 8 chunks, a2a_sum, 1,787.9 -> 1,742.5 us) and
results returned as they are stay in HBM, and so does a pinned routing argument
(`tcp.order`: it stands in the router's indices' buffer). schedule-experts loads the same way an expert loop's
result it stored in HBM when an engine reads it (`load_into_sram`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from dialects import tcp, tile, ve
from dialects.annotations import PHASE_ATTR
from dialects.tensor_types import stored_bytes

VIEWS = (tcp.ViewOp, ve.BroadcastOp, ve.BitcastOp, tile.SliceOp)
"""Ops that give another shape to the same bytes, or address some of them (a chunk's rows of
the tokens, shard-experts' `chunks`): they read nothing themselves."""
HBM_READERS = (tcp.DmaGatherOp, tcp.DmaScatterOp, tcp.LoadOp, tcp.StoreOp, func.ReturnOp)
"""Ops that may take an operand that lives in HBM."""
STAND_INS = (tcp.OrderOp,)
"""Ops whose result stands where another operand is: pin-routing's routing argument, read where the
router's indices are (their buffer), so it needs no load."""


def _computes_on(op: Operation) -> bool:
    """Whether an engine reads this user's operand from SRAM (through any views)."""
    if isinstance(op, HBM_READERS + STAND_INS):
        return False
    if isinstance(op, VIEWS):
        return any(_computes_on(use.operation) for use in op.results[0].uses)
    return True


def load_into_sram(arg: SSAValue) -> tcp.LoadOp | None:
    """Insert the load of `arg` (a function argument, or any value in HBM) before its first
    engine reader in its block and redirect those readers."""
    readers = [use.operation for use in arg.uses if _computes_on(use.operation)]
    if not readers:
        return None
    block = arg.block if isinstance(arg, BlockArgument) else arg.owner.parent_block()
    assert block is not None
    first = min((block.find_ancestor_op_in_block(r) or r for r in readers), key=block.get_operation_index)
    load = tcp.LoadOp(arg)
    load.result.name_hint = f"{arg.name_hint}_sram" if arg.name_hint else None
    if PHASE_ATTR in first.attributes:
        load.attributes[PHASE_ATTR] = first.attributes[PHASE_ATTR]
    Rewriter.insert_op(load, InsertPoint.before(first))
    for reader in readers:
        reader.operands = [load.result if v is arg else v for v in reader.operands]
    return load


def by_size(args: Sequence[BlockArgument]) -> list[BlockArgument]:
    """The arguments, smallest first (ties in argument order): each load goes just before its
    first reader, so of the loads before one reader the last inserted, the largest, comes last."""
    return sorted(args, key=lambda a: stored_bytes(a.type))


@dataclass(frozen=True)
class LoadArgumentsPass(ModulePass):
    name = "load-arguments"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks:
                for arg in by_size(fn.body.blocks.first.args):
                    load_into_sram(arg)

