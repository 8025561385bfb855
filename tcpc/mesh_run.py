"""Running a .moe layer on a mesh of chips: `--mesh ep=8` (or `dp=2,ep=4`, `ep=4,tp=2`, with
`strategy=allgather`) shards the graph (passes/mesh/shard_experts.py), lowers the SPMD program with
the single-chip pipeline and simulates it on every chip (runtime_sim/perf/mesh_simulate.py).
Inputs are the whole layer's (all T tokens, all E experts), drawn or read as for one chip, and
split over the chips as the `ccl.shard` argument attributes say; the outputs are the chips'
token rows put back together, so they compare with the single-chip reference directly.

A program's T is the layer's tokens over the whole mesh, each of the dp * ep * sp token shards
holding T / (dp * ep * sp), its own batch (data-parallel attention: the served decode step, down to
one token per chip); `compile_for_mesh` reads T per chip with `tokens=per-chip`, and chooses
block=auto by simulating the mesh, not one chip at the global T."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import DictionaryAttr, IntegerAttr, ModuleOp, StringAttr
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation

from dialects import ccl, moe
from passes.lowering.lower_topk import AUTO_STRATEGY as TOPK_AUTO
from passes.lowering.lower_topk import DEFAULT_STRATEGY as TOPK_DEFAULT
from passes.lowering.lower_topk import STRATEGIES as TOPK_STRATEGIES
from passes.mesh.shard_experts import CHUNKED_STRATEGIES, SP_SUMS, STRATEGIES, token_sources
from runtime_sim.semantics.tolerance import RECEIVER_SUM_SCALE, TP_SCALE, Comparison, combine_scale, compare_outputs
from tcpc import syntax
from tcpc.arrays import prepare_inputs
from tcpc.builder import build_module, evaluate_dims
from tcpc.diagnostics import CompileError
from tcpc.parser import parse
from tcpc.pipelines import PassStep, mesh_pipeline_spec, parse_pipeline
from tcpc.program import Program, compile_source, deep_recursion, function_in, print_ir, read_source

if TYPE_CHECKING:  # the simulator is slow to import
    from runtime_sim.perf.graph_work import GraphWork
    from runtime_sim.perf.report import Choice
    from target.mesh_machine import MeshMachine
    from runtime_sim.perf.mesh_simulate import MeshReport


MAX_SIMULATED_CHIPS = 128
"""The most chips `tcpc run --mesh` simulates unless `--max-chips` says more: seed 001's
largest mesh (16 x 8, `ep=16,sp=8`), which benchmarks/mesh.py --seed-mesh simulates. Every chip
is interpreted (chips of one trace are planned, scheduled and reported once), and an
all-to-all's buffers and messages grow with the chips: DeepSeek-V3 at its real dims, 4 tokens a
chip on ep=16,sp=8, takes about 6 CPU s a simulation."""


CHUNK_COUNTS = (1, 2, 4, 8)
"""The chunk counts `chunks=auto` simulates (those that divide the chip's tokens)."""


KEPT_COMMANDS = 20_000
"""The most commands a chip's report may have for the search's cheapest candidate's simulation
to be kept for the run (`_kept`): a decode layer's are a few thousand; a prefill's report,
held while every later candidate is simulated, would raise the peak memory."""

KEPT_RUNS = 8
"""The most simulations `_kept` holds: candidates of equal cycles, as many as a block search tries."""

_kept: dict[tuple[object, ...], MeshSimulation] = {}
"""The cost-only simulations of the cheapest candidates of the latest search (compile_for_mesh),
the first KEPT_RUNS of equal cycles, by what their cycles depend on (`_run_key`): the run that
follows (lower-topk's default strategy among topk=auto's) takes the one it would simulate
again, and the others go."""


TOKENS = ("global", "per-chip")
"""How `--mesh ...,tokens=` reads the program's T: over the whole mesh (the default), or per chip."""


@dataclass(frozen=True)
class MeshSpec:
    """`--mesh`: the mesh, the expert-parallel strategy, lower-topk's strategy (`topk=auto`:
    the one of fewer simulated cycles on the mesh, `simulate_on_mesh`) and how the program's
    T reads (`tokens`); bad specs raise ccl.MeshSpecError."""

    mesh: ccl.Mesh
    strategy: str = "a2a"
    topk: str = TOPK_DEFAULT
    tokens: str = "global"
    """`global`: T is the layer's tokens over the whole mesh, each token shard holding
    T / (dp * ep); `per-chip`: T is each chip's own batch, and `compile_for_mesh` compiles the
    program with dp * ep times its T. A compiled Program's T is always global."""
    chunks: int | None = 1
    """How many chunks the chip's token loop is split into (shard-experts' `chunks`); None
    (`chunks=auto`): the count of fewest simulated cycles (`simulate_on_mesh`)."""
    sp_sum: str = "f32"
    """With sp, the type a column's sum crosses the reduce-scatter in (shard-experts' `sp_sum`):
    bf16 is seed 001's, half the bytes, within a2a_sum's kind of tolerance (`check_on_mesh`)."""
    waves: int = 1
    """a2a's split pairs go back in this many all-to-alls under the expert loop (and one after it),
    each once the receiver's blocks of its experts are computed (shard-experts' `waves`)."""

    @staticmethod
    def parse(spec: str) -> MeshSpec:
        items = [i.strip() for i in spec.split(",") if i.strip()]
        options = {"strategy": "a2a", "topk": TOPK_DEFAULT, "tokens": "global", "chunks": "1", "sp_sum": "f32",
                   "waves": "1"}
        choices = {"strategy": STRATEGIES, "topk": (*TOPK_STRATEGIES, TOPK_AUTO), "tokens": TOKENS, "sp_sum": SP_SUMS}
        axes = []
        for item in items:
            name, _, value = item.partition("=")
            if name.strip() == "chunks":
                options["chunks"] = value.strip()
                if value.strip() != "auto" and not (value.strip().isdigit() and int(value.strip()) >= 1):
                    raise ccl.MeshSpecError(f"mesh '{spec}': chunks = {value.strip()!r} is neither a positive "
                                            "integer nor auto")
            elif name.strip() == "waves":
                options["waves"] = value.strip()
                if not (value.strip().isdigit() and int(value.strip()) >= 1):
                    raise ccl.MeshSpecError(f"mesh '{spec}': waves = {value.strip()!r} is not a positive integer")
            elif name.strip() in options:
                options[name.strip()] = value.strip()
                if value.strip() not in choices[name.strip()]:
                    raise ccl.MeshSpecError(f"mesh '{spec}': unknown {name.strip()} '{value.strip()}' "
                                            f"(expected {', '.join(choices[name.strip()])})")
            elif name.strip() in ccl.MESH_AXES:
                axes.append(item)
            else:  # named here, where the options are known: Mesh.parse knows only the axes
                raise ccl.MeshSpecError(f"mesh '{spec}': unknown '{name.strip()}' (expected axes "
                                        f"{', '.join(ccl.MESH_AXES)} as NAME=SIZE, and the options "
                                        f"{', '.join(f'{o}=' for o in options)})"
                                        + ("; a capacity is the program's: scatter(..., capacity=C)"
                                           if name.strip() == "capacity" else ""))
        chunks = None if options["chunks"] == "auto" else int(options["chunks"])
        return MeshSpec(ccl.Mesh.parse(",".join(axes)), options["strategy"], options["topk"], options["tokens"], chunks,
                        options["sp_sum"], int(options["waves"]))

    @property
    def scope(self) -> str:
        """Where a choice made on this mesh was simulated, for its report."""
        return f"the mesh {self.mesh} ({self.strategy})"

    def simulations(self, cost_only: bool = False) -> int:
        """How many times `simulate_on_mesh` simulates the mesh: once, or with topk=auto once
        per lower-topk strategy (cost-only) and, with values, once more for the chosen one."""
        if self.topk != TOPK_AUTO:
            return 1
        return len(TOPK_STRATEGIES) + (0 if cost_only else 1)

    def pipeline(self, cost_only: bool = False, lowered: bool = True, scheduled: bool = True) -> str:
        """shard-experts, then (`lowered`) the single-chip lowering, with (`scheduled`) the
        schedule level: what a chip runs."""
        m = self.mesh
        if lowered and self.topk == TOPK_AUTO:
            raise ccl.MeshSpecError("topk=auto is chosen by simulating every chip of the mesh (tcpc run --mesh); "
                                    "name a strategy to compile")
        level = None if not lowered else "scheduled" if scheduled else "lowered"
        if self.chunks is None:
            raise ccl.MeshSpecError("chunks=auto is chosen by simulating every chip of the mesh (tcpc run --mesh); "
                                    "name a count to compile")
        return mesh_pipeline_spec(m.size("ep"), m.size("dp"), m.size("tp"), self.strategy,
                                  None if self.topk == TOPK_DEFAULT else self.topk, cost_only, level, self.chunks,
                                  m.size("sp"), self.sp_sum, self.waves)


def _scatter(fn: func.FuncOp) -> moe.ScatterOp | None:
    """The graph's one scatter, the layer shard-experts shards (None: it refuses the graph)."""
    scatters = [o for o in fn.walk() if isinstance(o, moe.ScatterOp)]
    return scatters[0] if len(scatters) == 1 else None


def scattered_tokens(fn: func.FuncOp, mesh: ccl.Mesh | None = None) -> int | None:
    """The T of the graph's one scatter; None without exactly one, or when its experts do not
    divide over `mesh`'s ep chips (shard-experts says so, before it looks at T)."""
    scatter = _scatter(fn)
    if scatter is None:
        return None
    route = scatter.route.type
    return None if mesh is not None and route.experts.data % mesh.expert_shards else route.tokens.data


def chunk_counts(fn: func.FuncOp, spec: MeshSpec) -> tuple[int, ...]:
    """The chunk counts `chunks=auto` tries for `fn` on `spec`'s mesh: CHUNK_COUNTS that divide
    the chip's tokens, with a2a or a2a_sum and no capacity (shard-experts refuses the rest);
    else only 1."""
    scatter = _scatter(fn)
    if scatter is None or spec.strategy not in CHUNKED_STRATEGIES or scatter.route.type.capacity_limit is not None:
        return (1,)
    per_chip = scatter.route.type.tokens.data // spec.mesh.token_shards
    return tuple(c for c in CHUNK_COUNTS if per_chip % c == 0 and c <= per_chip)


def chunk_choice(alternatives: Sequence[tuple[int, int]], bounded: Sequence[int], routing: str | Path,
                 spec: MeshSpec) -> Choice:
    """The report's chunk-count choice: the count of fewest cycles (ties: fewer chunks); the
    counts in `bounded` have a lower bound above the fewest for cycles (compile_for_mesh)."""
    from runtime_sim.perf.report import Choice

    best = min(alternatives, key=lambda a: (a[1], a[0]))[0]
    return Choice("chunk count", "shard-experts (pass 1 of the mesh pipeline)", "chunks=auto", best,
                  tuple(alternatives), str(routing), spec.scope, tuple(bounded))


def _run_key(text: str, name: str, spec: MeshSpec, machine: MeshMachine, routing: str | Path, seed: int,
             sram_policy: str) -> tuple[object, ...] | None:
    """What a cost-only mesh simulation of the graph `name` of the module printed as `text`
    depends on; None for a routing read from a file (it may change)."""
    from runtime_sim.perf.routing_scenarios import SCENARIOS

    if str(routing) not in SCENARIOS:
        return None
    return (text, name, str(spec.mesh), spec.strategy, spec.topk, spec.chunks, spec.sp_sum, spec.waves, repr(machine),
            str(routing), seed,
            sram_policy)


def _keep(key: tuple[object, ...] | None, sim: MeshSimulation) -> None:
    """Keep a search's candidate simulation in `_kept` if it is among the cheapest so far."""
    cycles = sim.report.total_cycles
    fewest = min((k.report.total_cycles for k in _kept.values()), default=math.inf)
    if key is None or cycles > fewest or len(sim.report.chips[0].ops) > KEPT_COMMANDS:
        return
    if cycles < fewest:
        _kept.clear()
    if len(_kept) < KEPT_RUNS:  # ties too: the block search takes the smaller block, which it may try later
        _kept[key] = sim


def check_token_split(tokens: int, mesh: ccl.Mesh, dim: str | None = None, per_chip_hint: bool = False) -> None:
    """T must divide over the token shards; otherwise a MeshSpecError that says T is the whole
    mesh's and which T would do (with `dim`, how to --set it; `per_chip_hint`: that --mesh
    can take T per chip)."""
    n = mesh.token_shards
    if tokens % n == 0:
        return
    fits = [m for m in (tokens // n * n, (tokens // n + 1) * n) if m]
    ways = ", ".join(f"T = {m} is {m // n} per chip" + (f" (--set {dim}={m})" if dim else "") for m in fits)
    hint = ", or add tokens=per-chip to --mesh to give T per chip" if per_chip_hint else ""
    axes = "dp * ep * sp" if mesh.size("sp") > 1 else "dp * ep"
    raise ccl.MeshSpecError(f"T = {tokens} tokens do not divide over {axes} = {n} chips: T counts the tokens of the "
                            f"whole mesh, each chip holding T / {n} (its own batch); {ways}{hint}")


def _token_dim(tree: syntax.Program, fn: func.FuncOp) -> str | None:
    """The dim that counts the scattered tokens: the one name that the first axis of every
    argument they come from (shard-experts' `token_sources`) is declared with; None when one
    is an expression, or they name several."""
    scatter = _scatter(fn)
    params = next(g.params for g in tree.graphs if g.name == fn.sym_name.data)
    first = [params[i].type.dims[0] for i in sorted(token_sources(scatter))] if scatter is not None else []
    names = {d.id if isinstance(d, syntax.Name) else None for d in first}
    return names.pop() if len(names) == 1 else None


def mesh_dims(source: str, dims: Mapping[str, int | str], spec: MeshSpec, graph: str | None = None) -> dict[str, int | str]:
    """The dims to compile `source` with for the mesh of `spec`: `dims` (`--set`), the token dim
    times dp * ep with `tokens=per-chip`; the global T checked to divide over the token shards
    (check_token_split). The graph is built once for this, with the largest blocks."""
    with deep_recursion():
        tree = parse(source)
        values = evaluate_dims(tree.dims, dims)
        module = build_module(tree, values)
    fn = function_in(module, graph or next(o.sym_name.data for o in module.ops if isinstance(o, func.FuncOp)))
    tokens = scattered_tokens(fn, spec.mesh)
    if tokens is None:
        return dict(dims)
    dim = _token_dim(tree, fn)
    n = spec.mesh.token_shards
    if spec.tokens == "per-chip":
        if dim is None:
            raise ccl.MeshSpecError(f"tokens=per-chip multiplies the dim that counts the T = {tokens} scattered "
                                    f"tokens by the {n} token shards, but no one dim of @{fn.sym_name.data}'s "
                                    "arguments is T; give T over the whole mesh instead (without tokens=per-chip)")
        return {**dims, dim: values[dim] * n}
    check_token_split(tokens, spec.mesh, dim, per_chip_hint=True)
    return dict(dims)


def compile_for_mesh(path: str | Path, dims: Mapping[str, int | str] | None, spec: MeshSpec, *,
                     graph: str | None = None, machine: MeshMachine | str | Path | None = None,
                     routing: str | Path = "balanced", seed: int = 0) -> Program:
    """The .moe program at `path` as `tcpc run --mesh` and `tcpc compile --mesh` compile it: T
    read as `spec.tokens` says (`mesh_dims`), and every block=auto chosen by the cost model on
    the mesh: tcpc/autotune.py's candidates and search, each candidate sharded and simulated
    cost-only on every chip of `machine` (lower-topk's default strategy, the routing scenario
    `routing`), where compile_file simulates one chip at the global T.

    A block and chunk count whose chips' commands' lower bound (their roofline, their busiest
    unit's cycles, their longest path: mesh_simulate.MeshBar) passes the fewest cycles simulated
    so far cannot win: its simulation stops there (simulate_mesh's `bound_above`), and the
    choice lists the next cycle above them as the candidate's cycles (Choice.bounded)."""
    from runtime_sim.perf.mesh_simulate import AboveBound
    from target.mesh_machine import MeshMachine, load_mesh_machine
    from tcpc.autotune import remembered

    path = Path(path)
    if path.suffix == ".mlir":
        raise CompileError("--mesh shards a .moe program's graph; it does not apply to .mlir IR")
    source = read_source(path)
    mach = machine if isinstance(machine, MeshMachine) else load_mesh_machine(machine)
    trial = replace(spec, topk=TOPK_DEFAULT)
    _kept.clear()
    by_chunks: list[tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]] = []
    """(cycles, (chunks, cycles) of each count, the counts bounded) of every candidate costed, with chunks=auto."""

    def cycles(module: ModuleOp, name: str, above: float) -> tuple[int, bool]:
        counts = chunk_counts(function_in(module, name), spec) if spec.chunks is None else (spec.chunks,)
        text = print_ir(module)
        tried: list[tuple[int, int]] = []
        bounded: list[int] = []
        for c in counts:
            bar = min(above, min((cycles for _, cycles in tried), default=math.inf))

            def simulated(c: int = c, bar: float = bar) -> int:
                sim = simulate_on_mesh(Program(str(path), source, {}, module), replace(trial, chunks=c), graph=name,
                                       machine=mach, cost_only=True, routing=routing, seed=seed, verify="none",
                                       bound_above=bar)
                _keep(_run_key(text, name, replace(trial, chunks=c), mach, routing, seed, "spill"), sim)
                return sim.report.total_cycles
            try:
                tried.append((c, remembered((text, name, str(trial.mesh), trial.strategy, c, trial.waves, repr(mach)), routing,
                                            seed, simulated)))
            except AboveBound as e:  # neither remembered nor kept: a later, higher bar simulates it
                tried.append((c, e.cycles))
                bounded.append(c)
        best = min(cycles for _, cycles in tried)
        by_chunks.append((best, tuple(tried), tuple(bounded)))
        # A bound below every count simulated is the candidate's: all its counts are above `above`.
        return best, not any(simulated_cycles == best for c, simulated_cycles in tried if c not in bounded)

    program = compile_source(source, mesh_dims(source, dims or {}, spec, graph), str(path), machine=mach.chip,
                             routing=routing, seed=seed, block_cost=cycles, cost_scope=spec.scope)
    if spec.chunks is None:  # the chunk count of the chosen block's fewest cycles
        block = next((c for c in program.choices if c.what == "block"), None)
        want = dict(block.alternatives)[block.chosen] if block is not None else None
        found = next(((t, b) for best, t, b in reversed(by_chunks) if want is None or best == want), None)
        if found is None:  # no block=auto: the program as compiled, at each count
            cycles(program.module, program.function(graph).sym_name.data, math.inf)
            found = by_chunks[-1][1:]
        program.choices = [*program.choices, chunk_choice(*found, routing, spec)]
    return program


def shard_kind(attrs: DictionaryAttr | None) -> str:
    value = attrs.data.get(ccl.SHARD_ATTR) if attrs is not None else None
    return value.data if isinstance(value, StringAttr) else ""


def split_arguments(module: ModuleOp, name: str, mesh: ccl.Mesh, args: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Every chip's arguments: token-sharded ones split by the chip's token shard, expert-sharded
    ones by its ep coordinate (and, with a `ccl.tp_axis`, that axis by its tp coordinate), the
    rest replicated."""
    fn = function_in(module, name)
    attrs = fn.arg_attrs.data if fn.arg_attrs is not None else [None] * len(args)
    per_chip = []
    for c in range(mesh.chips):
        coords = mesh.coordinates(c)
        row = []
        for value, a in zip(args, attrs):
            kind = shard_kind(a)
            if kind == "tokens":
                n, i = value.shape[0] // mesh.token_shards, mesh.token_shard(c)
                value = value[i * n:(i + 1) * n]
            elif kind == "experts":
                n, i = value.shape[0] // mesh.expert_shards, mesh.expert_shard(c)
                value = value[i * n:(i + 1) * n]
                axis = a.data.get(ccl.TP_AXIS_ATTR) if a is not None else None
                if isinstance(axis, IntegerAttr):
                    n, j = value.shape[axis.value.data] // mesh.size("tp"), coords.get("tp", 0)
                    value = np.take(value, np.arange(j * n, (j + 1) * n), axis=axis.value.data)
            row.append(value)
        per_chip.append(row)
    return per_chip


def token_outputs(mesh: ccl.Mesh, outputs: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """The layer's outputs from every chip's: the token shards' rows in token order (the tp
    chips of a group compute the same rows; the first one's are taken)."""
    homes = [c for c in range(mesh.chips) if mesh.coordinates(c).get("tp", 0) == 0]
    return [np.concatenate([np.asarray(outputs[c][i]) for c in homes], axis=0) for i in range(len(outputs[0]))]


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
    topk_cycles: dict[str, int] = field(default_factory=dict)
    """With `topk=auto`: each lower-topk strategy's simulated cycles (cost-only, the run's
    routing); the run used the one of fewest (ties: the default)."""


def simulate_on_mesh(program: Program, spec: MeshSpec, inputs: Mapping[str, np.ndarray] | None = None, *,
                     seed: int = 0, graph: str | None = None, machine: MeshMachine | str | Path | None = None,
                     sram_policy: str = "spill", cost_only: bool = False,
                     routing: str | Path = "balanced",
                     listeners: Sequence[Interpreter.Listener] = (), verify: str = "each",
                     bound_above: float = math.inf) -> MeshSimulation:
    """Shard, lower and simulate one graph of `program` on the mesh of `spec`; `listeners` see
    every op of every chip, in each of the `spec.simulations(cost_only)` simulations. The
    program's T is the whole mesh's (check_token_split). The report carries the choices (the
    program's blocks, and with topk=auto the strategy) and each chip's loops and contractions.
    `verify` says when each compile is verified (apply_pipeline's VERIFY_MODES): a choice's
    candidates that are only costed, never; top-k strategies, the chosen one of which is the
    run, after their last pass. `bound_above` (cost-only, a named strategy and chunk count):
    a run whose chips' lower bound passes it stops with mesh_simulate.AboveBound."""
    from runtime_sim.perf.graph_work import graph_work
    from runtime_sim.perf.report import Choice
    from target.mesh_machine import MeshMachine, load_mesh_machine
    from runtime_sim.perf.mesh_simulate import simulate_mesh
    from tcpc.schedule_summary import contraction_mappings, tile_loops

    if program.is_ir:
        raise CompileError("--mesh shards a .moe program's graph; it does not apply to .mlir IR")
    fn = program.function(graph)
    name = fn.sym_name.data
    tokens = scattered_tokens(fn, spec.mesh)
    if tokens is not None:
        check_token_split(tokens, spec.mesh)
    mach = machine if isinstance(machine, MeshMachine) else load_mesh_machine(machine)
    if spec.chunks is None:  # chosen by compile_for_mesh, or here: each count simulated cost-only
        chosen = next((c for c in program.choices if c.what == "chunk count"), None)
        if chosen is None:
            tried = tuple((c, simulate_on_mesh(program, replace(spec, chunks=c, topk=TOPK_DEFAULT), seed=seed,
                                               graph=graph, machine=mach, sram_policy=sram_policy, cost_only=True,
                                               routing=routing, verify="none").report.total_cycles)
                          for c in chunk_counts(fn, spec))
            chosen = chunk_choice(tried, (), routing, spec)
        sim = simulate_on_mesh(program, replace(spec, chunks=int(chosen.chosen)), inputs, seed=seed, graph=graph,
                               machine=mach, sram_policy=sram_policy, cost_only=cost_only, routing=routing,
                               listeners=listeners)
        if not any(c.what == "chunk count" for c in sim.report.choices):
            for report in (sim.report, *sim.report.chips):
                report.choices = [*report.choices, chosen]
        return sim
    if spec.topk == TOPK_AUTO:
        trials = {s: simulate_on_mesh(program, replace(spec, topk=s), seed=seed, graph=graph, machine=mach,
                                      sram_policy=sram_policy, cost_only=True, routing=routing, listeners=listeners,
                                      verify="last" if verify == "each" else verify)
                  for s in TOPK_STRATEGIES}
        cycles = {s: t.report.total_cycles for s, t in trials.items()}
        best = min(TOPK_STRATEGIES, key=lambda s: (cycles[s], TOPK_STRATEGIES.index(s)))
        chosen = trials[best] if cost_only else simulate_on_mesh(
            program, replace(spec, topk=best), inputs, seed=seed, graph=graph, machine=mach, sram_policy=sram_policy,
            listeners=listeners)
        where = [p.name for p in parse_pipeline(chosen.pipeline)].index("lower-topk") + 1
        choice = Choice("lower-topk strategy", f"pass {where} of the pipeline", "topk=auto", best,
                        tuple(cycles.items()), str(routing), spec.scope)
        for report in (chosen.report, *chosen.report.chips):
            report.choices = [*report.choices, choice]
        return replace(chosen, topk_cycles=cycles)
    pipeline = spec.pipeline(cost_only)
    key = (_run_key(print_ir(program.module), name, spec, mach, routing, seed, sram_policy)
           if cost_only and _kept and not inputs and not listeners and bound_above == math.inf else None)
    kept = _kept.pop(key, None) if key is not None else None  # the search simulated this program
    if kept is not None:
        _kept.clear()
    if kept is not None:
        if verify != "none":  # compiled unverified, as every candidate is
            kept.module.verify()
        module, sim = kept.module, kept
    else:
        # A chip's useful work: its program after shard-experts, before lowering, read as the
        # pipeline passes it (lowering that prefix again took a tenth of a decode candidate's compile).
        works: list[GraphWork | None] = []

        def read_work(step: PassStep) -> None:
            if step.pass_ is not None and step.pass_.name == "shard-experts":
                works.append(graph_work(function_in(step.module, name)))

        module = program.lower(pipeline, machine=mach.chip, verify=verify, after_each=read_work)
        (work,) = works
        if cost_only:
            if inputs:
                raise CompileError("cost-only simulation takes no inputs")
            result = simulate_mesh(module, name, mach, cost_only=True, routing=routing, seed=seed,
                                   sram_policy=sram_policy, listeners=listeners, work=work,  # type: ignore[arg-type]
                                   bound_above=bound_above)
            sim = MeshSimulation([], {}, result.report, pipeline, module, True, result.report.routing)
        else:
            args = prepare_inputs(fn, inputs or {}, seed)
            result = simulate_mesh(module, name, mach, split_arguments(module, name, spec.mesh, args),
                                   sram_policy=sram_policy, listeners=listeners, work=work)  # type: ignore[arg-type]
            outputs = token_outputs(spec.mesh, result.outputs)
            names = [a.name_hint or f"arg{i}" for i, a in enumerate(fn.body.blocks.first.args)]  # type: ignore[union-attr]
            sim = MeshSimulation(outputs, dict(zip(names, args)), result.report, pipeline, module)
    # Every chip runs the one SPMD program: the same choices, loops and contraction mappings.
    loops, contractions = tile_loops(module, name), contraction_mappings(module, name)
    sim.report.choices, sim.report.loops = list(program.choices), loops
    for report in sim.report.chips:
        report.choices, report.loops, report.contractions = list(program.choices), loops, contractions
    return sim


class _CombineScale(Interpreter.Listener):
    """The reference's combine scale A (tolerance.combine_scale) as the reference runs."""

    def __init__(self) -> None:
        self.scale: np.ndarray | None = None

    def will_interpret_op(self, op: Operation, args: tuple[Any, ...]) -> None:
        if isinstance(op, moe.CombineOp):
            plan = args[1]
            self.scale = combine_scale(args[0], plan.scatter_idx, args[2] if len(args) > 2 else None)


def check_on_mesh(program: Program, spec: MeshSpec, sim: MeshSimulation, *, seed: int = 0,
                  graph: str | None = None) -> list[Comparison]:
    """The mesh run's outputs against the single-chip reference on the same inputs: bit for
    bit or within the tolerance (runtime_sim/semantics/tolerance.py), and with tp also within
    TP_SCALE of the combine's scale where an output has the combine's shape (a2a_sum, and sp's
    bf16 reduce-scatter: RECEIVER_SUM_SCALE more each, one rounding of a token's parts each)."""
    listener = _CombineScale()
    factor = (TP_SCALE if spec.mesh.size("tp") > 1 else 0.0) + (RECEIVER_SUM_SCALE if spec.strategy == "a2a_sum" else 0.0)
    factor += RECEIVER_SUM_SCALE if spec.sp_sum == "bf16" and spec.mesh.size("sp") > 1 else 0.0
    ref = program.run(sim.inputs, seed=seed, graph=graph, reference=True, listeners=[listener] if factor else [])
    allowances = None
    if listener.scale is not None:
        allowances = [factor * listener.scale if np.shape(want) == listener.scale.shape else None
                      for want in ref.outputs]
    return compare_outputs(sim.outputs, ref.outputs, allowances, factor or TP_SCALE)
