"""Cost formulas: the book's worked figures, the contraction formula, data-dependent DMA costs,
the vector-engine formulas, and the registry's checks."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from xdsl.parser import Parser

from runtime_sim.perf.cost_model import (
    DMA,
    TENSOR,
    CostModelError,
    NotLoweredError,
    OpCost,
    check_cost,
    cost_function,
    register_cost,
)
from runtime_sim.perf.costs import register_cost_models
from target.machine import default_machine
from runtime_sim.perf.simulate import simulate
from runtime_sim.perf.tcp_cost import command_cycles, dma_copy_cost, dma_cycles, gathered_rows
from target.contraction_mapping import ContractionShape, choose
from runtime_sim.perf.vector_cost import scan_cycles, vector_chain_cycles
from tcpc.pipelines import make_context

register_cost_models()  # these tests look costs up without running the simulator

M = default_machine()
BF16 = ml_dtypes.bfloat16


def parse(text: str):
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


def test_book_figure_16kb_hbm_to_hbm_dma_is_about_628_cycles() -> None:
    # Book, DMA Engine, Example 1: within a tier reads and writes serialise.
    cost = dma_copy_cost(M, 16 * 1024, src_hbm=True, dst_hbm=True)
    assert cost.engine == DMA
    assert abs(cost.cycles - 628) <= 4  # 64 read + 64 write 256-byte requests + 500 start-up
    assert cost.hbm_bytes == 2 * 16 * 1024


def test_book_figure_hbm_to_sram_pipelines_reads_and_writes() -> None:
    # Book, DMA Engine, Example 2: 16 MB HBM -> DM on one engine, max(65,536, 65,536) + 500.
    assert dma_cycles(M, 65_536, 65_536, 0, 1, cross_tier=True) == (66_036, "dma bandwidth")
    assert dma_cycles(M, 65_536, 65_536, 0, 1, cross_tier=False)[0] == 131_572
    small = dma_copy_cost(M, 16 * 1024, src_hbm=True, dst_hbm=False)
    assert small.cycles == 564 and small.hbm_bytes == 16 * 1024


def test_book_figure_through_the_simulator() -> None:
    module = parse("""
    func.func @f(%x: tensor<64x128xbf16>) -> tensor<64x128xbf16> {
      %y = tcp.load %x : tensor<64x128xbf16> -> tensor<64x128xbf16>
      func.return %y : tensor<64x128xbf16>
    }""")
    x = np.ones((64, 128), BF16)  # 16 KB from HBM into SRAM: 64 requests pipelined + 500
    result = simulate(module, "f", [x])
    assert result.report.total_cycles == 564
    assert result.report.ops[0].bound == "dma startup"
    np.testing.assert_array_equal(result.outputs[0], x)


def test_a_large_gather_is_spread_over_every_dma_engine() -> None:
    # Two 32 MB expert weights gathered from HBM: 64 MB read and written as 8 parts in parallel.
    module = parse("""
    func.func @f(%w: tensor<4x4096x4096xbf16>, %i: tensor<2xi32>) -> tensor<2x4096x4096xbf16> {
      %g = tcp.dma_gather %w[%i] : tensor<4x4096x4096xbf16>, tensor<2xi32> -> tensor<2x4096x4096xbf16>
      func.return %g : tensor<2x4096x4096xbf16>
    }""")
    report = simulate(module, "f", [np.zeros((4, 4096, 4096), BF16), np.array([0, 2], np.int32)]).report
    gather = report.ops[0]
    nbytes = 2 * 4096 * 4096 * 2
    assert gather.units == tuple(range(M.dma_engines)) and gather.engine_label == "dma0-7"
    # HBM -> SRAM pipelines reads and writes: after their start-up the 8 engines at 256 B/cycle
    # each would move it in 32,768 cycles, but together they get only the HBM's 1.5 KB/cycle.
    engines = nbytes / (M.dma_engines * M.dma_bytes_per_cycle)
    expect = M.dma_startup_cycles + max(engines, nbytes / M.hbm_bytes_per_cycle)
    assert gather.bound == "hbm" and abs(gather.cycles - expect) <= 2
    assert gather.part_ends == (gather.end,) * M.dma_engines  # equal shares: the parts end together
    assert gather.cycles < nbytes / M.dma_bytes_per_cycle / 4  # one engine would take 8x as long
    assert gather.cycles >= nbytes / M.hbm_bytes_per_cycle  # the roofline invariant
    assert report.engines[1].busy_cycles >= M.dma_engines * gather.cycles
    trace = report.chrome_trace()["traceEvents"]
    assert len({e["tid"] for e in trace if e["ph"] == "X" and e["args"]["key"] == gather.key}) == M.dma_engines


def test_dma_parts_follow_the_one_split_rule() -> None:
    from runtime_sim.perf.tcp_cost import dma_parts

    split = M.dma_split_bytes
    assert dma_parts(M, 16 * 1024) == 1 and dma_parts(M, split) == 1
    assert dma_parts(M, 2 * split) == 2 and dma_parts(M, 1 << 40) == M.dma_engines
    check_cost(parse("func.func @f() { func.return }").body.block.ops.first, dma_copy_cost(M, 64 << 20, True, False), M)
    op = parse("func.func @f() { func.return }").body.block.ops.first
    with pytest.raises(CostModelError, match="exceeds HBM bandwidth"):  # 1,501 B/cycle even alone
        check_cost(op, OpCost(DMA, 1000, hbm_bytes=1000 * 1500 + 1000, parts=8), M)
    check_cost(op, OpCost(DMA, 1000, hbm_bytes=1000 * 1500, parts=8), M)
    with pytest.raises(CostModelError, match=r"part cycles \(900,\) are not a DMA command's on 1 to 2 engines"):
        check_cost(op, OpCost(DMA, 1000, parts=2, part_cycles=(900,)), M)


def test_contraction_command_on_a_known_shape() -> None:
    # [256, 512] @ [512, 1024] bf16: 2^27 MACs at 256 x 256 per cycle = 2048 cycles when the
    # mapping keeps every multiplier busy; plus configuration (16) and the tree's fill (5).
    mapped = choose(ContractionShape(1, 256, 1024, 512), M).best
    assert (mapped.cycles, mapped.bound, mapped.utilization) == (2048, "outer", 1.0)
    assert command_cycles(M, mapped, blocks=1, blocks_run=1, guards=0, tree_depth=5) == (16 + 5 + 2048, "outer")
    assert command_cycles(M, mapped, blocks=6, blocks_run=3, guards=6, tree_depth=5)[0] == 16 + 6 * 4 + 5 + 1024
    skipped, bound = command_cycles(M, mapped, blocks=6, blocks_run=0, guards=6, tree_depth=5)
    assert skipped == 16 + 6 * 4 and bound.startswith("guard")
    tiny = choose(ContractionShape(1, 2, 2, 32), M).best
    assert command_cycles(M, tiny, blocks=1, blocks_run=1, guards=0, tree_depth=5)[1] == "overhead"


GATHER = """
func.func @f(%w: tensor<4x64x128xbf16>, %ei: tensor<6xi32>) -> tensor<6x64x128xbf16> {
  %wg = tcp.dma_gather %w[%ei] : tensor<4x64x128xbf16>, tensor<6xi32> -> tensor<6x64x128xbf16>
  func.return %wg : tensor<6x64x128xbf16>
}"""


def gather_cost(ids: list[int]) -> OpCost:
    w = np.ones((4, 64, 128), BF16)
    report = simulate(parse(GATHER), "f", [w, np.array(ids, np.int32)]).report
    op = report.ops[0]
    return OpCost(op.engine, op.cycles, op.bytes, op.hbm_bytes, op.flops, op.bound)


def test_weight_gather_reuses_a_weight_for_consecutive_blocks() -> None:
    row = 64 * 128 * 2  # one expert's weight, 16 KB
    assert gathered_rows(np.array([0, 0, 1, 1, 2, -1])) == 3
    assert gathered_rows(np.array([0, 1, 0, 1, -1, -1])) == 4
    grouped = gather_cost([0, 0, 1, 1, 2, -1])
    assert grouped.hbm_bytes == 3 * row
    assert grouped.cycles == 500 + 3 * 64  # reads and writes pipelined (HBM -> SRAM)
    assert gather_cost([0, 1, 0, 1, -1, -1]).hbm_bytes == 4 * row


def test_skipped_rows_cost_nothing_but_the_command_still_starts() -> None:
    none = gather_cost([-1] * 6)
    assert none.hbm_bytes == 0 and none.bytes_moved == 0 and none.cycles == 500


def test_scatter_reads_each_source_row_once() -> None:
    module = parse("""
    func.func @f(%x: tensor<4x64xbf16>, %si: tensor<4x2xi32>) -> tensor<10x64xbf16> {
      %xl = tcp.load %x : tensor<4x64xbf16> -> tensor<4x64xbf16>
      %r = tcp.dma_scatter %xl[%si] : tensor<4x64xbf16>, tensor<4x2xi32> -> tensor<10x64xbf16>
      func.return %r : tensor<10x64xbf16>
    }""")
    si = np.array([[0, 5], [1, -1], [-1, -1], [3, 4]], np.int32)
    op = simulate(module, "f", [np.ones((4, 64), BF16), si]).report.ops[1]
    assert op.hbm_bytes == 0  # SRAM to SRAM
    assert op.bytes == (3 + 5) * 128  # 3 rows read, 5 written, 128 B each
    assert op.cycles == 500 + 3 + 5  # one 256-byte request per row


def test_vector_chain_formula() -> None:
    n = 256 * 8 * 100  # 100 flits per slice
    assert vector_chain_cycles(M, n, alu="int", alus_used=2) == (16 + 2 + 100, "vector stream")
    assert vector_chain_cycles(M, n, alu="float", alus_used=2)[0] == 16 + 2 + 200  # 4-way
    reduce, _ = vector_chain_cycles(M, n, alu="float", alus_used=1, reduce_steps=64)
    assert reduce == 16 + 1 + 200 + 64  # first output waits 64 steps
    assert vector_chain_cycles(M, n, alu="int", alus_used=1, reduce_steps=64)[0] == reduce  # reduce is 4-way
    ring, _ = vector_chain_cycles(M, n, alu="float", alus_used=1, reduce_steps=64, inter_slice=True)
    assert ring == reduce + M.ring_traversal_cycles
    filt, _ = vector_chain_cycles(M, n, alu="int", alus_used=1, filter_stage=True)
    assert filt == 16 + 1 + 100 + M.filter_cycles
    with pytest.raises(ValueError):
        vector_chain_cycles(M, n, alu="bf16", alus_used=1)  # type: ignore[arg-type]


def test_cumsum_is_a_time_axis_scan() -> None:
    # 2048 rows (one per lane of every slice) of 64 steps: one round of 64 cycles.
    assert scan_cycles(M, 2048, 64) == (16 + 1 + 64, "scan")
    assert scan_cycles(M, 2049, 64)[0] == 16 + 1 + 128
    assert scan_cycles(M, 2048, 64, alu="float")[0] == 16 + 1 + 2 * 64


def test_the_mesh_plans_cumsum_runs_chunked_as_lower_routings() -> None:
    """ccl.a2a_plan's cumsum over a chunk's pairs (Qwen3-30B-A3B on 2 chips: 16,384 pairs, 2 rows)
    charged as lower-routing's chunked cumsum: 64 chunks of 256 steps side by side, the totals'
    cumsum and sum (64 steps each) and the offsets' add over every element, not one scan of 16,384
    steps; below MIN_CHUNKED_PAIRS one scan, as lower-routing runs it."""
    from runtime_sim.perf.ccl_cost import chunked_cumsum_cycles
    from target.chunked_scan import MIN_CHUNKED_PAIRS

    fixed = scan_cycles(M, 1, 1)[0] - 1
    add = vector_chain_cycles(M, 2 * 16384, alu="int", alus_used=1)[0]
    assert chunked_cumsum_cycles(M, 2, 16384) == (fixed + 256 + 2 * (fixed + 64) + add, "scan")
    assert chunked_cumsum_cycles(M, 2, 16384)[0] < scan_cycles(M, 2, 16384)[0] // 10
    assert chunked_cumsum_cycles(M, 2, MIN_CHUNKED_PAIRS - 1) == scan_cycles(M, 2, MIN_CHUNKED_PAIRS - 1)


def test_unlowered_ir_names_every_uncosted_op() -> None:
    module = parse("""
    func.func @f(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
      %e = tmath.exp %x : tensor<4x8xf32> -> tensor<4x8xf32>
      %s = tmath.softmax %e {axis = 1 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
      %t = tmath.exp %s : tensor<4x8xf32> -> tensor<4x8xf32>
      func.return %t : tensor<4x8xf32>
    }""")
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(NotLoweredError, match=r"lower them first: tmath.exp \(x2\), tmath.softmax"):
        simulate(module, "f", [x])
    report = simulate(module, "f", [x], uncosted="free").report
    assert report.total_cycles == 0
    assert all(o.bound == "not costed: lower it first" for o in report.ops)


def test_registered_costs_must_respect_the_peaks() -> None:
    module = parse(GATHER)
    op = next(o for o in module.walk() if o.name == "tcp.dma_gather")
    with pytest.raises(CostModelError, match="FLOPs"):
        check_cost(op, OpCost(DMA, 10, flops=1), M)
    with pytest.raises(CostModelError, match="HBM"):
        check_cost(op, OpCost(DMA, 10, hbm_bytes=10**6), M)
    with pytest.raises(CostModelError, match="unknown engine"):
        check_cost(op, OpCost("warp", 10), M)


def test_a_cost_function_plugs_in_by_registration() -> None:
    module = parse("""
    func.func @f(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
      %e = tmath.exp %x : tensor<4x8xf32> -> tensor<4x8xf32>
      func.return %e : tensor<4x8xf32>
    }""")
    assert cost_function(next(o for o in module.walk() if o.name == "tmath.exp")) is None

    @register_cost("tmath.exp")
    def exp_cost(op, operands, results, machine):
        cycles, bound = vector_chain_cycles(machine, operands[0].size, alu="float", alus_used=1)
        return OpCost(TENSOR, cycles, flops=operands[0].size, bound=bound)

    try:
        report = simulate(module, "f", [np.zeros((4, 8), np.float32)]).report
        exp = next(o for o in report.ops if o.name == "tmath.exp")  # after its argument's stream
        assert exp.engine == TENSOR and exp.cycles == 16 + 1 + 1
        assert exp.flops == 32
    finally:
        from runtime_sim.perf import cost_model

        del cost_model._COSTS["tmath.exp"]


def test_cost_models_register_through_the_explicit_list_only() -> None:
    """Importing a cost module registers nothing; `costs.COST_MODELS` does (like executor.SEMANTICS)."""
    code = ("from runtime_sim.perf import cost_model, tcp_cost, ve_cost, simulate\n"
            "assert not cost_model.costed_op_names(), sorted(cost_model.costed_op_names())\n"
            "from runtime_sim.perf.costs import register_cost_models\n"
            "register_cost_models()\n"
            "assert {'tcp.contract', 've.add', 'func.return'} <= cost_model.costed_op_names()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_biased_contraction_is_never_faster_than_its_flops() -> None:
    # gpt-oss's biased block contractions at a large block: the bias adds are FLOPs the roofline
    # counts at the tensor unit's peak, so the command's compute term counts them too.
    module = parse("""
    func.func @f(%x: tensor<1x2048x2880xbf16>, %w: tensor<1x2880x2880xbf16>, %b: tensor<1x1x2880xbf16>) -> tensor<1x2048x2880xf32> {
      %y = tcp.contract "gbd,gdf->gbf" %x, %w bias %b : tensor<1x2048x2880xbf16>, tensor<1x2880x2880xbf16> bias tensor<1x1x2880xbf16> -> tensor<1x2048x2880xf32>
      func.return %y : tensor<1x2048x2880xf32>
    }""")
    args = [np.ones((1, 2048, 2880), BF16), np.ones((1, 2880, 2880), BF16), np.ones((1, 1, 2880), BF16)]
    report = simulate(module, "f", args).report
    (op,) = [o for o in report.ops if o.name == "tcp.contract"]
    assert op.flops == 2 * 2048 * 2880 * 2880 + 2048 * 2880
    assert op.cycles >= op.flops / M.peak_flops_per_cycle


def test_a_row_gather_by_token_reads_hbm_or_sram_as_its_source_lives() -> None:
    """tile.gather (a block's token rows, schedule-experts): -1 rows read nothing and are zero;
    from HBM the reads and writes pipeline, bound by the engine's share of HBM; from SRAM (the
    same rows of the tokens' SRAM copy) no HBM byte moves, but a DM -> DM command serialises
    its reads and writes (book, DMA Engine, Example 3), so it takes the engine longer."""
    module = parse("""
    func.func @f(%x: tensor<8x2048xbf16>, %rows: tensor<1x4xi32>, %skip: tensor<1xi32>)
        -> (tensor<1x4x2048xbf16>, tensor<1x4x2048xbf16>, tensor<1x4x2048xbf16>) {
      %h = tile.gather %x[%rows] : tensor<8x2048xbf16>, tensor<1x4xi32> -> tensor<1x4x2048xbf16>
      %xs = tcp.load %x : tensor<8x2048xbf16> -> tensor<8x2048xbf16>
      %s = tile.gather %xs[%rows] : tensor<8x2048xbf16>, tensor<1x4xi32> -> tensor<1x4x2048xbf16>
      %g = tile.gather %x[%rows] guard %skip : tensor<8x2048xbf16>, tensor<1x4xi32> guard tensor<1xi32> -> tensor<1x4x2048xbf16>
      func.return %h, %s, %g : tensor<1x4x2048xbf16>, tensor<1x4x2048xbf16>, tensor<1x4x2048xbf16>
    }""")
    x = (np.arange(8 * 2048) % 251).astype(BF16).reshape(8, 2048)
    rows = np.array([[5, -1, 0, 7]], np.int32)
    result = simulate(module, "f", [x, rows, np.array([-1], np.int32)])
    want = np.stack([x[5], np.zeros(2048, BF16), x[0], x[7]])[None]
    np.testing.assert_array_equal(result.outputs[0], want)
    np.testing.assert_array_equal(result.outputs[1], want)
    np.testing.assert_array_equal(result.outputs[2], np.zeros_like(want))
    hbm, _, sram, skipped = result.report.ops
    row = 2048 * 2  # 4 KB: 16 requests
    assert hbm.hbm_bytes == 3 * row and hbm.bytes == 2 * 3 * row
    assert hbm.cycles == max(500 + 3 * 16, -(-3 * row * M.dma_engines // M.hbm_bytes_per_cycle))
    assert sram.hbm_bytes == 0 and sram.bytes == 2 * 3 * row
    assert sram.cycles == 500 + 2 * 3 * 16 > hbm.cycles  # reads, then writes
    assert skipped.cycles == M.guard_cycles and skipped.bytes == 0


@pytest.mark.parametrize("ids, prev_ids", [
    (np.array([3, -1], np.int32), np.array([3, -1], np.int32)),
    (np.array([3, -1], np.int32), np.array([3, 4], np.int32)),
    (np.array([3], np.int32), np.array([3, 3], np.int32)),
    (np.array([3, 5], np.int32), np.array([3, 5], np.int64)),  # equal values of two dtypes
    (np.arange(8, dtype=np.int32)[::2], np.array([0, 2, 4, 6], np.int32)),  # a strided view
    (np.int32(7), np.array(7, np.int32)),
    (np.array([1.0, -0.0], np.float32), np.array([1.0, 0.0], np.float32)),  # equal floats, other bits
])
def test_same_expert_ids_is_array_equal(ids: np.ndarray, prev_ids: np.ndarray) -> None:
    from runtime_sim.perf.tile_cost import same_expert_ids

    assert same_expert_ids(ids, prev_ids) == np.array_equal(ids, prev_ids)
