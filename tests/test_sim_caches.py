"""What the simulator reuses across loop iterations, and the speed benchmark on a toy layer.

The pinned simulations (tests/test_sim_pinned.py) show the reuse changes no result; these tests
show it happens: an op in a loop is costed once per distinct value of its data operands, a
reused weight tile is widened once while it lives, and the dependency graph is built only when
asked for.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import networkx as nx
import numpy as np
import pytest
from benchmark_scripts import load_script
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation

import tcpc
import tcpc.autotune
from runtime_sim.perf import cost_model
from runtime_sim.perf.costs import register_cost_models
from runtime_sim.semantics.numerics import bfloat16
from runtime_sim.semantics.tcp_semantics import WidenedOperands
from tcpc.pipelines import pipeline_spec

speed = load_script("sim_speed")
TOY = speed.bench.Model("toy", "toy", dict(D=8, F=16, E=4, K=2))


def counting_costs(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> Counter[str]:
    """Count the calls of the cost functions of the ops `names`."""
    register_cost_models()
    calls: Counter[str] = Counter()
    for name in names:
        fn = cost_model._COSTS[name]

        def counted(op: Any, operands: Any, results: Any, machine: Any, fn: Any = fn) -> Any:
            calls[op.name] += 1
            return fn(op, operands, results, machine)

        monkeypatch.setitem(cost_model._COSTS, name, counted)
    return calls


def test_an_op_in_a_loop_is_costed_once_per_value_of_its_data_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once per value of what its cost reads of them (a guard's sign, the rows a load moves)."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 256, "B": 4})
    # the expert loop a block at a time: many iterations of few ops (groups of blocks are the reverse)
    pipeline = program.full_pipeline().replace("schedule-experts{order=auto}", "schedule-experts{order=block}")
    program.passes(pipeline, graph="qwen3_moe", routing="skewed")  # strategy=auto costs whole runs: before counting
    monkeypatch.setattr(tcpc.autotune, "_compiled", {})  # and the run is made here, not taken from the choice's
    calls = counting_costs(monkeypatch, ("tcp.contract", "tile.gather", "ve.chain", "tile.load_expert"))
    result = program.simulate(cost_only=True, routing="skewed", pipeline=pipeline)
    executed = Counter(r.name for r in result.report.ops)
    module = program.lower(result.pipeline)  # as simulated: pin-routing, the strategy chosen
    static = Counter(op.name for op in module.walk())
    assert executed["tcp.contract"] > 5 * static["tcp.contract"]  # loops run the same ops many times
    # ve.chain reads no values: one cost per op of the IR
    assert calls["ve.chain"] <= static["ve.chain"] < executed["ve.chain"]
    # a block's row gather reads its indices (which rows, how many valid): costed per value
    assert 0 < calls["tile.gather"] <= executed["tile.gather"] and static["tile.gather"] < executed["tile.gather"]
    # a guarded contraction's cost reads of its guard, the block's expert id, only whether it is
    # -1 (cost_model.register_cost_key): at most two costs per op, a block run or skipped,
    # rather than one per expert (E = 16 here); an expert's weight tile load, the rows it moves
    assert calls["tcp.contract"] <= 2 * static["tcp.contract"] and 2 * calls["tcp.contract"] < executed["tcp.contract"]
    assert calls["tile.load_expert"] <= 2 * static["tile.load_expert"] < executed["tile.load_expert"]


def _read_only_tile(i: int) -> np.ndarray:
    tile = np.arange(6, dtype=np.float32).reshape(2, 3).astype(bfloat16) + i
    tile.flags.writeable = False
    return tile


def test_a_read_only_bf16_operand_is_widened_once_while_it_lives() -> None:
    widened = WidenedOperands(spares=1)
    tiles = [_read_only_tile(i) for i in range(6)]  # more than a few, as a loop iteration reads
    copies = [widened(t) for t in tiles]
    assert all(w.dtype == np.float32 and np.array_equal(w, t.astype(np.float32)) for t, w in zip(tiles, copies))
    assert all(widened(t) is w for t, w in zip(tiles, copies))  # every one kept, reused
    assert len(widened) == 6
    last = copies[-1]
    del tiles[-1], copies[-1]  # the tile dies: its copy is dropped, its memory kept for the next
    assert len(widened) == 5
    fresh = _read_only_tile(9)
    wide = widened(fresh)
    assert wide is last and np.array_equal(wide, fresh.astype(np.float32))  # rewritten in place
    writeable = tiles[0].copy()
    with pytest.raises(AssertionError):
        widened(writeable)  # its values may change under a copy: never kept


def test_expert_weight_tiles_are_read_only_and_results_unchanged() -> None:
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 64})
    tiles: list[np.ndarray] = []

    class Tiles:
        def will_interpret_op(self, op: Any, args: Any) -> None:
            pass

        def did_interpret_op(self, op: Any, results: Any) -> None:
            if op.name == "tile.load_expert":
                tiles.append(results[0])

    result = program.simulate(seed=4, listeners=[Tiles()])
    assert tiles and not any(t.flags.writeable for t in tiles)
    reference = program.run(seed=4, reference=True)
    np.testing.assert_array_equal(result.outputs[0], reference.outputs[0])


def test_the_graph_is_built_when_asked_for() -> None:
    result = tcpc.compile_file("examples/toy.moe").simulate(cost_only=True)
    assert "graph" not in vars(result.schedule)  # not built by the simulation
    graph = result.graph
    assert graph is result.graph  # built once
    assert graph.number_of_nodes() == len(result.report.ops)
    assert all(graph.nodes[k]["end"] == result.report.op(k).end for k in result.report.critical_path)


def test_the_speed_benchmark_rows_and_table() -> None:
    rows = [speed.cost_only_row(TOY, 16, {**TOY.dims, "T": 16, "B": 2}),
            speed.values_row(TOY, 16, dims={**TOY.dims, "T": 16, "B": 2})]
    assert [r.mode for r in rows] == ["cost-only", "values"]
    assert rows[0].ops > 0 and rows[1].ops > 0
    lines = speed.table(rows).splitlines()
    assert lines[0] == "| family | T | B | mode | ops simulated | wall s | CPU s | note |"
    assert [line.split("|")[4].strip() for line in lines[2:]] == ["cost-only", "values"]


def test_the_schedule_speed_rows_and_table() -> None:
    """`sim_speed.py --schedule`'s row: a schedule.md row timed by stage (the stages add up to
    its CPU seconds), with the simulations of every choice counted."""
    toy = speed.bench.Model("mixtral", "toy Mixtral", dict(D=64, F=128, E=8, K=2))
    row = speed.schedule_speed(toy, 16)
    assert row.cycles > 0 and row.block > 0 and row.peak_rss_mb > 0
    assert row.simulations >= 1  # the row's own run, and the choices' candidates not costed before
    assert all(row.stages[s] >= 0 for s in speed.STAGES[:-1]) and row.stages["compile"] > 0
    assert abs(sum(row.stages.values()) - row.cpu_seconds) < 1e-6
    lines = speed.schedule_table([row]).splitlines()
    assert lines[0].startswith("| model | T | B | simulated cycles | run s | CPU s | peak RSS MB | simulations |")
    assert "toy Mixtral" in lines[2]
    from tcpc import autotune
    assert autotune.apply_pipeline.__module__ == "tcpc.pipelines"  # the stage clock put it back


class _EveryOp(Interpreter.Listener):
    """A listener that sees every op run: a cost-only run then interprets every iteration."""

    def __init__(self) -> None:
        self.ops = 0

    def did_interpret_op(self, op: Operation, results: Any) -> None:
        self.ops += 1


class _Counting(_EveryOp):
    """One that takes a count of the ops run without it: loops may then copy iterations."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0

    def did_skip_ops(self, count: int) -> None:
        self.skipped += count


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_loop_iterations_that_read_no_values_are_copied_not_interpreted(routing: str) -> None:
    """The rank top-k's loop over token tiles reads no values for its costs: a cost-only run
    interprets a few of its iterations and records the rest as copies of the last, moved on
    (runtime_sim/perf/cost_only.py LoopReplay); the report is that of a run interpreting all."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"D": 2048, "F": 768, "E": 128, "K": 8, "T": 1024, "B": 128})
    pipeline = pipeline_spec(topk_strategy="rank", expert_order="block")  # ten tiles of 96 tokens
    copying, interpreting = _Counting(), _EveryOp()
    copied = program.simulate(cost_only=True, routing=routing, pipeline=pipeline, listeners=[copying])
    interpreted = program.simulate(cost_only=True, routing=routing, pipeline=pipeline, listeners=[interpreting])
    assert copying.skipped > 0
    assert copying.ops + copying.skipped == interpreting.ops
    assert copied.report.to_json() == interpreted.report.to_json()
    assert copied.report.chrome_trace() == interpreted.report.chrome_trace()
    assert nx.utils.graphs_equal(copied.graph, interpreted.graph)


def test_iterations_that_skip_every_guarded_block_are_not_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """An expert loop runs over the worst case's blocks, of which balanced routing fills the
    first 64 of 191 here: once an iteration has skipped every block it guards and passed its
    arguments on, a later one whose guards skip too runs the same ops (cost_only.GuardProbe),
    and is not interpreted; the report is that of a run interpreting each of them."""
    from runtime_sim.perf import cost_only

    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"D": 2048, "F": 768, "E": 128, "K": 8, "T": 1024, "B": 128})
    pipeline = pipeline_spec(topk_strategy="rank", expert_order="block")
    monkeypatch.setattr(cost_only.IterationProbe, "of", staticmethod(lambda loop: None))  # which takes them too
    probed, unprobed = _Counting(), _Counting()
    fast = program.simulate(cost_only=True, routing="balanced", pipeline=pipeline, listeners=[probed])
    monkeypatch.setattr(cost_only.GuardProbe, "of", staticmethod(lambda loop: None))
    slow = program.simulate(cost_only=True, routing="balanced", pipeline=pipeline, listeners=[unprobed])
    assert probed.ops + probed.skipped == unprobed.ops + unprobed.skipped
    # Most of the unused blocks' iterations (each cluster's slice, guard and branch, the yields): 558 ops.
    assert probed.skipped - unprobed.skipped >= 400
    assert fast.report.to_json() == slow.report.to_json()
    assert fast.report.chrome_trace() == slow.report.chrome_trace()


def test_a_loop_templates_appended_iterations_are_its_copies() -> None:
    """LoopTemplate.append moves on only what the loop made (commands from its first, buffers
    from its first buffer), each command's waits and reads split once into what stays and what
    moves; a command reading an operand streamed from HBM is copied whole. Every appended
    command is LoopTemplate.copy's."""
    from types import SimpleNamespace

    from runtime_sim.perf.op_trace import LoopTemplate, Trace, TracedOp

    cost = cost_model.OpCost("dma", 10)
    before = TracedOp(0, "tcp.load", "%w = tcp.load", cost, writes=(0,))
    made = TracedOp(1, "tcp.dma", "%a = tcp.dma", cost, deps=(0,), reads=(0,), writes=(1,))
    reader = TracedOp(2, "tcp.contract", "%b = tcp.contract", cost, deps=(0, 1), reads=(0, 1), writes=(2,))
    streamed = TracedOp(3, "tcp.contract", "tcp.contract", cost, deps=(2,), reads=(2,),
                        hbm_reads=(("%w", 64, (0, 2)),))
    trace = Trace([before, made, reader, streamed], {0: 64, 1: 32, 2: 32}, {0: "%w", 1: "%a", 2: "%b"})
    template = LoopTemplate(SimpleNamespace(trace=trace), None, 1, 1, 1, 4, 1, 3, [])  # type: ignore[arg-type]
    for n in (1, 2):
        template.append(n)
    assert trace.ops[4:] == [template.copy(t, n) for n in (1, 2) for t in trace.ops[1:4]]
    assert trace.ops[5].deps == (0, 4) and trace.ops[5].reads == (0, 3) and trace.ops[9].hbm_reads == (("%w", 64, (0, 8)),)
    assert [trace.buffer_labels[b] for b in range(3, 7)] == ["%a", "%b", "%a", "%b"] and trace.buffer_bytes[6] == 32


def test_a_routed_loops_pieces_share_the_first_pieces_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """interleave-shared cuts the routed loop into pieces whose bodies are clones: each piece's
    ops are costed as the first piece's (op_trace.cloned_loop_ops), so a contraction is costed
    once per kind of block for the whole loop, not once per piece; the report is that of a run
    that costs each piece's ops apart."""
    from runtime_sim.perf import op_trace
    from xdsl.dialects import scf

    program = tcpc.compile_file("examples/llama4.moe", dims={"T": 256, "D": 16, "FS": 1100, "B": 4})
    pipeline = pipeline_spec(topk_strategy="rank", expert_order="block")
    calls = counting_costs(monkeypatch, ("tcp.contract",))
    shared = program.simulate(cost_only=True, pipeline=pipeline)
    shared_calls = calls["tcp.contract"]
    assert shared.module is not None
    loops = [op for op in shared.module.walk() if isinstance(op, scf.ForOp) and op_trace.cloned_loop_ops(op)]
    assert len(loops) == 2  # the three pieces' last two
    assert all(isinstance(op_trace.cloned_loop_ops(loop)[loop.body.block.first_op], Operation) for loop in loops)
    monkeypatch.setattr(op_trace, "cloned_loop_ops", lambda loop: {})
    apart = program.simulate(cost_only=True, pipeline=pipeline)
    assert shared_calls + len(loops) <= calls["tcp.contract"] - shared_calls
    assert shared.report.to_json() == apart.report.to_json()
    assert shared.report.chrome_trace() == apart.report.chrome_trace()


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_iterations_that_read_what_an_earlier_one_read_are_not_interpreted(monkeypatch: pytest.MonkeyPatch,
                                                                            routing: str) -> None:
    """An iteration of a routed loop's piece whose guards and costed reads, worked out from its
    index and arguments (cost_only.IterationProbe.key), are an earlier iteration's takes that
    one's ops and is not interpreted; the report, trace and graph are those of a run that
    interprets them. Iterations that read otherwise (skewed routing: blocks of other row
    counts, blocks that do not run) have other keys: iterations of one key record one signature."""
    from runtime_sim.perf import cost_only

    program = tcpc.compile_file("examples/llama4.moe", dims={"T": 256, "D": 16, "FS": 1100, "B": 4})
    pipeline = pipeline_spec(topk_strategy="rank", expert_order="block")
    keys: list[Any] = []
    signatures: dict[Any, set[Any]] = {}
    taken: list[Any] = []
    key, ran, yields = cost_only.IterationProbe.key, cost_only.IterationProbe.ran, cost_only.IterationProbe.yields

    def keyed(self: Any, *args: Any) -> Any:
        keys.append(key(self, *args))
        return keys[-1]

    def interpreted(self: Any, events: Any, signature: Any, *args: Any) -> Any:
        signatures.setdefault((self.loop, keys[-1]), set()).add(signature)
        return ran(self, events, signature, *args)

    monkeypatch.setattr(cost_only.IterationProbe, "key", keyed)
    monkeypatch.setattr(cost_only.IterationProbe, "ran", interpreted)
    monkeypatch.setattr(cost_only.IterationProbe, "yields", lambda self, *args: taken.append(1) or yields(self, *args))
    probed, unprobed = _Counting(), _Counting()
    fast = program.simulate(cost_only=True, routing=routing, pipeline=pipeline, listeners=[probed])
    monkeypatch.setattr(cost_only.IterationProbe, "of", staticmethod(lambda loop: None))
    slow = program.simulate(cost_only=True, routing=routing, pipeline=pipeline, listeners=[unprobed])
    assert len(taken) > 0 and probed.skipped > unprobed.skipped
    assert probed.ops + probed.skipped == unprobed.ops + unprobed.skipped
    assert all(len(s) == 1 for s in signatures.values())
    assert len({s for loop_signatures in signatures.values() for s in loop_signatures}) > 1
    assert fast.report.to_json() == slow.report.to_json()
    assert fast.report.chrome_trace() == slow.report.chrome_trace()
    assert nx.utils.graphs_equal(fast.graph, slow.graph)
