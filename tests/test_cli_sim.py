"""`tcpc run` as a simulator (docs/simulator.md): reports, JSON, Chrome traces, machine
files, cost-only mode, the --check tolerance and the progress line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from lowered_moe import moe_ir
from ml_dtypes import bfloat16

import tcpc
from runtime_sim.semantics.tolerance import ULPS, compare_output, ulp
from tcpc.pipelines import FULL_PIPELINE
from tcpc.progress import Progress
from support import failure, tcpc_main

EXAMPLE = Path(__file__).parent.parent / "examples" / "mixtral.moe"
BIN = Path(sys.executable).parent


@pytest.fixture
def lowered(tmp_path: Path) -> Path:
    path = tmp_path / "moe.mlir"
    path.write_text(moe_ir(t=16, d=64, f=128, e=8, k=2, b=4))
    return path




def test_partly_lowered_ir_names_the_ops_without_a_cost(capsys: pytest.CaptureFixture[str]) -> None:
    # Asking for cycles of IR that still holds graph-level ops is an error naming them ...
    err = failure(capsys, "run", EXAMPLE, "-p", "lower-topk", "--report")
    assert err.startswith("tcpc: error: cannot simulate ops that have no cost model; lower them first: ")
    for name in ("moe.scatter", "moe.grouped_matmul (x3)", "moe.combine", "tmath.softmax", "tmath.matmul"):
        assert name in err
    assert "ve." not in err  # the top-k lowering is costed
    assert "(--reference runs it without simulating)" in err
    # ... while plain `run -p` executes that IR (translation validation) and says why no cycles.
    code, out, _ = tcpc_main(capsys, "run", EXAMPLE, "-p", "lower-topk", "--check", "--set", "T=4")
    assert code == 0 and "check: outputs equal the reference" in out
    assert "after lower-topk, not simulated: moe.combine, moe.grouped_matmul, moe.scatter" in out
    assert "ve." not in out.splitlines()[0]
    code, out, _ = tcpc_main(capsys, "run", EXAMPLE, "-p", "lower-topk", "--reference", "--check", "--set", "T=4")
    assert code == 0 and "after lower-topk, not simulated" in out and "check: outputs equal the reference" in out


def test_simulating_lowered_ir_prints_outputs_and_a_cycle_line(lowered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = tcpc_main(capsys, "run", lowered, "--seed", "2")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"graph moe from {lowered}, ") and lines[0].endswith("simulated on rngd, seed 2")
    assert lines[1].startswith("  out0 f32[16, 128]: [16, 128] float32  first [")
    assert lines[2].startswith("cycles: ") and " us at 1 GHz on rngd; roofline " in lines[2] and "x the roofline" in lines[2]
    result = tcpc.compile_file(lowered).simulate(seed=2)
    assert f"cycles: {result.report.total_cycles:,} = " in lines[2]


def test_report_json_and_trace(lowered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rj, tr = tmp_path / "r.json", tmp_path / "t.json"
    code, out, _ = tcpc_main(capsys, "run", lowered, "--report", "--report-json", rj, "--trace", tr)
    assert code == 0
    assert "engine   units" in out and "%y = tcp.contract" in out and "critical path" in out
    assert f"wrote {rj}" in out and f"wrote {tr}" in out
    report = json.loads(rj.read_text())
    for key in ("total_cycles", "clock_hz", "microseconds", "roofline_cycles", "roofline", "ops", "engines",
                "critical_path", "peak_sram_bytes", "machine", "machine_assumptions"):
        assert key in report
    assert report["total_cycles"] >= report["roofline_cycles"] > 0
    assert report["clock_hz"] == 1e9
    assert {e["name"] for e in report["engines"]} >= {"tensor", "dma"}
    assert {"label", "engine", "start", "end", "cycles", "bytes", "flops", "bound"} <= set(report["ops"][0])
    assert max(o["end"] for o in report["ops"]) == report["total_cycles"]
    trace = json.loads(tr.read_text())
    events = trace["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(set(threads.values())) == len(threads)  # one tid per engine unit
    assert "tensor unit 0" in threads.values() and "dma 0" in threads.values()
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["tid"] in threads and e["dur"] >= 0 for e in spans)
    assert {threads[e["tid"]] for e in spans if e["cat"] == "tensor"} <= {"tensor unit 0", "tensor unit 1"}


def test_determinism(lowered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("a", "b"):
        assert tcpc_main(capsys, "run", lowered, "--report-json", tmp_path / f"{name}.json", "--cost-only",
                         "--routing", "skewed")[0] == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


def test_machine_files(lowered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = tmp_path / "slow.toml"
    slow.write_text('extends = "rngd"\nname = "slow-dma"\n'
                    '[dma]\nstartup_cycles = { value = 5000, assumption = "a test machine" }\n')
    rj = tmp_path / "r.json"
    code, out, _ = tcpc_main(capsys, "run", lowered, "--machine", slow, "--report-json", rj)
    assert code == 0 and "on slow-dma" in out
    slow_cycles = json.loads(rj.read_text())["total_cycles"]
    tcpc_main(capsys, "run", lowered, "--report-json", rj)
    assert slow_cycles > json.loads(rj.read_text())["total_cycles"]
    broken = tmp_path / "broken.toml"
    broken.write_text("[dma\nengines = 8\n")
    assert failure(capsys, "run", lowered, "--machine", broken).startswith(f"tcpc: error: {broken}: not valid TOML")
    missing_key = tmp_path / "missing.toml"
    missing_key.write_text('extends = "rngd"\n[dma]\nengines = { value = 0, source = "x" }\n')
    assert "[dma] engines: must be positive" in failure(capsys, "run", lowered, "--machine", missing_key)
    assert "no such machine file" in failure(capsys, "run", lowered, "--machine", tmp_path / "none.toml")


@pytest.mark.parametrize("routing", ["balanced", "skewed", "one-expert", "file"])
def test_cost_only_never_prints_values(routing: str, lowered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if routing == "file":
        routing = str(tmp_path / "r.npz")
        np.savez(routing, experts=np.tile(np.array([[5, 2]], np.int32), (16, 1)))
    code, out, err = tcpc_main(capsys, "run", lowered, "--cost-only", "--routing", routing)
    assert code == 0 and err == ""
    assert "cost-only on rngd (no values computed)" in out
    assert f"routing %routing: {routing}: 16 tokens x top-2 of 8 experts" in out
    assert "out0 f32[16, 128]: not computed (cost-only)" in out
    assert "first [" not in out and "mean" not in out  # no value anywhere
    assert "cycles: " in out


def test_cost_only_scenarios_change_the_weight_traffic(lowered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traffic = {}
    for routing in ("balanced", "one-expert"):
        rj = tmp_path / f"{routing}.json"
        assert tcpc_main(capsys, "run", lowered, "--cost-only", "--routing", routing, "--report-json", rj)[0] == 0
        ops = json.loads(rj.read_text())["ops"]
        traffic[routing] = next(o["hbm_bytes"] for o in ops if o["label"].startswith("%wg"))
    assert traffic["one-expert"] < traffic["balanced"]


def test_flag_combinations(lowered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npz = tmp_path / "in.npz"
    np.savez(npz, gates=np.ones((16, 2), np.float32))
    usage = 2  # options that do not go together: a usage error, like argparse's own
    cases = [
        (["--reference", "--report"], "--report needs a simulation", usage),
        (["--reference", "--trace", "t.json"], "--trace needs a simulation", usage),
        (["--reference", "--cost-only"], "--cost-only needs a simulation", usage),
        (["--cost-only", "--inputs", npz], "--inputs does not apply to --cost-only", usage),
        (["--cost-only", "--out", "o.npz"], "--out does not apply to --cost-only", usage),
        (["--cost-only", "--check"], "--check does not apply to --cost-only", usage),
        (["--routing", "skewed"], "--routing sets the routing of a cost-only run; add --cost-only", usage),
        (["--cost-only", "--routing", "zipf"], "unknown routing 'zipf'", 1),
        (["--set", "T=4"], "--set applies to .moe programs", usage),
    ]
    for flags, message, status in cases:
        assert message in failure(capsys, "run", lowered, *flags, status=status)


def test_check_and_outputs_of_a_simulation(lowered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "o.npz"
    code, out, _ = tcpc_main(capsys, "run", lowered, "--check", "--out", out_path)
    assert code == 0 and "check: out0 identical" in out and "check: outputs equal the reference" in out
    with np.load(out_path) as data:
        assert data["out0"].shape == (16, 128)


def test_ir_files_that_do_not_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.mlir"
    bad.write_text("func.func @f( {")
    assert "error: cannot parse the IR" in failure(capsys, "run", bad)
    empty = tmp_path / "empty.mlir"
    empty.write_text("builtin.module {}")
    assert "holds no func.func" in failure(capsys, "run", empty)


def test_default_run_of_a_moe_program(capsys: pytest.CaptureFixture[str]) -> None:
    """A .moe program runs through the full pipeline by default, and simulates."""
    code, out, err = tcpc_main(capsys, "run", EXAMPLE, "--set", "T=4", "--cost-only")
    assert code == 0 and "not computed (cost-only)" in out, err
    chosen = (",".join(FULL_PIPELINE).replace("lower-topk", "lower-topk{strategy=rank}")  # rank wins at E = 8
              .replace("schedule-experts", "schedule-experts{order=block}"))  # a block at a time, at T = 4
    assert f"after pin-routing,{chosen}, cost-only" in out


def test_end_to_end_without_a_terminal(lowered: Path) -> None:
    """The installed command: exit 0, no progress line when stderr is not a terminal."""
    p = subprocess.run([BIN / "tcpc", "run", lowered, "--cost-only", "--routing", "one-expert"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == "" and "cycles: " in p.stdout
    p = subprocess.run([BIN / "tcpc", "run", EXAMPLE, "-p", "lower-topk", "--report"], capture_output=True, text=True)
    assert p.returncode == 1 and "no cost model" in p.stderr and "Traceback" not in p.stderr


# --- the progress line ------------------------------------------------------------------------


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_only_on_a_terminal_and_erases_itself() -> None:
    term = FakeTerminal()
    progress = Progress(4, term, delay=0.0, interval=0.0)
    for _ in range(3):
        progress.did_interpret_op(None, ())  # type: ignore[arg-type]
    assert "simulating: 3 / 4 ops (75%)" in term.getvalue()
    progress.did_interpret_op(None, ())  # type: ignore[arg-type]
    assert "planning memory and scheduling" in term.getvalue()
    progress.close()
    assert term.getvalue().endswith("\r\x1b[K")
    pipe = io.StringIO()
    quiet = Progress(4, pipe, delay=0.0, interval=0.0)
    quiet.did_interpret_op(None, ())  # type: ignore[arg-type]
    quiet.close()
    assert pipe.getvalue() == ""
    slow_start = FakeTerminal()
    short = Progress(4, slow_start, delay=60.0)
    short.did_interpret_op(None, ())  # type: ignore[arg-type]
    assert slow_start.getvalue() == ""  # a short run prints nothing


def test_progress_counts_the_ops_a_simulation_runs(lowered: Path) -> None:
    program = tcpc.compile_file(lowered)
    progress = Progress(stream=io.StringIO())
    program.simulate(listeners=[progress])
    assert progress.total == progress.done == sum(1 for _ in program.function().walk()) - 1


# --- the --check tolerance ------------------------------------------------------------------


def test_ulp_of_the_output_types() -> None:
    assert ulp(np.float64(1.0), bfloat16) == 2.0**-7
    assert ulp(np.float64(1.5), np.dtype(np.float32)) == 2.0**-23
    assert ulp(np.float64(-3.0), bfloat16) == 2.0**-6
    assert ulp(np.float64(0.0), np.dtype(np.float32)) == 2.0**-149  # subnormal spacing


def test_tolerance() -> None:
    want = np.array([1.0, -2.0, 0.5, 100.0], np.float32).astype(bfloat16)
    assert compare_output(0, want, want).identical
    one_ulp = np.array([1.0 + 2**-7, -2.0, 0.5, 100.0], np.float32).astype(bfloat16)
    c = compare_output(0, one_ulp, want)
    assert c.ok and not c.identical and c.max_ulps == 1.0 and "within tolerance" in c.message
    far = np.array([1.0 + 3 * 2**-7, -2.0, 0.5, 100.0], np.float32).astype(bfloat16)
    c = compare_output(0, far, want)
    assert not c.ok and "3 ulp at [0]" in c.message and f"allowed {ULPS}" in c.message
    # near zero: an element that cancels to almost nothing is held to 2^-16 of the scale
    w = np.array([1e-6, 100.0], np.float32)
    assert compare_output(0, np.array([1e-4, 100.0], np.float32), w).ok  # 1e-4 < 100 * 2^-16
    assert not compare_output(0, np.array([1e-2, 100.0], np.float32), w).ok
    assert not compare_output(0, np.array([1.0, 100.01], np.float32), np.array([1.0, 100.0], np.float32)).ok
    # integers identical; NaN and infinities in the same places
    assert not compare_output(0, np.array([1, 2], np.int32), np.array([1, 3], np.int32)).ok
    assert compare_output(0, np.array([np.nan, np.inf], np.float32), np.array([np.nan, np.inf], np.float32)).identical
    assert not compare_output(0, np.array([np.nan, 1.0], np.float32), np.array([1.0, 1.0], np.float32)).ok
    assert not compare_output(0, np.array([-np.inf], np.float32), np.array([np.inf], np.float32)).ok


def test_report_ops_bounds_the_op_table_and_the_critical_path(capsys: pytest.CaptureFixture[str]) -> None:
    """A looped program lists an op per trip: --report shows the first N and the path's ends."""
    code, out, _ = tcpc_main(capsys, "run", EXAMPLE, "--set", "T=256", "--cost-only", "--report", "--report-ops", "4",
                             "--report-by", "op")  # the op table alone: the line table's rows start with numbers too
    assert code == 0
    table = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(table) == 4
    more = next(line for line in out.splitlines() if "more (every op: --report-ops all" in line)
    path = next(line for line in out.splitlines() if line.startswith("critical path (*, "))
    ops = int(path.split(", ")[1].split()[0].replace(",", ""))
    assert path.count("#") == 8 and f"... {ops - 8:,} more ..." in path  # 4 at each end
    code, full, _ = tcpc_main(capsys, "run", EXAMPLE, "--set", "T=256", "--cost-only", "--report", "--report-ops", "all",
                              "--report-by", "op")
    listed = int(more.split("...")[1].split()[0].replace(",", "")) + 4
    assert code == 0 and len([line for line in full.splitlines() if line[:4].strip().isdigit()]) == listed
    assert "--report-ops -1: expected a count (0 for the summary only) or all" in failure(capsys, "run", EXAMPLE, "--report-ops", "-1", status=2)
