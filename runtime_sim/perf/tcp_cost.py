"""Cost formulas of the `tcp` ops: DMA commands and the contraction engine.

Every number comes from the machine file (see machines/rngd.toml for its source). Formulas:

DMA (book, "DMA Engine"; docs/hardware.md#moving-data). One part of a command runs on one engine:
    part cycles = startup + requests of the part * request_bytes / engine bytes-per-cycle
    requests    = max(read requests, write requests)   across tiers (HBM <-> SRAM)
                = read requests + write requests        within a tier (HBM -> HBM, SRAM -> SRAM)
  The book's worked figures (tcpc/fidelity.py reproduces them through these functions): an
  HBM -> HBM move serialises its phases (16 KB: 64 read + 64 write 256-byte requests + 500
  cycles ~ 628 cycles, Example 1), as does a same-cluster DM -> DM copy (16 MB: 65,536 +
  65,536 + 500 ~ 131,572, Example 3); an HBM -> DM transfer pipelines them ("Cross-tier
  transfers like HBM <-> DM pipeline the read and write phases": max(65,536 reads, 65,536
  writes) + 500 ~ 66,036 cycles on one engine, Example 2).
  A command moving more than the machine's `dma.split_bytes` is cut into several (assumption,
  machines/rngd.toml: a compiler issues a large transfer as several commands): pieces of
  split_bytes, the last one smaller, one engine each, parts = min(engines, ceil(bytes /
  split_bytes)); beyond one piece per engine, the bytes are spread evenly over all of them. So
  the largest part moves min(bytes, max(split_bytes, bytes / engines)), in whole requests
  (`largest_part_requests`), which never shrinks when the command grows: a bigger transfer is
  never faster (spreading evenly over floor(bytes / split_bytes) parts, the rule before, made a
  2 MB copy twice as fast as a 2 MB - 1 B one). Each part pays its own start-up and the parts
  run in parallel, so the command takes its largest part's cycles and occupies `parts` engines
  (`dma_parts` is the one rule, used for the tcp ops here and for the memory plan's spills,
  reloads and streams). The cost also gives its parts' cycles on fewer engines, 1 .. parts
  (`OpCost.part_cycles`, `part_hbm_bytes`: the same rule with fewer engines, fewer, larger
  parts); the scheduler takes the spread that ends it first given the engines free and the HBM
  bandwidth the commands before it booked.
  HBM bandwidth is shared by the DMA commands in flight (book, DMA Engine, "Memory Bandwidth":
  "Each DMA Engine moves up to 256 B/cycle on its own. HBM bandwidth is shared across all
  engines transferring HBM data, so an aggregate saturating HBM is bounded by the 1.5 TB/s HBM
  peak rather than by any per-engine sum"). The scheduler books it in issue order
  (`hbm_sharing`, scheduler.SharedBandwidth): after its start-up a part moves its HBM bytes at
  its engine's own rate (its HBM bytes over its transfer cycles: 256 B/cycle on RNGD) or at an
  equal share, with the other parts of its command, of what the commands issued before it
  leave, whichever is less, and always leaves every DMA engine not moving HBM data a floor of
  half its equal share of HBM (hbm bytes-per-cycle / (2 x engines), 94 B/cycle on RNGD; an
  assumption, docs/hardware.md#not-public-the-assumptions: the book does not say how HBM is
  arbitrated; the floor keeps a command issued later from starving and leaves a lone engine
  its full rate).
  So a lone engine runs at its 256 B/cycle (Example 2, 66,036 cycles; the rule before capped
  every engine at 1/8 of HBM, 187.5 B/cycle, even alone: 89,479), the engines together never
  move more than 1,500 B/cycle, and a command spread over all eight runs at 1/8 of HBM each,
  after its start-up (16 MB: 500 + 11,185 cycles; the rule before, 11,185, overlapped the
  start-up with the transfer). A command never slows one issued before it (one pass, in issue
  order: nothing placed earlier moves), so when HBM is short the earlier command goes first
  where the hardware would share evenly; the total is the same. The cost's `cycles` is the
  command's time with no other DMA command moving HBM data (`dma_cycles`); the report gives its
  scheduled time, and names `hbm` the bound of a command the sharing slowed.
  Rows are moved in whole requests: a row of r bytes costs
  ceil(r / request_bytes) requests to read and as many to write. Gathers and scatters cost by
  their runtime indices: index -1 rows move nothing (but the command still starts); a gather
  row equal to the previous row is not moved again (consecutive blocks of one expert reuse the
  weight already in SRAM). A scatter reads each source row once however many places it goes;
  the zero fill of the rows nobody writes is assumed free (buffers are allocated zeroed).

Contraction (book, Computing Tensors: "Contraction Engine" and its sections; per command, on one
cluster, all slices in lockstep): the command's mapping onto Slice, Lane, Time and Packet, the
op's `mapping` attribute (map-contractions' choice, or a hand-written one, checked against the
machine) or, where none is given, the one `target.contraction_mapping.choose` picks (the same
choice the pass makes), costed stage by stage by `target.contraction_mapping.cost`:
    cycles = config_overhead + guards * guard_cycles
             + [tree_depth + the mapping's cycles x blocks run / blocks]   if a block runs
A block whose guard is negative costs only its guard; the blocks that run share the mapping's
passes in proportion. An accumulator operand (`acc`, f32: a contraction tiled along K continuing
the previous tile's sum) is read back through fetch like the partial sums of a K chunk. `bound`
names the stage whose cycles are largest, or "overhead" when the fixed cycles outweigh it. The
bias add rides in the chain's vector stage (no cycles; one FLOP per result element).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import numpy as np
from xdsl.ir import Operation

from dialects import tcp
from dialects.tensor_types import code_tile_bytes, shape_of
from runtime_sim.perf.cost_model import (DMA, TENSOR, OpCost, free_cost, guard_signs, in_hbm, register_alias,
                                         register_cost, register_cost_key, register_data_operands,
                                         register_order_operands, register_view)
from runtime_sim.perf.cost_model import per_op
from target.contraction_mapping import ContractionShape, MappedCost, Mapping, MappingError, check, choose, cost
from runtime_sim.perf.scheduler import SharedBandwidth
from target.machine import Machine
from runtime_sim.semantics.numerics import code3, float4_e2m1, stored_nbytes


def requests(nbytes: int, machine: Machine) -> int:
    """DMA requests needed to move one contiguous piece of `nbytes`."""
    return -(-nbytes // machine.dma_request_bytes)


def largest_part_requests(machine: Machine, payload_requests: int, engines: int | None = None) -> int:
    """Requests (of the payload, one direction) the largest part of a DMA command moving
    `payload_requests` over at most `engines` engines (default all) carries: all of them up to
    `dma.split_bytes`; one piece of split_bytes while there are engines for every piece; then
    an even share of every engine. Never decreasing in the payload, never increasing in the
    engines."""
    piece = requests(machine.dma_split_bytes, machine)
    if payload_requests <= piece:
        return payload_requests
    return max(piece, -(-payload_requests // (engines or machine.dma_engines)))


def dma_parts(machine: Machine, nbytes: int) -> int:
    """How many engines a DMA command moving `nbytes` is spread over: one piece of the
    machine's `dma.split_bytes` per engine (the last piece smaller), at most every engine. The
    one split rule of every DMA command (a part is a run of whole requests, so a large row is
    cut too)."""
    pieces = -(-requests(nbytes, machine) // requests(machine.dma_split_bytes, machine))
    return max(1, min(machine.dma_engines, pieces))


def hbm_sharing(machine: Machine) -> SharedBandwidth:
    """How the DMA engines share HBM bandwidth (the module docstring): booked by the scheduler
    in issue order, a floor of half an engine's equal share kept for every engine not moving
    HBM data, each part starting its transfer after the command's start-up."""
    per_cycle = machine.hbm_bytes_per_cycle
    return SharedBandwidth(DMA, per_cycle, per_cycle / (2 * machine.dma_engines), machine.dma_startup_cycles)


def dma_part_cycles(machine: Machine, read_requests: int, write_requests: int, payload_bytes: int,
                    cross_tier: bool, engines: int | None = None) -> int:
    """Cycles of the largest part of a DMA command moving `payload_bytes` over at most `engines`
    engines (default all) on its own engine: its start-up, then its requests at the engine's
    rate (a cross-tier command pipelines its reads and writes)."""
    m = machine
    payload = requests(payload_bytes, m)
    issued = max(read_requests, write_requests) if cross_tier else read_requests + write_requests
    per_part = -(-issued * largest_part_requests(m, payload, engines) // payload) if payload else issued
    return m.dma_startup_cycles + math.ceil(per_part * m.dma_request_bytes / m.dma_bytes_per_cycle)


def part_hbm_bytes(machine: Machine, hbm_bytes: int, payload_bytes: int, engines: int | None = None) -> int:
    """The HBM bytes of the largest part of a DMA command moving `payload_bytes` (`hbm_bytes` of
    them through HBM) over at most `engines` engines (default all)."""
    payload = requests(payload_bytes, machine)
    if not payload:
        return hbm_bytes
    return -(-hbm_bytes * largest_part_requests(machine, payload, engines) // payload)


def alone_cycles(machine: Machine, part_cycles: int, hbm_bytes: int, parts: int) -> tuple[int, str]:
    """Cycles of a DMA command of `parts` parts, each taking `part_cycles` on its engine and
    moving `hbm_bytes` through HBM, while no other command moves HBM data, and the term that
    bounds it: `hbm` when its parts' share of HBM (the module docstring) makes it slower."""
    m = machine
    cycles = hbm_sharing(m).alone(part_cycles, hbm_bytes, parts, m.dma_engines)
    if cycles > part_cycles:
        return cycles, "hbm"
    transfer = part_cycles - m.dma_startup_cycles
    return cycles, "dma startup" if m.dma_startup_cycles >= transfer else "dma bandwidth"


def dma_cycles(machine: Machine, read_requests: int, write_requests: int, hbm_bytes: int,
               payload_bytes: int, cross_tier: bool = False, engines: int | None = None) -> tuple[int, str]:
    """Cycles of one DMA command moving `payload_bytes` spread over at most `engines` engines
    (default `dma_parts` of them) while no other command moves HBM data, and the term that
    bounds it (see the module docstring): a cross-tier command pipelines its reads and writes."""
    parts = min(engines or machine.dma_engines, dma_parts(machine, payload_bytes))
    return alone_cycles(machine, dma_part_cycles(machine, read_requests, write_requests, payload_bytes, cross_tier,
                                                 engines),
                        part_hbm_bytes(machine, hbm_bytes, payload_bytes, engines), parts)


def with_hbm_bytes(machine: Machine, cost: OpCost, hbm_bytes: int, payload_bytes: int) -> OpCost:
    """A DMA command's cost (its parts' engine cycles in `cost.part_cycles`) when it moves
    `hbm_bytes` through HBM: each part's HBM bytes on 1 .. parts engines, its cycles alone
    and their bound."""
    parts = cost.parts
    by_parts = tuple(part_hbm_bytes(machine, hbm_bytes, payload_bytes, k) for k in range(1, parts + 1))
    cycles, bound = alone_cycles(machine, cost.part_cycles[-1], by_parts[-1], parts)
    return replace(cost, cycles=cycles, bound=bound, hbm_bytes=hbm_bytes, part_hbm_bytes=by_parts if hbm_bytes else ())


@functools.lru_cache(maxsize=4096)  # a loop's commands ask for the same few again and again
def dma_command_cost(machine: Machine, read_requests: int, write_requests: int, hbm_bytes: int,
                     payload_bytes: int, cross_tier: bool, bytes_moved: int, result_bytes: int,
                     engines: int | None = None) -> OpCost:
    """The cost of one DMA command over `dma_parts` engines (at most `engines`), with its parts'
    cycles and HBM bytes on fewer engines (`OpCost.part_cycles`, `part_hbm_bytes`: the
    scheduler spreads it over the engines free when it is ready, fewer parts each moving more;
    see scheduler.py)."""
    parts = min(engines or machine.dma_engines, dma_parts(machine, payload_bytes))
    part_cycles = tuple(dma_part_cycles(machine, read_requests, write_requests, payload_bytes, cross_tier, k)
                        for k in range(1, parts + 1))
    cost = OpCost(DMA, part_cycles[-1], bytes_moved=bytes_moved, result_bytes=result_bytes, parts=parts,
                  part_cycles=part_cycles)
    return with_hbm_bytes(machine, cost, hbm_bytes, payload_bytes)


def dma_rows_cost(machine: Machine, rows_read: int, rows_written: int, row_bytes: int,
                  src_hbm: bool, dst_hbm: bool, pieces: int = 1) -> OpCost:
    """A DMA command moving whole rows: `rows_read` rows read, `rows_written` rows written,
    each row `pieces` equal contiguous pieces (a window of a row: each piece in whole requests)."""
    per_row = pieces * requests(row_bytes // pieces, machine)
    reads, writes = rows_read * per_row, rows_written * per_row
    hbm = (reads if src_hbm else 0) + (writes if dst_hbm else 0)
    hbm_bytes = hbm * machine.dma_request_bytes
    payload = max(rows_read, rows_written) * row_bytes
    return dma_command_cost(machine, reads, writes, hbm_bytes, payload, src_hbm != dst_hbm,
                            (rows_read + rows_written) * row_bytes, rows_written * row_bytes)


def dma_copy_cost(machine: Machine, nbytes: int, src_hbm: bool, dst_hbm: bool, engines: int | None = None) -> OpCost:
    """One contiguous copy of `nbytes` (load, store, spill, reload, stream), on at most
    `engines` engines (default: as many as the split rule gives; the book's worked examples
    run on one)."""
    n = requests(nbytes, machine)
    hbm_bytes = ((n if src_hbm else 0) + (n if dst_hbm else 0)) * machine.dma_request_bytes
    return dma_command_cost(machine, n, n, hbm_bytes, nbytes, src_hbm != dst_hbm, 2 * nbytes, nbytes, engines)


def gathered_rows(indices: np.ndarray) -> int:
    """Rows a gather moves: index -1 is skipped, and a row equal to the previous index (in
    row-major order of the index tensor) is reused rather than moved again."""
    flat = np.asarray(indices).reshape(-1)
    if flat.size == 0:
        return 0
    changed = np.concatenate(([True], flat[1:] != flat[:-1]))
    return int(np.count_nonzero(changed & (flat >= 0)))


def row_bytes(value: np.ndarray) -> int:
    """Bytes of one row at the stored width (f4e2m1: two values per byte; u3 codes: their
    16 x 16 tiles of 96 bytes)."""
    elements = int(math.prod(value.shape[1:]))
    if value.dtype == code3:
        return code_tile_bytes(value.shape[1:])
    if value.dtype == float4_e2m1:
        return -(-elements // 2)
    return elements * value.dtype.itemsize


def cost_dma_gather(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    source, indices = operands
    rows = gathered_rows(indices)
    return dma_rows_cost(machine, rows, rows, row_bytes(source), in_hbm(op.operands[0]), in_hbm(op.results[0]))


def cost_dma_scatter(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    source, indices = operands
    per_row = np.asarray(indices).reshape(indices.shape[0], -1) >= 0
    read = int(np.count_nonzero(per_row.any(axis=1)))
    written = int(np.count_nonzero(per_row))
    return dma_rows_cost(machine, read, written, row_bytes(source), in_hbm(op.operands[0]), in_hbm(op.results[0]))


def cost_load(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    return dma_copy_cost(machine, stored_nbytes(operands[0]), in_hbm(op.operands[0]), False)


def cost_store(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    return dma_copy_cost(machine, stored_nbytes(operands[0]), in_hbm(op.operands[0]), True)


@per_op
def mapped_cost(op: tcp.ContractOp | tcp.ScaledContractOp, machine: Machine) -> MappedCost:
    """The cost of `op`'s mapping: its `mapping` attribute checked against `machine`, or the
    cheapest legal one. A mapping that breaks a rule is a MappingError naming the op."""
    roles = op.roles()
    shape = ContractionShape.of(roles)
    if op.mapping is None:
        return choose(shape, machine).best
    mapping = Mapping(**op.mapping.fields())  # type: ignore[arg-type]
    try:
        check(mapping, shape, machine)
    except MappingError as e:
        raise MappingError(f"{op.name} ({', '.join(f'{v}={getattr(roles, r)}' for r, v in roles.letters.items())}): "
                           f"{e} (machine {machine.name})") from None
    return cost(mapping, shape, machine)


def command_cycles(machine: Machine, mapped: MappedCost, *, blocks: int, blocks_run: int, guards: int,
                   tree_depth: int, extra: dict[str, int] | None = None) -> tuple[int, str]:
    """Cycles of one contraction command and its bound (see the module docstring): the mapped
    passes of the blocks that run, after the fixed configuration, guards and the tree's fill;
    `extra` stages (the scales of a scaled contraction) run pipelined with the passes."""
    m = machine
    fixed = m.config_overhead_cycles + guards * m.guard_cycles
    if blocks_run == 0:
        return fixed, "guard (every block skipped)"
    terms = {mapped.bound: -(-mapped.cycles * blocks_run // blocks)} | (extra or {})
    bound = max(terms, key=lambda k: terms[k])  # first of equals: the mapping's stage wins ties
    work = terms[bound]
    fill = fixed + tree_depth
    return fill + work, bound if work > fill else "overhead"


def cost_contract(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    assert isinstance(op, tcp.ContractOp)
    lhs, rhs, *optional = operands
    bias = optional.pop(0) if op.bias is not None else None
    guard = optional.pop(0) if op.guard is not None else None
    acc = optional.pop(0) if op.acc is not None else None
    out = results[0]
    spec = op.spec.data
    a, b, o = spec.replace("->", ",").split(",")
    per_element = tcp.contracted_size(spec, shape_of(op.lhs.type), shape_of(op.rhs.type))
    blocks = out.shape[0] if guard is not None else 1
    run = int(np.count_nonzero(np.asarray(guard) >= 0)) if guard is not None else 1

    def share(nbytes: int, blocked: bool) -> int:
        """The bytes of an operand the running blocks read: a per-block operand only for the
        blocks that run, a shared one once (if any block runs)."""
        if guard is None:
            return nbytes
        return nbytes * run // blocks if blocked else (nbytes if run else 0)

    block_letter = o[:1]
    fetch = share(lhs.nbytes, a[:1] == block_letter) + share(rhs.nbytes, b[:1] == block_letter)
    if bias is not None:
        fetch += share(bias.nbytes, bias.ndim == out.ndim and bias.shape[0] == blocks and blocks > 1)
    if acc is not None:
        fetch += share(acc.nbytes, True)
    commit = share(out.nbytes, True)
    out_elements = out.size * run // blocks
    macs = out_elements * per_element
    adds = out_elements if bias is not None else 0
    mapped = mapped_cost(op, machine)
    # The roofline counts a bias add as a FLOP at the tensor peak, so the command is never
    # faster than (MACs + adds / 2) at the peak MAC rate, though the add rides in the chain.
    floor = {"compute": math.ceil((macs + adds / 2) / machine.peak_macs_per_cycle)} if adds else {}
    cycles, bound = command_cycles(machine, mapped, blocks=blocks, blocks_run=run,
                                   guards=blocks if guard is not None else 0, tree_depth=machine.tree_depth_cycles,
                                   extra=floor)
    return OpCost(TENSOR, cycles, bytes_moved=fetch + commit, flops=2 * macs + adds, bound=bound)


def cost_scaled_contract(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...],
                         machine: Machine) -> OpCost:
    """A block-scaled fp8 (or f4e2m1-through-the-lookup-table) contraction: one chain
    invocation in which the contraction engine and the vector engine run pipelined.

    - the contraction: its mapping at the fp8 width (a 64-byte packet holds 64 fp8; the TRF
      holds f8, an f4e2m1 weight widened by the fetch stage's lookup table (docs/hardware.md,
      Precisions) after it is read at half a byte), tree depth 6 (`tree_depth_fp8_cycles`);
    - vector scales: every f32 partial sum (one per K-block of each result element) gets
      lhs scale * rhs scale and is added to the running sum, in the vector engine of the slice
      that computed it: the Float cluster's multiply and fma in one pass (assumption: one pass,
      4-way, as every float stage runs; the book lists FpMul0/FpMul1 and FpFma as separate ALUs
      of the cluster), one ALU latency. A stage of the mapping's cost
      (target/contraction_mapping.py), per slice: a mapping that leaves slices idle leaves
      their vector engines idle too (before, the partial sums were spread over all the
      cluster's slices whatever the mapping);
    - an `acc` operand (the previous F tile's running sum) is read back as for `tcp.contract`.
    The stages overlap (the engines are pipelined), so the invocation takes the largest.
    FLOPs: 2 per MAC (at the fp8 peak in the roofline), plus the bias adds; the scale work is
    costed in cycles (the `vector scales` term) but not counted as FLOPs."""
    assert isinstance(op, tcp.ScaledContractOp)
    lhs, rhs, lhs_scales, rhs_scales, *optional = operands
    bias = optional.pop(0) if op.bias is not None else None
    guard = optional.pop(0) if op.guard is not None else None
    acc = optional.pop(0) if op.acc is not None else None
    g, b, d = lhs.shape
    f = rhs.shape[2]
    run = int(np.count_nonzero(np.asarray(guard) >= 0)) if guard is not None else g
    per_block = sum(stored_nbytes(v) for v in (lhs, rhs, lhs_scales, rhs_scales, *([] if acc is None else [acc]))) // g
    fetch = per_block * run
    if bias is not None:
        fetch += stored_nbytes(bias) * run // g if bias.shape[0] == g and g > 1 else stored_nbytes(bias)
    out_elements = run * b * f
    commit = out_elements * 4
    macs = out_elements * d
    extra = {}
    if bias is not None:  # as for tcp.contract: never faster than its FLOPs at the fp8 peak
        extra["compute"] = math.ceil((macs + out_elements / 2) / machine.peak_fp8_macs_per_cycle)
    cycles, bound = command_cycles(machine, mapped_cost(op, machine), blocks=g, blocks_run=run,
                                   guards=g if guard is not None else 0,
                                   tree_depth=machine.tree_depth_fp8_cycles + machine.alu_latency_cycles, extra=extra)
    flops = 2 * macs + (out_elements if bias is not None else 0)
    return OpCost(TENSOR, cycles, bytes_moved=fetch + commit, flops=flops, bound=bound, fp8_flops=2 * macs)


def register_tcp_costs() -> None:
    """The cost of every `tcp` op, and the operands whose values those costs read (cost-only
    mode computes exactly these)."""
    register_cost(tcp.DmaGatherOp)(cost_dma_gather)
    register_cost(tcp.DmaScatterOp)(cost_dma_scatter)
    register_cost(tcp.LoadOp)(cost_load)
    register_cost(tcp.StoreOp)(cost_store)
    register_cost(tcp.ContractOp)(cost_contract)
    register_cost(tcp.ScaledContractOp)(cost_scaled_contract)
    register_view(tcp.ViewOp)
    # The pinned routing stands where the router's indices are: their buffer, once they are made.
    register_cost(tcp.OrderOp)(free_cost)
    register_alias(tcp.OrderOp, 1)
    register_order_operands(tcp.OrderOp, lambda op: (op.input,))  # type: ignore[attr-defined]
    register_data_operands(tcp.DmaGatherOp, lambda op: (op.operands[1],))
    register_data_operands(tcp.DmaScatterOp, lambda op: (op.operands[1],))
    register_data_operands(tcp.ContractOp, lambda op: () if op.guard is None else (op.guard,))  # type: ignore[attr-defined]
    register_data_operands(tcp.ScaledContractOp, lambda op: () if op.guard is None else (op.guard,))  # type: ignore[attr-defined]
    register_cost_key(tcp.ContractOp, guard_signs)
    register_cost_key(tcp.ScaledContractOp, guard_signs)
