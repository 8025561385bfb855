"""The `tcpc` and `tcpc-opt` commands (docs/command-line.md).

Most checks call `tcpc.cli.main` in process; a few run the installed commands to show exit
status and the absence of tracebacks end to end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16
from xdsl.parser import Parser
from xdsl.utils.exceptions import VerifyException

import tcpc
from dialects.moe import max_blocks
from tcpc.cli import main
from tcpc.opt import TcpcOptMain
from tcpc.pipelines import make_context
from support import tcpc_main

BIN = Path(sys.executable).parent
EXAMPLE = Path(__file__).parent.parent / "examples" / "mixtral.moe"

ECHO = """\
# Returns its inputs, to see exactly what `run` fed in.
dims N = 3
graph echo(a: f32[2, N], b: bf16[N], c: i32[2]) -> (f32[2, N], bf16[N], i32[2]) {
    return a, b, c
}
graph twice(a: f32[N]) -> f32[N] {
    return a * 2
}
"""


@pytest.fixture
def echo(tmp_path: Path) -> Path:
    path = tmp_path / "echo.moe"
    path.write_text(ECHO)
    return path



def failure(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 1) -> str:
    """Run a command that must fail cleanly (status 1; usage errors 2); its one-line error."""
    code, out, err = tcpc_main(capsys, *argv)
    assert code == status, (out, err)
    assert "Traceback" not in err and "internal error" not in err
    assert err.startswith(("tcpc: error", f"{argv[1]}: error: ", f"{argv[1]}:")), err
    return err


def opt(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """tcpc-opt's output, without the blank line it ends with."""
    TcpcOptMain(args=[str(a) for a in argv]).run()
    return capsys.readouterr().out.rstrip("\n") + "\n"


# --- tcpc compile ----------------------------------------------------------------------------


def test_compile_prints_graph_ir(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = tcpc_main(capsys, "compile", EXAMPLE, "--set", "B=4")
    assert code == 0 and err == ""
    assert out.startswith("builtin.module attributes {dlti.target_system_spec = #dlti.target_system_spec<\"tcp\" = #dlti.target_device_spec<\"name\" = \"rngd\", ") and "func.func @mixtral(%x: tensor<16x64xbf16>" in out
    assert "moe.scatter" in out and "!moe.route<T = 16, K = 2, E = 8, B = 4, G = 14>" in out
    code, same, _ = tcpc_main(capsys, "compile", EXAMPLE, "--set", "B=4", "--emit", "graph")
    assert code == 0 and same == out
    assert out == tcpc.compile_file(EXAMPLE, {"B": 4}).graph_ir()


def test_compile_prints_the_examples_block_choice_first(capsys: pytest.CaptureFixture[str]) -> None:
    """The example leaves B to the compiler (`B = auto`): the choice, an MLIR comment, then the IR."""
    code, out, err = tcpc_main(capsys, "compile", EXAMPLE)
    program = tcpc.compile_file(EXAMPLE)
    (choice,) = program.choices
    assert code == 0 and err == ""
    assert out == f"// chose {choice.describe()}\n" + program.graph_ir()
    assert "mixtral.moe:9:52 (block=auto)" in out and f"B = {choice.chosen}, G = " in out


def test_compile_set_overrides_dims(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = tcpc_main(capsys, "compile", EXAMPLE, "--set", "T=32", "--set", "E=16", "--set", "K=4", "--set", "B=4")
    assert code == 0
    assert "%x: tensor<32x64xbf16>" in out and "tensor<16x64x128xbf16>" in out
    assert f"!moe.route<T = 32, K = 4, E = 16, B = 4, G = {max_blocks(32, 4, 16, 4)}>" in out


def test_compile_output_file_and_generic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "out.mlir"
    code, out, err = tcpc_main(capsys, "compile", EXAMPLE, "--generic", "-o", out_path)
    assert code == 0 and out == "" and err == ""
    text = out_path.read_text()
    choice, ir = text.split("\n", 1)
    assert choice.startswith("// chose block ") and ir.startswith('"builtin.module"()') and '"moe.topk"' in text
    module = Parser(make_context(), text).parse_module()  # the choice is a comment
    module.verify()
    assert module.is_structurally_equivalent(tcpc.compile_file(EXAMPLE).module)


@pytest.mark.parametrize("generic", [False, True])
def test_tcpc_opt_parses_and_verifies_compile_output(
    generic: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mixtral.mlir"
    assert main(["compile", str(EXAMPLE), "-o", str(path), *(["--generic"] if generic else [])]) == 0
    custom = tcpc.compile_file(EXAMPLE).graph_ir()
    assert opt(capsys, path) == custom
    # and the generic form tcpc-opt prints parses back to the same IR
    generic_path = tmp_path / "generic.mlir"
    generic_path.write_text(opt(capsys, path, "--print-op-generic"))
    assert opt(capsys, generic_path) == custom


def test_tcpc_opt_rejects_invalid_ir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.mlir"
    text = tcpc.compile_file(EXAMPLE, {"B": 4}).graph_ir().replace("K = 2, E = 8, B = 4, G = 14", "K = 2, E = 8, B = 4, G = 13")
    path.write_text(text)
    with pytest.raises(VerifyException, match="G = 13, but the worst case for this routing is 14"):
        opt(capsys, path)


def test_compile_and_opt_end_to_end(tmp_path: Path) -> None:
    """The installed commands: tcpc compile | tcpc-opt (custom and generic)."""
    for extra in ([], ["--generic"]):
        compiled = subprocess.run([BIN / "tcpc", "compile", EXAMPLE, "--set", "T=8", "--set", "B=4", *extra],
                                  capture_output=True, text=True, check=True)
        opted = subprocess.run([BIN / "tcpc-opt"], input=compiled.stdout, capture_output=True, text=True)
        assert opted.returncode == 0, opted.stderr
        assert opted.stdout.rstrip("\n") + "\n" == tcpc.compile_file(EXAMPLE, dims={"T": 8, "B": 4}).graph_ir()


def test_emit_lowered_and_unknown_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = tcpc_main(capsys, "compile", EXAMPLE, "--set", "T=4", "--set", "B=4", "--emit", "lowered")
    assert code == 0 and "tcp.contract" in out and "tmath." not in out and "moe." not in out, err
    assert "nosuchpass" in failure(capsys, "compile", EXAMPLE, "-p", "nosuchpass")


def test_compile_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert failure(capsys, "compile", tmp_path / "nope.moe") == f"tcpc: error: {tmp_path / 'nope.moe'}: no such file or directory\n"
    assert "is a directory" in failure(capsys, "compile", tmp_path)
    binary = tmp_path / "binary.moe"
    binary.write_bytes(b"graph \xff")
    assert failure(capsys, "compile", binary) == f"{binary}: error: not a UTF-8 text file (byte 6 is b'\\xff')\n"
    assert "no such file or directory" in failure(capsys, "compile", EXAMPLE, "-o", tmp_path / "no" / "dir.mlir")
    assert "--set T=x: 'x' is neither an integer nor auto" in failure(capsys, "compile", EXAMPLE, "--set", "T=x")


# --- tcpc run --reference --------------------------------------------------------------------


def run_out(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str, name: str = "out.npz") -> dict[str, np.ndarray]:
    out_path = tmp_path / name
    code, out, err = tcpc_main(capsys, "run", *argv, "--reference", "--out", out_path)
    assert code == 0, err
    assert f"wrote {out_path}" in out
    with np.load(out_path) as data:  # plain numpy, no ml_dtypes needed
        return {k: data[k] for k in data.files}


def test_run_reference_prints_and_writes_outputs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = tcpc_main(capsys, "run", EXAMPLE, "--reference", "--set", "T=4", "--seed", "7")
    assert code == 0 and err == ""
    assert out.startswith(f"graph mixtral from {EXAMPLE}, reference (graph-level IR), seed 7\n")
    assert "out0 bf16[4, 64]: [4, 64] bfloat16" in out
    outputs = run_out(capsys, tmp_path, EXAMPLE, "--set", "T=4", "--seed", "7")
    assert list(outputs) == ["out0"]
    assert outputs["out0"].dtype == np.float32 and outputs["out0"].shape == (4, 64)
    want = tcpc.compile_file(EXAMPLE, dims={"T": 4}).run(seed=7).outputs[0]
    np.testing.assert_array_equal(outputs["out0"], want.astype(np.float32))


def test_run_outputs_in_return_order_with_portable_dtypes(echo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    outputs = run_out(capsys, tmp_path, echo)
    assert list(outputs) == ["out0", "out1", "out2"]
    assert [(v.dtype, v.shape) for v in outputs.values()] == [
        (np.float32, (2, 3)), (np.float32, (3,)), (np.int32, (2,))
    ]
    # bf16 is written as f32 exactly: converting back to bf16 loses nothing.
    b = outputs["out1"]
    np.testing.assert_array_equal(b.astype(bfloat16).astype(np.float32), b)


def test_run_seed_determinism_and_independent_inputs(echo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    first = run_out(capsys, tmp_path, echo, "--seed", "5", name="1.npz")
    again = run_out(capsys, tmp_path, echo, "--seed", "5", name="2.npz")
    other = run_out(capsys, tmp_path, echo, "--seed", "6", name="3.npz")
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    assert not np.array_equal(first["out0"], other["out0"])
    # Giving one input does not change the inputs drawn for the others.
    given = tmp_path / "b.npz"
    b = np.array([1.0, 2.5, 1.0 + 2.0**-9], dtype=np.float64)  # the last rounds to 1.0 in bf16
    np.savez(given, b=b)
    partial = run_out(capsys, tmp_path, echo, "--seed", "5", "--inputs", given, name="4.npz")
    np.testing.assert_array_equal(partial["out0"], first["out0"])
    np.testing.assert_array_equal(partial["out2"], first["out2"])
    np.testing.assert_array_equal(partial["out1"], [1.0, 2.5, 1.0])


def test_run_inputs_by_name(echo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    b = np.array([0.1, -2.0, 3e38], dtype=np.float32).astype(bfloat16)
    c = np.array([-5, 2**31 - 1], dtype=np.int64)  # any integer array within the i32 range
    path = tmp_path / "in.npz"
    np.savez(path, a=a, b=b, c=c)
    with np.load(path) as data:
        assert data["b"].dtype == np.dtype("|V2")  # raw bf16, as numpy writes ml_dtypes arrays
    outputs = run_out(capsys, tmp_path, echo, "--inputs", path)
    np.testing.assert_array_equal(outputs["out0"], a)
    np.testing.assert_array_equal(outputs["out1"], b.astype(np.float32))
    np.testing.assert_array_equal(outputs["out2"], c.astype(np.int32))


def test_run_graph_selection(echo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    np.savez(path, a=np.array([1.0, -2.0, 0.5], dtype=np.float32))
    code, out, _ = tcpc_main(capsys, "run", echo, "--reference", "--graph", "twice", "--inputs", path)
    assert code == 0 and out.startswith(f"graph twice from {echo}")
    outputs = run_out(capsys, tmp_path, echo, "--graph", "twice", "--inputs", path)
    np.testing.assert_array_equal(outputs["out0"], [2.0, -4.0, 1.0])
    assert failure(capsys, "run", echo, "--reference", "--graph", "thrice") == (
        f"{echo}: error: no graph named 'thrice' (graphs: echo, twice)\n"
    )


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"zz": np.zeros(2)}, "'zz' is not an argument of graph 'echo' (arguments: a, b, c)"),
        ({"a": np.zeros((3, 2))}, "input 'a' has shape [3, 2], the graph declares f32[2, 3]"),
        ({"b": np.zeros(4)}, "input 'b' has shape [4], the graph declares bf16[3]"),
        ({"c": np.zeros(2)}, "input 'c' is float64, the graph declares i32[2] (integers)"),
        ({"c": np.array([2**31, 0])}, "input 'c' has values outside the i32 range"),
        ({"a": np.zeros((2, 3), dtype=np.complex64)}, "input 'a' is complex64, the graph declares f32[2, 3]"),
        ({"a": np.zeros((2, 3), dtype=bool)}, "input 'a' is bool, the graph declares f32[2, 3]"),
    ],
)
def test_run_bad_inputs(arrays: dict[str, np.ndarray], message: str, echo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    assert failure(capsys, "run", echo, "--reference", "--inputs", path) == f"tcpc: error: {path}: {message}\n"


def test_run_unreadable_inputs(echo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.npz"
    assert failure(capsys, "run", echo, "--reference", "--inputs", missing) == f"tcpc: error: {missing}: no such file or directory\n"
    text = tmp_path / "text.npz"
    text.write_text("not numpy")
    assert failure(capsys, "run", echo, "--reference", "--inputs", text) == f"tcpc: error: {text}: not an .npz or .npy file\n"
    npy = tmp_path / "a.npy"
    np.save(npy, np.zeros((2, 3)))
    assert "an .npy file holds one unnamed array" in failure(capsys, "run", echo, "--reference", "--inputs", npy)
    assert "the seed must be a non-negative integer, got -1" in failure(capsys, "run", echo, "--reference", "--seed", "-1")


def test_run_time_error_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Drawn expert indices lie in [0, 4); with E = 2 scatter meets one outside [0, E)."""
    path = tmp_path / "route.moe"
    path.write_text(
        "graph route(x: f32[4, 2], e: i32[4, 1]) -> f32[4, 2] {\n"
        "    xb, r = scatter(x, e, experts=2, block=1)\n"
        "    return combine(xb, r)\n"
        "}\n"
    )
    err = failure(capsys, "run", path, "--reference", "--seed", "1")
    assert err.startswith("tcpc: error while running: ") and "outside [0, 2)" in err


def test_run_without_reference(capsys: pytest.CaptureFixture[str]) -> None:
    """`tcpc run` without --reference lowers the program and simulates it."""
    code, out, err = tcpc_main(capsys, "run", EXAMPLE, "--set", "T=4")
    assert code == 0 and "out0 bf16[4, 64]" in out, err


# --- end to end: exit status and no traceback --------------------------------------------------


def test_run_end_to_end(echo: Path, tmp_path: Path) -> None:
    out_path = tmp_path / "out.npz"
    p = subprocess.run([BIN / "tcpc", "run", echo, "--reference", "--seed", "3", "--out", out_path],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    with np.load(out_path) as data:
        assert data.files == ["out0", "out1", "out2"]
        np.testing.assert_array_equal(data["out2"], tcpc.compile_source(ECHO).run(seed=3).outputs[2])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compile", "missing.moe"], "tcpc: error: missing.moe: no such file or directory"),
        (["run", "{echo}", "--reference", "--graph", "nope"], "error: no graph named 'nope'"),
        (["run", "{echo}", "--reference", "--inputs", "{bad}"], "bad.npz: input 'c' is float64"),
    ],
)
def test_errors_end_to_end(argv: list[str], message: str, echo: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, c=np.zeros(2))
    argv = [a.format(echo=echo, bad=bad) for a in argv]
    p = subprocess.run([sys.executable, "-m", "tcpc.cli", *argv], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 1
    assert message in p.stderr and "Traceback" not in p.stderr


def test_tcpc_opt_reports_bad_ir_without_a_traceback(tmp_path: Path) -> None:
    """A parse error, an attribute that fails verification, and a pass run out of order."""
    opt = Path(sys.executable).parent / "tcpc-opt"
    cases = {
        "bad_type.mlir": ("func.func @f(%x: tensor<2xf32>) -> tensor<2xf32> {\n"
                          "  %y = tmath.add %x, %x : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xbf16>\n"
                          "  func.return %y : tensor<2xf32>\n}\n", "bad_type.mlir:3:"),
        "bad_route.mlir": ("func.func @f(%x: tensor<16x64xbf16>, %i: tensor<16x2xi32>) {\n"
                           "  %xb, %r = moe.scatter %x, %i : tensor<16x64xbf16>, tensor<16x2xi32> -> "
                           "tensor<11x4x64xbf16>, !moe.route<T = 16, K = 2, E = 8, B = 4, G = 11>\n"
                           "  func.return\n}\n", "G = 11, but the worst case for this routing is 14"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        p = subprocess.run([str(opt), str(path)], capture_output=True, text=True)
        assert p.returncode == 1 and "Traceback" not in p.stderr
        assert p.stderr.startswith("tcpc-opt: error: ") and message in p.stderr
    ir = subprocess.run([str(Path(sys.executable).parent / "tcpc"), "compile", str(EXAMPLE.parent / "toy.moe")],
                        capture_output=True, text=True, check=True).stdout
    p = subprocess.run([str(opt), "-p", "lower-dispatch"], input=ir, capture_output=True, text=True)
    assert p.returncode == 1 and "run lower-routing first" in p.stderr and "Traceback" not in p.stderr
