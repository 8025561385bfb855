"""lower-routing is checked by translation validation: the IR before and after the pass, run on
the same inputs, gives bit-identical routing plans (scatter_idx, expert_ids) and outputs, on
random dims and routings with the edge cases (one expert takes every pair, empty experts, K = E,
K = 1, T = 1, B = 1, T*K not a multiple of B, capacity drops), on every example, and after
lower-topk on scores with ties. Routings the reference rejects run without faults and give a
plan that stays inside the static buffers."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import ModuleOp
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation
from xdsl.parser import Parser
from xdsl.utils.exceptions import InterpretationError

import tcpc
from dialects import moe, tcp, tile, ve
from passes.lowering.lower_routing import LowerRoutingPass, blocks_per_expert_bound, pair_limit
from runtime_sim.semantics.executor import run_function
from runtime_sim.semantics.moe_semantics import RoutePlan, route_plan
from tcpc.arrays import prepare_inputs
from tcpc.pipelines import PASSES, apply_pipeline, make_context, parse_pipeline
from support import assert_same_bits

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.moe"))
D = 3


class PlanRecorder(Interpreter.Listener):
    """Keeps every routing plan a run makes, from `moe.scatter` or from `moe.route`."""

    def __init__(self) -> None:
        self.plans: list[RoutePlan] = []

    def did_interpret_op(self, op: Operation, results: Any) -> None:
        if isinstance(op, moe.ScatterOp):
            self.plans.append(results[1])
        elif isinstance(op, moe.RouteOp):
            self.plans.append(results[0])


def run_recording(module: ModuleOp, name: str, args: list[np.ndarray]) -> tuple[tuple[Any, ...], list[RoutePlan]]:
    recorder = PlanRecorder()
    outputs = run_function(module, name, args, listeners=[recorder])
    return outputs, recorder.plans


def assert_same_plan(got: RoutePlan, want: RoutePlan) -> None:
    for field in ("scatter_idx", "expert_ids"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == np.int32 and g.shape == w.shape, (field, g.dtype, g.shape, w.shape)
        assert np.array_equal(g, w), f"{field} differ\nwant {w!r}\ngot  {g!r}"
    assert got.block == want.block


def route_type(t: int, k: int, e: int, b: int, c: int | None) -> moe.RouteType:
    return moe.RouteType.make(t, k, e, b, c)


@cache
def modules(t: int, k: int, e: int, b: int, c: int | None,
            pipeline: str = "lower-routing") -> tuple[ModuleOp, ModuleOp]:
    """@f(x [T, D] f32, expert_idx [T, K]) -> the blocked tokens, before and after the pass."""
    r = route_type(t, k, e, b, c)
    g = r.blocks.data
    rt = f"!moe.route<T = {t}, K = {k}, E = {e}, B = {b}, G = {g}" + (f", C = {c}>" if c else ">")
    text = (
        f"func.func @f(%x: tensor<{t}x{D}xf32>, %idx: tensor<{t}x{k}xi32>) -> tensor<{g}x{b}x{D}xf32> {{\n"
        f"  %xb, %route = moe.scatter %x, %idx : tensor<{t}x{D}xf32>, tensor<{t}x{k}xi32> "
        f"-> tensor<{g}x{b}x{D}xf32>, {rt}\n"
        f"  func.return %xb : tensor<{g}x{b}x{D}xf32>\n}}"
    )
    before = Parser(make_context(), text).parse_module()
    before.verify()
    return before, apply_pipeline(before, parse_pipeline(pipeline))


def tokens(t: int) -> np.ndarray:
    return (np.arange(t * D, dtype=np.float32) + 1).reshape(t, D)


def check_routing(idx: np.ndarray, e: int, b: int, c: int | None, pipeline: str = "lower-routing") -> RoutePlan:
    """The lowered plan and blocked tokens equal the reference's bit for bit; returns the plan."""
    t, k = idx.shape
    before, after = modules(t, k, e, b, c, pipeline)
    assert not ops_named(after, moe.ScatterOp)
    x = tokens(t)
    want_out, want_plans = run_recording(before, "f", [x, idx])
    got_out, got_plans = run_recording(after, "f", [x, idx])
    assert len(want_plans) == len(got_plans) == 1
    assert_same_plan(got_plans[0], want_plans[0])
    assert_same_plan(got_plans[0], route_plan(idx, route_type(t, k, e, b, c)))
    assert np.array_equal(got_out[0], want_out[0])
    return got_plans[0]


def ops_named(module: ModuleOp, cls: type) -> list:
    return [op for op in module.walk() if isinstance(op, cls)]


# ---------------------------------------------------------------------------------------------
# Routings

STYLES = ("random", "one_set", "few", "descending", "first")


def routing(t: int, k: int, e: int, style: str, seed: int) -> np.ndarray:
    """Valid routings (K distinct experts in [0, E) per token):
    `random`: any K experts; `one_set`: every token picks the same K experts (K = 1: every pair
    on one expert); `few`: experts drawn from K or K+1 of them, the rest empty; `descending`:
    random, each row in descending expert order; `first`: experts 0..K-1 in a random order."""
    rng = np.random.default_rng(seed)
    if style == "one_set":
        row = rng.permutation(e)[:k]
        return np.tile(row, (t, 1)).astype(np.int32)
    if style == "few":
        pool = rng.permutation(e)[: min(e, k + 1)]
        return np.stack([rng.permutation(pool)[:k] for _ in range(t)]).astype(np.int32)
    if style == "first":
        return np.stack([rng.permutation(k) for _ in range(t)]).astype(np.int32)
    rows = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    return -np.sort(-rows, axis=-1) if style == "descending" else rows


@st.composite
def routing_cases(draw: st.DrawFn) -> tuple:
    e = draw(st.one_of(st.integers(1, 12), st.integers(1, 48)))
    k = draw(st.one_of(st.integers(1, min(e, 3)), st.integers(1, min(e, 8)), st.just(e), st.just(1)))
    t = draw(st.one_of(st.integers(1, 12), st.integers(1, 40), st.just(1)))
    c = draw(st.one_of(st.none(), st.integers(1, t + 2)))
    most = t if c is None else min(t, c)
    b = draw(st.one_of(st.integers(1, max(1, most)), st.just(1), st.integers(1, t + 2)))
    style = draw(st.sampled_from(STYLES))
    seed = draw(st.integers(0, 2**32 - 1))
    return t, k, e, b, c, style, seed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_cases())
def test_lowered_routing_is_bit_identical(case: tuple) -> None:
    t, k, e, b, c, style, seed = case
    check_routing(routing(t, k, e, style, seed), e, b, c)


@pytest.mark.parametrize(
    "t, k, e, b, c, style",
    [
        (1, 1, 1, 1, None, "random"),      # one pair, one expert: single-element scans
        (1, 3, 5, 1, None, "random"),      # T = 1
        (6, 4, 4, 2, None, "random"),      # K = E: every expert takes every token
        (6, 4, 4, 4, 3, "random"),         # K = E with a capacity
        (9, 1, 4, 3, None, "one_set"),     # every pair on one expert, K = 1
        (7, 1, 6, 2, None, "one_set"),     # ... and T*K not a multiple of B
        (8, 2, 8, 3, None, "few"),         # empty experts
        (5, 3, 7, 1, None, "descending"),  # B = 1
        (11, 2, 5, 4, None, "random"),     # T*K = 22, B = 4
        (9, 1, 3, 2, 4, "one_set"),        # capacity drops: C < T
        (9, 2, 3, 2, 5, "random"),
        (6, 2, 4, 2, 6, "random"),         # C = T: nothing drops
        (6, 2, 4, 2, 9, "one_set"),        # C > T
        (10, 3, 3, 3, 2, "first"),         # every expert over capacity
    ],
)
def test_edge_cases(t: int, k: int, e: int, b: int, c: int | None, style: str) -> None:
    for seed in range(3):
        check_routing(routing(t, k, e, style, seed), e, b, c)


def test_capacity_drop_order() -> None:
    """Later tokens drop first; within a token its choices in k order."""
    idx = np.array([[0, 1], [1, 0], [0, 2], [1, 0]], dtype=np.int32)
    plan = check_routing(idx, 3, 1, 2)
    # expert 0 keeps pairs (0,0) and (1,1); expert 1 keeps (0,1) and (1,0); expert 2 keeps (2,1).
    assert plan.scatter_idx.tolist() == [[0, 2], [3, 1], [-1, 4], [-1, -1]]
    assert plan.expert_ids.tolist()[:5] == [0, 0, 1, 1, 2]


def test_worst_case_routing_fills_every_block() -> None:
    """A routing that needs all G blocks: one pair on each of E-1 experts, the rest on one."""
    t, k, e, b = 9, 1, 4, 2
    idx = np.array([[1], [2], [3]] + [[0]] * 6, dtype=np.int32)
    plan = check_routing(idx, e, b, None)
    assert (plan.expert_ids >= 0).all() and plan.expert_ids.shape[0] == route_type(t, k, e, b, None).blocks.data


def test_block_range_bound() -> None:
    """R = ceil(min(T, C) / B), the most blocks one expert can own, and never above G."""
    assert blocks_per_expert_bound(route_type(16, 2, 8, 4, None)) == 4
    assert blocks_per_expert_bound(route_type(16, 2, 8, 4, 5)) == 2
    assert blocks_per_expert_bound(route_type(4096, 8, 256, 64, None)) == 64
    for t, k, e, b, c in [(1, 1, 1, 1, None), (5, 2, 2, 5, None), (9, 3, 3, 2, 20), (7, 1, 7, 3, 1)]:
        r = route_type(t, k, e, b, c)
        assert 1 <= blocks_per_expert_bound(r) <= r.blocks.data


# ---------------------------------------------------------------------------------------------
# Routings the reference rejects


def assert_plan_in_bounds(plan: RoutePlan, idx: np.ndarray, e: int, b: int) -> None:
    """Indices in [-1, G*B), distinct rows, and each kept pair in a block of its own expert."""
    g = plan.expert_ids.shape[0]
    rows = plan.scatter_idx.reshape(-1)
    assert ((rows >= -1) & (rows < g * b)).all()
    assert ((plan.expert_ids >= -1) & (plan.expert_ids < e)).all()
    kept = rows[rows >= 0]
    assert len(set(kept.tolist())) == kept.size
    experts = idx.reshape(-1)[rows >= 0]
    assert np.array_equal(plan.expert_ids[kept // b], experts)


@pytest.mark.parametrize("c", [None, 3])
def test_out_of_range_experts_are_dropped(c: int | None) -> None:
    idx = np.array([[0, 9], [-1, 1], [1, 4], [2, 0]], dtype=np.int32)
    before, after = modules(4, 2, 4, 2, c)
    with pytest.raises(InterpretationError, match="outside"):
        run_function(before, "f", [tokens(4), idx])
    _, (plan,) = run_recording(after, "f", [tokens(4), idx])
    assert (plan.scatter_idx[(idx < 0) | (idx >= 4)] == -1).all()
    valid = (idx >= 0) & (idx < 4)
    assert (plan.scatter_idx[valid] >= 0).all()
    assert_plan_in_bounds(plan, idx, 4, 2)


@pytest.mark.parametrize("c", [None, 2, 5])
def test_repeated_experts_stay_inside_the_buffers(c: int | None) -> None:
    """Every token picks expert 1 three times: T*K pairs on one expert, more than G blocks hold."""
    t, k, e, b = 6, 3, 4, 2
    idx = np.ones((t, k), dtype=np.int32)
    before, after = modules(t, k, e, b, c)
    with pytest.raises(InterpretationError, match="more than once"):
        run_function(before, "f", [tokens(t), idx])
    _, (plan,) = run_recording(after, "f", [tokens(t), idx])
    assert_plan_in_bounds(plan, idx, e, b)
    kept = int((plan.scatter_idx >= 0).sum())
    assert kept == min(t * k, pair_limit(route_type(t, k, e, b, c)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_cases(), st.integers(-2, 2))
def test_any_indices_give_a_plan_inside_the_buffers(case: tuple, spread: int) -> None:
    """Repeats and out-of-range indices anywhere: no fault, and the plan stays consistent."""
    t, k, e, b, c, _, seed = case
    idx = np.random.default_rng(seed).integers(-1 - abs(spread), e + spread + 1, size=(t, k)).astype(np.int32)
    _, after = modules(t, k, e, b, c)
    _, (plan,) = run_recording(after, "f", [tokens(t), idx])
    assert_plan_in_bounds(plan, idx, e, b)
    assert (plan.scatter_idx[(idx < 0) | (idx >= e)] == -1).all()


def test_a_repeat_that_fits_counts_twice() -> None:
    idx = np.array([[2, 2], [0, 1], [1, 2]], dtype=np.int32)
    _, after = modules(3, 2, 3, 1, None)
    _, (plan,) = run_recording(after, "f", [tokens(3), idx])
    assert plan.scatter_idx.tolist() == [[3, 4], [0, 1], [2, 5]]
    assert_plan_in_bounds(plan, idx, 3, 1)


# ---------------------------------------------------------------------------------------------
# The op sequence and the pass interface


def test_op_sequence_and_cumsums() -> None:
    _, after = modules(5, 2, 4, 2, 3)
    new = [op for op in after.walk() if op.name.split(".")[0] in ("ve", "tcp", "moe")]
    assert {op.name.split(".")[0] for op in new} == {"ve", "tcp", "moe"}
    assert [op.name for op in new if not op.name.startswith("ve.")] == [
        "tcp.view", "tcp.view", "tcp.view", "moe.route", "moe.dispatch"]
    scans = ops_named(after, ve.ScanOp)
    assert len(scans) == 2
    for scan in scans:
        tags = scan.tags.owner
        assert isinstance(tags, ve.PositionTagOp) and tags.pattern == (0, 1, 2, 3)
        assert tags.axis.value.data == scan.axis.value.data == 0
        assert scan.kind.data == ve.ScanKind.ADD
        assert tuple(scan.read.get_values()) == (1, 2) and tuple(scan.write.get_values()) == (0, 1)
    names = {op.results[0].name_hint for op in new}
    for name in ("expert_mask", "counts", "kept_counts", "num_blocks", "global_offset", "token_rank",
                 "local_offset", "kept", "scatter_idx", "grid", "expert_ids"):
        assert name in names, name
    (route,) = ops_named(after, moe.RouteOp)
    assert route.scatter_idx.name_hint == "scatter_idx" and route.expert_ids.name_hint == "expert_ids"
    (filt,) = ops_named(after, ve.FilterOp)
    assert filt.result.type.get_shape() == (route_type(5, 2, 4, 2, 3).blocks.data,) and filt.pad.value.data == -1


@pytest.mark.parametrize("t, k, e, b, c, budget", [(1, 8, 128, 1, None, None), (1, 4, 16, 2, 1, None),
                                                   (5, 2, 4, 2, 3, None), (128, 2, 8, 16, None, None),
                                                   (128, 2, 8, 16, None, 10000)])
def test_one_tokens_expert_ids_come_before_the_pairs_offsets(t: int, k: int, e: int, b: int, c: int | None,
                                                             budget: int | None) -> None:
    """The vector engine runs its ops in program order. One token's weight loads need only the
    expert ids, which are made right after the block counts, before any op of the pairs'
    offsets (the cumsum over pairs, its gathers, scatter_idx); with more tokens the loop starts
    from the dispatch, which reads scatter_idx, and the ids come after it (plain, chunked and
    grouped cumsums)."""
    pipeline = "lower-routing" if budget is None else f"lower-routing{{routing_bytes={budget}}}"
    _, after = modules(t, k, e, b, c, pipeline)
    order = list(after.walk())
    (filt,) = ops_named(after, ve.FilterOp)
    (route,) = ops_named(after, moe.RouteOp)
    pairs = [order.index(op) for op in order if op.results and op.results[0].name_hint in
             ("mask_cumsum", "packed_cumsum", "token_rank", "pair_packed", "pair_row", "scatter_idx")]
    counts = [order.index(op) for op in order if op.results and op.results[0].name_hint in
              ("counts", "kept_counts", "carried_counts")]
    assert pairs and counts and route.expert_ids is filt.result
    if t == 1:
        assert max(counts) < order.index(filt) < min(pairs)
    else:
        assert order.index(filt) > max(pairs)


@pytest.mark.parametrize("t, k, e, b, c", [(1, 8, 128, 1, None), (1, 4, 16, 2, 1), (4, 2, 8, 8, None),
                                           (6, 3, 5, 4, 3), (5, 2, 4, 2, 3)])
def test_one_block_an_expert_makes_the_ids_from_the_counts(t: int, k: int, e: int, b: int, c: int | None) -> None:
    """With one block at most an expert (R = 1: T or the capacity at most B) an expert's
    blocks are whether it has a pair: the ids are the experts with a positive count, compacted
    (a tag and a filter after the histogram), with no block grid; otherwise the grid."""
    _, after = modules(t, k, e, b, c)
    names = [op.results[0].name_hint for op in after.walk() if op.results]
    one = blocks_per_expert_bound(route_type(t, k, e, b, c)) == 1
    assert ("grid" in names) is not one and ("block_start" in names) is not one
    if one:
        assert names[names.index("expert_ids") - 2:names.index("expert_ids")] == ["has_block", "block_expert"]
    for seed in range(3):
        check_routing(routing(t, k, e, "random", seed), e, b, c)


@pytest.mark.parametrize("path", ["qwen3_moe.moe", "gpt_oss_mxfp4.moe", "deepseek_v3.moe"])
def test_one_tokens_weights_follow_the_routing(path: str) -> None:
    """At T = 1 the graph's math that only the combine reads (the routing weights) moves from
    before the scatter to after its lowered ops, the same ops with the routing pinned
    (cost-only) as without; the layer keeps the reference's bits. At T = 2 nothing moves."""
    for t in (1, 2):
        program = tcpc.compile_file(ROOT / "examples" / path, {"T": t})
        orders = []
        for pipeline in ("lower-topk,lower-routing", "pin-routing,lower-topk,lower-routing"):
            order = list(program.lower(pipeline).walk())
            (combine,) = [o for o in order if isinstance(o, moe.CombineOp)]
            (route,) = [o for o in order if isinstance(o, moe.RouteOp)]
            assert combine.weights is not None
            orders.append(([o.name for o in order if o.dialect_name() == "tmath"],
                           order.index(combine.weights.owner) > order.index(route)))
        assert orders[0] == orders[1]
        assert orders[0][1] is (t == 1)
        for seed in (0, 1):
            ref = program.run(seed=seed)
            got = program.run(seed=seed, reference=False, pipeline="lower-topk,lower-routing")
            assert np.array_equal(got.outputs[0].view(np.uint8), ref.outputs[0].view(np.uint8))


@pytest.mark.parametrize(
    "t, k, e, b, c, style",
    [
        (128, 2, 8, 16, None, "random"),   # P = 256: 8 chunks of 32
        (130, 2, 6, 8, 40, "one_set"),     # P = 260: 10 chunks of 26, a capacity dropping
        (257, 1, 5, 32, None, "few"),      # P = 257, prime: one chunk, the plain scan
        (96, 4, 48, 2, None, "descending"),  # P = 384: 12 chunks of 32, E = 48
    ],
)
def test_chunked_cumsum_is_bit_identical(t: int, k: int, e: int, b: int, c: int | None, style: str) -> None:
    """From MIN_CHUNKED_PAIRS pairs the cumsum over pairs runs in chunks: the plan's bits all
    the same (capacity drops, empty experts, a prime P that keeps one chunk)."""
    from target.chunked_scan import MIN_CHUNKED_PAIRS, scan_chunks

    assert scan_chunks(t * k, e, 2048) == {256: 8, 260: 10, 257: 1, 384: 12}[t * k]
    assert t * k >= MIN_CHUNKED_PAIRS
    for seed in range(2):
        check_routing(routing(t, k, e, style, seed), e, b, c)
    _, after = modules(t, k, e, b, c)
    scans = ops_named(after, ve.ScanOp)
    assert len(scans) == (2 if t * k == 257 else 3)


@pytest.mark.parametrize("c", [None, 7])
@pytest.mark.parametrize("spread", [0, 2])
def test_packed_gather_equals_the_two_gathers(c: int | None, spread: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked, a pair's rank and its expert's first block ride one one-hot gather, packed in
    one i32: the plan is the two gathers' bit for bit, on any indices (repeats, out of range)."""
    import passes.lowering.lower_routing as lower_routing

    t, k, e, b = 130, 3, 6, 4
    rng = np.random.default_rng(spread)
    for idx in (routing(t, k, e, "random", 0), rng.integers(-1 - spread, e + spread, size=(t, k)).astype(np.int32)):
        _, packed = modules(t, k, e, b, c)
        assert [op.result.name_hint for op in ops_named(packed, ve.ReduceSumOp)].count("pair_packed") == 1
        _, (got,) = run_recording(packed, "f", [tokens(t), idx])
        with monkeypatch.context() as m:
            m.setattr(lower_routing, "packing_shift", lambda pairs, blocks: None)
            plain = apply_pipeline(modules(t, k, e, b, c)[0], parse_pipeline("lower-routing"))
        assert not [op for op in ops_named(plain, ve.ReduceSumOp) if op.result.name_hint == "pair_packed"]
        _, (want,) = run_recording(plain, "f", [tokens(t), idx])
        assert_same_plan(got, want)


def test_packing_needs_room_above_the_rank() -> None:
    """The rank takes the bits of P; the first block (at most G) must fit above them in an i32."""
    from passes.lowering.lower_routing import packing_shift

    assert packing_shift(16384, 255) == 15  # Qwen3-30B-A3B, T = 2048
    assert packing_shift(256, 100) == 9
    assert packing_shift(1 << 20, (1 << 10) - 2) == 21 and packing_shift(1 << 20, 1 << 10) is None


def test_chunks_take_the_fewest_scan_steps() -> None:
    """The divisor of P whose scans take the fewest steps, counting the rounds of the target's
    scan rows (RNGD: 2,048); one chunk below MIN_CHUNKED_PAIRS or for a prime P."""
    from target.chunked_scan import scan_chunks, scan_rows_of
    from target.machine import default_machine

    SCAN_ROWS = scan_rows_of(default_machine())
    assert SCAN_ROWS == 256 * 8  # one RNGD cluster's slices x 8 integer ways
    assert scan_chunks(255, 8, SCAN_ROWS) == 1 and scan_chunks(8191, 8, SCAN_ROWS) == 1
    # E = 8: every chunking is one round, P / S + 2 S steps: 8 and 16 chunks tie at 48, the fewer win.
    assert scan_chunks(256, 8, SCAN_ROWS) == 8
    # Qwen3-30B-A3B (E = 128) at T = 4096 and 2048: 16 chunks fill one round of 2,048 rows
    # (2,048 + 32 steps; 128 chunks, the largest divisor below sqrt(P), took 8 rounds of 256, 2,304).
    assert scan_chunks(32768, 128, SCAN_ROWS) == 16 and scan_chunks(16384, 128, SCAN_ROWS) == 16
    # Issue #12's layer (E = 64) at T = 1008 and 1016: 32 chunks each (252 and 254 steps in one
    # round); the rule before took 84 chunks of 96 at P = 8064, three rounds, slower than P = 8128.
    assert scan_chunks(8064, 64, SCAN_ROWS) == 32 and scan_chunks(8128, 64, SCAN_ROWS) == 32
    # Half the rows per round (a smaller machine): 16 chunks of 64 experts fill it.
    assert scan_chunks(8064, 64, SCAN_ROWS // 2) == 16


def test_without_capacity_there_is_no_min() -> None:
    _, after = modules(5, 2, 4, 2, None)
    assert not ops_named(after, ve.MinOp)
    assert [v.type.get_shape() for v in (op.result for op in ops_named(after, tcp.ViewOp))] == [(10,), (5, 2), (12,)]


@pytest.mark.parametrize(
    "t, k, e, b, c, budget, groups",
    [
        (128, 2, 8, 16, None, 10000, 2),   # P = 256: 8 chunks in 2 groups of 4 (9,216 B each)
        (130, 2, 6, 8, 40, 1, 10),         # P = 260: no group fits, one chunk each; a capacity dropping
        (96, 4, 48, 2, None, 60000, 3),    # P = 384: 12 chunks in 3 groups of 4, E = 48
    ],
)
def test_pair_groups_are_bit_identical(t: int, k: int, e: int, b: int, c: int | None, budget: int, groups: int) -> None:
    """When the chunked cumsum's [P, E] tensors exceed `routing_bytes`, the chunks run in groups
    (two passes, a carried histogram, the packed ranks stored group by group): the plan's bits
    all the same, on valid routings and on any indices (repeats, out of range), and no [P, E]
    tensor is left, only the groups' [P / groups, E]."""
    from passes.lowering.lower_routing import pair_groups
    from target.chunked_scan import scan_chunks

    pipeline = f"lower-routing{{routing_bytes={budget}}}"
    assert pair_groups(t * k, e, scan_chunks(t * k, e, 2048), budget) == groups
    rng = np.random.default_rng(groups)
    for idx in (routing(t, k, e, "random", 0), routing(t, k, e, "few", 1),
                rng.integers(-2, e + 2, size=(t, k)).astype(np.int32)):
        want = route_plan(idx, route_type(t, k, e, b, c)) if idx.min() >= 0 else None
        got = check_routing(idx, e, b, c, pipeline) if want is not None else None
        if want is None:  # indices the reference rejects: the one-group plan's bits
            _, (got,) = run_recording(modules(t, k, e, b, c, pipeline)[1], "f", [tokens(t), idx])
            _, (want,) = run_recording(modules(t, k, e, b, c)[1], "f", [tokens(t), idx])
        assert_same_plan(got, want)
    _, after = modules(t, k, e, b, c, pipeline)
    assert len(ops_named(after, tile.StoreOp)) == groups
    sizes = {int(np.prod(r.type.get_shape())) for op in after.walk() if op.name.startswith("ve.") for r in op.results}
    assert t * k // groups * e in sizes and max(sizes) < t * k * e


def test_pair_groups_only_where_the_target_needs_them() -> None:
    """Qwen3-30B-A3B at T = 4096 (P = 32,768 pairs, E = 128, 16 chunks): 36 MB of [P, E]
    tensors fit RNGD's routing share (one group: the program as before), and so do T = 8192's
    72 MB; a 32 MB target's 16 MB takes 4 groups of 9 MB."""
    from passes.lowering.lower_routing import ROUTING_SHARE, group_bytes, pair_groups
    from target.machine import default_machine

    assert group_bytes(32768, 128) == 36 << 20
    assert pair_groups(32768, 128, 16, default_machine().sram_bytes // ROUTING_SHARE) == 1
    assert pair_groups(65536, 128, 16, default_machine().sram_bytes // ROUTING_SHARE) == 1
    assert pair_groups(32768, 128, 16, (32 << 20) // ROUTING_SHARE) == 4


def test_routing_fits_a_tiny_sram(tmp_path: Path) -> None:
    """Issue #28 in small: Qwen3 at P = 256 pairs on 128 B per slice (32 KB in each cluster's
    SRAM, where the routing runs: was 64 B, 32 KB in all, while the clusters' SRAM was one
    pool) needs 2 spills (the one-hot) and a stream (the chunked cumsum) in one group; in groups,
    none, and the simulated outputs keep the reference's bits."""
    machine = tmp_path / "tiny.toml"
    machine.write_text('extends = "rngd"\nname = "tiny"\n[sram]\n'
                       'bytes_per_slice = { value = 128, assumption = "a routing larger than SRAM" }\n')
    program = tcpc.compile_file(ROOT / "examples" / "qwen3_moe.moe", {"T": 64, "K": 4, "B": 8})
    run = program.simulate(seed=3, machine=machine)
    assert not run.report.spills and not run.report.streams
    assert max(run.report.cluster_peak_sram_bytes) <= run.report.machine.cluster_sram_bytes
    assert_same_bits(run.outputs, program.run(seed=3).outputs)
    assert [o for o in run.report.ops if o.name == "tile.store" and o.phase == "routing"]


def test_routing_bytes_must_be_positive() -> None:
    from tcpc.pipelines import PipelineError

    with pytest.raises(PipelineError, match=r"lower-routing: routing_bytes must be positive \(or 0: the target's\), got -5"):
        parse_pipeline("lower-routing{routing_bytes=-5}")


def test_pass_is_registered() -> None:
    assert PASSES["lower-routing"]() is LowerRoutingPass
    (p,) = parse_pipeline("lower-routing")
    assert isinstance(p, LowerRoutingPass)


def test_scan_rows_must_be_positive() -> None:
    """A bad option is the pipeline's error, on one line, before any pass runs."""
    from tcpc.pipelines import PipelineError

    with pytest.raises(PipelineError, match=r"lower-routing: scan_rows must be positive \(or 0: the target's\), got -1"):
        parse_pipeline("lower-routing{scan_rows=-1}")


# ---------------------------------------------------------------------------------------------
# Examples, and after lower-topk


@pytest.mark.parametrize("pipeline", ["lower-routing", "lower-topk,lower-routing"])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_after_lower_routing_equals_its_reference(path: Path, pipeline: str) -> None:
    program = tcpc.compile_file(path)
    lowered = program.lower(pipeline)
    assert not ops_named(lowered, moe.ScatterOp)
    for graph in program.graph_names:
        for seed in (0, 1):
            ref = program.run(seed=seed, graph=graph)
            got = program.run(seed=seed, graph=graph, reference=False, pipeline=pipeline)
            assert len(got.outputs) == len(ref.outputs)
            for g, w in zip(got.outputs, ref.outputs):
                assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8))
            args = prepare_inputs(program.function(graph), {}, seed)
            _, want = run_recording(program.module, graph, args)
            _, have = run_recording(lowered, graph, args)
            assert len(have) == len(want) >= 1
            for h, w in zip(have, want):
                assert_same_plan(h, w)


@pytest.mark.parametrize("path, dims", [
    ("mixtral.moe", {"T": 64, "B": 8}),
    ("qwen3_moe.moe", {"T": 48, "E": 64, "K": 8, "B": 3}),
    ("llama4.moe", {"T": 40, "E": 16, "B": 5}),
])
def test_examples_at_larger_dims(path: str, dims: dict[str, int]) -> None:
    program = tcpc.compile_file(ROOT / "examples" / path, dims)
    lowered = program.lower("lower-topk,lower-routing")
    args = prepare_inputs(program.function(), {}, 3)
    want_out, want = run_recording(program.module, program.graph_names[0], args)
    got_out, have = run_recording(lowered, program.graph_names[0], args)
    assert_same_plan(have[0], want[0])
    assert np.array_equal(got_out[0].view(np.uint16), want_out[0].view(np.uint16))


TIES = """
dims T = 8, D = 4, E = 6, K = 2, B = 2, C = 3
graph g(x: f32[T, D], s: f32[T, E]) -> f32[T, D] {
    _, top_e = topk(s, K)
    xb, route = scatter(x, top_e, experts=E, block=B, capacity=C)
    return combine(xb, route)
}
"""


@pytest.mark.parametrize("dims", [{}, {"C": 8}, {"K": 1, "B": 1}, {"K": 6, "C": 5}, {"T": 1, "C": 1, "B": 1}])
def test_after_lower_topk_with_ties_and_a_capacity(dims: dict[str, int]) -> None:
    """Scores from a pool of three values, so most rows tie; top-k picks by lower index, and
    the routing follows it exactly, with capacity drops."""
    program = tcpc.compile_source(TIES, dims)
    t, e = program.dims["T"], program.dims["E"]
    for seed in range(4):
        rng = np.random.default_rng(seed)
        inputs = {"s": rng.choice(np.float32([0.5, 0.25, -1.0]), size=(t, e))}
        ref = program.run(inputs, seed=seed)
        got = program.run(inputs, seed=seed, reference=False, pipeline="lower-topk,lower-routing")
        assert np.array_equal(got.outputs[0], ref.outputs[0])
        lowered = program.lower("lower-topk,lower-routing")
        args = prepare_inputs(program.function(), inputs, seed)
        (want,), (have,) = run_recording(program.module, "g", args)[1], run_recording(lowered, "g", args)[1]
        assert_same_plan(have, want)
