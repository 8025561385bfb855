"""What each pass did (tcpc/pass_instruments.py): `--dump-ir`, `--pass-stats` and `--time-passes`
work on every example, for `tcpc compile` and `tcpc run`; a directory that cannot be one and
flags that would report on no pass are clean errors. The output formats are pinned by the golden
files tests/filecheck/pipeline/dump_ir.moe, pass_stats.moe, time_passes.moe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tcpc
from tcpc.pipelines import FULL_PIPELINE, LOWERED_PIPELINE, pipeline_spec
from tcpc.program import print_ir
from support import failure, tcpc_main

EXAMPLES_DIR = Path(__file__).parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.moe"))
TOY = EXAMPLES_DIR / "toy.moe"
LOWERED = pipeline_spec(LOWERED_PIPELINE, topk_strategy="rank")
FIXED = pipeline_spec(FULL_PIPELINE, topk_strategy="rank", expert_order="block")
"""The lowering and the full pipeline with their autos given, so that no candidate is compiled: the
test is the instruments, not the choices (pass_stats.moe and time_passes.moe run the autos)."""


def stats_rows(err: str) -> dict[str, list[str]]:
    """--pass-stats' table rows by pass name (and `output`): the columns after the name."""
    rows: dict[str, list[str]] = {}
    for line in err.splitlines():
        match = re.match(r"\s+(?:\d+\s+)?([a-z-]+)\s+(.*)$", line)
        if match and match.group(1) not in ("pass", "note"):
            rows[match.group(1)] = match.group(2).split()
    return rows


def dumps_and_counts(example: Path, passes: tuple[str, ...], pipeline: str, tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    """Compile `example` through `pipeline` (the passes `passes`) with --dump-ir and --pass-stats:
    a file per step, each parsing as tcpc-opt reads it, the last the IR compile prints; a
    statistics row per step, cycles from lower-math on. The rows, by pass."""
    code, out, err = tcpc_main(capsys, "compile", example, "--set", "B=4", "-p", pipeline, "--dump-ir", tmp_path,
                               "--pass-stats")
    assert code == 0, err
    names = ["00-input.mlir", *(f"{i:02d}-{name}.mlir" for i, name in enumerate(passes, 1))]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    for name in (names[0], names[-1]):
        tcpc.load_ir((tmp_path / name).read_text(), name)
    assert (tmp_path / names[-1]).read_text() == out
    rows = stats_rows(err)
    assert list(rows) == ["input", *passes, "output"]
    assert all(rows[p][0] == "-" for p in ("input", "lower-topk", "lower-routing", "lower-dispatch"))
    assert rows["output"][0].replace(",", "").isdigit()  # the lowered program is simulated
    assert "note:" not in err
    return rows


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_dumps_and_counts_every_pass(example: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The lowering of every example (the schedule level: llama4 below, toy in pass_stats.moe)."""
    dumps_and_counts(example, LOWERED_PIPELINE, LOWERED, tmp_path, capsys)


def test_the_schedule_level_of_a_shared_expert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """llama4's shared expert: schedule-shared changes the IR, where toy's it does not."""
    rows = dumps_and_counts(EXAMPLES_DIR / "llama4.moe", FULL_PIPELINE, FIXED, tmp_path, capsys)
    assert rows["schedule-shared"] != ["unchanged"]


def test_run_reports_its_own_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tcpc run --cost-only compiles with pin-routing first; the statistics' last cycles are the run's."""
    code, out, err = tcpc_main(capsys, "run", TOY, "--cost-only", "--routing", "skewed", "-p", FIXED,
                               "--dump-ir", tmp_path, "--pass-stats", "--time-passes")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir())[:3] == ["00-input.mlir", "01-pin-routing.mlir",
                                                               "02-lower-topk.mlir"]
    rows = stats_rows(err)
    assert re.search(rf"^cycles: {rows['output'][0]} = ", out, re.MULTILINE), (out, err)
    assert "cost-only on rngd for skewed routing" in err
    assert re.findall(r"\)  (\S+)$", err, re.MULTILINE) == ["pin-routing", *FULL_PIPELINE, "verifier", "Total"]


@pytest.mark.parametrize("make, argv, note", [
    ("mesh", ("--mesh", "ep=2", "--emit", "lowered"), "@toy is sharded over a mesh: the cycles of a chip need every chip"),
    ("unpinned", ("-p", "schedule-experts"), "no cycles: the cost of %pair_expert = tcp.view depends on the values"),
], ids=["mesh", "unpinned-ir"])
def test_a_level_the_simulator_cannot_run_says_why(make: str, argv: tuple[str, ...], note: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Every op has a cost, yet no cycles: a mesh chip's program, or lowered IR whose routing is
    not an argument (cost-only has no values for the router's)."""
    source = TOY
    if make == "unpinned":
        source = tmp_path / "lowered.mlir"
        source.write_text(print_ir(tcpc.compile_file(TOY).lower(pipeline_spec(LOWERED_PIPELINE, topk_strategy="rank"))))
    code, _, err = tcpc_main(capsys, "compile", source, *argv, "--pass-stats")
    assert code == 0, err
    assert rows_cycles(err) == {"-"}
    assert f"note: {note}" in err
    assert "or as noted below" in err


def rows_cycles(err: str) -> set[str]:
    return {columns[0] for columns in stats_rows(err).values() if columns[0] != "unchanged"}


def test_dump_ir_directory_is_made_with_its_parents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "a" / "b"
    code, _, err = tcpc_main(capsys, "compile", TOY, "-p", "lower-topk", "--dump-ir", target)
    assert code == 0, err
    assert sorted(p.name for p in target.iterdir()) == ["00-input.mlir", "01-lower-topk.mlir"]


def test_dump_ir_that_cannot_be_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any work, naming the flag and the path."""
    file = tmp_path / "f.mlir"
    file.write_text("")
    argv = ("compile", TOY, "--emit", "lowered", "--dump-ir")
    assert failure(capsys, *argv, file) == f"tcpc: error: --dump-ir {file}: is a file; name a directory\n"
    assert failure(capsys, *argv, file / "sub") == (f"tcpc: error: --dump-ir {file / 'sub'}: cannot create the "
                                                    "directory: not a directory\n")
    assert failure(capsys, "run", TOY, "--cost-only", "--dump-ir", file).startswith("tcpc: error: --dump-ir")


@pytest.mark.parametrize("argv, message", [
    (("compile", TOY, "--pass-stats"), "--pass-stats reports on the passes one by one; the graph-level IR goes "
                                       "through none (add --emit lowered, --emit scheduled or -p PASSES)"),
    (("compile", TOY, "--emit", "graph", "--print-ir-after-all"), "--print-ir-after-all reports on the passes"),
    (("compile", TOY, "--emit", "planned", "--time-passes"), "--time-passes reports on the passes one by one; "
                                                             "--emit planned prints the planned IR once"),
    (("run", TOY, "--reference", "--dump-ir", "d"), "--dump-ir reports on the passes one by one; --reference runs "
                                                    "the graph-level IR, which goes through none (add -p PASSES)"),
    (("run", TOY, "--mesh", "ep=2", "--pass-stats"), "--pass-stats does not apply to --mesh (tcpc compile --mesh "
                                                     "SPEC --emit scheduled reports on a chip's passes)"),
])
def test_flags_that_report_on_no_pass_are_usage_errors(argv: tuple[object, ...], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert failure(capsys, *argv, status=2).startswith(f"tcpc: error: {message}")
