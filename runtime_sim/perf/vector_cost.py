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

Cumsum (a time-axis scan; the branch-logged add of the book's MoE chapter,
docs/hardware.md#vector-engine): rows of length n are scanned one step per cycle with every
lane of every slice on an independent row:
    cycles = config_overhead + alus_used * alu_latency + n * ceil(rows / (slices * ways))

ve_cost.py turns these cycles into each `ve` op's OpCost (bytes moved: the operands it reads,
except splats in a constant slot, plus the results it writes).
"""

from __future__ import annotations

import math
from typing import Literal

from runtime_sim.perf.machine import Machine

AluClass = Literal["int", "float"]
"""`int`: integer, logic and clip stages (8-way); `float`: float, reduce and divide (4-way)."""



def vector_ways(machine: Machine, alu: AluClass) -> int:
    if alu == "int":
        return machine.int_ways
    if alu == "float":
        return machine.float_ways
    raise ValueError(f"ALU class must be 'int' or 'float', got {alu!r}")


def vector_chain_cycles(machine: Machine, elements: int, *, alu: AluClass, alus_used: int,
                        reduce_steps: int = 0, inter_slice: bool = False,
                        filter_stage: bool = False) -> tuple[int, str]:
    """Cycles of one chain invocation and the term that dominates it."""
    m = machine
    per_slice = math.ceil(elements / m.slices)
    ways = vector_ways(m, "float" if reduce_steps > 0 else alu)
    terms = {
        "vector stream": math.ceil(per_slice / ways),
        "reduce fill": reduce_steps,
        "ring": m.ring_traversal_cycles if inter_slice else 0,
        "filter": m.filter_cycles if filter_stage else 0,
        "overhead": m.config_overhead_cycles + alus_used * m.alu_latency_cycles,
    }
    bound = max(terms, key=lambda k: terms[k])
    return sum(terms.values()), bound


def scan_cycles(machine: Machine, rows: int, axis_len: int, *, alu: AluClass = "int",
                alus_used: int = 1) -> tuple[int, str]:
    """Cycles of a cumsum over `rows` independent rows of `axis_len` steps."""
    m = machine
    rounds = math.ceil(rows / (m.slices * vector_ways(m, alu)))
    scan = axis_len * rounds
    fixed = m.config_overhead_cycles + alus_used * m.alu_latency_cycles
    return fixed + scan, "scan" if scan >= fixed else "overhead"
