"""Issue #31, parts 4 to 6: the served decode step on a mesh (T global or per chip, down to one
token per chip; the all-to-all's latency-bound regime), the mesh report's choices, and cost-only
routings that load the chips as they load the experts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from runtime_sim.perf.routing_scenarios import balanced
from tcpc.cli import main

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
