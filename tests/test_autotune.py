"""Choices by the cost model (tcpc/autotune.py): `block=auto`, auto as the default for a block
that cannot fit (decode with the program's prefill B), and `lower-topk{strategy=auto}`.

No cycle count is pinned: the tests assert relations (the choice has the fewest cycles of the
alternatives the report lists, the run costs what its choice was costed at, the same choice
twice), so they hold as the cost model moves.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from xdsl.passes import ModulePass

import tcpc
import tcpc.autotune
from passes.lowering.lower_dispatch import quantizes_dispatched_tokens
from runtime_sim.perf import cost_only
from runtime_sim.perf.report import Choice
from target.machine import default_machine
from tcpc.autotune import BETTER_BLOCK_RATIO, block_candidates, choose_block
from tcpc.builder import AutoBlock
from tcpc.cli import main
from tcpc.diagnostics import Loc
from tcpc.pipelines import FULL_PIPELINE
from tcpc.pipelines import LEVELS
from tcpc.program import print_ir
from tcpc.sweep import chosen_block

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FAMILIES = sorted(p.name for p in EXAMPLES.glob("*.moe"))
MIXTRAL_AUTO = (EXAMPLES / "mixtral.moe").read_text().replace("block=B", "block=auto")


def assert_cheapest(choice: Choice) -> None:
    """The chosen alternative has the fewest cycles; among equals, the first tried."""
    cycles = dict(choice.alternatives)
    fewest = min(cycles.values())
    assert cycles[choice.chosen] == fewest
    assert next(v for v, c in choice.alternatives if c == fewest) == choice.chosen


def auto(tokens: int, k: int, experts: int, capacity: int | None = None) -> AutoBlock:
    return AutoBlock("g", Loc(1, 1), tokens, k, experts, capacity)


@pytest.mark.parametrize("tokens, k, experts, capacity, expected", [
    (1, 8, 128, None, [1]),  # decode: one token, one row per expert
    (16, 8, 128, None, [1, 2, 4, 16]),  # share 1: up to 4, then T
    (64, 8, 128, None, [1, 2, 4, 8, 16, 64]),  # share 4
    (4096, 8, 128, None, [64, 128, 256, 512, 1024, 4096]),  # share 256
    (4096, 8, 128, 100, [32, 64, 100]),  # the capacity bounds the share and every block
    (3, 2, 2, None, [1, 2, 3]),  # the largest block that fits need not be a power of two
])
def test_block_candidates(tokens: int, k: int, experts: int, capacity: int | None, expected: list[int]) -> None:
    assert block_candidates(auto(tokens, k, experts, capacity)) == expected


@pytest.mark.parametrize("best, expected_tried", [
    (4, [1, 2, 4, 8, 16, 64]),  # inside the range: the candidates only
    (64, [1, 2, 4, 8, 16, 64]),  # T itself: nothing past it
    (32, [1, 2, 4, 8, 16, 32, 64]),  # past the largest power of two tried, up to the best
])
def test_choose_block_searches_past_the_ends(best: int, expected_tried: list[int]) -> None:
    """Synthetic cycles with one minimum: the search finds it, and tries one block past it at most."""
    chosen, tried = choose_block(auto(64, 8, 128), lambda b, above: abs(b.bit_length() - best.bit_length()) + 100)
    assert chosen == best
    assert [b for b, _ in tried] == expected_tried


def test_choose_block_goes_down_while_it_pays() -> None:
    chosen, tried = choose_block(auto(4096, 8, 128), lambda b, above: abs(b - 16) + 7)
    assert chosen == 16 and [b for b, _ in tried] == [8, 16, 32, 64, 128, 256, 512, 1024, 4096]


def test_choose_block_ties_go_to_the_smaller_block() -> None:
    chosen, tried = choose_block(auto(4096, 8, 128), lambda b, above: 5)
    assert chosen == 32 and tried[0] == (32, 5)  # one past the lower end, equal: the smaller wins, then it stops


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_runs_without_setting_b(family: str) -> None:
    """T = 1 with the example's B = auto (the toy's B = 2 cannot fit, so auto is its default too):
    the compiler picks the block, then the top-k strategy at that block (and, for a program that
    quantizes dispatched tokens, where lower-dispatch quantizes them); the run costs what the
    last choice was costed at."""
    program = tcpc.compile_file(EXAMPLES / family, {"T": 1})
    (choice,) = program.choices
    assert choice.what == "block" and choice.chosen == 1
    assert ("block = 2 does not fit" if family == "toy.moe" else "block=auto") in choice.reason
    assert "B = 1," in program.graph_ir()
    sim = program.simulate(cost_only=True)
    block, strategy, *quantize, order = sim.report.choices
    assert block == choice and strategy.what == "lower-topk strategy" and order.what == "schedule-experts order"
    assert [q.what for q in quantize] == (["lower-dispatch quantize"] if quantizes_dispatched_tokens(program.module) else [])
    assert sim.report.total_cycles == dict(order.alternatives)[order.chosen] == min(dict(order.alternatives).values())
    assert dict(strategy.alternatives)["rank"] == dict(choice.alternatives)[1]  # both costed the same program
    before = quantize[0] if quantize else strategy
    assert dict(order.alternatives)["block"] == dict(before.alternatives)[before.chosen]
    if quantize:
        assert dict(quantize[0].alternatives)["blocks"] == dict(strategy.alternatives)[strategy.chosen]


@pytest.mark.parametrize("family", ["mixtral.moe", "deepseek_v3.moe"])
def test_decode_with_values_matches_the_reference(family: str) -> None:
    program = tcpc.compile_file(EXAMPLES / family, {"T": 1})
    sim = program.simulate(seed=3)
    ref = program.run(seed=3)
    for got, want in zip(sim.outputs, ref.outputs):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_block_auto_picks_the_fewest_cycles_and_runs_at_them() -> None:
    program = tcpc.compile_source(MIXTRAL_AUTO, filename="mixtral_auto.moe")
    (choice,) = program.choices
    assert choice.reason == "block=auto" and choice.where == "mixtral_auto.moe:9:52"
    assert [b for b, _ in choice.alternatives] == block_candidates(auto(16, 2, 8))
    assert len({c for _, c in choice.alternatives}) > 1  # the block matters, so the choice means something
    assert_cheapest(choice)
    sim = program.simulate(cost_only=True)
    assert sim.report.total_cycles == dict(choice.alternatives)[choice.chosen]
    experts = [loop for loop in sim.report.loops if loop.phase == "experts"]
    assert experts and any(f", {choice.chosen}, " in t for t in experts[0].tiles)  # the block's rows


def test_block_auto_is_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    first = tcpc.compile_source(MIXTRAL_AUTO)
    monkeypatch.setattr(tcpc.autotune, "_costs", {})  # costed again, not remembered
    second = tcpc.compile_source(MIXTRAL_AUTO)
    assert first.choices == second.choices
    assert first.graph_ir() == second.graph_ir()


def test_a_costing_is_made_once_per_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The same program, passes, machine, routing scenario and seed: its cycles are remembered;
    anything else, or a routing read from a file (its content may change), is simulated."""
    first = tcpc.compile_source(MIXTRAL_AUTO)

    def no_simulation(*args: object, **kwargs: object) -> None:
        raise AssertionError("simulated again")

    monkeypatch.setattr(tcpc.autotune, "cost_only_cycles", no_simulation)
    monkeypatch.setattr(tcpc.autotune, "cost_only_run", no_simulation)
    assert tcpc.compile_source(MIXTRAL_AUTO).choices == first.choices
    for other in ({"dims": {"T": 8}}, {"routing": "skewed"}, {"seed": 1}):
        with pytest.raises(AssertionError, match="simulated again"):
            tcpc.compile_source(MIXTRAL_AUTO, **other)  # type: ignore[arg-type]
    routing = tmp_path / "r.npy"
    np.save(routing, np.tile(np.arange(2, dtype=np.int32), (16, 1)))
    with pytest.raises(AssertionError, match="simulated again"):
        tcpc.compile_source(MIXTRAL_AUTO, routing=routing)


def test_a_run_reports_the_program_its_choices_compiled_and_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run that follows the strategy and loop order choices reports the cheapest of the
    programs they compiled and simulated to cost them, rather than compiling and simulating it
    again; with the same report."""
    program = tcpc.compile_source(MIXTRAL_AUTO)
    apply = tcpc.autotune.apply_pipeline
    compiles: list[str] = []

    def counted(module: object, passes: list[ModulePass], *args: object, **kwargs: object) -> object:
        if passes[-1:] and passes[-1].name == FULL_PIPELINE[-1]:  # a program compiled (its prefix may be kept)
            compiles.append("compile")
        return apply(module, passes, *args, **kwargs)  # type: ignore[arg-type]

    simulate = cost_only.simulate_cost_only
    simulations: list[str] = []

    def counted_simulation(*args: object, **kwargs: object) -> object:
        simulations.append("simulate")
        return simulate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tcpc.autotune, "_costs", {})  # every candidate costed (and compiled) here
    monkeypatch.setattr(tcpc.autotune, "_compiled", {})
    monkeypatch.setattr(tcpc.autotune, "apply_pipeline", counted)
    monkeypatch.setattr(cost_only, "simulate_cost_only", counted_simulation)
    taken = program.simulate(cost_only=True)
    candidates = {(c.what, alternative) for c in taken.report.choices if c.what != "block" for alternative, _ in c.alternatives}
    assert len(compiles) == len(candidates) - 1  # the second choice's default is the first's winner, costed once
    assert not simulations  # the cheapest candidate's run, reported
    monkeypatch.setattr(tcpc.autotune, "_compiled", {})  # nothing kept: compiled and simulated for the run
    again = program.simulate(cost_only=True)
    assert len(compiles) == len(candidates) and len(simulations) == 1
    assert taken.report.to_json() == again.report.to_json()
    assert taken.report.chrome_trace() == again.report.chrome_trace()


def test_bounded_alternatives_change_no_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block whose commands' roofline is above the fewest cycles simulated so far is not
    planned nor scheduled: the choice is the one that simulating every block makes, each
    bound is at most the block's simulated cycles and above the chosen block's, and every
    other block's cycles are the simulated ones."""
    dims = {"T": 512, "D": 256, "F": 1024, "E": 8, "K": 2, "B": "auto"}  # B = 512 is bounded above 128's cycles
    monkeypatch.setattr(tcpc.autotune, "_costs", {})
    monkeypatch.setattr(tcpc.autotune, "_bounds", {})
    (bounded,) = tcpc.compile_file(EXAMPLES / "mixtral.moe", dims).choices
    run = cost_only.cost_only_run

    def simulated(*args: object, **kwargs: object) -> cost_only.CostOnlyRun:
        return run(*args, **{**kwargs, "bound_above": float("inf")})  # type: ignore[arg-type]

    monkeypatch.setattr(tcpc.autotune, "_costs", {})
    monkeypatch.setattr(tcpc.autotune, "_bounds", {})
    monkeypatch.setattr(tcpc.autotune, "cost_only_run", simulated)
    (every,) = tcpc.compile_file(EXAMPLES / "mixtral.moe", dims).choices
    assert bounded.bounded and not every.bounded  # a bound took the place of a simulation
    assert bounded.chosen == every.chosen and bounded.chosen not in bounded.bounded
    exact, least = dict(every.alternatives), dict(bounded.alternatives)
    assert exact.keys() == least.keys()
    for block, cycles in least.items():
        if block in bounded.bounded:
            assert exact[bounded.chosen] < cycles <= exact[block]
        else:
            assert cycles == exact[block]
    assert "cycles" in bounded.describe() and f"{bounded.bounded[0]}: >= " in bounded.describe()
    assert [a.get("lower_bound", False) for a in bounded.to_json()["alternatives"]] == \
        [b in bounded.bounded for b, _ in bounded.alternatives]


def test_a_bounded_loop_order_changes_no_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop order's `tile` candidate at decode (groups of B = 1 blocks, one expert each)
    stops at its roofline, above the block order's cycles: the choice is the one simulating
    both orders makes, and the bound is at most the tile order's simulated cycles."""
    dims = {"T": 16, "D": 1024, "F": 512, "E": 128, "K": 8, "B": 1}

    def order_choice() -> Choice:
        for memo in ("_costs", "_bounds", "_compiled"):
            monkeypatch.setattr(tcpc.autotune, memo, {})
        program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims)
        _, choices = program.passes(graph=program.function().sym_name.data)
        (order,) = [c for c in choices if c.what == "schedule-experts order"]
        return order

    bounded = order_choice()
    run = cost_only.cost_only_run

    def simulated(*args: object, **kwargs: object) -> cost_only.CostOnlyRun:
        return run(*args, **{**kwargs, "bound_above": float("inf")})  # type: ignore[arg-type]

    monkeypatch.setattr(tcpc.autotune, "cost_only_run", simulated)
    every = order_choice()
    assert bounded.bounded == ("tile",) and not every.bounded
    assert bounded.chosen == every.chosen == "block"
    exact, least = dict(every.alternatives), dict(bounded.alternatives)
    assert least["block"] == exact["block"] < least["tile"] <= exact["tile"]


def test_the_block_searchs_choice_stays_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cheapest block stays compiled, with its run, while the blocks after it are costed
    (the latest program and the cheapest of the others are kept), so the strategy and order
    choices compile only their other alternatives, and when the defaults win the run
    compiles and simulates nothing more, reporting what simulating it again reports."""
    for memo in ("_costs", "_bounds", "_compiled"):
        monkeypatch.setattr(tcpc.autotune, memo, {})
    program = tcpc.compile_source(MIXTRAL_AUTO)
    (choice,) = program.choices
    assert len(choice.alternatives) > tcpc.autotune.COMPILED_KEPT  # later blocks were costed after the best
    apply = tcpc.autotune.apply_pipeline
    compiles: list[str] = []

    def counted(module: object, passes: list[ModulePass], *args: object, **kwargs: object) -> object:
        if passes[-1:] and passes[-1].name == FULL_PIPELINE[-1]:  # a program compiled (its prefix may be kept)
            compiles.append("compile")
        return apply(module, passes, *args, **kwargs)  # type: ignore[arg-type]

    simulate = cost_only.simulate_cost_only
    simulations: list[str] = []

    def counted_simulation(*args: object, **kwargs: object) -> object:
        simulations.append("simulate")
        return simulate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tcpc.autotune, "apply_pipeline", counted)
    monkeypatch.setattr(cost_only, "simulate_cost_only", counted_simulation)
    sim = program.simulate(cost_only=True)
    assert [c.what for c in sim.report.choices[1:]] == ["lower-topk strategy", "schedule-experts order"]
    assert [c.chosen for c in sim.report.choices[1:]] == ["rank", "block"]  # the block search's own program
    assert len(compiles) == 2  # rounds, then the group order: each choice's default was costed before
    assert not simulations  # the block search's run of its best block
    assert sim.report.total_cycles == min(dict(sim.report.choices[-1].alternatives).values())
    monkeypatch.setattr(tcpc.autotune, "_compiled", {})  # nothing kept: compiled and simulated for the run
    again = program.simulate(cost_only=True)
    assert len(simulations) == 1
    assert sim.report.to_json() == again.report.to_json()


def test_a_chosen_options_default_is_the_parsed_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice's alternatives take their options' parsed types (`most_rows=512` parses as an
    int), so the program the block search costed with every pass at its default is not compiled
    and simulated again by the choices that cost it as their default: DeepSeek-V3 at prefill
    chooses lower-topk's strategy, then schedule-shared's most_rows, then the loop order, and
    compiles only rounds, 1024 rows and the tile order; each forks from the IR it shares with
    the one before (compiled_candidate): 1024 rows after the lowering, the tile order after
    the shared expert's rows, 36 passes run of the three programs' 51. The choices and the run
    are those of options taken as given (strings), which costed the defaults again."""
    from passes.schedule.schedule_shared import ScheduleSharedPass
    from tcpc.pipelines import parse_pipeline

    parsed = parse_pipeline("schedule-shared{most_rows=512}")[0]
    assert tcpc.autotune.with_option(ScheduleSharedPass(most_rows="auto"), "most_rows", "512") == parsed
    apply = tcpc.autotune.apply_pipeline
    compiles: list[list[str]] = []

    def counted(module: object, passes: list[ModulePass], *args: object, **kwargs: object) -> object:
        compiles.append([p.name for p in passes])
        return apply(module, passes, *args, **kwargs)  # type: ignore[arg-type]

    def simulated() -> tuple[tcpc.SimulationResult, int, int, int]:
        """The run, the programs the block search compiled, those the choices after it
        compiled (a compile that ends the pipeline) and the passes these ran."""
        for memo in ("_costs", "_bounds", "_compiled", "_prefixes"):
            monkeypatch.setattr(tcpc.autotune, memo, {})
        compiles.clear()
        program = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe", {"T": 4096, "B": "auto"})
        searched = len(compiles)
        sim = program.simulate(cost_only=True)
        chosen = compiles[searched:]
        return sim, searched, sum(c[-1:] == [FULL_PIPELINE[-1]] for c in chosen), sum(map(len, chosen))

    monkeypatch.setattr(tcpc.autotune, "apply_pipeline", counted)
    sim, searched, chosen, passes = simulated()
    assert [(c.what, c.chosen) for c in sim.report.choices[1:]] == [
        ("lower-topk strategy", "rounds"), ("schedule-shared most_rows", "1024"), ("schedule-experts order", "block")]
    assert (chosen, passes) == (3, 17 + 10 + 9)
    assert sim.report.total_cycles == min(dict(sim.report.choices[-1].alternatives).values())
    monkeypatch.setattr(tcpc.autotune, "with_option", lambda p, option, value: replace(p, **{option: value}))
    again, searched_again, chosen_again, _ = simulated()
    assert (searched_again, chosen_again) == (searched, 4)  # rank at 512 rows compiled again
    assert again.report.to_json() == sim.report.to_json()


def test_a_new_choice_lets_the_runs_of_earlier_programs_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block search's run is kept for its own run only: another program's choice lets it
    go (a run is large), and the first program's run then simulates it again."""
    for memo in ("_costs", "_bounds", "_compiled"):
        monkeypatch.setattr(tcpc.autotune, memo, {})
    first = tcpc.compile_source(MIXTRAL_AUTO)
    key = (print_ir(first.module), repr(default_machine()))
    assert tcpc.autotune._compiled[key].run is not None
    tcpc.compile_file(EXAMPLES / "mixtral.moe", {"B": 4}).simulate(cost_only=True)  # another program's choices
    assert tcpc.autotune._compiled[key].run is None  # still compiled, no longer run
    simulate = cost_only.simulate_cost_only
    simulations: list[str] = []

    def counted_simulation(*args: object, **kwargs: object) -> object:
        simulations.append("simulate")
        return simulate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cost_only, "simulate_cost_only", counted_simulation)
    first.simulate(cost_only=True)
    assert len(simulations) == 1


def test_a_large_block_candidates_run_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block candidate's run of more than BLOCK_RUN_KEPT_COMMANDS commands is dropped (a
    prefill run is large, and would be held while the later candidates are simulated)."""
    for memo in ("_costs", "_bounds", "_compiled"):
        monkeypatch.setattr(tcpc.autotune, memo, {})
    monkeypatch.setattr(tcpc.autotune, "BLOCK_RUN_KEPT_COMMANDS", 0)
    program = tcpc.compile_source(MIXTRAL_AUTO)
    assert all(kept.run is None for kept in tcpc.autotune._compiled.values())


def test_block_auto_for_the_runs_routing() -> None:
    """The candidates are costed with the routing scenario the run names."""
    balanced = tcpc.compile_source(MIXTRAL_AUTO).choices[0]
    skewed = tcpc.compile_source(MIXTRAL_AUTO, routing="one-expert").choices[0]
    assert (balanced.routing, skewed.routing) == ("balanced", "one-expert")
    assert balanced.alternatives != skewed.alternatives
    assert_cheapest(skewed)


def test_a_block_beyond_the_capacity_is_chosen_within_it() -> None:
    source = MIXTRAL_AUTO.replace("block=auto", "block=8, capacity=3")
    (choice,) = tcpc.compile_source(source).choices
    assert "at most its capacity 3" in choice.reason
    assert max(b for b, _ in choice.alternatives) == 3
    assert_cheapest(choice)


def test_a_block_that_fits_is_kept() -> None:
    assert tcpc.compile_file(EXAMPLES / "mixtral.moe", {"B": 4}).choices == []
    assert tcpc.compile_file(EXAMPLES / "toy.moe").choices == []


def test_dims_b_auto_is_block_auto() -> None:
    """The examples write `dims ..., B = auto`: the block is chosen as for block=auto, at the
    location of block=B; `--set B=4` fixes it again."""
    program = tcpc.compile_file(EXAMPLES / "mixtral.moe")
    (choice,) = program.choices
    assert choice.reason == "block=auto" and choice.where == f"{EXAMPLES / 'mixtral.moe'}:9:52"
    assert_cheapest(choice)
    assert f"B = {choice.chosen}," in program.graph_ir() and str(program.dims["B"]) == "auto"
    assert tcpc.compile_source(MIXTRAL_AUTO).choices == [replace(choice, where="<string>:9:52")]


def test_qwen3_decode_report_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The brief's command, with no --set B: text and JSON reports say what was chosen."""
    report = tmp_path / "r.json"
    code = main(["run", str(EXAMPLES / "qwen3_moe.moe"), "--set", "T=1", "--cost-only", "--report",
                 "--report-json", str(report)])
    out = capsys.readouterr().out
    assert code == 0
    assert "chose block 1 at " in out and "qwen3_moe.moe:22:52 (block=auto)" in out
    assert re.search(r"schedule: experts loop %(block|group):", out)  # whichever order was chosen
    assert "chose lower-topk strategy " in out and "(strategy=auto); cycles by lower-topk strategy" in out
    assert out.count("chose block 1 at ") == 1, "the header leaves the choices to the report's text"
    data = json.loads(report.read_text())
    choice, strategy, order = data["choices"]
    assert choice["what"] == "block" and choice["chosen"] == 1
    assert strategy["what"] == "lower-topk strategy" and strategy["routing"] == "balanced"
    cycles = {a["value"]: a["cycles"] for a in strategy["alternatives"]}
    assert cycles["rank"] == choice["alternatives"][0]["cycles"]
    assert cycles[strategy["chosen"]] == min(cycles.values())
    orders = {a["value"]: a["cycles"] for a in order["alternatives"]}
    assert order["what"] == "schedule-experts order" and orders["block"] == cycles[strategy["chosen"]]
    assert orders[order["chosen"]] == min(orders.values()) == data["total_cycles"]
    assert any(loop["phase"] == "experts" for loop in data["loops"])


def test_the_json_reports_choice_is_its_cheapest_alternative(tmp_path: Path) -> None:
    path, report = tmp_path / "auto.moe", tmp_path / "r.json"
    path.write_text(MIXTRAL_AUTO)
    assert main(["run", str(path), "--cost-only", "--routing", "skewed", "--report-json", str(report)]) == 0
    data = json.loads(report.read_text())
    choice, strategy, order = data["choices"]
    cycles = {a["value"]: a["cycles"] for a in choice["alternatives"]}
    assert len(cycles) > 1 and choice["routing"] == strategy["routing"] == order["routing"] == "skewed"
    assert cycles[choice["chosen"]] == min(cycles.values())
    by_strategy = {a["value"]: a["cycles"] for a in strategy["alternatives"]}
    assert by_strategy["rank"] == cycles[choice["chosen"]]  # the strategies are costed at the chosen block
    assert by_strategy[strategy["chosen"]] == min(by_strategy.values())
    by_order = {a["value"]: a["cycles"] for a in order["alternatives"]}
    assert by_order["block"] == by_strategy[strategy["chosen"]]  # the orders at the chosen strategy
    assert by_order[order["chosen"]] == min(by_order.values()) == data["total_cycles"]
    assert choice["chosen"] == min(b for b, c in cycles.items() if c == min(cycles.values()))


def test_compile_prints_the_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "auto.moe"
    path.write_text(MIXTRAL_AUTO)
    assert main(["compile", str(path)]) == 0
    out = capsys.readouterr().out
    first, ir = out.split("\n", 1)
    assert first.startswith(f"// chose block ") and f"{path}:9:52 (block=auto)" in first
    chosen = int(first.split()[3])
    assert f"B = {chosen}," in ir


# --- a fixed block the compiler's choice beats (the report's "better block") ---------------------


def test_a_fixed_block_far_from_the_choice_is_named_with_the_better_one() -> None:
    """qwen3_moe at T = 64 with B = 1: the search of block=auto, run for the fixed block, finds a
    block more than 1.5x faster, at the cycles block=auto costs it; the fixed block at the
    cycles of the expert loop order a run with it takes (at T = 16 its blocks of one row in
    groups come within 1.5x of block=auto's, so none is named there)."""
    (auto_choice,) = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", {"B": "auto", "T": 64}).choices
    cycles = dict(auto_choice.alternatives)
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", {"B": 1, "T": 64})
    (better,) = program.better_blocks()
    assert better.where == auto_choice.where and better.dim == "B" and better.routing == "balanced"
    assert (better.given, better.better) == (1, auto_choice.chosen)
    assert better.better_cycles == cycles[auto_choice.chosen]
    run = program.simulate(cost_only=True, pipeline=program.full_pipeline().replace("strategy=auto", "strategy=rank"))
    assert better.given_cycles == run.report.total_cycles  # block=auto costs top-k at rank
    assert better.given_cycles > BETTER_BLOCK_RATIO * better.better_cycles
    assert f"--set B={better.better} or --set B=auto" in better.describe()
    assert tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", {"B": 1}).better_blocks() == []


def test_a_fixed_block_near_the_choice_is_not_named() -> None:
    """Every candidate within BETTER_BLOCK_RATIO of the best: no better block, whatever the choice."""
    (auto_choice,) = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", {"B": "auto"}).choices
    near = [b for b, c in auto_choice.alternatives if c <= BETTER_BLOCK_RATIO * min(dict(auto_choice.alternatives).values())]
    assert len(near) > 1
    assert tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", {"B": near[-1]}).better_blocks() == []
    assert tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", {"B": "auto"}).better_blocks() == []  # nothing fixed


def test_a_literal_block_is_named_as_block_equals(tmp_path: Path) -> None:
    path = tmp_path / "one.moe"
    path.write_text(MIXTRAL_AUTO.replace("block=auto", "block=1"))
    (better,) = tcpc.compile_file(path, {"T": 64}, routing="skewed").better_blocks(routing="skewed")
    assert better.dim is None and better.where == f"{path}:9:52" and better.routing == "skewed"
    assert f"block={better.better} or block=auto" in better.describe() and "(cost-only, skewed routing)" in better.describe()


def test_the_report_names_the_better_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Text and JSON, only when a report is asked for; the Python API's report leaves it unlooked."""
    report = tmp_path / "r.json"
    qwen3 = str(EXAMPLES / "qwen3_moe.moe")
    assert main(["run", qwen3, "--set", "B=1", "--set", "T=64", "--cost-only", "--report", "--report-json", str(report)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "better block" in x]
    assert line.startswith("better block: block 1 at ") and "qwen3_moe.moe:22:52 takes " in line
    (better,) = json.loads(report.read_text())["better_blocks"]
    assert better["given"] == 1 and better["dim"] == "B" and better["routing"] == "balanced"
    assert f"of block {better['better']}, the compiler's choice" in line
    assert f"{better['given_cycles']:,} cycles" in line and f"the {better['better_cycles']:,} of" in line
    assert main(["run", qwen3, "--set", "B=1", "--set", "T=64", "--cost-only", "--report-json", str(report)]) == 0
    assert "  better block: block 1 at " in capsys.readouterr().out  # under the header without --report
    sim = tcpc.compile_file(qwen3, {"B": 1, "T": 64}).simulate(cost_only=True)
    assert sim.report.better_blocks is None and "better_blocks" not in sim.report.to_json()


# --- lower-topk{strategy=auto} -------------------------------------------------------------------


@pytest.mark.parametrize("dims", [{"T": 16, "B": 4}, {"T": 16, "E": 256, "K": 1, "B": 4}])
def test_strategy_auto_picks_the_cheaper_strategy(dims: dict[str, int]) -> None:
    program = tcpc.compile_file(EXAMPLES / "mixtral.moe", dims)
    passes, (choice,) = program.passes("lower-topk{strategy=auto}")
    assert choice.what == "lower-topk strategy" and [s for s, _ in choice.alternatives] == ["rank", "rounds"]
    assert_cheapest(choice)
    assert passes[0].strategy == choice.chosen
    chosen_ir = tcpc.program.print_ir(program.lower(f"lower-topk{{strategy={choice.chosen}}}"))
    assert tcpc.program.print_ir(program.lower("lower-topk{strategy=auto}")) == chosen_ir
    full = ",".join(["lower-topk{strategy=auto}", *FULL_PIPELINE[1:]])
    sim = program.simulate(cost_only=True, pipeline=full)
    assert sim.report.choices == [choice]
    assert sim.report.total_cycles == dict(choice.alternatives)[choice.chosen]
    assert "strategy=" + str(choice.chosen) in sim.pipeline


def test_strategy_auto_in_a_full_run(capsys: pytest.CaptureFixture[str]) -> None:
    spec = "lower-topk{strategy=auto},lower-routing,lower-dispatch,lower-quant,lower-math,load-arguments"
    code = main(["run", str(EXAMPLES / "toy.moe"), "-p", spec, "--check"])
    out = capsys.readouterr().out
    assert code == 0
    assert "chose lower-topk strategy r" in out and "check: outputs equal the reference" in out


def test_tcpc_opt_refuses_strategy_auto(tmp_path: Path) -> None:
    """Only the driver has the cost model; the pass alone says so."""
    import subprocess
    import sys

    ir = tcpc.compile_file(EXAMPLES / "toy.moe").graph_ir()
    done = subprocess.run([sys.executable, "-m", "tcpc.opt", "-p", "lower-topk{strategy=auto}"], input=ir,
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "tcpc-opt: error: lower-topk{strategy=auto} is chosen by the cost model" in done.stderr
    assert "Traceback" not in done.stderr


def test_tcpc_opt_refuses_order_auto() -> None:
    """schedule-experts{order=auto} too is the driver's to resolve."""
    import subprocess
    import sys

    ir = tcpc.compile_file(EXAMPLES / "toy.moe").graph_ir()
    done = subprocess.run([sys.executable, "-m", "tcpc.opt", "-p", "schedule-experts{order=auto}"], input=ir,
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "tcpc-opt: error: schedule-experts{order=auto} is chosen by the cost model" in done.stderr


def test_order_auto_takes_groups_where_blocks_refetch_streamed_weights() -> None:
    """Mixtral-style experts that stream F tiles through 4 MB of SRAM, 8 blocks of 16 rows per
    expert: the groups load each tile once per expert instead of once per block, and the cost
    model takes them; the run simulates the program it chose, at the cycles it was chosen for."""
    program = tcpc.compile_file(EXAMPLES / "mixtral.moe", dict(T=512, D=256, F=2048, E=8, K=2, B=16))
    pipeline = program.full_pipeline().replace("schedule-experts{", "schedule-experts{sram_bytes=4000000 ")
    sim = program.simulate(cost_only=True, pipeline=pipeline)
    (order,) = [c for c in sim.report.choices if c.what == "schedule-experts order"]
    cycles = dict(order.alternatives)
    assert order.chosen == "tile" and cycles["tile"] < cycles["block"]
    assert sim.report.total_cycles == cycles["tile"] and "schedule-experts{sram_bytes=4000000 order=tile}" in sim.pipeline
    assert any(loop.variable == "group" for loop in sim.report.loops)


# --- one resolution of auto: compile, run, sweep and the API -------------------------------------

TOY = EXAMPLES / "toy.moe"
ROUNDS_WINS = {"E": 128, "K": 1}
"""The toy at 128 experts, top-1: one round of reduce-max beats rank's [T, E, E] compare, so
strategy=auto picks the strategy that is not the pass's default."""


def sets(dims: dict[str, int]) -> list[str]:
    return [arg for name, value in dims.items() for arg in ("--set", f"{name}={value}")]


@pytest.fixture(scope="module")
def toy_run() -> tuple[str, str]:
    """`tcpc run` (with values) where rounds wins: the pipeline as run and its choice line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", str(TOY), *sets(ROUNDS_WINS)]) == 0
    header, choice = out.getvalue().splitlines()[:2]
    pipeline = header.split(", after ", 1)[1].split(", simulated on ", 1)[0]
    assert "lower-topk{strategy=rounds}" in pipeline and choice.startswith("  chose lower-topk strategy rounds ")
    return pipeline, choice.strip()


@pytest.mark.parametrize("level", ["lowered", "scheduled"])
def test_compile_prints_the_program_run_simulates(level: str, toy_run: tuple[str, str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`--emit lowered|scheduled` resolves strategy=auto as `tcpc run` does (default machine,
    balanced routing), says so in a `// chose` line, and prints the IR of the passes run ran."""
    pipeline, choice = toy_run
    assert main(["compile", str(TOY), *sets(ROUNDS_WINS), "--emit", level]) == 0
    first, ir = capsys.readouterr().out.split("\n", 1)
    assert first == f"// {choice}" and "(balanced routing)" in first
    if level == "scheduled":  # and the expert loop's order, which the lowered level has no loop for
        order, ir = ir.split("\n", 1)
        assert order.startswith("// chose schedule-experts order ")
    assert "tensor<4x128x128xi32>" not in ir  # not rank's all-pairs compare
    as_run = ",".join(pipeline.split(",")[:len(LEVELS[level])])
    assert main(["compile", str(TOY), *sets(ROUNDS_WINS), "-p", as_run]) == 0
    assert capsys.readouterr().out == ir


def test_compile_emit_planned_states_its_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """The plan's choices are the cost-only run's, for its routing."""
    sim = tcpc.compile_file(TOY, ROUNDS_WINS).simulate(cost_only=True, routing="skewed")
    assert main(["compile", str(TOY), *sets(ROUNDS_WINS), "--emit", "planned", "--cost-only", "--routing", "skewed"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("".join(f"// chose {c.describe()}\n" for c in sim.report.choices) + "// planned: ")
    assert "(skewed routing)" in out.splitlines()[0]


@pytest.mark.parametrize("dims, routing", [(ROUNDS_WINS, "balanced"), ({"T": 1}, "skewed")])
def test_a_sweep_point_costs_what_run_and_the_api_cost(dims: dict[str, int], routing: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep point costs what `tcpc run --cost-only` and `Program.simulate` cost at the same
    point: one resolution of every auto (rounds chosen; at T = 1 the block and rank, for the
    skewed routing)."""
    from tcpc.sweep import load_spec, run_point

    spec = tmp_path / "point.toml"
    spec.write_text(f"program = {json.dumps(str(TOY))}\nrouting = {json.dumps(routing)}\n[dims]\n"
                    + "".join(f"{name} = {value}\n" for name, value in dims.items()))
    (point,) = load_spec(spec).points
    row = run_point(point)
    assert row["status"] == "ok", row["error"]
    assert main(["run", str(TOY), *sets(dims), "--cost-only", "--routing", routing]) == 0
    cycles = re.search(r"^cycles: ([0-9,]+) ", capsys.readouterr().out, re.MULTILINE)
    api = tcpc.compile_file(TOY, dims, routing=routing).simulate(cost_only=True, routing=routing)
    assert cycles is not None and row["total_cycles"] == int(cycles[1].replace(",", "")) == api.report.total_cycles
    strategy = next(c for c in api.report.choices if c.what == "lower-topk strategy")
    assert strategy.chosen == ("rounds" if dims == ROUNDS_WINS else "rank")
    assert row["block_size"] == chosen_block(api.report)


@pytest.mark.parametrize("machine", [None, "rngd-cluster"])
def test_every_level_resolves_auto_as_the_run(machine: str | None) -> None:
    """Program.passes at the lowered level costs each strategy through the machine's own full
    pipeline, so it chooses what the run on that machine chooses."""
    program = tcpc.compile_file(TOY, ROUNDS_WINS)
    _, lowered = program.passes(level="lowered", machine=machine)
    sim = program.simulate(machine=machine, cost_only=True)
    strategies = [c for c in sim.report.choices if c.what == "lower-topk strategy"]
    assert lowered == strategies and lowered[0].chosen == "rounds"
    as_run = ",".join(sim.pipeline.split(",")[1:len(LEVELS["lowered"]) + 1])  # after pin-routing
    assert print_ir(program.lower(level="lowered", machine=machine)) == print_ir(program.lower(as_run, machine=machine))
    with pytest.raises(ValueError, match="level 'planned': expected lowered or scheduled"):
        program.passes(level="planned")


def test_the_sweeps_block_size_column_is_the_choice() -> None:
    decode = tcpc.compile_file(EXAMPLES / "toy.moe", {"T": 1}).simulate(cost_only=True)
    assert chosen_block(decode.report) == 1
    assert chosen_block(tcpc.compile_file(EXAMPLES / "toy.moe").simulate(cost_only=True).report) is None


def test_the_choices_benchmark_on_toy_dims() -> None:
    """benchmarks/choices.py: the choice never costs more than the fixed rule of run.py."""
    from benchmark_scripts import load_script

    choices = load_script("choices")
    model = choices.MODELS[0]
    row = choices.choice_row(model, 8, dims=dict(D=16, F=32, E=4, K=2))
    assert row.chosen_cycles == min(c for _, c in row.alternatives)
    assert row.chosen_cycles <= row.rule_cycles
    assert f"| {row.title} | 8 |" in choices.table([row])


def test_set_auto_leaves_the_programs_block_to_the_cost_model(capsys: pytest.CaptureFixture[str]) -> None:
    """`--set B=auto` on a program that writes `block=B`: chosen as for `block=auto`, at any T."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", {"T": 64, "B": "auto"})
    (choice,) = program.choices
    assert choice.reason == "block=auto" and choice.where.startswith(f"{EXAMPLES / 'qwen3_moe.moe'}:22:")
    assert_cheapest(choice)
    assert program.dims["T"] == 64 and str(program.dims["B"]) == "auto"
    assert main(["compile", str(EXAMPLES / "qwen3_moe.moe"), "--set", "B=auto", "--set", "T=64"]) == 0
    assert capsys.readouterr().out.startswith(f"// chose block {choice.chosen} at ")


def test_a_dim_set_to_auto_is_only_a_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "a.moe"
    path.write_text((EXAMPLES / "qwen3_moe.moe").read_text().replace("dims T = 16", "dims C = 2\ndims T = 16")
                    .replace("experts=E, block=B", "experts=E, block=B, capacity=C * B"))
    assert main(["compile", str(path), "--set", "B=auto"]) == 1
    err = capsys.readouterr().err
    assert f"{path}:" in err and "cannot apply '*' to auto: a dim set to auto (dims NAME = auto, or --set NAME=auto) is only a scatter's block=" in err
    assert "Traceback" not in err



def test_a_block_bounded_before_interleaving_changes_no_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-4-Scout at prefill spreads its shared expert through the routed loop
    (interleave-shared), which only reorders the commands: a block candidate is bounded before
    that pass (cost_only_bound), its pieces built only if the bound does not rule it out. B =
    32 stops there, above the chosen block's cycles and at most its own simulated in full, so
    the choice is the one simulating it would make."""
    from passes.lowering.lower_topk import DEFAULT_STRATEGY
    from passes.schedule.schedule_experts import ORDERS
    from tcpc.pipelines import parse_pipeline, pipeline_spec

    dims = {"T": 1024, "D": 512, "F": 1024, "FS": 1024}
    bounds: list[int | None] = []
    bound = tcpc.autotune.cost_only_bound

    def spied(*args: object, **kwargs: object) -> int | None:
        bounds.append(bound(*args, **kwargs))  # type: ignore[arg-type]
        return bounds[-1]

    for memo in ("_costs", "_bounds", "_compiled"):
        monkeypatch.setattr(tcpc.autotune, memo, {})
    monkeypatch.setattr(tcpc.autotune, "cost_only_bound", spied)
    (choice,) = tcpc.compile_file(EXAMPLES / "llama4.moe", {**dims, "B": "auto"}).choices
    tried = dict(choice.alternatives)
    assert bounds.count(None) < len(bounds) and tried[32] in bounds and 32 in choice.bounded
    program = tcpc.compile_file(EXAMPLES / "llama4.moe", {**dims, "B": 32})
    passes = parse_pipeline(pipeline_spec(topk_strategy=DEFAULT_STRATEGY, expert_order=ORDERS[0]))
    cycles, bounded = tcpc.autotune.cost_cycles(program.module, [program.function().sym_name.data], passes,
                                                default_machine(), "balanced", 0)
    assert not bounded and tried[choice.chosen] < tried[32] <= cycles


def test_an_alternative_forked_from_a_kept_prefix_is_the_program_compiled_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """compiled_candidate compiles an alternative from the IR it shares with those compiled
    before it (kept before each pass a choice forks at): the same IR as compiling it whole,
    whichever alternatives came first, and the prefixes kept are one program's."""
    from tcpc.autotune import compiled_candidate, compiled_cost_only
    from tcpc.pipelines import parse_pipeline, pipeline_spec

    monkeypatch.setattr(tcpc.autotune, "_prefixes", {})
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe", {"T": 256, "B": 16})
    machine = default_machine()
    for strategy, rows, order in [("rounds", "512", "block"), ("rounds", "1024", "block"), ("rounds", "1024", "tile"),
                                  ("rank", "1024", "tile"), ("rounds", "512", "tile")]:
        passes = parse_pipeline(pipeline_spec(topk_strategy=strategy, expert_order=order, shared_rows=rows))
        whole = compiled_cost_only(program.module, passes, machine, verify="none")
        assert print_ir(compiled_candidate(program.module, passes, machine)) == print_ir(whole)
    # before lower-dispatch, schedule-shared and schedule-experts: rounds's three, 1024 rows', rank's three
    assert len(tcpc.autotune._prefixes) == 3 + 1 + 3
    other = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe", {"T": 256, "B": 32})
    compiled_candidate(other.module, passes, machine)
    assert len(tcpc.autotune._prefixes) == 3
