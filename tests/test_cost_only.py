"""Cost-only simulation (runtime_sim/perf/cost_only.py): routing scenarios, the pin-routing pass,
shape-only values, and agreement with the full simulation."""

from __future__ import annotations

import re
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from lowered_moe import moe_ir, moe_source
from xdsl.parser import Parser

import tcpc
from dialects.annotations import ROUTING_ATTR, routing_arguments
from runtime_sim.perf.cost_model import NotLoweredError
from runtime_sim.perf.cost_only import CostOnlyError, Placeholder, placeholder, simulate_cost_only
from runtime_sim.perf.routing_scenarios import RoutingError, scenario_choices, skewed
from runtime_sim.perf.simulate import simulate
from runtime_sim.semantics.tolerance import compare_output
from tcpc.pipelines import make_context
from tcpc.program import print_ir

EXAMPLES = Path(__file__).parent.parent / "examples"
DIMS = dict(t=16, d=64, f=128, e=8, k=2, b=4)


def lowered(**dims: int) -> tcpc.Program:
    return tcpc.load_ir(moe_ir(**{**DIMS, **dims}))


# --- scenarios -------------------------------------------------------------------------------


def counts(choices: np.ndarray, experts: int) -> np.ndarray:
    return np.bincount(choices.reshape(-1), minlength=experts)


def test_scenarios() -> None:
    b = scenario_choices("balanced", 20, 3, 8)
    assert b.shape == (20, 3) and b.dtype == np.int32
    assert counts(b, 8).max() - counts(b, 8).min() <= 1
    one = scenario_choices("one-expert", 20, 3, 8)
    assert (one == [0, 1, 2]).all()
    s = scenario_choices("skewed", 2000, 2, 8, seed=5)
    c = counts(s, 8)
    assert c[0] == c.max() and c[0] > 2 * c[7]  # Zipf-like: expert 0 the most popular
    np.testing.assert_array_equal(s, skewed(2000, 2, 8, seed=5))  # deterministic in the seed
    assert not np.array_equal(s, skewed(2000, 2, 8, seed=6))
    for choices in (b, one, s):
        assert all(len(set(row)) == len(row) for row in choices.tolist())  # K distinct experts


def test_scenario_files_and_errors(tmp_path: Path) -> None:
    choices = np.array([[1, 0], [3, 2]], np.int64)
    np.savez(tmp_path / "one.npz", anything=choices)
    np.savez(tmp_path / "named.npz", experts=choices, other=np.zeros(3))
    np.save(tmp_path / "plain.npy", choices)
    for name in ("one.npz", "named.npz", "plain.npy"):
        np.testing.assert_array_equal(scenario_choices(tmp_path / name, 2, 2, 4), choices)
    np.savez(tmp_path / "two.npz", a=choices, b=choices)
    np.savez(tmp_path / "dup.npz", experts=np.array([[1, 1], [0, 2]]))
    np.savez(tmp_path / "range.npz", experts=np.array([[1, 4], [0, 2]]))
    np.savez(tmp_path / "float.npz", experts=choices.astype(np.float32))
    cases = {
        "two.npz": "name the expert choices 'experts'",
        "dup.npz": "token 0 chooses one expert twice",
        "range.npz": "must lie in [0, 4)",
        "float.npz": "must be integers",
        "one.npz": "the routing needs [3, 2]",
        "missing.npz": "no such file",
    }
    for name, message in cases.items():
        with pytest.raises(RoutingError, match=re.escape(message)):
            scenario_choices(tmp_path / name, 3 if name == "one.npz" else 2, 2, 4)
    with pytest.raises(RoutingError, match="unknown routing 'zipf'"):
        scenario_choices("zipf", 2, 2, 4)
    with pytest.raises(RoutingError, match="impossible"):
        scenario_choices("balanced", 2, 5, 4)


# --- pin-routing -----------------------------------------------------------------------------


def test_pin_routing_makes_the_scatter_indices_an_argument() -> None:
    program = tcpc.compile_file(EXAMPLES / "toy.moe")
    pinned = program.lower("pin-routing")
    fn = next(op for op in pinned.ops if op.sym_name.data == "toy")
    assert routing_arguments(fn) == {4: 4}
    arg = fn.body.blocks.first.args[4]
    assert arg.name_hint == "routing" and str(arg.type) == "tensor<4x2xi32>"
    scatter = next(op for op in fn.walk() if op.name == "moe.scatter")
    order = scatter.operands[1].owner  # the routing, once the router's indices are made
    assert order.name == "tcp.order" and order.operands[0] is arg
    assert order.operands[1] is next(op for op in fn.walk() if op.name == "moe.topk").results[1]
    text = print_ir(pinned)
    assert f"%routing: tensor<4x2xi32> {{{ROUTING_ATTR} = 4 : i64}}" in text
    # idempotent, round-trips through the generic form, and survives lowering
    assert print_ir(program.lower("pin-routing,pin-routing")) == text
    generic = Parser(make_context(), print_ir(pinned, generic=True)).parse_module()
    assert generic.is_structurally_equivalent(pinned)
    after = program.lower("pin-routing,lower-topk")
    assert routing_arguments(next(op for op in after.ops if op.sym_name.data == "toy")) == {4: 4}
    # the pinned graph runs with a routing of our choosing
    result = tcpc.load_ir(text).run({"routing": np.array([[3, 1], [0, 2], [1, 0], [2, 3]])}, seed=0)
    assert result.outputs[0].shape == (4, 8)


# --- cost-only runs --------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["balanced", "skewed", "one-expert", "file"])
def test_cost_only_equals_the_full_simulation(scenario: str, tmp_path: Path) -> None:
    """Given the routing the full simulation used, cost-only mode reports the same cycles,
    op by op, without computing a value."""
    program = lowered()
    if scenario == "file":
        choices = np.stack([np.random.default_rng(i).choice(8, 2, replace=False) for i in range(16)])
        np.savez(tmp_path / "route.npz", experts=choices)
        scenario = str(tmp_path / "route.npz")
    else:
        choices = scenario_choices(scenario, 16, 2, 8, seed=4)
    full = program.simulate({"routing": choices}, seed=1)
    cost = program.simulate(cost_only=True, routing=scenario, seed=4)
    assert cost.outputs == [] and cost.inputs == {} and cost.cost_only
    np.testing.assert_array_equal(cost.routing["routing"].choices, choices)
    assert cost.report.total_cycles == full.report.total_cycles
    keys = ("label", "engine", "start", "end", "cycles", "bytes", "hbm_bytes", "flops", "bound")
    assert [[getattr(o, k) for k in keys] for o in cost.report.ops] == [[getattr(o, k) for k in keys] for o in full.report.ops]
    assert cost.report.peak_sram_bytes == full.report.peak_sram_bytes


def ops_by_time(report) -> list[tuple[str, int, int]]:
    """A report's commands as (label, start, end), without pin-routing's `tcp.order` (free, and
    only in the pinned program)."""
    return [(o.label, o.start, o.end) for o in report.ops if o.label != "%routing_ready = tcp.order"]


def test_cost_only_of_a_graph_with_its_router_equals_the_full_simulation(tmp_path: Path) -> None:
    """With the router in the program, pin-routing's routing stands in for its indices: read
    from their buffer once they are made (no load of its own), the same commands at the same
    cycles as the full simulation that computed them."""
    program = tcpc.compile_file(EXAMPLES / "toy.moe")
    full = program.simulate(seed=0)
    np.savez(tmp_path / "route.npz", experts=np.concatenate([r.choices for r in full.trace.routings]))
    cost = program.simulate(cost_only=True, routing=tmp_path / "route.npz")
    assert ops_by_time(cost.report) == ops_by_time(full.report)
    assert cost.report.total_cycles == full.report.total_cycles


def test_a_collective_reading_the_pinned_routing_waits_for_the_router(tmp_path: Path) -> None:
    """On a mesh the ids' all-gather runs on the link, not behind the router in the vector
    engine's issue order: with a link fast enough to be free before the router's top-k ends
    (10 cycles of latency, an assumption of this test), it starts only once the chip's top-k
    indices are made, and the cost-only run matches the full one chip by chip, op by op."""
    from target.mesh_machine import load_mesh_machine
    from tcpc.mesh_run import MeshSpec, simulate_on_mesh

    program = tcpc.compile_file(EXAMPLES / "toy.moe", dims={"T": 8, "E": 8})
    spec, fast = MeshSpec.parse("ep=2,sp=2"), replace(load_mesh_machine(), link_latency_cycles=10)
    full = simulate_on_mesh(program, spec, seed=3, machine=fast)
    logits = full.inputs["x"].astype(np.float32) @ full.inputs["router"]  # softmax keeps the order
    np.savez(tmp_path / "route.npz", experts=np.argsort(-logits, axis=1, kind="stable")[:, :2])
    cost = simulate_on_mesh(program, spec, cost_only=True, routing=tmp_path / "route.npz", machine=fast)
    for chip in cost.report.chips:
        top_e = next(o for o in chip.ops if o.label.startswith("%top_e"))
        ids = next(o for o in chip.ops if o.label == "%experts_row = ccl.all_gather")
        x_row = next(o for o in chip.ops if o.label == "%x_row = ccl.all_gather")
        assert x_row.end < top_e.end <= ids.start  # the link was free before the router was done
    assert [ops_by_time(c) for c in cost.report.chips] == [ops_by_time(c) for c in full.report.chips]
    assert cost.report.total_cycles == full.report.total_cycles


def test_the_handwritten_lowering_computes_the_reference() -> None:
    """The test IR is a faithful lowering: the simulation's outputs agree with the graph-level
    scatter / grouped_matmul / combine on the same routing (its combine is one contraction
    over K, whose accumulation order differs from combine's in-order sum, so within the
    --check tolerance rather than bit for bit)."""
    reference = tcpc.compile_source(moe_source(**DIMS))
    for scenario in ("balanced", "skewed", "one-expert"):
        choices = scenario_choices(scenario, 16, 2, 8, seed=2)
        got = lowered().simulate({"routing": choices}, seed=7).outputs[0]
        want = reference.run({"routing": choices}, seed=7).outputs[0]
        assert compare_output(0, got, want).ok


def weight_bytes(report) -> int:
    return next(o.hbm_bytes for o in report.ops if o.label.startswith("%wg"))


def test_one_expert_reads_fewer_weights_than_balanced() -> None:
    program = lowered()
    reports = {s: program.simulate(cost_only=True, routing=s).report for s in ("balanced", "skewed", "one-expert")}
    per_expert = 64 * 128 * 2
    assert weight_bytes(reports["one-expert"]) == 2 * per_expert  # K = 2 experts, each read once
    assert weight_bytes(reports["balanced"]) == 8 * per_expert  # every expert
    assert weight_bytes(reports["one-expert"]) < weight_bytes(reports["skewed"]) <= weight_bytes(reports["balanced"])


@pytest.mark.parametrize("scenario", ["balanced", "skewed", "one-expert"])
def test_more_tokens_never_fewer_cycles(scenario: str) -> None:
    cycles = [lowered(t=t).simulate(cost_only=True, routing=scenario).report.total_cycles for t in (4, 8, 16, 32, 64)]
    assert cycles == sorted(cycles), cycles
    assert cycles[-1] > cycles[0]


def test_cycle_counts_are_deterministic() -> None:
    first = lowered().simulate(cost_only=True, routing="skewed", seed=3).report
    again = lowered().simulate(cost_only=True, routing="skewed", seed=3).report
    assert first.to_json() == again.to_json()


def test_placeholders_take_no_memory() -> None:
    from xdsl.dialects.builtin import TensorType, bf16

    p = placeholder(TensorType(bf16, [256, 7168, 2048]), frozenset(["%w"]))
    assert isinstance(p, Placeholder) and p.nbytes == 256 * 7168 * 2048 * 2 and p.strides == (0, 0, 0)
    assert p.sources == {"%w"}


def test_a_placeholder_is_shared_and_read_only() -> None:
    """One placeholder per type and sources serves every op that makes one (an unrolled loop
    makes tens of thousands), which is sound because nothing can write it."""
    from xdsl.dialects.builtin import TensorType, bf16, f32

    p = placeholder(TensorType(bf16, [4, 8]), frozenset(["%x"]))
    assert placeholder(TensorType(bf16, [4, 8]), frozenset(["%x"])) is p
    assert placeholder(TensorType(bf16, [4, 8])) is not p and placeholder(TensorType(f32, [4, 8])) is not p
    with pytest.raises(ValueError, match="read-only"):
        p[0, 0] = 1


def test_real_model_sizes_need_no_memory() -> None:
    """DeepSeek-V3's layer at its real dims (the routed experts alone are 22 GB in bf16): the
    graph after pin-routing and lower-topk runs cost-only in a few MB."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe",
                                dims=dict(T=64, D=7168, F=2048, FS=2048, E=256, K=8, NG=8, TG=4, B=16))
    tracemalloc.start()
    try:
        result = program.simulate(cost_only=True, pipeline="lower-topk", uncosted="free", routing="skewed")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MB"
    assert result.report.total_cycles > 0 and result.outputs == []
    assert result.routing["routing"].choices.shape == (64, 8)
    assert any(o.name == "ve.filter" for o in result.report.ops)


def test_costs_that_need_unpinned_values_are_refused() -> None:
    """Indices given as plain arguments: cost-only mode has no values for them and says so."""
    text = """
    func.func @f(%x: tensor<8x64xbf16>, %ti: tensor<4x2xi32>) -> tensor<4x2x64xbf16> {
      %xl = tcp.load %x : tensor<8x64xbf16> -> tensor<8x64xbf16>
      %xb = tcp.dma_gather %xl[%ti] : tensor<8x64xbf16>, tensor<4x2xi32> -> tensor<4x2x64xbf16>
      func.return %xb : tensor<4x2x64xbf16>
    }"""
    module = Parser(make_context(), text).parse_module()
    with pytest.raises(CostOnlyError, match=r"%xb = tcp.dma_gather depends on the values of its operand %ti, "
                                            r"which is computed from input\(s\) %ti"):
        simulate_cost_only(module, "f")
    # The same IR simulates normally with values.
    simulate(module, "f", [np.zeros((8, 64), np.float32).astype("bfloat16"), np.zeros((4, 2), np.int32)])


def test_cost_only_refuses_unlowered_ir_unless_told() -> None:
    program = tcpc.compile_file(EXAMPLES / "toy.moe")
    with pytest.raises(NotLoweredError, match="moe.scatter"):
        program.simulate(cost_only=True, pipeline="lower-topk")
    free = program.simulate(cost_only=True, pipeline="lower-topk", uncosted="free")
    assert free.pipeline == "pin-routing,lower-topk" and free.report.total_cycles > 0
    with pytest.raises(tcpc.CompileError, match="takes no inputs"):
        program.simulate({"x": np.zeros((4, 8))}, cost_only=True, pipeline="lower-topk")


def test_routing_free_ir_needs_no_scenario() -> None:
    text = """
    func.func @f(%a: tensor<512x1024xbf16>, %b: tensor<1024x1024xbf16>) -> tensor<512x1024xf32> {
      %la = tcp.load %a : tensor<512x1024xbf16> -> tensor<512x1024xbf16>
      %lb = tcp.load %b : tensor<1024x1024xbf16> -> tensor<1024x1024xbf16>
      %c = tcp.contract "mk,kn->mn" %la, %lb : tensor<512x1024xbf16>, tensor<1024x1024xbf16> -> tensor<512x1024xf32>
      func.return %c : tensor<512x1024xf32>
    }"""
    program = tcpc.load_ir(text)
    cost = program.simulate(cost_only=True)
    full = program.simulate()
    assert cost.routing == {} and cost.report.total_cycles == full.report.total_cycles


def test_pin_routing_tags_a_routing_input_and_keeps_names_unique() -> None:
    source = """
    graph g(x: f32[4, 2], routing: i32[4, 1], e: i32[4, 1]) -> f32[4, 2] {
        xb, r = scatter(x, routing, experts=2, block=1)
        yb, r2 = scatter(x, e * 1, experts=2, block=1)
        return combine(xb, r) + combine(yb, r2)
    }
    """
    pinned = tcpc.compile_source(source).lower("pin-routing")
    fn = next(iter(pinned.ops))
    assert routing_arguments(fn) == {1: 2, 3: 2}  # the input is tagged; a new argument for the other
    assert [a.name_hint for a in fn.body.blocks.first.args] == ["x", "routing", "e", "routing1"]
    assert "%routing: tensor<4x1xi32> {tcpc.routing_experts = 2 : i64}" in print_ir(pinned)


def test_a_run_stops_at_its_bar() -> None:
    """cost_only_run(bound_above=bar): once the lower bound of the commands recorded so far
    (LowerBoundBar: their roofline, their busiest unit's cycles) is above the bar, the run
    stops with that bound, which is above the bar and at most the simulated cycles; with the
    bar at the whole run's bound or above, it runs in full. Here the tensor units bound the
    run above its roofline."""
    from runtime_sim.perf.cost_only import LowerBoundBar, cost_only_run
    from runtime_sim.perf.simulate import layer_roofline
    from target.machine import default_machine
    from tcpc.pipelines import COST_ONLY_PASSES, apply_pipeline, parse_pipeline, pipeline_spec

    machine = default_machine()
    program = tcpc.compile_file(EXAMPLES / "mixtral.moe", {"T": 256, "D": 256, "F": 512, "B": 16})
    spec = ",".join([*COST_ONLY_PASSES, pipeline_spec(topk_strategy="rank", expert_order="block")])
    module = apply_pipeline(program.module, parse_pipeline(spec), machine=machine)
    full = cost_only_run(module, "mixtral", machine, keep_below=float("inf"))
    assert full.trace is not None and not full.bound
    roof = layer_roofline(machine, full.trace, None).cycles
    least = LowerBoundBar(machine, float("inf")).least(full.trace)
    assert roof < least <= full.cycles
    for bar in (0.0, roof, least - 1):
        stopped = cost_only_run(module, "mixtral", machine, bound_above=bar)
        assert stopped.bound and stopped.trace is None
        assert bar < stopped.cycles <= full.cycles
    for bar in (least, float(full.cycles)):
        assert cost_only_run(module, "mixtral", machine, bound_above=bar) == cost_only_run(module, "mixtral", machine)


def test_routing_tables_are_let_go_once_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy value whose readers are all symbolic ops of its own block is let go once they have
    run and the thunks made of it have computed (cost_only._Thunk): the routing's [T K, E]
    tables then live a few at a time, not all through the run; the cycles are the same."""
    from runtime_sim.perf import cost_only
    from runtime_sim.perf.cost_only import cost_only_run
    from runtime_sim.perf.value_memo import VALUES
    from target.machine import default_machine
    from tcpc.pipelines import COST_ONLY_PASSES, apply_pipeline, parse_pipeline, pipeline_spec

    machine = default_machine()
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe", dims=dict(T=512, D=64, F=32, FS=32, E=64, B=64))
    spec = ",".join([*COST_ONLY_PASSES, pipeline_spec(topk_strategy="rounds", expert_order="block")])
    module = apply_pipeline(program.module, parse_pipeline(spec), machine=machine)
    computed: list[cost_only._Thunk] = []
    compute = cost_only._Thunk.compute

    def held_most() -> int:
        """The most bytes the computed thunks' values held at once."""
        most = 0

        def counted(thunk: cost_only._Thunk) -> None:
            nonlocal most
            compute(thunk)
            computed.append(thunk)
            most = max(most, sum(getattr(v, "nbytes", 0) for t in computed for v in t.values or ()))

        computed.clear()
        VALUES.clear()  # each run computes its values (none taken from the run before)
        monkeypatch.setattr(cost_only._Thunk, "compute", counted)
        cycles = cost_only_run(module, "deepseek_v3", machine).cycles
        assert cycles == expected
        return most

    expected = cost_only_run(module, "deepseek_v3", machine).cycles
    let_go = held_most()
    assert any(t.values == () for t in computed)
    monkeypatch.setattr(cost_only._Thunk, "release", lambda thunk: None)
    kept = held_most()
    table = 512 * 8 * 64 * 4  # [T K, E] i32
    assert let_go + 3 * table <= kept, (let_go, kept, table)


def test_values_remembered_across_runs_give_the_same_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run after another of the same routing takes the values its costs and branches read
    from `VALUES` (value_memo.py) and computes none of them; its report is the one a run
    computing everything makes, and so is that of a run of another routing or block size
    after it (other values: other keys)."""
    from runtime_sim.perf import cost_only
    from runtime_sim.perf.value_memo import VALUES
    from target.machine import default_machine
    from tcpc.pipelines import COST_ONLY_PASSES, apply_pipeline, parse_pipeline, pipeline_spec

    machine = default_machine()
    spec = ",".join([*COST_ONLY_PASSES, pipeline_spec(topk_strategy="rounds", expert_order="block")])
    modules = {b: apply_pipeline(tcpc.compile_file(EXAMPLES / "deepseek_v3.moe",
                                                   dims=dict(T=64, D=64, F=32, FS=32, E=16, K=4, B=b)).module,
                                 parse_pipeline(spec), machine=machine) for b in (4, 8)}
    computed: list[str] = []
    compute = cost_only._Thunk.compute

    def counted(thunk: cost_only._Thunk) -> None:
        computed.append(thunk.op.name)
        compute(thunk)

    monkeypatch.setattr(cost_only._Thunk, "compute", counted)

    def report(routing: str, block: int, fresh: bool) -> str:
        if fresh:
            VALUES.clear()
        return simulate_cost_only(modules[block], "deepseek_v3", machine, routing=routing, seed=1).report.to_json()

    first = report("balanced", 8, fresh=True)
    computed.clear()
    hits = VALUES.hits
    assert report("balanced", 8, fresh=False) == first
    assert VALUES.hits > hits and "ve.scan" not in computed, computed  # the routing's index generation not run again
    for routing, block in (("skewed", 8), ("balanced", 4)):
        warm = report(routing, block, fresh=False)
        assert warm == report(routing, block, fresh=True) != first
