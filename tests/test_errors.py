"""Every error class of the language (docs/language.md#errors) through the `tcpc` command: exit status 1,
`FILE:LINE:COL: error: message`, the source line and a caret, and never a traceback.

Every case runs through `tcpc.cli.main` in process; one case of each kind also runs as a real
`tcpc compile` process (concurrently, to keep the suite fast).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tcpc.cli import main

TCPC = [sys.executable, "-m", "tcpc.cli"]

# A graph header with one tensor of each element type; the body goes on line 3.
HEAD = (
    "dims T = 4, D = 8, E = 4, K = 2\n"
    "graph g(x: f32[T, D], h: bf16[T, D], n: i32[T, D], y: f32[T, 3], w: f32[5, 2], idx: i32[T, K]) -> f32[T, D] {\n"
)


def body(*lines: str) -> str:
    """HEAD, then `lines` (line 3 onwards, indented by 4), then `return x` and `}`."""
    return HEAD + "".join(f"    {line}\n" for line in lines) + "    return x\n}\n"


@dataclass(frozen=True)
class Case:
    source: str
    line: int | None  # None: the error has no place in the file (e.g. a bad --set)
    col: int | None
    message: str
    args: tuple[str, ...] = ()


CASES: dict[str, Case] = {
    # --- syntax ---------------------------------------------------------------------------
    "unexpected-token": Case(body("a = x )"), 3, 11, "unexpected ')', expected an operator"),
    "unexpected-keyword": Case(body("a = return x"), 3, 9, "unexpected 'return', expected an expression"),
    "keyword-as-name": Case("graph graph(x: f32[4]) -> f32[4] { return x }\n", 1, 7, "unexpected 'graph', expected a name"),
    "keyword-glued-to-name": Case("graphfoo(x: f32[4]) -> f32[4] { return x }\n", 1, 1, "unexpected 'graphfoo', expected 'dims', 'graph' or end of file"),
    "type-as-name": Case(body("f32 = x"), 3, 5, "unexpected 'f32', expected 'return', '}' or a name"),
    "return-then-statement": Case(body("a = x return x"), 3, 11, "return must be the last statement"),
    "unexpected-character": Case(body("a = x $ 1"), 3, 11, "unexpected character '$'"),
    "unexpected-eof": Case(HEAD + "    return x\n", 3, 13, "unexpected end of file, expected"),
    "unexpected-eof-in-expression": Case(HEAD + "    a = x +\n\n", 3, 12, "unexpected end of file, expected an expression"),
    "unterminated-string": Case(body('v, i = topk(x, K, order="index)'), 3, 29, "unterminated string"),
    "unknown-type": Case("graph g(x: f64[4]) -> f32[4] { return x }\n", 1, 12, "unexpected 'f64', expected a type (bf16, f32, i32)"),
    "missing-keyword-value": Case(body("a = sum(x, axis=)"), 3, 21, "unexpected ')', expected an expression"),
    "missing-result-type": Case("graph g(x: f32[4]) { return x }\n", 1, 20, "unexpected '{', expected '->'"),
    "empty-file": Case("", 1, 1, "the file defines no graph"),
    "only-comments-and-dims": Case("# nothing here\ndims T = 4\n", 1, 1, "the file defines no graph"),
    "graph-without-statements": Case("graph empty(x: f32[4]) -> f32[4] {\n}\n", 1, 7, "graph 'empty' has no return statement"),
    "return-not-last": Case(HEAD + "    return x\n    a = x\n}\n", 3, 5, "return must be the last statement"),
    # --- names and functions ------------------------------------------------------------------
    "unknown-name": Case(body("a = x + z"), 3, 13, "unknown name 'z'"),
    "unknown-name-in-dims": Case("dims A = B * 2, B = 3\ngraph g(x: f32[4]) -> f32[4] { return x }\n", 1, 10, "unknown name 'B'"),
    "discard-is-not-a-value": Case(body("_ = exp(x)", "a = _"), 4, 9, "unknown name '_'"),
    "unknown-function": Case(body("a = 2 * relu(x)"), 3, 13, "unknown function 'relu'"),
    "assign-to-dim": Case(body("a, T = topk(x, 2)"), 3, 8, "'T' is a dim and cannot be assigned"),
    "assign-to-constant": Case(body("inf = x"), 3, 5, "'inf' is a constant"),
    "duplicate-graph": Case("graph g(x: f32[4]) -> f32[4] { return x }\ngraph g(x: f32[4]) -> f32[4] { return x }\n", 2, 7, "graph 'g' is defined twice"),
    "duplicate-dim": Case("dims T = 4, D = 2\ndims T = 5\ngraph g(x: f32[T]) -> f32[T] { return x }\n", 2, 6, "dim T is defined twice"),
    "duplicate-parameter": Case("graph g(x: f32[4], x: f32[4]) -> f32[4] { return x }\n", 1, 20, "parameter 'x' is declared twice"),
    "parameter-named-like-dim": Case("dims T = 4\ngraph g(T: f32[4]) -> f32[4] { return T }\n", 2, 9, "parameter 'T' has the name of a dim"),
    # --- arity and keywords --------------------------------------------------------------------
    "too-many-arguments": Case(body("a = exp(x, 1)"), 3, 9, "exp() takes 1 argument (x), got 2"),
    "too-many-with-optional": Case(body("a = sum(x, 0, true, 1)"), 3, 9, "sum() takes at most 3 arguments (x, axis, keepdims), got 4"),
    "missing-argument": Case(body("a = where(x > 0, x)"), 3, 9, "where() is missing argument 'b'"),
    "missing-required-keyword": Case(body("xb, r = scatter(x, idx, experts=E)"), 3, 13, "scatter() needs block=..."),
    "unknown-keyword": Case(body("a = sum(x, axes=0)"), 3, 16, "sum() has no argument 'axes' (it takes x, axis, keepdims)"),
    "duplicate-keyword": Case(body("a = sum(x, axis=0, axis=1)"), 3, 24, "sum() got 'axis' twice"),
    "keyword-repeats-positional": Case(body("a = sum(x, 0, axis=1)"), 3, 19, "sum() got 'axis' twice"),
    "positional-after-keyword": Case(body("a = sum(x, axis=0, true)"), 3, 24, "positional argument after a keyword argument"),
    # --- shapes and types ----------------------------------------------------------------------
    "shape-mismatch": Case(body("a = x + y"), 3, 11, "shapes [4, 8] and [4, 3] do not broadcast"),
    "shape-mismatch-in-maximum": Case(body("a = maximum(x, y)"), 3, 9, "shapes [4, 8] and [4, 3] do not broadcast"),
    "dtype-mismatch": Case(body("a = x * n"), 3, 11, "cannot mix f32[4, 8] and i32[4, 8]"),
    "dtype-mismatch-bf16-i32": Case(body("a = n - h"), 3, 11, "cannot mix i32[4, 8] and bf16[4, 8]"),
    "return-type-mismatch": Case(HEAD + "    return h\n}\n", 3, 12, "returned bf16[4, 8], but the graph declares f32[4, 8]"),
    "return-shape-mismatch": Case(HEAD + "    return y\n}\n", 3, 12, "returned f32[4, 3], but the graph declares f32[4, 8]"),
    "return-count": Case(HEAD + "    return x, x\n}\n", 3, 5, "graph 'g' declares 1 result but returns 2"),
    "unpack-too-many": Case(body("a, b = exp(x)"), 3, 5, "2 names on the left, but the right gives 1 value"),
    "unpack-too-few": Case(body("v = topk(x, K)"), 3, 5, "1 name on the left, but the right gives 2 values"),
    "multi-result-as-value": Case(body("a = topk(x, K) + 1"), 3, 9, "this call gives 2 values; unpack them"),
    "reshape-count": Case(body("a = reshape(x, [T, 3])"), 3, 9, "cannot reshape f32[4, 8] (32 elements) to [4, 3] (12 elements)"),
    "matmul-inner-dims": Case(body("a = x @ w"), 3, 11, "cannot multiply f32[4, 8] by f32[5, 2]: the inner dimensions 8 and 5 differ"),
    "matmul-rank": Case(body("a = sum(x, axis=0) @ w"), 3, 24, "'@' needs operands of rank 2 or more"),
    "where-not-boolean": Case(body("a = where(x, x, 0)"), 3, 9, "where() needs a boolean condition (a comparison), got f32[4, 8]"),
    "where-two-scalars": Case(body("a = where(x > 0, 1, 0)"), 3, 9, "where() needs a tensor for at least one branch"),
    "integer-division": Case(body("a = n / 2"), 3, 11, "integer division is not supported"),
    "arithmetic-on-booleans": Case(body("a = (x > 0) * (x > 1)"), 3, 17, "cannot do arithmetic on booleans"),
    "float-function-of-int": Case(body("a = softmax(n)"), 3, 9, "softmax() needs a float tensor, got i32[4, 8]"),
    "axis-out-of-range": Case(body("a = sum(x, axis=2)"), 3, 21, "axis 2 is out of range for rank 2"),
    "not-static": Case(body("v, i = topk(x, x)"), 3, 20, "topk k must be known at compile time"),
    "indices-not-i32": Case(body("a = take(x, y)"), 3, 17, "the indices of take must be i32, got f32[4, 3]"),
    "route-as-tensor": Case(body("xb, r = scatter(x, idx, experts=E, block=2)", "a = r * 2"), 4, 9, "the routing plan is not a tensor"),
    "topk-order": Case(body('v, i = topk(x, K, order="random")'), 3, 29, 'topk order must be one of "score", "index", got "random"'),
    # --- MoE rules -------------------------------------------------------------------------------
    "topk-k-exceeds-e": Case(body("v, i = topk(y, 4)"), 3, 20, "K = 4 exceeds the 3 candidates on the last axis of f32[4, 3]"),
    "scatter-k-exceeds-e": Case(body("xb, r = scatter(x, idx, experts=1, block=2)"), 3, 13, "K = 2 exceeds E = 1"),
    # A block that does not fit is not an error: the compiler picks one (tests/test_autotune.py).
    "block-zero": Case(body("xb, r = scatter(x, idx, experts=E, block=T - 4)"), 3, 48, "block must be a positive integer, got 0"),
    "block-auto-string": Case(body('xb, r = scatter(x, idx, experts=E, block="auto")'), 3, 46, 'block must be an integer or auto (a word, not a string), got "auto"'),
    "auto-in-expression": Case(body("xb, r = scatter(x, idx, experts=E, block=auto + 1)"), 3, 46, "'auto' is a value only scatter's block= takes"),
    # `dims B = auto` is a block left to the compiler: an error where it is used as anything else
    "auto-dim-as-size": Case("dims T = auto\ngraph g(x: f32[T]) -> f32[T] { return x }\n", 2, 16, "a dimension cannot be auto: a dim set to auto (dims NAME = auto, or --set NAME=auto) is only a scatter's block="),
    "auto-dim-in-a-dim": Case("dims T = 4, B = auto, C = B * 2\ngraph g(x: f32[T]) -> f32[T] { return x }\n", 1, 29, "cannot apply '*' to auto"),
    "auto-dim-as-experts": Case("dims T = 4, D = 8, E = auto\ngraph g(x: f32[T, D], idx: i32[T, 2]) -> f32[T, D] {\n    xb, r = scatter(x, idx, experts=E, block=E)\n    return x\n}\n", 3, 37, "experts cannot be auto"),
    "auto-as-name": Case(body("auto = x"), 3, 5, "unexpected 'auto'"),
    "combine-weights-shape": Case(body("xb, r = scatter(x, idx, experts=E, block=2)", "a = combine(xb, r, y)"), 4, 24, "combine weights must be a float [T, K] = [4, 2], got f32[4, 3]"),
    "grouped-matmul-weights-shape": Case(body("xb, r = scatter(x, idx, experts=E, block=2)", "a = grouped_matmul(xb, w, r)"), 4, 28, "grouped_matmul weights must be [E, D, F] = [4, 8, F], got f32[5, 2]"),
    # --- dims --------------------------------------------------------------------------------------
    "dim-zero": Case("dims T = 0\ngraph g(x: f32[T]) -> f32[T] { return x }\n", 1, 10, "dim T must be a positive integer, got 0"),
    "dim-negative": Case("dims T = 4, D = T - 6\ngraph g(x: f32[T]) -> f32[T] { return x }\n", 1, 19, "dim D must be a positive integer, got -2"),
    "dim-inexact-division": Case("dims E = 4, G = E / 3\ngraph g(x: f32[G]) -> f32[G] { return x }\n", 1, 19, "dim G must be an integer, but 4 / 3 does not divide exactly"),
    "dim-not-integer": Case("dims T = 2.5\ngraph g(x: f32[T]) -> f32[T] { return x }\n", 1, 10, "dim T must be an integer, got 2.5"),
    "dim-division-by-zero": Case("dims T = 4 / 0\ngraph g(x: f32[T]) -> f32[T] { return x }\n", 1, 12, "division by zero"),
    "type-dim-not-positive": Case("dims T = 4\ngraph g(x: f32[T - 4]) -> f32[T] { return x }\n", 2, 18, "a dimension must be a positive integer, got 0"),
    "reshape-dim-inexact": Case(body("a = reshape(x, [T, D / 3])"), 3, 26, "a dimension must be an integer, but 8 / 3 does not divide exactly"),
    # --- --set -------------------------------------------------------------------------------------
    "set-breaks-dependent-dim": Case("dims E = 8, G = E / 4\ngraph g(x: f32[G]) -> f32[G] { return x }\n", 1, 19, "dim G must be an integer, but 6 / 4 does not divide exactly", ("--set", "E=6")),
    "set-unknown-dim": Case(body(), None, None, "--set Q: no dim named Q (dims: T, D, E, K)", ("--set", "Q=3")),
    "set-not-integer": Case(body(), None, None, "--set T=1.5: '1.5' is neither an integer nor auto", ("--set", "T=1.5")),
    "set-not-positive": Case(body(), None, None, "--set T=0: a dim must be a positive integer", ("--set", "T=0")),
    "set-without-value": Case(body(), None, None, "--set T: expected NAME=VALUE", ("--set", "T")),
}


SUBPROCESS = [
    "unexpected-token", "unexpected-eof", "empty-file", "unknown-name", "unknown-function",
    "too-many-arguments", "unknown-keyword", "shape-mismatch", "dtype-mismatch", "topk-k-exceeds-e",
    "dim-inexact-division", "block-zero", "return-count", "set-unknown-dim", "set-not-integer",
]
"""The cases that also run as a `tcpc` process (one per kind of error; each costs ~0.3 s)."""


def check(name: str, path: Path, returncode: int, stdout: str, stderr: str) -> None:
    case = CASES[name]
    assert returncode == 1, stderr
    assert stdout == ""
    assert "Traceback" not in stderr
    lines = stderr.rstrip("\n").split("\n")
    if case.line is None:
        assert lines[0].startswith((f"{path}: error: ", "tcpc: error: ")), stderr
        assert case.message in lines[0]
        assert len(lines) == 1
        return
    head = f"{path}:{case.line}:{case.col}: error: "
    assert lines[0].startswith(head), stderr
    assert case.message in lines[0][len(head):], stderr
    assert len(lines) == 3, stderr
    assert lines[1] == case.source.split("\n")[case.line - 1]
    assert lines[2] == " " * (case.col - 1) + "^"


def write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.moe"
    path.write_text(CASES[name].source)
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_error(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In process: the same `main` as the command, so an escaping exception fails the test."""
    path = write(tmp_path, name)
    returncode = main(["compile", str(path), *CASES[name].args])
    out = capsys.readouterr()
    check(name, path, returncode, out.out, out.err)


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Run the SUBPROCESS cases concurrently, each as its own `tcpc compile`."""
    directory = tmp_path_factory.mktemp("errors")

    def run(name: str) -> tuple[str, tuple[Path, subprocess.CompletedProcess]]:
        path = write(directory, name)
        p = subprocess.run([*TCPC, "compile", str(path), *CASES[name].args], capture_output=True, text=True, timeout=60)
        return name, (path, p)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(pool.map(run, SUBPROCESS))


@pytest.mark.parametrize("name", SUBPROCESS)
def test_error_end_to_end(name: str, processes: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    path, p = processes[name]
    check(name, path, p.returncode, p.stdout, p.stderr)


def test_caret_keeps_tabs_aligned(tmp_path: Path) -> None:
    """A caret under a tab-indented line keeps the tabs, so it lines up in any terminal."""
    path = tmp_path / "tabs.moe"
    path.write_text("graph g(x: f32[4]) -> f32[4] {\n\treturn\tq\n}\n")
    p = subprocess.run([*TCPC, "compile", str(path)], capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stderr.split("\n")[:3] == [f"{path}:2:9: error: unknown name 'q'", "\treturn\tq", "\t      \t^"]


def test_crlf_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "crlf.moe"
    path.write_bytes(b"graph g(x: f32[4]) -> f32[4] {\r\n    return q\r\n}\r\n")
    p = subprocess.run([*TCPC, "compile", str(path)], capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stderr.split("\n")[:3] == [f"{path}:2:12: error: unknown name 'q'", "    return q", "           ^"]
