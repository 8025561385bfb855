"""`split-clusters{clusters=N}`: the expert loop spread over the chip's clusters.

RNGD has two clusters of 256 slices; each runs its own tensor-unit commands in lockstep, and
the two run at once (docs/hardware.md#pes-clusters-and-slices). `schedule-experts` builds one
loop over the G blocks; this pass makes each iteration carry one copy of the block's work per
cluster, pinned to it (`tcpc.cluster`), and guarded so that exactly one copy runs:

- cluster c owns the experts e with e mod N == c (N a power of two). Before the loop, each
  cluster computes its own `expert_ids` with the other clusters' blocks set to -1 (a `ve.and`,
  a comparison and a select on G ids), from a DMA copy (`tile.copy`) when it is not the cluster
  the routing ran on. An expert's blocks are adjacent and all on one cluster, so its weights
  are still loaded once, by the cluster that contracts them;
- in cluster c's copy the block's id is its own masked id: its weight loads (`tile.load_expert`)
  and guarded contractions skip a block another cluster owns, as they skip unused blocks; its
  row gathers, row loads and result stores (`tile.gather`, `tile.load`, `tile.store`) are guarded by whether c owns the
  block (an unused block, id -1, belongs to cluster N - 1, which computes and stores it as the
  loop did), so each block is stored exactly once and a skipped copy moves nothing;
- the values a copy reads from SRAM that another cluster produced are copied to it by DMA once,
  before the loop (constants are rebuilt, not copied); HBM values are read directly, and so is
  a row gather's source (a DMA command reads any cluster's memory, or HBM); block scales
  gathered ahead of the loop by the expert ids are gathered again from HBM by each cluster's
  masked ids (`regathered`), each moving only its own blocks' rows, right before the loop: the
  dispatch's commands, which the first block's row gathers wait for, go first (Qwen3-30B-A3B
  fp8, cost-only, balanced: T = 2048 612,354 -> 610,073 cycles, T = 4096 903,711 -> 900,297);
- a loop whose results schedule-experts keeps in SRAM (one token in blocks of one row, decode:
  memory-bound, its combine on cluster 0) is left whole on cluster 0: a result another cluster
  made would cross by DMA, and one cluster's tensor unit keeps up with the weights' stream
  (Qwen3-30B-A3B bf16 T = 1: 59,308 -> 59,202 cycles on one cluster with the results still in
  HBM). Its weight loads then no longer queue behind six scale gathers (two clusters' three):
  the loads of each cluster's first expert, issued before those gathers (issue #30), went with it;
- at prefill (at least PREFILL_PAIRS_PER_EXPERT routed pairs per expert) the plan's first loop
  starts from each cluster's guessed first weights (`guessed_loads`): expert c's tiles, loaded
  on cluster c while the router computes, which the first slot (a group loop,
  schedule-experts{order=tile}) or the first block cluster c owns (a block loop of block-scaled
  experts, which keep block order) reuses when the routing uses expert c (Qwen3-30B-A3B T = 2048,
  B = 128, cost-only, balanced: 1,039,088 -> 1,026,998 cycles; in fp8, 621,375 -> 619,387);
  not beside a shared expert, whose loads need no guess to take the HBM the routing leaves idle;
  so does one chip's decode from GUESS_PAIRS_PER_EXPERT pairs per expert (Qwen3-30B-A3B at T = 64),
  where expert c is almost surely used and HBM is idle while the router ranks;
- on a mesh chip at decode, the first routed loop (the first chunk's) guesses them too when it
  streams its weights (fewer FLOPs per weight byte than `own_dma_intensity`), its guessed loads
  issued before the first `ccl.all_to_all_done`: HBM is idle while the router ranks and the link
  moves the expert lists and the tokens, which the routing and the first block wait for. A chip
  holds few experts and receives a batch from every chip (Qwen3-30B-A3B on 8 chips at 16 tokens
  a chip: 8 pairs per expert), so its lowest experts are used; a wrong guess costs HBM the loop
  had no use for yet (same model, cost-only, balanced, B = 8, 2 chunks: 124,505 -> 118,886
  cycles; on 4 chips, B = 4: 230,238 -> 224,703). A chip that all-gathers every token (strategy
  allgather, no all-to-all) issues them before the all-gather of the tokens' expert choices
  (`routing_gather`), which its routing waits for, where its first weights waited for that
  all-gather and the routing (Qwen3-30B-A3B on 2 chips at 16 tokens a chip, B = 2: 447,587 ->
  439,927 cycles);
- the result buffers in HBM are shared, chained through both copies' guarded stores; every
  other loop-carried value (previous ids and weights for reuse, the double-buffering waits) is
  each cluster's own.

A shared expert's loop (phase `shared`, passes/schedule/schedule_shared.py: every block has one
"expert") is split by block instead: with G a multiple of N, an iteration runs N blocks, one
per cluster (block + N - 1 - c on cluster c), the copies' commands interleaved in program
order and nothing masked or guarded; with fewer blocks than clusters (decode) the loop runs
whole on cluster N - 1, beside the routing on cluster 0; otherwise each copy is masked to the
blocks g with N - 1 - (g mod N) == c.

A group loop's copies at prefill alternate slot by slot in program order (`interleaved_slots`),
each cluster's rows and first slot, then the clusters' later slots in turn, then each one's
stores: HBM serves the commands in issue order, and with each copy whole the second cluster
trailed the first by a group's DMA (Qwen3-30B-A3B T = 2048: 1,026,998 -> 1,022,764 cycles).

Vector ops of the copy that does not own a block still run on that cluster's (zero) tiles: the
chain has no guard of its own. That costs each cluster the other's vector time on the block
(a few percent of a block's contraction at real sizes), and is visible in the report.

DMA engines: by default a copy's DMA commands take whichever of the chip's engines are free,
so a memory-bound block (decode) streams its weights at the whole chip's HBM bandwidth. But
commands issue in program order and an engine runs its commands in order: where a block's
contraction outlasts its weight load, loads wait for the buffers the contractions hold, and
a waiting load of one cluster holds the engines' queues: the other cluster's loads, issued
after it, queue behind, and the clusters contract in turn. So when a block does at least
`own_dma_intensity` FLOPs per weight byte (its contraction on one cluster takes at least as
long as its weight load at the whole chip's HBM bandwidth) and the loop's work can spread over
every cluster (a routed loop that can hold an expert per cluster, min(E, G) >= N; a shared
expert's loop with a block per cluster), each copy's ops are marked `tcpc.own_dma` and their
DMA runs on the cluster's own engines (the simulator's `own_dma_units`).

Token loops of `schedule-tokens` (the router's) run tile i on cluster i mod N
(passes/schedule/_cluster_token_tiles.py). When the router's loop so spreads (prefill), the
tokens' quantization made whole before the expert loop (lower-dispatch{quantize=tokens}) runs
on the last cluster right after the router's loop, from its own load of the tokens
(`quantize_beside_routing`): beside the routing on cluster 0, where it followed it. A load of
the tokens that only the quantization reads (an f32 router loads its own tiles) moves with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IndexType, IntegerAttr, ModuleOp, StringAttr, TensorType
from xdsl.ir import Attribute, Block, OpResult, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import ccl, tcp, tile, ve
from dialects.annotations import PHASE_ATTR, SHARED, cluster_of, phase_of, place_on_cluster
from dialects.tensor_types import shape_of, stored_bits
from passes._loop_builder import in_hbm
from passes.schedule._cluster_copies import pin, reacher, read_in_place
from passes.schedule._cluster_token_tiles import load_sliced_rows, split_token_loop, token_loops
from target.machine import Machine
from target.target_spec import machine_of


def expert_loops(block: Block) -> list[scf.ForOp]:
    """The loops of `block` built by schedule-experts: those whose body loads expert weights."""
    return [op for op in block.ops if isinstance(op, scf.ForOp)
            and any(isinstance(inner, tile.LoadExpertOp) for inner in op.body.walk())]


def _is_stored(value: SSAValue) -> bool:
    """Whether `value` is a buffer a `tile.store` wrote, directly or as a branch's result; not
    a buffer the body makes itself (a contraction's column pieces, passes/schedule/_k_pieces.py)."""
    owner = value.owner
    if isinstance(owner, tile.StoreOp):
        while isinstance(owner, tile.StoreOp):
            owner = owner.dest.owner
        return not isinstance(owner, tile.BufferOp)
    if isinstance(owner, scf.IfOp) and isinstance(value, OpResult):
        then_yield = owner.true_region.block.last_op
        return isinstance(then_yield, scf.YieldOp) and _is_stored(then_yield.operands[value.index])
    return False


def _owned_ids(ids: SSAValue, cluster: int, clusters: int, before: list[Operation],
               with_blocks: bool, by_block: bool = False) -> tuple[SSAValue, SSAValue | None]:
    """For `cluster`, computed on it from `ids` (the expert ids as it reads them): the ids with
    the blocks another cluster owns set to -1, and, `with_blocks`, the blocks it owns (0, else
    -1). A block belongs to the cluster its expert names (e mod N; an unused block, id -1, to
    the cluster -1 mod N names), or, `by_block` (a shared expert's loop, every block of one
    expert), to cluster N - 1 - (g mod N): the clusters take the blocks in turn, the last one
    first, so a single block (decode) does not run on cluster 0, where the routing runs."""
    t = ids.type
    mask = ve.ConstOp(clusters - 1, t)
    key: list[Operation] = [ve.IotaOp(t, 0)] if by_block else []
    owner = ve.AndOp(key[0].results[0] if key else ids, mask.result)
    this = ve.ConstOp(clusters - 1 - cluster if by_block else cluster, t)
    mine = ve.TagOp("eq", owner.result, this.result)
    none = ve.ConstOp(-1, t)
    owned = ve.SelectOp(mine.result, [1], ids, none.result)
    ops: list[Operation] = [mask, *key, owner, this, mine, none, owned]
    owned.result.name_hint = f"expert_ids_cluster{cluster}"
    blocks = None
    if with_blocks:
        zero = ve.ConstOp(0, t)
        select = ve.SelectOp(mine.result, [1], zero.result, none.result)
        select.result.name_hint = f"blocks_cluster{cluster}"
        ops += [zero, select]
        blocks = select.result
    for op in ops:
        place_on_cluster(op, cluster)
    before.extend(ops)
    return owned.result, blocks


def addressed(value: SSAValue) -> SSAValue:
    """The value `value` addresses, through slices and views."""
    while isinstance(value.owner, (tile.SliceOp, tcp.ViewOp)):
        value = value.owner.operands[0]
    return value


def derived(value: SSAValue, own: dict[SSAValue, SSAValue | None], cluster: int, before: list[Operation]) -> SSAValue | None:
    """`value`, made before the loop from the values `own` maps (a group's tables from the
    expert ids and row index) by vector ops, views and slices, made again on `cluster` from
    its own (appended to `before`); None if it is not made from them. `own` memoises both."""
    if not own:
        return None
    if value in own:
        return own[value]
    owner = value.owner
    own[value] = None
    if not isinstance(owner, Operation) or not (owner.dialect_name() == "ve" or isinstance(owner, (tcp.ViewOp, tile.SliceOp))):
        return None
    operands = [derived(v, own, cluster, before) for v in owner.operands]
    if all(v is None for v in operands):
        return None
    new = owner.clone()
    new.operands = [v if d is None else d for v, d in zip(owner.operands, operands)]
    pin(new, cluster)
    before.append(new)
    for old, r in zip(owner.results, new.results):
        r.name_hint = f"{old.name_hint}_cluster{cluster}" if old.name_hint else None
        own[old] = r
    return own[value]


def gathered_by(value: SSAValue, expert_ids: SSAValue) -> bool:
    """Whether `value` is a gather from HBM by the loop's expert ids made before the loop (the
    block scales schedule-experts gathers ahead)."""
    owner = value.owner
    return isinstance(owner, tcp.DmaGatherOp) and owner.indices is expert_ids and in_hbm(owner.source)


def regathered(value: SSAValue, expert_ids: SSAValue, owned: SSAValue, cluster: int, before: list[Operation],
               made: "Made") -> SSAValue | None:
    """`value`, when it is `gathered_by` the loop's expert ids, gathered again on `cluster` by
    its own masked ids (appended to `before`): each cluster moves only its blocks' rows (index
    -1 moves nothing) from HBM, where a DMA copy of the whole gather from cluster 0's SRAM would move
    every row SRAM -> SRAM, whose reads and writes do not pipeline (tcp_cost.py): MXFP4's scales
    of Qwen3-30B-A3B at T = 1 (393 KB a matrix) took 3,572 cycles to copy on each of three
    engines against 2,036 to gather. None for any other value."""
    owner = value.owner
    if not (gathered_by(value, expert_ids) and owned is not expert_ids):
        return None
    assert isinstance(owner, tcp.DmaGatherOp)
    if (cluster, value) not in made.copies:
        gather = tcp.DmaGatherOp(owner.source, owned)
        gather.attributes.update(owner.attributes)
        gather.location = owner.location
        gather.result.name_hint = f"{value.name_hint}_cluster{cluster}" if value.name_hint else None
        pin(gather, cluster)
        before.append(gather)
        made.copies[(cluster, value)] = gather.result
        made.regathered.append(owner)
    return made.copies[(cluster, value)]


def _owned_rows(tokens: SSAValue, owned: SSAValue, cluster: int, before: list[Operation], name: str | None) -> SSAValue:
    """`tokens` (each block's row -> token index, [G, B]) with the rows of the blocks `cluster`
    does not own (`owned`: its masked expert ids, -1 elsewhere) set to -1: a gather of a
    group's rows then moves only the cluster's own, on `cluster`."""
    blocks, rows = shape_of(tokens.type)
    ids = ve.BroadcastOp(owned, 1, rows)
    zero = ve.ConstOp(0, ids.result.type)
    mine = ve.TagOp("ge", ids.result, zero.result)
    none = ve.ConstOp(-1, tokens.type)  # type: ignore[arg-type]
    masked = ve.SelectOp(mine.result, [1], tokens, none.result)
    masked.result.name_hint = f"{name or 'rows'}_cluster{cluster}"
    ops: list[Operation] = [ids, zero, mine, none, masked]
    for op in ops:
        place_on_cluster(op, cluster)
    before.extend(ops)
    return masked.result


PREFILL_PAIRS_PER_EXPERT = 64
"""The routed pairs per expert (T x K / E, at least, by the plan's G, E and B) from which an expert
loop is prefill's: its first weights are guessed (`guessed_loads`; under uniform routing an
expert is then left unused with probability about exp(-64), where at decode a guess is often
wrong and its loads would take HBM from the loop's own) and a group loop's clusters' copies alternate slot
by slot (`interleaved_slots`). Below it (decode, small batches) neither: interleaved, Qwen3-30B-A3B
T = 64, B = 4, skewed (4 pairs per expert) took 696,526 -> 698,102 cycles, and with 16 as the
bound Mixtral-8x7B T = 64, B = 4, skewed (16 per expert) 2,039,108 -> 2,047,591. Every
prefill row of benchmarks/schedule.py (T >= 2048) has at least 64."""


GUESS_PAIRS_PER_EXPERT = 4
"""The routed pairs per expert (as PREFILL_PAIRS_PER_EXPERT's) from which a chip's first expert loop
guesses its first weights (`guessed_loads`), at decode too: under uniform routing expert c is then
unused with probability about exp(-4), 2% (Qwen3-30B-A3B at T = 64: 512 pairs over 128 experts,
(1 - 8 / 128) ** 64 = 1.6%), and the guessed loads run while the router ranks, HBM otherwise idle,
ending before the routing's ids (MXFP4, B = 4, balanced: 251,784 -> 248,518 cycles; skewed
229,747 -> 226,332; one-expert 89,243 -> 85,361). Below it a guess is
often wrong (T = 1: 8 of 128 experts, expert c used with probability 1 / 16), and a right one in
the benchmarks' balanced routing would be their luck, not the program's."""


def guessed_loads(body: Block, private: list[int], clusters: int, experts: int, own_dma: bool,
                  before: Operation | None = None) -> tuple[dict[tuple[int, int], SSAValue], list[Operation]]:
    """Each cluster's first weight tiles at prefill, loaded before the routing is known: for
    every weight load of the loop's first slot (or block) that the body carries for reuse, the load
    of expert c on cluster c, the first expert c owns whenever the routing uses expert c (the
    canonical layout puts the experts' blocks in ascending order). The loop starts from them as
    its previous ids and tiles, so the first slot reuses them when its expert is c
    (`tile.load_expert` fetches only ids that differ) and loads its own otherwise: the same
    values either way. Only at prefill (PREFILL_PAIRS_PER_EXPERT), on one chip from
    GUESS_PAIRS_PER_EXPERT, or in a mesh chip's first routed loop at decode, in the plan's first
    loop (from block 0); with `before`, only the loads whose weights are made before it (a mesh
    chip's tp bias, masked after the dispatch, is not). Returns the loop's new initial values by
    (cluster, position among `private`) and the ops, for `issue_after_router`."""
    args = list(body.args[1:])
    loads = [op for op in body.walk() if isinstance(op, tile.LoadExpertOp) and op.prev_ids in args
             and (before is None or _made_before(op.source, before))]
    inits: dict[tuple[int, int], SSAValue] = {}
    ops: list[Operation] = []
    if not loads or any(op.prev_tile not in args for op in loads):
        return inits, ops
    for c in range(min(clusters, experts)):
        guess = ve.ConstOp(c, loads[0].ids.type)  # type: ignore[arg-type]
        guess.result.name_hint = f"guessed_expert_cluster{c}"
        made: list[Operation] = [guess]
        for op in loads:  # the same load of expert c, waiting for nothing
            window = None if op.offsets is None else (list(op.window_offsets()), list(shape_of(op.result.type)[1:]))
            new = tile.LoadExpertOp(op.source, guess.result, None, None, [], window)
            new.attributes.update(op.attributes)
            new.location = op.location
            new.result.name_hint = f"{op.result.name_hint}_guessed" if op.result.name_hint else None
            made.append(new)
            assert op.prev_ids is not None and op.prev_tile is not None
            ids_at, tile_at = private.index(args.index(op.prev_ids)), private.index(args.index(op.prev_tile))
            inits[(c, ids_at)], inits[(c, tile_at)] = guess.result, new.result
        for op in made:
            pin(op, c, own_dma)
        ops += made
    return inits, ops


def _made_before(value: SSAValue, op: Operation) -> bool:
    """Whether `value` is an argument or made by an op ahead of `op` in `op`'s block."""
    owner = value.owner
    if not isinstance(owner, Operation):
        return True
    return owner.parent_block() is op.parent_block() and owner.is_before_in_block(op)


def routed_pairs_at_least(blocks: int, experts: int, rows: int) -> int:
    """The fewest routed pairs T x K a plan of `blocks` blocks of `rows` over `experts` experts
    can hold: G = E + (T x K - E) // B when T x K >= E (moe.max_blocks, without a capacity)."""
    return experts + (blocks - experts) * rows if blocks > experts else blocks


def routing_gather(block: Block, loop: scf.ForOp) -> ccl.AllGatherOp | None:
    """The last all-gather before `loop` in `block`: on a mesh chip that all-gathers every token
    (strategy allgather), that of the tokens' expert choices, which the routing waits for."""
    gathers = [op for op in block.ops if isinstance(op, ccl.AllGatherOp) and op.is_before_in_block(loop)]
    return gathers[-1] if gathers else None


def issue_after_router(ops: list[Operation], block: Block, loop: scf.ForOp) -> None:
    """Insert `ops` into `block` right after its last op of the router phase (else right before
    `loop`): engines run their commands in program order, so they take the HBM bandwidth the
    router leaves idle while it contracts and ranks, after the router's own loads, and before
    the routing's and the dispatch's commands, which wait for the router's results."""
    anchor: Operation | None = None
    for op in block.ops:
        if op is loop:
            break
        if phase_of(op) == "router":
            anchor = op
    for op in ops:
        if anchor is None:
            block.insert_op_before(op, loop)
        else:
            block.insert_op_after(op, anchor)
            anchor = op


def _slot_segments(then: Block) -> tuple[list[Operation], list[list[Operation]], list[Operation]] | None:
    """A group's branch (`_expert_groups.GroupLoop`) cut at its slots: the ops up to and with the
    first slot's work (the rows' gather, the first slot's loads and contractions), each later
    slot's ops (the slices and views of its tables, its guard and its `scf.if`), and the rest
    (the stores, the yield); None for a branch not so made (one slot)."""
    ops = list(then.ops)
    if any(isinstance(op, scf.ForOp) for op in ops):
        return None  # the later slots in a loop of their own (_expert_groups.SLOTS_UNROLLED)
    addressing = (tile.SliceOp, tcp.ViewOp, tile.GuardOp)
    first = next((i for i, op in enumerate(ops) if isinstance(op, scf.IfOp)), None)
    if first is None:
        return None
    start = first
    while start > 0 and isinstance(ops[start - 1], addressing):
        start -= 1
    segments: list[list[Operation]] = []
    i = start
    while True:
        j = i
        while j < len(ops) and isinstance(ops[j], addressing):
            j += 1
        if j == len(ops) or not (isinstance(ops[j], scf.IfOp) and isinstance(ops[j].cond.owner, tile.GuardOp)):
            break
        segments.append(ops[i:j + 1])
        i = j + 1
    return (ops[:start], segments, ops[i:]) if segments else None


def interleaved_slots(copies: list[list[Operation]], before: list[Operation],
                      renamed: dict[SSAValue, SSAValue]) -> list[Operation] | None:
    """The clusters' copies of a group loop's body (each its group's `scf.if` on its masked ids,
    last) in an order that alternates the clusters slot by slot: each copy's branch becomes an
    `scf.if` on the same guard holding its rows and first slot, its later slots' ops unguarded
    (a slot's own guard skips it when the group does not run, its expert -1), and an `scf.if`
    holding its stores (else: the branch's own else). Engines run their commands in program
    order and HBM serves them in that order, so with each copy whole the second cluster's loads
    of a group came after all of the first's, and it trailed by a group's DMA (Qwen3-30B-A3B
    T = 2048, B = 128: 14,600 cycles, its last group alone at the end); slot by slot, it
    trails by a slot's. The values the first branch makes for the later ops are its results
    (HBM buffers, or 0, when it does not run: read by nothing then). Returns the body's ops,
    the old branches' results mapped to the new ones in `renamed`; None (nothing changed) for
    copies not so made."""
    parts = []
    for copy in copies:
        branch = copy[-1]
        split = _slot_segments(branch.true_region.block) if isinstance(branch, scf.IfOp) else None
        if split is None or not isinstance(branch.cond.owner, tile.GuardOp):
            return None
        parts.append((copy[:-1], branch, *split))
    if len({len(p[3]) for p in parts}) != 1:
        return None
    crossings: list[list[SSAValue]] = []
    for _, _, prologue, segments, rest in parts:
        inside = {inner for op in prologue for inner in op.walk()}
        later = (inner for op in [*(op for seg in segments for op in seg), *rest] for inner in op.walk())
        crossing = list(dict.fromkeys(v for inner in later for v in inner.operands if v.owner in inside))
        if not all(isinstance(v.type, (IndexType, TensorType)) for v in crossing):
            return None
        crossings.append(crossing)
    firsts: list[Operation] = []
    lasts: list[Operation] = []
    for c, ((_, branch, prologue, segments, rest), crossing) in enumerate(zip(parts, crossings)):
        nothing: dict[Attribute, SSAValue] = {}
        for v in crossing:
            if v.type not in nothing:
                made = (arith.ConstantOp.from_int_and_width(0, IndexType()) if isinstance(v.type, IndexType)
                        else tile.BufferOp("hbm", v.type))
                pin(made, c)
                before.append(made)
                nothing[v.type] = made.results[0]
        later = [op for seg in segments for op in seg] + rest
        readers = {inner for op in later for inner in op.walk()}
        for op in [*prologue, *later]:
            op.detach()
        first = scf.IfOp(branch.cond, [v.type for v in crossing], [Block([*prologue, scf.YieldOp(*crossing)])],
                         [Block([scf.YieldOp(*(nothing[v.type] for v in crossing))])])
        for v, r in zip(crossing, first.results):
            v.replace_uses_with_if(r, lambda use: use.operation in readers)
        last = scf.IfOp(branch.cond, [r.type for r in branch.results], [Block(rest)],
                        [branch.false_region.detach_block(0)])
        for old, new in zip(branch.results, last.results):
            old.replace_all_uses_with(new)
            renamed[old] = new
        for op in (first, last):
            op.attributes.update(branch.attributes)
        firsts.append(first)
        lasts.append(last)
        branch.erase(safe_erase=False)
    slots = [op for k in range(len(parts[0][3])) for p in parts for op in p[3][k]]
    return [*(op for p in parts for op in p[0]), *firsts, *slots, *lasts]


def insert_early(ops: list[Operation], block: Block, user: Operation) -> None:
    """Insert `ops` (in dependency order, all needed before `user`) into `block`, each as early
    as its operands allow: right after the last op of the block defining one of them (an op
    without operands right before its first reader). Engines issue their commands in program
    order, so a cluster's masked expert ids, and the DMA copy another cluster reads them from,
    are issued as soon as the routing has made the ids, not behind the dispatch's commands that
    precede the loop (the blocks' guards read them; the weight loads also wait for the
    dispatch's row indices, schedule-experts' choice, so the loop starts from the dispatch)."""
    placed: set[Operation] = set()
    for op in ops:
        if not op.operands:
            continue
        definers = [v.owner for v in op.operands if isinstance(v.owner, Operation) and v.owner.parent_block() is block]
        if definers:
            last = max(definers, key=block.get_operation_index)
            after = last
            while (following := after.next_op) is not None and following in placed:  # keep `ops`' order
                after = following
            block.insert_op_after(op, after)
        else:
            block.insert_op_before(op, block.first_op or user)
        placed.add(op)
    for op in ops:
        if op.operands:
            continue
        readers = [use.operation for r in op.results for use in r.uses if use.operation.parent_block() is block]
        block.insert_op_before(op, min(readers, key=block.get_operation_index) if readers else user)


def _constant(value: SSAValue) -> int | None:
    owner = value.owner
    if isinstance(owner, arith.ConstantOp) and isinstance(owner.value, IntegerAttr):
        return owner.value.value.data
    return None


def _trip_count(loop: scf.ForOp) -> int | None:
    lb, ub, step = (_constant(v) for v in (loop.lb, loop.ub, loop.step))
    if lb is None or ub is None or not step:
        return None
    return max(0, -(-(ub - lb) // step))


def flops_per_weight_byte(body: Block) -> float:
    """FLOPs a block's contraction does per byte of the weight it reads: 2 x the rows that weight
    meets (a block's, or a group's of several blocks sharing it) over the weight's bytes per
    element (the first contraction of the loop body with a weight operand)."""
    for op in body.walk():
        if isinstance(op, tcp.ContractOp):
            return contraction_flops_per_weight_byte(op)
    return 0.0


def contraction_flops_per_weight_byte(op: tcp.ContractOp | tcp.ScaledContractOp) -> float:
    """FLOPs `op` does per byte of its weight (rhs) as stored: 2 x its rows over the weight's bytes
    per element, a block-scaled weight's scales included (MXFP4's e8m0 per 32 values add 1/16)."""
    bits = stored_bits(op.rhs.type.element_type)  # type: ignore[attr-defined]
    if isinstance(op, tcp.ScaledContractOp):
        scales = op.rhs_scales.type
        bits += stored_bits(scales.element_type) * math.prod(shape_of(scales)) / math.prod(shape_of(op.rhs.type))  # type: ignore[attr-defined]
    return 2 * op.roles().m * 8 / bits


@dataclass
class Made:
    """What split_loop made before a loop, for the next loop of the same plan to read (a group
    loop and the loop of the blocks left over): copies to other clusters, each cluster's masked
    expert ids and row index, and the values made again from them."""

    copies: dict[tuple[int, SSAValue], SSAValue] = field(default_factory=dict)
    owned: dict[tuple[SSAValue, int], SSAValue] = field(default_factory=dict)
    own: dict[int, dict[SSAValue, SSAValue | None]] = field(default_factory=dict)
    regathered: list[tcp.DmaGatherOp] = field(default_factory=list)
    """The gathers made again on each cluster (`regathered`): erased once no loop reads them."""
    guessed: set[SSAValue] = field(default_factory=set)
    """The expert ids whose first group loop was seen (`guessed_loads`: only it starts from block 0)."""
    guessed_on_mesh: bool = False
    """Whether a mesh chip's first routed loop at decode guessed its first weights (only it does)."""


def split_loop(loop: scf.ForOp, clusters: int, own_dma_intensity: int = 0, made: Made | None = None) -> scf.ForOp:
    """Rebuild `loop` with one guarded copy of its body per cluster (see the docstring); its
    DMA on each cluster's own engines if a block does at least `own_dma_intensity` FLOPs per
    weight byte (0: never); a group loop reuses what an earlier loop `made`."""
    made = Made() if made is None else made
    body = loop.body.block
    own_dma = 0 < own_dma_intensity <= flops_per_weight_byte(body)
    yielded = body.last_op
    assert isinstance(yielded, scf.YieldOp)
    loads = [op for op in body.walk() if isinstance(op, tile.LoadExpertOp)]
    # The body's slice of the loop's expert ids: what its skip guard reads (a group's blocks, whose
    # weight loads read the group's distinct experts), else what its weight loads are indexed by.
    guards = [op for op in body.ops if isinstance(op, tile.GuardOp)]
    ids_tile = guards[0].ids if guards else loads[0].ids
    slice_op = ids_tile.owner
    expert_ids = addressed(ids_tile)
    # A group's loop (schedule-experts{order=tile}) reads its ids through tables made from them
    # before the loop: each cluster makes its own from its masked ids (`derived`).
    grouped = not (isinstance(slice_op, tile.SliceOp) and slice_op.source is expert_ids)
    if not grouped and slice_op.parent_block() is not body:
        raise ValueError("split-clusters: the expert loop's weight loads are not indexed by the block's expert id")
    index, *old_args = body.args
    # A carried value is a result buffer (shared by every cluster) when the body yields a store into it.
    shared = [i for i, v in enumerate(yielded.operands) if _is_stored(v)]
    if any(not in_hbm(loop.iter_args[i]) for i in shared):
        return loop  # results kept in SRAM (one token's, the docstring): the loop stays on cluster 0
    private = [i for i in range(len(old_args)) if i not in shared]
    for i in private:
        if loop.results[i].uses:
            raise ValueError("split-clusters: a loop result other than a stored buffer is used after the loop")
    phase = loop.attributes.get(PHASE_ATTR)
    by_block = phase == StringAttr(SHARED)
    blocks = _trip_count(loop)
    if by_block and blocks is not None and blocks < clusters:
        pin(loop, clusters - 1)  # one block (decode): on the last cluster, beside the routing on cluster 0
        return loop
    # A shared expert's loop gets here with a block per cluster; a routed one needs as many experts.
    experts = shape_of(loads[0].source.type)[0]
    own_dma = own_dma and (by_block or blocks is None or min(experts, blocks) >= clusters)

    before: list[Operation] = []
    reach = reacher(before, made.copies)

    unrolled = by_block and blocks is not None and blocks % clusters == 0
    if unrolled:  # each copy has a block of its own: no masks, no guards
        guarded = False
        owned: tuple[SSAValue, ...] = tuple(expert_ids for _ in range(clusters))
        step = arith.ConstantOp.from_int_and_width(clusters * _constant(loop.step), IndexType())
        before.append(step)
    else:
        # Row loads and stores outside an scf.if need a guard of their own: whether c owns the block.
        guarded = any(isinstance(op, (tile.LoadOp, tile.GatherOp, tile.StoreOp)) for op in body.ops)
        if grouped and all((expert_ids, c) in made.owned for c in range(clusters)):
            owned = tuple(made.owned[(expert_ids, c)] for c in range(clusters))
        else:
            owned, block_guards = zip(*(_owned_ids(reach(expert_ids, c), c, clusters, before, guarded, by_block)
                                        for c in range(clusters)))
            made.owned.update(((expert_ids, c), v) for c, v in enumerate(owned))
    # A group's row index (a gather of several blocks' rows at once): each cluster's own rows only.
    group_rows = [] if not grouped else list(dict.fromkeys(
        addressed(g.indices) for g in body.walk() if isinstance(g, tile.GatherOp)))
    inits = list(loop.iter_args)
    firsts: dict[tuple[int, int], SSAValue] = {}
    guessed: list[Operation] = []
    row_index = group_rows[0] if group_rows else next(
        (addressed(g.indices) for g in body.walk() if isinstance(g, tile.GatherOp)), None)
    pairs = 0 if row_index is None else routed_pairs_at_least(shape_of(expert_ids.type)[0], experts,
                                                              shape_of(row_index.type)[1])
    prefill = pairs >= PREFILL_PAIRS_PER_EXPERT * experts
    # A block loop guesses only with block-scaled experts (they keep block order, `groupable`): bf16 ones
    # took longer so (Llama-4-Scout T = 1024, B = 128, its shared expert interleaved: 49,082 -> 50,856 cycles).
    scaled = any(isinstance(op, tcp.ScaledContractOp) for op in body.walk())
    # Nor beside a shared expert at prefill: its loads need no routing and take the HBM the routing leaves idle,
    # surely used, where guessed loads issued first delay them (DeepSeek-V3 MXFP4 T = 2048: 13,197,655 -> 13,229,918).
    parent = loop.parent_block()
    assert parent is not None
    beside_shared = any(phase_of(op) == SHARED for op in parent.ops)
    waited = ccl.first_all_to_all_done(parent) or routing_gather(parent, loop)
    # A mesh chip's first routed loop at decode streams its weights: it guesses them while the link moves the tokens
    # (or, all-gathered, the tokens' expert choices).
    on_mesh = (not prefill and not by_block and waited is not None and not made.guessed_on_mesh
               and flops_per_weight_byte(body) < own_dma_intensity)
    # One chip at decode guesses where expert c is almost surely used (GUESS_PAIRS_PER_EXPERT).
    likely = prefill or pairs >= GUESS_PAIRS_PER_EXPERT * experts and waited is None
    if expert_ids not in made.guessed:
        made.guessed.add(expert_ids)  # the plan's first loop, from block 0: its first block's expert is the lowest
        if likely and (grouped or scaled) and not beside_shared or on_mesh:
            firsts, guessed = guessed_loads(body, private, clusters, experts, own_dma, waited if on_mesh else None)
            made.guessed_on_mesh = on_mesh
    new_inits = [inits[i] for i in shared] + [firsts.get((c, k), inits[i]) for c in range(clusters)
                                              for k, i in enumerate(private)]
    new_body = Block(arg_types=[index.type, *(v.type for v in new_inits)])
    new_index, *new_args = new_body.args
    new_index.name_hint = index.name_hint
    shared_args = dict(zip(shared, new_args[:len(shared)]))
    chain: dict[int, SSAValue] = dict(shared_args)
    private_yields: list[SSAValue] = []
    defined_in_body = {r for op in body.walk() for r in op.results} | set(body.args)
    for region_op in body.walk():
        for region in region_op.regions:
            for blk in region.blocks:
                defined_in_body |= set(blk.args)

    copies: list[list[Operation]] = []
    for c in range(clusters):
        copy: list[Operation] = []
        copies.append(copy)
        mapping: dict[SSAValue, SSAValue] = {index: new_index}
        own: dict[SSAValue, SSAValue | None] = made.own.setdefault(c, {}) if grouped else {}
        if grouped:  # the ids, and a group's rows, as this cluster owns them
            own[expert_ids] = owned[c]
            for tokens in group_rows:
                if own.get(tokens) is None:
                    own[tokens] = _owned_rows(reach(tokens, c), owned[c], c, before, tokens.name_hint)
        if unrolled:  # copy c runs block index + N - 1 - c: the last cluster takes the first
            offset = arith.ConstantOp.from_int_and_width(clusters - 1 - c, IndexType())
            block_index = arith.AddiOp(new_index, offset.result)
            block_index.result.name_hint = f"{index.name_hint}_c{c}" if index.name_hint else None
            for op in (offset, block_index):
                pin(op, c)
                copy.append(op)
            mapping[index] = block_index.result
        mapping.update({old_args[i]: chain[i] for i in shared})
        cluster_args = new_args[len(shared) + c * len(private):len(shared) + (c + 1) * len(private)]
        mapping.update({old_args[i]: a for i, a in zip(private, cluster_args)})
        for a, old in zip(cluster_args, (old_args[i] for i in private)):
            a.name_hint = f"{old.name_hint}_c{c}" if old.name_hint else None
        block_guard: SSAValue | None = None
        if guarded:
            owns = tile.SliceOp(block_guards[c], new_index, ids_tile.type)
            owns.result.name_hint = "block_is_mine" if c == 0 else f"block_is_mine_c{c}"
            pin(owns, c, own_dma)
            if phase is not None:
                owns.attributes[PHASE_ATTR] = phase
            copy.append(owns)
            block_guard = owns.result

        for op in body.ops:
            if op is yielded:
                break
            for inner in op.walk():
                for operand in inner.operands:
                    if read_in_place(inner, operand):
                        continue
                    if operand not in defined_in_body and operand not in mapping:
                        mapping[operand] = (derived(operand, own, c, before) or regathered(operand, expert_ids, owned[c], c, before, made)
                                            or reach(operand, c))
            if op is slice_op and not grouped:
                new: Operation = tile.SliceOp(owned[c], mapping[index], ids_tile.type)
            elif isinstance(op, tile.LoadOp):
                new = tile.LoadOp(mapping[op.source], mapping[op.offset], op.result.type,
                                  [mapping[a] for a in op.after], guard=block_guard)
            elif isinstance(op, tile.GatherOp):
                new = tile.GatherOp(mapping.get(op.source, op.source), mapping[op.indices],
                                    [mapping[a] for a in op.after], guard=block_guard)
            elif isinstance(op, tile.StoreOp) and op.offsets is None:  # (a window store writes the body's own buffer)
                new = tile.StoreOp(mapping[op.tile], mapping[op.dest], mapping[op.offset], guard=block_guard)
            else:
                new = op.clone(value_mapper=mapping)
            for key, attr in op.attributes.items():
                new.attributes.setdefault(key, attr)
            for old_r, new_r in zip(op.results, new.results):
                new_r.name_hint = old_r.name_hint
                mapping[old_r] = new_r
            pin(new, c, own_dma)
            copy.append(new)
        for i in shared:
            chain[i] = mapping[yielded.operands[i]]
        private_yields += [mapping[yielded.operands[i]] for i in private]
    renamed: dict[SSAValue, SSAValue] = {}
    slotted = interleaved_slots(copies, before, renamed) if grouped and prefill else None
    chain = {i: renamed.get(v, v) for i, v in chain.items()}
    private_yields = [renamed.get(v, v) for v in private_yields]
    if unrolled:  # the copies' commands interleaved: each engine serves both clusters' blocks in turn
        new_body.add_ops(op for ops in zip(*copies) for op in ops)
    elif slotted is not None:
        new_body.add_ops(slotted)
    else:
        new_body.add_ops(op for ops in copies for op in ops)
    new_body.add_op(scf.YieldOp(*(chain[i] for i in shared), *private_yields))

    new_loop = scf.ForOp(loop.lb, loop.ub, step if unrolled else loop.step, new_inits, new_body)
    new_loop.attributes.update(loop.attributes)
    for op in before:
        if phase is not None:
            op.attributes.setdefault(PHASE_ATTR, phase)
    parent.insert_op_before(new_loop, loop)
    # The scales' gathers, read first by the first block's contraction, which also waits for the
    # dispatch's row gathers, go last: issued as early as the ids allow, they took three engines
    # ahead of the dispatch's scatters of the row marks, which then ran in two rounds.
    gathers = [op for op in before if isinstance(op, tcp.DmaGatherOp)]
    insert_early([op for op in before if op not in gathers], parent, new_loop)
    for op in gathers:
        parent.insert_op_before(op, new_loop)
    for op in guessed:
        if phase is not None:
            op.attributes.setdefault(PHASE_ATTR, phase)
    if on_mesh:
        assert waited is not None
        for op in guessed:
            parent.insert_op_before(op, waited)
    else:
        issue_after_router(guessed, parent, new_loop)
    for k, i in enumerate(shared):
        loop.results[i].replace_all_uses_with(new_loop.results[k])
    loop.detach()
    loop.erase()
    for gather in made.regathered:
        if gather.parent is not None and not gather.result.uses:
            gather.detach()
            gather.erase()
    return new_loop


def tokens_own(block: Block) -> list[Operation]:
    """The dispatch's ops of `block` that read only the tokens as loaded (`tcp.load`),
    constants and each other: the tokens' own quantization (lower-dispatch{quantize=tokens}),
    which no routing result feeds, with the constants only they read. A mesh chip's
    collectives (a chunk's tokens sent as loaded) are not: they stay with the dispatch."""
    found: list[Operation] = []
    for op in block.ops:
        if phase_of(op) != "dispatch" or not op.operands or op.dialect_name() == "ccl":
            continue
        owners = [v.owner for v in op.operands if isinstance(v.owner, Operation)]
        if any(o in found or isinstance(o, tcp.LoadOp) for o in owners) and all(
                o in found or isinstance(o, tcp.LoadOp) or not o.operands for o in owners):
            found.append(op)
    inside = set(found)
    consts = {o for op in found for v in op.operands if isinstance(o := v.owner, Operation) and not o.operands
              and phase_of(o) == "dispatch" and all(u.operation in inside for r in o.results for u in r.uses)}
    return [op for op in block.ops if op in inside or op in consts]


def quantize_beside_routing(block: Block, clusters: int) -> None:
    """The tokens' quantization, made whole before the expert loop, on the last cluster right
    after the router's last op, from its own load of the tokens, when the router's token loop
    spreads over the clusters (prefill): it runs there while cluster 0 computes the routing,
    where on cluster 0 it followed the routing and the dispatch's index (Qwen3-30B-A3B fp8,
    cost-only, balanced: T = 2048 619,387 -> 618,369 cycles, T = 4096 921,604 -> 914,513).
    A load of the tokens only the quantization reads moves with it, where a second load would
    cross HBM again: load-arguments put it before its first reader, after the routing, when the
    router's loop loads its own tiles (DeepSeek-V3 fp8, T = 2048, B = 64: 9,033,204 cycles with a
    second load, 9,013,664 with the quantization left on cluster 0, 8,993,467 with the load moved).
    Where the router's loop also reads the tokens' copy, the quantization loads its own, and the
    router's tiles on cluster 0, the copy's only readers then, load their rows from HBM
    (`load_sliced_rows`) rather than wait for all T rows (Qwen3-30B-A3B fp8, cost-only, balanced:
    T = 2048 614,475 -> 612,354 cycles, T = 4096 911,783 -> 903,711)."""
    ops = tokens_own(block)
    inside = set(ops)
    alone = {o for op in ops for v in op.operands if isinstance(o := v.owner, tcp.LoadOp)
             and all(u.operation in inside for u in v.uses)}
    router = [op for op in block.ops if phase_of(op) == "router" and op not in alone]
    last = clusters - 1
    if not ops or not any(isinstance(op, scf.ForOp) and any(cluster_of(o) == last for o in op.walk()) for op in router):
        return  # the router on one cluster (decode): the quantization stays where it was
    ordered = list(block.ops)
    before = set(ordered[:ordered.index(router[-1]) + 1])
    # Only ops after the router move (to just after it, earlier): one before it (a mesh chip's
    # chunk of tokens, sliced for the dispatch's scatter) has readers there, which it would follow.
    ops = [op for op in ops if op not in before]
    moved = set(ops)
    if not ops or any(isinstance(o := v.owner, Operation) and o not in moved and o not in before
                      and not isinstance(o, tcp.LoadOp) for op in ops for v in op.operands):
        return
    at = router[-1]
    loads: dict[SSAValue, SSAValue] = {}
    copies: list[tcp.LoadOp] = []  # the router's copies of the tokens, which the quantization no longer reads
    for op in ops:
        for i, v in enumerate(op.operands):
            if isinstance(load := v.owner, tcp.LoadOp) and v not in loads:
                if load in alone and all(u.operation in moved for u in v.uses):
                    load.detach()
                else:
                    copies.append(load)
                    load = tcp.LoadOp(load.operands[0])
                    load.result.name_hint = f"{v.name_hint}_c{last}" if v.name_hint else None
                load.attributes[PHASE_ATTR] = StringAttr("dispatch")
                block.insert_op_after(load, at)
                pin(load, last)
                at = load
                loads[v] = load.result
            if v in loads:
                op.operands[i] = loads[v]
        op.detach()
        block.insert_op_after(op, at)
        pin(op, last)
        at = op
    for copy in copies:
        load_sliced_rows(copy)


def own_dma_intensity(machine: Machine) -> int:
    """FLOPs per weight byte from which a block's contraction on one cluster outlasts its weight
    load at the whole chip's HBM bandwidth: a cluster's peak over the HBM bandwidth, rounded
    up (RNGD: 131,072 FLOPs per cycle over 1,500 B per cycle, 88)."""
    return math.ceil(machine.peak_flops_per_cycle / machine.hbm_bytes_per_cycle)


@dataclass(frozen=True)
class SplitClustersPass(ModulePass):
    name = "split-clusters"

    clusters: int = 0
    """Clusters to spread over (0, the default: the target chip's; RNGD: 2); 1 leaves the
    loops as they are."""

    own_dma_intensity: int | None = None
    """FLOPs per weight byte from which a block's contraction on its cluster outlasts its weight
    load at the chip's whole HBM bandwidth, so each cluster's copy issues its DMA on its own
    engines (`tcpc.own_dma`) and never queues behind the other's (None, the default: the
    target's, `own_dma_intensity`; RNGD 88). Below it the copies share every engine: the loads
    stream back to back, and a cluster with more blocks (skewed routing) takes the bandwidth
    the other leaves. 0: never."""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        machine = machine_of(op)
        clusters = self.clusters or machine.clusters
        if clusters & (clusters - 1):
            raise ValueError(f"split-clusters: clusters={clusters} is not a power of two")
        if clusters == 1:
            return
        intensity = own_dma_intensity(machine) if self.own_dma_intensity is None else self.own_dma_intensity
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks:
                tokens = token_loops(fn.body.block)
                made = Made()
                for loop in expert_loops(fn.body.block):
                    split_loop(loop, clusters, intensity, made)
                for loop in tokens:
                    split_token_loop(loop, clusters)
                quantize_beside_routing(fn.body.block, clusters)
