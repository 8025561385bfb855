"""`schedule-experts`: the expert loop of the schedule level.

After `lower-dispatch` and `lower-math`, an MoE layer's experts are whole-tensor commands over
all G blocks at once: a weight gather `tcp.dma_gather %w[%expert_ids]` ([G, D, F], every
block's own copy of its expert's weight), a guarded `tcp.contract "gbd,gdf->gbf"`, and `ve`
ops (row masks, roundings, the activation between the grouped matmuls) on [G, B, F]. At real
sizes those tensors are gigabytes, far beyond SRAM. This pass turns them into one static loop
over the blocks, `scf.for %g = 0 to G`, whose body does one block's work on tiles:

- every experts-phase op that is *block-parallel* (its operands and results have G blocks on
  their first axis, and it does not reduce, scan, filter or number along that axis) moves into
  the loop, cloned with one block instead of G. The block's results are the same numbers, by
  the same routine (a contraction of one block is the contraction's batch item g: one
  np.matmul per item either way), so the loop is bit-identical to what it replaces;
- a block no expert uses (id -1: G counts the worst routing's blocks) is skipped whole: the
  body after its id is an `scf.if` on `tile.guard` of the id, whose other branch yields the
  carried values unchanged, so an unused block costs its guard and nothing else. Its rows of
  the result buffers stay zero, so this is done only when the combine's gather is the one
  reader of every result (`read_by_combine`): it reads only routed pairs' rows. A routing
  that leaves more blocks unused therefore never pays for them, which keeps the layer's time
  monotone in T;
- a weight gather becomes `tile.load_expert %w[%ids_g] reuse %prev_ids, %prev_tile`: the
  canonical layout keeps an expert's blocks adjacent, so its weights are loaded once per run
  of blocks and reused; unused blocks (id -1) load nothing and their guarded contractions skip;
- the dispatch (lower-dispatch's `tcp.dma_gather %x[%block_tokens]`, G blocks of token rows)
  becomes the block's own gather, `tile.gather %x[%block_tokens_tile]`: its B rows come straight
  from the tokens by the block's row -> token index (-1: a padding row, zero), so the tokens
  never cross HBM as a blocked copy (before: a DMA scatter of every routed row into an HBM
  buffer ahead of the loop, on the critical path, then a load of each block's tile). The
  gather keeps the phase `dispatch`. It reads the tokens where they are, in HBM: a gather from
  the router's SRAM copy would move no HBM bytes, but an SRAM -> SRAM DMA serialises its reads
  and writes (book, "DMA Engine"; tcp_cost.py) and so takes the engines longer than an
  HBM -> SRAM one, which the engines pipeline (docs/passes.md, "The dispatch, a block at a time").
  One token in blocks of one row (decode, B = 1) is the exception where the weights are kept
  across blocks (not streamed): every block that runs holds the token's row, so the block's
  tile is a view of the token's SRAM copy (the router's load), no DMA command at all
  (Qwen3-30B-A3B bf16 T = 1: 59,892 -> 59,494 cycles),
  and its row -> token index (what its rows' masks read) is the constant 0, so lower-dispatch's
  scatter of the token's marks goes, with its copy to cluster 1 (59,494 -> 59,420).
  Streamed tiles keep the gathers: their loads span every engine back to back, and without
  the gathers' commands to offset them they start in lockstep, every start-up leaving HBM idle
  (Mixtral-8x7B T = 1: 507,447 -> 510,309 cycles, gpt-oss-120b 150,416 -> 151,712);
- another block-parallel input made elsewhere is sliced per block when in SRAM
  (`tile.slice`), loaded a block at a time when in HBM (`tile.load`);
- a result used after the loop is stored a block at a time into an HBM buffer (`tile.buffer`,
  `tile.store`), which the combine's gather then reads; where an expert has at most one block
  (G <= E, a mesh receiver's decode: mostly padding), only the rows that hold a pair (a guard
  per row; DeepSeek-V3 ep=8, 16 a chip, skewed: 2,151.3 -> 2,094.5 us). One token read in
  place (above) keeps its K results in SRAM instead (`results_in_sram`): each block's result is committed where it
  is made, split-clusters leaves the loop on cluster 0, and the combine picks its rows on the
  vector engine (`gather_on_vector_engine`), so neither the last block's store nor the gather
  back (516 + 628 cycles of DMA start-ups) follows the last weight byte (Qwen3-30B-A3B bf16
  T = 1: 59,308 -> 58,221 cycles);
- with streamed F tiles a block's results are stored by the next block that runs, right after
  its last tile's weight loads (carried as pending with their block and expert id, -1 before
  the first; the loop's last block stores its own too, or flushes the pending ones if it does
  not run): engines run their commands in program order, so a store issued at the end of its
  own block took an engine that then sat idle until the block's last contraction, and the next
  blocks' loads, issued after it, could not use it; an idle engine also holds its floor share
  of HBM (tcp_cost.hbm_sharing). DeepSeek-V3 fp8, T = 4096, B = 128, cost-only, balanced:
  10,117 -> 9,750 us (the engines idle 1.01 -> 0.34 of eight on average in the loop); not
  where the blocks' contractions are bound by their weights' bytes (`weight_bound`, below: decode);
- prefetching: a row gather or row tile load of block g waits (an `after` operand) for the last
  contraction of block g - 4 (`ROWS_AHEAD`), the last reader of that block's tiles, so the row
  tiles of four blocks are in SRAM at a time and the DMA of block g runs while blocks g - 3 to
  g - 1 contract; an expert's weight load waits for block g - 4 too (`WEIGHT_AHEAD`), so the
  next expert's weights arrive while the current expert's last blocks contract;
- the loop starts from the dispatch: a weight load also waits for the blocks' row indices (the
  dispatch's result, which the row gathers read anyway), so the loop's first commands start
  once the dispatch's DMA commands are done, from the same point at every T. Issued as soon as
  the expert ids were known, the first blocks' loads shared the engines with the dispatch's
  scatters in an order that changed with T, and issue #12's layer took 7 cycles less at
  T = 288 than at T = 280 (benchmarks/monotone.py). Decode of one token is the exception: its
  dispatch is one scatter of K rows, the same commands at every such layer, so nothing in it
  varies to reorder the loads, and its weight loads start as soon as the expert ids are known
  (Qwen3-30B-A3B bf16, T = 1, a block at a time: 60,853 -> 60,376 cycles).

- F tiles (passes/schedule/_f_tiles.py): when the plan is up-projections, column work and one
  down-projection (a SwiGLU or a plain MLP), the block's work runs per tile of F: each tile
  loads its window of every weight (`tile.load_expert ... at`), contracts and activates
  [1, B, tile], and adds its share of the down-projection to the previous tile's f32 sum
  (`tcp.contract ... acc`); the last tile's sum is what the untiled contraction gave, bit for
  bit. Tiles of experts that fit (two of them in half the SRAM) are carried to the next block
  for reuse and wait like whole weights; streamed tiles (Mixtral, Llama-4, DeepSeek-V3, gpt-oss
  at real dims) are fetched per block, each waiting for the down-projection two tiles earlier.
  A mesh chip's shared expert at decode, whose weights load before any routed weight, has its
  tiles chosen for a whole cluster's SRAM (`loads_before_routed`), and so are a mesh chip's
  routed experts at decode, whose blocks stream their weights (`streams_on_mesh`).
  Block-scaled (fp8, MXFP4) experts tile the same way, their weights' scales with them.
- one token's last block (decode, its results in SRAM, above) is a loop of its own, from G - 1
  to G, whose weights that one DMA engine loads alone, after its first, load in two pieces
  along K, each piece's contraction continuing the previous one's f32 sum: the stream ends
  with smaller commands and the engines finish closer together, with the same bits
  (passes/schedule/_k_pieces.py; Qwen3-30B-A3B MXFP4 T = 1: 19,206 -> 18,552 cycles);
- a whole weight whose one DMA command would leave an engine idle (over one `dma.split_bytes`
  piece, not whole pieces: tp's halved F, Qwen3-30B-A3B's [2048, 384] bf16 matrices, 1.5 MB as a
  1 MB and a 0.5 MB part holding two engines for the 1 MB part's time) loads in every block as
  K pieces that hold the engines least (`engine_pieces`: two of 0.75 MB, one engine each), each
  piece reused by the expert's next block as the whole weight is and its contraction continuing
  the previous piece's f32 sum: the same bits (Qwen3-30B-A3B ep=2,tp=2, 16 tokens a chip, B = 2:
  357.1 -> 312.4 us; its stream at 1,049 -> 1,240 B/cycle on one chip); a weight whose K is one
  grain (that layer's down matrix, [384, 2048]) in N pieces instead, each contraction making
  its columns of the result in an SRAM buffer (`column_pieces`; 289.3 -> 266.0 us);
- weight scales small enough (`scales_ahead`: fp8's, a few hundred bytes per expert and
  matrix; MXFP4's where an expert's move in less than a DMA start-up, `scales_ahead_row_bytes`)
  stay gathered for all blocks before the loop, one DMA command each, where they fit the
  weights' share of SRAM beside the loop's weight tiles and are one DMA piece each or the loop
  streams its weights (`scales_fit`: decode; Qwen3-30B-A3B MXFP4 T = 64: 271,516 -> 255,290
  cycles); the loop addresses its block's rows, and each F tile its window, in place
  (`tile.slice ... at`). Where the loop streams, larger scales go too where they fit beside
  those (gpt-oss-120b's and DeepSeek-V3's MXFP4 at T = 1). Otherwise they load with their
  expert, a block at a time. Biases
  (gpt-oss-120b's, 5.6 KB an expert and matrix) go ahead the same way where the loop streams
  its weights.
- the loop's order (`order`): `block`, the above, one block at a time; `tile`, groups of
  consecutive blocks, each group's distinct experts (its slots) running their F tiles as a
  block does, on all of the group's rows at once (passes/schedule/_expert_groups.py): a weight
  tile crosses HBM once per expert of a group rather than once per block, and a contraction
  takes a group's rows of one expert rather than one block's. `auto`, what the full pipeline
  writes, is the driver's choice between them by the cost model (tcpc/autotune.py).

Ops that are not block-parallel, or that depend on an op after the loop's place, stay where
they are. The loop goes right after the last op it absorbs; outside ops that read its results
and stood between its ops move after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IndexType, ModuleOp, TensorType, bf16, f32, i32
from xdsl.ir import Attribute, Block, Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.traits import Pure

from dialects import ccl, tcp, tile, ve
from dialects.ve import is_lane_type
from dialects.annotations import PHASE_ATTR, SHARED, phase_of
from dialects.tensor_types import shape_of, stored_bytes
from passes._auto_option import AUTO, check_choice, refuse_auto
from passes.schedule._expert_groups import GroupPlan, build_group_loops, group_blocks, groupable
from passes.schedule._f_tiles import (CONTRACTIONS, TILES_IN_FLIGHT, WEIGHT_SHARE, FRegion, choose_f_tile,
                                      find_f_region, held_weight_bytes)
from passes.schedule._k_pieces import (K_AXIS, Pieces, column_pieces, contract_pieces, cut_last_block, engine_pieces,
                                       last_block_cuts, piece_window)
from passes.schedule.interleave_shared import spreads
from passes.schedule.split_clusters import contraction_flops_per_weight_byte, own_dma_intensity
from passes.lowering.load_arguments import load_into_sram
from passes._loop_builder import (
    ZERO_OPERAND_VE,
    erase_unread,
    clone_rows,
    index_constant,
    connected,
    escaping_results,
    in_hbm,
    is_row_parallel_ve,
    leading,
    reopen_otherwise,
    replace_by_loop,
    select_ops,
    skip_unless,
    tile_type,
)
from target.machine import Machine
from target.target_spec import machine_of

TILE_AHEAD = TILES_IN_FLIGHT
"""A streamed F tile's loads wait for the down-projection two tiles earlier (passes/schedule/_f_tiles.py)."""
ROWS_AHEAD = 4
"""A block's row tiles are fetched once block g - 4 has contracted: four blocks' row tiles in
SRAM (B x D each: 64 KB for issue #12's sweep layer, 1 MB for Qwen3-30B-A3B at B = 256, next
to megabytes of weights). The DMA engines run their commands in order, so a row gather issued
before its tile's space is free takes an engine and holds it idle until the contraction that
frees the space ends, while weight loads issued after it queue; with block g - 2 the sweep's
layer (cost-only, balanced) spent a share of its engines' time in the expert loop so
idle (11% at T = 448), and T = 448 took more cycles than T = 456 (198,532 against 195,960).
With g - 4 the gathers are ready when an engine frees: 185,437 and 186,084 cycles; no cell of
benchmarks/schedule.py moves. At most `WEIGHT_AHEAD` (the waits the loop carries)."""
def scales_ahead_row_bytes(machine: Machine) -> int:
    """Weight scales of at most this many bytes per expert may be gathered for every block at
    once, before the loop (`scales_ahead`, `scales_fit`): a row moved in less time than a DMA
    command's start-up (RNGD: 500 cycles x 256 B/cycle, 128 KB) would cost mostly start-up as a
    command of its own, so one command for all blocks saves a start-up per expert and matrix:
    fp8's 128 x 128 blocks (a few hundred bytes or KB per matrix), and MXFP4's one e8m0 per 32
    weights where a matrix is small (Qwen3-30B-A3B: 48 KB; at T = 1, 24 such commands held the
    engines for 500-1,025 cycles each to move 48 KB). Larger MXFP4 scales (gpt-oss-120b's 259 KB, DeepSeek-V3's
    458 KB a matrix) go ahead only where the loop streams its weights (`scales_fit`), else load
    with their expert, spread over the engines."""
    return machine.dma_startup_cycles * machine.dma_bytes_per_cycle


WEIGHT_AHEAD = 4
"""An expert's weights are fetched once block g - 4 has contracted: a weight load (megabytes,
every few blocks) has the time of up to three blocks' contractions to arrive."""
assert ROWS_AHEAD <= WEIGHT_AHEAD
ORDER_BLOCK, ORDER_TILE, ORDER_AUTO = "block", "tile", AUTO
ORDERS = (ORDER_BLOCK, ORDER_TILE)
"""The expert loop's orders: a block at a time, each loading its expert's weights (`block`, the
pass's default), or groups of blocks, each weight tile loaded once per expert of a group and
contracted with all its rows there (`tile`, passes/schedule/_expert_groups.py). `auto` is the
driver's to resolve by the cost model (tcpc/autotune.py), as lower-topk's strategy is."""


def is_block_parallel(op: Operation, blocks: int, expert_ids: SSAValue, phase: str = "experts") -> bool:
    """Whether `op`, of the plan's `phase`, computes each of the G blocks from that block alone
    (see the docstring)."""
    if is_dispatch_gather(op, blocks) and phase == "experts":
        return True
    if phase_of(op) != phase or not op.results or expert_ids in op.results:
        return False
    if isinstance(op, tcp.DmaGatherOp):
        return op.indices is expert_ids
    if any(leading(r) != blocks for r in op.results):
        return False
    if isinstance(op, tcp.ContractOp):
        spec = op.spec.data
        (a, b), out = spec.split("->")[0].split(","), spec.split("->")[1]
        return a[0] == out[0] and (out[0] not in b or b[0] == out[0]) and (
            op.bias is None or leading(op.bias) in (blocks, None))
    if isinstance(op, tcp.ScaledContractOp):  # every operand is per block
        return op.bias is None or leading(op.bias) in (blocks, None)
    if isinstance(op, tcp.ViewOp):
        return leading(op.input) == blocks
    if isinstance(op, ZERO_OPERAND_VE):
        # A splat or numbering with G rows by coincidence (T = G = 1 at decode: the [T, K] ones
        # the row marks scatter) goes into the loop only for readers that go there too; else
        # an outside reader would keep every op after it out of the loop.
        return is_row_parallel_ve(op, blocks) and all(
            is_block_parallel(u.operation, blocks, expert_ids, phase) for r in op.results for u in r.uses)
    return is_row_parallel_ve(op, blocks)


def ahead_readers(value: SSAValue) -> list[Operation] | None:
    """The contractions that read `value` (a gather's result) as their weight's scales or as
    their bias (through views), or None if anything else reads it."""
    readers: list[Operation] = []
    for use in value.uses:
        op = use.operation
        if isinstance(op, tcp.ViewOp):
            inner = ahead_readers(op.result)
            if inner is None:
                return None
            readers += inner
        elif isinstance(op, tcp.ScaledContractOp) and use.index == 3 or \
                isinstance(op, CONTRACTIONS) and op.bias is value:
            readers.append(op)
        else:
            return None
    return readers


def scales_ahead(parallel: list[Operation]) -> list[tcp.DmaGatherOp]:
    """The gathers among a plan's block-parallel ops that may fetch weight scales (or biases:
    gpt-oss-120b's, 5.6 KB an expert and matrix) for every block at once, before the loop (one
    DMA command rather than one per expert); the loop addresses each block's rows in place.
    Whether they do is `scales_fit`'s."""
    return [op for op in parallel if isinstance(op, tcp.DmaGatherOp) and bool(ahead_readers(op.result))]


def scales_fit(ahead: list[tcp.DmaGatherOp], held: int, sram_bytes: int, machine: Machine) -> list[tcp.DmaGatherOp]:
    """Which of the scales that may go `ahead` do, rather than load a block at a time with their
    weights. Those whose rows move in less than a command's start-up (`scales_ahead_row_bytes`:
    as commands of their own they would cost mostly start-up): each that is one DMA piece
    (`dma_split_bytes`: it delays the loop's first block by at most a piece's transfer), and
    every one where the loop streams its weights (a block's contraction does fewer FLOPs per
    weight byte than its cluster's peak over HBM's bandwidth, `own_dma_intensity`: decode),
    where every per-block command's start-up holds an engine the weights stream on (biases only
    there: gpt-oss-120b at T = 1, 12 commands of 5.6 KB became 3; cost-only, balanced: bf16
    150,224 -> 149,887 cycles, fp8 76,554 -> 76,035, MXFP4 42,694 -> 42,344); none unless they
    fit the weights' share of `sram_bytes` beside the `held` bytes of the loop's weight tiles
    (`held_weight_bytes`; each cluster holds their G rows through the loop, split-clusters).
    Where the loop streams, larger rows too where they fit beside those (MXFP4's of gpt-oss-120b,
    259 KB an expert and matrix, and DeepSeek-V3, 458 KB: at T = 1, 42,344 -> 41,853 and
    159,490 -> 157,756 cycles). Where the contraction outlasts the load, per-block loads
    hide behind it and a large gather ahead only delays the first block: Qwen3-30B-A3B MXFP4
    (balanced, cost-only) with its 33 MB of scales ahead at T = 64 (B = 4) took 271,516 ->
    255,290 cycles, at T = 256 (B = 16) 299,896 -> 280,154, but at T = 512 (B = 32)
    369,094 -> 378,465 and at T = 2048 (B = 128) 1,349,310 -> 1,362,076."""
    streams = all(contraction_flops_per_weight_byte(reader) < own_dma_intensity(machine)
                  for op in ahead for reader in ahead_readers(op.result) or [])
    small = [op for op in ahead
             if stored_bytes(op.result.type) <= scales_ahead_row_bytes(machine) * shape_of(op.result.type)[0]]
    chosen = [op for op in small if streams or stored_bytes(op.result.type) <= machine.dma_split_bytes
              and all(isinstance(u.operation, tcp.ScaledContractOp) for u in op.result.uses)]

    def fits(gathers: list[tcp.DmaGatherOp]) -> bool:
        return sum(stored_bytes(op.result.type) for op in gathers) + held <= sram_bytes // WEIGHT_SHARE

    if not fits(chosen):
        return []
    larger = [op for op in ahead if op not in small] if streams else []
    return chosen + larger if larger and fits(chosen + larger) else chosen


def gathered_source(op: Operation, expert_ids: SSAValue) -> bool:
    """Whether `op` is read only as the source of gathers by the plan's `expert_ids` (the
    one-expert view of a shared expert's scales, which has G = 1 rows by coincidence at
    decode): a gather reads its source whole, ahead of the loop or a block at a time in it
    (`tile.load_expert`), so the source stays outside."""
    uses = [u for r in op.results for u in r.uses]
    return bool(uses) and all(isinstance(u.operation, tcp.DmaGatherOp) and u.index == 0
                              and u.operation.indices is expert_ids for u in uses)


def _root(value: SSAValue) -> Operation | None:
    """The op that produced a value's buffer, through views."""
    owner = value.owner
    while isinstance(owner, tcp.ViewOp):
        owner = owner.input.owner
    return owner if isinstance(owner, Operation) else None


def is_dispatch_gather(op: Operation, blocks: int) -> bool:
    """The dispatch: the tokens' rows gathered into G blocks by each row's token
    (lower-dispatch's `tcp.dma_gather %x[%block_tokens]`, indices [G, B]); the loop gathers one
    block's rows. Another dispatch gather (a mesh receiver copying its tokens to their slots,
    one index per row) is not one, even with G rows."""
    return (isinstance(op, tcp.DmaGatherOp) and phase_of(op) == "dispatch" and leading(op.indices) == blocks
            and len(shape_of(op.indices.type)) == 2)


def starts_from_dispatch(dispatch: tcp.DmaGatherOp) -> bool:
    """Whether the loop's weight loads wait for `dispatch`'s row indices (the docstring): all
    but one token's, whose dispatch is one scatter of K rows at every such layer."""
    return leading(dispatch.source) != 1


def one_row(dispatch: tcp.DmaGatherOp) -> bool:
    """Whether `dispatch` gathers one token into blocks of one row (decode, B = 1): every block
    that runs holds that token's row (lower-dispatch's `block_tokens`), so its tile is the
    token's row where it already is, with no DMA command."""
    return leading(dispatch.source) == 1 and shape_of(dispatch.indices.type)[1] == 1


def sram_copy(block: Block, tokens: SSAValue) -> SSAValue:
    """`tokens` in SRAM: themselves, or their `tcp.load` in `block` (the router's,
    load-arguments), else a new load right after they are made, issued before the commands
    that follow."""
    if not in_hbm(tokens):
        return tokens
    for op in block.ops:
        if isinstance(op, tcp.LoadOp) and op.input is tokens:
            return op.result
    load = tcp.LoadOp(tokens)
    load.result.name_hint = f"{tokens.name_hint}_sram" if tokens.name_hint else None
    owner = tokens.owner
    if isinstance(owner, Operation) and owner.parent_block() is block:
        block.insert_op_after(load, owner)
    else:
        block.insert_op_before(load, block.first_op)
    return load.result


def read_by_combine(value: SSAValue, inside: set[Operation]) -> bool:
    """Whether every reader of `value` outside `inside` is the combine's DMA gather of its rows
    (through views): its indices name only the rows of routed pairs, which lie in used blocks,
    so the rows of an unused block are never read and the loop may skip it."""
    for use in value.uses:
        reader = use.operation
        if reader in inside:
            continue
        if isinstance(reader, tcp.ViewOp):
            if not read_by_combine(reader.result, inside):
                return False
        elif not (isinstance(reader, tcp.DmaGatherOp) and use.index == 0 and phase_of(reader) == "combine"):
            return False
    return True


def combine_gathers(value: SSAValue) -> list[tcp.DmaGatherOp]:
    """The combine's DMA gathers of `value`'s rows (through views): `read_by_combine`'s readers."""
    found: list[tcp.DmaGatherOp] = []
    for use in value.uses:
        if isinstance(use.operation, tcp.ViewOp):
            found += combine_gathers(use.operation.result)
        elif isinstance(use.operation, tcp.DmaGatherOp):
            found.append(use.operation)
    return found


def contracted_as_loaded(value: SSAValue) -> bool:
    """Whether every reader of a loaded weight tile `value` is a contraction, directly or
    through views (gpt-oss's biases are viewed to the contraction's shape): nothing the
    vector engine must decode first."""
    return all(isinstance(u.operation, CONTRACTIONS)
               or (isinstance(u.operation, tcp.ViewOp) and contracted_as_loaded(u.operation.result))
               for u in value.uses)


def results_in_sram(value: SSAValue) -> bool:
    """Whether the combine can read a loop result `value` from SRAM on the vector engine
    (`gather_on_vector_engine`): its elements are 32-bit lanes or bf16 (widened exactly), and
    every gather of its rows picks rows of one axis."""
    element = value.type.get_element_type()  # type: ignore[attr-defined]
    return (element == bf16 or is_lane_type(element)) and all(
        len(shape_of(g.source.type)) == 2 for g in combine_gathers(value))


def gather_on_vector_engine(gather: tcp.DmaGatherOp) -> None:
    """Replace the combine's DMA `gather` of rows in SRAM by the vector engine's Filter stage:
    every index meets every row (broadcasts, views), the row whose number equals the index is
    kept (`ve.filter`, one element per line, +0 where the index is -1, as the DMA gather's zero
    row), bf16 rows widened to f32 first and narrowed back where a reader wants bf16 (both
    exact). An SRAM -> SRAM DMA command costs its start-up (500 cycles on RNGD) and serialised
    reads and writes; the Filter stage streams the rows once per index. The index tags, made
    from the indices alone, go right after them, off the path that waits for the rows."""
    source, indices = gather.source, gather.indices
    rows, width = shape_of(source.type)
    lead = list(shape_of(indices.type))
    axis = len(lead)
    full = [*lead, rows, width]
    block = gather.parent_block()
    assert block is not None
    spread = ve.BroadcastOp(indices, axis, rows)
    number = ve.IotaOp(TensorType(i32, full[:-1]), axis)
    picks = ve.TagOp("eq", spread.result, number.result)
    picks.result.name_hint = f"{gather.result.name_hint}_picks" if gather.result.name_hint else None
    along_rows = ve.BroadcastOp(picks.result, axis + 1, width)  # a view: the Filter streams it
    tags_ops: list[Operation] = [spread, number, picks, along_rows]
    element = source.type.get_element_type()  # type: ignore[attr-defined]
    row_ops: list[Operation] = []
    lanes: SSAValue = source
    if not is_lane_type(element):
        row_ops.append(ve.WidenOp(source, TensorType(f32, [rows, width])))
        lanes = row_ops[-1].results[0]
    for size in reversed(lead):
        row_ops.append(ve.BroadcastOp(lanes, 0, size))
        lanes = row_ops[-1].results[0]
    kept = ve.FilterOp(lanes, along_rows.result, [1], axis, 1, pad=0)
    flat = tcp.ViewOp(kept.result, [*lead, width])
    row_ops += [kept, flat]
    picked = flat.result
    picked.name_hint = gather.result.name_hint
    widened = [u.operation for u in list(gather.result.uses)
               if isinstance(u.operation, ve.WidenOp) and u.operation.result.type == picked.type]
    for widen in widened:  # the reader widened the rows: it reads them as picked
        widen.result.replace_all_uses_with(picked)
        widen.detach()
        widen.erase()
    if gather.result.uses:
        if picked.type != gather.result.type:
            row_ops.append(ve.NarrowOp(picked, gather.result.type))  # type: ignore[arg-type]
        gather.result.replace_all_uses_with(row_ops[-1].results[0])
    for op in (*tags_ops, *row_ops):
        op.attributes.update(gather.attributes)
        op.location = gather.location
    owner = indices.owner
    if isinstance(owner, Operation) and owner.parent_block() is block:
        block.insert_ops_after(tags_ops, owner)
    else:
        block.insert_ops_before(tags_ops, gather)
    # The vector engine runs its commands in program order: the rows' work goes just before
    # its first reader, after the combine's work that does not wait for the rows (its weights).
    readers = [block.find_ancestor_op_in_block(u.operation) for u in row_ops[-1].results[0].uses]
    first = min((r for r in readers if r is not None), key=block.get_operation_index, default=gather)
    block.insert_ops_before(row_ops, first)
    gather.detach()
    gather.erase()


def combine_ahead(loop: scf.ForOp) -> None:
    """Move the combine's vector work that does not wait for `loop` (its weights' widening and
    masks, made from the routing) before it: the loop's blocks and the combine then share one
    cluster's vector engine (one token's loop, results in SRAM), which runs its commands in
    program order, so behind the loop that work waited for the last block (37 cycles of
    Qwen3-30B-A3B's T = 1 critical path)."""
    block = loop.parent_block()
    assert block is not None
    later: set[SSAValue] = set(loop.results)
    op = loop.next_op
    while op is not None:
        following = op.next_op
        independent = not any(v in later for nested in op.walk() for v in nested.operands)
        if independent and phase_of(op) == "combine" and op.dialect_name() == "ve" and op.has_trait(Pure):
            op.detach()
            block.insert_op_before(op, loop)
        else:
            later.update(r for nested in op.walk() for r in nested.results)
        op = following


@dataclass
class _Layout:
    """A plan's loop before it is built: its ops, the results that leave it, its weight
    gathers, its F region and tiles, whether the tiles stay resident, and the SRAM its weight
    tiles hold (`held_weight_bytes`)."""

    ops: list[Operation]
    escaping: list[SSAValue]
    gathers: list[tcp.DmaGatherOp]
    region: FRegion | None
    tiles: list[tuple[int, int]]
    resident: bool
    held: int


@dataclass
class _Slot:
    """A weight load whose tile a block passes to the next (reuse): the gather it replaces and
    its F tile (None: the whole weight)."""

    gather: tcp.DmaGatherOp
    columns: tuple[int, int] | None
    type: Attribute
    rows: tuple[int, int] | None = None
    """The K piece (or N columns) of a whole weight loaded in pieces (`engine_pieces`), else None."""


def _block_is_last(last_block: SSAValue, index: SSAValue) -> tuple[tile.SliceOp, tile.GuardOp]:
    """The guard on whether block `index` is the last that runs (`last_block_table`), made
    both in a running block's body and in the branch of one that does not run."""
    at_last = tile.SliceOp(last_block, index, tile_type(last_block.type))
    is_last = tile.GuardOp(at_last.result)
    at_last.result.name_hint, is_last.result.name_hint = "if_last", "block_is_last"
    return at_last, is_last


def schedule_plan(block: Block, expert_ids: SSAValue, machine: Machine, sram_bytes: int = 0,
                  f_tile: int = 0, order: str = "block", group: int = 0) -> scf.ForOp | None:
    """Build the expert loop over `expert_ids`'s blocks in `block` for `machine`, its F tiles
    chosen for `sram_bytes` of SRAM (0: one cluster's), in `order` (`tile`: groups of `group`
    blocks, 0 as many as fit SRAM, passes/schedule/_expert_groups.py); the (first) loop, or
    None if nothing moves."""
    blocks = shape_of(expert_ids.type)[0]
    phase = plan_phase(block, expert_ids)
    sram = sram_bytes or machine.cluster_sram_bytes
    parallel = [op for op in block.ops if is_block_parallel(op, blocks, expert_ids, phase)
                and not gathered_source(op, expert_ids)]
    others = [v for v in expert_id_values(block) if v is not expert_ids and plan_phase(block, v) == phase]

    def addressable(v: SSAValue) -> bool:
        """A value made before the loop that a block's tile may address in place."""
        root = _root(v)
        return leading(v) == blocks and not in_hbm(v) and not (root is not None and phase_of(root) == "dispatch")

    def layout(ahead: list[tcp.DmaGatherOp]) -> _Layout | None:
        """The loop's ops, weight gathers and F tiles with the scales of `ahead` gathered
        before it; None if nothing moves."""
        candidates = [op for op in parallel if op not in ahead]
        if others:  # several plans of one phase (a mesh chip's chunks): only this plan's ops
            candidates = connected(candidates, [op for op in candidates if expert_ids in op.operands])
        ops = select_ops(block, candidates)
        escaping = escaping_results(ops)
        if not any(isinstance(op, CONTRACTIONS) for op in ops) or not escaping:
            return None
        gathers = [op for op in ops if isinstance(op, tcp.DmaGatherOp) and op.indices is expert_ids]
        region = find_f_region(ops, gathers, addressable)
        width, resident = (0, True) if region is None else choose_f_tile(region, gathers, sram, f_tile, machine)
        tiles = [] if region is None or width >= region.f else [
            (f0, min(region.f, f0 + width)) for f0 in range(0, region.f, width)]
        return _Layout(ops, escaping, gathers, region, tiles, resident,
                       held_weight_bytes(region, gathers, width, resident))

    ahead = scales_ahead(parallel)
    laid = layout(ahead)
    going = [] if laid is None else scales_fit(ahead, laid.held, sram, machine)
    if going != ahead:
        laid = layout(going)
    if laid is None:
        return None
    ops, escaping, gathers, region, tiles, resident = (laid.ops, laid.escaping, laid.gathers, laid.region,
                                                       laid.tiles, laid.resident)
    last = ops[-1]
    tiled_gathers = [g for g in gathers if tiles and region is not None and (g in region.tiled or g in region.down_loads)]
    skippable = all(read_by_combine(r, set(ops)) for r in escaping)
    dispatches = [op for op in ops if is_dispatch_gather(op, blocks)]
    if order == ORDER_TILE and phase == "experts" and skippable and dispatches and groupable(ops, region, gathers):
        assert region is not None
        plan = GroupPlan(ops, escaping, region, tiles or [(0, region.f)], resident, expert_ids, dispatches[0].indices,
                         last.attributes[PHASE_ATTR], shape_of(gathers[0].source.type)[0],
                         shape_of(dispatches[0].indices.type)[1], gathers, starts_from_dispatch(dispatches[0]))
        width = max(f1 - f0 for f0, f1 in plan.tiles)
        size = group or group_blocks(plan, width, sram)
        return build_group_loops(block, plan, min(size, blocks))[0]

    # Whole weights whose one command would leave DMA engines idle load in K (or N) pieces,
    # each reused as a whole weight is (passes/schedule/_k_pieces.py, `engine_pieces`).
    pieces: dict[tcp.DmaGatherOp, tuple[Operation, Pieces]] = {}
    for op in ops:
        rhs = op.rhs.owner if isinstance(op, tcp.ContractOp) else None
        if isinstance(rhs, tcp.DmaGatherOp) and rhs in gathers and rhs not in tiled_gathers:
            cut = engine_pieces(op, machine)
            if cut is not None:
                pieces[rhs] = (op, cut)
    slots: list[_Slot] = []
    for g in gathers:
        if g in pieces:
            op, cut = pieces[g]
            for rows in cut.bounds:
                window = piece_window(op, g.result, rows, cut.axis)
                slots.append(_Slot(g, None, TensorType(g.result.type.get_element_type(), [1, *window[1]]), rows))
        elif g not in tiled_gathers:
            slots.append(_Slot(g, None, tile_type(g.result.type)))
        elif resident:
            assert region is not None
            for columns in tiles:
                window = region.window(g.result, columns)
                slots.append(_Slot(g, columns, TensorType(g.result.type.get_element_type(), [1, *window[1]])))
    streamed = bool(tiles) and not resident

    # One token's row read in place: its results stay in SRAM too (the docstring), when its
    # weights are contracted as loaded: the loop then runs on one cluster (split-clusters), whose
    # vector engine alone could not keep up with weights it decodes (fp4 groups, trellis codes:
    # Qwen3-30B-A3B fp4_groups T = 1 took 42.0 -> 74.2 us on one cluster).
    in_place = [op for op in dispatches if skippable and not streamed and one_row(op)]
    contracted = all(contracted_as_loaded(g.result) for g in gathers)
    in_sram = bool(in_place) and contracted and all(results_in_sram(r) for r in escaping)

    before: list[Operation] = []
    c0 = arith.ConstantOp.from_int_and_width(0, IndexType())
    c_blocks = arith.ConstantOp.from_int_and_width(blocks, IndexType())
    c1 = arith.ConstantOp.from_int_and_width(1, IndexType())
    before += [c0, c_blocks, c1]
    buffers = [tile.BufferOp("sram" if in_sram else "hbm", r.type) for r in escaping]
    no_ids = ve.ConstOp(-1, TensorType(i32, [1]))
    no_tiles = [tile.BufferOp("sram", slot.type) for slot in slots]
    before += buffers + ([no_ids] if slots or streamed else []) + no_tiles
    for b, r in zip(buffers, escaping):
        b.result.name_hint = f"{r.name_hint or 'out'}_buffer"
    carried_init: list[SSAValue] = [b.result for b in buffers]
    carried_init += [no_ids.result for _ in slots] + [t.result for t in no_tiles]
    # The double-buffering waits carry the last contraction of the WEIGHT_AHEAD previous blocks
    # (the last reader of their loaded tiles); before the first block there is nothing to wait for.
    # Streamed F tiles also carry the previous block's last two down-projection tiles.
    last_contract = [op for op in ops if isinstance(op, CONTRACTIONS)][-1]
    nothing = ve.ConstOp(0.0, tile_type(last_contract.result.type))
    before.append(nothing)
    n_tile_waits = TILE_AHEAD if streamed else 0
    carried_init += [nothing.result] * (n_tile_waits + WEIGHT_AHEAD)
    # An expert's pairs in one block (G <= E: B holds every token the chip may route, decode on a
    # mesh receiver): the block is mostly padding, and only its rows that hold a pair go to HBM.
    experts = shape_of(gathers[0].source.type)[0] if gathers else 0
    padded = skippable and not in_sram and blocks <= experts
    # Streamed tiles: a block's results are stored by the next block that runs, after its weight
    # loads (the docstring); before the first nothing is pending (id -1, an unread HBM buffer). Not
    # where the blocks' contractions are bound by their weights' bytes (`weight_bound`: decode): their
    # stores are small and HBM-bound loads follow them anyway; deferred there, DeepSeek-V3 at T = 64,
    # B = 2 took 15,844,376 -> 16,191,177 cycles, and on 8 chips at 128 and 1 token a chip 2,124,406 ->
    # 2,137,670 and 562,588 -> 563,818 (test_mesh_decode).
    defer = streamed and skippable and not in_sram and not padded and not weight_bound(block, expert_ids, machine)
    pending_init: list[SSAValue] = []
    last_block: SSAValue | None = None
    if defer:
        none = [tile.BufferOp("hbm", tile_type(r.type)) for r in escaping]
        for n, r in zip(none, escaping):
            n.result.name_hint = f"{r.name_hint or 'out'}_none"
        table = last_block_table(expert_ids)
        before += [*none, *table]
        pending_init = [*(n.result for n in none), c0.result, no_ids.result]
        last_block = table[-1].results[0]
    carried_init += pending_init
    for op in before:
        op.attributes[PHASE_ATTR] = last.attributes[PHASE_ATTR]

    body = Block(arg_types=[IndexType(), *(v.type for v in carried_init)])
    index, *args = body.args
    index.name_hint = "block"
    n_buf, n_slots = len(buffers), len(slots)
    buffer_args = args[:n_buf]
    prev_ids_args = args[n_buf:n_buf + n_slots]
    prev_tile_args = args[n_buf + n_slots:n_buf + 2 * n_slots]
    tile_done_args = args[n_buf + 2 * n_slots:n_buf + 2 * n_slots + n_tile_waits]
    args, pending = args[:len(args) - len(pending_init)], args[len(args) - len(pending_init):]
    for p, r in zip(pending, escaping):
        p.name_hint = f"{r.name_hint or 'out'}_pending"
    if defer:
        pending[-2].name_hint, pending[-1].name_hint = "pending_block", "pending_expert"
    waits = args[len(args) - WEIGHT_AHEAD:]  # waits[i]: the last contraction of block g - 1 - i
    for i, w in enumerate(waits):
        w.name_hint = f"done_{i + 1}_ago"
    for i, w in enumerate(tile_done_args):
        w.name_hint = f"f_tile_done_{n_tile_waits - i}_ago"
    tile_wait, weight_wait = waits[ROWS_AHEAD - 1], waits[WEIGHT_AHEAD - 1]

    mapping: dict[SSAValue, SSAValue] = {}

    def add(op: Operation, name: str | None = None) -> SSAValue:
        op.attributes.setdefault(PHASE_ATTR, last.attributes[PHASE_ATTR])
        body.add_op(op)
        if name is not None:
            op.results[0].name_hint = name
        return op.results[0]

    ids_tile = add(tile.SliceOp(expert_ids, index, tile_type(expert_ids.type)), "expert_of_block")
    mapping[expert_ids] = ids_tile
    runs = add(tile.GuardOp(ids_tile), "block_runs") if skippable else None

    def tile_of(v: SSAValue) -> SSAValue:
        if v in mapping:
            return mapping[v]
        if leading(v) != blocks:
            return v  # the same for every block: a weight, a table, a splat
        name = f"{v.name_hint}_tile" if v.name_hint else None
        if in_hbm(v):
            mapping[v] = add(tile.LoadOp(v, index, tile_type(v.type), [tile_wait]), name)
        else:
            mapping[v] = add(tile.SliceOp(v, index, tile_type(v.type)), name)
        return mapping[v]

    slot_results: list[SSAValue | None] = [None] * n_slots
    # The loop starts from the dispatch (docstring): a weight load waits for the row indices too.
    dispatched = [op.indices for op in ops if is_dispatch_gather(op, blocks) and starts_from_dispatch(op)]

    def load(gather: tcp.DmaGatherOp, columns: tuple[int, int] | None, wait: SSAValue,
             rows: tuple[int, int] | None = None) -> Operation:
        """The load of the block's tile of `gather`'s weight (`columns` of F, or its K piece
        `rows`), reusing the previous block's when its slot is carried; not yet in the body."""
        k = next((i for i, s in enumerate(slots) if s.gather is gather and s.columns == columns and s.rows == rows),
                 None)
        prev = (prev_ids_args[k], prev_tile_args[k]) if k is not None else (None, None)
        window = None if columns is None or region is None else region.window(gather.result, columns)
        if rows is not None:
            window = piece_window(pieces[gather][0], gather.result, rows, pieces[gather][1].axis)
        new = tile.LoadExpertOp(gather.source, ids_tile, *prev, [wait, *dispatched], window)
        new.attributes.update(gather.attributes)
        new.location = gather.location
        new.attributes.setdefault(PHASE_ATTR, last.attributes[PHASE_ATTR])
        new.results[0].name_hint = gather.result.name_hint
        if k is not None:
            slot_results[k] = new.results[0]
        return new

    down_tiles: list[SSAValue] = []
    flushed = list(buffer_args)

    def flush() -> None:
        """The previous block's results (`pending`), stored now: after this block's weight loads."""
        *tiles_pending, block_pending, ids_pending = pending
        flushed[:] = [add(tile.StoreOp(t, buf, block_pending, ids_pending), f"{r.name_hint or 'out'}_flushed")
                      for t, buf, r in zip(tiles_pending, buffer_args, escaping)]

    def f_tiles() -> SSAValue:
        """Every F tile of the region: its loads, its column work, its share of the
        down-projection accumulated onto the previous tile's; the last tile's sum. Engines
        issue commands in program order, so streamed tiles place the loads of tile t + 1
        before the work of tile t (they wait, by `after`, for the down-projection of tile
        t - 1); resident tiles, mostly reused, are emitted as built, each load just before its first
        reader and before the block's row tiles, which wait for block g - ROWS_AHEAD (measured better:
        Qwen3-30B-A3B, T = 1024, one cluster, before the whole-chip merge: 1.40 M against
        1.47 M cycles)."""
        assert region is not None
        acc: SSAValue | None = None
        loads: list[list[Operation]] = []
        work: list[list[Operation]] = []
        for t, columns in enumerate(tiles):
            width = columns[1] - columns[0]
            if not streamed:
                wait = weight_wait
            else:
                wait = down_tiles[t - TILE_AHEAD] if t >= TILE_AHEAD else tile_done_args[t]
            local: dict[SSAValue, SSAValue] = {}
            loads.append([])
            work.append([])

            def operand(v: SSAValue, columns: tuple[int, int] = columns, width: int = width,
                        local: dict[SSAValue, SSAValue] = local) -> SSAValue:
                """The tile's `v`: made by the tile, a window of the block's rows of a value
                made before the loop (scales gathered ahead), or the block's `v`."""
                if v not in local and region is not None and v in region.outside:
                    window = add(tile.SliceOp(v, index, region.tile_type(v, width), region.window(v, columns)[0]),
                                 f"{v.name_hint}_tile" if v.name_hint else None)
                    local[v] = window
                return local[v] if v in local else tile_of(v)

            for op in region.tiled:
                if isinstance(op, tcp.DmaGatherOp):
                    loads[t].append(load(op, columns, wait))
                    if not streamed:
                        body.add_op(loads[t][-1])
                    local[op.result] = loads[t][-1].results[0]
                    continue
                new: Operation = type(op).create(
                    operands=[operand(v) for v in op.operands],
                    result_types=[region.tile_type(r, width) for r in op.results],
                    properties=dict(op.properties), attributes=dict(op.attributes), location=op.location)
                work[t].append(new)
                if not streamed:
                    body.add_op(new)
                for old, r in zip(op.results, new.results):
                    r.name_hint = old.name_hint
                    local[old] = r
            for gather in region.down_loads:
                loads[t].append(load(gather, columns, wait))
                if not streamed:
                    body.add_op(loads[t][-1])
                local[gather.result] = loads[t][-1].results[0]
            final = t == len(tiles) - 1
            new = down_tile(region, operand, acc, final)
            work[t].append(new)
            if not streamed:
                body.add_op(new)
            acc = new.results[0]
            down_tiles.append(acc)
        if streamed:
            body.add_ops(loads[0])
            for t in range(len(tiles)):
                body.add_ops(loads[t + 1] if t + 1 < len(tiles) else [])
                if defer and t == max(len(tiles) - 2, 0):  # the last tile's loads issued
                    flush()
                body.add_ops(work[t])
        assert acc is not None
        return acc

    def down_tile(region: FRegion, operand: Callable[[SSAValue], SSAValue], acc: SSAValue | None,
                  final: bool) -> Operation:
        """A tile's share of the down-projection, continuing `acc`; the bias with the last."""
        down = region.down
        bias = tile_of(down.bias) if final and down.bias is not None else None
        guard = None if down.guard is None else tile_of(down.guard)
        if isinstance(down, tcp.ScaledContractOp):
            new: Operation = tcp.ScaledContractOp(operand(down.lhs), operand(down.rhs), operand(down.lhs_scales),
                                                  operand(down.rhs_scales), bias=bias, guard=guard, acc=acc)
        else:
            new = tcp.ContractOp(down.spec.data, operand(down.lhs), operand(down.rhs), tile_type(down.result.type),
                                 bias=bias, guard=guard, acc=acc)
        new.attributes.update(down.attributes)
        new.location = down.location
        new.results[0].name_hint = down.result.name_hint
        return new

    deferred: set[Operation] = set()
    if tiles and region is not None:
        deferred = (set(region.tiled) - set(region.shared)) | {region.down, *region.down_loads}
    for op in in_place:  # a block that runs holds the one token's row: its row -> token index is 0
        mapping[op.indices] = add(ve.ConstOp(0, tile_type(op.indices.type)), "the_token")
    for op in ops:
        if op in deferred:
            if region is not None and op is region.down:
                mapping[op.result] = f_tiles()
            continue
        if op in in_place:  # docstring
            rows = tcp.ViewOp(sram_copy(block, op.source), shape_of(tile_type(op.result.type)))
            mapping[op.result] = add(rows, f"{op.result.name_hint}_tile" if op.result.name_hint else None)
            continue
        if is_dispatch_gather(op, blocks):  # the block's rows, fetched like a row tile
            rows = tile.GatherOp(op.source, tile_of(op.indices), [tile_wait])
            rows.attributes.update(op.attributes)
            rows.location = op.location
            mapping[op.result] = add(rows, f"{op.result.name_hint}_tile" if op.result.name_hint else None)
            continue
        if isinstance(op, tcp.DmaGatherOp) and op in pieces:
            mapping[op.result] = op.result  # read by its contraction, in pieces (below)
            continue
        if isinstance(op, tcp.DmaGatherOp):
            mapping[op.result] = add(load(op, None, weight_wait))
            continue
        cut = pieces.get(op.rhs.owner) if isinstance(op, tcp.ContractOp) else None  # type: ignore[arg-type]
        if cut is not None and cut[0] is op:
            assert isinstance(op.rhs.owner, tcp.DmaGatherOp)
            bounds, axis = cut[1].bounds, cut[1].axis
            weights = [add(load(op.rhs.owner, None, weight_wait, rows)) for rows in bounds]
            made = (contract_pieces(op, weights, list(bounds), tile_of) if axis == K_AXIS
                    else column_pieces(op, weights, bounds, tile_of))
            for new in made:
                add(new)
            mapping[op.result] = made[-1].results[0]
            continue
        new = clone_rows(op, [tile_of(v) for v in op.operands], 1)
        body.add_op(new)
        mapping.update(zip(op.results, new.results))

    rows = next((tile_of(op.indices) for op in dispatches), None) if padded else None
    written = None if rows is None else add(tcp.ViewOp(rows, [shape_of(rows.type)[-1]]), "row_written")
    if defer:  # the last block stores its own results too, as no block follows
        assert last_block is not None
        at_last, last_guard = _block_is_last(last_block, index)
        add(at_last)
        is_last = add(last_guard)
        own = [tile.StoreOp(mapping[r], buf, index) for r, buf in zip(escaping, flushed)]
        stored = list(add_if(body, is_last, own, flushed, last.attributes[PHASE_ATTR]).results)
        carried_out = [*(mapping[r] for r in escaping), index, ids_tile]
    else:
        stored = [add(tile.StoreOp(mapping[r], buf, index,
                                   written if written is not None and tile.guards_rows(mapping[r].type, written.type)
                                   else None),
                      f"{r.name_hint}_stored" if r.name_hint else None)
                  for r, buf in zip(escaping, buffer_args)]
        carried_out = []
    done = mapping[last_contract.result]
    assert all(r is not None for r in slot_results)
    body.add_op(scf.YieldOp(*stored, *(ids_tile for _ in slots), *slot_results, *down_tiles[len(down_tiles) - n_tile_waits:],
                            done, *waits[:-1], *carried_out))
    if runs is not None:
        branch = skip_unless(body, runs)
        branch.attributes[PHASE_ATTR] = last.attributes[PHASE_ATTR]
        if defer:  # a block that does not run flushes what is pending if it is the last
            assert last_block is not None
            otherwise, carried = reopen_otherwise(branch)
            *tiles_pending, block_pending, ids_pending = pending
            at_last, is_last = _block_is_last(last_block, index)
            otherwise.add_ops([at_last, is_last])
            last_flush = [tile.StoreOp(t, buf, block_pending, ids_pending) for t, buf in zip(tiles_pending, buffer_args)]
            carried[:n_buf] = list(add_if(otherwise, is_last.result, last_flush, list(buffer_args),
                                          last.attributes[PHASE_ATTR]).results)
            for op in otherwise.ops:
                op.attributes.setdefault(PHASE_ATTR, last.attributes[PHASE_ATTR])
            otherwise.add_op(scf.YieldOp(*carried))

    # One token's last block: a loop of its own, its weights loaded in K pieces (the docstring).
    peel = in_sram and blocks > 1 and bool(last_block_cuts(body, machine))
    c_last = index_constant(blocks - 1)
    loop = scf.ForOp(c0, c_last if peel else c_blocks, c1, carried_init, body)
    loops = [loop]
    if peel:
        before.append(c_last)
        loops.append(scf.ForOp(c_last, c_blocks, c1, list(loop.results), loop.body.clone()))
        cut_last_block(loops[-1].body.block, machine)
    for op in [c_last, *loops]:
        op.attributes[PHASE_ATTR] = last.attributes[PHASE_ATTR]
    replace_by_loop(block, ops, escaping, list(loops[-1].results[:n_buf]), [*before, *loops])
    for op in in_place:
        erase_unread(op.indices)
    for stored in loops[-1].results[:n_buf]:
        if in_sram:
            for gather in combine_gathers(stored):
                gather_on_vector_engine(gather)
            continue
        # Stored in HBM a block at a time: a reader on an engine that computes (a shared
        # expert's rows added to the routed ones) reads it from SRAM, loaded once after the loop
        # (a tile at a time, where a token loop of schedule-tokens is what reads it).
        load_into_sram(stored)
    if in_sram:
        combine_ahead(loop)
    return loop


def last_block_table(expert_ids: SSAValue) -> list[Operation]:
    """The ops of a table `[G]` i32, 0 at the loop's last block and -1 elsewhere (its last op's
    result), for a `tile.guard` of its slice: the blocks numbered by an iota plus the ids and 0,
    so that split-clusters makes each cluster its own from its own ids (`derived`)."""
    t = expert_ids.type
    zero = ve.ConstOp(0, t)  # type: ignore[arg-type]
    zeros = ve.AndOp(expert_ids, zero.result)
    iota = ve.IotaOp(t, 0)  # type: ignore[arg-type]
    number = ve.AddOp(iota.result, zeros.result)
    final = ve.ConstOp(shape_of(t)[0] - 1, t)  # type: ignore[arg-type]
    last = ve.TagOp("eq", number.result, final.result)
    off = ve.ConstOp(-1, t)  # type: ignore[arg-type]
    table = ve.SelectOp(last.result, [1], zero.result, off.result)
    table.result.name_hint = "zero_if_last"
    return [zero, zeros, iota, number, final, last, off, table]


def add_if(block: Block, condition: SSAValue, stores: list[tile.StoreOp], otherwise: list[SSAValue],
           phase: Attribute) -> scf.IfOp:
    """`stores` in an `scf.if %condition` at the end of `block`, yielding their results, else
    `otherwise` (the buffers as they were)."""
    for op in stores:
        op.attributes[PHASE_ATTR] = phase
    branch = scf.IfOp(condition, [v.type for v in otherwise], [Block([*stores, scf.YieldOp(*(o.result for o in stores))])],
                      [Block([scf.YieldOp(*otherwise)])])
    branch.attributes[PHASE_ATTR] = phase
    block.add_op(branch)
    return branch


def plan_phase(block: Block, expert_ids: SSAValue) -> str:
    """The phase of the plan `expert_ids` guards: `experts` for a routing's, `shared` for a
    shared expert's (passes/schedule/schedule_shared.py). A plan's loop absorbs the ops of its phase."""
    for op in block.ops:
        if isinstance(op, CONTRACTIONS) and op.guard is expert_ids:
            return phase_of(op) or "experts"
    return "experts"


def expert_id_values(block: Block) -> list[SSAValue]:
    """The plans of a function body: the guards of its block contractions, in order."""
    found: list[SSAValue] = []
    for op in block.ops:
        if isinstance(op, CONTRACTIONS) and op.guard is not None and op.guard not in found:
            found.append(op.guard)
    return found


def spread_through_routed(block: Block, expert_ids: SSAValue, plans: list[SSAValue], machine: Machine) -> bool:
    """Whether `expert_ids`' plan is a shared expert's that interleave-shared will spread through
    the routed loop (passes/schedule/interleave_shared.py): its F tiles are then chosen for half
    the SRAM, the routed loop's tiles being in SRAM at the same time."""
    if plan_phase(block, expert_ids) != SHARED:
        return False
    routed = [op for op in block.ops if isinstance(op, CONTRACTIONS) and op.guard in plans
              and plan_phase(block, op.guard) == "experts"]
    return bool(routed) and spreads(shape_of(expert_ids.type)[0], routed[0], machine)


def loads_before_routed(block: Block, expert_ids: SSAValue) -> bool:
    """Whether `expert_ids`' plan is a mesh chip's shared expert at decode (one row block):
    schedule-shared puts it under the dispatch's all-to-alls, after the router, and its weights
    load while the router computes and the link moves the tokens, before any routed weight
    (those wait for the routing). Its F tiles are then chosen for the whole SRAM of a cluster
    rather than half: the two in flight hold the whole expert (DeepSeek-V3: two tiles of 1,024
    columns, 88 MB), all loaded under the router, where with tiles of 512 the last two waited
    for the first ones' contractions and then delayed the routed weight stream (8 chips, 128
    tokens each, a2a, B = 32: 2,227.5 -> 2,209.4 us). On one chip the same tiles are not
    better at every T (DeepSeek-V3 at T = 128, B = 1: 16,013.8 -> 16,155.7 us)."""
    return (plan_phase(block, expert_ids) == SHARED and shape_of(expert_ids.type)[0] == 1
            and ccl.first_all_to_all_done(block) is not None)


def streams_on_mesh(block: Block, expert_ids: SSAValue, machine: Machine) -> bool:
    """Whether `expert_ids`' plan is a mesh chip's routed experts at decode: its blocks'
    contractions do fewer FLOPs per weight byte than `own_dma_intensity` (the loop streams its
    weights at HBM's bandwidth, a few rows a block). Its F tiles are then chosen for the whole
    SRAM of a cluster rather than half, as the shared expert's are (`loads_before_routed`): the
    rows take little of it, and each weight command moves twice the bytes for the start-ups of
    its parts, which otherwise leave HBM idle one part's start-up in ten (DeepSeek-V3, two tiles
    of 1,024 columns rather than four of 512; 8 chips, 128 tokens each, a2a, B = 32,
    topk=rounds: 2,207.3 -> 2,158.6 us). A compute-bound block keeps the half (DeepSeek-V3,
    skewed, B = 128: 2,451.1 us, 2,459.8 with the whole cluster); on one chip the loop's
    results and the router's tiles share the cluster."""
    if plan_phase(block, expert_ids) != "experts" or ccl.first_all_to_all_done(block) is None:
        return False
    return weight_bound(block, expert_ids, machine)


def weight_bound(block: Block, expert_ids: SSAValue, machine: Machine) -> bool:
    """Whether `expert_ids`' blocks' contractions do fewer FLOPs per weight byte than
    `own_dma_intensity`: the loop streams its weights at HBM's bandwidth (decode, a few rows a block)."""
    contractions = [op for op in block.ops if isinstance(op, CONTRACTIONS) and op.guard is expert_ids]
    return bool(contractions) and all(contraction_flops_per_weight_byte(op) < own_dma_intensity(machine)
                                      for op in contractions)


@dataclass(frozen=True)
class ScheduleExpertsPass(ModulePass):
    """Expert work -> static loops over the blocks (the module docstring says how)."""

    name = "schedule-experts"

    sram_bytes: int = 0
    """The SRAM the F tile is chosen for (0, the default: one cluster's of the module's target,
    target/target_spec.py)."""
    f_tile: int = 0
    """The F tile when positive (a multiple of 512 keeps it exact), chosen from `sram_bytes`
    when 0."""
    order: str = ORDER_BLOCK
    """The expert loop's order: `block` (one block at a time), `tile` (groups of blocks, each
    weight tile loaded once per expert of a group: passes/schedule/_expert_groups.py), or
    `auto`, which the driver resolves by the cost model (tcpc/autotune.py)."""
    group: int = 0
    """Blocks per group in `tile` order when positive; 0: as many as fit the SRAM."""

    def __post_init__(self) -> None:
        check_choice(self.name, "order", self.order, ORDERS)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        refuse_auto(self.name, "order", self.order, ORDERS)
        machine = machine_of(op)
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks:
                body = fn.body.block
                plans = expert_id_values(body)
                for expert_ids in plans:
                    sram = self.sram_bytes or machine.cluster_sram_bytes
                    if spread_through_routed(body, expert_ids, plans, machine):
                        sram //= 2  # its weight tiles share SRAM with the routed loop's
                    elif loads_before_routed(body, expert_ids) or streams_on_mesh(body, expert_ids, machine):
                        sram *= WEIGHT_SHARE  # the weights' share is the whole cluster's
                    schedule_plan(body, expert_ids, machine, sram, self.f_tile, self.order, self.group)
