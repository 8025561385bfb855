"""The full pipeline (the lowering passes, then the schedule level) end to end: what the
lowered IR holds, and that simulating it computes the reference, deterministically, never below
the roofline (which counts the router and the kept pairs, the padding apart), over every example
and over random dims and routings."""

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

import tcpc
from tcpc.pipelines import FULL_PIPELINE, LOWERED_PIPELINE, SCHEDULE_PIPELINE

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.moe"))
LOWERED_DIALECTS = {"func", "tcp", "ve", "builtin"}
SCHEDULED_DIALECTS = LOWERED_DIALECTS | {"tile", "scf", "arith"}


def test_the_default_pipeline_is_the_full_lowering_then_the_schedule_level() -> None:
    assert LOWERED_PIPELINE == ("lower-topk", "lower-routing", "lower-dispatch", "lower-quant", "lower-math",
                                "load-arguments")
    assert SCHEDULE_PIPELINE == ("schedule-shared", "schedule-experts", "schedule-tokens", "split-router-k",
                                 "split-clusters", "fuse-ve-chains", "map-contractions", "interleave-shared",
                                 "interleave-chunks", "return-waves")
    assert FULL_PIPELINE == LOWERED_PIPELINE + SCHEDULE_PIPELINE


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_lowered_ir_holds_only_engine_ops_and_the_branch_logger_cumsum(path: Path) -> None:
    program = tcpc.compile_file(path)
    lowered = program.lower(",".join(LOWERED_PIPELINE))
    assert {op.name.split(".")[0] for op in lowered.walk()} <= LOWERED_DIALECTS
    ops = list(program.lower().walk())
    assert {op.name.split(".")[0] for op in ops} <= SCHEDULED_DIALECTS
    scans = [op for op in ops if op.name == "ve.scan"]
    assert scans, "routing needs cumsums"
    for scan in scans:  # each cumsum is the branch logger's guarded add over a position tag
        assert scan.tags.owner.name == "ve.position_tag"
        assert tuple(scan.read.get_values()) == (1, 2) and tuple(scan.write.get_values()) == (0, 1)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_simulates_to_its_reference(path: Path) -> None:
    program = tcpc.compile_file(path)
    want = program.run(seed=3).outputs
    first = program.simulate(seed=3)
    second = program.simulate(seed=3)
    for got, ref in zip(first.outputs, want):
        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    assert first.report.total_cycles == second.report.total_cycles
    assert first.report.total_cycles >= first.report.roofline.cycles > 0


LAYER = """
dims T = {t}, D = {d}, F = {f}, E = {e}, K = {k}, B = {b}
graph layer(x: bf16[T, D], router: f32[D, E], w_up: bf16[E, D, F], w_down: bf16[E, F, D])
        -> (bf16[T, D], i32[T, K]) {{
    probs = softmax(f32(x) @ router)
    top_p, top_e = topk(probs, K)
    xb, route = scatter(x, top_e, experts=E, block=B{capacity})
    h = silu(grouped_matmul(xb, w_up, route))
    return combine(grouped_matmul(h, w_down, route), route, bf16(top_p)), top_e
}}
"""


@st.composite
def layers(draw: st.DrawFn) -> tuple[str, dict[str, np.ndarray]]:
    t = draw(st.integers(1, 9))
    e = draw(st.integers(1, 8))
    k = draw(st.integers(1, e))
    d, f = draw(st.sampled_from([(4, 8), (8, 4)]))
    capacity = draw(st.none() | st.integers(1, t))
    b = draw(st.integers(1, min(t, capacity or t)))
    cap = "" if capacity is None else f", capacity={capacity}"
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    router = rng.standard_normal((d, e)).astype(np.float32)
    scenario = draw(st.sampled_from(["random", "ties", "one-expert", "nan-token", "inf-logit"]))
    x = rng.standard_normal((t, d)).astype(np.float32)
    if scenario == "ties":  # every score equal: lower expert ids win, every token on experts 0..K-1
        router[:] = 0
    elif scenario == "one-expert":  # router collapse onto the last expert
        router[:, -1] = 50.0
        x = np.abs(x)
    elif scenario == "nan-token":  # a padding row of NaN gives NaN scores; K distinct experts still
        x[draw(st.integers(0, t - 1))] = np.nan
    elif scenario == "inf-logit":
        router[0, 0] = np.inf
    source = LAYER.format(t=t, d=d, f=f, e=e, k=k, b=b, capacity=cap)
    return source, {"x": x, "router": router}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
def test_random_layers_simulate_to_the_reference(layer: tuple[str, dict[str, np.ndarray]]) -> None:
    source, inputs = layer
    program = tcpc.compile_source(source)
    want = program.run(inputs, seed=1).outputs
    sim = program.simulate(inputs, seed=1)
    out, top_e = sim.outputs
    np.testing.assert_array_equal(top_e, want[1])  # routing is bit-identical
    assume(not np.isnan(want[0].astype(np.float32)).all())
    np.testing.assert_array_equal(out.view(np.uint16), want[0].view(np.uint16))
    assert sim.report.total_cycles >= sim.report.roofline.cycles
    # The roofline counts the router and the kept pairs; the padding, each expert's last block's rest.
    dims, capacity = program.dims, re.search(r"capacity=(\d+)", source)
    kept = np.bincount(want[1].reshape(-1), minlength=dims["E"])
    kept = np.minimum(kept, int(capacity.group(1))) if capacity else kept
    per_pair = 2 * dims["D"] * dims["F"] * 2  # the up and the down projection
    assert sim.report.roofline.flops == 2 * dims["T"] * dims["D"] * dims["E"] + int(kept.sum()) * per_pair
    assert sim.report.roofline.padding.flops == int((-(-kept // dims["B"]) * dims["B"] - kept).sum()) * per_pair


def test_planned_ir_carries_the_simulated_schedule() -> None:
    program = tcpc.compile_file(EXAMPLES[0])
    planned = program.planned(seed=3)
    report = program.simulate(seed=3).report
    slots = [op.attributes["tcpc.plan"] for op in planned.walk() if "tcpc.plan" in op.attributes]
    # no spills or streams at these dims, so every command is an IR op's execution; an op in a
    # loop runs once per iteration and carries the slot of its last execution
    assert not report.spills and not report.streams
    ran = {(r.engine, r.start, r.end) for r in report.ops}
    assert 0 < len(slots) <= len(report.ops)
    for slot in slots:
        assert (slot.data["engine"].data, slot.data["start"].value.data, slot.data["end"].value.data) in ran
    assert max(s.data["end"].value.data for s in slots) <= report.total_cycles


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_engines_read_arguments_only_through_loads(path: Path) -> None:
    """After the full pipeline no contraction or vector op reads a function argument (HBM):
    DMA commands and views do, everything else reads a tcp.load's copy."""
    lowered = tcpc.compile_file(path).lower()
    fn = next(iter(lowered.ops))
    readers_of = {arg: [use.operation.name for use in arg.uses] for arg in fn.body.blocks.first.args}
    allowed = {"tcp.dma_gather", "tcp.dma_scatter", "tcp.load", "tcp.view", "ve.broadcast", "ve.bitcast",
               "tile.load_expert", "tile.load", "tile.gather"}
    for arg, names in readers_of.items():
        assert set(names) <= allowed, (arg.name_hint, names)
        assert names.count("tcp.load") <= 1


def test_load_arguments_keeps_the_values() -> None:
    """Execution test of load-arguments: the IR before and after the pass, same inputs."""
    from xdsl.parser import Parser

    from runtime_sim.semantics.executor import run_function
    from tcpc.pipelines import apply_pipeline, make_context, parse_pipeline

    text = (Path(__file__).parent / "filecheck" / "lowering" / "load_arguments" / "args.mlir").read_text()
    before = Parser(make_context(), text).parse_module()
    after = apply_pipeline(before, parse_pipeline("load-arguments"))
    assert sum(op.name == "tcp.load" for op in after.walk()) == 2
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((3, 8, 2)).astype(np.float32),
            np.array([2, 0, -1], np.int32), rng.standard_normal(8).astype(np.float32)]
    (want,), (got,) = run_function(before, "f", args), run_function(after, "f", args)
    np.testing.assert_array_equal(got, want)


class _BreakOneContraction(ModulePass):
    """Gives the first tcp.contract a spec its operands do not fit (a pass with a bug)."""

    name = "break-one-contraction"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        contract = next(o for o in op.walk() if o.name == "tcp.contract")
        contract.properties["spec"] = StringAttr("zmk,kn->mn")


class _BreakOneChain(ModulePass):
    """Makes the last ve.chain yield its first input rather than its last op's result (every
    other chain as it was)."""

    name = "break-one-chain"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        chain = [o for o in op.walk() if o.name == "ve.chain"][-1]
        block = chain.regions[0].blocks[0]
        assert block.last_op is not None
        block.last_op.operands = [block.args[0]]


def test_each_pass_is_verified_where_it_changed_the_ir(monkeypatch: pytest.MonkeyPatch) -> None:
    """apply_pipeline verifies after every pass only the ops the pass made or changed (and the
    ops they are nested in), and still catches a broken op, and a broken chain among chains
    of the same ops."""
    from xdsl.ir import Operation

    from tcpc.pipelines import apply_pipeline, parse_pipeline

    verified: list[Operation] = []
    marks: list[int] = []

    class ChangeNothing(ModulePass):
        """Changes nothing; notes how many ops were verified before it ran."""

        name = "change-nothing"

        def apply(self, ctx: Context, op: ModuleOp) -> None:
            marks.append(len(verified))

    verify = Operation.verify

    def counting(self: Operation, verify_nested_ops: bool = True) -> None:
        verified.append(self)
        verify(self, verify_nested_ops)

    lowered = tcpc.compile_file(EXAMPLES[0]).lower()
    monkeypatch.setattr(Operation, "verify", counting)
    apply_pipeline(lowered, [ChangeNothing(), ChangeNothing(), ChangeNothing()])
    first, second = verified[marks[0]:marks[1]], verified[marks[1]:marks[2]]
    assert len(first) > 300  # every op of the lowered mixtral (but repeated ones)
    chains = sum(o.name == "ve.chain" for o in lowered.walk())
    assert sum(o.name == "ve.chain" for o in first) < chains  # chains of the same ops once
    assert [o.name for o in second] == ["builtin.module"]  # after a pass that changed nothing: the module alone
    with pytest.raises(VerifyException, match="does not match operand ranks"):
        apply_pipeline(lowered, [ChangeNothing(), _BreakOneContraction()])
    with pytest.raises(VerifyException, match="ve.chain yields"):
        apply_pipeline(lowered, [ChangeNothing(), _BreakOneChain()])
    assert apply_pipeline(lowered, parse_pipeline("map-contractions")).is_structurally_equivalent(lowered)


def test_verify_modes_each_last_none() -> None:
    """`verify="each"` stops at the pass that broke the IR; "last" verifies once, after the last
    pass, so a break before it is still caught; "none" (a candidate the cost model drops)
    does not verify, and tcpc/autotune.py verifies the candidate it keeps when it hands it over."""
    from tcpc.autotune import _Compiled, _compiled, take_compiled
    from tcpc.pipelines import apply_pipeline

    seen: list[str] = []

    class Note(ModulePass):
        """Notes that it ran (after a broken pass: the IR was not verified in between)."""

        name = "note"

        def apply(self, ctx: Context, op: ModuleOp) -> None:
            seen.append(self.name)

    lowered = tcpc.compile_file(EXAMPLES[0]).lower()
    with pytest.raises(VerifyException, match="does not match operand ranks"):
        apply_pipeline(lowered, [_BreakOneContraction(), Note()])
    assert seen == []
    with pytest.raises(VerifyException, match="does not match operand ranks"):
        apply_pipeline(lowered, [_BreakOneContraction(), Note()], verify="last")
    assert seen == ["note"]
    broken = apply_pipeline(lowered, [_BreakOneContraction(), Note()], verify="none")
    # The kept candidate's IR is verified as it is handed over, so a broken one cannot be run.
    from target.machine import default_machine
    from tcpc.program import print_ir

    machine = default_machine()
    program = (print_ir(lowered), repr(machine))
    _compiled[program] = _Compiled(1, (), broken, None, ())
    try:
        with pytest.raises(VerifyException, match="does not match operand ranks"):
            take_compiled(lowered, [], machine)
    finally:
        _compiled.pop(program, None)
