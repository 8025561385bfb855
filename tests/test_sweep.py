"""`tcpc sweep`: spec expansion, a small sweep on a Dask LocalCluster (threads, in seconds), a
failing point, resumption, the Parquet schema, an existing scheduler and the charts."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

import tcpc.sweep.cluster
from tcpc.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main
from tcpc.pipelines import FULL_PIPELINE, pipeline_spec
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
    (f'programs = ["{TOY}"]\n[machine_overrides]\n"sram.size" = 1', "'sram.size' is not a machine file key"),
    (f'programs = ["{TOY}"]\n[pass_options]\n"lower-foo.x" = 1', "'lower-foo.x' is not PASS.OPTION"),
    ('routing = "balanced"', "no program"),
    ('programs = []', "programs: an empty list"),
    ('programs = ["x.moe"\n', "not valid TOML"),
])
def test_spec_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SweepError, match=message):
        load_spec(write_spec(tmp_path, text))


def test_pass_options_build_the_pipeline() -> None:
    """The sweep's pipeline is tcpc's own (the same for every machine: the passes read the
    point's machine from the module's target), its pass options on top."""
    assert pipeline_spec(topk_strategy=None) == ",".join(FULL_PIPELINE)
    assert pipeline_spec(topk_strategy=None, options={"lower-topk.strategy": "rounds"}).startswith(
        "lower-topk{strategy=rounds},")
    assert "split-clusters{clusters=4}" in pipeline_spec(options={"split-clusters.clusters": 4})
    assert "split-clusters{clusters=1 own_dma_intensity=9}" in pipeline_spec(
        options={"split-clusters.clusters": 1, "split-clusters.own_dma_intensity": 9})


def test_sweep_runs_records_failures_and_resumes(tmp_path: Path) -> None:
    text = SPEC.replace("dma_engines = 8", "dma_engines = [8, 0]")  # 0 engines: an invalid machine
    spec = load_spec(write_spec(tmp_path, text))
    out = tmp_path / "out"
    first = run_sweep(spec, out, workers=1, processes=False)
    assert first.ran == 16 and first.skipped == 0
    assert first.seconds > 0 and first.points_per_second == 16 / first.seconds
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
    assert slow["hbm_bytes_per_s"] == 1e9 and fast["hbm_bytes"] > 0 and slow["hbm_bytes"] > 0
    assert slow["total_cycles"] > fast["total_cycles"]  # (each machine's loop order is its own cost model's)
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
    rate = re.search(r"([0-9.]+) points per second \(4 in ([0-9.]+) s\)", out)
    assert rate is not None and float(rate.group(1)) > 0, out
    for name in ("roofline.png", "cycles_vs_routing.png", "cycles_vs_dim_T.png"):
        data = (tmp_path / "o" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", str(tmp_path / "none.toml")]) == 1
    assert "none.toml: no such sweep spec" in capsys.readouterr().err
    spec = write_spec(tmp_path, f'programs = ["{TOY}"]\n')
    assert main(["sweep", str(spec), "--workers", "0"]) == 2  # a usage error
    assert "--workers 0: a LocalCluster needs at least 1 worker process" in capsys.readouterr().err
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


class ClusterStarted(BaseException):
    """Raised where the sweep would start its cluster: a spec refused up front never gets there
    (a BaseException, so tcpc's error handling does not turn it into an internal error)."""


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(*args: object) -> None:
        raise ClusterStarted

    monkeypatch.setattr(tcpc.sweep.cluster, "_client", start)


TOY_SPEC = 'programs = ["{toy}"]\n'

BAD_SPECS: dict[str, tuple[str, tuple[str, ...], int, str]] = {
    # name: (spec text, more arguments, exit status, what stderr says)
    "missing-program": ('programs = ["{toy}", "nope.moe"]', (), EXIT_ERROR,
                        "spec.toml: spec: programs: {tmp}/nope.moe: no such file"),
    "missing-program-in-a-case": ('routing = ["balanced", "skewed"]\n[[cases]]\nprogram = "{toy}"\n'
                                  '[[cases]]\nprogram = "nope.moe"', (), EXIT_ERROR,
                                  "spec.toml: case 2: program: {tmp}/nope.moe: no such file"),
    "program-syntax": ('programs = ["bad.moe"]', (), EXIT_ERROR,
                       "spec: programs: {tmp}/bad.moe:4:1: error: unexpected '}', expected an expression"),
    "program-and-programs": (TOY_SPEC + 'program = "{toy}"', (), EXIT_ERROR, "spec: both programs and program"),
    "unknown-dim": (TOY_SPEC + "[dims]\nX = [1, 2]", (), EXIT_ERROR,
                    "spec: [dims] X: toy.moe has no dim named X (dims: B, D, E, F, K, T)"),
    "dim-not-a-number": (TOY_SPEC + '[dims]\nT = "many"', (), EXIT_ERROR,
                         "[dims] T: 'many' is neither an integer nor auto"),
    "unknown-routing": (TOY_SPEC + 'routing = ["balanced", "zipf"]', (), EXIT_ERROR,
                        "spec: routing: unknown routing scenario 'zipf' (expected balanced, skewed, one-expert"),
    "missing-routing-file": (TOY_SPEC + 'routing = "r.npz"', (), EXIT_ERROR,
                             "spec: routing: {tmp}/r.npz: no such file or directory"),
    "pickled-routing-file": (TOY_SPEC + 'routing = "objects.npz"', (), EXIT_ERROR,
                             "objects.npz: array 'idx' holds Python objects (pickled)"),
    "unknown-machine": (TOY_SPEC + 'machine = "rngd9"', (), EXIT_ERROR,
                        "spec: machine: 'rngd9' is not a built-in machine (rngd, rngd-cluster) or a .toml machine file"),
    "mesh-as-machine": (TOY_SPEC + 'machine = ["rngd", "rngd_pcie"]', (), EXIT_ERROR,
                        "spec: machine: 'rngd_pcie' is not a built-in machine (rngd, rngd-cluster)"),
    "bad-machine-file": (TOY_SPEC + '[[cases]]\nmachine = "m.toml"', (), EXIT_ERROR,
                         "case 1: machine: {tmp}/m.toml: [dma] engines: must be positive"),
    "unknown-sram-policy": (TOY_SPEC + 'sram_policy = "drop"', (), EXIT_ERROR,
                            "spec: sram_policy: 'drop' is not an SRAM policy (spill, error)"),
    "negative-seed": (TOY_SPEC + "seed = [0, -1]", (), EXIT_ERROR, "spec: seed: -1 is not a seed"),
    "unknown-pass-option": (TOY_SPEC + '[pass_options]\n"lower-topk.bogus" = 1', (), EXIT_ERROR,
                            "'lower-topk.bogus': lower-topk has no option 'bogus' (options: strategy)"),
    "bad-pass-option-value": (TOY_SPEC + '[pass_options]\n"lower-topk.strategy" = ["rank", "best"]', (), EXIT_ERROR,
                              "[pass_options] lower-topk.strategy: pipeline 'lower-topk{{strategy=best}}': "
                              "lower-topk: unknown strategy 'best'"),
    "out-not-a-string": (TOY_SPEC + "out = 3", (), EXIT_ERROR, "spec: out: 3 is not a directory (a string)"),
    "o-is-a-file": (TOY_SPEC, ("-o", "{tmp}/spec.toml"), EXIT_ERROR,
                    "-o {tmp}/spec.toml: is a file; the results go in a directory"),
    "out-is-a-file": (TOY_SPEC + 'out = "bad.moe"', (), EXIT_ERROR, "spec.toml: out {tmp}/bad.moe: is a file"),
    "o-under-a-file": (TOY_SPEC, ("-o", "{tmp}/bad.moe/out"), EXIT_ERROR,
                       "-o {tmp}/bad.moe/out: cannot make the results directory: not a directory"),
    "more-points-than-asked": (TOY_SPEC + "[dims]\nT = [1, 2, 3, 4]", ("--max-points", "3"), EXIT_ERROR,
                               "spec.toml: 4 points, more than the limit of 3 (--max-points N runs up to N)"),
    "workers-zero": (TOY_SPEC, ("--workers", "0"), EXIT_USAGE,
                     "--workers 0: a LocalCluster needs at least 1 worker process"),
    "workers-negative": (TOY_SPEC, ("--workers", "-1"), EXIT_USAGE, "--workers -1: a LocalCluster needs at least 1"),
    "workers-with-scheduler": (TOY_SPEC, ("--workers", "2", "--scheduler", "tcp://127.0.0.1:1"), EXIT_USAGE,
                               "--workers sizes the LocalCluster; it does not apply with --scheduler"),
    "max-points-zero": (TOY_SPEC, ("--max-points", "0"), EXIT_USAGE, "--max-points 0: expected a positive integer"),
}


@pytest.mark.parametrize("name", BAD_SPECS)
def test_a_bad_spec_fails_once_before_the_cluster_starts(
        name: str, tmp_path: Path, no_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    """One error naming the spec and its key (or the flag), the exit status docs/command-line.md gives, no point run."""
    text, more, status, message = BAD_SPECS[name]
    (tmp_path / "bad.moe").write_text("dims T = 4\ngraph g(x: f32[T]) -> f32[T] {\n    return x +\n}\n")
    (tmp_path / "m.toml").write_text('extends = "rngd"\n[dma]\nengines = { value = 0, assumption = "x" }\n')
    np.savez(tmp_path / "objects.npz", idx=np.array([[0, {"a": 1}]], dtype=object))
    spec = write_spec(tmp_path, text.replace("{toy}", str(TOY)) + "\n")
    code = main(["sweep", str(spec), *(a.replace("{tmp}", str(tmp_path)) for a in more)])
    err = capsys.readouterr().err
    assert code == status, err
    assert message.replace("{tmp}", str(tmp_path)).replace("{{", "{").replace("}}", "}") in err
    assert err.count("\n") == 1 and err.startswith("tcpc: error: ") and "internal error" not in err
    assert "--scheduler" not in err or name == "workers-with-scheduler"


def test_a_dim_that_one_case_s_program_lacks(tmp_path: Path) -> None:
    """The grid's dims go to every case's program: each must declare them."""
    mixtral = EXAMPLES.resolve() / "mixtral.moe"
    (tmp_path / "small.moe").write_text("dims T = 4, D = 8\ngraph g(x: f32[T, D]) -> f32[T, D] {\n    return x\n}\n")
    with pytest.raises(SweepError, match=r"spec.toml: case 2: \[dims\] E: small.moe has no dim named E \(dims: D, T\)"):
        load_spec(write_spec(tmp_path, f'[dims]\nE = 4\n[[cases]]\nprogram = "{mixtral}"\n'
                                       '[[cases]]\nprogram = "small.moe"\n'))


def test_the_count_is_said_before_the_cluster_starts(
        tmp_path: Path, no_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path)  # 8 points
    with pytest.raises(ClusterStarted):
        main(["sweep", str(spec), "--max-points", "8", "-o", str(tmp_path / "o")])
    assert "sweep " + str(spec) + " (toy): 8 point(s) on a LocalCluster" in capsys.readouterr().out


def test_the_limit_counts_points_before_building_them(tmp_path: Path) -> None:
    """A million points are refused by their count at once (building them would take minutes);
    a spec of exactly the limit is built."""
    def spec(values: int) -> Path:
        return write_spec(tmp_path, f'programs = ["{TOY}"]\n[dims]\nT = {list(range(1, values + 1))}\n'
                                    f'D = {[8 * i for i in range(1, values + 1)]}\n')

    with pytest.raises(SweepError, match=r"spec.toml: 1,000,000 points, more than the limit of 10,000 \(--max-points"):
        load_spec(spec(1000))
    assert len(load_spec(spec(10), max_points=100).points) == 100
    with pytest.raises(SweepError, match="100 points, more than the limit of 99"):
        load_spec(spec(10), max_points=99)


def test_a_sweep_whose_every_point_failed_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dask.distributed import LocalCluster

    failing = write_spec(tmp_path, f'programs = ["{TOY}"]\n[dims]\nT = [0, -4]\n')
    some = tmp_path / "some.toml"
    some.write_text(f'programs = ["{TOY}"]\n[dims]\nT = [0, 4]\n')
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        every = main(["sweep", str(failing), "--scheduler", cluster.scheduler_address, "-o", str(tmp_path / "a")])
        captured = capsys.readouterr()
        one = main(["sweep", str(some), "--scheduler", cluster.scheduler_address, "-o", str(tmp_path / "b")])
    assert every == EXIT_ERROR, captured
    assert captured.err == (f"tcpc: error: {failing}: every point failed (2 of 2); the errors are above and in "
                            f"{tmp_path / 'a' / 'results.csv'}\n")
    assert "failed" in captured.out and "T=0: a dim must be a positive integer" in captured.out
    rows = pq.read_table(tmp_path / "a" / "results.parquet").to_pylist()  # the failures are kept as rows
    assert [r["status"] for r in rows] == ["error", "error"]
    assert one == EXIT_OK, capsys.readouterr()  # one point of two failed: the sweep succeeded
