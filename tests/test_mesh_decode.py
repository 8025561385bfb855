"""Issue #31, parts 4 to 6: the served decode step on a mesh (T global or per chip, down to one
token per chip; the all-to-all's latency-bound regime), the mesh report's choices, and cost-only
routings that load the chips as they load the experts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import tcpc
from runtime_sim.perf.routing_scenarios import balanced
from tcpc.cli import main
from tcpc.mesh_run import MeshSpec, check_on_mesh, simulate_on_mesh

DEEPSEEK_ROUTING = [a for d in ("E=256", "K=8", "NG=8", "TG=4") for a in ("--set", d)]
"""DeepSeek-V3's routing (top-8 of 256 experts, 4 of 8 groups) at examples/deepseek_v3.moe's small D and F."""


@pytest.mark.parametrize("tokens, k, experts, chips", [(8, 8, 256, 8), (3, 4, 16, 2), (5, 2, 8, 8), (16, 6, 48, 4),
                                                       (7, 3, 12, 4), (40, 8, 128, 8)])
def test_balanced_deals_pairs_over_chips_and_experts(tokens: int, k: int, experts: int, chips: int) -> None:
    """On ep chips of E/ep consecutive experts, `balanced` loads every chip within one run of
    r = gcd(K, E/ep) pairs and every expert within one pair, a token's K experts distinct; on
    one chip it is (t*K + k) mod E."""
    one_chip = balanced(tokens, k, experts)
    assert one_chip.tolist() == [[(t * k + j) % experts for j in range(k)] for t in range(tokens)]
    choices = balanced(tokens, k, experts, chips)
    assert all(len(set(row)) == k for row in choices.tolist())
    per_expert = np.bincount(choices.ravel(), minlength=experts)
    assert per_expert.max() - per_expert.min() <= 1
    assert sorted(per_expert) == sorted(np.bincount(one_chip.ravel(), minlength=experts))
    per_chip = np.bincount(choices.ravel() // (experts // chips), minlength=chips)
    assert per_chip.max() - per_chip.min() <= math.gcd(k, experts // chips)


def test_balanced_routing_loads_every_chip_at_one_token_each(tmp_path) -> None:
    """DeepSeek-V3's routing on 8 chips at one token per chip: each chip receives a token's 8
    pairs (round robin over the experts alone put all 64 on chips 0 and 1) and does the same
    work."""
    out = tmp_path / "r.json"
    assert main(["run", "examples/deepseek_v3.moe", *DEEPSEEK_ROUTING, "--set", "T=8", "--set", "B=1",
                 "--mesh", "ep=8", "--cost-only", "--report-json", str(out)]) == 0
    data = json.loads(out.read_text())
    busy = {sum(e["busy_cycles"] for e in chip["engines"] if e["name"] in ("tensor", "dma")) for chip in data["chips"]}
    assert len(busy) == 1


def test_balanced_routing_line_says_how_the_chips_are_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "examples/deepseek_v3.moe", *DEEPSEEK_ROUTING, "--set", "T=16", "--set", "B=2",
                 "--mesh", "dp=2,ep=4", "--cost-only"]) == 0
    assert "balanced: 16 tokens x top-8 of 256 experts, 128 experts used, busiest 1 pairs; 16 pairs to each chip" \
        in capsys.readouterr().out


def test_routing_file_splits_over_chips_as_the_tokens_do(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A routing file's row t is token t of the whole mesh: chip c's tokens [c*T/n, (c+1)*T/n)
    take rows [c*T/n, (c+1)*T/n), and the rows each chip receives in the dispatch are the
    tokens of other chips with a pair on its experts, once each (E = 16 over ep = 4: chip c
    holds experts 4c..4c+3)."""
    rng = np.random.default_rng(7)
    choices = np.argsort(rng.random((16, 16)), axis=1)[:, :4].astype(np.int32)  # T = 16, top-4 of 16
    path = tmp_path / "routing.npy"
    np.save(path, choices)
    out = tmp_path / "r.json"
    assert main(["run", "examples/deepseek_v3.moe", "--set", "T=16", "--set", "B=2", "--mesh", "ep=4", "--cost-only",
                 "--routing", str(path), "--report-json", str(out)]) == 0
    owner, home = choices // 4, np.repeat(np.arange(4), 4)
    pairs = [int((owner == c).sum()) for c in range(4)]
    assert f"pairs by chip: {', '.join(map(str, pairs))}" in capsys.readouterr().out
    links = json.loads(out.read_text())["links"]
    row_bytes = 64 * 2  # D = 64, bf16
    for c in range(4):
        rows = int(((owner == c).any(axis=1) & (home != c)).sum())
        recv_x = next(x for x in links if x["chip"] == c and "recv_x" in x["label"])
        assert recv_x["received_bytes"] == rows * row_bytes
    np.save(path, choices[:8])  # the tokens of two chips only
    assert main(["run", "examples/deepseek_v3.moe", "--set", "T=16", "--set", "B=2", "--mesh", "ep=4", "--cost-only",
                 "--routing", str(path)]) == 1
    assert ("expert choices have shape [8, 4], the routing needs [16, 4] (the mesh's T = 16 tokens in token order, "
            "split over its 4 token shards as the tokens are: 4 each)") in capsys.readouterr().err


def test_t_that_does_not_divide_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    """T is the whole mesh's tokens: T = 1 over 8 chips is refused with the T that would do and
    how to give T per chip instead."""
    assert main(["run", "examples/deepseek_v3.moe", "--set", "T=1", "--mesh", "ep=8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tcpc: error: T = 1 tokens do not divide over dp * ep = 8 chips: T counts the tokens of "
                          "the whole mesh, each chip holding T / 8 (its own batch); T = 8 is 1 per chip (--set T=8), "
                          "or add tokens=per-chip to --mesh to give T per chip")
    assert main(["run", "examples/deepseek_v3.moe", "--set", "T=12", "--mesh", "dp=2,ep=4"]) == 1
    assert "T = 8 is 1 per chip (--set T=8), T = 16 is 2 per chip (--set T=16)" in capsys.readouterr().err
    assert main(["run", "examples/deepseek_v3.moe", "--mesh", "ep=8,tokens=local"]) == 1
    assert "unknown tokens 'local' (expected global, per-chip)" in capsys.readouterr().err


@pytest.mark.parametrize("mesh", ["ep=8", "ep=8,strategy=a2a_sum", "dp=2,ep=2,tp=2"])
def test_one_token_per_chip_is_the_single_chip_layer(mesh: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The served decode step: `--set T=1 --mesh ...,tokens=per-chip` runs the layer of dp*ep
    tokens, one on each chip (its own batch), and gives one chip's outputs bit for bit (a2a_sum:
    within its tolerance)."""
    assert main(["run", "examples/deepseek_v3.moe", "--set", "T=1", "--mesh", f"{mesh},tokens=per-chip", "--check"]) == 0
    out = capsys.readouterr().out
    shards = 4 if "tp" in mesh else 8  # the tp chips of a group share their token
    assert f"8 chips of rngd on rngd-pcie, T = {shards} tokens (1 per chip)" in out
    # a2a_sum rounds each chip's part of a token's sum (tolerance.RECEIVER_SUM_SCALE): these
    # tokens' pairs sit on several chips; a2a and tp give one chip's bits.
    same = "check: outputs agree with the reference" if "a2a_sum" in mesh else "check: outputs equal the reference"
    assert f"out0 bf16[{shards}, 64]" in out and same in out


def test_tokens_per_chip_needs_one_dim_of_tokens(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """tokens=per-chip scales the dim that counts the tokens; tokens whose count is an
    expression name no such dim."""
    layer = tmp_path / "layer.moe"
    layer.write_text("""dims S = 4, D = 8, F = 16, E = 4, K = 2, B = 2
graph g(x: bf16[2 * S, D], router: f32[D, E], w_up: bf16[E, D, F], w_down: bf16[E, F, D]) -> bf16[2 * S, D] {
    top_p, top_e = topk(softmax(f32(x) @ router), K)
    xb, route = scatter(x, top_e, experts=E, block=B)
    return combine(grouped_matmul(silu(grouped_matmul(xb, w_up, route)), w_down, route), route, bf16(top_p))
}
""")
    assert main(["run", str(layer), "--mesh", "ep=2,tokens=per-chip"]) == 1
    assert ("tokens=per-chip multiplies the dim that counts the T = 8 scattered tokens by the 2 token shards, but no "
            "one dim of @g's arguments is T; give T over the whole mesh instead") in capsys.readouterr().err
    assert main(["run", str(layer), "--mesh", "ep=2", "--check"]) == 0


def test_decode_all_to_alls_are_latency_bound(tmp_path) -> None:
    """Every collective step pays the mesh file's latency (2,000 cycles on rngd_pcie) before its
    bytes: at one token per chip each all-to-all is mostly that latency (the report marks it),
    and a transfer of more than latency x bandwidth bytes is bandwidth-bound."""
    out = tmp_path / "r.json"
    assert main(["run", "examples/deepseek_v3.moe", "--set", "T=1", "--mesh", "ep=8,tokens=per-chip", "--cost-only",
                 "--routing", "skewed", "--report-json", str(out)]) == 0
    links = json.loads(out.read_text())["links"]
    to_all = [x for x in links if x["op"] == "ccl.all_to_all_start"]
    assert {x["latency_cycles"] for x in to_all} == {2000}
    assert all(x["busy_cycles"] == 2000 + math.ceil(max(x["sent_bytes"], x["received_bytes"]) / 30) for x in to_all)
    assert {x["bound"] for x in to_all} == {"latency"} and max(x["received_bytes"] for x in to_all) > 0
    assert main(["run", "examples/deepseek_v3.moe", "--set", "T=64", "--set", "D=1024", "--set", "B=16",
                 "--mesh", "ep=2,tokens=per-chip", "--cost-only", "--report-json", str(out)]) == 0
    recv_x = [x for x in json.loads(out.read_text())["links"] if "recv_x" in x["label"]]
    assert all(x["received_bytes"] > 2000 * 30 and x["bound"] == "bandwidth" for x in recv_x)


def test_deepep_decode_setting_costs_latency_plus_bytes() -> None:
    """DeepEP's low-latency benchmark setting (128 tokens per chip, hidden 7168, top-8 of 256
    on 8 chips) on rngd_pcie's link: a dispatch all-to-all of bf16 rows, 7/8 of the tokens to
    each other chip, costs one step's latency and its bytes at 30 B/cycle, hundreds of
    microseconds (bandwidth-bound, as DeepEP's own 77 us at 98 GB/s are); one token per chip
    sent to the 7 others costs the latency and 3,346 cycles of bytes."""
    from xdsl.dialects.builtin import TensorType, bf16, i32
    from xdsl.utils.test_value import create_ssa_value

    from dialects import ccl
    from runtime_sim.perf.ccl_cost import link_parts, traffic
    from target.mesh_machine import load_mesh_machine

    machine = load_mesh_machine()
    x = create_ssa_value(TensorType(bf16, [8, 128, 7168]))
    op = ccl.AllToAllOp(x, "ep", 8, rows=create_ssa_value(TensorType(i32, [8])))
    send = np.zeros((8, 128, 7168), dtype=np.uint16)  # bf16 rows: 2 B a value

    def dispatch(rows_to_each: int) -> tuple[int, int]:
        rows = np.full(8, rows_to_each, dtype=np.int32)
        return link_parts(machine, [traffic(op, (send, rows), 8, me) for me in range(8)], 0)

    latency, transfer = dispatch(112)
    assert latency == 2000 and transfer == math.ceil(7 * 112 * 7168 * 2 / 30)
    assert 300 < (latency + transfer) / 1000 < 500  # microseconds at 1 GHz
    assert dispatch(1) == (2000, 3346)


def test_mesh_report_shows_its_choices_and_loops(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """The block and the top-k strategy chosen on the mesh, and the chips' loops, in the text
    report and in every chip's JSON; the block's cycles are the mesh's (the top-k choice's
    default strategy at that block costs the same), and `tcpc compile --mesh` chooses it too."""
    out = tmp_path / "r.json"
    assert main(["run", "examples/deepseek_v3.moe", "--mesh", "ep=4,topk=auto", "--cost-only", "--report",
                 "--report-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(block=auto); cycles by block on the mesh ep=4 (a2a) (balanced routing): " in text
    assert "(topk=auto); cycles by lower-topk strategy on the mesh ep=4 (a2a) (balanced routing): rank: " in text
    assert "schedule (every chip): experts loop %block: " in text
    data = json.loads(out.read_text())
    block, topk = data["choices"]
    assert (block["what"], topk["what"], block["on"]) == ("block", "lower-topk strategy", "the mesh ep=4 (a2a)")
    for chip in data["chips"]:
        assert chip["choices"] == data["choices"] and chip["loops"] and chip["contractions"]
        assert any(loop["phase"] == "experts" for loop in chip["loops"])
    by_block = {a["value"]: a["cycles"] for a in block["alternatives"]}
    assert by_block[block["chosen"]] == min(by_block.values())
    assert {a["value"]: a["cycles"] for a in topk["alternatives"]}["rank"] == by_block[block["chosen"]]
    assert main(["compile", "examples/deepseek_v3.moe", "--mesh", "ep=4", "--emit", "lowered"]) == 0
    assert capsys.readouterr().out.startswith(f"// chose block {block['chosen']} at examples/deepseek_v3.moe:41:52 "
                                              "(block=auto); cycles by block on the mesh ep=4 (a2a)")


def test_split_pairs_return_before_the_receivers_sums(tmp_path) -> None:
    """a2a's return of the split pairs is issued before the receiver's combine: its step (only
    the link's latency under balanced routing, which splits no token) runs while the combine
    sums the received tokens, and the sums go back once made instead of queuing behind it on
    the link. Qwen3-30B-A3B on 8 chips at 16 tokens each, B = 8, 2 chunks: 125,930 -> 124,957
    cycles; 124,505 with the chunks' router tiled over the chip's tokens; 124,355 with chunk 1's
    receive in chunk 0's expert loop and chunk 0's combine in chunk 1's (interleave-chunks);
    118,735 with the first chunk's weights guessed too; 117,916 with the empty return skipped
    (test_a_chip_with_no_split_pair_skips_their_return); 117,506 with the receiver's gathers in
    tiles of 4 rows (test_the_receivers_tiles_gather_a_start_ups_worth); 116,555 with the last
    round's one-engine weights in pieces (interleave-chunks); 116,647 with the pinned routing read after
    the router's top-k, whose indices' last ops and cross-cluster copies cost-only runs no longer
    drop (pinned); 115,856 with the home's `tile.gather_into` of the sums into the output
    (test_a_home_with_no_split_pair_back_gathers_the_sums_into_the_output)."""
    out = tmp_path / "r.json"
    assert main(["run", "examples/qwen3_moe.moe", *(a for d in ("D=2048", "F=768", "E=128", "K=8", "T=128", "B=8")
                                                   for a in ("--set", d)),
                 "--mesh", "ep=8,chunks=2", "--cost-only", "--report-json", str(out)]) == 0
    data = json.loads(out.read_text())
    returns = [x for x in data["links"] if x["chip"] == 0 and x["label"].startswith(("%returned ", "%returned_sums "))]
    assert [x["label"].split()[0] for x in returns] == ["%returned", "%returned_sums"] * 2
    assert all(pairs["end"] <= sums["start"] for pairs, sums in zip(returns[::2], returns[1::2]))
    assert data["total_cycles"] == 115_856


QWEN3 = {"D": 2048, "F": 768, "E": 128, "K": 8}
"""Qwen3-30B-A3B's dims."""


def test_the_first_chunk_guesses_its_first_weights_at_decode() -> None:
    """A mesh chip's first routed loop at decode streams its weights, and starts from each
    cluster's guessed first expert (expert c on cluster c, every F tile), loaded while the router
    ranks and the link moves the expert lists, which the routing and every other weight load
    wait for. Qwen3-30B-A3B on 8 chips at 16 tokens each, B = 8, 2 chunks, balanced: the first
    blocks reuse the guesses, every expert's weights cross HBM once, and the first weights load
    from the start, not after the routing: 124,505 -> 118,886 cycles; 118,735 with interleave-chunks;
    117,916 with the empty return of split pairs skipped, 117,506 with the receiver's gathers in
    tiles of 4 rows, 116,555 with the last round's one-engine weights in pieces; 116,647 with the pinned
    routing read after the router's top-k (`tcp.order`): the guesses never waited for the routing, so
    they did not lean on its being there at cycle 0; the extra cycles are the router's indices
    assembled, as a run with values does (pinned); 115,856 with each chunk's home, none of whose split
    pairs came back, gathering the receivers' sums straight into the output."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={**QWEN3, "T": 128, "B": 8})
    report = simulate_on_mesh(program, MeshSpec.parse("ep=8,chunks=2"), cost_only=True).report
    chip = report.chips[0]
    loads = [o for o in chip.ops if o.name == "tile.load_expert"]
    guessed = [o for o in loads if "guessed" in o.label]
    assert len(guessed) == 2 * 3 * 2  # two clusters' gate, up and down in two F tiles (512 and 256 columns)
    assert min(o.start for o in guessed) < min(o.end for o in chip.ops if o.engine == "link" and o.cycles)
    assert max(o.start for o in guessed) < min(o.start for o in loads if o.hbm_bytes and o not in guessed)
    assert sum(o.hbm_bytes for o in loads) == 16 * 3 * 2048 * 768 * 2  # the chip's 16 experts, each once
    assert report.total_cycles == 115_856


def test_a_wrong_guess_on_a_mesh_costs_time_not_bits() -> None:
    """The guessed first weights of a mesh chip at decode give one chip's bits whatever the
    routing: with random tokens, and with a router that never picks either chip's first two
    experts (0, 1 and 8, 9 on ep=2), whose first blocks then load their own weights."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 32, "B": 4})
    spec = MeshSpec.parse("ep=2,chunks=2")
    rng = np.random.default_rng(7)
    router = rng.standard_normal((64, 16)).astype(np.float32)
    router[:, [0, 1, 8, 9]] = -4.0
    for inputs in (None, {"x": np.abs(rng.standard_normal((32, 64))).astype(np.float32), "router": router}):
        sim = simulate_on_mesh(program, spec, inputs, seed=3)
        assert all(any("guessed" in o.label for o in chip.ops) for chip in sim.report.chips)
        results = check_on_mesh(program, spec, sim, seed=3)
        assert all(c.identical for c in results), [c.message for c in results]
    chosen = np.argsort(-(sim.inputs["x"].astype(np.float32) @ sim.inputs["router"].astype(np.float32)), axis=1)
    assert not np.isin([0, 1, 8, 9], chosen[:, :4]).any()


def test_a_home_with_no_split_pair_back_gathers_the_sums_into_the_output() -> None:
    """A chunk's home sum made whole (decode) branches on whether any split pair came back:
    without one, one `tile.gather_into` writes the receivers' sums from the return's buffer
    into the output (schedule-tokens' `whole_sums_into_output`). At top-2 seed 0 splits a
    token of every chunk but one of chip 0's: chip 0 takes each branch once, chip 1 the sum
    twice; the outputs keep one chip's bits either way."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"K": 2, "B": 4})
    spec = MeshSpec.parse("ep=2,chunks=2")
    sim = simulate_on_mesh(program, spec, seed=0)
    assert [sum(o.label == "tile.gather_into" for o in chip.ops) for chip in sim.report.chips] == [1, 0]
    results = check_on_mesh(program, spec, sim, seed=0)
    assert all(c.identical for c in results), [c.message for c in results]


def test_an_all_gathering_chip_guesses_its_first_weights_too() -> None:
    """A chip that all-gathers every token (strategy allgather) guesses its first weights at
    decode as an all-to-all's receiver does, before the all-gather of the expert choices
    (Qwen3-30B-A3B on 2 chips at 16 tokens each, B = 2: 447,587 -> 439,927 cycles); with a router
    that never picks either chip's first two experts, one chip's output within allgather's
    tolerance (its sum regrouped by chip)."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 32, "B": 4})
    spec = MeshSpec.parse("ep=2,strategy=allgather")
    rng = np.random.default_rng(7)
    router = rng.standard_normal((64, 16)).astype(np.float32)
    router[:, [0, 1, 8, 9]] = -4.0
    inputs = {"x": np.abs(rng.standard_normal((32, 64))).astype(np.float32), "router": router}
    sim = simulate_on_mesh(program, spec, inputs, seed=3)
    for chip in sim.report.chips:
        guessed = [o for o in chip.ops if "guessed" in o.label]
        choices = next(o for o in chip.ops if o.label.startswith("%experts_all"))
        assert guessed and max(o.start for o in guessed) < choices.start
    results = check_on_mesh(program, spec, sim, seed=3)
    assert all(c.ok for c in results), [c.message for c in results]


def test_receivers_sums_go_back_once_the_split_pairs_have(tmp_path) -> None:
    """Under skewed routing a2a returns many split pairs (chip 0: 523 rows, 252 us on its link);
    the receiver's sums are made under that return and their all-to-all follows it at once on the
    link. The home's token loop (its pair sum, which waits for the split pairs) had taken the
    receiver's tiles' largest indices (16 tiles of 8 received rows on a chip of 16 tokens), so the
    sums waited for it: DeepSeek-V3 on 8 chips at 16 tokens each, B = 128, skewed: 2,451,627 ->
    2,434,608 cycles. Only the whole tokens' sums go back (a destination's whole tokens ranked
    first, `whole_first`): chip 0 received 112 tokens of other chips, one of them whole, and its
    sums' return moved 1.6 MB (55.5 us), one row now: 2,434,608 -> 2,386,729 cycles; its blocks
    (one an expert) store only their pairs' rows: 2,330,510; the f32 router on the widened tokens'
    one bf16 piece (map-contractions): 2,327,266; the pinned routing read after the router's top-k,
    not loaded from HBM (`tcp.order`): 2,327,245 (pinned)."""
    out = tmp_path / "r.json"
    dims = ("D=7168", "F=2048", "FS=2048", "E=256", "K=8", "NG=8", "TG=4", "T=128", "B=128")
    assert main(["run", "examples/deepseek_v3.moe", *(a for d in dims for a in ("--set", d)),
                 "--mesh", "ep=8,topk=rounds", "--cost-only", "--routing", "skewed", "--seed", "1",
                 "--report-json", str(out)]) == 0
    data = json.loads(out.read_text())
    returns = {x["label"].split()[0]: x for x in data["links"] if x["chip"] == 0}
    assert returns["%returned_sums"]["start"] == returns["%returned"]["end"]
    assert returns["%returned_sums"]["sent_bytes"] == 2 * 7168  # one whole token's row
    assert data["total_cycles"] == 2_327_245


def test_streamed_weights_take_the_cluster_at_decode(tmp_path) -> None:
    """A mesh chip's routed experts at decode stream their weights (a block of B = 1 rows does 2
    FLOPs per weight byte): their F tiles are chosen for the whole cluster's SRAM, two of 1,024
    columns per matrix rather than four of 512, each command's parts paying their start-up for
    twice the bytes. DeepSeek-V3 on 8 chips at one token each: 568,512 -> 563,663 cycles;
    562,588 with the empty return of split pairs skipped; 562,559 with the pinned routing read
    after the router's top-k, not loaded from HBM (`tcp.order`; pinned)."""
    out = tmp_path / "r.json"
    dims = ("D=7168", "F=2048", "FS=2048", "E=256", "K=8", "NG=8", "TG=4", "T=8", "B=1")
    assert main(["run", "examples/deepseek_v3.moe", *(a for d in dims for a in ("--set", d)), "--mesh", "ep=8",
                 "--cost-only", "--report-json", str(out)]) == 0
    data = json.loads(out.read_text())
    experts = [loop for loop in data["chips"][0]["loops"] if loop["phase"] == "experts"]
    assert experts and all("bf16[1, 7168, 1024]" in loop["tiles"] for loop in experts)
    assert data["total_cycles"] == 562_559


def test_the_shared_experts_tiles_share_the_clusters_at_decode(tmp_path) -> None:
    """DeepSeek-V3 on 8 chips at 128 tokens each, B = 32: the shared expert's one block does 128
    FLOPs per weight byte, so its second F tile's gate and up projections run on cluster 0 after
    the routing (interleave-shared), and its six contractions no longer hold cluster 1 past the
    tokens' arrival; its store follows the routed loop. 2,158,611 -> 2,151,969 cycles; 2,147,700 with the
    receiver's combine over both clusters; 2,133,626 with the f32 router's matmul in the router's
    token loop, a 64-row tile of the chip's 128 tokens on each cluster (schedule-tokens'
    `sharing_pays`: it was whole on cluster 0, 34.8 us longer than a tile); 2,124,613 with that
    matmul on the widened tokens' one bf16 piece (three piece pairs, map-contractions), whole on
    cluster 0 again: 24,192 cycles, where a tile on each would save 11,120 and its copies cost
    16,836; 2,124,406 with the plans' cumsums chunked; 2,124,585 with the pinned routing read after
    the router's top-k, not loaded from HBM (`tcp.order`; pinned)."""
    out = tmp_path / "r.json"
    dims = ("D=7168", "F=2048", "FS=2048", "E=256", "K=8", "NG=8", "TG=4", "T=1024", "B=32")
    assert main(["run", "examples/deepseek_v3.moe", *(a for d in dims for a in ("--set", d)),
                 "--mesh", "ep=8,topk=rounds", "--cost-only", "--report-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert not [loop for loop in data["chips"][0]["loops"] if loop["phase"] == "shared"]
    router = [loop for loop in data["chips"][0]["loops"] if loop["phase"] == "router"]
    assert len(router) == 1 and "bf16[64, 7168]" not in router[0]["tiles"], router  # no tokens' tile: the matmul whole
    assert data["total_cycles"] == 2_124_585


def test_a_chip_with_no_split_pair_skips_their_return() -> None:
    """a2a's return of the split pairs `expects` the counts the home's plan sent: a chip with no
    split pair to send back or get skips that all-to-all (its guard cycles on the link, no
    step, no wait for the group), where it paid a step's latency for nothing. Balanced routing
    splits no token of the small Qwen3 layer (top-4 of 8 experts a chip): every chip skips;
    skewed routing splits some, and a chip that has one to send or get keeps the step. With
    real routing every chip keeps one chip's bits, and each checks that what comes is what it
    expected. Qwen3-30B-A3B on 8 chips at 16 tokens each, B = 8, 2 chunks, balanced:
    118,735 -> 117,916 cycles (test_split_pairs_return_before_the_receivers_sums)."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 32, "B": 4})
    spec = MeshSpec.parse("ep=2")
    machine_guard = 4  # rngd.toml's control.guard_cycles

    def split_returns(routing: str) -> list[dict]:
        report = simulate_on_mesh(program, spec, cost_only=True, routing=routing).report
        return [x.to_json() for x in report.links if x.label.startswith("%returned ")]

    balanced_returns = split_returns("balanced")
    assert balanced_returns and all(x["bound"] == "skipped" and x["busy_cycles"] == machine_guard
                                    and x["wait_cycles"] == 0 for x in balanced_returns)
    skewed = split_returns("skewed")
    assert any(x["bound"] != "skipped" and x["latency_cycles"] == 2000 for x in skewed)
    assert all((x["bound"] == "skipped") == (x["sent_bytes"] == x["received_bytes"] == 0) for x in skewed)
    sim = simulate_on_mesh(program, spec, seed=5)
    assert all(c.identical for c in check_on_mesh(program, spec, sim, seed=5))


def test_the_receivers_tiles_gather_a_start_ups_worth() -> None:
    """A mesh receiver's combine over its received rows packed first runs in tiles whose
    gather moves about what one DMA engine moves in a start-up (500 cycles at 256 B/cycle:
    128 KB), not a flit's 8 rows: with 8 pairs of a 4 KB row (D = 2048) a tile of 4 rows,
    whose gathers run on engines side by side (Qwen3-30B-A3B ep=8 at 16 tokens a chip: the
    received rows' gather in two commands of 1,012 cycles where one took 1,524; 117,916 ->
    117,506 cycles). Every chip keeps one chip's bits."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"D": 2048, "F": 32, "E": 16, "K": 8, "T": 16, "B": 2})
    spec = MeshSpec.parse("ep=2")
    sim = simulate_on_mesh(program, spec, seed=2)
    combine = [loop for loop in sim.report.loops if loop.phase == "combine"]
    assert [loop.step for loop in combine] == [4]
    assert all(c.identical for c in check_on_mesh(program, spec, sim, seed=2))


def test_an_all_to_all_checks_the_rows_it_expects() -> None:
    """`expects` is what this chip knows the others send it: the exchange checks it, an error on
    the chip whose expectation the group does not meet (a plan's counts out of step with the
    receivers' would skip rows that cross)."""
    import threading

    from xdsl.dialects.builtin import TensorType, bf16, i32
    from xdsl.utils.exceptions import InterpretationError
    from xdsl.utils.test_value import create_ssa_value

    from dialects import ccl
    from runtime_sim.semantics.ccl_semantics import CCLFunctions, MeshExchange

    counts = TensorType(i32, [2])
    op = ccl.AllToAllStartOp(create_ssa_value(TensorType(bf16, [2, 2, 4])), "ep", 2,
                             rows=create_ssa_value(counts), expects=create_ssa_value(counts))
    rows = {0: [0, 1], 1: [2, 0]}  # chip 0 sends one row to chip 1, chip 1 two to chip 0

    def run(expects: dict[int, list[int]]) -> dict[int, object]:
        exchange = MeshExchange(ccl.Mesh.parse("ep=2"))
        out: dict[int, object] = {}

        def chip(c: int) -> None:
            args = (np.zeros((2, 2, 4), np.float32), np.array(rows[c], np.int32), np.array(expects[c], np.int32))
            try:
                out[c] = CCLFunctions(exchange, c)._all_to_all(op, args)[0]
            except InterpretationError as e:
                out[c] = e

        threads = [threading.Thread(target=chip, args=(c,)) for c in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        return out

    assert not any(isinstance(v, Exception) for v in run({0: [0, 2], 1: [1, 0]}).values())
    wrong = run({0: [0, 1], 1: [1, 0]})
    assert isinstance(wrong[0], InterpretationError) and "expects rows [0, 1]" in str(wrong[0])
    assert not isinstance(wrong[1], Exception)


def _stores_row_by_row(module: object) -> bool:
    """Whether the module's routed expert loop stores its blocks' results row by row (a guard per row)."""
    from dialects import tile

    stores = [op for op in module.walk() if isinstance(op, tile.StoreOp)  # type: ignore[attr-defined]
              and op.attributes.get("tcpc.phase") is not None and op.attributes["tcpc.phase"].data == "experts"]
    return bool(stores) and all(tile.guards_parts(op) for op in stores)


@pytest.mark.parametrize("dims, mesh", [({"T": 8, "B": 8}, "ep=2"), ({"T": 16, "K": 8, "B": 16}, "ep=2,waves=3")])
def test_a_receivers_padded_blocks_store_only_their_pairs_rows(monkeypatch: pytest.MonkeyPatch, dims: dict[str, int],
                                                               mesh: str) -> None:
    """Decode on 2 chips at 4 tokens a chip, B = 8: a receiver's 8 tokens give each of its experts
    at most 8 pairs, one block (G = E = 8), mostly padding, and schedule-experts stores only the
    rows that hold a pair (a guard per row: tests/filecheck/schedule/schedule_experts/
    mesh_row_stores.moe); the outputs are one chip's, bit for bit, with the blocks' buffer
    starting as NaN (a row nobody stored and somebody read would show). So with a2a's split pairs
    gathered in waves from the loop's pieces (K = 8, B = 16: 8 tokens a chip)."""
    from xdsl.interpreter import OpImplResult

    from dialects import tile
    from dialects.tensor_types import shape_of
    from runtime_sim.semantics.numerics import tensor_dtype
    from runtime_sim.semantics.tile_semantics import TileFunctions
    from runtime_sim.semantics.tolerance import compare_outputs
    from support import mesh_outputs

    zeros = vars(TileFunctions)["__impl_dict"][tile.BufferOp]

    def nan_blocks(ft: object, interpreter: object, op: tile.BufferOp, values: tuple) -> OpImplResult:
        if not (op.result.name_hint or "").startswith("y_blocked"):
            return zeros(ft, interpreter, op, values)
        return OpImplResult((np.full(shape_of(op.result.type), np.nan, tensor_dtype(op.result.type)),), None)

    program = tcpc.compile_file("examples/qwen3_moe.moe", dims=dims)
    spec = MeshSpec.parse(mesh)
    module = program.lower(spec.pipeline())
    assert _stores_row_by_row(module)
    monkeypatch.setitem(vars(TileFunctions)["__impl_dict"], tile.BufferOp, nan_blocks)
    (outputs,) = mesh_outputs(program, spec, [module], 5)
    results = compare_outputs(outputs, program.run(seed=5).outputs)
    assert all(c.identical for c in results), [c.message for c in results]


def test_a_skewed_receivers_row_stores_cost_its_pairs_rows() -> None:
    """Qwen3-MoE with D = 2,048 on 2 chips at 32 tokens a chip, B = 64 (one block an expert),
    skewed routing (seed 1): each block stores the rows of its pairs, not its 64 rows (with the
    whole blocks stored: 48,404 cycles; 47,419 before the pinned routing was read after the
    router's top-k, `tcp.order`)."""
    dims = {"T": 64, "D": 2048, "F": 256, "E": 16, "K": 4, "B": 64}
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims=dims)
    sim = simulate_on_mesh(program, MeshSpec.parse("ep=2"), cost_only=True, routing="skewed", seed=1)
    assert sim.report.total_cycles == 47_433
