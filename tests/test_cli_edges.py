"""Hard edges of the command line (issue 13): every bad input is one clear error with the exit
status docs/command-line.md's table gives, never a traceback, an "internal error" or a silent wrong answer.

The table runs in process through `tcpc.cli.main`; the few edges only a real process shows
(Ctrl-C, a closed pipe, tcpc-opt's own argument handling) run as subprocesses.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tcpc.cli import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

OUT_OF_RANGE = """\
dims T = 4, D = 8, E = 4, K = 2, B = 2
graph g(x: f32[T, D], idx: i32[T, K], w: f32[E, D, D]) -> f32[T, D] {
    xb, r = scatter(x, idx, experts=E, block=B)
    return combine(grouped_matmul(xb, w, r), r)
}
"""

TENSOR_MATH = """\
dims T = 4, D = 8
graph g(x: f32[T, D], h: bf16[T, D], n: i32[T, D]) -> f32[T, D] {{
    a = {expr}
    return x
}}
"""

DYNAMIC = """\
builtin.module {
  func.func @f(%x: tensor<?x8xf32>) -> tensor<?x8xf32> {
    func.return %x : tensor<?x8xf32>
  }
}
"""

SCALAR_IR = """\
builtin.module {
  func.func @f(%x: i32) -> i32 {
    func.return %x : i32
  }
}
"""

HUGE_IR = """\
builtin.module {
  func.func @f(%x: tensor<1000000000x1000000xf32>) -> tensor<1000000000x1000000xf32> {
    func.return %x : tensor<1000000000x1000000xf32>
  }
}
"""


def machine(body: str) -> str:
    return f'extends = "rngd"\n{body}'


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Every file the table names, by placeholder."""
    text = {
        "range.moe": OUT_OF_RANGE,
        "nan.moe": TENSOR_MATH.format(expr="x").replace("return x", "return log(x - 100.0)"),
        "inf-literal.moe": TENSOR_MATH.format(expr="x * 1e999"),
        "f32-overflow.moe": TENSOR_MATH.format(expr="x * 1.0e39"),
        "bf16-overflow.moe": TENSOR_MATH.format(expr="h * 3.4e38"),
        "i32-overflow.moe": TENSOR_MATH.format(expr="n + 3000000000"),
        "fold-overflow.moe": TENSOR_MATH.format(expr="x * (1e308 * 10.0)"),
        "dyn.mlir": DYNAMIC,
        "huge.mlir": HUGE_IR,
        "scalar.mlir": SCALAR_IR,
        "f64.mlir": DYNAMIC.replace("?x8xf32", "4xf64"),
        "noname.toml": machine('[dma]\nstartup_cycles = { value = 1000, assumption = "slower start-up" }\n'),
        "huge.toml": machine('[dma]\nstartup_cycles = { value = 100000000000000, assumption = "x" }\n'),
        "zero.toml": machine('[dma]\nengines = { value = 0, assumption = "x" }\n'),
        "zero-clock.toml": machine('[chip]\nclock_hz = { value = 0.0, assumption = "x" }\n'),
        "negative.toml": machine('[control]\nguard_cycles = { value = -1, assumption = "x" }\n'),
        "zero-link.toml": 'extends = "rngd_pcie"\n[link]\nbytes_per_cycle = { value = 0, assumption = "x" }\n',
        "nosuch-base.toml": 'extends = "nosuch"\n',
    }
    paths = {name: tmp_path / name for name in text}
    for name, body in text.items():
        paths[name].write_text(body)
    (tmp_path / "binary.toml").write_bytes(b'name = "\xff\xfe"\n')
    (tmp_path / "binary.mlir").write_bytes(b"\x92\x00builtin.module {}")
    np.savez(tmp_path / "idx.npz", idx=np.array([[0, 1], [2, 9], [3, -1], [1, 2]], np.int32))
    np.savez(tmp_path / "objects.npz", idx=np.array([[0, {"a": 1}]], dtype=object))
    (tmp_path / "empty.npz").write_bytes(b"")
    np.savez(tmp_path / "shape.npz", x=np.zeros((3, 8), np.float32))
    np.savez(tmp_path / "dtype.npz", x=np.full((4, 8), "a"))
    (tmp_path / "truncated.npz").write_bytes((tmp_path / "shape.npz").read_bytes()[:100])
    with zipfile.ZipFile(tmp_path / "bytes.npz", "w") as z:
        z.writestr("x.npy", "not an array")
    (tmp_path / "copy.moe").write_text((ROOT / "examples" / "toy.moe").read_text())
    (tmp_path / "bom.moe").write_text("\ufeff" + (ROOT / "examples" / "toy.moe").read_text(), encoding="utf-8")
    (tmp_path / "bom-error.moe").write_text("\ufeffdims T = 4,, D = 8\n", encoding="utf-8")
    (tmp_path / "bom.mlir").write_text("\ufeff" + DYNAMIC.replace("?x8xf32", "4x8xf32"), encoding="utf-8")
    names = {key.replace(".", "_"): str(path) for key, path in paths.items()}
    names.update({k.replace(".", "_"): str(tmp_path / k) for k in
                  ("binary.toml", "binary.mlir", "idx.npz", "objects.npz", "copy.moe", "empty.npz", "shape.npz",
                   "dtype.npz", "truncated.npz", "bytes.npz", "bom.moe", "bom-error.moe", "bom.mlir")})
    return {**names, "tmp": str(tmp_path), "toy": str(ROOT / "examples" / "toy.moe"),
            "mixtral": str(ROOT / "examples" / "mixtral.moe")}


@dataclass(frozen=True)
class Edge:
    argv: tuple[str, ...]
    status: int
    err: str
    """What stderr must contain ("" : stderr must be empty)."""
    out: str = ""
    """What stdout must contain."""
    one_line: bool = True
    """The error is one line (located program errors add the source line and a caret)."""


EDGES: dict[str, Edge] = {
    # --- pipeline syntax slips, for compile and run --------------------------------------------
    "unclosed-brace": Edge(("compile", "{toy}", "-p", "lower-topk{strategy=rank"), EXIT_ERROR,
                           "tcpc: error: pipeline 'lower-topk{strategy=rank': '{' is never closed at column 11"),
    "empty-pass": Edge(("compile", "{toy}", "-p", "lower-topk,,lower-math"), EXIT_ERROR,
                       "a pass name is missing (two commas, or a comma at an end) at column 12"),
    "lone-comma": Edge(("run", "{toy}", "-p", ","), EXIT_ERROR, "pipeline ',': a pass name is missing"),
    "trailing-comma": Edge(("run", "{toy}", "-p", "lower-topk,"), EXIT_ERROR, "a pass name is missing"),
    "option-twice": Edge(("compile", "{toy}", "-p", "lower-topk{strategy=rank strategy=rounds}"), EXIT_ERROR,
                         "option 'strategy' is given twice at column 26"),
    "unknown-pass": Edge(("run", "{toy}", "-p", "lower-topk,nosuch"), EXIT_ERROR, "unknown pass 'nosuch'"),
    "stray-character": Edge(("compile", "{toy}", "-p", "lower-topk;lower-math"), EXIT_ERROR,
                            "unexpected character ';' at column 11"),
    # --- sizes the tool cannot hold ----------------------------------------------------------
    "dim-beyond-i32": Edge(("compile", "{mixtral}", "--set", "T=1000000000000"), EXIT_ERROR,
                           "mixtral.moe:4:23: error: dim T = 1000000000000 is too large", one_line=False),
    "pairs-beyond-i32": Edge(("compile", "{mixtral}", "--set", "T=1500000000"), EXIT_ERROR,
                             "scatter: T * K = 1500000000 * 2 = 3,000,000,000 token choices", one_line=False),
    "values-beyond-memory": Edge(("run", "{mixtral}", "--set", "T=1000000000", "--set", "B=4"), EXIT_ERROR,
                                 "of memory for its values"),
    "ir-beyond-memory": Edge(("run", "{huge_mlir}", "--reference"), EXIT_ERROR,
                             "--cost-only computes the cycles without values"),
    "mesh-beyond-the-chip-limit": Edge(("run", "{mixtral}", "--mesh", "ep=1024"), EXIT_ERROR,
                                       "tcpc: error: --mesh ep=1024: 1,024 chips, more than the 128 tcpc simulates by "
                                       "default (every chip is simulated, and the time grows faster than the chip "
                                       "count); --max-chips 1024 lifts the limit"),
    "mesh-beyond-max-chips": Edge(("run", "{mixtral}", "--mesh", "dp=2,ep=2", "--max-chips", "2"), EXIT_ERROR,
                                  "--mesh dp=2,ep=2: 4 chips, more than --max-chips 2 (every chip"),
    "max-chips-zero": Edge(("run", "{mixtral}", "--mesh", "ep=2", "--max-chips", "0"), EXIT_USAGE,
                           "--max-chips 0: expected a positive number of chips"),
    "max-chips-without-mesh": Edge(("run", "{mixtral}", "--max-chips", "64"), EXIT_USAGE,
                                   "--max-chips applies to a --mesh run; add --mesh"),
    # --- literals -----------------------------------------------------------------------------
    "literal-not-finite": Edge(("compile", "{inf-literal_moe}"), EXIT_ERROR,
                               ":3:13: error: the number 1e999 is not finite", one_line=False),
    "literal-f32-overflow": Edge(("compile", "{f32-overflow_moe}"), EXIT_ERROR,
                                 ":3:11: error: 1e+39 overflows f32", one_line=False),
    "literal-bf16-overflow": Edge(("compile", "{bf16-overflow_moe}"), EXIT_ERROR,
                                  ":3:11: error: 3.4e+38 overflows bf16", one_line=False),
    "literal-outside-i32": Edge(("compile", "{i32-overflow_moe}"), EXIT_ERROR,
                                ":3:11: error: 3000000000 does not fit in i32", one_line=False),
    "folded-overflow": Edge(("compile", "{fold-overflow_moe}"), EXIT_ERROR,
                            ":3:20: error: 1e+308 * 10.0 overflows a 64-bit float", one_line=False),
    # --- routing out of range: a warning, the run goes on ------------------------------------
    "routing-out-of-range": Edge(("run", "{range_moe}", "--inputs", "{idx_npz}"), EXIT_OK,
                                 "tcpc: warning: 2 of 8 expert choices are outside [0, 4) "
                                 "(the first: token 1, choice 1 chose 9)", out="cycles:"),
    "routing-out-of-range-interpreted": Edge(("run", "{range_moe}", "--inputs", "{idx_npz}", "-p", "lower-routing"),
                                             EXIT_OK, "2 of 8 expert choices are outside [0, 4)"),
    "routing-out-of-range-reference": Edge(("run", "{range_moe}", "--inputs", "{idx_npz}", "--reference"), EXIT_ERROR,
                                           "tcpc: error while running: moe.scatter: expert index"),
    # --- files ----------------------------------------------------------------------------------
    "out-is-a-directory": Edge(("run", "{toy}", "--out", "{tmp}"), EXIT_ERROR, "--out {tmp}: is a directory"),
    "o-is-a-directory": Edge(("compile", "{toy}", "-o", "{tmp}"), EXIT_ERROR, "-o {tmp}: is a directory"),
    "o-is-the-input": Edge(("compile", "{copy_moe}", "-o", "{copy_moe}"), EXIT_ERROR,
                           "-o {copy_moe}: is an input of this command"),
    "out-in-missing-directory": Edge(("run", "{toy}", "--out", "{tmp}/no/such/out.npz"), EXIT_ERROR,
                                     "--out {tmp}/no/such/out.npz: no such file or directory"),
    "trace-and-out-one-file": Edge(("run", "{toy}", "--out", "{tmp}/x", "--trace", "{tmp}/x"), EXIT_USAGE,
                                   "--out and --trace both name"),
    "o-on-a-full-device": Edge(("compile", "{toy}", "-o", "/dev/full"), EXIT_ERROR,
                               "tcpc: error: cannot write /dev/full: no space left on device"),
    "out-on-a-full-device": Edge(("run", "{toy}", "--out", "/dev/full"), EXIT_ERROR,
                                 "tcpc: error: cannot write /dev/full: no space left on device"),
    "trace-on-a-full-device": Edge(("run", "{toy}", "--trace", "/dev/full"), EXIT_ERROR,
                                   "tcpc: error: cannot write /dev/full: no space left on device"),
    "report-json-on-a-full-device": Edge(("run", "{toy}", "--report-json", "/dev/full"), EXIT_ERROR,
                                         "tcpc: error: cannot write /dev/full: no space left on device"),
    "mesh-out-on-a-full-device": Edge(("run", "{mixtral}", "--mesh", "ep=2", "--out", "/dev/full"), EXIT_ERROR,
                                      "tcpc: error: cannot write /dev/full: no space left on device"),
    "mesh-trace-on-a-full-device": Edge(("run", "{mixtral}", "--mesh", "ep=2", "--cost-only", "--trace", "/dev/full"),
                                        EXIT_ERROR, "tcpc: error: cannot write /dev/full: no space left on device"),
    "mesh-out-is-a-directory": Edge(("run", "{mixtral}", "--mesh", "ep=2", "--out", "{tmp}"), EXIT_ERROR,
                                    "--out {tmp}: is a directory"),
    "missing-program": Edge(("compile", "{tmp}/nope.moe"), EXIT_ERROR, "nope.moe: no such file or directory"),
    # --- corrupt inputs ------------------------------------------------------------------------
    "pickled-inputs": Edge(("run", "{toy}", "--inputs", "{objects_npz}"), EXIT_ERROR,
                           "array 'idx' holds Python objects (pickled)"),
    "empty-inputs": Edge(("run", "{toy}", "--inputs", "{empty_npz}"), EXIT_ERROR, "{empty_npz}: an empty file, not an .npz or .npy"),
    "truncated-inputs": Edge(("run", "{toy}", "--inputs", "{truncated_npz}"), EXIT_ERROR,
                             "{truncated_npz}: a truncated or damaged .npz (not a readable zip file)"),
    "inputs-member-not-an-array": Edge(("run", "{toy}", "--inputs", "{bytes_npz}"), EXIT_ERROR,
                                       "{bytes_npz}: 'x' is not a numpy array"),
    "inputs-shape": Edge(("run", "{toy}", "--inputs", "{shape_npz}"), EXIT_ERROR,
                         "tcpc: error: {shape_npz}: input 'x' has shape [3, 8], the graph declares bf16[4, 8]"),
    "inputs-dtype": Edge(("run", "{toy}", "--reference", "--inputs", "{dtype_npz}"), EXIT_ERROR,
                         "tcpc: error: {dtype_npz}: input 'x' is <U1, the graph declares bf16[4, 8]"),
    "inputs-shape-on-a-mesh": Edge(("run", "{mixtral}", "--mesh", "ep=2", "--inputs", "{shape_npz}"), EXIT_ERROR,
                                   "tcpc: error: {shape_npz}: input 'x' has shape [3, 8], the graph declares bf16[16, 64]"),
    "empty-routing": Edge(("run", "{toy}", "--cost-only", "--routing", "{empty_npz}"), EXIT_ERROR,
                          "{empty_npz}: an empty file, not an .npz or .npy"),
    "truncated-routing": Edge(("run", "{toy}", "--cost-only", "--routing", "{truncated_npz}"), EXIT_ERROR,
                              "{truncated_npz}: a truncated or damaged .npz"),
    "pickled-routing": Edge(("run", "{toy}", "--cost-only", "--routing", "{objects_npz}"), EXIT_ERROR,
                            "{objects_npz}: array 'idx' holds Python objects (pickled)"),
    "binary-machine": Edge(("run", "{toy}", "--machine", "{binary_toml}"), EXIT_ERROR,
                           "binary.toml: not a UTF-8 text file (byte 8 is b'\\xff')"),
    "binary-mlir": Edge(("run", "{binary_mlir}"), EXIT_ERROR, "binary.mlir: error: not a UTF-8 text file"),
    "dynamic-shape": Edge(("run", "{dyn_mlir}"), EXIT_ERROR,
                          "%x (an argument of func.func, tensor<?x8xf32>) has a size that is not static"),
    "scalar-argument": Edge(("run", "{scalar_mlir}"), EXIT_ERROR,
                            "argument 'x' of graph 'f' is i32, not a tensor"),
    "f64-tensors": Edge(("run", "{f64_mlir}"), EXIT_ERROR, "%x (an argument of func.func) has element type f64"),
    "machine-number-too-large": Edge(("run", "{toy}", "--machine", "{huge_toml}"), EXIT_ERROR,
                                     "[dma] startup_cycles: 100000000000000 is too large to simulate"),
    "machine-number-zero": Edge(("run", "{toy}", "--machine", "{zero_toml}"), EXIT_ERROR,
                                "tcpc: error: {zero_toml}: [dma] engines: must be positive, got 0"),
    "machine-clock-zero": Edge(("run", "{toy}", "--machine", "{zero-clock_toml}"), EXIT_ERROR,
                               "tcpc: error: {zero-clock_toml}: [chip] clock_hz: must be positive, got 0.0"),
    "machine-latency-below-zero": Edge(("run", "{toy}", "--machine", "{negative_toml}"), EXIT_ERROR,
                                       "tcpc: error: {negative_toml}: [control] guard_cycles: must be zero or more, got -1"),
    "mesh-link-zero": Edge(("run", "{mixtral}", "--mesh", "ep=2", "--mesh-machine", "{zero-link_toml}"), EXIT_ERROR,
                           "tcpc: error: {zero-link_toml}: [link] bytes_per_cycle: must be positive, got 0"),
    "machine-extends-unknown": Edge(("run", "{toy}", "--machine", "{nosuch-base_toml}"), EXIT_ERROR,
                                    "tcpc: error: {nosuch-base_toml}: extends: 'nosuch' is neither a built-in machine "
                                    "(chips: rngd, rngd-cluster; meshes: rngd_2x4, rngd_pcie) nor a file {tmp}/nosuch"),
    "mesh-extends-unknown": Edge(("run", "{mixtral}", "--mesh", "ep=2", "--mesh-machine", "{nosuch-base_toml}"),
                                 EXIT_ERROR, "tcpc: error: {nosuch-base_toml}: extends: 'nosuch' is neither"),
    "machine-without-a-name": Edge(("run", "{toy}", "--machine", "{noname_toml}"), EXIT_OK, "",
                                   out="at 1 GHz on noname;"),
    # --- a UTF-8 byte-order mark, as some editors write --------------------------------------
    "bom-program": Edge(("run", "{bom_moe}"), EXIT_OK, "", out="cycles:"),
    "bom-program-error": Edge(("compile", "{bom-error_moe}"), EXIT_ERROR,
                              "bom-error.moe:1:12: error: unexpected ',', expected a name\ndims T = 4,, D = 8\n",
                              one_line=False),
    "bom-ir": Edge(("run", "{bom_mlir}"), EXIT_OK, "", out="bom.mlir, as given, simulated"),
    # --- warnings ------------------------------------------------------------------------------
    "all-nan-output": Edge(("run", "{nan_moe}"), EXIT_OK, "", out="not finite: all (32 NaN)"),
    # --- options together ----------------------------------------------------------------------
    "run-pin-routing": Edge(("run", "{toy}", "-p", "pin-routing"), EXIT_OK, "", out="after pin-routing, not simulated"),
    "reference-check": Edge(("run", "{toy}", "--reference", "--check"), EXIT_USAGE,
                            "--reference runs only the reference: nothing to compare"),
    "reference-after-p-check": Edge(("run", "{toy}", "--reference", "-p", "lower-topk", "--check"), EXIT_OK, "",
                                    out="check: the outputs of the IR after lower-topk against the reference "
                                        "(the graph-level IR)"),
    "run-pin-routing-check": Edge(("run", "{toy}", "-p", "pin-routing", "--check"), EXIT_USAGE,
                                  "--check compares with the reference"),
    "planned-after-p": Edge(("compile", "{toy}", "--emit", "planned", "-p", ",".join(
        ("lower-topk{strategy=rounds}", "lower-routing", "lower-dispatch", "lower-math", "load-arguments"))), EXIT_OK, "",
        out="// planned: the IR after lower-topk{strategy=rounds},"),
    "planned-partly-lowered": Edge(("compile", "{toy}", "--emit", "planned", "-p", "lower-topk"), EXIT_ERROR,
                                   "--emit planned needs every op lowered"),
    "planned-cost-only": Edge(("compile", "{toy}", "--emit", "planned", "--cost-only", "--routing", "skewed"), EXIT_OK,
                              "", out="without values, for the skewed routing (cost-only)"),
    "emit-graph-with-p": Edge(("compile", "{toy}", "--emit", "graph", "-p", "lower-topk"), EXIT_USAGE,
                              "--emit graph prints the IR before any pass"),
    "seed-without-planned": Edge(("compile", "{toy}", "--seed", "3"), EXIT_USAGE, "--seed applies to --emit planned"),
    "routing-without-cost-only": Edge(("compile", "{toy}", "--emit", "planned", "--routing", "skewed"), EXIT_USAGE,
                                      "add --cost-only"),
    "report-ops-zero": Edge(("run", "{toy}", "--report", "--report-ops", "0"), EXIT_OK, "",
                            out="on the critical path (listed by --report-ops N or all, and in --report-json)\ncycles:"),
    "report-ops-not-a-count": Edge(("run", "{toy}", "--report", "--report-ops", "some"), EXIT_USAGE,
                                   "--report-ops some: expected a count (0 for the summary only) or all"),
    "report-by-unknown": Edge(("run", "{toy}", "--report", "--report-by", "line,lines"), EXIT_USAGE,
                              "--report-by lines: expected phase, line or op (comma-separated or repeated)"),
    "report-by-without-report": Edge(("run", "{toy}", "--report-by", "line"), EXIT_USAGE,
                                     "--report-by chooses --report's tables; add --report"),
    "report-by-mesh": Edge(("run", "{toy}", "--mesh", "ep=2", "--report", "--report-by", "op"), EXIT_USAGE,
                           "--report-by chooses the tables of a chip's report; a --mesh report has its own"),
    "report-by-phase-and-op": Edge(("run", "{toy}", "--report", "--report-by", "op", "--report-by", "phase",
                                    "--report-ops", "0"), EXIT_OK, "",
                                   out="on the critical path (listed by --report-ops N or all, and in --report-json)\ncycles:"),
    # --- usage errors: argparse's status, kept for tcpc's own -------------------------------------
    "no-command": Edge((), EXIT_USAGE, "tcpc: error: the following arguments are required: command", one_line=False),
    "unknown-option": Edge(("run", "{toy}", "--bogus"), EXIT_USAGE, "tcpc: error: unrecognized arguments: --bogus",
                           one_line=False),
    "bad-choice": Edge(("compile", "{toy}", "--emit", "asm"), EXIT_USAGE, "invalid choice: 'asm'", one_line=False),
    "set-not-an-integer": Edge(("compile", "{toy}", "--set", "T=x"), EXIT_ERROR, "--set T=x: 'x' is neither an integer nor auto"),
}


def fill(text: str, files: dict[str, str]) -> str:
    """`text` with each `{placeholder}` of `files` replaced (pipelines keep their own braces)."""
    return re.sub(r"\{([\w.-]+)\}", lambda m: files.get(m.group(1), m.group(0)), text)


@pytest.mark.parametrize("name", EDGES)
def test_edge(name: str, files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    edge = EDGES[name]
    argv = [fill(a, files) for a in edge.argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse exits on its own
        code = e.code
    captured = capsys.readouterr()
    err, out = captured.err, captured.out
    assert code == edge.status, (out, err)
    assert "Traceback" not in err and "internal error" not in err and "Warning:" not in err
    if edge.err:
        assert fill(edge.err, files) in err
        if edge.one_line:
            assert err.count("\n") == 1, err
    else:
        assert err == ""
    assert edge.out in out


def test_output_files_are_written_where_named(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """A bare name is written as it is: numpy would write `x.npz` and tcpc say `wrote x`."""
    target = Path(files["tmp"]) / "outputs"
    assert main(["run", files["toy"], "--out", str(target)]) == EXIT_OK
    assert f"wrote {target}\n" in capsys.readouterr().out
    with np.load(target) as data:
        assert data["out0"].shape == (4, 8)


def test_a_full_disk_names_the_path_and_leaves_no_partial_file(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "savez", full)
    target = Path(files["tmp"]) / "o.npz"
    assert main(["run", files["toy"], "--out", str(target)]) == EXIT_ERROR
    assert capsys.readouterr().err == f"tcpc: error: cannot write {target}: no space left on device\n"
    assert not target.exists()


def test_a_full_stdout_is_an_error_not_a_success(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The report and the `wrote` lines sit in stdout's buffer until the end: its failing flush
    is the command's error."""
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        code = main(["run", files["toy"], "--report", "--out", str(Path(files["tmp"]) / "o.npz")])
    assert code == EXIT_ERROR
    assert capsys.readouterr().err == "tcpc: error: cannot write the standard output: no space left on device\n"


def test_a_full_stdout_ends_a_real_process_with_one_line() -> None:
    """Block-buffered, as in a shell: nothing more at the interpreter's exit (its own flush)."""
    env = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "tcpc.cli", "compile", str(ROOT / "examples" / "toy.moe")],
                              stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert (done.returncode, done.stderr) == (EXIT_ERROR, "tcpc: error: cannot write the standard output: "
                                                          "no space left on device\n")


def test_a_bug_is_an_internal_error_with_its_own_status(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import tcpc.cli

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(tcpc.cli, "compile_file", broken)
    monkeypatch.delenv("TCPC_DEBUG", raising=False)
    assert main(["compile", files["toy"]]) == EXIT_INTERNAL
    assert capsys.readouterr().err == "tcpc: internal error: RuntimeError: a bug (set TCPC_DEBUG=1 for the traceback)\n"


def test_a_closed_pipe_ends_quietly() -> None:
    """`tcpc ... | head -0`: the reader is gone before tcpc writes anything."""
    command = [sys.executable, "-m", "tcpc.cli", "compile", str(ROOT / "examples" / "toy.moe")]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE, err
    assert err == ""


SLOW = """\
dims N = 2048
graph slow(a: f32[N, N]) -> f32[N, N] {
    b = exp(a @ a)
    c = b @ b
    d = c @ c
    e = d @ d
    f = e @ e
    g = f @ f
    return g @ g
}
"""


def test_ctrl_c_ends_with_one_line_and_status_130(tmp_path: Path) -> None:
    program = tmp_path / "slow.moe"
    program.write_text(SLOW)
    # 'ready' is printed from inside the run (the reference run, seconds long), so the signal
    # arrives while tcpc computes, however loaded the machine: no sleep to guess with.
    # SIGINT gets Python's own handler even where the parent ignores it (a job started with `&`
    # by a non-interactive shell inherits SIG_IGN, and Python then installs none).
    script = ("import signal, sys, tcpc.cli, tcpc.program\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "run = tcpc.program.Program.run\n"
              "def announced(*a, **k):\n    print('ready', flush=True)\n    return run(*a, **k)\n"
              "tcpc.program.Program.run = announced\n"
              f"sys.exit(tcpc.cli.main(['run', {str(program)!r}, '--reference']))\n")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=ENV) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, (out, err)
    assert err.decode() == "tcpc: interrupted\n"


@pytest.mark.parametrize("spec, message", [
    ("lower-topk{strategy=rank", "'{' is never closed at column 11"),
    ("lower-topk,,lower-math", "a pass name is missing"),
    ("lower-topk{strategy=rank strategy=rounds}", "option 'strategy' is given twice"),
])
def test_tcpc_opt_pipeline_slips(spec: str, message: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty.mlir"
    empty.write_text("builtin.module {}\n")
    done = subprocess.run([sys.executable, "-m", "tcpc.opt", str(empty), "-p", spec], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"tcpc-opt: error: pipeline '{spec}': {message}" + done.stderr.split(message, 1)[1]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, message", [
    (("{tmp}/nope.mlir",), "{tmp}/nope.mlir: no such file or directory"),
    (("{tmp}",), "{tmp}: is a directory"),
    (("{empty}", "-o", "{tmp}/no/such/out.mlir"), "{tmp}/no/such/out.mlir: no such file or directory"),
    (("{empty}", "-o", "/dev/full"), "cannot write /dev/full: no space left on device"),
])
def test_tcpc_opt_files(argv: tuple[str, ...], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tcpc.opt import main as opt_main

    empty = tmp_path / "empty.mlir"
    empty.write_text("builtin.module {}\n")
    names = {"tmp": str(tmp_path), "empty": str(empty)}
    with pytest.raises(SystemExit) as exit:
        opt_main([a.format(**names) for a in argv])
    assert exit.value.code == 1
    assert capsys.readouterr().err == f"tcpc-opt: error: {message.format(**names)}\n"


def test_tcpc_opt_reads_a_byte_order_mark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tcpc.opt import main as opt_main

    path = tmp_path / "bom.mlir"
    path.write_text("\ufeffbuiltin.module {}\n", encoding="utf-8")
    opt_main([str(path)])
    assert capsys.readouterr().out == "builtin.module {\n}\n\n"


def test_tcpc_opt_full_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tcpc.opt import main as opt_main

    empty = tmp_path / "empty.mlir"
    empty.write_text("builtin.module {}\n")
    with open("/dev/full", "w") as full, pytest.raises(SystemExit) as exit:
        monkeypatch.setattr(sys, "stdout", full)
        opt_main([str(empty)])
    assert exit.value.code == 1
    assert capsys.readouterr().err == "tcpc-opt: error: cannot write the standard output: no space left on device\n"
