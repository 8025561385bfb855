"""The .moe frontend: every syntactic form, the type and shape rules, every builtin's result,
and the custom/generic IR round trips (docs/language.md, docs/architecture.md#dialects)."""

from __future__ import annotations

import io
import math
import textwrap

import numpy as np
import pytest
from ml_dtypes import bfloat16
from xdsl.dialects import func
from xdsl.ir import Operation
from xdsl.parser import Parser
from xdsl.printer import Printer

import tcpc
from dialects import moe, tmath
from dialects.moe import MoE
from dialects.tensor_types import format_type
from dialects.tmath import TMath
from runtime_sim.semantics.executor import run_function
from tcpc import syntax as ast
from tcpc.parser import parse
from tcpc.pipelines import make_context

PARAMS = (
    "x: f32[4, 8], h: bf16[4, 8], n: i32[4, 8], row: f32[8], col: f32[4, 1], "
    "idx: i32[4, 2], w: f32[8, 3], b3: f32[2, 4, 8], wb: f32[2, 8, 3]"
)
DIMS = "dims T = 4, D = 8, E = 8, K = 2, G = E / 2"


def compile_graph(body: str, result: str, params: str = PARAMS, dims: str = DIMS) -> tcpc.Program:
    """One graph `g` whose body is `body` (or `return body` for an expression); compiling proves
    the returned value has the declared result type."""
    if "return" not in body:
        body = f"return {body}"
    return tcpc.compile_source(f"{dims}\ngraph g({params}) -> {result} {{\n{body}\n}}\n")


def body_ops(program: tcpc.Program, graph: str | None = None) -> list[Operation]:
    return list(program.function(graph).body.block.ops)


def names(program: tcpc.Program) -> list[str]:
    return [op.name for op in body_ops(program)]


def returned_op(program: tcpc.Program) -> Operation:
    ret = body_ops(program)[-1]
    assert isinstance(ret, func.ReturnOp)
    return ret.operands[0].owner


def expr(text: str, result: str, op_name: str, **kw) -> Operation:
    program = compile_graph(text, result, **kw)
    op = returned_op(program)
    assert op.name == op_name
    assert format_type(op.results[0].type) == result
    return op


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((4, 8)).astype(np.float32),
        "row": rng.standard_normal(8).astype(np.float32),
        "col": rng.standard_normal((4, 1)).astype(np.float32),
        "n": rng.integers(-5, 5, (4, 8)).astype(np.int32),
        "idx": rng.integers(0, 8, (4, 2)).astype(np.int32),
        "w": rng.standard_normal((8, 3)).astype(np.float32),
        "b3": rng.standard_normal((2, 4, 8)).astype(np.float32),
        "wb": rng.standard_normal((2, 8, 3)).astype(np.float32),
    }


def run(program: tcpc.Program, given: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    return program.run(inputs() if given is None else given).outputs


# --- parsing ------------------------------------------------------------------------------


def test_parse_ast_keeps_locations_and_forms() -> None:
    program = parse(
        textwrap.dedent(
            """\
            # a comment line
            dims T = 4, G = T / 2  # trailing comment
            graph g(x: f32[T, 8]) -> (f32[T, 8], i32[T, 2]) {
                v, i = topk(-x, 2, order="index")   # keyword with a string
                return x * 2.5e0, i
            }
            """
        )
    )
    assert [d.name for d in program.dims] == ["T", "G"]
    assert program.dims[1].value == ast.Binary(ast.Loc(2, 19), "/", ast.Name(ast.Loc(2, 17), "T"), ast.Number(ast.Loc(2, 21), 2))
    (g,) = program.graphs
    assert g.name == "g" and g.loc == ast.Loc(3, 7)
    assert [p.name for p in g.params] == ["x"]
    assert [r.dtype for r in g.results] == ["f32", "i32"]
    assign, ret = g.body
    assert [t.id for t in assign.targets] == ["v", "i"]
    call = assign.value
    assert isinstance(call, ast.Call) and call.func == "topk" and call.loc == ast.Loc(4, 12)
    assert isinstance(call.args[0], ast.Neg) and call.args[1] == ast.Number(ast.Loc(4, 21), 2)
    (kw,) = call.keywords
    assert kw.name == "order" and kw.value == ast.String(ast.Loc(4, 30), "index") and kw.loc == ast.Loc(4, 24)
    product = ret.values[0]
    assert isinstance(product, ast.Binary) and product.loc == ast.Loc(5, 14)
    assert product.rhs == ast.Number(ast.Loc(5, 16), 2.5)


def test_precedence_and_associativity() -> None:
    (d,) = parse("dims A = 2 + 3 * 4 - -1").dims
    assert isinstance(d.value, ast.Binary) and d.value.op == "-"
    program = tcpc.compile_source(
        "dims A = 2 + 3 * 4 - -1, B = 20 / 2 / 5, C = (2 + 3) * 4, M = 2 * -3 + 10\n"
        "graph g(x: f32[A]) -> f32[A] { return x }"
    )
    assert program.dims == {"A": 15, "B": 2, "C": 20, "M": 4}


def test_newlines_are_not_significant() -> None:
    program = tcpc.compile_source(
        "dims T = 4,\n  D = 8\ngraph g(\n x: f32[T,\n D]\n) -> f32[T, D] { y = x\n * 2 return\n y }"
    )
    assert names(program) == ["tmath.constant", "tmath.mul", "func.return"]


def test_a_byte_order_mark_is_not_part_of_the_program() -> None:
    """Editors may write one at the start of a UTF-8 file; columns on line 1 do not count it."""
    program = tcpc.compile_source("\ufeffdims T = 4\ngraph g(x: f32[T]) -> f32[T] { return x }")
    assert program.dims == {"T": 4}
    with pytest.raises(tcpc.CompileError) as error:
        tcpc.compile_source("\ufeffdims T = 4,,")
    loc = error.value.loc
    assert loc is not None and (loc.line, loc.col) == (1, 12)


def test_names_may_start_with_keywords() -> None:
    program = compile_graph("returned = x\ndimsx = x\ngraphs = x\nf32x = x\nreturn returned + dimsx + graphs + f32x", "f32[4, 8]")
    assert names(program) == ["tmath.add"] * 3 + ["func.return"]


def test_scalar_tensors() -> None:
    program = compile_graph("return x", "f32[]", params="x: f32[]", dims="")
    assert program.function().function_type.inputs.data[0] == program.function().function_type.outputs.data[0]


# --- dims ----------------------------------------------------------------------------------


def test_dims_are_expressions_of_earlier_dims() -> None:
    program = tcpc.compile_source(
        "dims E = 16, G = E / 4, H = G * 2 + 1, M = min(E, 4), N = max(G, 7), P = (E - 2) / 7\n"
        "dims Q = M * N\n"
        "graph g(x: f32[E, G]) -> f32[G, E] { return reshape(x, [G, E / G * G]) }"
    )
    assert program.dims == {"E": 16, "G": 4, "H": 9, "M": 4, "N": 7, "P": 2, "Q": 28}


def test_dim_overrides_and_dependent_dims_follow() -> None:
    text = "dims T = 16, E = 8, G = E / 4, C = T * 2\ngraph g(x: f32[T, G]) -> f32[T, G] { return x }"
    program = tcpc.compile_source(text, dims={"E": 32, "T": 3})
    assert program.dims == {"T": 3, "E": 32, "G": 8, "C": 6}
    assert format_type(program.function().function_type.inputs.data[0]) == "f32[3, 8]"
    assert tcpc.compile_source(text).dims == {"T": 16, "E": 8, "G": 2, "C": 32}
    # An override replaces the definition, even one that depends on other dims.
    assert tcpc.compile_source(text, dims={"G": 5}).dims["G"] == 5


def test_dims_in_types_and_builtins() -> None:
    program = compile_graph("reshape(x, [T, G, E / G])", "f32[4, 4, 2]")
    assert names(program) == ["tmath.reshape", "func.return"]
    expr("reshape(x, [min(T, 2), max(T, 16)])", "f32[2, 16]", "tmath.reshape")
    expr("reshape(x, [T * D])", "f32[32]", "tmath.reshape")


def test_static_values_can_be_named() -> None:
    program = compile_graph("half = T / 2\nreturn reshape(x, [half, 2 * D])", "f32[2, 16]")
    assert names(program) == ["tmath.reshape", "func.return"]


# --- graphs and statements ----------------------------------------------------------------


def test_multiple_graphs() -> None:
    program = tcpc.compile_source(
        "dims T = 4\n"
        "graph first(x: f32[T]) -> f32[T] { return exp(x) }\n"
        "dims D = 2\n"
        "graph second(x: bf16[T, D]) -> bf16[T, D] { return -x }\n"
    )
    assert program.graph_names == ["first", "second"]
    assert [op.name for op in body_ops(program, "second")] == ["tmath.neg", "func.return"]
    assert program.function().sym_name.data == "first"
    out = program.run({"x": np.array([[1.0, -2], [3, 4], [0, 0], [5, 6]])}, graph="second").outputs[0]
    np.testing.assert_array_equal(out.astype(np.float32), [[-1, 2], [-3, -4], [0, 0], [-5, -6]])


def test_multiple_results_unpacking_and_discard() -> None:
    program = compile_graph(
        "v, i = topk(x, K)\n_, j = topk(x, 3)\na, _ = topk(x, 1)\nreturn v, i",
        "(f32[4, 2], i32[4, 2])",
    )
    fn = program.function()
    assert [format_type(t) for t in fn.function_type.outputs.data] == ["f32[4, 2]", "i32[4, 2]"]
    assert names(program) == ["moe.topk"] * 3 + ["func.return"]
    v, i = run(program)
    x = inputs()["x"]
    want = np.argsort(-x, axis=-1, kind="stable")[:, :2]
    np.testing.assert_array_equal(i, want)
    np.testing.assert_array_equal(v, np.take_along_axis(x, want, axis=-1))


def test_names_can_be_rebound_and_get_name_hints() -> None:
    program = compile_graph("y = exp(x)\ny = y + x\nreturn y", "f32[4, 8]")
    hints = [op.results[0].name_hint for op in body_ops(program)[:-1]]
    assert hints == ["y", "y"]


# --- arithmetic, broadcasting, types ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "result", "op_name"),
    [
        ("x + x", "f32[4, 8]", "tmath.add"),
        ("x - row", "f32[4, 8]", "tmath.sub"),
        ("col * row", "f32[4, 8]", "tmath.mul"),
        ("x / col", "f32[4, 8]", "tmath.div"),
        ("h + h", "bf16[4, 8]", "tmath.add"),
        ("h * x", "f32[4, 8]", "tmath.mul"),  # bf16 with f32 gives f32
        ("row - h", "f32[4, 8]", "tmath.sub"),
        ("n + n", "i32[4, 8]", "tmath.add"),
        ("n * 3", "i32[4, 8]", "tmath.mul"),
        ("h * 2", "bf16[4, 8]", "tmath.mul"),  # a scalar literal takes the tensor's type
        ("0.5 - x", "f32[4, 8]", "tmath.sub"),
        ("x / T", "f32[4, 8]", "tmath.div"),
        ("-x", "f32[4, 8]", "tmath.neg"),
        ("-n", "i32[4, 8]", "tmath.neg"),
        ("x * -1", "f32[4, 8]", "tmath.mul"),
        ("x @ w", "f32[4, 3]", "tmath.matmul"),
        ("b3 @ w", "f32[2, 4, 3]", "tmath.matmul"),
        ("b3 @ wb", "f32[2, 4, 3]", "tmath.matmul"),
        ("h @ w", "f32[4, 3]", "tmath.matmul"),
        ("f32(h)", "f32[4, 8]", "tmath.cast"),
        ("bf16(x)", "bf16[4, 8]", "tmath.cast"),
        ("i32(x)", "i32[4, 8]", "tmath.cast"),
        ("f32(n)", "f32[4, 8]", "tmath.cast"),
        ("i32(x > 0)", "i32[4, 8]", "tmath.cast"),
        ("f32(x == row)", "f32[4, 8]", "tmath.cast"),
    ],
)
def test_binary_unary_and_conversions(text: str, result: str, op_name: str) -> None:
    expr(text, result, op_name)


def test_scalar_literal_becomes_constant_of_tensor_type() -> None:
    program = compile_graph("h * 2", "bf16[4, 8]")
    const = body_ops(program)[0]
    assert isinstance(const, tmath.ConstantOp)
    assert format_type(const.result.type) == "bf16[]" and const.value.value.data == 2.0
    program = compile_graph("maximum(x, -inf)", "f32[4, 8]")
    assert body_ops(program)[0].value.value.data == -math.inf
    program = compile_graph("minimum(x, inf)", "f32[4, 8]")
    assert body_ops(program)[0].value.value.data == math.inf


def test_static_arithmetic_folds() -> None:
    program = compile_graph("x * (T * 2 - 1) / (-D)", "f32[4, 8]")
    constants = [op.value.value.data for op in body_ops(program) if isinstance(op, tmath.ConstantOp)]
    assert constants == [7.0, -8.0]


@pytest.mark.parametrize(
    ("op", "predicate"), [("==", "eq"), ("!=", "ne"), ("<", "lt"), ("<=", "le"), (">", "gt"), (">=", "ge")]
)
def test_comparisons(op: str, predicate: str) -> None:
    program = compile_graph(f"where(x {op} col, x, 0)", "f32[4, 8]")
    cmp = next(o for o in body_ops(program) if isinstance(o, tmath.CmpOp))
    assert cmp.predicate.data == predicate and format_type(cmp.result.type) == "bool[4, 8]"
    x, c = inputs()["x"], inputs()["col"]
    numpy_op = {"==": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal,
                ">": np.greater, ">=": np.greater_equal}[op]
    np.testing.assert_array_equal(run(program)[0], np.where(numpy_op(x, c), x, 0))


def test_static_comparisons_and_booleans_fold() -> None:
    program = compile_graph("sum(x, axis=1, keepdims=T == 4)", "f32[4, 1]")
    assert names(program) == ["tmath.reduce_sum", "func.return"]
    expr("sum(x, axis=1, keepdims=false)", "f32[4]", "tmath.reduce_sum")
    expr("sum(x, axis=1, keepdims=true)", "f32[4, 1]", "tmath.reduce_sum")


def test_broadcasting_executes_like_numpy() -> None:
    program = compile_graph("return col * row + x, h * 2, n - 1", "(f32[4, 8], bf16[4, 8], i32[4, 8])")
    given = inputs()
    given["h"] = given["x"]  # rounded to bf16 on the way in
    a, b, c = run(program, given)
    np.testing.assert_allclose(a, given["col"] * given["row"] + given["x"], rtol=1e-6)
    h = given["x"].astype(bfloat16)
    np.testing.assert_array_equal(b, (h.astype(np.float32) * 2).astype(bfloat16))
    np.testing.assert_array_equal(c, given["n"] - 1)


def test_batched_matmul_executes_like_numpy() -> None:
    program = compile_graph("return b3 @ wb, b3 @ w", "(f32[2, 4, 3], f32[2, 4, 3])")
    a, b = run(program)
    given = inputs()
    np.testing.assert_allclose(a, given["b3"] @ given["wb"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, given["b3"] @ given["w"], rtol=1e-5, atol=1e-6)


# --- builtins --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sigmoid", "silu", "exp", "log", "sqrt", "tanh", "abs"])
def test_unary_builtins(name: str) -> None:
    expr(f"{name}(x)", "f32[4, 8]", f"tmath.{name}")
    expr(f"{name}(h)", "bf16[4, 8]", f"tmath.{name}")


def test_unary_builtins_execute() -> None:
    program = compile_graph(
        "return sigmoid(x), silu(x), exp(x), log(abs(x)), sqrt(abs(x)), tanh(x)", f"({', '.join(['f32[4, 8]'] * 6)})"
    )
    x = inputs()["x"].astype(np.float64)
    sig = 1 / (1 + np.exp(-x))
    for got, want in zip(run(program), [sig, x * sig, np.exp(x), np.log(np.abs(x)), np.sqrt(np.abs(x)), np.tanh(x)]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_abs_of_integers() -> None:
    program = compile_graph("abs(n)", "i32[4, 8]")
    np.testing.assert_array_equal(run(program)[0], np.abs(inputs()["n"]))


def test_softmax() -> None:
    op = expr("softmax(x)", "f32[4, 8]", "tmath.softmax")
    assert op.axis.value.data == 1
    assert expr("softmax(x, axis=0)", "f32[4, 8]", "tmath.softmax").axis.value.data == 0
    assert expr("softmax(b3, -2)", "f32[2, 4, 8]", "tmath.softmax").axis.value.data == 1
    expr("softmax(h)", "bf16[4, 8]", "tmath.softmax")
    x = inputs()["x"]
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(run(compile_graph("softmax(x)", "f32[4, 8]"))[0], e / e.sum(-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize(
    ("args", "result", "axes"),
    [
        ("x", "f32[]", [0, 1]),
        ("x, axis=0", "f32[8]", [0]),
        ("x, axis=-1", "f32[4]", [1]),
        ("x, 1", "f32[4]", [1]),
        ("x, axis=-1, keepdims=true", "f32[4, 1]", [1]),
        ("x, 1, true", "f32[4, 1]", [1]),
        ("x, keepdims=true", "f32[1, 1]", [0, 1]),
        ("b3, axis=[0, -1]", "f32[4]", [0, 2]),
        ("b3, axis=[2, 0], keepdims=true", "f32[1, 4, 1]", [0, 2]),
        ("b3, axis=[]", "f32[2, 4, 8]", []),
    ],
)
@pytest.mark.parametrize("name", ["sum", "max", "min"])
def test_reductions(name: str, args: str, result: str, axes: list[int]) -> None:
    op = expr(f"{name}({args})", result, f"tmath.reduce_{name}")
    assert list(op.axis_list) == axes


def test_reductions_keep_int_and_bf16_types_and_execute() -> None:
    expr("sum(n, axis=1)", "i32[4]", "tmath.reduce_sum")
    expr("max(h, axis=0)", "bf16[8]", "tmath.reduce_max")
    program = compile_graph("return sum(b3, axis=[0, 2]), max(x, axis=0), min(n, -1, true)", "(f32[4], f32[8], i32[4, 1])")
    s, mx, mn = run(program)
    given = inputs()
    np.testing.assert_allclose(s, given["b3"].sum(axis=(0, 2)), rtol=1e-5)
    np.testing.assert_array_equal(mx, given["x"].max(axis=0))
    np.testing.assert_array_equal(mn, given["n"].min(axis=-1, keepdims=True))


def test_min_max_of_statics_fold() -> None:
    program = compile_graph("reshape(x, [min(T, 2), max(T, D, 3) * 2])", "f32[2, 16]")
    assert names(program) == ["tmath.reshape", "func.return"]
    assert tcpc.compile_source("dims T = 5, C = max(min(T, 4), 1)\ngraph g(x: f32[C]) -> f32[4] { return x }").dims["C"] == 4


def test_maximum_minimum_clamp() -> None:
    expr("maximum(x, row)", "f32[4, 8]", "tmath.maximum")
    expr("minimum(h, 0)", "bf16[4, 8]", "tmath.minimum")
    expr("maximum(n, 0)", "i32[4, 8]", "tmath.maximum")
    expr("minimum(col, h)", "f32[4, 8]", "tmath.minimum")
    program = compile_graph("clamp(x, -0.5, 0.5)", "f32[4, 8]")
    assert names(program) == ["tmath.constant", "tmath.maximum", "tmath.constant", "tmath.minimum", "func.return"]
    np.testing.assert_array_equal(run(program)[0], np.clip(inputs()["x"], -0.5, 0.5))
    program = compile_graph("clamp(x, col, inf)", "f32[4, 8]")
    np.testing.assert_array_equal(run(program)[0], np.maximum(inputs()["x"], inputs()["col"]))


def test_where() -> None:
    op = expr("where(x > 0, x, 0)", "f32[4, 8]", "tmath.select")
    assert format_type(op.cond.type) == "bool[4, 8]"
    expr("where(col > 0, row, h)", "f32[4, 8]", "tmath.select")
    expr("where(n == 1, 5, n)", "i32[4, 8]", "tmath.select")
    expr("where(row > 0, h, -inf)", "bf16[4, 8]", "tmath.select")
    program = compile_graph("where(col > row, x, -x)", "f32[4, 8]")
    given = inputs()
    np.testing.assert_array_equal(run(program)[0], np.where(given["col"] > given["row"], given["x"], -given["x"]))


def test_one_hot_and_take() -> None:
    expr("one_hot(idx, E)", "i32[4, 2, 8]", "tmath.one_hot")
    expr("one_hot(idx, depth=3)", "i32[4, 2, 3]", "tmath.one_hot")
    expr("take(x, idx)", "f32[4, 2]", "tmath.take")
    expr("take(h, indices=idx)", "bf16[4, 2]", "tmath.take")
    program = compile_graph("return one_hot(idx, E), take(x, idx)", "(i32[4, 2, 8], f32[4, 2])")
    oh, taken = run(program)
    given = inputs()
    np.testing.assert_array_equal(oh, (given["idx"][..., None] == np.arange(8)).astype(np.int32))
    np.testing.assert_array_equal(taken, np.take_along_axis(given["x"], given["idx"], axis=-1))


def test_topk() -> None:
    program = compile_graph("v, i = topk(x, K)\nreturn v, i", "(f32[4, 2], i32[4, 2])")
    op = returned_op(program)
    assert isinstance(op, moe.TopKOp) and op.k.value.data == 2 and op.order_name == "score" and op.order is None
    program = compile_graph('v, i = topk(h, k=3, order="index")\nreturn v, i', "(bf16[4, 3], i32[4, 3])")
    op = returned_op(program)
    assert op.order_name == "index"
    compile_graph("v, i = topk(n, 8)\nreturn v, i", "(i32[4, 8], i32[4, 8])")  # K = E, integer scores
    program = compile_graph('_, i = topk(x, 3, order="index")\nreturn i', "i32[4, 3]")
    x = inputs()["x"]
    np.testing.assert_array_equal(run(program)[0], np.sort(np.argsort(-x, axis=-1, kind="stable")[:, :3], axis=-1))


MOE_PARAMS = "x: bf16[T, D], e: i32[T, K], w: bf16[E, D, F], bias: f32[E, F], p: f32[T, K]"
MOE_DIMS = "dims T = 8, D = 4, F = 6, E = 4, K = 2, B = 2"


def moe_graph(body: str, result: str) -> tcpc.Program:
    return compile_graph(body, result, params=MOE_PARAMS, dims=MOE_DIMS)


def test_scatter_and_route_type() -> None:
    program = moe_graph("xb, r = scatter(x, e, experts=E, block=B)\nreturn xb", "bf16[10, 2, 4]")
    op = returned_op(program)
    assert isinstance(op, moe.ScatterOp)
    route = op.route.type
    assert (route.tokens.data, route.k.data, route.experts.data, route.block.data) == (8, 2, 4, 2)
    assert route.blocks.data == moe.max_blocks(8, 2, 4, 2) == 10 and route.capacity_limit is None
    program = moe_graph("xb, r = scatter(x, e, experts=E, block=B, capacity=3)\nreturn xb", "bf16[8, 2, 4]")
    route = returned_op(program).route.type
    assert route.capacity_limit == 3 and route.blocks.data == moe.max_blocks(8, 2, 4, 2, 3) == 8
    # Positional experts/block work too (they are ordinary parameters).
    moe_graph("xb, _ = scatter(x, e, E, B)\nreturn xb", "bf16[10, 2, 4]")


def test_grouped_matmul_and_combine() -> None:
    head = "xb, r = scatter(x, e, experts=E, block=B)\n"
    op = returned_op(moe_graph(head + "return grouped_matmul(xb, w, r)", "bf16[10, 2, 6]"))
    assert isinstance(op, moe.GroupedMatmulOp) and op.bias is None
    # The result type promotes the blocks' and weights' types; an f32 bias does not widen it.
    op = returned_op(moe_graph(head + "return grouped_matmul(xb, w, r, bias=bias)", "bf16[10, 2, 6]"))
    assert op.bias is not None
    moe_graph(head + "return grouped_matmul(f32(xb), w, r)", "f32[10, 2, 6]")
    op = returned_op(moe_graph(head + "return combine(xb, r)", "bf16[8, 4]"))
    assert isinstance(op, moe.CombineOp) and op.weights is None
    op = returned_op(moe_graph(head + "return combine(xb, r, p)", "bf16[8, 4]"))
    assert op.weights is not None
    op = returned_op(moe_graph(head + "return combine(f32(xb), route=r, weights=bf16(p))", "f32[8, 4]"))
    assert op.weights is not None


def test_moe_pipeline_executes_like_a_dense_loop() -> None:
    program = moe_graph(
        "xb, r = scatter(x, e, experts=E, block=B)\n"
        "return combine(grouped_matmul(f32(xb), w, r, bias=bias), r, p), combine(f32(xb), r)",
        "(f32[8, 6], f32[8, 4])",
    )
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    e = np.stack([rng.permutation(4)[:2] for _ in range(8)]).astype(np.int32)
    w = rng.standard_normal((4, 4, 6)).astype(np.float32)
    bias = rng.standard_normal((4, 6)).astype(np.float32)
    p = rng.random((8, 2)).astype(np.float32)
    out, plain = program.run({"x": x, "e": e, "w": w, "bias": bias, "p": p}).outputs
    xr = x.astype(bfloat16).astype(np.float32)
    wr = w.astype(bfloat16).astype(np.float32)
    want = sum(p[:, k, None] * (np.einsum("td,tdf->tf", xr, wr[e[:, k]]) + bias[e[:, k]]) for k in range(2))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(plain, 2 * xr)


def test_mixtral_example_builds() -> None:
    program = tcpc.compile_file("examples/mixtral.moe", dims={"T": 8})
    assert program.graph_names == ["mixtral"]
    assert format_type(program.function().function_type.outputs.data[0]) == "bf16[8, 64]"
    assert {op.name for op in body_ops(program)} >= {"moe.topk", "moe.scatter", "moe.grouped_matmul", "moe.combine"}


# --- IR round trips --------------------------------------------------------------------------

EVERY_OP = """\
dims T = 8, D = 4, F = 6, E = 4, K = 2, B = 2, G = 2
graph all_ops(x: bf16[T, D], s: f32[T, E], w: bf16[E, D, F], bias: f32[E, F], n: i32[T, E])
        -> (bf16[T, F], f32[T, F], f32[T, D], i32[T, K, E], f32[T, K], f32[T, G, 4], i32[T], f32[T, E]) {
    probs = softmax(s)
    top_p, top_e = topk(probs, K)
    _, top_i = topk(probs, K, order="index")
    weights = top_p / sum(top_p, axis=-1, keepdims=true)
    xb, route = scatter(x, top_e, experts=E, block=B)
    xc, route_c = scatter(x, top_i, experts=E, block=B, capacity=4)
    y = grouped_matmul(xb, w, route)
    yb = grouped_matmul(f32(xc), w, route_c, bias=bias)
    a = combine(y, route, bf16(weights))
    b = combine(yb, route_c)
    c = combine(f32(xb), route, weights) * 2 + 1 - maximum(f32(x), 0)
    d = minimum(clamp(-s, -inf, inf), exp(s)) / (sigmoid(s) + silu(s) + tanh(s))
    e = where(s >= 0, log(abs(s)) + sqrt(abs(s)), max(s, axis=0) - min(s, 1, true))
    f = reshape(f32(x) @ reshape(s, [D, T * E / D]), [T, G, T / G])
    flags = where(s != 0, n, 0) + i32(s == 0) + i32(s < 0) + i32(s <= 0) + i32(s > 0)
    return a, b, c, one_hot(top_e, E) + reshape(take(n, top_i), [T, K, 1]), take(s, top_e), f, sum(flags, axis=1), d + e
}
"""


def every_op_module():
    return tcpc.compile_source(EVERY_OP).module


def test_every_op_module_uses_every_op() -> None:
    used = {op.name for op in every_op_module().walk()}
    every = {op.name for op in TMath.operations} | {op.name for op in MoE.operations}
    # moe.route and moe.dispatch are made by lower-routing and moe.pair_rows by shard-experts,
    # never by the frontend (tests/filecheck/dialects/moe/ops.mlir round-trips them); the low-precision
    # grouped matmul has its own round trip (tests/test_quant.py).
    assert every - used == {"moe.route", "moe.dispatch", "moe.pair_rows", "moe.scaled_grouped_matmul"}
    assert every_op_module().ops.first.sym_name.data == "all_ops"


def print_module(module, generic: bool) -> str:
    out = io.StringIO()
    Printer(stream=out, print_generic_format=generic).print_op(module)
    return out.getvalue()


@pytest.mark.parametrize("first_generic", [False, True])
def test_round_trip_custom_and_generic(first_generic: bool) -> None:
    module = every_op_module()
    text = print_module(module, first_generic)
    if first_generic:
        assert '"tmath.softmax"' in text and '"moe.scatter"' in text
    else:
        assert "moe.topk %probs" in text
    parsed = Parser(make_context(), text).parse_module()
    parsed.verify()
    assert parsed.is_structurally_equivalent(module)
    # and back through the other format
    again = Parser(make_context(), print_module(parsed, not first_generic)).parse_module()
    again.verify()
    assert again.is_structurally_equivalent(module)


def test_round_tripped_module_executes_identically() -> None:
    program = tcpc.compile_source(EVERY_OP)
    module = Parser(make_context(), print_module(program.module, True)).parse_module()
    args = program.run(seed=3).inputs
    again = run_function(module, "all_ops", list(args.values()))
    for a, b in zip(program.run(seed=3).outputs, again):
        np.testing.assert_array_equal(a, b)


def test_every_op_module_executes() -> None:
    outputs = tcpc.compile_source(EVERY_OP).run(seed=1).outputs
    assert [o.shape for o in outputs] == [(8, 6), (8, 6), (8, 4), (8, 2, 4), (8, 2), (8, 2, 4), (8,), (8, 4)]


def test_arguments_are_evaluated_once() -> None:
    """max/min look at their arguments to tell max(T, 4) from a reduction: no op twice."""
    program = compile_graph("max(exp(x), 1)", "f32[4]")
    assert names(program) == ["tmath.exp", "tmath.reduce_max", "func.return"]
    program = compile_graph("min(-x, 0, true)", "f32[1, 8]")
    assert names(program) == ["tmath.neg", "tmath.reduce_min", "func.return"]


def test_long_expressions() -> None:
    program = compile_graph(" + ".join(["x"] * 1000), "f32[4, 8]")
    assert len(body_ops(program)) == 1000
    np.testing.assert_allclose(run(program)[0], 1000 * inputs()["x"], rtol=1e-4, atol=1e-2)
    with pytest.raises(tcpc.CompileError, match="nested too deeply"):
        compile_graph("-" * 30000 + "x", "f32[4, 8]")
