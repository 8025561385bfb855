"""The schedule level's loops and the tile sizes they use, and the contraction commands' mappings,
read from the simulated IR for the report: which tiles and mappings the compiler chose is a fact
of the IR, not of the cost model."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IntegerAttr, ModuleOp
from xdsl.ir import SSAValue

from dialects import tcp, tile
from dialects.annotations import phase_of
from dialects.tensor_types import format_type
from runtime_sim.perf.report import ContractionRecord, TileLoop
from target.contraction_mapping import ContractionShape, Mapping, choose, cost
from target.target_spec import machine_of

TILE_OPS = (tile.SliceOp, tile.LoadOp, tile.GatherOp, tile.LoadExpertOp)
"""The ops that bring one iteration's tile into SRAM."""


def _constant(value: SSAValue) -> int | None:
    owner = value.owner
    if isinstance(owner, arith.ConstantOp) and isinstance(owner.value, IntegerAttr):
        return owner.value.value.data
    return None


def tile_loops(module: ModuleOp, function: str) -> list[TileLoop]:
    """Every `scf.for` of `function` with constant bounds, outermost first, with its phase,
    trip count, step and the distinct types of the tiles its body slices or loads. The pieces
    of one loop (interleave-shared splits the routed loop where it places a shared expert's
    contractions: the next piece starts where the last ended, in the same block) are one entry."""
    loops: list[TileLoop] = []
    ended: tuple[object, int] | None = None  # the last loop's block and upper bound
    for fn in module.ops:
        if not (isinstance(fn, func.FuncOp) and fn.sym_name.data == function):
            continue
        for op in fn.walk():
            if not isinstance(op, scf.ForOp):
                continue
            lb, ub, step = _constant(op.lb), _constant(op.ub), _constant(op.step)
            if lb is None or ub is None or not step:
                continue
            body = op.body.block
            # through branches (an unused block's scf.if) and the clusters' copies alike
            tiles = dict.fromkeys(format_type(t.result.type) for t in body.walk() if isinstance(t, TILE_OPS))
            variable = body.args[0].name_hint or "i"
            loop = TileLoop(phase_of(op) or "other", variable, max(0, -(-(ub - lb) // step)), step, tuple(tiles))
            last = loops[-1] if loops else None
            if (last is not None and ended == (op.parent_block(), lb)
                    and (last.phase, last.variable, last.step, last.tiles) == (loop.phase, loop.variable, loop.step, loop.tiles)):
                loops[-1] = replace(last, iterations=last.iterations + loop.iterations, pieces=last.pieces + 1)
            else:
                loops.append(loop)
            ended = (op.parent_block(), ub)
    return loops


def contraction_mappings(module: ModuleOp, function: str) -> list[ContractionRecord]:
    """Every distinct contraction command of `function` (spec, operand types and mapping), in IR
    order, with its mapping's cost and the chooser's runner-up; an op without a mapping (IR not
    through map-contractions) is shown with the one the cost model picks for it."""
    found: dict[tuple[str, str, str], ContractionRecord] = {}
    keys: dict[tuple[object, ...], tuple[str, str, str]] = {}
    """An op's kind, operand types, attributes and properties -> its record's key: the unrolled
    loops of the group order repeat a few contractions thousands of times."""
    commands: Counter[tuple[str, str, str]] = Counter()
    for fn in module.ops:
        if not (isinstance(fn, func.FuncOp) and fn.sym_name.data == function):
            continue
        machine = machine_of(fn)
        for op in fn.walk():
            if not isinstance(op, tcp.ContractOp | tcp.ScaledContractOp):
                continue
            content = (type(op), tuple(v.type for v in op.operands), tuple(op.attributes.items()),
                       tuple(op.properties.items()))
            key = keys.get(content)
            if key is not None:
                commands[key] += 1
                continue
            roles = op.roles()
            shape = ContractionShape.of(roles)
            choice = choose(shape, machine)
            mapped = choice.best if op.mapping is None else cost(Mapping(**op.mapping.fields()), shape, machine)  # type: ignore[arg-type]
            spec = op.spec.data if isinstance(op, tcp.ContractOp) else "gbd,gdf->gbf (block-scaled)"
            what = f"{spec} {format_type(op.lhs.type)} x {format_type(op.rhs.type)}"
            key = keys[content] = (phase_of(op), what, str(mapped.mapping))
            commands[key] += 1
            if key in found:
                continue
            runner = choice.runner_up
            found[key] = ContractionRecord(
                phase_of(op), what, 1, mapped.mapping.book_form(roles.letters, shape), mapped.cycles, mapped.utilization,
                mapped.bound, runner.mapping.book_form(roles.letters, shape) if runner else "",
                runner.cycles if runner else 0)
    return [replace(record, commands=commands[key]) for key, record in found.items()]
