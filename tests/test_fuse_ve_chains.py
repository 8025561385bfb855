"""fuse-ve-chains (passes/schedule/fuse_ve_chains.py) and `ve.chain`: which runs of ve ops fuse (the
stage table of dialects/ve_stages.py), that fusing never changes a value, and that a chain
costs ONE invocation of the vector engine."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from xdsl.dialects import scf
from xdsl.dialects.builtin import ModuleOp
from xdsl.parser import Parser

import tcpc
from dialects import ve
from dialects.tensor_types import E8M0
from dialects.ve_stages import (
    CHAIN_SLOTS,
    NOT_IN_A_CHAIN,
    REINTERPRET,
    STAGES,
    chain_problem,
)
from passes.schedule.fuse_ve_chains import FuseVeChainsPass
from runtime_sim.perf.cost_model import cost_function
from runtime_sim.perf.cost_only import placeholder
from runtime_sim.perf.costs import register_cost_models
from target.machine import default_machine
from runtime_sim.perf.simulate import simulate
from runtime_sim.semantics.executor import run_function
from tcpc.pipelines import (
    FULL_PIPELINE,
    apply_pipeline,
    make_context,
    parse_pipeline,
)
from tcpc.program import prepare_inputs

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.moe"))
M = default_machine()
N = 80 * 256  # 80 elements per slice: 10 cycles at 8-way, 20 at 4-way
OVERHEAD, LATENCY = M.config_overhead_cycles, M.alu_latency_cycles


def parse(text: str) -> ModuleOp:
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


def fused(module: ModuleOp) -> ModuleOp:
    return apply_pipeline(module, parse_pipeline("fuse-ve-chains"))


def computed(report):  # type: ignore[no-untyped-def]
    """The report's ops but the streams of the function's arguments (in HBM, which the vector
    engine cannot read: the memory plan streams each in before its reader)."""
    return [o for o in report.ops if not o.label.startswith("stream in ")]


def chains(module: ModuleOp) -> list[ve.ChainOp]:
    return [op for op in module.walk() if isinstance(op, ve.ChainOp)]


def func_ops(module: ModuleOp, name: str = "f") -> list:
    fn = next(op for op in module.ops if op.sym_name.data == name)
    return list(fn.body.block.ops)


SILU = f"""
func.func @f(%y: tensor<{N}xf32>) -> tensor<{N}xbf16> {{
  %s = ve.sigmoid %y : tensor<{N}xf32>
  %m = ve.mul %y, %s : tensor<{N}xf32>
  %h = ve.narrow %m : tensor<{N}xf32> -> tensor<{N}xbf16>
  func.return %h : tensor<{N}xbf16>
}}"""


# ---------------------------------------------------------------------------------------------
# The table


def test_every_ve_op_has_a_stage_or_a_reason_it_never_joins() -> None:
    names = {cls.name for cls in ve.VE.operations}
    covered = set(CHAIN_SLOTS) | set(NOT_IN_A_CHAIN) | {REINTERPRET}
    assert names == covered, f"missing: {names - covered}, stale: {covered - names}"
    assert not set(CHAIN_SLOTS) & set(NOT_IN_A_CHAIN)


def test_the_book_stage_order() -> None:
    # furiosa-opt book, Intra-Slice Chain: stages 1..12, with the casts around the chain.
    assert STAGES[1:13] == ("Tag", "Logic", "Fxp", "FxpToFp", "Narrow", "Float", "IntraSliceReduce",
                            "FpDiv", "Widen", "FpToFxp", "Clip", "Filter")
    assert (STAGES[0], STAGES[-1]) == ("Fetch", "Cast")


# ---------------------------------------------------------------------------------------------
# Legality


def members_of(text: str) -> list:
    return [op for op in func_ops(parse(text)) if op.name.startswith("ve.") and op.name != "ve.const"]


def test_a_legal_run_has_no_problem() -> None:
    assert chain_problem(members_of(SILU)) is None


def test_an_alu_used_twice_is_illegal() -> None:
    text = """
    func.func @f(%x: tensor<8xf32>) -> tensor<8xf32> {
      %a = ve.sigmoid %x : tensor<8xf32>
      %b = ve.tanh %a : tensor<8xf32>
      func.return %b : tensor<8xf32>
    }"""
    problem = chain_problem(members_of(text))
    assert problem is not None and "ve.tanh needs Float (FpFpu)" in problem  # the book's tanh(sqrt(x))


def test_a_stage_before_the_previous_one_is_illegal() -> None:
    text = """
    func.func @f(%x: tensor<8xi32>, %y: tensor<8xi32>) -> tensor<8xi32> {
      %a = ve.max %x, %y : tensor<8xi32>
      %b = ve.and %a, %y : tensor<8xi32>
      func.return %b : tensor<8xi32>
    }"""
    problem = chain_problem(members_of(text))
    assert problem is not None and "ve.and needs Logic" in problem


def test_an_op_with_two_homes_takes_the_later_one_when_needed() -> None:
    # i32 add: Fxp's FxpAdd, else the Clip cluster's ClipAdd (book, Clip Cluster: AddFxp)
    text = """
    func.func @f(%x: tensor<8xi32>, %y: tensor<8xi32>) -> tensor<8xi32> {
      %a = ve.max %x, %y : tensor<8xi32>
      %b = ve.add %a, %y : tensor<8xi32>
      func.return %b : tensor<8xi32>
    }"""
    assert chain_problem(members_of(text)) is None


def test_an_intermediate_used_outside_is_illegal() -> None:
    text = """
    func.func @f(%x: tensor<8xf32>, %y: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
      %a = ve.exp %x : tensor<8xf32>
      %b = ve.mul %a, %y : tensor<8xf32>
      func.return %a, %b : tensor<8xf32>, tensor<8xf32>
    }"""
    members = members_of(text)
    assert chain_problem(members) == "the result of ve.exp is used outside the chain"
    assert chain_problem(members, complete=False) is None  # still growing: legal so far


def test_a_member_must_read_the_stream() -> None:
    text = """
    func.func @f(%x: tensor<8xf32>, %y: tensor<8xf32>) -> tensor<8xf32> {
      %a = ve.exp %x : tensor<8xf32>
      %b = ve.mul %y, %y : tensor<8xf32>
      func.return %b : tensor<8xf32>
    }"""
    assert chain_problem(members_of(text)) == "ve.mul does not read the previous op's result"


def test_the_stash_holds_one_value_of_a_stashable_stage_read_once() -> None:
    silu = """
    func.func @f(%x: tensor<8xbf16>) -> tensor<8xf32> {
      %y = ve.widen %x : tensor<8xbf16> -> tensor<8xf32>
      %s = ve.sigmoid %y : tensor<8xf32>
      %m = ve.mul %y, %s : tensor<8xf32>
      func.return %m : tensor<8xf32>
    }"""
    assert chain_problem(members_of(silu)) is None  # widen's result stashed as it enters Tag
    twice = silu.replace("func.return %m", "%a = ve.add %m, %y : tensor<8xf32>\n      func.return %a")
    assert "stash holds one" in (chain_problem(members_of(twice)) or "")
    after_reduce = """
    func.func @f(%x: tensor<8x4xf32>) -> tensor<8xf32> {
      %r = ve.reduce_max %x along 1 : tensor<8x4xf32> -> tensor<8xf32>
      %d = ve.div %r, %r : tensor<8xf32>
      %m = ve.max %d, %r : tensor<8xf32>
      func.return %m : tensor<8xf32>
    }"""
    assert "stash holds one" in (chain_problem(members_of(after_reduce)) or "")  # IntraSliceReduce cannot stash


@pytest.mark.parametrize("op", ["ve.broadcast", "ve.scan"])
def test_ops_that_never_join_a_chain(op: str) -> None:
    assert op in NOT_IN_A_CHAIN


def test_stored_values_widen_in_the_fetch_stage_and_e8m0_scales_do_not() -> None:
    # book, Fetch Adapter: f4e2m1 -> f8e4m3 by the table, f8 -> f32 by fetch_cast, the stream
    # entering the chain; an e8m0 exponent has no table or cast there.
    text = """
    func.func @f(%v: tensor<8xf4E2M1FN>, %s: tensor<8xf32>, %e: tensor<8xf8E8M0FNU>) -> tensor<8xbf16> {
      %w = ve.widen_low %v : tensor<8xf4E2M1FN> -> tensor<8xf32>
      %m = ve.mul %w, %s : tensor<8xf32>
      %h = ve.narrow %m : tensor<8xf32> -> tensor<8xbf16>
      %x = ve.widen_low %e : tensor<8xf8E8M0FNU> -> tensor<8xf32>
      %y = ve.mul %x, %s : tensor<8xf32>
      func.return %h : tensor<8xbf16>
    }"""
    members = members_of(text)
    assert chain_problem(members[:3]) is None
    assert "e8m0 scale" in (chain_problem(members[3:]) or "")


@pytest.mark.parametrize("example, first", [("qwen3_moe_fp4_groups", "ve.widen_low"), ("qwen3_moe_trellis3", "ve.lookup"),
                                            ("gpt_oss_w4a16", "ve.widen_low")])
def test_a_decoded_weight_is_one_chain(example: str, first: str) -> None:
    """Each weight the vector engine decodes for the contraction is one invocation: the stored
    codes widened (or looked up) as they enter, scale (and signs) multiplied, rounded to bf16 by
    the Cast stage; no f32 copy of the weight is written to SRAM and read back."""
    program = tcpc.compile_file(EXAMPLES[0].with_name(f"{example}.moe"))
    module = program.lower(program.full_pipeline())
    decodes = [c for c in chains(module) if c.result.name_hint == "w_decoded"]
    assert decodes and all(c.members[0].name == first and c.members[-1].name == "ve.narrow" for c in decodes)
    assert not [op for op in module.walk() if isinstance(op, ve.LookupOp | ve.WidenLowOp)
                and not isinstance(op.parent_op(), ve.ChainOp) and op.input.type.get_element_type() != E8M0]


# ---------------------------------------------------------------------------------------------
# The pass


def test_the_pass_groups_a_run_into_one_chain() -> None:
    module = fused(parse(SILU))
    (chain,) = chains(module)
    assert [m.name for m in chain.members] == ["ve.sigmoid", "ve.mul", "ve.narrow"]
    assert [op.name for op in func_ops(module)] == ["ve.chain", "func.return"]
    assert chain.result.name_hint == "h"


def test_the_pass_fuses_in_nested_blocks() -> None:
    # A loop body (scf.for, as the schedule level builds them) is a block like any other.
    ctx = make_context()  # tcpc's dialects include scf and arith, which the schedule level uses
    module = Parser(ctx, """
    func.func @f(%y: tensor<64xf32>) -> tensor<64xf32> {
      %lb = arith.constant 0 : index
      %ub = arith.constant 2 : index
      %step = arith.constant 1 : index
      scf.for %i = %lb to %ub step %step {
        %s = ve.sigmoid %y : tensor<64xf32>
        %m = ve.mul %y, %s : tensor<64xf32>
        %h = ve.narrow %m : tensor<64xf32> -> tensor<64xbf16>
      }
      func.return %y : tensor<64xf32>
    }""").parse_module()
    FuseVeChainsPass().apply(ctx, module)
    module.verify()
    (chain,) = chains(module)
    assert isinstance(chain.parent_op(), scf.ForOp)
    assert [m.name for m in chain.members] == ["ve.sigmoid", "ve.mul", "ve.narrow"]


def test_a_stashed_intermediate_takes_no_sram() -> None:
    text = f"""
    func.func @f(%x: tensor<{N}xbf16>) -> tensor<{N}xbf16> {{
      %y = ve.widen %x : tensor<{N}xbf16> -> tensor<{N}xf32>
      %s = ve.sigmoid %y : tensor<{N}xf32>
      %m = ve.mul %y, %s : tensor<{N}xf32>
      %h = ve.narrow %m : tensor<{N}xf32> -> tensor<{N}xbf16>
      func.return %h : tensor<{N}xbf16>
    }}"""
    module = fused(parse(text))
    (chain,) = chains(module)
    assert [m.name for m in chain.members] == ["ve.widen", "ve.sigmoid", "ve.mul", "ve.narrow"]
    x = np.linspace(-3, 3, N, dtype=np.float32).astype(ml_dtypes.bfloat16)
    result = simulate(module, "f", [x])
    (rec,) = computed(result.report)
    assert rec.cycles == OVERHEAD + 4 * LATENCY + 20
    assert rec.bytes == 2 * N + 2 * N  # the bf16 input once, the bf16 result
    want = run_function(parse(text), "f", [x])
    np.testing.assert_array_equal(result.outputs[0].view(np.uint16), want[0].view(np.uint16))


def test_the_pass_is_idempotent() -> None:
    once = fused(parse(SILU))
    assert str(fused(once)) == str(once)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_fusing_never_changes_a_value(path: Path) -> None:
    """The IR before and after the pass, on the same inputs: bit-identical outputs."""
    program = tcpc.compile_file(path)
    before = program.lower(",".join(FULL_PIPELINE[:FULL_PIPELINE.index("fuse-ve-chains")]))
    after = fused(before)
    assert chains(after), "every example has runs that fuse"
    name = program.graph_names[0]
    inputs = prepare_inputs(program.function(), {}, 5)
    want = run_function(before, name, inputs)
    got = run_function(after, name, inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


# ---------------------------------------------------------------------------------------------
# Cost: one invocation


def test_a_chain_costs_one_invocation() -> None:
    y = np.linspace(-4, 4, N, dtype=np.float32)
    module = fused(parse(SILU))
    report = simulate(module, "f", [y]).report
    (rec,) = computed(report)
    # One configuration overhead, three stages of latency, one pass at the Float cluster's 4-way
    # (20 cycles for 80 values per slice): 16 + 3 + 20.
    assert rec.name == "ve.chain" and rec.label == "%h = ve.chain[3](sigmoid,mul,narrow)"
    assert rec.cycles == OVERHEAD + 3 * LATENCY + 20
    assert rec.bytes == 2 * 4 * N + 2 * N  # %y read twice (stream and operand), bf16 written
    assert rec.flops == 2 * N  # sigmoid and mul
    unfused = simulate(parse(SILU), "f", [y]).report
    assert sum(r.cycles for r in computed(unfused)) == 3 * (OVERHEAD + LATENCY + 20) - 10  # narrow is 8-way
    assert sum(r.bytes for r in computed(unfused)) == (2 * 4 + 4 + 4 + 4 + 4 + 2) * N  # with intermediates


def test_a_chain_with_a_reduction_streams_at_the_slowest_stage() -> None:
    text = f"""
    func.func @f(%x: tensor<{N // 8}x8xi32>, %o: tensor<{N // 8}xi32>) -> tensor<{N // 8}xi32> {{
      %c = ve.const 1 : tensor<{N // 8}x8xi32>
      %a = ve.add %x, %c : tensor<{N // 8}x8xi32>
      %r = ve.reduce_sum %a along 1 : tensor<{N // 8}x8xi32> -> tensor<{N // 8}xi32>
      %s = ve.add %r, %o : tensor<{N // 8}xi32>
      func.return %s : tensor<{N // 8}xi32>
    }}"""
    module = fused(parse(text))
    (chain,) = chains(module)
    assert [m.name for m in chain.members] == ["ve.add", "ve.reduce_sum", "ve.add"]  # Fxp, reduce, ClipAdd
    x, o = np.ones((N // 8, 8), np.int32), np.arange(N // 8, dtype=np.int32)
    result = simulate(module, "f", [x, o])
    (rec,) = computed(result.report)
    # The reduction streams N values 4-way (20 cycles per slice), the adds 8-way (10, and 10/8
    # after the reduction); its first output waits 8 steps; three stages of latency.
    assert rec.cycles == OVERHEAD + 3 * LATENCY + 20 + 8
    assert rec.bytes == 4 * N + 4 * (N // 8) + 4 * (N // 8)  # %x and %o read, the sums written
    np.testing.assert_array_equal(result.outputs[0], 2 * 8 + o)


def test_intermediates_take_no_sram() -> None:
    module = fused(parse(SILU))
    result = simulate(module, "f", [np.zeros(N, np.float32)])
    assert result.trace is not None and len(result.trace.ops) == 1
    assert list(result.trace.buffer_bytes.values()) == [2 * N]  # only the bf16 result


def test_cost_only_runs_chains() -> None:
    program = tcpc.compile_file(EXAMPLES[0])
    full = program.simulate(seed=0)
    assert any(r.name == "ve.chain" for r in full.report.ops)
    cost = program.simulate(cost_only=True)
    assert any(r.name == "ve.chain" for r in cost.report.ops)
    assert cost.outputs == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_fusing_only_removes_costs(path: Path) -> None:
    """Every chain of every example costs no more cycles and bytes than its members run one by
    one, and no fewer cycles than its slowest member's stream plus one overhead."""
    register_cost_models()
    module = tcpc.compile_file(path).lower()

    def cost(op):
        return cost_function(op)(op, tuple(placeholder(v.type) for v in op.operands),
                                 tuple(placeholder(r.type) for r in op.results), M)

    for chain in chains(module):
        whole, alone = cost(chain), [cost(m) for m in chain.members]
        assert whole.cycles <= sum(c.cycles for c in alone)
        assert whole.bytes_moved <= sum(c.bytes_moved for c in alone)
        assert whole.flops == sum(c.flops for c in alone)
        assert whole.cycles >= max(c.cycles for c in alone)
