"""The simulator end to end: scheduling, memory plan, reports, and the properties every
simulation must have (determinism, monotonicity, never below the roofline)."""

import json
from pathlib import Path

import ml_dtypes
import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdsl.parser import Parser

from dialects.moe import max_blocks
from target.machine import Machine, default_machine, load_machine
from runtime_sim.perf.memory_plan import SramOverflowError
from runtime_sim.perf.scheduler import SharedBandwidth, Task, schedule
from runtime_sim.perf.simulate import SimResult, simulate
from tcpc.pipelines import make_context

BF16 = ml_dtypes.bfloat16
UNITS = {"tensor": 1, "dma": 8, "none": None}


def parse(text: str):
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


def run(module, args, machine: Machine | None = None, **kw) -> SimResult:
    """Simulate, and check what must hold for every simulation."""
    result = simulate(module, "f", args, machine, **kw)
    r = result.report
    assert r.total_cycles >= r.roofline.cycles
    assert r.peak_sram_bytes <= r.sram_capacity
    assert r.total_cycles == max((o.end for o in r.ops), default=0)
    if r.ops:
        path = r.critical_path
        assert r.op(path[-1]).end == r.total_cycles
        assert sum(r.op(k).cycles for k in path) == r.total_cycles  # a tight chain of commands
    return result


# --- scheduler ---------------------------------------------------------------------------


def test_engines_overlap_and_one_engine_serialises() -> None:
    s = schedule([Task(0, "a", "tensor", 100), Task(1, "b", "dma", 60)], UNITS)
    assert (s.slots[0].start, s.slots[1].start, s.makespan) == (0, 0, 100)
    s = schedule([Task(0, "a", "tensor", 100), Task(1, "b", "tensor", 60)], UNITS)
    assert (s.slots[1].start, s.makespan) == (100, 160)
    assert s.graph.edges[0, 1]["kind"] == "engine"
    assert s.utilisation("tensor") == 1.0


def test_a_dependent_op_waits_for_its_producer() -> None:
    s = schedule([Task(0, "load", "dma", 600), Task(1, "mm", "tensor", 50, deps=(0,))], UNITS)
    assert s.slots[1].start == 600 and s.makespan == 650
    assert s.critical_path == [0, 1]
    assert s.graph.edges[0, 1]["kind"] == "data"


def test_dma_engines_run_eight_commands_at_once() -> None:
    tasks = [Task(i, f"d{i}", "dma", 500 + i) for i in range(9)]
    s = schedule(tasks, UNITS)
    assert all(s.slots[i].start == 0 for i in range(8))
    assert s.slots[8].start == 500 and s.slots[8].unit == 0
    assert s.busy["dma"] == sum(500 + i for i in range(9))


def test_critical_path_is_the_longest_path() -> None:
    tasks = [Task(0, "x", "dma", 500), Task(1, "w", "dma", 900), Task(2, "mm", "tensor", 40, deps=(0, 1)),
             Task(3, "y", "dma", 10), Task(4, "out", "tensor", 5, deps=(2, 3))]
    s = schedule(tasks, UNITS)
    assert s.critical_path == [1, 2, 4]
    g = s.graph.copy()  # node-weighted longest path, through a sink that adds the last node's cycles
    for u, v in g.edges:
        g.edges[u, v]["w"] = g.nodes[u]["cycles"]
    for n in list(g.nodes):
        g.add_edge(n, "sink", w=g.nodes[n]["cycles"])
    assert nx.dag_longest_path_length(g, weight="w") == s.makespan == 945


# --- a small MoE-shaped program in tcp ops -------------------------------------------------


def moe_ir(t: int, d: int, f: int, e: int, b: int, g: int) -> str:
    return f"""
func.func @f(%x: tensor<{t}x{d}xbf16>, %ti: tensor<{g}x{b}xi32>, %ei: tensor<{g}xi32>,
             %w: tensor<{e}x{d}x{f}xbf16>, %bias: tensor<{g}x1x{f}xf32>) -> tensor<{g}x{b}x{f}xf32> {{
  %xl = tcp.load %x : tensor<{t}x{d}xbf16> -> tensor<{t}x{d}xbf16>
  %xb = tcp.dma_gather %xl[%ti] : tensor<{t}x{d}xbf16>, tensor<{g}x{b}xi32> -> tensor<{g}x{b}x{d}xbf16>
  %wg = tcp.dma_gather %w[%ei] : tensor<{e}x{d}x{f}xbf16>, tensor<{g}xi32> -> tensor<{g}x{d}x{f}xbf16>
  %y = tcp.contract "gbd,gdf->gbf" %xb, %wg bias %bias guard %ei : tensor<{g}x{b}x{d}xbf16>, tensor<{g}x{d}x{f}xbf16> bias tensor<{g}x1x{f}xf32> guard tensor<{g}xi32> -> tensor<{g}x{b}x{f}xf32>
  func.return %y : tensor<{g}x{b}x{f}xf32>
}}"""


def blocks(choices: np.ndarray, e: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """The canonical block layout of a routing: token rows and expert ids
    (docs/architecture.md#the-routing-plan-and-the-block-layout)."""
    t, k = choices.shape
    g = max_blocks(t, k, e, b)
    ti = np.full((g, b), -1, np.int32)
    ei = np.full(g, -1, np.int32)
    block = 0
    for expert in range(e):
        tokens = [p // k for p in range(t * k) if choices.flat[p] == expert]
        for start in range(0, len(tokens), b):
            chunk = tokens[start:start + b]
            ti[block, :len(chunk)] = chunk
            ei[block] = expert
            block += 1
    return ti, ei


def moe_run(choices: np.ndarray, d: int = 64, f: int = 128, e: int = 8, b: int = 4, machine: Machine | None = None) -> SimResult:
    t = choices.shape[0]
    ti, ei = blocks(choices, e, b)
    g = ei.shape[0]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((t, d)).astype(BF16), ti, ei,
            rng.standard_normal((e, d, f)).astype(BF16), np.zeros((g, 1, f), np.float32)]
    return run(parse(moe_ir(t, d, f, e, b, g)), args, machine)


def routing(t: int, e: int = 8, k: int = 2, seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)


def test_outputs_are_the_real_outputs() -> None:
    choices = routing(8)
    result = moe_run(choices)
    ti, ei = blocks(choices, 8, 4)
    y = result.outputs[0]
    for g, expert in enumerate(ei):
        if expert < 0:
            assert (y[g] == 0).all()
    assert np.isfinite(y).all() and (y != 0).any()


def test_more_tokens_never_fewer_cycles() -> None:
    full = routing(64)
    cycles = [moe_run(full[:t]).report.total_cycles for t in (2, 4, 8, 16, 32, 64)]
    assert cycles == sorted(cycles), cycles
    assert cycles[-1] > cycles[0]


def test_more_active_experts_never_less_weight_traffic() -> None:
    weight_bytes = []
    for active in range(1, 9):
        choices = np.array([[t % active] for t in range(16)], np.int32)  # K = 1
        report = moe_run(choices).report
        weight_bytes.append(next(o.hbm_bytes for o in report.ops if o.label.startswith("%wg")))
    assert weight_bytes == sorted(weight_bytes) and weight_bytes[-1] == 8 * weight_bytes[0]


def test_cycle_counts_are_deterministic() -> None:
    first = moe_run(routing(16)).report
    second = moe_run(routing(16)).report
    assert first.to_json() == second.to_json()
    assert first.chrome_trace() == second.chrome_trace()


def test_report_records_and_text() -> None:
    report = moe_run(routing(16)).report
    names = [o.name for o in report.ops]
    # The contraction's bias and guard are arguments, in HBM: the memory plan streams them in.
    assert names == ["tcp.load", "tcp.dma_gather", "tcp.dma_gather", "tcp.load", "tcp.load", "tcp.contract"]
    assert sorted(o.label for o in report.ops[3:5]) == ["stream in %bias", "stream in %ei"]
    mm = report.ops[5]
    assert mm.engine == "tensor" and mm.flops > 0 and mm.start >= max(o.end for o in report.ops[:3] if o.key in (1, 2))
    data = json.loads(json.dumps(report.to_json()))
    for key in ("total_cycles", "clock_hz", "microseconds", "roofline_cycles", "critical_path", "ops", "engines", "peak_sram_bytes"):
        assert key in data
    assert data["microseconds"] == pytest.approx(data["total_cycles"] / 1e3)
    assert {e["name"] for e in data["engines"]} >= {"tensor", "dma"}
    assert set(data["ops"][0]) >= {"engine", "start", "end", "cycles", "bytes", "flops", "bound"}
    text = report.to_text()
    assert "total" in text and "roofline" in text and "%y = tcp.contract" in text and "critical path" in text


def test_chrome_trace_has_one_track_per_engine_unit() -> None:
    report = moe_run(routing(16)).report
    trace = json.loads(json.dumps(report.chrome_trace()))
    events = trace["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "tensor unit 0" in threads.values() and "dma 0" in threads.values()
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(report.ops)
    for e in spans:
        assert e["tid"] in threads and e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 1
    assert {threads[e["tid"]] for e in spans if e["cat"] == "tensor"} == {"tensor unit 0"}
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx(report.microseconds)


def test_compute_bound_contraction_meets_the_roofline_closely() -> None:
    module = parse("""
    func.func @f(%a: tensor<512x1024xbf16>, %b: tensor<1024x1024xbf16>) -> tensor<512x1024xf32> {
      %la = tcp.load %a : tensor<512x1024xbf16> -> tensor<512x1024xbf16>
      %lb = tcp.load %b : tensor<1024x1024xbf16> -> tensor<1024x1024xbf16>
      %c = tcp.contract "mk,kn->mn" %la, %lb : tensor<512x1024xbf16>, tensor<1024x1024xbf16> -> tensor<512x1024xf32>
      func.return %c : tensor<512x1024xf32>
    }""")
    a, b = np.ones((512, 1024), BF16), np.ones((1024, 1024), BF16)
    report = run(module, [a, b]).report
    mm = report.ops[2]
    assert mm.bound == "outer" and mm.cycles == 16 + 5 + 512 * 1024 * 1024 // 65536
    # The roofline is the whole chip's (two clusters): one command on one cluster reaches half of it.
    assert report.roofline.flop_cycles == pytest.approx(512 * 1024 * 1024 * 2 / (2 * 131072))


# --- memory plan ---------------------------------------------------------------------------

SPILL_IR = """
func.func @f(%x: tensor<16x32xf32>) -> tensor<32xf32> {
  %a = tcp.load %x : tensor<16x32xf32> -> tensor<16x32xf32>
  %b = tcp.load %x : tensor<16x32xf32> -> tensor<16x32xf32>
  %c = tcp.load %x : tensor<16x32xf32> -> tensor<16x32xf32>
  %bc = tcp.contract "ij,ij->i" %b, %c : tensor<16x32xf32>, tensor<16x32xf32> -> tensor<16xf32>
  %r = tcp.contract "ij,i->j" %a, %bc : tensor<16x32xf32>, tensor<16xf32> -> tensor<32xf32>
  func.return %r : tensor<32xf32>
}"""


def tiny_machine(tmp_path: Path, sram_bytes: int) -> Machine:
    path = tmp_path / "tiny.toml"
    path.write_text('extends = "rngd"\nname = "tiny"\n'
                    '[chip]\nslices = { value = 1, assumption = "test" }\nclusters = { value = 1, assumption = "test" }\n'
                    f'[sram]\nbytes_per_slice = {{ value = {sram_bytes}, assumption = "test" }}\n')
    return load_machine(path)


def test_sram_overflow_error_names_op_and_bytes(tmp_path: Path) -> None:
    x = np.ones((16, 32), np.float32)  # 2 KB per copy
    with pytest.raises(SramOverflowError, match=r"at %c = tcp.load: it asks for 2,048 bytes, 1,024 of 5,120 bytes are available") as info:
        run(parse(SPILL_IR), [x], tiny_machine(tmp_path, 5120), sram_policy="error")
    assert (info.value.asked, info.value.available) == (2048, 1024)


def test_spill_stores_and_reloads_the_buffer_needed_last(tmp_path: Path) -> None:
    x = np.arange(16 * 32, dtype=np.float32).reshape(16, 32) / 100
    roomy = run(parse(SPILL_IR), [x], tiny_machine(tmp_path, 1 << 20))
    tight = run(parse(SPILL_IR), [x], tiny_machine(tmp_path, 5120))
    np.testing.assert_array_equal(tight.outputs[0], roomy.outputs[0])
    assert not roomy.report.spills
    assert [(s.buffer, s.bytes, s.evicted_at) for s in tight.report.spills] == [("%a", 2048, "%c = tcp.load")]
    labels = [o.label for o in tight.report.ops]
    assert labels.index("spill %a") < labels.index("%c = tcp.load") < labels.index("reload %a") < labels.index("%r = tcp.contract")
    ops = {o.label: o for o in tight.report.ops}
    assert ops["%c = tcp.load"].start >= ops["spill %a"].end
    assert ops["reload %a"].start >= ops["spill %a"].end
    assert ops["spill %a"].hbm_bytes == ops["reload %a"].hbm_bytes == 2048
    assert tight.report.total_cycles > roomy.report.total_cycles
    assert tight.report.peak_sram_bytes <= 5120


def test_an_op_whose_own_buffers_do_not_fit_streams_them_through_hbm(tmp_path: Path) -> None:
    # 3000 bytes: %bc needs %b (spilled, 2 KB) back beside %c (2 KB): it reads %b from HBM in tiles.
    x = np.arange(16 * 32, dtype=np.float32).reshape(16, 32) / 100
    roomy = run(parse(SPILL_IR), [x], tiny_machine(tmp_path, 1 << 20))
    tight = run(parse(SPILL_IR), [x], tiny_machine(tmp_path, 3000))
    np.testing.assert_array_equal(tight.outputs[0], roomy.outputs[0])
    assert [(s.buffer, s.bytes, s.op, s.direction) for s in tight.report.streams] == [
        ("%b", 2048, "%bc = tcp.contract", "in")]
    ops = {o.label: o for o in tight.report.ops}
    assert ops["stream in %b"].engine == "dma" and ops["stream in %b"].hbm_bytes == 2048
    assert ops["stream in %b"].start >= ops["spill %b"].end
    assert ops["%bc = tcp.contract"].start >= ops["stream in %b"].end
    assert ops["stream in %b"].phase == ops["%bc = tcp.contract"].phase
    assert tight.report.total_cycles > roomy.report.total_cycles
    assert tight.report.peak_sram_bytes <= 3000
    with pytest.raises(SramOverflowError, match=r"SRAM overflow at %b = tcp.load: it asks for 2,048 bytes"):
        run(parse(SPILL_IR), [x], tiny_machine(tmp_path, 3000), sram_policy="error")


STREAM_IR = """
func.func @f(%x: tensor<64x32xf32>) -> tensor<32xf32> {
  %a = tcp.load %x : tensor<64x32xf32> -> tensor<64x32xf32>
  %b = ve.mul %a, %a : tensor<64x32xf32>
  %c = ve.add %b, %b : tensor<64x32xf32>
  %d = ve.reduce_sum %c along 0 : tensor<64x32xf32> -> tensor<32xf32>
  %e = ve.reduce_sum %a along 0 : tensor<64x32xf32> -> tensor<32xf32>
  %r = ve.add %d, %e : tensor<32xf32>
  func.return %r : tensor<32xf32>
}"""


def test_results_larger_than_sram_stream_out_and_back_in(tmp_path: Path) -> None:
    """Every 64x32 f32 buffer (8 KB) is larger than a 6 KB SRAM: the load's rows go straight
    into its readers' tiles (fetched again for the second reader), %b and %c are written out
    to HBM and read back in by their readers, and the result is the same."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1000
    roomy = run(parse(STREAM_IR), [x], tiny_machine(tmp_path, 1 << 20))
    tight = run(parse(STREAM_IR), [x], tiny_machine(tmp_path, 6000))
    np.testing.assert_array_equal(tight.outputs[0], roomy.outputs[0])
    assert not roomy.report.streams and not roomy.report.spills
    streams = [(s.buffer, s.op, s.direction) for s in tight.report.streams]
    assert streams == [
        ("%a", "%a = tcp.load", "fused"),
        ("%b", "%b = ve.mul", "out"),
        ("%b", "%c = ve.add", "in"),
        ("%c", "%c = ve.add", "out"),
        ("%c", "%d = ve.reduce_sum", "in"),
    ]
    ops = {o.label: o for o in tight.report.ops}
    order = [o.label for o in tight.report.ops]
    # Stream out after the producer, stream in before the reader; the second reader of %a refetches it.
    assert order.index("%b = ve.mul") < order.index("stream out %b") < order.index("stream in %b") < order.index("%c = ve.add")
    assert ops["stream in %b"].start >= ops["stream out %b"].end
    assert ops["%c = ve.add"].start >= ops["stream in %b"].end
    assert ops["refetch %a"].name == "tcp.load" and ops["refetch %a"].cycles == ops["%a = tcp.load"].cycles
    assert ops["%e = ve.reduce_sum"].start >= ops["refetch %a"].end
    assert ops["stream out %b"].hbm_bytes == ops["stream in %b"].hbm_bytes == 8192
    # Streaming costs time, and never counts in the roofline (the layer's own traffic).
    assert tight.report.total_cycles > roomy.report.total_cycles
    assert tight.report.roofline == roomy.report.roofline
    assert tight.report.peak_sram_bytes <= 6000
    data = tight.report.to_json()
    assert data["streams"][1] == {"buffer": "%b", "bytes": 8192, "op": "%b = ve.mul", "direction": "out"}
    assert "streamed %b (8,192 B) out to HBM by %b = ve.mul" in tight.report.to_text()
    with pytest.raises(SramOverflowError, match=r"SRAM overflow at %a = tcp.load: it asks for 8,192 bytes, "
                                                r"6,000 of 6,000 bytes are available"):
        run(parse(STREAM_IR), [x], tiny_machine(tmp_path, 6000), sram_policy="error")


def test_large_transfers_are_split_over_the_dma_engines(tmp_path: Path) -> None:
    from runtime_sim.perf.tcp_cost import dma_copy_cost, dma_parts

    machine = default_machine()
    chunk = machine.dma_split_bytes
    assert dma_parts(machine, 2048) == 1 and dma_copy_cost(machine, 2048, False, True).parts == 1
    piece = dma_copy_cost(machine, 64 * chunk + 5, False, True)
    assert piece.parts == machine.dma_engines
    assert piece.bytes_moved == 2 * (64 * chunk + 5)
    assert dma_copy_cost(machine, 3 * chunk, True, False).parts == 3


def test_a_command_on_several_units_ends_with_its_last_part() -> None:
    """`big` runs a part on each of the eight units: seven start at once, the eighth when `a`
    frees unit 0, and `big` ends with it (`part_starts` says when each began); each part frees
    its own unit, so `c` runs on one of the seven at 50."""
    tasks = [Task(0, "a", "dma", 100), Task(1, "big", "dma", 50, units=8), Task(2, "c", "dma", 10)]
    s = schedule(tasks, UNITS)
    assert (s.slots[1].start, s.slots[1].end) == (100, 150)
    assert s.slots[1].units == tuple(range(8)) and s.slots[1].unit == 0
    assert s.slots[1].part_starts == (100,) + (0,) * 7 and s.slots[0].part_starts == ()
    assert s.slots[2].start == 50 and s.slots[2].unit != 0
    assert s.busy["dma"] == 100 + 8 * 50 + 10
    assert s.critical_path == [0, 1]
    with pytest.raises(ValueError, match="needs 9 units"):
        schedule([Task(0, "x", "dma", 1, units=9)], UNITS)


def test_a_spreadable_command_takes_the_free_units_when_that_ends_it_first() -> None:
    """`big` may run on 1..8 units (400 cycles on one, 50 on eight). One unit is held until 1000
    by `waits`: eight units would end at 1050, seven at 100 (57 cycles: 58 x 7 >= 400). The next
    command finds the held unit and the seven taken, and the tie rule takes the fewest units."""
    by_units = tuple(-(-400 // k) for k in range(1, 9))
    tasks = [Task(0, "producer", "tensor", 900), Task(1, "waits", "dma", 100, deps=(0,)),
             Task(2, "big", "dma", 50, units=8, cycles_by_units=by_units)]
    s = schedule(tasks, UNITS)
    assert (s.slots[2].start, s.slots[2].end, len(s.slots[2].units)) == (0, 58, 7)
    assert s.slots[1].unit not in s.slots[2].units
    assert s.busy["dma"] == 100 + 7 * 58
    # Every unit free: all eight (50 < 58); a spread that cannot end earlier takes fewer units.
    assert len(schedule([tasks[2]], UNITS).slots[2].units) == 8
    flat = Task(3, "flat", "dma", 70, units=8, cycles_by_units=(70,) * 8)
    assert len(schedule([flat], UNITS).slots[3].units) == 1


def test_a_command_on_its_clusters_own_engines_takes_only_those() -> None:
    """`own` may take units 4..7 only: it spreads over those four though 0..3 are free, and a
    command without a group still takes the best fit of all eight."""
    by_units = tuple(-(-400 // k) for k in range(1, 9))
    tasks = [Task(0, "own", "dma", 50, units=8, cycles_by_units=by_units), Task(1, "any", "dma", 10)]
    s = schedule(tasks, UNITS, allowed={0: (4, 5, 6, 7)})
    assert s.slots[0].units == (4, 5, 6, 7) and s.slots[0].end == 100
    assert s.slots[1].start == 0 and s.slots[1].unit < 4
    # A command that cannot be spread over fewer units than its parts ignores the group.
    fixed = schedule([Task(0, "fixed", "dma", 50, units=8)], UNITS, allowed={0: (4, 5, 6, 7)})
    assert fixed.slots[0].units == tuple(range(8))


HBM = SharedBandwidth("dma", 1500.0, 1500.0 / 16, 500)
"""RNGD's HBM as the DMA engines share it (tcp_cost.hbm_sharing): 1,500 B/cycle, a floor of half
an engine's equal share, data after a 500-cycle start-up."""
MB = 1 << 20


def test_a_lone_part_moves_hbm_data_at_its_engines_own_rate() -> None:
    """Book, DMA Engine, Example 2: 16 MB on one engine, 65,536 requests + 500 cycles."""
    s = schedule([Task(0, "alone", "dma", 66_036, traffic_by_units=(16 * MB,))], UNITS, shared=HBM)
    assert (s.slots[0].end, s.slots[0].shared, s.shared_peak) == (66_036, False, 256.0)


def test_eight_loads_at_once_share_hbm_and_none_is_starved() -> None:
    """Eight 2 MB loads ready at once, 8,692 cycles each alone (256 B/cycle). Issued in order,
    the first four run at their own rate; the others take what is left, never less than the
    floor, and speed up as the first ones end. HBM never carries more than 1,500 B/cycle, so
    the last ends no earlier than all 16 MB at 1,500 B/cycle after the start-up; and a command
    placed later moves nothing placed before it."""
    tasks = [Task(k, f"load {k}", "dma", 8_692, traffic_by_units=(2 * MB,)) for k in range(8)]
    s = schedule(tasks, UNITS, shared=HBM)
    ends = [s.slots[k].end for k in range(8)]
    assert ends[:4] == [8_692] * 4 and not any(s.slots[k].shared for k in range(4))
    assert ends == sorted(ends) and all(s.slots[k].shared for k in range(4, 8))
    assert s.shared_peak == 1500.0 and s.makespan == 13_884 >= 500 + 8 * 2 * MB / 1500  # docs/hardware.md
    assert all(end <= 500 + 2 * MB / HBM.floor for end in ends)
    for n in range(1, 8):
        assert [schedule(tasks[:n], UNITS, shared=HBM).slots[k] for k in range(n)] == [s.slots[k] for k in range(n)]


def test_a_command_over_every_engine_shares_hbm_equally() -> None:
    """16 MB over eight engines: 2 MB each at an eighth of HBM, 500 + 11,185 cycles, the parts
    ending together; the cost's own cycles say the same (tcp_cost.dma_copy_cost)."""
    from runtime_sim.perf.tcp_cost import dma_copy_cost

    cost = dma_copy_cost(default_machine(), 16 * MB, True, False)
    big = Task(0, "big", "dma", cost.part_cycles[-1], units=8, cycles_by_units=cost.part_cycles,
               traffic_by_units=cost.part_hbm_bytes)
    slot = schedule([big], UNITS, shared=HBM).slots[0]
    assert (slot.units, slot.part_ends) == (tuple(range(8)), (11_685,) * 8)
    assert cost.cycles == 11_685 and cost.bound == "hbm"


def test_a_spread_that_hbm_would_slow_is_not_taken() -> None:
    """A 6 MB load that may run on 1..8 engines, issued while a command on six engines takes all
    of HBM but the floors of the two others. Alone on those two it would end at 12,788, but HBM
    leaves them only the floor until the first command ends (at 10,087), so that spread would
    end at 18,865; on all eight (two parts now, six when the first command's engines free) it
    ends at 14,183, and the scheduler takes that."""
    first = Task(0, "first", "dma", 8_692, units=6, traffic_by_units=(2 * MB,) * 6)
    by_units = tuple(500 + -(-6 * MB // 256 // k) for k in range(1, 9))
    by_traffic = tuple(-(-6 * MB // k) for k in range(1, 9))
    load = Task(1, "load", "dma", by_units[-1], units=8, cycles_by_units=by_units, traffic_by_units=by_traffic)
    s = schedule([first, load], UNITS, shared=HBM)
    assert (s.slots[0].end, s.slots[1].units, s.slots[1].end) == (10_087, tuple(range(8)), 14_183)
    two = Task(1, "load", "dma", by_units[1], units=2, cycles_by_units=by_units[:2], traffic_by_units=by_traffic[:2])
    assert by_units[1] == 12_788 and schedule([first, two], UNITS, shared=HBM).slots[1].end == 18_865


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 3 * MB), st.integers(0, 3), st.integers(0, 2000)),
                min_size=1, max_size=12))
def test_hbm_sharing_never_exceeds_hbm_nor_moves_an_earlier_command(
        commands: list[tuple[int, int, int, int]]) -> None:
    """Random DMA commands (parts, HBM bytes of the whole, how many commands back the one it
    waits for, a tensor command's cycles before it): HBM never carries more than its bandwidth,
    no part ends before its own cycles, and scheduling a prefix places it as the whole does."""
    tasks: list[Task] = []
    for parts, nbytes, back, compute in commands:
        deps = (tasks[-back].key,) if back and len(tasks) >= back else ()
        tasks.append(Task(len(tasks), "compute", "tensor", compute, deps))
        by_units = tuple(500 + -(-nbytes // 256 // k) for k in range(1, parts + 1))
        tasks.append(Task(len(tasks), "load", "dma", by_units[-1], (tasks[-1].key,), (), parts, by_units,
                          tuple(-(-nbytes // k) for k in range(1, parts + 1))))
    s = schedule(tasks, UNITS, shared=HBM)
    assert s.shared_peak <= HBM.bytes_per_cycle + 1e-6
    for t in tasks[1::2]:
        slot = s.slots[t.key]
        own = t.cycles_by_units[len(slot.units) - 1]
        assert all(e - b >= own for b, e in zip(slot.part_starts or (slot.start,), slot.part_ends or (slot.end,)))
    half = len(tasks) // 2
    assert schedule(tasks[:half], UNITS, shared=HBM).slots == {k: s.slots[k] for k in range(half)}


def test_dma_costs_on_fewer_engines_are_never_faster() -> None:
    from runtime_sim.perf.tcp_cost import alone_cycles, dma_copy_cost

    machine = default_machine()
    for nbytes in ((3 << 20) + 5, 64 << 20):
        cost = dma_copy_cost(machine, nbytes, True, False)
        assert len(cost.part_cycles) == len(cost.part_hbm_bytes) == cost.parts
        alone = [alone_cycles(machine, c, b, k)[0]
                 for k, (c, b) in enumerate(zip(cost.part_cycles, cost.part_hbm_bytes), 1)]
        assert alone[-1] == cost.cycles and all(a >= b for a, b in zip(alone, alone[1:]))
        # On k engines the k parts together never move more than HBM's bytes per cycle.
        for cycles in alone:
            assert cycles * machine.hbm_bytes_per_cycle >= nbytes
    one = dma_copy_cost(machine, 1 << 20, True, False)  # one part, at one engine's 256 B/cycle
    assert (one.parts, one.part_cycles, one.cycles) == (1, (4596,), 4596)


def test_dead_buffers_space_is_reused_after_their_last_reader(tmp_path: Path) -> None:
    # %b and %c die at %bc; %r reuses their space, so it must wait for %bc to finish.
    x = np.ones((16, 32), np.float32)
    report = run(parse(SPILL_IR), [x], tiny_machine(tmp_path, 5120)).report
    ops = {o.label: o for o in report.ops}
    assert ops["reload %a"].start >= ops["%bc = tcp.contract"].end


def test_function_calls_carry_dependencies() -> None:
    module = parse("""
    func.func @g(%u: tensor<16x32xf32>) -> tensor<16x32xf32> {
      %v = tcp.load %u : tensor<16x32xf32> -> tensor<16x32xf32>
      func.return %v : tensor<16x32xf32>
    }
    func.func @f(%x: tensor<16x32xf32>) -> tensor<16xf32> {
      %y = func.call @g(%x) : (tensor<16x32xf32>) -> tensor<16x32xf32>
      %z = tcp.contract "ij,ij->i" %y, %y : tensor<16x32xf32>, tensor<16x32xf32> -> tensor<16xf32>
      func.return %z : tensor<16xf32>
    }""")
    result = run(module, [np.ones((16, 32), np.float32)])
    assert [o.name for o in result.report.ops] == ["tcp.load", "tcp.contract"]
    assert result.graph.edges[0, 1]["kind"] == "data"
    assert result.report.ops[1].start == result.report.ops[0].end


@pytest.mark.parametrize("seed", range(24))
def test_random_programs_never_hold_more_than_sram(tmp_path: Path, seed: int) -> None:
    """Loads and elementwise contractions in random order on a small SRAM: whether they spill,
    stream or neither, the scheduled run never holds more than SRAM (checked in run())."""
    rnd = np.random.default_rng(seed)
    t = "tensor<16x32xf32>"
    lines, names = [], []
    for i in range(int(rnd.integers(3, 12))):
        if not names or rnd.random() < 0.4:
            lines.append(f"  %v{i} = tcp.load %x : {t} -> {t}")
        else:
            a, b = rnd.choice(names, 2)
            lines.append(f'  %v{i} = tcp.contract "ij,ij->ij" %{a}, %{b} : {t}, {t} -> {t}')
        names.append(f"v{i}")
    text = f"func.func @f(%x: {t}) -> {t} {{\n" + "\n".join(lines) + f"\n  func.return %{names[-1]} : {t}\n}}"
    machine = tiny_machine(tmp_path, int(rnd.choice([5000, 8000, 12000])))
    run(parse(text), [np.ones((16, 32), np.float32)], machine)  # streams what cannot fit


def test_default_machine_is_used() -> None:
    assert moe_run(routing(4)).report.machine == default_machine()


def test_an_unmaterialised_gather_contracts_to_the_same_bits() -> None:
    from runtime_sim.semantics.numerics import GatheredRows, contract

    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 16, 8)).astype(BF16)
    x = rng.standard_normal((6, 3, 16)).astype(BF16)
    idx = np.array([2, 2, -1, 4, 0, 2], np.int32)
    lazy = GatheredRows(w, idx)
    whole = np.asarray(lazy)
    assert lazy.shape == whole.shape == (6, 16, 8) and lazy.nbytes == whole.nbytes
    np.testing.assert_array_equal(whole[2], 0)
    np.testing.assert_array_equal(whole[3], w[4])
    for spec, a, b, la, lb in [("gbd,gdf->gbf", x, whole, x, lazy),          # rows are the batch
                               ("gdf,gbd->gbf", whole, x, lazy, x),          # on the left
                               ("gdf,gbd->gfb", whole, x, lazy, x),          # transposed result
                               ("gdf,hbd->ghbf", whole, x, lazy, x)]:        # no batch: materialised
        want = contract(spec, a, b)
        got = contract(spec, la, lb)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_with_buffers_larger_than_sram(tmp_path: Path, seed: int) -> None:
    """Loads (DMA, fused into their readers when too large) and elementwise ve ops on buffers
    larger than SRAM: the outputs match an unconstrained run, the run never holds more than
    SRAM, and streaming only ever adds time."""
    rnd = np.random.default_rng(seed)
    t = "tensor<64x32xf32>"  # 8 KB
    lines, names = [], []
    for i in range(int(rnd.integers(3, 10))):
        if not names or rnd.random() < 0.3:
            lines.append(f"  %v{i} = tcp.load %x : {t} -> {t}")
        else:
            a, b = rnd.choice(names, 2)
            op = rnd.choice(["ve.add", "ve.mul", "ve.max"])
            lines.append(f"  %v{i} = {op} %{a}, %{b} : {t}")
        names.append(f"v{i}")
    last = names[-1]
    lines.append(f"  %r = ve.reduce_sum %{last} along 0 : {t} -> tensor<32xf32>")
    text = (f"func.func @f(%x: {t}) -> tensor<32xf32> {{\n" + "\n".join(lines)
            + "\n  func.return %r : tensor<32xf32>\n}")
    x = np.random.default_rng(seed).standard_normal((64, 32)).astype(np.float32)
    roomy = run(parse(text), [x], tiny_machine(tmp_path, 1 << 20))
    tight = run(parse(text), [x], tiny_machine(tmp_path, int(rnd.choice([3000, 6000, 9000, 20000]))))
    np.testing.assert_array_equal(tight.outputs[0], roomy.outputs[0])
    assert tight.report.total_cycles >= roomy.report.total_cycles
    assert tight.report.roofline == roomy.report.roofline
