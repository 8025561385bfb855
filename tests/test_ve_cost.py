"""Vector-engine costs (runtime_sim/perf/ve_cost.py): every op of `ve` and `tcp` has one, and each
`ve` op costs what the book's stage table says on known shapes."""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from xdsl.irdl import irdl_op_definition
from xdsl.parser import Parser

from dialects import ve
from dialects.tcp import TCP
from dialects.ve import VE
from runtime_sim.perf import cost_model
from runtime_sim.perf.cost_model import NONE, TENSOR, cost_function, costed_op_names, is_unbuffered, is_view
from runtime_sim.perf.costs import register_cost_models
from target.machine import default_machine
from runtime_sim.perf.simulate import simulate
from runtime_sim.perf.ve_cost import VE_COSTS, register_ve_op, ve_cost_of
from tcpc.pipelines import make_context

register_cost_models()  # these tests look costs up without running the simulator

M = default_machine()
N = 80 * 256  # 80 elements per slice: 10 cycles at 8-way, 20 at 4-way
FIXED = M.config_overhead_cycles + M.alu_latency_cycles  # one invocation, one stage


def test_every_ve_and_tcp_op_has_a_cost() -> None:
    ops = sorted({cls.name for cls in [*VE.operations, *TCP.operations]})
    missing = [name for name in ops if name not in costed_op_names()]
    assert not missing, f"ops without a cost function: {', '.join(missing)}"


def test_every_ve_op_has_a_table_entry_or_family() -> None:
    assert not [cls.name for cls in VE.operations if ve_cost_of(cls) is None]
    assert set(VE_COSTS) <= {cls.name for cls in VE.operations}  # no stale entries in the table


def test_a_new_unary_float_op_is_costed_by_its_family() -> None:
    @irdl_op_definition
    class LogOp(ve.UnaryFloatOp):
        name = "ve.test_log"

    try:
        assert register_ve_op(LogOp)
        x = Parser(make_context(), f"""
        func.func @f(%x: tensor<{N}xf32>) -> tensor<{N}xf32> {{
          func.return %x : tensor<{N}xf32>
        }}""").parse_module()
        arg = next(o for o in x.walk() if o.name == "func.func").body.blocks.first.args[0]
        op = LogOp(arg)
        values = (np.zeros(N, np.float32),)
        cost = cost_function(op)(op, values, values, M)
        assert (cost.engine, cost.cycles, cost.flops) == (TENSOR, FIXED + 20, N)  # Float cluster, 4-way
    finally:
        del cost_model._COSTS["ve.test_log"]


def simulate_text(text: str, *values: np.ndarray):
    """The report of `text`'s @f, its ops without the streams of its arguments: arguments are
    in HBM, which the vector engine cannot read, so the memory plan streams each one in before
    the op that reads it (tests/test_memory_plan.py); these tests look at the op alone."""
    module = Parser(make_context(), text).parse_module()
    module.verify()
    report = simulate(module, "f", list(values)).report
    return replace(report, ops=[o for o in report.ops if not o.label.startswith("stream in ")])


I32 = f"tensor<{N}xi32>"
F32 = f"tensor<{N}xf32>"
TAG = f"tensor<{N}xi4>"


def binary(op: str, t: str) -> str:
    return (f"func.func @f(%a: {t}, %b: {t}) -> {t} {{\n"
            f"  %r = {op} %a, %b : {t}\n  func.return %r : {t}\n}}")


@pytest.mark.parametrize(
    ("op", "t", "cycles", "flops"),
    [
        ("ve.and", I32, 10, 0), ("ve.or", I32, 10, 0), ("ve.xor", I32, 10, 0),
        ("ve.shl", I32, 10, 0), ("ve.shr_u", I32, 10, 0), ("ve.shr_s", I32, 10, 0),
        ("ve.add", I32, 10, 0), ("ve.sub", I32, 10, 0), ("ve.mul", I32, 10, 0),  # Fxp, 8-way
        ("ve.add", F32, 20, N), ("ve.sub", F32, 20, N), ("ve.mul", F32, 20, N),  # Float, 4-way
        ("ve.div", F32, 20, N),  # FpDiv, 4-way
        ("ve.max", I32, 10, 0), ("ve.min", I32, 10, 0),
        ("ve.max", F32, 10, 0), ("ve.min", F32, 10, 0),  # the Clip cluster takes f32, 8-way
    ],
)
def test_binary_ops(op: str, t: str, cycles: int, flops: int) -> None:
    dtype = np.float32 if "f32" in t else np.int32
    a = np.ones(N, dtype)
    report = simulate_text(binary(op, t), a, a)
    (rec,) = report.ops
    assert (rec.name, rec.engine, rec.cycles, rec.flops) == (op, TENSOR, FIXED + cycles, flops)
    assert rec.bytes == 3 * 4 * N  # two operands read, one result written


@pytest.mark.parametrize(("op", "cycles"), [("ve.exp", 20), ("ve.sigmoid", 20)])
def test_unary_float_ops_run_4_way(op: str, cycles: int) -> None:
    text = f"func.func @f(%a: {F32}) -> {F32} {{\n  %r = {op} %a : {F32}\n  func.return %r : {F32}\n}}"
    (rec,) = simulate_text(text, np.zeros(N, np.float32)).ops
    assert (rec.cycles, rec.flops) == (FIXED + cycles, N)


@pytest.mark.parametrize(
    ("line", "arg", "value"),
    [
        (f"%r = ve.tag gt %a, %a : {I32} -> {TAG}", I32, np.zeros(N, np.int32)),
        (f"%r = ve.fxp_to_fp %a : {I32} -> {F32}", I32, np.zeros(N, np.int32)),
        (f"%r = ve.fp_to_fxp %a : {F32} -> {I32}", F32, np.zeros(N, np.float32)),
        (f"%r = ve.narrow %a : {F32} -> tensor<{N}xbf16>", F32, np.zeros(N, np.float32)),
        (f"%r = ve.widen %a : tensor<{N}xbf16> -> {F32}", f"tensor<{N}xbf16>", np.zeros(N, ml_dtypes.bfloat16)),
    ],
)
def test_tags_and_conversions_run_8_way(line: str, arg: str, value: np.ndarray) -> None:
    result = line.rsplit("-> ", 1)[1]
    text = f"func.func @f(%a: {arg}) -> {result} {{\n  {line}\n  func.return %r : {result}\n}}"
    (rec,) = simulate_text(text, value).ops
    assert (rec.engine, rec.cycles, rec.flops) == (TENSOR, FIXED + 10, 0)


def test_select_and_filter() -> None:
    text = f"""func.func @f(%a: {I32}, %b: {I32}) -> ({I32}, tensor<40xi32>) {{
      %t = ve.tag lt %a, %b : {I32} -> {TAG}
      %s = ve.select %t in [1], %a, %b : {TAG}, {I32}
      %k = ve.filter %a, %t keep [1] along 0 pad 0 : {I32}, {TAG} -> tensor<40xi32>
      func.return %s, %k : {I32}, tensor<40xi32>
    }}"""
    a = np.arange(N, dtype=np.int32)
    ops = {o.name: o for o in simulate_text(text, a, a[::-1].copy()).ops}
    assert ops["ve.select"].cycles == FIXED + 10
    assert ops["ve.filter"].cycles == FIXED + 10 + M.filter_cycles  # the Filter stage's latency
    assert ops["ve.filter"].bytes == 4 * N + N + 4 * 40  # values and tags read, 40 kept written


def test_reductions_run_4_way_and_wait_for_the_axis() -> None:
    text = """func.func @f(%a: tensor<320x64xi32>) -> tensor<320xi32> {
      %r = ve.reduce_sum %a along 1 : tensor<320x64xi32> -> tensor<320xi32>
      func.return %r : tensor<320xi32>
    }"""
    (rec,) = simulate_text(text, np.ones((320, 64), np.int32)).ops
    assert rec.cycles == FIXED + 20 + 64  # 4-way stream + first output after 64 steps
    f32 = text.replace("i32", "f32").replace("ve.reduce_sum", "ve.reduce_max")
    (rec,) = simulate_text(f32, np.ones((320, 64), np.float32)).ops
    assert (rec.cycles, rec.flops) == (FIXED + 20 + 64, 0)
    fsum = text.replace("i32", "f32")
    (rec,) = simulate_text(fsum, np.ones((320, 64), np.float32)).ops
    assert rec.flops == 320 * 63


def test_scan_is_a_time_axis_scan() -> None:
    # 2048 rows (8 per slice) of 64 steps: one round of 64 cycles; 2049 rows need two.
    for rows, rounds in ((2048, 1), (2049, 2)):
        t = f"tensor<{rows}x64xi32>"
        text = f"""func.func @f(%a: {t}) -> {t} {{
          %p = ve.position_tag along 1 first 0 middle 1 last 2 single 3 : tensor<{rows}x64xi4>
          %c = ve.scan add %a, %p along 1 read [1, 2] write [0, 1] : {t}, tensor<{rows}x64xi4>
          func.return %c : {t}
        }}"""
        report = simulate_text(text, np.ones((rows, 64), np.int32))
        scan = next(o for o in report.ops if o.name == "ve.scan")
        assert scan.cycles == FIXED + 64 * rounds and scan.bound == "scan"


def test_constants_tables_and_views_are_free() -> None:
    text = f"""func.func @f(%a: tensor<{N // 8}xi32>) -> tensor<8x{N // 8}xf32> {{
      %c = ve.const 3 : tensor<8x{N // 8}xi32>
      %i = ve.iota along 0 : tensor<8x{N // 8}xi32>
      %b = ve.broadcast %a along 0 : tensor<{N // 8}xi32> -> tensor<8x{N // 8}xi32>
      %s = ve.add %b, %c : tensor<8x{N // 8}xi32>
      %t = ve.add %s, %i : tensor<8x{N // 8}xi32>
      %f = ve.bitcast %t : tensor<8x{N // 8}xi32> -> tensor<8x{N // 8}xf32>
      func.return %f : tensor<8x{N // 8}xf32>
    }}"""
    report = simulate_text(text, np.arange(N // 8, dtype=np.int32))
    ops = {o.label: o for o in report.ops}
    for label in ("%c = ve.const", "%i = ve.iota", "%b = ve.broadcast", "%f = ve.bitcast"):
        assert ops[label].engine == NONE and ops[label].cycles == 0
    assert ops["%s = ve.add"].bytes == 2 * 4 * N  # the broadcast operand streams N elements; the const none
    assert ops["%t = ve.add"].bytes == 3 * 4 * N  # a table is fetched like any operand
    # Only the two adds' results take SRAM: the const rides in a constant slot, the iota is a
    # static line, the broadcast and bitcast are views.
    assert report.peak_sram_bytes == 2 * 4 * N
    module = Parser(make_context(), text).parse_module()
    kinds = {o.name: (is_view(o), is_unbuffered(o)) for o in module.walk()}
    assert kinds["ve.const"] == (False, True) and kinds["ve.iota"] == (False, True)
    assert kinds["ve.broadcast"] == (True, False) and kinds["ve.bitcast"] == (True, False)


def test_position_tags_are_free_tables() -> None:
    text = """func.func @f() -> tensor<4x8xi4> {
      %p = ve.position_tag along 1 first 0 middle 1 last 2 single 3 : tensor<4x8xi4>
      func.return %p : tensor<4x8xi4>
    }"""
    report = simulate_text(text)
    assert report.total_cycles == 0 and report.ops[0].engine == NONE and report.peak_sram_bytes == 0
