"""`schedule-tokens`: token-tile loops of the schedule level, for the router and the combine.

The router's work after its matmul (softmax or sigmoid, the bit-packed top-k ranking, whose
[T, E, E] tensors are 268 MB at T = 4096, E = 128, the routing weights) and the combine (the
gather of each token's K rows, the weighted sum) are row-parallel along the tokens: row t of
every result depends on row t of the operands alone. This pass puts each phase's row-parallel
ops into a static loop over tiles of `rows` tokens, `scf.for %row = 0 to T_main step rows`,
plus one straight-line copy of the body for the remaining T - T_main tokens when the tile does
not divide T, so the largest intermediate is a tile's, sized to fit `tile_bytes` of SRAM.

- Inputs with T rows made outside the loop are addressed a tile at a time in SRAM
  (`tile.slice`), or, when one is a whole copy of an HBM value that only the loop reads (a
  `tcp.load`: the tokens before the f32 router's widening, a shared expert's rows), loaded a
  tile at a time from HBM (`tile.load`) and the whole copy dropped (`loaded_whole`);
  everything else (a gather's source rows in HBM, tables, splats) is used whole.
- A DMA gather placed in HBM (shard-experts' buffers only DMA and the link touch: a2a's split
  pairs to return) stays out of the loops: its DMA commands write its rows straight to HBM,
  where a tile loop would gather into SRAM and store every tile whole, the worst-case buffer's
  padding included (DeepSeek-V3 on 8 chips at 128 tokens each: 117 MB, 82 us).
- Results used after the loop are written a tile at a time into SRAM buffers (`tile.buffer`,
  `tile.store`: the producing engine commits each tile at its place), or into HBM ones when
  the function returns them or they are larger than a cluster's SRAM (`goes_to_hbm`); a
  chunk's home sum, which shard-experts' `tile.store` puts into the layer's output in HBM,
  straight into the output past the chunk's offset (`output_store`).
- The combine's loop also takes the row-parallel ops that follow it, the layer's tail (a
  shared expert's rows added to the routed ones, casts of the result): the layer's output is
  made a tile at a time (`loop_phase`).
- The tile height: the largest number of rows whose intermediates (every result of the body,
  as if none were freed, and the tiles it loads) fit `tile_bytes` and, beside the SRAM buffers
  the loop stores into, one cluster's SRAM; rounded down to a multiple of 8 (one flit of 32-bit
  values per slice lane) when at least 8, and at most T. Ops that fit whole but gather more
  than one DMA piece of rows from HBM (the combine at decode) take a tile per DMA engine
  instead (`spread_rows`), so that the tiles' gathers run on every engine; so does a chunk's
  home sum at most (`engine_rows`: after the last return it has nothing else to run under).
- A chunk's home sum made whole (decode) and stored into the output branches on whether any of
  its split pairs came back: without one its rows are the receivers' sums, which one
  `tile.gather_into` writes from the return's buffer into the output (`whole_sums_into_output`).
- The function's results end in HBM (`store_results`): one the loops did not store there is
  stored by a `tcp.store` before the return.
- A mesh receiver's combine (a2a, a2a_sum) skips a tile none of whose rows holds a pair
  (`empty_tile_indices`), a2a's gather of split pairs a sender's slice none of whose tokens
  split, and a2a's home chip the gather and sum of a tile's returned split pairs when it
  holds none (`guarded_pair_sum`); where a tile would span several senders' slices, it runs over the
  received rows packed first (`pack_received`), in tiles of one flit's rows (at most a
  slice's; fewer where their gather moves more than a DMA start-up's worth, `start_up_rows`),
  its sums sent back packed (`ccl.all_to_all_start ... {packed}`), or scattered back to their
  rows where something else reads them.

The router's matmul joins its loop when its tiles give a second cluster a share (`shared_from`:
an f32 one from more than one tile of GRID_M rows, a bf16 one from a tile per cluster; with
fewer tokens, when the cycles the second cluster's share saves outweigh what its tile adds,
the matmul's weight copied to it above all, `sharing_pays`; `is_row_contraction`). Its tiles may be cut at any row: every
tile product of `numerics.contract` holds GRID_M rows, so a row's bits do not depend on the
rows beside it. Other contractions stay outside. When the rest of the phase holds its tiles
to fewer rows than the matmul's own ops allow (still fewer than T) and the matmul's mapping is
cheaper in those larger tiles (`contraction_cycles`), the matmul and the ops it reads through
get a loop of their own first (`contraction_head`), its logits crossing to the rest in an SRAM
buffer; that loop loads its tokens a tile at a time from HBM even when the whole SRAM copy
stays for another reader (`loaded_whole`'s `reload`; the copy's load then moves to that
reader, `_sink_copy`). Every other op's row-tiled form computes the same numbers in the same
order, so the pass is bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import DictionaryAttr, IndexType, IntegerAttr, ModuleOp, StringAttr, TensorType, UnitAttr
from xdsl.ir import Block, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import ccl, tcp, tile, ve
from dialects.annotations import OTHER, PHASE_ATTR, SHARED, is_pair_sum, phase_of, placed_in_hbm
from dialects.tensor_types import shape_of, stored_bytes
from passes.schedule._cluster_copies import DMA_OPS
from passes.schedule._cluster_token_tiles import hbm_copied, worth_splitting
from passes.schedule._received_rows import back_source, pack_received, returning_all_to_all
from passes._loop_builder import (clone_rows, connected, escaping_results, in_hbm, index_constant, is_row_parallel_ve, leading,
                                 load_chain, replace_by_loop, select_ops, sink_to_first_reader, skip_unless,
                                 split_shared_constants, tile_type)
from runtime_sim.semantics.numerics import GRID_M
from target.contraction_mapping import ContractionShape, choose
from target.target_spec import machine_of

ROW_MATMUL = "mk,kn->mn"
TILED_PHASES = ("router", "combine")
TAIL_AFTER = ("combine", SHARED)
"""Phases whose results only the layer's tail reads: the combine's rows and a shared expert's."""
RECEIVING_STRATEGIES = ("a2a", "a2a_sum")
"""shard-experts' strategies whose chips receive into static worst-case buffers."""

TILE_SHARE = 8
"""A token tile's intermediates may take 1 / TILE_SHARE of the chip's SRAM (RNGD: 32 MB of
256 MB; the expert loop's tiles and weights, at most a cluster's half, and the routing tensors
live at the same time). A compiler choice, not a machine number; `schedule-tokens{tile_bytes=...}`
overrides it. Every tile iteration pays its commands' fixed costs, so fewer, larger tiles are
faster: Qwen3-30B-A3B's router at T = 4096 takes 698,547 cycles in 8 MB tiles and 337,124 in
32 MB ones (benchmarks/schedule.py)."""


def is_row_parallel(op: Operation, tokens: int) -> bool:
    if isinstance(op, tcp.ContractOp):
        return is_row_contraction(op, tokens)
    if isinstance(op, tcp.DmaGatherOp):
        return leading(op.indices) == tokens and leading(op.result) == tokens and not placed_in_hbm(op)
    if isinstance(op, tcp.ViewOp):
        return is_row_view(op, tokens)
    return is_row_parallel_ve(op, tokens)


def is_row_contraction(op: tcp.ContractOp, tokens: int) -> bool:
    """A matmul whose lhs rows are the tokens and whose rhs is not (the router's logits, x @
    W): row t of the result is row t of lhs times the whole rhs, with the same bits however
    the rows are cut (`numerics.contract`: every tile product holds GRID_M rows). It joins a
    loop only from `shared_from` tokens, or fewer where `sharing_pays`: the gain is the
    clusters sharing it (DeepSeek-V3's f32 router at T = 4096: over a million cycles on its
    bf16 pieces, half on each of two); with fewer, a bf16 one's tiles cost more in start-ups
    and copies than they share (Qwen3-30B-A3B's at T = 200: 765 cycles more)."""
    return (op.spec.data == ROW_MATMUL and op.guard is None and op.acc is None
            and leading(op.lhs) == tokens and leading(op.result) == tokens)


def shared_from(contractions: list[tcp.ContractOp], clusters: int) -> int:
    """The tokens from which a token loop takes `contractions` in: more than one GRID_M tile
    when one runs on the vector engine's fma (an f32 operand, `ContractionShape.vector`: 1.6%
    of the MACs, so a second cluster's share pays for its copies at once; issue #12's
    Mixtral-style layer, benchmarks/monotone.py, took 6% fewer cycles at T = 256 than at 248
    when this waited for two tiles), else a whole tile per cluster."""
    vector = any(ContractionShape.of(op.roles()).vector for op in contractions)
    return GRID_M + 1 if vector else clusters * GRID_M


def sharing_pays(contractions: list[tcp.ContractOp], tokens: int, rows: int, clusters: int, crossings: int) -> bool:
    """Whether `contractions` join a token loop of fewer than `shared_from` tokens, its tiles
    of at most `rows` balanced over the `clusters` (`balanced_rows`): when the mapping level's
    cycles they save against the whole contraction on one cluster (`contraction_cycles`)
    outweigh what another cluster's tile adds. Its copy of their whole operands (the rhs, a
    bias: a DM -> DM copy reading and writing in turn on the chip's DMA engines after a
    start-up, docs/hardware.md#moving-data) counts twice: the tile waits for it, and it holds
    the engines the weights' loads need, which decide a decode layer's time; and a DMA start-up
    for each of the tile's `crossings` (its tokens' load, each result copied back). DeepSeek-V3's
    f32 router at 128 tokens a chip, on nine bf16 piece pairs: 67,200 cycles whole on one
    cluster, 34,744 in a 64-row tile on each, against 2 x 7,668 + 3 x 500 (ep=8, a2a: 2,147.7 ->
    2,133.6 us); on the widened tokens' one piece (three pairs) 24,192 against 13,072: whole. Measured where it
    does not pay (ep=8, F = 2,048, cost-only): D = 512, E = 256, 128 a chip, 2,320 saved against
    3,524, 185.8 -> 186.3 us joined; D = 7,168, E = 256, 32 a chip, 16,210 against 16,836,
    2,062.5 -> 2,069.8 us."""
    if clusters < 2 or tokens < 8 * clusters:
        return False
    machine = machine_of(contractions[0])
    even = balanced_rows(tokens, rows, clusters, row_granule(contractions))
    saved = (contraction_cycles(contractions, tokens, tokens, 1)
             - contraction_cycles(contractions, even, tokens, clusters))
    copied = sum(stored_bytes(v.type) for op in contractions for v in row_operands(op) if not in_hbm(v))
    copy = machine.dma_startup_cycles + math.ceil(2 * copied / (machine.dma_engines * machine.dma_bytes_per_cycle))
    return saved > (clusters - 1) * (2 * copy + crossings * machine.dma_startup_cycles)


def row_operands(op: Operation) -> set[SSAValue]:
    """The operands of a token-loop op read whole, not a tile at a time, whatever their rows: a
    gather's source (its indices name rows of all of it), a contraction's rhs and bias."""
    if isinstance(op, tcp.DmaGatherOp):
        return {op.source}
    if isinstance(op, tcp.ContractOp):
        return {v for v in (op.rhs, op.bias) if v is not None}
    return set()


def is_row_view(op: tcp.ViewOp, tokens: int) -> bool:
    """A view that keeps the T rows and reshapes within a row (DeepSeek-V3's [T, E] scores seen
    as [T, groups, E / groups], a [T] sum as [T, 1]): a tile of it is the same view of the
    input's tile. A view read whole as a gather's source stays outside."""
    if leading(op.input) != tokens or leading(op.result) != tokens:
        return False
    return not any(isinstance(u.operation, tcp.DmaGatherOp) and u.operation.source is op.result for u in op.result.uses)


def layer_tail(block: Block, nested_reads: dict[Operation, tuple[Operation, ...]] | None = None) -> set[Operation]:
    """The ops of `block` that read, directly or not, the combine's or a shared expert's
    results: the layer's tail (their sum, casts of the result), whatever phase lower-math gave
    them by data flow (on a mesh chip the combine is math ops whose inputs reach back to the
    router's weights, so the tail is labelled `router`). `nested_reads` keeps, across calls,
    the ops whose results the ops inside an op with regions read (a loop schedule-tokens built
    is not changed after: walking every loop again at every phase was 7% of a mesh candidate)."""
    cache: dict[Operation, tuple[Operation, ...]] = {} if nested_reads is None else nested_reads
    tail: set[Operation] = set()
    for op in block.ops:
        if op.regions:
            if op not in cache:
                cache[op] = tuple(o for nested in op.walk() for v in nested.operands
                                  if isinstance(o := v.owner, Operation))
            reads = cache[op]
        else:
            reads = tuple(o for v in op.operands if isinstance(o := v.owner, Operation))
        if any(o in tail or phase_of(o) in TAIL_AFTER for o in reads):
            tail.add(op)
    return tail


def loop_phase(op: Operation, tail: set[Operation]) -> str:
    """The tiled phase whose loop may take `op`: the combine's takes the layer's tail too (the
    output is then made a tile at a time and written to HBM as it is, never whole in SRAM:
    DeepSeek-V3 at T = 4096 made its [T, D] sum whole, the routed rows, the shared rows loaded
    whole and the f32 sum, 235 MB on cluster 0), the router's takes the rest of its phase."""
    phase = phase_of(op) or OTHER
    return "combine" if phase == OTHER or (op in tail and phase != "combine") else phase


def tile_rows(ops: list[Operation], tokens: int, tile_bytes: int, reload: bool = False) -> int:
    """Rows whose intermediates take at most `tile_bytes`: every result of `ops` (a view is no
    new data) and every input the tile loads from HBM (`loaded_whole`)."""
    inside = set(ops)
    loaded = {v for op in ops for v in op.operands
              if v.owner not in inside and leading(v) == tokens and loaded_whole(v, inside, reload) is not None}
    per_row = sum(math.prod(tile_type(r.type).get_shape()) * _element_bytes(r.type)
                  for r in [*(r for op in ops if not isinstance(op, tcp.ViewOp) for r in op.results), *loaded])
    rows = max(1, min(tokens, tile_bytes // max(1, per_row)))
    granule = row_granule(ops)
    return rows - rows % granule if rows >= granule else rows


def row_granule(ops: list[Operation]) -> int:
    """The multiple a token tile's rows are rounded down to: GRID_M with a contraction inside,
    else 8 (one flit of 32-bit values per slice lane). Not for the contraction's bits (any rows
    give them: `is_row_contraction`) but to keep the whole grid tiles every prefill router was
    measured in; a tile fewer than GRID_M rows, two 64-row tiles of a 128-token router on two
    clusters, is not rounded (`balanced_rows`)."""
    return GRID_M if any(isinstance(op, tcp.ContractOp) for op in ops) else 8


def _element_bytes(t: object) -> int:
    assert isinstance(t, TensorType)
    width = getattr(t.get_element_type(), "bitwidth", 32)
    return max(1, width // 8)


def _clone_rows(ops: list[Operation], rows: int, offset: SSAValue, tokens: int, add,
                mapping: dict[SSAValue, SSAValue], rows_in_hbm: Callable[[SSAValue], SSAValue | None]) -> None:
    """Append `ops` working on `rows` tokens from `offset` (outside inputs sliced on demand, or
    loaded from HBM where `rows_in_hbm` gives their rows there)."""

    def tile_of(v: SSAValue) -> SSAValue:
        if v not in mapping:
            if leading(v) != tokens:
                return v
            source = rows_in_hbm(v)
            named = v if source is None else source
            name = f"{named.name_hint}_tile" if named.name_hint else None
            shape = tile_type(v.type, rows)
            mapping[v] = add(tile.SliceOp(v, offset, shape) if source is None else tile.LoadOp(source, offset, shape), name)
        return mapping[v]

    for op in ops:
        whole = row_operands(op)
        new = clone_rows(op, [v if v in whole else tile_of(v) for v in op.operands], rows)
        add(new)
        mapping.update(zip(op.results, new.results))


MIN_SPLIT_VECTOR_BYTES = 8 << 20
"""The vector bytes from which a phase that fits SRAM whole is still cut into a tile per
cluster (a rule of thumb, not a cost: a cluster's vector engine makes about 8 KB per cycle,
256 slices x 32 B, so half of 8 MB is about the ~500-cycle start-up of the copies between
the clusters that the second tile needs)."""


def balanced_rows(tokens: int, rows: int, clusters: int, granule: int = 8) -> int:
    """Tile rows for a loop whose tiles take turns on `clusters` clusters: as many tiles as
    `rows` needs, rounded up to a multiple of the clusters, the rows shared evenly (a multiple
    of `granule`, `row_granule`), so that no cluster gets a remainder's scraps while the other
    runs a whole tile."""
    tiles = -(-tokens // rows)
    tiles = -(-tiles // clusters) * clusters
    even = -(-tokens // tiles)
    return min(rows, -(-even // granule) * granule if even >= granule else even)


def chunk_trips(rows: int, clusters: int, chunk: int, granule: int) -> int:
    """A chunked chip's router tile rows, `rows` or fewer, so that its first trips (`clusters`
    tiles each) end where the first chunk does: interleave-chunks dispatches a chunk after the
    trips that make its rows, and the router's rows past its end in them delayed it. Left alone
    when those rows are under a quarter of a chunk (small tiles, or trips of whole chunks).
    Qwen3-30B-A3B, 4,096 tokens a chip, 1,536-row trips: on 2 chips (2 chunks of 2,048) the
    first dispatch waited for all of the router's 3 trips, on 4 (chunks of 1,024) for one
    holding half of chunk 1."""
    trip = clusters * rows
    past = -(-chunk // trip) * trip % chunk
    aligned = chunk // clusters // -(-chunk // trip) // granule * granule
    return aligned if 4 * past >= chunk and aligned else rows


def schedule_phase(block: Block, phase: str, tokens: int, tile_bytes: int, whole: set[Operation],
                   clusters: int = 1, nested_reads: dict[Operation, tuple[Operation, ...]] | None = None,
                   made: set[Operation] | None = None) -> bool:
    """One token-tile loop over the row-parallel ops of `phase` not in `whole` that a loop can
    take together; when they fit SRAM whole, they join `whole` instead (and the ops a
    contraction kept apart from them get their own turn: DeepSeek-V3's router after its
    matmul, when the input's widening before it fits). False when no such op is left.

    `made` keeps, across calls, the ops a loop was given before it (its tiles' largest
    indices): they belong to that loop, and another count's loop whose tiles they happen to
    match (a receiver's 16 tiles of 8 rows on a chip of 16 tokens) must not take them, which
    made the receiver's sums wait for the home's pair sum, behind the return of split pairs
    (DeepSeek-V3 ep=8, 16 tokens a chip, skewed routing).

    With `clusters` > 1 the tiles are balanced over the clusters (`balanced_rows`) when a tile
    is worth running on another cluster (split-clusters' rule, `worth_splitting`), and a phase
    that fits whole but makes at least MIN_SPLIT_VECTOR_BYTES is cut into a tile per cluster:
    without it, a router that just fits whole ran on one cluster, and one just too large for
    that ran on two, faster (benchmarks/monotone.py: T = 360 took more cycles than T = 368)."""
    tail = layer_tail(block, nested_reads)
    made = set() if made is None else made
    candidates = [op for op in block.ops
                  if loop_phase(op, tail) == phase and is_row_parallel(op, tokens) and op not in whole
                  and op not in made]
    fn = block.parent_op()
    if candidates and isinstance(fn, func.FuncOp) and ccl.CHUNKS_ATTR in fn.attributes:
        candidates = connected(candidates, candidates[:1])  # one chunk's ops, a loop of their own
    chosen = select_ops(block, candidates)
    if not chosen:
        return False
    if not escaping_results(chosen):
        whole.update(chosen)
        return True
    ops = split_shared_constants(chosen)
    escaping = escaping_results(ops)
    # A tile's intermediates fit beside the SRAM buffers its results go to, in the one cluster
    # whose engines run it (DeepSeek-V3's f32 tokens for its router, 117 MB at T = 4096); when
    # those buffers alone exceed it, no tile size helps, and the memory plan spills.
    room = machine_of(chosen[0]).cluster_sram_bytes - sum(stored_bytes(r.type) for r in escaping if not goes_to_hbm(r))
    budget = min(tile_bytes, room) if room > 0 else tile_bytes
    rows = tile_rows(ops, tokens, budget)
    contractions = [op for op in ops if isinstance(op, tcp.ContractOp)]
    few = bool(contractions) and tokens < shared_from(contractions, clusters)
    if contractions and (rows < min(tokens, GRID_M)
                         or (few and not sharing_pays(contractions, tokens, rows, clusters, 1 + len(escaping)))):
        # tiles of fewer rows than a grid tile, each fetching the whole rhs again (the combine's
        # 16-row tiles would take a shared expert's matmuls), or too few to share it out
        whole.update(contractions)
        return True
    if not escaping:
        whole.update(ops)
        return True
    chunks = fn.attributes.get(ccl.CHUNKS_ATTR) if isinstance(fn, func.FuncOp) else None
    if phase == "router" and isinstance(chunks, IntegerAttr) and rows < tokens:
        # A chunked chip's first dispatch waits for the router's first tiles: a chunk's rows a
        # tile, where the router is tiled at all (Qwen3-30B-A3B ep=8, 8 chunks of 512: 1,024-row
        # tiles on each cluster made the first chunk's tokens leave 9 us later).
        rows = min(rows, max(row_granule(ops), tokens // chunks.value.data))
    if rows < tokens and any(last_output_store(r) for r in escaping):
        # The last chunk's home sum, after the last return with nothing to run under: a tile per
        # DMA engine at most, each tile's gather of the chips' rows on an engine of its own
        # (Qwen3-30B-A3B ep=4, 4,096 tokens a chip: 4 tiles of 256 rows took 8.7 us to gather).
        rows = min(rows, engine_rows(ops, tokens))
    rows, spread = cluster_rows(ops, escaping, rows, tokens, phase, clusters, shares=few)
    if phase == "router" and isinstance(chunks, IntegerAttr) and rows < tokens:
        rows = chunk_trips(rows, clusters if spread else 1, tokens // chunks.value.data, row_granule(ops))
    reload = False
    head = contraction_head(ops, contractions)
    if head:
        head_escaping = escaping_results(head)
        head_rows, head_spread = cluster_rows(head, head_escaping, tile_rows(head, tokens, budget, True), tokens, phase,
                                              clusters, True)
        if (head_rows < tokens
                and contraction_cycles(contractions, head_rows, tokens, clusters if head_spread else 1)
                + first_load_cycles(contractions, head_rows, tokens)
                < contraction_cycles(contractions, rows, tokens, clusters if spread else 1)
                + first_load_cycles(contractions, rows, tokens)):
            # The rest of the phase takes the next turn. (A head that fits whole is left in the
            # phase's loop: whole, its matmul would wait for all of its input's load, where the
            # tiles overlap each load with the previous tile's contraction; Llama-4-Scout's
            # router at T = 2048 took 4,217 cycles more so.)
            ops, escaping, rows, reload = head, head_escaping, head_rows, True
            for r in escaping:
                r.name_hint = r.name_hint or "logits"
    skip_by = empty_tile_indices(block, ops, escaping, tokens)
    back = returning_all_to_all(escaping) if skip_by is not None and len(shape_of(skip_by.type)) == 2 else None
    source_rows = shape_of(back.input.type)[1] if back is not None else tokens
    packing: list[Operation] = []
    packed_rows = None
    # a2a's split pairs gathered to go home are guarded by their own indices, a sender's slice
    # a row ([chips, slots]), not by received rows to pack ([tokens, pairs]): never packed
    gathers_own_rows = any(isinstance(r.owner, tcp.DmaGatherOp) and r.owner.indices is skip_by for r in escaping)
    if (back is not None and back.rows is not None and source_rows < min(rows, tokens) and skip_by is not None
            and not gathers_own_rows):
        # A tile would hold several senders' slices, each its received rows then padding:
        # pack the received rows first, so the tiles past them skip (`pack_received`), in
        # tiles of one flit of rows at most, fewer where their gather moves more than a DMA
        # start-up's worth (`start_up_rows`): each running tile's gather on an engine of its own
        # (Qwen3-30B-A3B ep=8, 16 tokens a chip: 128.8 us in tiles of a slice's 16, 127.9 in 8).
        packing, packed_rows, skip_by = pack_received(ops, skip_by, back.rows, source_rows)
        rows = min(source_rows, row_granule(ops), start_up_rows(ops, tokens))
    elif rows >= tokens and (rows := spread_rows(ops, tokens)) >= tokens:
        whole.update(ops)
        return True
    counts = back.rows if back is not None and packed_rows is None and shape_of(back.input.type)[0] == tokens else None
    part = guarded_pair_sum(block, ops, tokens) if skip_by is None else None
    before, loop, after, results = _tile_loop(ops, escaping, rows, tokens, phase, reload, skip_by, counts, part)
    if packed_rows is not None and back is not None and escaping == [back_source(back)]:
        back.properties["packed"] = UnitAttr()  # the sums go back as packed (ccl.all_to_all's `packed`)
    elif packed_rows is not None:  # each result back to its received row
        unpacked = [tcp.DmaScatterOp(r, packed_rows, tokens) for r in results]
        for op, r in zip(unpacked, escaping):
            op.attributes[PHASE_ATTR] = StringAttr(phase)
            op.result.name_hint = r.name_hint
        after += unpacked
        results = [op.result for op in unpacked]
    made.update(before)
    absorbed = set(ops)
    inputs = {v for op in ops for v in op.operands if v.owner not in absorbed}  # whole copies the tiles replace go
    folded = [output_store(r) for r in escaping]
    replace_by_loop(block, ops, escaping, results, [*packing, *before, *after])
    for store in folded:
        if store is not None:  # the loop stored its tiles into the output already
            store.result.replace_all_uses_with(store.tile)
            store.detach()
            store.erase()
    for v in inputs:
        _erase_unread_copy(v)
        if reload:
            _sink_copy(block, v, loop)
    return True


def contraction_head(ops: list[Operation], contractions: list[tcp.ContractOp]) -> list[Operation]:
    """The ops of a token loop's `ops` (in order) that its one row contraction reads through
    (the tokens' tile load, their widening before an f32 router): a loop of their own, whose
    tiles the contraction's mapping may prefer to the whole phase's. Empty when the loop has
    another number of contractions or the head would be all of `ops`."""
    if len(contractions) != 1:
        return []
    inside = set(ops)
    found: set[Operation] = set()
    pending: list[Operation] = [contractions[0]]
    while pending:
        op = pending.pop()
        if op in found:
            continue
        found.add(op)
        pending += [v.owner for v in op.operands if isinstance(v.owner, Operation) and v.owner in inside]
    return [op for op in ops if op in found] if len(found) < len(ops) else []


def contraction_cycles(contractions: list[tcp.ContractOp], rows: int, tokens: int, clusters: int) -> int:
    """The mapping level's cycles (target/contraction_mapping.py) of `contractions` over
    `tokens` rows in tiles of `rows`, a cluster's share of them on `clusters` clusters. A tile
    of few rows leaves the TRF loads of the stationary operand unamortized: DeepSeek-V3's f32
    router on its bf16 pieces takes 24,192 cycles for 128 rows (bound by TRF load) and 48,384
    for 512 (bound by the multipliers' outer stage), so where its top-k ranking holds the router's tiles to 128
    rows a cluster, its matmul is cheaper in a loop of its own (`contraction_head`)."""
    tiles = [rows] * (tokens // rows) + ([tokens % rows] if tokens % rows else [])
    machine = machine_of(contractions[0])
    total = sum(choose(replace(ContractionShape.of(op.roles()), m=m), machine).best.cycles
                for op in contractions for m in tiles)
    return -(-total // clusters)


def first_load_cycles(contractions: list[tcp.ContractOp], rows: int, tokens: int) -> int:
    """The cycles before a token loop's first contraction can start: its first tile's rows of
    the contractions' lhs brought from HBM at the machine's HBM rate (docs/hardware.md), which
    no earlier tile's contraction hides. Larger tiles trade it against contraction_cycles'
    amortized TRF loads: Llama-4-Scout's bf16 router at T = 4096 in a loop of its own took
    3,200-row tiles, 30,744 -> 59,584 cycles of the router phase, though its contraction alone
    was estimated cheaper there."""
    machine = machine_of(contractions[0])
    row_bytes = sum(stored_bytes(op.lhs.type) // tokens for op in contractions)  # the lhs holds the loop's T rows
    return math.ceil(min(rows, tokens) * row_bytes / machine.hbm_bytes_per_cycle)


def spread_rows(ops: list[Operation], tokens: int) -> int:
    """Tile rows for ops that fit SRAM whole but gather more than one DMA piece of rows from HBM
    (`dma_split_bytes`; the combine's gather of each token's K rows at decode, Qwen3-30B-A3B at
    T = 64: 2 MB): whole, its pieces run on as few engines as it has pieces, at most 256 B/cycle
    each, and the output's store on one; in a tile per engine (rows a multiple of
    `row_granule`), the tiles' gathers run side by side on every engine, each tile's vector work
    and store behind its own gather. `tokens` (whole) otherwise."""
    gathered = sum(stored_bytes(op.result.type) for op in ops
                   if isinstance(op, tcp.DmaGatherOp) and in_hbm(op.source))
    return tokens if gathered <= machine_of(ops[0]).dma_split_bytes else engine_rows(ops, tokens)


def engine_rows(ops: list[Operation], tokens: int) -> int:
    """Rows of a tile per DMA engine over `tokens` (a multiple of `row_granule`); `tokens` when
    they make fewer than two such tiles."""
    granule = row_granule(ops)
    tiles = min(machine_of(ops[0]).dma_engines, tokens // granule)
    return tokens if tiles < 2 else -(-tokens // (tiles * granule)) * granule


def start_up_rows(ops: list[Operation], tokens: int) -> int:
    """The fewest rows whose gathers from HBM (a mesh receiver's rows of each token's pairs)
    move what one DMA engine moves in a command's start-up: a tile of fewer spends most of its
    gather starting, one of more leaves engines idle that would gather the next rows beside it
    (Qwen3-30B-A3B ep=8, 16 tokens a chip, 8 pairs of 4 KB a row: 4 rows, the received 8 rows'
    gather in two commands of 1,012 cycles side by side where one took 1,524). `tokens` without
    such gathers."""
    machine = machine_of(ops[0])
    per_row = sum(stored_bytes(op.result.type) for op in ops
                  if isinstance(op, tcp.DmaGatherOp) and in_hbm(op.source)) // tokens
    if not per_row:
        return tokens
    return max(1, -(-machine.dma_startup_cycles * machine.dma_bytes_per_cycle // per_row))


def cluster_rows(ops: list[Operation], escaping: list[SSAValue], rows: int, tokens: int, phase: str,
                 clusters: int, reload: bool = False, shares: bool = False) -> tuple[int, bool]:
    """The tile rows of a loop over `ops` (at most `rows`, what SRAM allows) and whether its
    tiles take turns on the `clusters` clusters: balanced over them (`balanced_rows`) when a
    tile is worth running on another cluster (split-clusters' rule, `worth_splitting`, judged
    on a trial loop), also when the ops fit whole but make at least MIN_SPLIT_VECTOR_BYTES or
    hold a contraction that joined them to be shared (`shares`, `sharing_pays`)."""
    if clusters > 1 and tokens >= 8 * clusters:
        fits = rows >= tokens
        made = sum(stored_bytes(r.type) for op in ops if op.dialect_name() == "ve" for r in op.results)
        if not fits or made >= MIN_SPLIT_VECTOR_BYTES or shares:
            even = balanced_rows(tokens, rows, clusters, row_granule(ops))
            trial = _tile_loop(ops, escaping, even, tokens, phase, reload)
            spread = worth_splitting(trial[1], machine_of(ops[0]))
            for op in [*reversed(trial[2]), trial[1], *reversed(trial[0])]:
                op.erase(safe_erase=False)  # only the decision was wanted
            if spread:
                return even, True
    return rows, False


LINK_OPS = ccl.COLLECTIVES
"""The collectives: the link moves their data, HBM to HBM across chips (not ccl.a2a_plan or
a2a_tokens, which compute on the vector engine)."""


def goes_to_hbm(result: SSAValue) -> bool:
    """Whether a loop's `result` is written tile by tile to HBM rather than kept in SRAM: when
    only DMA commands, collectives and the function's return read it (through views), which
    read HBM where it is, and either the function returns it (the layer's output ends in HBM,
    each tile stored as it is made; or a chunked chip's home sum, which a `tile.store` puts in
    the layer's output in HBM: in SRAM, the last cluster's tiles crossed to cluster 0's buffer
    by DMA first, and the last chunk's did so after the link's last transfer, 4 us on
    Qwen3-30B-A3B ep=8), or it is placed in HBM (shard-experts' buffers that only
    DMA and the link touch, `tcpc.space`), or it is larger than a cluster's SRAM (the module's
    target's: a mesh chip's rows to return, at prefill). A compute engine reads SRAM, so a
    result it reads stays there, for the memory plan to place."""
    owner = result.owner
    assert isinstance(owner, Operation)
    returned = False
    pending, seen = [result], set()
    while pending:
        value = pending.pop()
        for use in value.uses:
            user = use.operation
            if isinstance(user, (tcp.ViewOp, ccl.AllToAllDoneOp)):
                if user not in seen:
                    seen.add(user)
                    pending.append(user.result)
            elif isinstance(user, func.ReturnOp):
                returned = True
            elif isinstance(user, tile.StoreOp) and use.index == 0 and in_hbm(user.dest):
                returned = True  # stored into a buffer in HBM: a chunk's home sum into the layer's output
            elif not isinstance(user, (*DMA_OPS, *LINK_OPS)):
                return False
    return returned or placed_in_hbm(owner) or stored_bytes(result.type) > machine_of(owner).cluster_sram_bytes


def output_store(result: SSAValue) -> tile.StoreOp | None:
    """The `tile.store` of a chunked chip's home sum `result` into the layer's output in HBM
    (shard-experts' chunks), when it is the result's only reader: the loop making `result`
    stores its tiles there (into the store's destination past its offset), not into a buffer of
    its own that the store then copied, HBM to HBM, after the loop's last tile (4.6 us after
    the last return on Qwen3-30B-A3B ep=4)."""
    uses = list(result.uses)
    if len(uses) != 1:
        return None
    use = uses[0]
    store = use.operation
    if (isinstance(store, tile.StoreOp) and use.index == 0 and store.guard is None and store.offsets is None
            and in_hbm(store.dest)):
        return store
    return None


def last_output_store(result: SSAValue) -> bool:
    """Whether `result` is the last chunk's home sum: stored into the layer's output
    (`output_store`) by the last store there, whose output no other chunk's store takes."""
    store = output_store(result)
    return store is not None and not any(isinstance(u.operation, tile.StoreOp) for u in store.result.uses)


def empty_tile_indices(block: Block, ops: list[Operation], escaping: list[SSAValue], tokens: int) -> SSAValue | None:
    """The combine gather's indices by which the loop skips a tile none of whose tokens has a
    pair: on a mesh chip of an all-to-all strategy, whose receive buffers are the static worst
    case (every token, or every slot, that every chip of the group could send) and mostly
    empty, when every result the loop stores is a pair sum (`is_pair_sum`: such a token's
    row is +0.0, what the zero-filled buffer holds) or that gather's own rows (a row of index
    -1 is zero too: a2a's split pairs gathered from the blocks to go home, one row per slot
    that every chip could send, which a routing that splits no token leaves all -1; Qwen3-30B-A3B
    ep=8, 4,096 tokens a chip, 8 chunks: 91,480 cycles of HBM stores a chunk). On one chip
    every token has its pairs, and allgather's combine runs over the group's real tokens, whose
    pairs interleave: there the check would cost without saving (Qwen3-30B-A3B ep=2 allgather
    prefill: 3,135 -> 3,201 us with it). None otherwise."""
    if not _receives(block):
        return None
    gathers = [op for op in ops if isinstance(op, tcp.DmaGatherOp) and leading(op.indices) == tokens]
    if len(gathers) != 1:
        return None
    if not all(isinstance(r.owner, Operation) and (is_pair_sum(r.owner) or r.owner is gathers[0]) for r in escaping):
        return None
    return gathers[0].indices


def _receives(block: Block) -> bool:
    """Whether `block` is a mesh chip's function of a `RECEIVING_STRATEGIES` strategy."""
    fn = block.parent_op()
    strategy = fn.attributes.get(ccl.STRATEGY_ATTR) if isinstance(fn, func.FuncOp) else None
    return isinstance(strategy, StringAttr) and strategy.data in RECEIVING_STRATEGIES


@dataclass(frozen=True)
class GuardedPart:
    """The ops of a token loop that make a pair sum (`is_pair_sum`) from a gather of pair rows
    and nothing else reads: a tile whose gather indices are all -1 skips them and takes +0.0."""

    indices: SSAValue
    """The gather's [T, ...] indices, whose tile's largest decides."""
    ops: frozenset[Operation]
    total: Operation
    """The pair sum."""


def guarded_pair_sum(block: Block, ops: list[Operation], tokens: int) -> GuardedPart | None:
    """On a mesh chip of an all-to-all strategy, the part of a token loop's `ops` that makes
    its one pair sum from its one gather of [T, ...] rows by [T, ...] indices, where the loop
    stores more than pair sums (so `empty_tile_indices` cannot skip whole tiles): a2a's home
    chip sums a split token's pairs that came back with the receivers' sums of whole tokens,
    and a tile of whole tokens (every tile, under a routing that splits none) needs only the
    latter (Qwen3-30B-A3B ep=2, 4,096 tokens a chip: 9 tiles of 2,243 cycles after the last
    return). The part is every op the sum reads through, within `ops`, whose results only the
    part reads; it must hold the gather. None otherwise."""
    if not _receives(block):
        return None
    totals = [op for op in ops if is_pair_sum(op)]
    gathers = [op for op in ops if isinstance(op, tcp.DmaGatherOp) and leading(op.indices) == tokens]
    if len(totals) != 1:
        return None
    total = totals[0]
    part = _read_only_by(ops, {total})
    found = [g for g in gathers if g in part]
    if len(found) != 1 or len(part) == len(ops):
        return None
    return GuardedPart(found[0].indices, frozenset(part), total)


def whole_sums_into_output(block: Block) -> None:
    """On an a2a mesh chip, each chunk's home sum stored into the layer's output in HBM
    (`output_store`, made whole: at decode) as `bf16(f32(whole) + pair_sum)`, where `whole` is
    the gather of the receivers' sums of its whole tokens and `pair_sum` the weighted sum of
    its split pairs' returned rows, gets a branch on whether any split pair came back: without
    one (every chunk, under a routing that splits no token) `pair_sum` is +0.0 and the rows are
    the receivers' sums, which one `tile.gather_into` writes from the return's buffer straight
    into the output, where the gather, the add and the store each waited for the one before
    (Qwen3-30B-A3B ep=4, 16 tokens a chip: 1,419 cycles after the last return, 628 so). The
    rows are those of `moe.combine` on one chip, a -0.0 included (the + 0.0 made it +0.0)."""
    if not _receives(block):
        return
    homes = [(store, found) for store in block.ops if isinstance(store, tile.StoreOp)
             if (found := _home_sum(store)) is not None]
    for store, (whole, part, pairs) in homes:
        flat = tcp.ViewOp(pairs.indices, [1, math.prod(shape_of(pairs.indices.type))])
        top = ve.ReduceMaxOp(flat.result, 1)
        guard = tile.GuardOp(top.result)
        top.result.name_hint, guard.result.name_hint = "pair_top_index", "split_pairs_back"
        into = tile.GatherIntoOp(whole.source, whole.indices, store.dest, store.offset)
        readers = list(store.result.uses)
        anchor = store.next_op
        for op in [*part, store]:
            op.detach()
        branch = scf.IfOp(guard.result, [store.result.type], [Block([*part, store, scf.YieldOp(store.result)])],
                          [Block([into, scf.YieldOp(into.result)])])
        for op in (flat, top, guard, into, branch):
            op.attributes[PHASE_ATTR] = store.attributes.get(PHASE_ATTR, StringAttr("combine"))
        if anchor is None:
            block.add_ops([flat, top, guard, branch])
        else:
            block.insert_ops_before([flat, top, guard, branch], anchor)
        branch.results[0].name_hint = store.result.name_hint
        for use in readers:
            use.operation.operands[use.index] = branch.results[0]


def _home_sum(store: tile.StoreOp) -> tuple[tcp.DmaGatherOp, list[Operation], tcp.DmaGatherOp] | None:
    """For `whole_sums_into_output`: the gather of the whole tokens' sums, the ops (in order)
    that only the stored `bf16(f32(whole) + pair_sum)` reads, and the one gather of returned
    pair rows among them; None when `store` is not such a store."""
    if store.guard is not None or store.offsets is not None or not in_hbm(store.dest):
        return None
    chain: list[Operation] = []
    value = store.tile
    for kind in (ve.NarrowOp, ve.AddOp):
        owner = value.owner
        if not isinstance(owner, kind) or not value.has_one_use():
            return None
        chain.append(owner)
        value = owner.operands[0] if kind is ve.NarrowOp else value
    add = chain[-1]
    sums = [v for v in add.operands if isinstance(v.owner, Operation) and is_pair_sum(v.owner)]
    rest = [v for v in add.operands if v not in sums]
    if len(sums) != 1 or len(rest) != 1:
        return None
    value, owner = rest[0], None
    for kind in (ve.WidenOp, tcp.ViewOp, tcp.DmaGatherOp):
        owner = value.owner
        if not isinstance(owner, kind) or not value.has_one_use():
            return None
        value = owner.operands[0]
    whole = owner
    assert isinstance(whole, tcp.DmaGatherOp)
    block = store.parent_block()
    assert block is not None
    kept = {whole.source, whole.indices}  # the branch without split pairs reads them
    movable = [op for op in block.ops if (isinstance(op, (tcp.DmaGatherOp, tcp.ViewOp)) or op.dialect_name() == "ve")
               and not any(r in kept for r in op.results)]
    part = _read_only_by(movable, {store, *chain})
    gathers = [op for op in part if isinstance(op, tcp.DmaGatherOp) and op is not whole]
    if whole not in part or len(gathers) != 1:
        return None
    part.discard(store)
    return whole, [op for op in block.ops if op in part], gathers[0]


def _read_only_by(ops: list[Operation], part: set[Operation]) -> set[Operation]:
    """`part` and the ops of `ops` (in program order) whose results only those ops read."""
    part = set(part)
    for op in reversed(ops):  # users come after their producers: one backward pass
        if op not in part and any(r.uses for r in op.results) and all(
                use.operation in part for r in op.results for use in r.uses):
            part.add(op)
    return part


def loaded_whole(value: SSAValue, inside: set[Operation], reload: bool = False) -> SSAValue | None:
    """The HBM value that `value`, an SRAM input of a token loop over `inside`, copies whole (a
    `tcp.load`, through views: the tokens loaded for the router, a shared expert's rows loaded
    after its loop) when only `inside` reads that copy. The loop then loads each tile's rows
    from HBM (`tile.load`) and the whole copy goes: it held all T rows in one cluster's SRAM
    for a loop that reads them a tile at a time. With `reload` (a router matmul's own loop,
    `contraction_head`) also when others read the copy, which then stays: a tile on another
    cluster loads its rows rather than copying them from cluster 0's SRAM (DeepSeek-V3 fp8 at
    T = 4096 with quantize=tokens: the router's tiles on both clusters, 1,224,303 -> 714,043
    cycles). None otherwise."""
    source = value
    while isinstance(source.owner, tcp.ViewOp):
        source = source.owner.input
    hbm = hbm_copied(source)

    def read_inside(v: SSAValue) -> bool:
        return all(use.operation in inside
                   or (isinstance(use.operation, tcp.ViewOp) and read_inside(use.operation.result)) for use in v.uses)

    return hbm if hbm is not None and (reload or read_inside(source)) else None


def _erase_unread_copy(value: SSAValue) -> None:
    """Erase `value` and the views and load it was made by, as far as nothing else reads them."""
    while not value.uses and isinstance(owner := value.owner, (tcp.ViewOp, tcp.LoadOp)):
        value = owner.operands[0]
        owner.detach()
        owner.erase()


def _tile_tops(indices: SSAValue, main: int, rows: int, c0: Operation, before: list[Operation],
               counts: SSAValue | None = None) -> SSAValue:
    """The largest of each tile's `indices` (the first `main` of them, tiles of `rows`), over
    each of the tile's rows ([main]: a tile's guard slices it at the tile's offset), made by
    ops appended to `before`: one reduction over all the tiles at once before the loop, not
    one per tile in it, where each paid the reduction's fill over the tile's elements (1,040
    cycles a tile of 128 tokens x 8 at prefill, 32 tiles a combine loop: Qwen3-30B-A3B's
    receivers on 8 chips at 4,096 tokens each, 8 chunks, spent 266 us in them).

    With `counts` (the loop's rows are whole sender slices of the all-to-all that returns its
    results, and `counts` that all-to-all's `rows`: the slices' rows that cross), each slice's
    count less one stands for its largest index: a slice none of whose rows cross needs
    nothing made, and its gather's indices are then all -1 too. That reads [chips] counts
    where the reduction reads every index (a2a's split pairs: [8, 4,096] on 8 chips, 8,241
    cycles of the reduction's fill a chunk)."""
    if counts is not None:
        column = tcp.ViewOp(counts, [shape_of(counts.type)[0], 1])
        one = ve.ConstOp(1, column.result.type)  # type: ignore[arg-type]
        last = ve.SubOp(column.result, one.result)
        last.result.name_hint = "last_row_sent"
        before += [column, one, last]
        indices = last.result
    shape = shape_of(indices.type)
    head = indices
    if main < shape[0]:
        head = tile.SliceOp(indices, c0.results[0], tile_type(indices.type, main))
        before.append(head)
        head = head.results[0]
    tiles = main // rows
    by_tile = [tiles, rows * math.prod(shape[1:])]
    if by_tile[1] == 1:  # a value a tile: its own largest
        tops = tcp.ViewOp(head, [main])
        tops.result.name_hint = "tile_top_at_row"
        before.append(tops)
        return tops.result
    if by_tile != list(shape_of(head.type)):
        per_tile = tcp.ViewOp(head, by_tile)
        before.append(per_tile)
        head = per_tile.result
    maxima = ve.ReduceMaxOp(head, 1)
    spread = ve.BroadcastOp(maxima.result, 1, rows)
    tops = tcp.ViewOp(spread.result, [main])
    before += [maxima, spread, tops]
    for op, name in ((maxima, "tile_tops"), (spread, "tile_top_rows"), (tops, "tile_top_at_row")):
        op.result.name_hint = name
    return tops.result


def _sink_copy(block: Block, value: SSAValue, loop: Operation) -> None:
    """Move the whole `tcp.load` that `value` is (through views), when the loop reloading its
    tiles no longer reads it, to just before the first op of `block` that still does
    (`sink_to_first_reader`): the tokens loaded whole for the router and kept for the
    dispatch's quantization (quantize=tokens) then take a cluster's SRAM from the dispatch on,
    not through the router and the routing, where DeepSeek-V3 fp8 at T = 4096 spilled them."""
    chain = load_chain(value)
    if chain and chain[0].parent is block and value.uses:
        sink_to_first_reader(block, chain, unless=loop)


def _tile_loop(ops: list[Operation], escaping: list[SSAValue], rows: int, tokens: int, phase: str,
               reload: bool = False, skip_by: SSAValue | None = None, counts: SSAValue | None = None,
               part: GuardedPart | None = None) -> tuple[list[Operation], scf.ForOp, list[Operation], list[SSAValue]]:
    """The token-tile loop of `phase` over `ops` in tiles of `rows` (not yet in the block): the
    ops before it, the loop, the ops after it (the loop and the remainder) and the escaping
    results. With `skip_by` (empty_tile_indices), a tile whose indices are all -1 is skipped:
    its largest index (a vector reduction; with `counts`, its slices' counts: `_tile_tops`)
    decides an `scf.if` (`tile.guard`) around the tile's work. With `part`
    (guarded_pair_sum), only the part's ops are guarded so, the sum taking +0.0 (a `ve.const`)
    in a tile whose gather indices are all -1. A result that only a store into the layer's
    output reads (`output_store`) has no buffer: the loop stores its tiles there."""
    main = tokens - tokens % rows
    marker = {PHASE_ATTR: StringAttr(phase)}

    before: list[Operation] = [c0 := index_constant(0), c_main := index_constant(main), c_rows := index_constant(rows)]
    into = [output_store(r) for r in escaping]
    buffers = {r: tile.BufferOp("hbm" if goes_to_hbm(r) else "sram", r.type)
               for r, s in zip(escaping, into) if s is None}
    before += buffers.values()
    for r, b in buffers.items():
        b.result.name_hint = f"{r.name_hint or 'out'}_buffer"
    inits = [s.dest if s is not None else buffers[r].result for r, s in zip(escaping, into)]

    def at(row: SSAValue, store: tile.StoreOp | None, target: Block) -> SSAValue:
        """Where a tile of rows from `row` goes: there in its own buffer, or past `store`'s offset
        in the layer's output."""
        if store is None:
            return row
        shifted = arith.AddiOp(row, store.offset)
        shifted.attributes.update(marker)
        target.add_op(shifted)
        return shifted.result

    body = Block(arg_types=[IndexType(), *(v.type for v in inits)])
    offset, *buffer_args = body.args
    offset.name_hint = "row"

    inside = set(ops)
    from_hbm: dict[SSAValue, SSAValue | None] = {}

    def rows_in_hbm(v: SSAValue) -> SSAValue | None:
        """`v`'s rows in HBM, when the loop loads them a tile at a time (`loaded_whole`)."""
        if v not in from_hbm:
            source = loaded_whole(v, inside, reload)
            if source is not None and source.type != v.type:  # a view of the HBM value, before the loop
                view = tcp.ViewOp(source, list(shape_of(v.type)))
                view.result.name_hint = v.name_hint
                before.append(view)
                source = view.result
            from_hbm[v] = source
        return from_hbm[v]

    def add_to(target: Block):
        def add(op: Operation, name: str | None = None) -> SSAValue:
            op.attributes.update({k: v for k, v in marker.items() if k not in op.attributes})
            target.add_op(op)
            if name is not None:
                op.results[0].name_hint = name
            return op.results[0]
        return add

    mapping: dict[SSAValue, SSAValue] = {}
    add = add_to(body)
    runs = None
    if skip_by is not None:
        tops = _tile_tops(skip_by, main, rows, c0, before, counts)
        indices = add(tile.SliceOp(skip_by, offset, tile_type(skip_by.type, rows)),
                      f"{skip_by.name_hint}_tile" if skip_by.name_hint else None)
        mapping[skip_by] = indices
        top, guard = _tile_guard(tops, offset)
        add(top, "top_index")
        runs = add(guard, "tile_has_pairs")
    _clone_rows(ops, rows, offset, tokens, add, mapping, rows_in_hbm)
    if part is not None:
        tops = _tile_tops(part.indices, main, rows, c0, before)
        total = part.total.results[0]
        mapping[total] = _guard_part(body, [mapping[r].owner for op in ops if op in part.ops for r in op.results[:1]],  # type: ignore[misc]
                                     mapping[total], tops, offset, marker)
    stored = [add(tile.StoreOp(mapping[r], buf, at(offset, s, body))) for r, buf, s in zip(escaping, buffer_args, into)]
    body.add_op(scf.YieldOp(*stored))
    if runs is not None:
        skip_unless(body, runs).attributes.update(marker)
    loop = scf.ForOp(c0, c_main, c_rows, inits, body)
    loop.attributes.update(marker)
    after: list[Operation] = [loop]
    results: list[SSAValue] = list(loop.results)
    if main < tokens:  # the remainder: the body once more, on the last tokens - main rows
        rest = Block()
        add_rest = add_to(rest)
        c_rest = add_rest(index_constant(main))
        rest_mapping: dict[SSAValue, SSAValue] = {}
        _clone_rows(ops, tokens - main, c_rest, tokens, add_rest, rest_mapping, rows_in_hbm)
        results = [add_rest(tile.StoreOp(rest_mapping[r], buf, at(c_rest, s, rest)))
                   for r, buf, s in zip(escaping, results, into)]
        after += list(rest.ops)
        for op in after[1:]:
            op.detach()
    for op in before:
        op.attributes.update(marker)
    return before, loop, after, results


def _tile_guard(tops: SSAValue, offset: SSAValue) -> tuple[tile.SliceOp, tile.GuardOp]:
    """The guard of the tile at `offset`: its largest index (`_tile_tops`' row there) not -1."""
    top = tile.SliceOp(tops, offset, TensorType(tops.type.get_element_type(), [1]))  # type: ignore[attr-defined]
    return top, tile.GuardOp(top.results[0])


def _guard_part(body: Block, part: list[Operation], total: SSAValue, tops: SSAValue, offset: SSAValue,
                marker: dict[str, StringAttr]) -> SSAValue:
    """Move the tile's `part` ops (in order, `total` the last one's result) into an `scf.if`
    on the tile's largest gather index (`tops` at `offset`) at `total`'s place; the other
    branch yields +0.0, what the part makes of a tile of -1 indices. Returns the branch's
    result, which the tile's readers of `total` now read."""
    first = part[0]
    top, guard = _tile_guard(tops, offset)
    top.result.name_hint, guard.result.name_hint = "pair_top_index", "tile_has_split_pairs"
    body.insert_ops_before([top, guard], first)
    anchor = total.owner.next_op  # type: ignore[union-attr]
    readers = list(total.uses)
    for op in part:
        op.detach()
    zero = ve.ConstOp(0.0, total.type)  # type: ignore[arg-type]
    branch = scf.IfOp(guard.result, [total.type], [Block([*part, scf.YieldOp(total)])],
                      [Block([zero, scf.YieldOp(zero.result)])])
    for op in (top, guard, branch, zero):
        op.attributes.update(marker)
    if anchor is None:
        body.add_op(branch)
    else:
        body.insert_op_before(branch, anchor)
    branch.results[0].name_hint = total.name_hint
    for use in readers:
        use.operation.operands[use.index] = branch.results[0]
    return branch.results[0]


def token_counts(fn: func.FuncOp) -> list[int]:
    """The token counts T to tile for, in program order: the rows of each combine gather's
    indices (a routing plan's scatter_idx; on a mesh chip also the home chip's gather of its
    tokens' returned rows, whose tokens are fewer than the receiver's worst case: untiled,
    DeepSeek-V3's at 4096 tokens per chip on 8 chips was one 470 MB gather (a2a; 940 MB of
    f32 rows with a2a_sum), which the memory plan streamed). Each phase is tiled at every
    count, so a mesh chip's router is tiled at its own tokens, the second count: whole,
    DeepSeek-V3's input widened to f32 took 117 MB of one cluster's SRAM at 4096 tokens per
    chip. (Tiling it there once made DeepSeek-V3's a2a prefill spill and take 30% longer; with
    the tokens loaded a tile at a time and the tiles sized for a cluster's SRAM it does not.)
    A chip whose token loop is split into chunks gathers a chunk's tokens at home, so its own
    tokens come last, from its token-sharded arguments: without them its router stayed whole
    (DeepSeek-V3 ep=8, 4096 tokens a chip, 2 chunks: 1,450 us before the dispatch, not 750)."""
    found: list[int] = []
    for op in fn.walk():
        if isinstance(op, tcp.DmaGatherOp) and phase_of(op) == "combine":
            rows = leading(op.indices)
            if rows is not None and rows not in found:
                found.append(rows)
    if ccl.CHUNKS_ATTR in fn.attributes:
        own = [shape_of(a.type)[0] for a, attrs in zip(fn.args, fn.arg_attrs or ())
               if isinstance(attrs, DictionaryAttr) and attrs.data.get(ccl.SHARD_ATTR) == StringAttr("tokens")]
        found += [rows for rows in own[:1] if rows not in found]
    return found


def store_results(fn: func.FuncOp) -> None:
    """The layer's results end in HBM, as the next layer's input, written once (the chip limit
    counts those bytes): a token loop writes a result it makes to HBM tile by tile
    (`goes_to_hbm`); any other result in SRAM (made whole: at decode, or after the loops) is
    stored by one `tcp.store` (DMA, SRAM -> HBM) before the return. An argument returned as it
    is, or a value in HBM, stays where it is."""
    ret = fn.body.block.last_op
    if not isinstance(ret, func.ReturnOp):
        return
    for i, value in enumerate(ret.operands):
        if in_hbm(value):
            continue
        store = tcp.StoreOp(value)
        store.result.name_hint = f"{value.name_hint}_hbm" if value.name_hint else None
        owner = value.owner
        phase = phase_of(owner) if isinstance(owner, Operation) else None
        store.attributes[PHASE_ATTR] = StringAttr(phase or OTHER)
        fn.body.block.insert_op_before(store, ret)
        ret.operands[i] = store.result


@dataclass(frozen=True)
class ScheduleTokensPass(ModulePass):
    name = "schedule-tokens"

    tile_bytes: int = 0
    """The SRAM a tile's intermediates may take (0: 1 / TILE_SHARE of the target's SRAM)."""

    clusters: int = 0
    """Clusters the tiles take turns on (split-clusters; 0: the target's): tiles balanced over them."""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        machine = machine_of(op)
        tile_bytes = self.tile_bytes or machine.sram_bytes // TILE_SHARE
        clusters = self.clusters or machine.clusters
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks:
                nested_reads: dict[Operation, tuple[Operation, ...]] = {}
                made: set[Operation] = set()
                for tokens in token_counts(fn):
                    for phase in TILED_PHASES:
                        whole: set[Operation] = set()
                        while schedule_phase(fn.body.block, phase, tokens, tile_bytes, whole, clusters, nested_reads,
                                             made):
                            pass
                whole_sums_into_output(fn.body.block)
                store_results(fn)
