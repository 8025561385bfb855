"""A checkpoint family a user declares in TOML (`--family FILE`, tcpc/family_file.py): OLMoE,
which tcpc has no table for, as examples/families/olmoe.toml declares it, loads a tiny OLMoE
checkpoint in both of its layouts; a mistake in the file names the file and the key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_checkpoints import D, E, EXAMPLES, F, LAYERS, Tiny, error, qwen3_moe, tcpc, write

from tcpc.checkpoint_families import FAMILIES
from tcpc.checkpoints import CheckpointError, compile_with_weights, open_checkpoint
from tcpc.family_file import load_family
from tcpc.program import compile_file

OLMOE_TOML = EXAMPLES / "families" / "olmoe.toml"
OLMOE = EXAMPLES / "families" / "olmoe.moe"
SETS = ("--set", "T=8", "--set", "B=4")


def olmoe(rng: np.random.Generator, fused: bool = False) -> Tiny:
    """OLMoE's tensors are Qwen3-MoE's (per expert as allenai released them, or transformers
    5's fused gate_up_proj); its config is OlmoeConfig's (intermediate_size, num_experts,
    norm_topk_prob false)."""
    tiny = qwen3_moe(rng, fused)
    tiny.config = {"model_type": "olmoe", "hidden_size": D, "intermediate_size": F, "num_experts": E,
                   "num_experts_per_tok": 2, "norm_topk_prob": False, "num_hidden_layers": LAYERS}
    return tiny


def test_olmoe_without_a_declared_family_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = error(capsys, write(tmp_path, olmoe(np.random.default_rng(0))), "qwen3_moe", 0, *SETS)
    assert "model_type 'olmoe' has no tensor mapping" in err
    assert "declare it in a TOML file given with --family, see docs/checkpoints.md" in err


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_declared_olmoe_family_loads(fused: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = olmoe(np.random.default_rng(1), fused)
    ckpt = write(tmp_path, tiny)
    families = (load_family(OLMOE_TOML), *FAMILIES)
    loaded = compile_with_weights(OLMOE, open_checkpoint(ckpt), 1, {"B": 4}, families=families)
    assert loaded.family.name == "olmoe" and loaded.dims == {"D": D, "F": F, "E": E, "K": 2}
    want = {k: v.astype(np.float32) for k, v in tiny.expected(1).items()}
    for name, value in want.items():
        assert np.array_equal(loaded.weights[name].astype(np.float32), value), name
    (got,) = loaded.program.run(loaded.weights, seed=2).outputs
    (by_hand,) = compile_file(OLMOE, {**tiny.dims, "B": 4}).run(want, seed=2).outputs
    assert np.array_equal(got, by_hand) and np.abs(got).max() > 0
    code, out, err = tcpc(capsys, "run", OLMOE, "--weights", ckpt, "--layer", 1, "--family", OLMOE_TOML, *SETS,
                          "--reference")
    assert code == 0, err
    assert f"weights: layer 1 of {ckpt} (olmoe: router, w_gate, w_up, w_down; dims D={D}, F={F}, E={E}, K=2" in out
    # what the declared program bakes in is checked as a built-in family's is
    tiny.config["norm_topk_prob"] = True
    err = error(capsys, write(tmp_path / "norm", tiny), "families/olmoe", 0, "--family", OLMOE_TOML, *SETS)
    assert ("norm_topk_prob = True, but examples/families/olmoe.moe needs False (the program does not renormalise "
            "the top-K probabilities)") in err


TEXT = OLMOE_TOML.read_text()


@pytest.mark.parametrize("old, new, message", [
    ('name = "olmoe"', 'name = "olmoe"\ncolour = "blue"', "colour: unknown key (known here: "),
    ('router = { tensor = "gate.weight", transpose = true }\nw_gate = { tensor = "experts.{e}',
     'router = { tensor = "gate.weight", transpose = "yes" }\nw_gate = { tensor = "experts.{e}',
     'layouts[0].arguments.router.transpose: expected true or false, got "yes"'),
    ('w_gate = { tensor = "experts.{e}.gate_proj.weight"', 'w_gate = { tensor = "experts.{x}.gate_proj.weight"',
     "layouts[0].arguments.w_gate.tensor: expected a tensor name under the prefix ({e}: one per expert)"),
    ('w_up = { tensor = "experts.{e}.up_proj.weight", transpose = true }',
     'w_up = { tensor = "experts.{e}.up_proj.weight", transpose = true, scale = "experts.up_proj.weight_scale_inv" }',
     "layouts[0].arguments.w_up.scale: expected a tensor name ({e} as in tensor)"),
    ('part = 0, parts_axis = 1', 'part = 2, parts_axis = 1',
     "layouts[1].arguments.w_gate.part: expected 0 (the gate) or 1 (the up projection), got 2"),
    ('D = "hidden_size"', 'D = "hidden"', "dims.D: config key 'hidden' is not declared under keys"),
    ('F = "intermediate_size"', 'F = ["intermediate_size", 2]', "dims.F: expected a config key or a list of them"),
    ('num_hidden_layers = { default = 16 }', 'num_hidden_layers = { default = 16, alias = ["n_layers"] }',
     "keys.num_hidden_layers.alias: unknown key"),
    ('num_hidden_layers = { default = 16 }', '', "layers_key: config key 'num_hidden_layers' is not declared under keys"),
    ('key = "norm_topk_prob"', 'key = "hidden_size"',
     "requirements: config key 'hidden_size' needs a default (the one transformers assumes)"),
    ('prefixes = ["model.layers.{layer}.mlp"]', 'prefixes = ["model.layers.mlp"]',
     "prefixes: expected a list of tensor-name prefixes with {layer}"),
    ('[programs]\nolmoe = "examples/families/olmoe.moe"\n', '', "programs: missing (a table)"),
    ('name = "per expert"', 'name = 3', "layouts[0].name: expected a string, got 3"),
    ('name = "olmoe"', 'name = "olmoe', "not valid TOML"),
], ids=["unknown-key", "not-a-bool", "bad-template", "scale-template", "part", "undeclared-dim-key", "dim-kind",
        "unknown-key-field", "undeclared-layers-key", "requirement-default", "prefix", "no-programs", "layout-name",
        "toml"])
def test_family_file_errors_name_the_file_and_the_key(old: str, new: str, message: str, tmp_path: Path) -> None:
    assert old in TEXT
    path = tmp_path / "family.toml"
    path.write_text(TEXT.replace(old, new, 1))
    with pytest.raises(CheckpointError) as caught:
        load_family(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value), str(caught.value)


def test_family_file_declares_which_layers_are_moe(tmp_path: Path) -> None:
    """[moe_layer] is the rule of the built-in tables (here Qwen3-MoE's and DeepSeek's)."""
    path = tmp_path / "family.toml"
    path.write_text(TEXT.replace("[keys]", '[keys]\nmlp_only_layers = { default = [] }\nfirst_k = { default = 1 }\n'
                                 'sparse_step = { default = 2 }', 1)
                    + '\n[moe_layer]\nfirst = "first_k"\nstep = "sparse_step"\noffset = 1\ndense = "mlp_only_layers"\n')
    family = load_family(path)
    config = {"first_k": 1, "sparse_step": 2, "mlp_only_layers": [5]}
    assert [layer for layer in range(8) if family.moe_layer(config, layer)] == [1, 3, 7]
    assert [layer for layer in range(8) if family.moe_layer({**config, "mlp_only_layers": None}, layer)] == [1, 3, 5, 7]
    path.write_text(TEXT + "\n[moe_layer]\nstep = 0\n")
    with pytest.raises(CheckpointError, match="moe_layer.step: expected a positive integer or a config key, got 0"):
        load_family(path)
    path.write_text(TEXT + '\n[moe_layer]\ndense = "mlp_only_layers"\n')
    with pytest.raises(CheckpointError, match="moe_layer: config key 'mlp_only_layers' is not declared under keys"):
        load_family(path)


def test_a_missing_family_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = error(capsys, write(tmp_path, olmoe(np.random.default_rng(0))), "families/olmoe", 0, "--family",
                tmp_path / "nowhere.toml", *SETS)
    assert f"{tmp_path / 'nowhere.toml'}: no such file or directory" in err
