"""Choices by the cost model: a scatter's block size (`block=auto`, and the default when the
program's block cannot fit), lower-topk's strategy (`strategy=auto`) and the expert loop's
order (`schedule-experts{order=auto}`: a block at a time, or groups of blocks sharing each
weight tile, passes/schedule/_expert_groups.py).

Each alternative is compiled through the full pipeline and simulated cost-only (no values:
pin-routing, then runtime_sim.perf.cost_only) on the run's machine with the run's routing
scenario (balanced unless the run names another); the alternative with the fewest total
cycles wins, ties going to the first one tried (the smaller block; `rank`, the default
strategy; `block`, the default order). The choice lives here, in the driver: passes never import the performance model
(the layering rule), so a pass given `strategy=auto` without the driver refuses to run.

Block candidates are kept few, so that a decode compile stays fast: the powers of two from a
quarter to four times the expected rows per expert under balanced routing (T * K / E, at
least 1), within [1, the largest block that fits], plus that largest block (T, or the
capacity). Fewer rows than a quarter of an expert's share multiply the blocks (and the
simulated loop iterations) for nothing; more than four times it pads every block. When the
cheapest candidate is an end of that range of powers of two, the search goes on past it, a
power of two at a time, while the cycles keep falling.

A block the program fixes (`B = 4` written for a small T) is kept, even at a T where it is far
from the best; a report looks for that (`better_blocks`) by the same search, and names the
compiler's block when it is more than BETTER_BLOCK_RATIO times faster.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from passes.lowering.lower_topk import DEFAULT_STRATEGY, STRATEGIES
from passes.schedule.schedule_experts import ORDERS
from runtime_sim.perf.cost_only import CostOnlyRun, cost_only_cycles, cost_only_run
from runtime_sim.perf.report import BetterBlock, Choice
from runtime_sim.perf.routing_scenarios import SCENARIOS
from target.machine import Machine
from tcpc.builder import AutoBlock
from tcpc.diagnostics import Loc
from tcpc.pipelines import COST_ONLY_PASSES, apply_pipeline, is_auto, parse_pipeline, pipeline_spec
from tcpc.program import print_ir

BLOCK_SPREAD = 4
"""Candidate blocks range over [share / BLOCK_SPREAD, share * BLOCK_SPREAD], share = T * K / E."""


def block_candidates(auto: AutoBlock) -> list[int]:
    """The block sizes tried for one auto scatter, smallest first (see the module docstring)."""
    most = auto.most
    share = min(most, max(1, math.ceil(auto.tokens * auto.k / auto.experts)))
    low, high = max(1, share // BLOCK_SPREAD), min(most, share * BLOCK_SPREAD)
    powers = [1 << i for i in range(high.bit_length()) if low <= 1 << i <= high]
    return sorted({*powers, most})


def choose_block(auto: AutoBlock, cycles_of: Callable[[int], int]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The block of fewest cycles (ties: the smaller) among `block_candidates`, extended past an
    end of their powers of two while that keeps lowering the cycles; and every (block, cycles)
    tried, by block."""
    tried = {b: cycles_of(b) for b in block_candidates(auto)}
    best = min(tried, key=lambda b: (tried[b], b))
    while (beyond := _past_the_end(best, tried, auto.most)) is not None:
        before = tried[best]
        tried[beyond] = cycles_of(beyond)
        if tried[beyond] <= before and (tried[beyond] < before or beyond < best):
            best = beyond  # fewer cycles, or as many with a smaller block
        if tried[beyond] >= before:
            break  # the cycles stopped falling
    return best, tuple(sorted(tried.items()))


def _past_the_end(best: int, tried: Mapping[int, int], most: int) -> int | None:
    """The next power of two past `best` when it is the smallest or the largest power of two
    tried, if it fits and was not tried; else None."""
    powers = [b for b in tried if b & (b - 1) == 0 and b != most]  # the range's, not the largest block
    if best not in powers:
        return None
    if best == min(powers) and best > 1 and best // 2 not in tried:
        return best // 2
    if best == max(powers) and best * 2 < most and best * 2 not in tried:
        return best * 2
    return None


COSTS_KEPT = 1024
"""How many costings `cost_cycles` remembers (the oldest are forgotten first)."""
_costs: dict[tuple[object, ...], int] = {}
COMPILED_KEPT = 2
"""How many programs `cost_cycles` keeps a compiled form (and run) of for `take_compiled`."""


@dataclass
class _Compiled:
    """A program's cheapest compiled form costed, and its cost-only run when one was kept."""

    cycles: int
    passes: tuple[str, ...]
    module: ModuleOp
    run: CostOnlyRun | None = None
    run_of: tuple[object, ...] = ()
    """(function, routing scenario, seed) of `run`."""


_compiled: dict[tuple[str, str], _Compiled] = {}
"""(program, machine) -> its cheapest compiled form costed: the latest COMPILED_KEPT programs."""


def take_compiled(module: ModuleOp, passes: Sequence[ModulePass], machine: Machine,
                  run_of: tuple[object, ...] = ()) -> tuple[ModuleOp, CostOnlyRun | None]:
    """`module` after the cost-only passes and `passes`, compiled for `machine`
    (apply_pipeline), and its cost-only run of `run_of` = (function, routing scenario, seed)
    if one is kept. A run simulates the program its choices found cheapest, which they
    compiled and simulated to cost it: `cost_cycles` keeps the cheapest compiled form of each
    of the latest programs it costed, with its run (trace, plan and schedule) when it costed
    one function; this hands them over if they are the ones asked for (forgetting them, so
    whoever runs the IR may annotate it); else it compiles, and there is no run."""
    program = (print_ir(module), repr(machine))
    kept = _compiled.get(program)
    if kept is not None and kept.passes == tuple(map(repr, passes)):
        del _compiled[program]
        return kept.module, kept.run if kept.run_of == run_of else None
    return apply_pipeline(module, [*parse_pipeline(",".join(COST_ONLY_PASSES)), *passes], machine=machine), None


def cost_cycles(module: ModuleOp, functions: Sequence[str], passes: Sequence[ModulePass], machine: Machine,
                routing: str | Path, seed: int, keep_run: bool = False) -> int:
    """Total cycles of `functions` after `passes`, simulated cost-only with the routing scenario.

    Remembered for the process, by the module's text and everything else the cycles depend on:
    the block search and the strategy choice cost the chosen block's program alike, a report's
    better-block search costs the run's own block again, and a program compiled again (the
    Python API, tests) is not simulated again. A routing read from a file is not remembered (the
    file may change). With `keep_run`, the run of the program's cheapest form costed is kept
    for `take_compiled` (the latest program's only: a run is large)."""
    text = print_ir(module)

    def cycles() -> int:
        lowered = apply_pipeline(module, [*parse_pipeline(",".join(COST_ONLY_PASSES)), *passes], machine=machine)
        program = (text, repr(machine))
        kept = _compiled.pop(program, None)
        if keep_run and len(functions) == 1 and str(routing) in SCENARIOS:  # a scenario's run, kept if the cheapest yet
            run = cost_only_run(lowered, functions[0], machine, routing=routing, seed=seed,
                                keep_below=math.inf if kept is None else kept.cycles)
            total = run.cycles
        else:
            run = None
            total = sum(cost_only_cycles(lowered, name, machine, routing=routing, seed=seed) for name in functions)
        if kept is None or total < kept.cycles:  # the first of equals: a choice's tie goes to its first alternative
            kept = _Compiled(total, tuple(map(repr, passes)), lowered, run if run is not None and run.trace else None,
                             (functions[0], str(routing), seed))
        for other in _compiled.values():
            other.run = None  # runs of the latest program only
        _compiled[program] = kept  # the latest last
        while len(_compiled) > COMPILED_KEPT:
            del _compiled[next(iter(_compiled))]
        return total

    return remembered((text, tuple(functions), tuple(map(repr, passes)), repr(machine)), routing, seed, cycles)


def remembered(key: tuple[object, ...], routing: str | Path, seed: int, cycles: Callable[[], int]) -> int:
    """`cycles()`, remembered for the process by `key` (everything but the routing that the
    cycles depend on), the routing scenario and the seed; a routing read from a file is not
    remembered (the file may change). The oldest of COSTS_KEPT are forgotten first."""
    full = (*key, str(routing), seed) if str(routing) in SCENARIOS else None
    if full in _costs:
        return _costs[full]  # type: ignore[index]
    value = cycles()
    if full is not None:
        if len(_costs) >= COSTS_KEPT:
            del _costs[next(iter(_costs))]
        _costs[full] = value
    return value


def block_cycles(auto: AutoBlock, blocks: Mapping[Loc, int], build: Callable[[Mapping[Loc, int]], ModuleOp],
                 machine: Machine, routing: str | Path, seed: int,
                 cost: Callable[[ModuleOp, str], int] | None = None) -> Callable[..., int]:
    """The cycles of `auto`'s graph with its scatter at a given block and the others at `blocks`
    (as built where not given), in the expert loop `order` given (default: the pass's), each
    block and order costed once; `cost` (a module and its graph -> cycles, such as a mesh's)
    replaces one chip's, in its own pipeline's loop order."""
    @functools.cache
    def cycles_of(block: int, order: str = ORDERS[0]) -> int:
        module = build({**blocks, auto.loc: block})
        if cost is not None:
            assert order == ORDERS[0], "a given cost has its own loop order"
            return cost(module, auto.graph)
        # top-k and the loop order at the passes' defaults: they are chosen after the block, at the block chosen
        pipeline = pipeline_spec(topk_strategy=DEFAULT_STRATEGY, expert_order=order)
        return cost_cycles(module, [auto.graph], parse_pipeline(pipeline), machine, routing, seed)
    return cycles_of


def choose_blocks(autos: Sequence[AutoBlock], build: Callable[[Mapping[Loc, int]], ModuleOp], filename: str,
                  machine: Machine, routing: str | Path = "balanced", seed: int = 0,
                  cost: Callable[[ModuleOp, str], int] | None = None,
                  on: str = "") -> tuple[dict[Loc, int], list[Choice]]:
    """A block size for every auto scatter, in source order: each one's candidates are costed
    with the earlier ones at their choice and the later ones at the largest block that fits.
    `build` compiles the program with the given blocks; `cost` costs a candidate in place of
    one chip's simulation (`on` names where, for the choice's report)."""
    chosen: dict[Loc, int] = {}
    choices: list[Choice] = []
    for auto in autos:
        best, tried = choose_block(auto, block_cycles(auto, chosen, build, machine, routing, seed, cost))
        chosen[auto.loc] = best
        choices.append(Choice("block", _where(filename, auto.loc), auto.reason, best, tuple(tried), str(routing), on))
    return chosen, choices


BETTER_BLOCK_RATIO = 1.5
"""A fixed block is reported when the compiler's choice is more than this many times faster."""


def better_blocks(fixed: Sequence[AutoBlock], build: Callable[[Mapping[Loc, int]], ModuleOp], filename: str,
                  machine: Machine, routing: str | Path = "balanced", seed: int = 0) -> list[BetterBlock]:
    """The scatters whose fixed block takes more than BETTER_BLOCK_RATIO times the cycles of
    the block `choose_block` picks in its place (the other scatters as built), with both blocks'
    cycles: what block=auto would have given. The fixed block is costed in the expert loop
    order the run would choose for it (groups of blocks make a small block cheap where a
    block at a time refetches its expert's weights), the search's blocks as block=auto costs
    them. `build` compiles the program with the given blocks."""
    better: list[BetterBlock] = []
    for scatter in fixed:
        assert scatter.given is not None, "a fixed block is given"
        cycles_of = block_cycles(scatter, {}, build, machine, routing, seed)
        best, tried = choose_block(scatter, cycles_of)
        given, fewest = min(cycles_of(scatter.given, order) for order in ORDERS), dict(tried)[best]
        if given > BETTER_BLOCK_RATIO * fewest:
            better.append(BetterBlock(_where(filename, scatter.loc), scatter.given, given, best, fewest, str(routing),
                                      scatter.dim))
    return better


def _where(filename: str, loc: Loc) -> str:
    return f"{filename}:{loc.line}:{loc.col}"


AUTO_CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lower-topk": ("strategy", STRATEGIES),
    "schedule-experts": ("order", ORDERS),
}
"""Pass -> the option the driver chooses when it is `auto` and its alternatives, the pass's
default first (a tie keeps it): lower-topk's strategy, schedule-experts' loop order."""


def resolve_autos(module: ModuleOp, passes: Sequence[ModulePass], functions: Sequence[str], machine: Machine,
                  routing: str | Path = "balanced", seed: int = 0) -> tuple[list[ModulePass], list[Choice]]:
    """`passes` with every `auto` option (`AUTO_CHOICES`) replaced by the alternative of fewest
    cycles, in pipeline order (an `auto` later in the pipeline costs as its pass's default
    while an earlier one is chosen). Each alternative is costed fully lowered: the given
    passes, then the passes of the full pipeline that they do not name, in its order, so a
    pipeline that stops early (`--emit lowered`) chooses as the full one does."""
    resolved = list(passes)
    choices: list[Choice] = []
    full = parse_pipeline(pipeline_spec(topk_strategy=None))
    for i, p in enumerate(resolved):
        if not is_auto(p):
            continue
        option, alternatives = AUTO_CHOICES[p.name]
        named = {q.name for q in resolved}
        rest = [q for q in full if q.name not in named]

        def cycles_of(value: str, i: int = i, p: ModulePass = p, option: str = option) -> int:
            trial = [replace(p, **{option: value}) if j == i else _default_if_auto(q) for j, q in enumerate(resolved)]  # type: ignore[type-var]
            return cost_cycles(module, functions, [*trial, *rest], machine, routing, seed, keep_run=True)

        tried = tuple((v, cycles_of(v)) for v in alternatives)
        best = min(tried, key=lambda t: (t[1], alternatives.index(t[0])))[0]  # ties: the pass's default
        resolved[i] = replace(p, **{option: best})  # type: ignore[type-var]
        choices.append(Choice(f"{p.name} {option}", f"pass {i + 1} of the pipeline", f"{option}=auto", best, tried,
                              str(routing)))
    return resolved, choices


def _default_if_auto(p: ModulePass) -> ModulePass:
    """A later `auto` costs as its pass's default while an earlier one is chosen."""
    if is_auto(p):
        option, alternatives = AUTO_CHOICES[p.name]
        return replace(p, **{option: alternatives[0]})  # type: ignore[type-var]
    return p
