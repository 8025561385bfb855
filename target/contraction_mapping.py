"""How one contraction runs on a cluster's contraction engine: its mapping onto Slice, Lane, Time
and Packet, the rules a mapping keeps, its cycles stage by stage, and the choice of the cheapest.

The source is the furiosa-opt book (github.com/furiosa-ai/furiosa-opt, its docs sources): Computing
Tensors, "Contraction Engine" and its "Outer", "Packet Reducer", "Time Reducer" and "Lane Folder"
sections; "Register Files"; Moving Tensors, "Fetch Engine" and "Commit Engine". docs/hardware.md
("The contraction mapping") walks through it.

A contraction `lhs, rhs -> result` has four roles of axes: batch (`g`: in both operands and the
result), the lhs's free axes (`m`: lhs and result), the rhs's free axes (`n`: rhs and result) and
the contracted axes (`k`: both operands, not the result). A role of several axes is taken as one
axis of their product. A mapping places the roles:

- `trf`: the stationary operand, loaded into the TRF in the sub context (`.to_trf()`); the other
  streams through fetch, switch and collect into the Stream Adapter.
- `slices` (g, m, n): how many of the cluster's slices each role is split over (its outer part in
  Slice; each slice gets ceil(extent / slices), the padding of the last is waste). The contracted
  axis is never split over slices: a reduction across slices runs in the vector engine ("Lane
  Folder"), which this model does not enumerate.
- `lanes`: the stationary free axis' inner part in Lane (1, 2, 4 or 8).
- `broadcast`: the Stream Adapter's Time Broadcast: how many stationary rows per lane one streamed
  packet meets, innermost in Time ("Outer": "Time Broadcasting amortizes fetches").
- `packet`: the contracted axis' inner part in Packet, in elements. A packet is 64 bytes
  (PackSize 2, every multiplier busy) or 32 (PackSize 1: "effective throughput halves"); fewer
  elements than that are padding (`K in Time`, the book's degenerate kernel, has packet 1).
- `k_chunk`: the contracted extent one TRF load holds (Time's outer, reduced part is k_chunk /
  packet). A longer contracted axis is cut into chunks; each chunk's f32 partial sums are committed
  and read back by the next chunk like an accumulator operand (assumption: the book describes the
  accumulation within one command, not across TRF loads).
- `trf_mode`: `half` (double buffering, "Register Files": a store fills one half of each bank while
  the sequencer reads the other, 40 KB) or `full` (80 KB; a load waits for the reads).

Per slice (every slice of the cluster runs in lockstep, so the largest share sets the time), the
command runs one pass per (batch row, group of lanes x broadcast stationary rows, K chunk), R being
the streaming rows per slice:

    outer   = R x broadcast x chunk / packet      one packet per lane per cycle ("Outer")
    fetch   = R x chunk x stream bytes / fetch B/cycle, plus the f32 partial sums read back
    switch  = the broadcast of those rows to the slices that share them ("Switch Engine",
              Performance: ring_size x Time x flits, the rows spread over a sub-ring of them)
    folder  = R x broadcast                       Interleaved: one 8-lane flit per position
    commit  = R x lanes x broadcast x result bytes / commit B/cycle (f32 for a partial chunk)
    main    = max(outer, fetch, switch, folder, commit)   the stages are pipelined
    load    = lanes x broadcast x chunk x stationary bytes / fetch B/cycle   (sub context)
    half: sum over passes of max(main, load) (each load overlaps a pass); full: sum of main + load

A block-scaled contraction (fp8, MXFP4: `tcp.scaled_contract`) also runs its scales in the same
invocation: each K-block's f32 partial sum of each result element is multiplied by its two
scales and added to the running sum in the vector engine, next in the chain, of the slice that
computed it (book, Intra-Slice Chain: the vector engine is a stage of every slice's pipeline;
the Float cluster runs 4-way). Per slice:

    vector scales = g_s x m_s x n_s x (k / k_block) / float_ways
                                                (assumption: one Float pass per partial sum)

pipelined with the passes, so the command takes the larger of the two: a mapping that leaves
slices idle leaves their vector engines idle too, and the chooser weighs that.

The Time Reducer keeps one slot per surviving position inside the reduction: [Lane # 8, Packet 1]
chunks, accumulator_cells / 8 = 128 slots ("Time Reducer", Interleaved), so broadcast <= 128 (the
streaming rows beyond the slots form an outer Time loop, which costs nothing). The TRF holds
lanes x broadcast x chunk elements at the multiplier's width (trf_bytes, halved in `half`).
Utilization is useful MACs / (the cluster's MACs per cycle x cycles): padding and idle lanes and
multipliers are waste.

An f32 x f32 contraction has no multiplier pair ("Outer", Multiplier: "A contraction over an
element type this table does not list runs in the Vector Engine instead"): it runs on the vector
engine's float fma, `float_ways` MACs per slice per cycle, with both operands streamed per slice
(assumption: the book gives no cycle model for this route; one fma per MAC on the 4-way float
stage, each slice reading its own copy of both operands).

It may instead run on the multipliers as bf16 pieces (engine `bf16x9`): each f32 operand is
the exact sum of three bf16 pieces (hi = bf16(a), mid = bf16(a - hi), lo = a - hi - mid: 3 x 8
significant bits, all 24 of f32's), so a x b is the sum of the nine piece products, each exact
in the f32 accumulators (Henry, Tang and Heinecke, "Leveraging the bfloat16 Artificial
Intelligence Datatype For Higher-Precision Computations", ARITH 2019: bf16x9). Only the order
in which the f32 sum adds the products differs from the reference's, as on every contraction,
so the values are the reference's (docs/architecture.md#tolerance); inputs whose pieces fall
below bf16's normal range (|a| < 2^-110) or are not finite are outside what the route keeps.
Cost (assumptions): the bf16 contraction over K x 9 (every pair of pieces along the contracted
axis, each piece fetched once per pair), after one split pass of the vector engine over both
operands' elements spread over the cluster's slices at the float rate (`split` stage: a chain
of narrow, widen and subtract per element, the pieces written to DM). An operand widened from
bf16 (`ve.widen`: DeepSeek-V3's router reads f32(x) of bf16 tokens) is its own hi piece, and its
mid and lo pieces are zero: the six products with them are exact zeros, which add nothing to the
f32 sum, so the route makes only the three with hi, over K x 3, the same values
(`ContractionShape.lhs_pieces`; its split pass still counts, narrowing it back to bf16). This is
not bf16x3's truncation (which drops nonzero terms of two f32 operands): no term that is not zero
is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Protocol

from target.machine import Machine
from target.switch_engine import switch_cycles

ROLES = ("g", "m", "n", "k")
STAGES = ("outer", "fetch", "switch", "lane folder", "commit", "TRF load")
SCALES_STAGE = "vector scales"
"""A block-scaled contraction's stage in the vector engine (the module docstring)."""
ENGINES = ("contraction", "vector", "bf16x9")
"""Where a contraction runs: the multipliers, the vector engine's float fma (f32 x f32), or the
multipliers on the bf16 pieces of f32 operands (the module docstring)."""
PIECES = 3
"""bf16 pieces of an f32 operand in the `bf16x9` route: 3 x 8 significant bits."""
SPLIT_STAGE = "split"
"""The `bf16x9` route's vector pass cutting the operands into pieces."""


@dataclass(frozen=True)
class ContractionShape:
    """The sizes and element widths a mapping is chosen for: role extents, stored bytes per
    element of each operand (what fetch reads: f4e2m1 is half a byte), the multiplier's width
    (bf16 2, fp8 1; what the TRF holds and a packet counts), the result's bytes, and whether the
    command reads an accumulator (an f32 running sum, as `acc`)."""

    g: int
    m: int
    n: int
    k: int
    lhs_bytes: float = 2
    rhs_bytes: float = 2
    mac_bytes: int = 2
    result_bytes: int = 4
    accumulates: bool = False
    vector: bool = False
    """f32 x f32: no multiplier pair, the vector engine's route."""
    scale_blocks: int = 0
    """Block-scaled: the K-blocks of each result element, whose partial sums the vector engine
    of the computing slice scales and adds (the module docstring); 0: not block-scaled."""
    lhs_pieces: int = PIECES
    """bf16 pieces of each lhs value in the `bf16x9` route: 1 where the lhs is widened from bf16
    (its mid and lo pieces are zero: the module docstring)."""
    rhs_pieces: int = PIECES
    """The rhs's likewise."""

    @property
    def macs(self) -> int:
        return self.g * self.m * self.n * self.k

    def pieces(self) -> ContractionShape:
        """The bf16 contraction the `bf16x9` route runs for this f32 one: every pair of the
        operands' pieces along the contracted axis."""
        return replace(self, k=self.k * self.lhs_pieces * self.rhs_pieces, lhs_bytes=2, rhs_bytes=2, mac_bytes=2,
                       vector=False)

    @staticmethod
    def of(roles: ContractionRoles) -> ContractionShape:
        """The shape of a contraction op's roles (`dialects.tcp` ContractOp.roles()): a
        block-scaled one multiplies at the fp8 width (an f4e2m1 operand is read at half a byte and
        widened by the fetch stage's lookup table); an f32 operand has no multiplier pair."""
        lb, rb = roles.lhs_bits / 8, roles.rhs_bits / 8
        return ContractionShape(roles.g, roles.m, roles.n, roles.k, lhs_bytes=lb, rhs_bytes=rb,
                                mac_bytes=1 if roles.block_scaled else 2, result_bytes=roles.result_bits // 8,
                                accumulates=roles.accumulates, vector=not roles.block_scaled and max(lb, rb) == 4,
                                scale_blocks=roles.scale_blocks, lhs_pieces=1 if roles.lhs_bf16 else PIECES,
                                rhs_pieces=1 if roles.rhs_bf16 else PIECES)


class ContractionRoles(Protocol):
    """What a contraction op tells about itself (dialects.tcp.ContractionRoles)."""

    g: int
    m: int
    n: int
    k: int
    lhs_bits: int
    rhs_bits: int
    result_bits: int
    block_scaled: bool
    accumulates: bool
    scale_blocks: int
    lhs_bf16: bool
    rhs_bf16: bool


@dataclass(frozen=True)
class Mapping:
    """One placement of a contraction's roles (see the module docstring). `engine` is one of
    ENGINES; a vector mapping uses only `slices`, a `bf16x9` one places the pieces' contraction
    (`ContractionShape.pieces`)."""

    trf: str
    slices: tuple[int, int, int]
    lanes: int
    broadcast: int
    packet: int
    k_chunk: int
    trf_mode: str
    engine: str = "contraction"

    def book_form(self, letters: dict[str, str], shape: ContractionShape) -> str:
        """The mapping in the book's notation (a mapping expression per class, `X / n` the outer
        part of X in steps of n, `X % n` the inner, `# n` padded to n), with the spec's letters:
        `Slice [b / 64, f / 28] Lane [b % 8] Time [b % 64 / 32, d / 32, f % 28, b % 32 / 8]
        Packet [d % 32] TRF lhs (half)`."""
        name = {r: letters.get(r, r) for r in ROLES}
        extent = {"g": shape.g, "m": shape.m, "n": shape.n}
        per = {r: -(-extent[r] // s) for r, s in zip("gmn", self.slices)}
        sliced = {r: s > 1 for r, s in zip("gmn", self.slices)}

        def inner(role: str, step: int = 1) -> str:
            """The part of a role's axis inside its slice, in steps of `step`."""
            base = f"{name[role]} % {per[role]}" if sliced[role] else name[role]
            return base if step == 1 else f"{base} / {step}"

        spatial = []
        for role, s in zip("gmn", self.slices):
            if s > 1:
                pad = f" # {s * per[role]}" if s * per[role] != extent[role] else ""
                spatial.append(f"{name[role]} / {per[role]}{pad}")
        slice_ = f"Slice [{', '.join(spatial) or '1'}]"
        if self.engine == "vector":
            return f"{slice_} (vector engine: f32 x f32)"
        if self.engine == "bf16x9":
            pieces = replace(self, engine="contraction").book_form(letters, shape.pieces())
            return f"{pieces} (f32 x f32 as bf16x9: {name['k']} x {shape.lhs_pieces * shape.rhs_pieces} piece pairs)"
        stat, stream = ("n", "m") if self.trf == "rhs" else ("m", "n")
        rows = self.lanes * self.broadcast
        time = [inner("g")] if per["g"] > 1 else []
        if per[stat] > rows:
            time.append(inner(stat, rows))
        k_pad = _padded(shape.k, self.packet)
        steps = name["k"] if self.packet == 1 else f"{name['k']} / {self.packet}"
        if k_pad > self.k_chunk:
            time += [f"{name['k']} / {self.k_chunk}", f"{name['k']} % {self.k_chunk}" + steps[len(name["k"]):]]
        elif k_pad > self.packet:
            time.append(steps)
        if per[stream] > 1:
            time.append(inner(stream))
        if self.broadcast > 1:
            time.append(f"{name[stat]} % {rows} / {self.lanes}")
        if self.packet == 1:  # the contracted axis wholly in Time: one element in a 32-byte packet
            packet = f"1 # {32 // shape.mac_bytes}"
        elif k_pad > self.packet:
            packet = f"{name['k']} % {self.packet}"
        else:
            packet = name["k"] + (f" # {k_pad}" if k_pad != shape.k else "")
        lane = f"{name[stat]} % {self.lanes}" if self.lanes > 1 else "1"
        return (f"{slice_} Lane [{lane}] Time [{', '.join(time) or '1'}] Packet [{packet}] "
                f"TRF {self.trf} ({self.trf_mode})")


@dataclass(frozen=True)
class MappedCost:
    """A mapping's cycles (the per-slice passes; configuration, guards and the tree's fill are
    the command's, added by the caller), each stage's cycles summed over the passes, the stage
    that bounds it and the MAC utilization."""

    mapping: Mapping
    cycles: int
    stages: dict[str, int] = field(compare=False)
    bound: str
    utilization: float


class MappingError(ValueError):
    """A mapping that breaks a rule of the hardware; the message names the rule and the numbers."""


def _padded(extent: int, unit: int) -> int:
    return -(-extent // unit) * unit


def packet_choices(shape: ContractionShape, machine: Machine) -> list[int]:
    """The packet sizes the chooser tries, in elements: a full packet (PackSize 2) and a half one
    (PackSize 1). Any size from 1 to a full packet is legal (the rest is padding)."""
    full = machine.packet_bytes // shape.mac_bytes
    return [full, full // 2]


def trf_elements_per_lane(lanes: int, trf_mode: str, shape: ContractionShape, machine: Machine) -> int:
    """Elements one of `lanes` active lanes may hold: the TRF's payload over the active lanes
    ("With fewer than 8 active lanes, each active lane sees more rows"), half of it in `half`
    mode."""
    total = machine.trf_bytes // shape.mac_bytes
    return total // lanes // (2 if trf_mode == "half" else 1)


def broadcast_slots(machine: Machine) -> int:
    """The Time Reducer's slots in Interleaved mode with the contracted axis reduced: its cells
    over [Lane # 8, Packet 1] chunks, the most Time Broadcast rows one pass may keep."""
    return machine.accumulator_cells // machine.lanes


def check(mapping: Mapping, shape: ContractionShape, machine: Machine) -> None:
    """Raise MappingError naming the first rule `mapping` breaks for `shape` on `machine`."""
    sizes = (shape.g, shape.m, shape.n)
    used = math.prod(mapping.slices)
    if used > machine.slices:
        raise MappingError(f"the mapping uses {used} slices (g x m x n = {' x '.join(map(str, mapping.slices))}); "
                           f"a cluster has {machine.slices}")
    for role, s, extent in zip("gmn", mapping.slices, sizes):
        if not 1 <= s <= extent:
            raise MappingError(f"axis {role} of size {extent} is split over {s} slices (1 to {extent}: every slice "
                               f"gets part of the axis, each element exactly once)")
    if mapping.engine not in ENGINES or mapping.trf not in ("lhs", "rhs") or mapping.trf_mode not in ("half", "full"):
        raise MappingError(f"engine {mapping.engine!r}, trf {mapping.trf!r}, trf_mode {mapping.trf_mode!r}: expected "
                           f"one of {', '.join(ENGINES)}, lhs or rhs, half or full")
    if mapping.engine != "contraction" and not shape.vector:
        raise MappingError(f"engine {mapping.engine} is a route of an f32 x f32 contraction; this one has a "
                           f"multiplier pair (engine contraction)")
    if mapping.engine == "vector":
        return
    if mapping.engine == "bf16x9":
        check(replace(mapping, engine="contraction"), shape.pieces(), machine)
        return
    if shape.vector:
        raise MappingError("an f32 x f32 contraction has no multiplier pair: it runs on the vector engine "
                           "(engine vector) or on its bf16 pieces (engine bf16x9)")
    if mapping.lanes not in (1, 2, 4, 8) or mapping.lanes > machine.lanes:
        raise MappingError(f"Lane = {mapping.lanes}: the Outer stage takes 1, 2, 4 or 8 lanes, at most {machine.lanes}")
    full = machine.packet_bytes // shape.mac_bytes
    if not 1 <= mapping.packet <= full:
        raise MappingError(f"Packet = {mapping.packet} elements of {shape.mac_bytes} B: a packet holds 1 to {full} "
                           f"({machine.packet_bytes} bytes)")
    if mapping.broadcast < 1 or mapping.broadcast > broadcast_slots(machine):
        raise MappingError(f"Time Broadcast = {mapping.broadcast}: the Time Reducer has "
                           f"{broadcast_slots(machine)} slots of [Lane # 8, Packet 1]")
    if mapping.k_chunk < mapping.packet or mapping.k_chunk % mapping.packet:
        raise MappingError(f"k_chunk = {mapping.k_chunk} is not a positive multiple of the packet ({mapping.packet})")
    held = mapping.broadcast * min(mapping.k_chunk, _padded(shape.k, mapping.packet))
    room = trf_elements_per_lane(mapping.lanes, mapping.trf_mode, shape, machine)
    if held > room:
        raise MappingError(f"the stationary operand needs {held} elements per lane (broadcast {mapping.broadcast} x "
                           f"k_chunk {mapping.k_chunk}); the TRF holds {room} per lane with {mapping.lanes} lanes "
                           f"in {mapping.trf_mode} mode")


def cost(mapping: Mapping, shape: ContractionShape, machine: Machine) -> MappedCost:
    """The cycles of `shape` under a legal `mapping` (see the module docstring)."""
    m = machine
    g_s, m_s, n_s = (-(-e // s) for e, s in zip((shape.g, shape.m, shape.n), mapping.slices))
    peak = m.macs_per_cycle_bf16 if shape.mac_bytes == 2 else m.macs_per_cycle_fp8
    if mapping.engine == "vector":
        macs = g_s * m_s * n_s * shape.k
        stages = {"vector fma": -(-macs // m.float_ways),
                  "fetch": math.ceil(g_s * shape.k * (m_s * shape.lhs_bytes + n_s * shape.rhs_bytes) / m.fetch_bytes_per_cycle),
                  "commit": math.ceil(g_s * m_s * n_s * shape.result_bytes / m.commit_bytes_per_cycle)}
        cycles = max(stages.values())
        bound = max(stages, key=lambda s: stages[s])
        return MappedCost(mapping, cycles, stages, bound, shape.macs / (peak * m.slices * cycles))
    if mapping.engine == "bf16x9":
        pieces = cost(replace(mapping, engine="contraction"), shape.pieces(), machine)
        elements = shape.g * (shape.m + shape.n) * shape.k
        stages = {**pieces.stages, SPLIT_STAGE: -(-elements // (m.slices * m.float_ways))}
        cycles = pieces.cycles + stages[SPLIT_STAGE]
        bound = max(stages, key=lambda s: stages[s])
        return MappedCost(mapping, cycles, stages, bound, shape.macs / (peak * m.slices * cycles))
    stat, stream = (n_s, m_s) if mapping.trf == "rhs" else (m_s, n_s)
    stream_bytes, stat_bytes = (shape.lhs_bytes, shape.rhs_bytes) if mapping.trf == "rhs" else (shape.rhs_bytes, shape.lhs_bytes)
    rows = mapping.lanes * mapping.broadcast
    row_passes = g_s * -(-stat // rows)
    k_pad = _padded(shape.k, mapping.packet)
    full_chunks, last = divmod(k_pad, mapping.k_chunk)
    chunks = [(mapping.k_chunk, full_chunks)] + ([(last, 1)] if last else [])
    fetch_rate, commit_rate = m.fetch_bytes_per_cycle, m.commit_bytes_per_cycle
    sharing = mapping.slices[2] if mapping.trf == "rhs" else mapping.slices[1]  # slices streaming the same rows
    partial = stream * rows * 4  # one chunk's f32 partial sums in a slice
    totals = dict.fromkeys(STAGES, 0)
    cycles = 0
    for index, (chunk, count) in enumerate(chunks):
        last_group = index == len(chunks) - 1
        for (first, final), times in _positions(index == 0, last_group, count):  # each kind of position once
            reads_back = (not first) or shape.accumulates
            stage = {
                "outer": stream * mapping.broadcast * -(-chunk // mapping.packet),
                "fetch": math.ceil((stream * chunk * stream_bytes + (partial if reads_back else 0)) / fetch_rate),
                "switch": _broadcast(sharing, stream * chunk * stream_bytes, m),
                "lane folder": stream * mapping.broadcast,
                "commit": math.ceil(stream * rows * (shape.result_bytes if final else 4) / commit_rate),
                "TRF load": math.ceil(rows * chunk * stat_bytes / fetch_rate),
            }
            main = max(stage[s] for s in STAGES[:5])
            per_pass = max(main, stage["TRF load"]) if mapping.trf_mode == "half" else main + stage["TRF load"]
            cycles += per_pass * row_passes * times
            for s in STAGES:
                totals[s] += stage[s] * row_passes * times
    if shape.scale_blocks:  # the partial sums' scales, pipelined with the passes (module docstring)
        totals[SCALES_STAGE] = -(-g_s * m_s * n_s * shape.scale_blocks // m.float_ways)
        cycles = max(cycles, totals[SCALES_STAGE])
    bound = max(totals, key=lambda s: totals[s])
    return MappedCost(mapping, cycles, totals, bound, shape.macs / (peak * m.slices * cycles))


def _positions(first_group: bool, last_group: bool, count: int) -> list[tuple[tuple[bool, bool], int]]:
    """The `count` positions of one group of equal k-chunks, as (first, final) kinds with how
    many positions are of each: the first position of the first group is the first, the last
    of the last group the final, and every other position costs alike (so `cost` works each
    kind out once, not each of D / k_chunk positions)."""
    if count == 0:
        return []
    if count == 1:
        return [((first_group, last_group), 1)]
    kinds = [((first_group, False), 1), ((False, False), count - 2), ((False, last_group), 1)]
    return [(kind, times) for kind, times in kinds if times]


def _broadcast(sharing: int, nbytes: float, machine: Machine) -> int:
    """Cycles of the switch delivering `nbytes` of a streamed operand to each of `sharing` slices
    that need the same rows: the rows are spread over a sub-ring of them (the next power of
    two) and broadcast around it (book, Switch Engine, Broadcast01 and Performance). One slice
    alone forwards its own data: free."""
    if sharing <= 1:
        return 0
    ring = min(machine.slices, 1 << (sharing - 1).bit_length())
    steps = max(1, math.ceil(nbytes / (ring * machine.flit_bytes)))
    return switch_cycles(ring, steps, machine.flit_bytes, machine)


def _slice_choices(extent: int, slices: int) -> list[int]:
    """Slice counts worth trying for an axis: powers of two and the whole extent (when it fits),
    and the counts that divide the axis evenly near them."""
    options = {1}
    s = 1
    while s * 2 <= min(extent, slices):
        s *= 2
        options.add(s)
    if extent <= slices:
        options.add(extent)
    for s in list(options):  # the fewest slices giving the same per-slice extent wastes least
        options.add(-(-extent // -(-extent // s)))
    return sorted(options)


def candidates(shape: ContractionShape, machine: Machine) -> list[Mapping]:
    """Every legal mapping the chooser considers: slice splits of g, m and n (powers of two and
    even divisions), both operands as the stationary one, Time Broadcast in powers of two, a full
    or half packet, the TRF in half or full mode with the longest K chunk it holds, and Lane the
    fewest of 1, 2, 4, 8 covering the stationary rows of a slice."""
    m = machine
    splits = [(a, b, c) for a in _slice_choices(shape.g, m.slices) for b in _slice_choices(shape.m, m.slices)
              for c in _slice_choices(shape.n, m.slices) if a * b * c <= m.slices]
    if shape.vector:
        on_pieces = [replace(mp, engine="bf16x9") for mp in candidates(shape.pieces(), machine)]
        return [Mapping("lhs", split, 1, 1, 1, 1, "full", "vector") for split in splits] + on_pieces
    found: list[Mapping] = []
    for split in splits:
        per = {"m": -(-shape.m // split[1]), "n": -(-shape.n // split[2])}
        for trf in ("rhs", "lhs"):
            stat = per["n" if trf == "rhs" else "m"]
            lanes = min(m.lanes, 1 << max(0, (stat - 1).bit_length()))
            most = -(-stat // lanes)
            broadcasts = sorted({min(most, 1 << i) for i in range(8)})
            for packet in packet_choices(shape, m):
                if packet != packet_choices(shape, m)[0] and shape.k * shape.mac_bytes > m.packet_bytes // 2:
                    continue  # a half packet only pays off when K fits in it
                k_pad = _padded(shape.k, packet)
                for mode in ("half", "full"):
                    for broadcast in broadcasts:
                        room = trf_elements_per_lane(lanes, mode, shape, m)
                        k_chunk = min(k_pad, room // broadcast // packet * packet)
                        if k_chunk < packet or broadcast > broadcast_slots(m):
                            continue
                        found.append(Mapping(trf, split, lanes, broadcast, packet, k_chunk, mode))
    return found


@dataclass(frozen=True)
class Choice:
    """The cheapest mapping and the best one that differs from it in stationary operand or slice
    split (the runner-up a report names)."""

    best: MappedCost
    runner_up: MappedCost | None


def _order(c: MappedCost) -> tuple:
    """Cheapest first; among equals the fewest slices, then a fixed order of the fields, so the
    choice never depends on the enumeration's order."""
    mp = c.mapping
    return (c.cycles, math.prod(mp.slices), mp.slices, mp.trf != "rhs", mp.trf_mode != "half", -mp.packet,
            mp.broadcast, mp.k_chunk, ENGINES.index(mp.engine))


@lru_cache(maxsize=4096)
def choose(shape: ContractionShape, machine: Machine) -> Choice:
    """The cheapest legal mapping of `shape` on one cluster of `machine`, deterministically."""
    costed = sorted((cost(mp, shape, machine) for mp in candidates(shape, machine)), key=_order)
    if not costed:
        raise MappingError(f"no legal mapping for a contraction of g={shape.g} m={shape.m} n={shape.n} k={shape.k}")
    best = costed[0]
    key = (best.mapping.trf, best.mapping.slices)
    runner = next((c for c in costed[1:] if (c.mapping.trf, c.mapping.slices) != key), None)
    return Choice(best, runner)
