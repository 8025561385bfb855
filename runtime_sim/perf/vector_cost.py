"""Cost formulas of the vector engine, as plain functions of the numbers that decide them.

They are not tied to any op: a `ve` op's cost function reads its element count, ALU class and
stages from the op and calls these (see `register_cost` in cost_model.py). Book, "Vector
engine": the engine works on 32-bit values, one 32-byte flit (8 values) per slice per cycle
through a fixed chain of optional stages; integer, logic and clip stages run 8-way, float,
reduce and divide stages 4-way; each ALU used adds one cycle of latency.

Chain invocation over `elements` 32-bit values spread evenly over the slices:
    cycles = config_overhead + alus_used * alu_latency
             + ceil(elements / slices / ways)            stream; ways = 8 (int) or 4 (float)
             + reduce_steps                               first output of an n-step reduction
             + ring_traversal   if the reduction crosses slices (assumption: one hop per slice)
             + filter_cycles    if the Filter stage compacts (assumption)
  A chain runs at the pace of its slowest stage, so one float, reduce or divide stage makes
  the whole invocation 4-way: pass alu="float" for float or divide stages; a reduction
  (reduce_steps > 0) is 4-way whatever `alu` says.

A fused chain (`ve.chain`, one invocation running several ops in the chain's stage order):
    cycles = config_overhead + (sum of the members' alus_used) * alu_latency
             + max over members of ceil(elements_i / slices / ways_i)   one pass, slowest stage
             + reduce_steps + ring + filter_cycles   as above, for the members that have them
  A single op is the chain of one member: the two formulas agree on it.

Cumsum (a time-axis scan; the branch-logged add of the book's MoE chapter,
docs/hardware.md#vector-engine): rows of length n are scanned one step per cycle with every
lane of every slice on an independent row:
    cycles = config_overhead + alus_used * alu_latency + n * ceil(rows / (slices * ways))

ve_cost.py turns these cycles into each `ve` op's OpCost (bytes moved: the operands it reads,
except splats in a constant slot, plus the results it writes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from target.machine import Machine

AluClass = Literal["int", "float"]
"""`int`: integer, logic and clip stages (8-way); `float`: float, reduce and divide (4-way)."""



def vector_ways(machine: Machine, alu: AluClass) -> int:
    if alu == "int":
        return machine.int_ways
    if alu == "float":
        return machine.float_ways
    raise ValueError(f"ALU class must be 'int' or 'float', got {alu!r}")


@dataclass(frozen=True)
class ChainStage:
    """The work of one op in a chain invocation: the 32-bit values it streams, its rate class,
    the ALUs it adds latency for, the steps of a reduced axis, whether it is the Filter stage."""

    elements: int
    alu: AluClass
    alus_used: int = 1
    reduce_steps: int = 0
    filter_stage: bool = False


def chain_invocation_cycles(machine: Machine, stages: Sequence[ChainStage], *,
                            inter_slice: bool = False) -> tuple[int, str]:
    """Cycles of ONE chain invocation running `stages` (one op's, or a fused `ve.chain`'s) and
    the term that dominates it: the configuration overhead once, the latency of every ALU used,
    and one pass of the data at the pace of the slowest stage (the largest elements / ways of
    any stage, a reduction's stages counted 4-way over their input)."""
    m = machine

    def stream(s: ChainStage) -> int:
        ways = vector_ways(m, "float" if s.reduce_steps > 0 else s.alu)
        return math.ceil(math.ceil(s.elements / m.slices) / ways)

    terms = {
        "vector stream": max(stream(s) for s in stages),
        "reduce fill": sum(s.reduce_steps for s in stages),
        "ring": m.ring_traversal_cycles if inter_slice else 0,
        "filter": m.filter_cycles if any(s.filter_stage for s in stages) else 0,
        "overhead": m.config_overhead_cycles + sum(s.alus_used for s in stages) * m.alu_latency_cycles,
    }
    bound = max(terms, key=lambda k: terms[k])
    return sum(terms.values()), bound


def vector_chain_cycles(machine: Machine, elements: int, *, alu: AluClass, alus_used: int,
                        reduce_steps: int = 0, inter_slice: bool = False,
                        filter_stage: bool = False) -> tuple[int, str]:
    """Cycles of one chain invocation of a single op and the term that dominates it."""
    stage = ChainStage(elements, alu, alus_used, reduce_steps, filter_stage)
    return chain_invocation_cycles(machine, [stage], inter_slice=inter_slice)


def scan_cycles(machine: Machine, rows: int, axis_len: int, *, alu: AluClass = "int",
                alus_used: int = 1) -> tuple[int, str]:
    """Cycles of a cumsum over `rows` independent rows of `axis_len` steps."""
    m = machine
    rounds = math.ceil(rows / (m.slices * vector_ways(m, alu)))
    scan = axis_len * rounds
    fixed = m.config_overhead_cycles + alus_used * m.alu_latency_cycles
    return fixed + scan, "scan" if scan >= fixed else "overhead"
