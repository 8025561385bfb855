"""Cycles by source line (`SimReport.lines`, `--report-by line`): every command's cycles, bytes
and FLOPs go to the `.moe` lines of its op, an op of several lines shares them equally, and so
the lines add up to the run's totals, the critical path's to its total cycles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tcpc
from runtime_sim.perf.report import EngineRecord, LineRecord, OpRecord, SimReport, roofline
from target.machine import default_machine
from tcpc.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_lines_of_a_run_add_up_to_its_totals() -> None:
    """Mixtral: the lines' critical cycles are the total, their busy cycles the engines', their
    bytes and FLOPs the commands'; each line has its text, in line order."""
    program = tcpc.compile_file(EXAMPLES / "mixtral.moe", {"B": 8})
    report = program.simulate(cost_only=True).report
    lines = report.lines
    assert sum(r.critical_cycles for r in lines) == report.total_cycles
    assert sum(r.busy_cycles for r in lines) == sum(e.busy_cycles for e in report.engines)
    costed = [o for o in report.ops if not (o.cycles == 0 and o.engine == "none")]
    assert sum(r.bytes for r in lines) == sum(o.bytes for o in costed)
    assert sum(r.flops for r in lines) == sum(o.flops for o in costed)
    source = (EXAMPLES / "mixtral.moe").read_text().splitlines()
    assert [r.line for r in lines] == [4, 6, 7, 8, 9, 10, 11]  # line 5 holds parameters the loads do not name
    assert all(r.file == str(EXAMPLES / "mixtral.moe") and r.text == source[r.line - 1] for r in lines)
    by_line = {r.line: r for r in lines}
    assert by_line[10].flops > by_line[11].flops > 0  # two grouped matmuls on line 10, one on 11
    assert by_line[7].flops == 0 and by_line[7].commands > 0  # top-k: vector-engine work, no FLOPs


def record(key: int, cycles: int, locations: tuple[str, ...], start: int = 0, engine: str = "tensor") -> OpRecord:
    return OpRecord(key, f"op{key}", "ve.add", engine, 0, start, start + cycles, cycles, 10 * cycles, 0, 3 * cycles,
                    "overhead", locations=locations)


def small_report(sources: dict[str, list[str]]) -> SimReport:
    """Three commands back to back (all on the critical path): one of line 2, one shared by
    lines 2 and 4 (a fused chain), one without a location."""
    machine = default_machine()
    ops = [record(0, 10, ("f.moe:2:5",)), record(1, 5, ("f.moe:4:1", "f.moe:2:9"), 10), record(2, 4, (), 15)]
    engines = [EngineRecord("tensor", 2, 19, 0.0), EngineRecord("dma", 8, 0, 0.0)]
    return SimReport(machine, 19, roofline(machine, 0, 0), ops, engines, [0, 1, 2], 0, machine.sram_bytes, "spill",
                     sources=sources)


def test_an_op_of_several_lines_shares_its_figures_equally() -> None:
    """Command 1's 5 cycles, 50 bytes and 15 FLOPs: 3, 25 and 8 to line 4 (its first place),
    2, 25 and 7 to line 2; the unlocated command is a row of its own, last; the sums stay exact."""
    report = small_report({"f.moe": ["graph g() {", "  a = b + c", "  # note", "  d = a * a", "}"]})
    assert report.lines == [
        LineRecord("f.moe", 2, "  a = b + c", 2, 12, 12, 125, 0, 37),
        LineRecord("f.moe", 4, "  d = a * a", 1, 3, 3, 25, 0, 8),
        LineRecord("", 0, None, 1, 4, 4, 40, 0, 12),
    ]


def test_the_line_table_reads_as_annotated_source() -> None:
    """Every line from the first to the last with a cost, a line without one with its text
    alone; the commands without a location under a header of their own."""
    text = small_report({"f.moe": ["graph g() {", "  a = b + c", "  # note", "  d = a * a", "}"]}).to_text(tables=("line",))
    table = text[text.index(" line commands"):].splitlines()
    assert table == [
        " line commands         busy  critical path   share        bytes          FLOPs  f.moe",
        "    2        2           12             12   63.2%          125             37    a = b + c",
        "    3                                                                             # note",
        "    4        1            3              3   15.8%           25              8    d = a * a",
        "",
        " line commands         busy  critical path   share        bytes          FLOPs  (no source location)",
        "    -        1            4              4   21.1%           40             12",
    ]
    assert "phase " not in text and " op " not in text


def test_ir_without_locations_says_so() -> None:
    machine = default_machine()
    report = SimReport(machine, 4, roofline(machine, 0, 0), [record(0, 4, ())], [EngineRecord("tensor", 2, 4, 0.0)],
                       [0], 0, machine.sram_bytes, "spill")
    assert "cycles by source line: no op has a source location (IR without loc(...))" in report.to_text(tables=("line",))


@pytest.mark.parametrize("tables", [["line"], ["phase,op"], ["op", "line"]])
def test_report_by_prints_the_tables_asked_for(tables: list[str], capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    argv = ["run", str(EXAMPLES / "toy.moe"), "--report", "--report-ops", "3", "--report-json", str(tmp_path / "r.json")]
    assert main([*argv, *(a for t in tables for a in ("--report-by", t))]) == 0
    out = capsys.readouterr().out
    asked = {t for given in tables for t in given.split(",")}
    assert ("phase     commands" in out) == ("phase" in asked)
    assert (" line commands" in out) == ("line" in asked)
    assert ("critical path (*" in out) == ("op" in asked)
    data = json.loads((tmp_path / "r.json").read_text())  # JSON has every table whatever is printed
    assert data["lines"] and data["phases"] and data["ops"][0]["locations"]
    assert sum(r["critical_cycles"] for r in data["lines"]) == data["total_cycles"]


def test_ir_written_with_locations_keeps_its_lines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`tcpc compile --debug-locations -o` then `tcpc run` of that IR: the same table as the
    program's, the lines' text read from the `.moe` file the locations name."""
    toy, ir = str(EXAMPLES / "toy.moe"), tmp_path / "toy.mlir"
    assert main(["compile", toy, "--emit", "scheduled", "--debug-locations", "-o", str(ir)]) == 0
    assert main(["run", toy, "--report", "--report-by", "line"]) == 0
    from_program = capsys.readouterr().out
    assert main(["run", str(ir), "--report", "--report-by", "line"]) == 0
    from_ir = capsys.readouterr().out
    table = from_program[from_program.index(" line commands"):]
    assert "    probs = softmax(f32(x) @ router)" in table and table == from_ir[from_ir.index(" line commands"):]
