"""Running a .moe layer on a mesh of chips: `--mesh ep=8` (or `dp=2,ep=4`, with
`strategy=allgather`) shards the graph (passes/shard_experts.py), lowers the SPMD program with
the single-chip pipeline and simulates it on every chip (runtime_sim/perf/mesh_simulate.py).
Inputs are the whole layer's (all T tokens, all E experts), drawn or read as for one chip, and
split over the chips as the `ccl.shard` argument attributes say; the outputs are the chips'
token rows put back together, so they compare with the single-chip reference directly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from xdsl.dialects.builtin import DictionaryAttr, ModuleOp, StringAttr

from dialects import ccl
from passes.shard_experts import STRATEGIES
from tcpc.arrays import prepare_inputs
from tcpc.diagnostics import CompileError
from tcpc.pipelines import FULL_PIPELINE
from tcpc.program import Program, function_in

if TYPE_CHECKING:  # the simulator is slow to import
    from runtime_sim.perf.mesh_machine import MeshMachine
    from runtime_sim.perf.mesh_simulate import MeshReport


@dataclass(frozen=True)
class MeshSpec:
    """`--mesh`: the mesh and the expert-parallel strategy (bad specs raise ccl.MeshSpecError)."""

    mesh: ccl.Mesh
    strategy: str = "a2a"

    @staticmethod
    def parse(spec: str) -> MeshSpec:
        items = [i.strip() for i in spec.split(",") if i.strip()]
        strategy = "a2a"
        axes = []
        for item in items:
            name, _, value = item.partition("=")
            if name.strip() == "strategy":
                strategy = value.strip()
                if strategy not in STRATEGIES:
                    raise ccl.MeshSpecError(f"mesh '{spec}': unknown strategy '{strategy}' (expected {', '.join(STRATEGIES)})")
            else:
                axes.append(item)
        mesh = ccl.Mesh.parse(",".join(axes))
        if mesh.size("tp") > 1:
            raise ccl.MeshSpecError(f"mesh '{spec}': tensor parallelism (tp) is not implemented yet; use dp and ep")
        return MeshSpec(mesh, strategy)

    def pipeline(self, cost_only: bool = False, lowered: bool = True) -> str:
        shard = f"shard-experts{{ep={self.mesh.size('ep')} dp={self.mesh.size('dp')} strategy={self.strategy}}}"
        passes = (["pin-routing"] if cost_only else []) + [shard] + (list(FULL_PIPELINE) if lowered else [])
        return ",".join(passes)


def shard_kind(attrs: DictionaryAttr | None) -> str:
    value = attrs.data.get(ccl.SHARD_ATTR) if attrs is not None else None
    return value.data if isinstance(value, StringAttr) else ""


def split_arguments(module: ModuleOp, name: str, mesh: ccl.Mesh, args: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Every chip's arguments: token-sharded ones split by chip, expert-sharded ones by the
    chip's ep coordinate, the rest replicated."""
    fn = function_in(module, name)
    attrs = fn.arg_attrs.data if fn.arg_attrs is not None else [None] * len(args)
    per_chip = []
    for c in range(mesh.chips):
        row = []
        for value, a in zip(args, attrs):
            kind = shard_kind(a)
            if kind == "tokens":
                n = value.shape[0] // mesh.chips
                row.append(value[c * n:(c + 1) * n])
            elif kind == "experts":
                ep = mesh.size("ep")
                n, i = value.shape[0] // ep, mesh.coordinates(c)["ep"]
                row.append(value[i * n:(i + 1) * n])
            else:
                row.append(value)
        per_chip.append(row)
    return per_chip


@dataclass
class MeshSimulation:
    outputs: list[np.ndarray]
    """The layer's outputs, the chips' token rows in chip order."""
    inputs: dict[str, np.ndarray]
    report: MeshReport
    pipeline: str
    module: ModuleOp
    cost_only: bool = False
    routing: dict = field(default_factory=dict)


def simulate_on_mesh(program: Program, spec: MeshSpec, inputs: Mapping[str, np.ndarray] | None = None, *,
                     seed: int = 0, graph: str | None = None, machine: MeshMachine | str | Path | None = None,
                     sram_policy: str = "spill", cost_only: bool = False,
                     routing: str | Path = "balanced") -> MeshSimulation:
    """Shard, lower and simulate one graph of `program` on the mesh of `spec`."""
    from runtime_sim.perf.mesh_machine import MeshMachine, load_mesh_machine
    from runtime_sim.perf.mesh_simulate import simulate_mesh

    if program.is_ir:
        raise CompileError("--mesh shards a .moe program's graph; it does not apply to .mlir IR")
    fn = program.function(graph)
    name = fn.sym_name.data
    mach = machine if isinstance(machine, MeshMachine) else load_mesh_machine(machine)
    pipeline = spec.pipeline(cost_only)
    module = program.lower(pipeline)
    if cost_only:
        if inputs:
            raise CompileError("cost-only simulation takes no inputs")
        result = simulate_mesh(module, name, mach, cost_only=True, routing=routing, seed=seed,
                               sram_policy=sram_policy)  # type: ignore[arg-type]
        return MeshSimulation([], {}, result.report, pipeline, module, True, result.report.routing)
    args = prepare_inputs(fn, inputs or {}, seed)
    result = simulate_mesh(module, name, mach, split_arguments(module, name, spec.mesh, args),
                           sram_policy=sram_policy)  # type: ignore[arg-type]
    outputs = [np.concatenate([np.asarray(chip[i]) for chip in result.outputs], axis=0)
               for i in range(len(result.outputs[0]))]
    names = [a.name_hint or f"arg{i}" for i, a in enumerate(fn.body.blocks.first.args)]  # type: ignore[union-attr]
    return MeshSimulation(outputs, dict(zip(names, args)), result.report, pipeline, module)
