"""`tcpc sweep`: spec expansion, a small sweep on a Dask LocalCluster (threads, in seconds), a
failing point, resumption, the Parquet schema, an existing scheduler and the charts."""

from __future__ import annotations

from pathlib import Path

import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from tcpc.cli import main
from tcpc.pipelines import FULL_PIPELINE, pipeline_for
from tcpc.program import as_machine, compile_file
from tcpc.sweep import SweepError, load_spec, point_key, run_sweep

EXAMPLES = Path(__file__).parent.parent / "examples"
TOY = (EXAMPLES / "toy.moe").resolve()

SPEC = f"""
description = "toy"
programs = ["{TOY}"]
routing = ["balanced", "one-expert"]

[dims]
T = [4, 8]

[machine_overrides]
"hbm.bytes_per_second" = [1_500_000_000_000, 1_000_000_000]
dma_engines = 8
"""


def write_spec(tmp_path: Path, text: str = SPEC) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def test_spec_is_a_grid_of_its_lists(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    assert len(spec.points) == 2 * 2 * 2
    p = spec.points[0]
    assert p["program"] == str(TOY) and p["dims"] == {"T": 4} and p["routing"] == "balanced"
    # a Machine field name and a "section.key" both name the machine file key
    assert p["machine_overrides"] == {"hbm.bytes_per_second": 1_500_000_000_000, "dma.engines": 8}
    assert len({point_key(q) for q in spec.points}) == 8


def test_cases_cross_the_grid(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, f"""
routing = ["balanced", "skewed"]
[[cases]]
program = "{TOY}"
dims = {{ T = 4 }}
[[cases]]
program = "{EXAMPLES.resolve() / 'mixtral.moe'}"
dims = {{ T = 8, E = 4 }}
"""))
    assert [(Path(p["program"]).name, p["dims"], p["routing"]) for p in spec.points] == [
        ("toy.moe", {"T": 4}, "balanced"), ("toy.moe", {"T": 4}, "skewed"),
        ("mixtral.moe", {"T": 8, "E": 4}, "balanced"), ("mixtral.moe", {"T": 8, "E": 4}, "skewed")]


@pytest.mark.parametrize("text, message", [
    ('programs = ["x.moe"]\nbogus = 1', "unknown key 'bogus'"),
    ('programs = ["x.moe"]\n[machine_overrides]\n"sram.size" = 1', "'sram.size' is not a machine file key"),
    ('programs = ["x.moe"]\n[pass_options]\n"lower-foo.x" = 1', "'lower-foo.x' is not PASS.OPTION"),
    ('routing = "balanced"', "no program"),
    ('programs = []', "programs: an empty list"),
    ('programs = ["x.moe"\n', "not valid TOML"),
])
def test_spec_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SweepError, match=message):
        load_spec(write_spec(tmp_path, text))


def test_pass_options_build_the_pipeline() -> None:
    """The sweep's pipeline is tcpc's own for the point's machine, its pass options on top."""
    rngd, one_cluster = as_machine("rngd"), as_machine("rngd-cluster")
    assert pipeline_for(rngd, topk_strategy=None) == ",".join(FULL_PIPELINE)
    assert pipeline_for(one_cluster, topk_strategy=None) == ",".join(
        f"{p}{{clusters=1}}" if p in ("split-clusters", "schedule-tokens") else p for p in FULL_PIPELINE)
    assert pipeline_for(one_cluster, topk_strategy=None, options={"lower-topk.strategy": "rounds"}).startswith(
        "lower-topk{strategy=rounds},")
    assert "split-clusters{clusters=4}" in pipeline_for(rngd, options={"split-clusters.clusters": 4})
    assert "split-clusters{clusters=1 own_dma_intensity=9}" in pipeline_for(
        one_cluster, options={"split-clusters.own_dma_intensity": 9})


def test_sweep_runs_records_failures_and_resumes(tmp_path: Path) -> None:
    text = SPEC.replace("dma_engines = 8", "dma_engines = [8, 0]")  # 0 engines: an invalid machine
    spec = load_spec(write_spec(tmp_path, text))
    out = tmp_path / "out"
    first = run_sweep(spec, out, workers=1, processes=False)
    assert first.ran == 16 and first.skipped == 0
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert len(rows) == 16
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in rows if r["status"] == "error"]
    assert len(ok) == 8 and len(bad) == 8 == len(first.failed)
    assert all(r["machine.dma.engines"] == 0 for r in bad)
    assert all("[dma] engines: must be positive, got 0" in r["error"] and r["total_cycles"] is None for r in bad)
    # the override took effect: a slow HBM makes the layer slower
    by = {(r["routing"], r["dim.T"], r["machine.hbm.bytes_per_second"]): r for r in ok}
    fast, slow = by[("balanced", 8, 1_500_000_000_000)], by[("balanced", 8, 1_000_000_000)]
    assert slow["hbm_bytes_per_s"] == 1e9 and fast["hbm_bytes"] == slow["hbm_bytes"] > 0
    assert slow["total_cycles"] > fast["total_cycles"]
    # one point is exactly `tcpc run --cost-only` (the same code path)
    sim = compile_file(TOY, {"T": 8}).simulate(cost_only=True, routing="balanced")
    assert fast["total_cycles"] == sim.report.total_cycles
    assert sum(v for k, v in fast.items() if k.startswith("phase.") and v) == fast["total_cycles"]
    assert fast["roofline_ratio"] == pytest.approx(fast["total_cycles"] / fast["roofline_cycles"])
    # the CSV holds the same rows
    assert pyarrow.csv.read_csv(out / "results.csv").num_rows == 16
    # a rerun skips what is done and retries what failed
    again = run_sweep(spec, out, workers=1, processes=False)
    assert again.ran == 8 and again.skipped == 8
    rerun = {r["key"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert all(rerun[r["key"]]["total_cycles"] == r["total_cycles"] for r in ok)
    # fixed spec: the failing points are gone from it, nothing is left to run
    fixed = load_spec(write_spec(tmp_path, SPEC))
    assert run_sweep(fixed, out, workers=1, processes=False).ran == 0


def test_parquet_schema(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, f'programs = ["{TOY}"]\n[dims]\nT = [4, 8]\n'
                                          '[pass_options]\n"lower-topk.strategy" = ["rank", "rounds"]\n'))
    outcome = run_sweep(spec, tmp_path / "out", workers=1, processes=False)
    assert outcome.ran == 4 and not outcome.failed
    assert {r["pass.lower-topk.strategy"] for r in outcome.rows} == {"rank", "rounds"}
    schema = pq.read_schema(tmp_path / "out" / "results.parquet")
    types = {f.name: str(f.type) for f in schema}
    for name, t in [("key", "string"), ("status", "string"), ("error", "string"), ("program", "string"),
                    ("total_cycles", "int64"), ("microseconds", "double"), ("roofline_ratio", "double"),
                    ("peak_sram_bytes", "int64"), ("hbm_bytes", "int64"), ("block_size", "int64"),
                    ("arithmetic_intensity", "double"), ("achieved_flops_per_s", "double"),
                    ("dim.T", "int64"), ("pass.lower-topk.strategy", "string"), ("phase.experts", "int64")]:
        assert types.get(name) == t, name


def test_cli_on_an_existing_scheduler_with_charts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dask.distributed import LocalCluster

    spec = write_spec(tmp_path, f'programs = ["{TOY}"]\nrouting = ["balanced", "skewed"]\n[dims]\nT = [4, 8]\n')
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        code = main(["sweep", str(spec), "--scheduler", cluster.scheduler_address, "-o", str(tmp_path / "o"), "--plot"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 point(s) on the Dask scheduler at" in out and "ran 4, skipped 0 already done, 0 failed" in out
    for name in ("roofline.png", "cycles_vs_routing.png", "cycles_vs_dim_T.png"):
        data = (tmp_path / "o" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", str(tmp_path / "none.toml")]) == 1
    assert "none.toml: no such sweep spec" in capsys.readouterr().err
    spec = write_spec(tmp_path, f'programs = ["{TOY}"]\n')
    assert main(["sweep", str(spec), "--workers", "0"]) == 2  # a usage error
    assert "--workers N (N >= 1)" in capsys.readouterr().err
    assert main(["sweep", str(spec), "-o", str(tmp_path / "o"), "--scheduler", "nonsense"]) == 1
    assert "--scheduler nonsense: cannot connect (missing port number" in capsys.readouterr().err


def test_progress_counts_points_on_a_terminal() -> None:
    import io

    from tcpc.sweep import SweepProgress

    stream = io.StringIO()
    bar = SweepProgress(3, stream, force=True)
    bar.point_done(True)
    bar.point_done(False)
    bar.point_done(True)
    assert "sweep: 3 / 3 points, 1 failed" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r\x1b[K")
    quiet = io.StringIO()  # not a terminal: nothing
    SweepProgress(1, quiet).point_done(True)
    assert quiet.getvalue() == ""


def test_an_edited_machine_file_reruns_its_points(tmp_path: Path) -> None:
    machine = tmp_path / "m.toml"
    machine.write_text('extends = "rngd"\n[hbm]\nbytes_per_second = { value = 1e12, assumption = "test" }\n')
    spec_path = write_spec(tmp_path, f'programs = ["{TOY}"]\nmachine = "m.toml"\n')
    first = run_sweep(load_spec(spec_path), tmp_path / "out", workers=1, processes=False)
    assert first.ran == 1 and first.rows[0]["hbm_bytes_per_s"] == 1e12
    assert run_sweep(load_spec(spec_path), tmp_path / "out", workers=1, processes=False).ran == 0
    machine.write_text(machine.read_text().replace("1e12", "2e12"))
    again = run_sweep(load_spec(spec_path), tmp_path / "out", workers=1, processes=False)
    assert again.ran == 1 and again.rows[0]["hbm_bytes_per_s"] == 2e12
