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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from passes.lowering.lower_dispatch import QUANTIZE_PLACES
from passes.lowering.lower_topk import DEFAULT_STRATEGY, STRATEGIES
from passes.schedule.schedule_experts import ORDERS
from passes.schedule.schedule_shared import MOST_ROWS
from passes.schedule.interleave_chunks import InterleaveChunksPass
from passes.schedule.interleave_shared import InterleaveSharedPass, interleaves
from passes.schedule.return_waves import ReturnWavesPass
from runtime_sim.perf.cost_only import CostOnlyRun, cost_only_bound, cost_only_cycles, cost_only_run
from runtime_sim.perf.report import BetterBlock, Choice
from runtime_sim.perf.routing_scenarios import SCENARIOS
from runtime_sim.semantics.collector import without_gc_pauses
from target.machine import Machine
from tcpc.builder import AutoBlock
from tcpc.diagnostics import Loc
from tcpc.pipelines import (COST_ONLY_PASSES, PassStep, Verified, apply_pipeline, is_auto, parse_pipeline, pipeline_spec,
                            verify_changed)
from tcpc.program import print_ir

BLOCK_SPREAD = 4
"""Candidate blocks range over [share / BLOCK_SPREAD, share * BLOCK_SPREAD], share = T * K / E."""

REORDERING_PASSES = (InterleaveSharedPass.name, InterleaveChunksPass.name, ReturnWavesPass.name)
"""The last passes of the pipeline, which only reorder the commands (split loops, move ops):
a lower bound on the commands' cycles before them holds after them."""


def _share(auto: AutoBlock) -> int:
    """The rows an expert receives under balanced routing (T * K / E, at least 1), within the
    largest block that fits."""
    return min(auto.most, max(1, math.ceil(auto.tokens * auto.k / auto.experts)))


def _distance_from_share(block: int, auto: AutoBlock) -> tuple[int, int]:
    """How far `block` is from the share in powers of two, the larger block first among equals
    (a prefill's best block is often the next power of two above its share)."""
    return abs(block.bit_length() - _share(auto).bit_length()), -block


def block_candidates(auto: AutoBlock) -> list[int]:
    """The block sizes tried for one auto scatter, smallest first (see the module docstring)."""
    most, share = auto.most, _share(auto)
    low, high = max(1, share // BLOCK_SPREAD), min(most, share * BLOCK_SPREAD)
    powers = [1 << i for i in range(high.bit_length()) if low <= 1 << i <= high]
    return sorted({*powers, most})


def choose_block(auto: AutoBlock, cycles_of: Callable[[int, float], int]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The block of fewest cycles (ties: the smaller) among `block_candidates`, extended past an
    end of their powers of two while that keeps lowering the cycles; and every (block, cycles)
    tried, by block. `cycles_of(block, above)` may give, in place of a block's cycles, a lower
    bound on them that is above `above` (the fewest cycles found so far): such a block can
    neither win nor tie, so the choice is the one every block's cycles would make. The blocks
    nearest the expected rows per expert, the likely best, are costed first."""
    tried: dict[int, int] = {}
    for b in sorted(block_candidates(auto), key=lambda b: _distance_from_share(b, auto)):
        tried[b] = cycles_of(b, min(tried.values(), default=math.inf))
    best = min(tried, key=lambda b: (tried[b], b))
    while (beyond := _past_the_end(best, tried, auto.most)) is not None:
        before = tried[best]
        tried[beyond] = cycles_of(beyond, before)
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
_bounds: dict[tuple[object, ...], int] = {}
"""Lower bounds `cost_cycles` gave in place of cycles, by the same keys as `_costs`."""
_spilling: dict[tuple[object, ...], int] = {}
"""Buffers spilled or streamed by the memory plans `cost_cycles` simulated, by the same keys
as `_costs`, where there were any (`spilled`)."""
COMPILED_KEPT = 2
"""How many programs `cost_cycles` keeps a compiled form (and run) of for `take_compiled`: the
latest, and the cheapest of the others (a block search's choice, which the strategy and order
choices and the run then take, costed before later blocks). So at most this many runs are
kept: a run is large."""
BLOCK_RUN_KEPT_COMMANDS = 20_000
"""The most commands a block candidate's run may have to be kept (a decode layer's: a few
thousand, a few MB). A prefill block search's best run would be held while every later
candidate is simulated, above the peak memory of the choices without it (DeepSeek-V3 T =
4096: 83,039 commands; the row's peak RSS 329 -> 402 MB)."""


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
"""(program, machine) -> its cheapest compiled form costed: COMPILED_KEPT programs, the latest last."""


def take_compiled(module: ModuleOp, passes: Sequence[ModulePass], machine: Machine,
                  run_of: tuple[object, ...] = (),
                  after_each: Callable[[PassStep], None] | None = None) -> tuple[ModuleOp, CostOnlyRun | None]:
    """`module` after the cost-only passes and `passes`, compiled for `machine`
    (apply_pipeline), and its cost-only run of `run_of` = (function, routing scenario, seed)
    if one is kept. A run simulates the program its choices found cheapest, which they
    compiled and simulated to cost it: `cost_cycles` keeps the cheapest compiled form of each
    of the latest programs it costed, with its run (trace, plan and schedule) when it costed
    one function; this hands them over if they are the ones asked for (forgetting them, so
    whoever runs the IR may annotate it); else it compiles, and there is no run. With
    `after_each` (a watcher of every pass) it always compiles, for the watcher to see."""
    program = (print_ir(module), repr(machine))
    kept = _compiled.get(program) if after_each is None else None
    if kept is not None and kept.passes == tuple(map(repr, passes)):
        del _compiled[program]
        with without_gc_pauses():  # verifying makes a mark per op (tcpc/pipelines.py), which the collector would rescan
            verify_changed(kept.module, Verified())  # compiled unverified, as every candidate is (cost_cycles)
        return kept.module, kept.run if kept.run_of == run_of else None
    return compiled_cost_only(module, passes, machine, after_each), None


_prefixes: dict[tuple[str, ...], ModuleOp] = {}
"""The passes (their reprs) -> the program `_prefixes_of` names after the cost-only passes and
those passes, for the alternatives of the choices that fork after them (`compiled_candidate`)."""
_prefixes_of: tuple[ModuleOp | None, str] = (None, "")
"""The program and the machine (its repr) of `_prefixes`: the program itself, not its text,
which has no source locations (two programs of one text would share their reports' lines)."""


def compiled_candidate(module: ModuleOp, passes: Sequence[ModulePass], machine: Machine) -> ModuleOp:
    """`compiled_cost_only(module, passes, machine, verify="none")`, from the longest prefix of
    `passes` kept compiled: the IR before each pass a choice forks at (AUTO_CHOICES) is kept, so
    that alternatives which differ only from there on (a loop order after the lowering and the
    shared expert's rows chosen) compile what they share once. Kept for one program and
    machine at a time."""
    global _prefixes_of
    if _prefixes_of[0] is not module or _prefixes_of[1] != repr(machine):
        _prefixes.clear()
        _prefixes_of = (module, repr(machine))
    names = tuple(map(repr, passes))
    forks = [i for i, p in enumerate(passes) if i > 0 and p.name in AUTO_CHOICES]
    start = next((i for i in reversed(forks) if names[:i] in _prefixes), None)
    if not forks:
        return compiled_cost_only(module, passes, machine, verify="none")
    if start is None:
        start = forks[0]
        _prefixes[names[:start]] = compiled_cost_only(module, passes[:start], machine, verify="none")
    lowered = _prefixes[names[:start]]
    for end in [i for i in forks if i > start] + [len(passes)]:
        lowered = apply_pipeline(lowered, list(passes[start:end]), machine=machine, verify="none")  # a copy
        if end < len(passes):
            _prefixes[names[:end]] = lowered
        start = end
    return lowered


def compiled_cost_only(module: ModuleOp, passes: Sequence[ModulePass], machine: Machine,
                       after_each: Callable[[PassStep], None] | None = None, verify: str = "each") -> ModuleOp:
    """`module` after the cost-only passes (COST_ONLY_PASSES) and `passes`, for `machine`,
    verified as `verify` says (apply_pipeline)."""
    return apply_pipeline(module, [*parse_pipeline(",".join(COST_ONLY_PASSES)), *passes], after_each,
                          machine=machine, verify=verify)


class _AboveBest(Exception):
    """An alternative's run stopped at a lower bound on its cycles above the best's."""

    def __init__(self, bound: int):
        super().__init__(bound)
        self.bound = bound


def cost_cycles(module: ModuleOp, functions: Sequence[str], passes: Sequence[ModulePass], machine: Machine,
                routing: str | Path, seed: int, keep_below: float = 0, keep_commands: float = math.inf,
                above: float = math.inf, bound_first: bool = False, fork: bool = False) -> tuple[int, bool]:
    """Total cycles of `functions` after `passes`, simulated cost-only with the routing scenario;
    and whether they are a lower bound instead: with `above` (the fewest cycles of the
    alternatives a choice costed so far) and one function, a program whose commands' lower
    bound (LowerBoundBar: their roofline, their busiest unit's cycles) is above it is neither
    planned nor scheduled (cost_only_run's `bound_above`): it cannot win, and the bound says
    by how much at least. With `fork` (a choice's alternatives), what the program shares with
    the alternatives costed before it is not compiled again (`compiled_candidate`). With
    `bound_first` (a block search's later candidates, which seldom win), a program that
    interleave-shared, last but interleave-chunks, would reorder is bounded before the two
    (cost_only_bound; `interleaves`), whose pieces are then built only for a candidate the
    bound does not rule out (DeepSeek-V3 at T = 4096: none of five).

    Remembered for the process, by the module's text and everything else the cycles depend on:
    the block search and the strategy choice cost the chosen block's program alike, a report's
    better-block search costs the run's own block again, and a program compiled again (the
    Python API, tests) is not simulated again; a bound is remembered apart, and simulated when
    a later `above` is not below it. A routing read from a file is not remembered (the file may
    change). The run of one function with a routing scenario is kept for `take_compiled` when
    its cycles are below `keep_below` and below every other form of the program costed, and
    it has at most `keep_commands` commands (a block search keeps its best block's so far,
    a strategy or order choice its best alternative's: the run that follows then simulates
    nothing again). Without a finite `keep_below` (a block search's first block, a strategy
    or order alternative) the runs kept for other programs are dropped: a run is large, and
    only the latest choice's is taken."""
    text = print_ir(module)
    key = (text, tuple(functions), tuple(map(repr, passes)), repr(machine))
    full = _remembered_key(key, routing, seed)
    bound = _bounds.get(full) if full is not None and full not in _costs else None
    if bound is not None and bound > above:
        return bound, True

    def cycles() -> int:
        last = len(passes)
        while last and passes[last - 1].name in REORDERING_PASSES:
            last -= 1
        if bound_first and above < math.inf and len(functions) == 1 and last < len(passes):
            lowered = compiled_cost_only(module, passes[:last], machine, verify="none")
            if interleaves(lowered):  # its commands' bound is the same before the passes
                bound = cost_only_bound(lowered, functions[0], machine, above, routing=routing, seed=seed)
                if bound is not None:
                    raise _AboveBest(bound)
            lowered = apply_pipeline(lowered, list(passes[last:]), machine=machine, verify="none")
        else:
            lowered = (compiled_candidate(module, passes, machine) if fork
                       else compiled_cost_only(module, passes, machine, verify="none"))
        program = (text, repr(machine))
        kept = _compiled.get(program)
        if len(functions) == 1:
            keep = str(routing) in SCENARIOS  # a scenario's run, kept if the cheapest yet
            run = cost_only_run(lowered, functions[0], machine, routing=routing, seed=seed,
                                keep_below=min(keep_below, math.inf if kept is None else kept.cycles) if keep else 0,
                                bound_above=above)
            if run.bound:
                raise _AboveBest(run.cycles)
            total = run.cycles
            if run.spills and full is not None:
                _remember(_spilling, full, run.spills)
        else:
            run = None
            total = sum(cost_only_cycles(lowered, name, machine, routing=routing, seed=seed) for name in functions)
        _compiled.pop(program, None)
        if kept is None or total < kept.cycles:  # the first of equals: a choice's tie goes to its first alternative
            small = run is not None and run.trace is not None and len(run.trace.ops) <= keep_commands
            kept = _Compiled(total, tuple(map(repr, passes)), lowered, run if small else None,
                             (functions[0], str(routing), seed))
        if keep_below == math.inf:  # a choice's first costing, or a strategy or order's: earlier choices' runs go
            for other in _compiled.values():
                other.run = None
        _compiled[program] = kept  # the latest last
        while len(_compiled) > COMPILED_KEPT:
            del _compiled[max(list(_compiled)[:-1], key=lambda p: _compiled[p].cycles)]
        return total

    try:
        # One pause over the compile and the run: a collection between them would scan the
        # compiled module while alive, then again, older, once the candidate drops it.
        with without_gc_pauses():
            return remembered(key, routing, seed, cycles), False
    except _AboveBest as e:
        if full is not None:
            _remember(_bounds, full, e.bound)
        return e.bound, True


def spilled(module: ModuleOp, functions: Sequence[str], passes: Sequence[ModulePass], machine: Machine,
            routing: str | Path, seed: int) -> bool:
    """Whether `cost_cycles` found, for the same arguments, a memory plan that spilled or
    streamed a buffer (remembered for a routing scenario; False when not known)."""
    key = (print_ir(module), tuple(functions), tuple(map(repr, passes)), repr(machine))
    full = _remembered_key(key, routing, seed)
    return full is not None and full in _spilling


def _remembered_key(key: tuple[object, ...], routing: str | Path, seed: int) -> tuple[object, ...] | None:
    """`remembered`'s key; None for a routing read from a file (the file may change)."""
    return (*key, str(routing), seed) if str(routing) in SCENARIOS else None


def _remember(memo: dict[tuple[object, ...], int], key: tuple[object, ...], value: int) -> None:
    """memo[key] = value, the oldest of COSTS_KEPT forgotten first."""
    if len(memo) >= COSTS_KEPT:
        del memo[next(iter(memo))]
    memo[key] = value


def remembered(key: tuple[object, ...], routing: str | Path, seed: int, cycles: Callable[[], int]) -> int:
    """`cycles()`, remembered for the process by `key` (everything but the routing that the
    cycles depend on), the routing scenario and the seed; a routing read from a file is not
    remembered (the file may change). The oldest of COSTS_KEPT are forgotten first."""
    full = _remembered_key(key, routing, seed)
    if full in _costs:
        return _costs[full]  # type: ignore[index]
    value = cycles()
    if full is not None:
        _remember(_costs, full, value)
    return value


class BlockCycles:
    """The cycles of `auto`'s graph with its scatter at a given block and the others at `blocks`
    (as built where not given), in the expert loop `order` given (default: the pass's), each
    block and order costed once; `cost` (a module, its graph and `above` -> cycles and whether
    they are a lower bound above `above`, such as a mesh's) replaces one chip's, in its own
    pipeline's loop order. Asked with `above`, the cycles may be a lower bound above it
    (cost_cycles): `bounded` holds those blocks."""

    def __init__(self, auto: AutoBlock, blocks: Mapping[Loc, int], build: Callable[[Mapping[Loc, int]], ModuleOp],
                 machine: Machine, routing: str | Path, seed: int,
                 cost: Callable[[ModuleOp, str, float], tuple[int, bool]] | None = None):
        self.auto, self.blocks, self.build, self.cost = auto, blocks, build, cost
        self.machine, self.routing, self.seed = machine, routing, seed
        self.bounded: set[int] = set()
        self._known: dict[tuple[int, str], tuple[int, bool]] = {}

    def __call__(self, block: int, above: float = math.inf, order: str = ORDERS[0]) -> int:
        known = self._known.get((block, order))
        if known is None or (known[1] and known[0] <= above):  # not costed, or a bound no longer above
            module = self.build({**self.blocks, self.auto.loc: block})
            if self.cost is not None:
                assert order == ORDERS[0], "a given cost has its own loop order"
                known = self.cost(module, self.auto.graph, above)
            else:
                # top-k and the loop order at the passes' defaults: they are chosen after the block, at the block chosen
                pipeline = pipeline_spec(topk_strategy=DEFAULT_STRATEGY, expert_order=order)
                known = cost_cycles(module, [self.auto.graph], parse_pipeline(pipeline), self.machine, self.routing,
                                    self.seed, keep_below=above, keep_commands=BLOCK_RUN_KEPT_COMMANDS, above=above,
                                    bound_first=True)
            self._known[block, order] = known
        if order == ORDERS[0]:
            (self.bounded.add if known[1] else self.bounded.discard)(block)
        return known[0]


def choose_blocks(autos: Sequence[AutoBlock], build: Callable[[Mapping[Loc, int]], ModuleOp], filename: str,
                  machine: Machine, routing: str | Path = "balanced", seed: int = 0,
                  cost: Callable[[ModuleOp, str, float], tuple[int, bool]] | None = None,
                  on: str = "") -> tuple[dict[Loc, int], list[Choice]]:
    """A block size for every auto scatter, in source order: each one's candidates are costed
    with the earlier ones at their choice and the later ones at the largest block that fits.
    `build` compiles the program with the given blocks; `cost` costs a candidate in place of
    one chip's simulation (`on` names where, for the choice's report)."""
    chosen: dict[Loc, int] = {}
    choices: list[Choice] = []
    for auto in autos:
        cycles_of = BlockCycles(auto, chosen, build, machine, routing, seed, cost)
        best, tried = choose_block(auto, cycles_of)
        chosen[auto.loc] = best
        choices.append(Choice("block", _where(filename, auto.loc), auto.reason, best, tuple(tried), str(routing), on,
                              tuple(b for b, _ in tried if b in cycles_of.bounded)))
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
        cycles_of = BlockCycles(scatter, {}, build, machine, routing, seed)
        best, tried = choose_block(scatter, cycles_of)
        given, fewest = min(cycles_of(scatter.given, order=order) for order in ORDERS), dict(tried)[best]
        if given > BETTER_BLOCK_RATIO * fewest:
            better.append(BetterBlock(_where(filename, scatter.loc), scatter.given, given, best, fewest, str(routing),
                                      scatter.dim))
    return better


def _where(filename: str, loc: Loc) -> str:
    return f"{filename}:{loc.line}:{loc.col}"


AUTO_CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lower-topk": ("strategy", STRATEGIES),
    "lower-dispatch": ("quantize", QUANTIZE_PLACES),
    "schedule-experts": ("order", ORDERS),
    "schedule-shared": ("most_rows", MOST_ROWS),
}
"""Pass -> the option the driver chooses when it is `auto` and its alternatives, the pass's
default first (a tie keeps it): lower-topk's strategy, where lower-dispatch quantizes
block-scaled activations (each block's rows or each token once), schedule-experts' loop order,
schedule-shared's largest row block (the shared weights' passes through HBM against SRAM)."""


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

        def trial_of(value: str, i: int = i, p: ModulePass = p, option: str = option) -> list[ModulePass]:
            trial = [with_option(p, option, value) if j == i else _default_if_auto(q) for j, q in enumerate(resolved)]
            return [*trial, *rest]

        costed: dict[str, tuple[int, bool]] = {}
        for v in alternatives:  # an alternative bounded above the best so far can neither win nor tie
            costed[v] = cost_cycles(module, functions, trial_of(v), machine, routing, seed, keep_below=math.inf,
                                    above=min((c for c, _ in costed.values()), default=math.inf), fork=True)
        tried = tuple((v, c) for v, (c, _) in costed.items())
        fitting = [(v, c) for v, c in tried if not (p.name in FITTING_CHOICES and v != alternatives[0]
                                                    and spilled(module, functions, trial_of(v), machine, routing, seed))]
        best = min(fitting, key=lambda t: (t[1], alternatives.index(t[0])))[0]  # ties: the pass's default
        resolved[i] = with_option(p, option, best)
        choices.append(Choice(f"{p.name} {option}", f"pass {i + 1} of the pipeline", f"{option}=auto", best, tried,
                              str(routing), bounded=tuple(v for v, (_, bound) in costed.items() if bound)))
    return resolved, choices


FITTING_CHOICES = ("schedule-shared",)
"""Passes whose `auto` alternatives other than the default are taken only when the memory
plan fits every buffer in SRAM (no spill or stream): schedule-shared's larger row blocks,
which buy their fewer weight passes with SRAM (Llama-4-Scout at T = 2048 spilled 3 buffers
with 1,024 rows; its spills cost less than the weights they saved, but the schedule level
places every buffer in SRAM itself and the memory plan only checks it: docs/architecture.md)."""


def _default_if_auto(p: ModulePass) -> ModulePass:
    """A later `auto` costs as its pass's default while an earlier one is chosen."""
    if is_auto(p):
        option, alternatives = AUTO_CHOICES[p.name]
        return with_option(p, option, alternatives[0])
    return p


def with_option(p: ModulePass, option: str, value: str) -> ModulePass:
    """`p` with `option` = `value`, of the type of the option's default, as the pipeline's
    parser gives it (`most_rows=512` parses as an int): the same pass then has the same repr,
    which `cost_cycles` remembers it by, whether parsed or chosen (an alternative costed by
    the block search is not simulated again by a choice)."""
    default = next(f.default for f in fields(p) if f.name == option)
    typed = value if default is MISSING or isinstance(default, str) else type(default)(value)
    return replace(p, **{option: typed})  # type: ignore[type-var]
