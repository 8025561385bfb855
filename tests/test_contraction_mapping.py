"""The contraction mapping: the book's rules and stage costs (target/contraction_mapping.py), the
map-contractions pass, and the simulator costing the mapping an op carries."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from xdsl.parser import Parser

from dialects import tcp
from passes.schedule.map_contractions import MapContractionsPass
from runtime_sim.perf.simulate import simulate
from target.contraction_mapping import ContractionShape, Mapping, MappingError, candidates, check, choose, cost
from target.machine import default_machine
import tcpc
from runtime_sim.semantics.executor import run_function
from tcpc.pipelines import FULL_PIPELINE, apply_pipeline, make_context, parse_pipeline
from tcpc.program import prepare_inputs
from support import assert_same_bits, tcpc_main

M = default_machine()
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# The book's batched matmul (Contraction Engine, "Example: Batched MatMul"): V = 32, M = 32,
# N = 8, K = 32 over the chip's two clusters; per cluster V x M / 2 = 512 rows of the streamed
# operand share one [K, N] weight.
BMM = ContractionShape(1, 512, 8, 32)
K_IN_TIME = Mapping("rhs", (1, 256, 1), 8, 1, 1, 32, "half")
"""Slice [M % 16, V % 16], Lane [N], Time [V / 16, K], Packet [1 # 16]."""
M_IN_TIME = Mapping("rhs", (1, 16, 1), 8, 1, 32, 32, "half")
"""Slice [V % 16 # 256], Lane [N], Time [M], Packet [K]: 32 rows streamed per slice."""


def test_k_in_time_runs_at_one_32nd_of_the_macs() -> None:
    # "only 1 of 32 multipliers does useful work per cycle (1/32 MAC utilization for bf16)"
    check(K_IN_TIME, BMM, M)
    mapped = cost(K_IN_TIME, BMM, M)
    assert mapped.utilization == pytest.approx(1 / 32)
    assert (mapped.cycles, mapped.bound) == (64, "outer")


def test_m_in_time_uses_every_lane_of_the_slices_it_uses() -> None:
    # "It maximizes MAC utilization across lanes": every multiplier of the 16 slices busy in an
    # Outer cycle; the streamed packet is read at 32 B a cycle, so fetch paces it (book, Outer,
    # Performance: "Fetch bandwidth bounds the Stream Adapter").
    check(M_IN_TIME, BMM, M)
    mapped = cost(M_IN_TIME, BMM, M)
    assert BMM.macs / (16 * M.macs_per_cycle_bf16 * mapped.stages["outer"]) == 1
    assert mapped.bound == "fetch" and mapped.stages["fetch"] == 2 * mapped.stages["outer"]


def test_the_choice_beats_the_books_examples_and_is_deterministic() -> None:
    best = choose(BMM, M)
    assert best.best.cycles < min(cost(M_IN_TIME, BMM, M).cycles, cost(K_IN_TIME, BMM, M).cycles)
    assert choose.__wrapped__(BMM, M) == best  # the same choice without the cache
    assert best.runner_up is not None
    assert (best.runner_up.mapping.trf, best.runner_up.mapping.slices) != (best.best.mapping.trf, best.best.mapping.slices)


def test_a_large_contraction_reaches_the_peak_and_a_padded_one_does_not() -> None:
    assert choose(ContractionShape(1, 256, 1024, 512), M).best.utilization == 1.0
    padded = choose(ContractionShape(1, 250, 1000, 500), M).best
    assert padded.utilization < 1.0


@pytest.mark.parametrize("mapping, message", [
    (replace(K_IN_TIME, slices=(1, 256, 2)), "uses 512 slices"),
    (replace(K_IN_TIME, slices=(1, 16, 16)), "axis n of size 8 is split over 16 slices"),
    (replace(K_IN_TIME, lanes=16), "Lane = 16"),
    (replace(K_IN_TIME, lanes=3), "Lane = 3"),
    (replace(K_IN_TIME, packet=33), "a packet holds 1 to 32"),
    (replace(K_IN_TIME, broadcast=129), "the Time Reducer has 128 slots"),
    (replace(K_IN_TIME, k_chunk=48, packet=32), "not a positive multiple of the packet"),
    (replace(K_IN_TIME, trf_mode="quarter"), "half or full"),
])
def test_a_broken_rule_is_named(mapping: Mapping, message: str) -> None:
    with pytest.raises(MappingError, match=message):
        check(mapping, BMM, M)


def test_the_stationary_operand_must_fit_the_trf() -> None:
    shape = ContractionShape(1, 256, 1024, 4096)
    fits = Mapping("rhs", (1, 1, 256), 4, 2, 32, 4096, "full")  # 4 lanes: 8,192 elements each
    check(fits, shape, M)
    with pytest.raises(MappingError, match=r"needs 8192 elements per lane .* holds 4096 per lane with 4 lanes in half"):
        check(replace(fits, trf_mode="half"), shape, M)
    with pytest.raises(MappingError, match="needs 8192 elements per lane"):
        check(replace(fits, lanes=8), shape, M)


def test_an_f32_pair_runs_on_the_vector_engine_when_it_is_cheapest() -> None:
    shape = ContractionShape(1, 1, 8, 4096, 4, 4, vector=True)  # one token's logits: 32k MACs
    best = choose(shape, M).best
    assert best.mapping.engine == "vector" and best.bound == "vector fma"
    assert best.cycles >= math.ceil(shape.macs / (M.float_ways * M.slices))
    with pytest.raises(MappingError, match="no multiplier pair"):
        check(Mapping("rhs", (1, 1, 1), 8, 1, 32, 2048, "full"), shape, M)


def test_an_f32_pair_runs_on_its_bf16_pieces_when_that_is_cheaper() -> None:
    """bf16x9: the bf16 contraction over K x 9 piece pairs plus the split pass, costed as such."""
    shape = ContractionShape(1, 2048, 256, 7168, 4, 4, vector=True)  # DeepSeek-V3's router, one cluster's rows
    choice = choose(shape, M)
    best, pieces = choice.best, shape.pieces()
    assert best.mapping.engine == "bf16x9" and pieces.k == 9 * shape.k and pieces.mac_bytes == 2 and not pieces.vector
    on_pieces = cost(replace(best.mapping, engine="contraction"), pieces, M)
    split = -(-(2048 + 256) * 7168 // (M.slices * M.float_ways))
    assert best.stages["split"] == split and best.cycles == on_pieces.cycles + split
    assert best.cycles >= math.ceil(pieces.macs / (M.macs_per_cycle_bf16 * M.slices))
    vector = [cost(mp, shape, M) for mp in candidates(shape, M) if mp.engine == "vector"]
    assert vector and best.cycles < min(c.cycles for c in vector) / 6
    assert best.utilization == shape.macs / (M.macs_per_cycle_bf16 * M.slices * best.cycles)  # useful MACs only
    assert "(f32 x f32 as bf16x9: k x 9 piece pairs)" in best.mapping.book_form({}, shape)
    check(best.mapping, shape, M)
    with pytest.raises(MappingError, match="route of an f32 x f32 contraction"):
        check(best.mapping, replace(shape, lhs_bytes=2, rhs_bytes=2, vector=False), M)
    too_long = replace(best.mapping, k_chunk=best.mapping.k_chunk * 64, trf_mode="full")
    with pytest.raises(MappingError, match="the TRF holds"):
        check(too_long, shape, M)


ROUTER_OF_BF16 = """func.func @router(%x: tensor<512x7168xbf16>, %w: tensor<7168x256xf32>) -> tensor<512x256xf32> {
  %xf = ve.widen %x : tensor<512x7168xbf16> -> tensor<512x7168xf32>
  %y = tcp.contract "mk,kn->mn" %xf, %w : tensor<512x7168xf32>, tensor<7168x256xf32> -> tensor<512x256xf32>
  func.return %y : tensor<512x256xf32>
}"""


def test_a_widened_bf16_operand_is_one_piece() -> None:
    """f32(x) of bf16 tokens (DeepSeek-V3's router tile): x is its own hi piece, its mid and lo
    pieces are zero, so the route makes hi x the router's three pieces, over K x 3 (the same
    split pass), not the nine pairs of two full f32 operands."""
    module = Parser(make_context(), ROUTER_OF_BF16).parse_module()
    op = next(o for o in module.walk() if isinstance(o, tcp.ContractOp))
    roles = op.roles()
    assert roles.lhs_bf16 and not roles.rhs_bf16
    shape = ContractionShape.of(roles)
    nine = replace(shape, lhs_pieces=3)
    assert (shape.lhs_pieces, shape.rhs_pieces) == (1, 3)
    assert shape.pieces().k == 3 * 7168 and nine.pieces().k == 9 * 7168
    best, before = choose(shape, M).best, choose(nine, M).best
    assert best.mapping.engine == "bf16x9" == before.mapping.engine
    split = -(-(512 + 256) * 7168 // (M.slices * M.float_ways))
    assert best.stages["split"] == split == before.stages["split"]
    assert best.cycles == cost(replace(best.mapping, engine="contraction"), shape.pieces(), M).cycles + split
    assert best.cycles < before.cycles / 2
    assert "(f32 x f32 as bf16x9: k x 3 piece pairs)" in best.mapping.book_form({}, shape)


def test_block_scales_run_in_the_vector_engine_of_each_slice() -> None:
    """A block-scaled contraction's partial sums are scaled in the slice that computed them: a
    mapping that leaves slices idle pays their share of the scales on the slices it uses, and
    the chooser weighs it. MXFP4's K-blocks of 32 ([128, 2048] x [2048, 256], an F tile of
    Qwen3-30B-A3B's up-projection at B = 128): 64 partial sums per result, 4 a cycle per slice."""
    shape = ContractionShape(1, 128, 256, 2048, lhs_bytes=1, rhs_bytes=0.5, mac_bytes=1, scale_blocks=2048 // 32)
    per_result = shape.scale_blocks / M.float_ways
    half = Mapping("rhs", (1, 8, 16), 8, 2, 64, 2048, "half")  # 128 slices: 16 x 16 results each
    check(half, shape, M)
    assert cost(half, shape, M).stages["vector scales"] == 16 * 16 * per_result
    assert cost(half, shape, M).cycles >= 16 * 16 * per_result
    best = choose(shape, M).best
    assert math.prod(best.mapping.slices) == M.slices  # every slice's vector engine takes its share
    assert best.cycles >= best.stages["vector scales"] >= shape.m * shape.n * per_result / M.slices
    assert best.cycles < cost(half, shape, M).cycles
    # without block scales the same shape has no such stage
    assert "vector scales" not in choose(replace(shape, scale_blocks=0), M).best.stages


def test_the_book_form_names_every_class() -> None:
    shape = ContractionShape(1, 256, 1792, 4096)
    text = choose(shape, M).best.mapping.book_form({"g": "g", "m": "b", "n": "f", "k": "d"}, shape)
    for part in ("Slice [", "Lane [", "Time [", "Packet [d % 32]", "TRF "):
        assert part in text
    # the book's K in Time: Slice [M % 16, V % 16], Lane [N], Time [V / 16, K], Packet [1 # 16]
    assert K_IN_TIME.book_form({"m": "vm", "n": "n", "k": "k"}, BMM) == \
        "Slice [vm / 2] Lane [n % 8] Time [k, vm % 2] Packet [1 # 16] TRF rhs (half)"


@given(st.integers(1, 4), st.integers(1, 600), st.integers(1, 600), st.integers(1, 5000), st.booleans())
def test_no_mapping_beats_the_peak_and_the_choice_is_legal(g: int, m: int, n: int, k: int, fp8: bool) -> None:
    shape = ContractionShape(g, m, n, k, lhs_bytes=1 if fp8 else 2, rhs_bytes=1 if fp8 else 2, mac_bytes=1 if fp8 else 2)
    best = choose(shape, M).best
    check(best.mapping, shape, M)
    peak = (M.macs_per_cycle_fp8 if fp8 else M.macs_per_cycle_bf16) * M.slices
    assert best.cycles >= shape.macs / peak and 0 < best.utilization <= 1
    assert all(cost(c, shape, M).cycles >= best.cycles for c in candidates(shape, M)[:50])


IR = """
func.func @f(%x: tensor<512x32xbf16>, %w: tensor<32x8xbf16>) -> tensor<512x8xf32> {
  %xs = tcp.load %x : tensor<512x32xbf16> -> tensor<512x32xbf16>
  %ws = tcp.load %w : tensor<32x8xbf16> -> tensor<32x8xbf16>
  %y = tcp.contract "mk,kn->mn" %xs, %ws : tensor<512x32xbf16>, tensor<32x8xbf16> -> tensor<512x8xf32> MAPPING
  func.return %y : tensor<512x8xf32>
}"""
K_IN_TIME_ATTR = ("{mapping = #tcp.mapping<trf = rhs, slices = [1, 256, 1], lanes = 8, broadcast = 1, packet = 1, "
                  "k_chunk = 32, trf_mode = half>}")


def _module(mapping: str):
    module = Parser(make_context(), IR.replace("MAPPING", mapping)).parse_module()
    module.verify()
    return module


def test_the_pass_changes_only_time_and_the_simulator_costs_the_mapping_given() -> None:
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((512, 32)).astype(ml_dtypes.bfloat16), rng.standard_normal((32, 8)).astype(ml_dtypes.bfloat16)]
    before = _module("")
    after = _module("")
    MapContractionsPass().apply(make_context(), after)
    contract = next(op for op in after.walk() if isinstance(op, tcp.ContractOp))
    assert contract.mapping is not None
    degenerate = _module(K_IN_TIME_ATTR)
    runs = [simulate(m, "f", args, M) for m in (before, after, degenerate)]
    assert_same_bits(list(runs[0].outputs), list(runs[1].outputs))
    assert_same_bits(list(runs[0].outputs), list(runs[2].outputs))
    cycles = [r.report.ops[2].cycles for r in runs]
    fill = M.config_overhead_cycles + M.tree_depth_cycles
    assert cycles[0] == cycles[1] == fill + choose(BMM, M).best.cycles
    assert cycles[2] == fill + 64  # K in Time, as given


def test_a_broken_hand_written_mapping_is_an_error_not_a_traceback(tmp_path, capsys) -> None:
    bad = K_IN_TIME_ATTR.replace("lanes = 8", "lanes = 4").replace("slices = [1, 256, 1]", "slices = [1, 256, 2]")
    path = tmp_path / "bad.mlir"
    path.write_text(IR.replace("MAPPING", bad))
    code, out, err = tcpc_main(capsys, "run", path)
    assert code == 1 and "uses 512 slices" in err and "a cluster has 256" in err and "Traceback" not in err


@pytest.mark.parametrize("example", ["toy", "qwen3_moe_fp8"])
def test_mapping_an_example_never_changes_a_value(example: str) -> None:
    """The examples' IR before and after map-contractions, on the same inputs: the same bits."""
    program = tcpc.compile_file(EXAMPLES / f"{example}.moe")
    before = program.lower(",".join(FULL_PIPELINE[:-1]))
    after = apply_pipeline(before, parse_pipeline("map-contractions"))
    mapped = [op for op in after.walk() if isinstance(op, tcp.ContractOp | tcp.ScaledContractOp)]
    assert mapped and all(op.mapping is not None for op in mapped)
    name = program.graph_names[0]
    inputs = prepare_inputs(program.function(), {}, 5)
    assert_same_bits(list(run_function(before, name, inputs)), list(run_function(after, name, inputs)))


def test_the_report_names_each_contractions_mapping(capsys, tmp_path) -> None:
    out_json = tmp_path / "r.json"
    code, out, err = tcpc_main(capsys, "run", EXAMPLES / "mixtral.moe", "--report", "--report-ops", "0",
                               "--report-json", out_json)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("contraction: ")]
    assert any("router mk,kn->mn f32" in line and "vector engine" in line and "bound by vector fma" in line
               for line in lines)
    experts = [line for line in lines if line.startswith("contraction: experts gbd,gdf->gbf")]
    assert experts and all("Slice [" in line and "Packet [" in line and "runner-up" in line for line in experts)
    records = json.loads(out_json.read_text())["contractions"]
    assert {r["phase"] for r in records} == {"router", "experts"}
    assert all(0 < r["utilization"] <= 1 and r["cycles"] > 0 and r["commands"] >= 1 for r in records)
