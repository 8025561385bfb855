"""Phases (dialects/annotations.py): every lowering pass marks the engine ops it emits with
`tcpc.phase`, lower-math takes a phase from its neighbours, and the simulator reports cycles
by phase."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdsl.dialects.builtin import StringAttr

import tcpc
from dialects.annotations import PHASE_ATTR, PHASES, phase_of
from tcpc.pipelines import LOWERED_PIPELINE
from tcpc.program import print_ir

EXAMPLES = Path(__file__).parent.parent / "examples"


def lowered_ops(example: str):
    module = tcpc.compile_file(EXAMPLES / f"{example}.moe").lower()
    return [op for op in module.walk() if op.name.startswith(("ve.", "tcp.", "tile."))]


def named(ops, name: str):
    return next(op for op in ops if any(r.name_hint == name for r in op.results))


@pytest.mark.parametrize("example", ["toy", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"])
def test_every_engine_op_of_a_lowered_example_has_a_phase(example: str) -> None:
    ops = lowered_ops(example)
    assert ops and all(phase_of(op) in PHASES for op in ops)
    assert {"router", "routing", "dispatch", "experts", "combine"} <= {phase_of(op) for op in ops}


def test_each_pass_marks_its_own_ops() -> None:
    ops = lowered_ops("deepseek_v3")
    assert phase_of(named(ops, "rank")) == "router"  # lower-topk
    assert phase_of(named(ops, "counts")) == "routing"  # lower-routing
    assert phase_of(named(ops, "block_tokens")) == "dispatch"  # lower-dispatch: moe.dispatch's index
    assert phase_of(named(ops, "xb_tile")) == "dispatch"  # and its gather, a block's rows in the loop
    assert phase_of(named(ops, "w_gathered")) == "experts"  # lower-dispatch: moe.grouped_matmul
    assert phase_of(named(ops, "y_acc")) == "experts"
    assert phase_of(named(ops, "row_valid")) == "experts"  # the row masks serve the experts
    assert phase_of(named(ops, "y_restored")) == "combine"  # lower-dispatch: moe.combine
    assert phase_of(named(ops, "shared")) == "shared"  # schedule-shared: the shared expert's loop
    lowered = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe").lower(",".join(LOWERED_PIPELINE))
    assert phase_of(named(list(lowered.walk()), "shared")) == "other"  # lower-math: before the schedule level


def test_lower_math_takes_the_phase_of_its_neighbours() -> None:
    ops = lowered_ops("gpt_oss")
    # The router's matmul feeds a top-k; the clamped SwiGLU sits between grouped matmuls.
    contracts = [op for op in ops if op.name == "tcp.contract"]
    assert phase_of(contracts[0]) == "router"
    assert all(phase_of(op) == "experts" for op in contracts[1:])
    assert phase_of(named(ops, "glu")) == "experts"
    assert phase_of(named(ops, "h")) == "experts"
    # The weights (softmax over the K chosen logits) come from the top-k.
    weights = [op for op in tcpc.compile_file(EXAMPLES / "gpt_oss.moe").lower().walk()
               if op.name == "ve.exp"]
    assert weights and all(phase_of(op) == "router" for op in weights)


def test_a_tmath_op_keeps_a_phase_it_already_has() -> None:
    program = tcpc.compile_file(EXAMPLES / "llama4.moe")
    for op in program.module.walk():
        if any(r.name_hint == "shared" for r in op.results):
            op.attributes[PHASE_ATTR] = StringAttr("shared")
    module = program.lower()
    assert "shared" in {phase_of(op) for op in module.walk()}


def test_the_phase_prints_at_the_end_of_the_line_and_parses_back() -> None:
    module = tcpc.compile_file(EXAMPLES / "toy.moe").lower()
    text = print_ir(module)
    line = next(line for line in text.splitlines() if "%y_acc = tcp.contract" in line)
    # one block, cluster 0's copy; the contraction's mapping first, the phase last
    assert '-> tensor<1x2x16xf32> {mapping = #tcp.mapping<' in line
    assert line.endswith('>, tcpc.phase = "experts", tcpc.cluster = 0 : i64}')
    const = next(line for line in text.splitlines() if "ve.const" in line)
    assert const.endswith(': tensor<4x4xi32> {tcpc.phase = "router"}')
    again = tcpc.load_ir(text)
    assert print_ir(again.module) == text


def test_the_report_gives_cycles_by_phase() -> None:
    report = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe").simulate(seed=0).report
    phases = {p.name: p for p in report.phases}
    assert set(phases) <= set(PHASES) and {"router", "experts", "combine", "other"} <= set(phases)
    # The critical path runs back to back: its cycles by phase sum to the total.
    assert sum(p.critical_cycles for p in phases.values()) == report.total_cycles
    # Busy cycles by phase sum to the engines' busy cycles.
    assert sum(p.busy_cycles for p in phases.values()) == sum(e.busy_cycles for e in report.engines)
    assert all(p.critical_cycles <= p.busy_cycles for p in phases.values())
    data = report.to_json()
    assert [p["name"] for p in data["phases"]] == list(phases)
    assert all("phase" in o for o in data["ops"])
    text = report.to_text()
    assert "critical path" in text and "\nexperts " in text


def test_the_critical_path_enters_a_command_of_several_parts_by_its_part() -> None:
    """gpt-oss-120b at T = 1: its weight loads run a part on each DMA engine, each part starting
    when its engine frees. The critical path runs through single parts (a load's part that
    waited for a bias load on its engine), and the phases' cycles still add up to the total."""
    dims = dict(D=2880, F=2880, E=128, K=4, T=1)
    report = tcpc.compile_file(EXAMPLES / "gpt_oss.moe", dims=dims).simulate(cost_only=True, routing="balanced").report
    on_path = [report.op(k) for k in report.critical_path]
    assert any(len(o.units) > 1 for o in on_path)
    assert sum(report.critical_cycles.values()) == report.total_cycles
    assert sum(p.critical_cycles for p in report.phases) == report.total_cycles
