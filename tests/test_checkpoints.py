"""`tcpc run --weights`: tiny checkpoints of every family, written with safetensors' numpy API
in the HuggingFace names and layouts (and a config.json), run with --check and compared with
the same weights passed as an npz; and the errors of a checkpoint that does not fit."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16, float4_e2m1fn, float8_e8m0fnu
from safetensors.numpy import save_file

from tcpc.checkpoints import CheckpointError, compile_with_weights, open_checkpoint
from tcpc.cli import main
from tcpc.program import compile_file

EXAMPLES = Path(__file__).parent.parent / "examples"
LAYERS = 2
D, F, E = 64, 32, 4  # multiples of 32: MXFP4 blocks


def bf16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(bfloat16)


@dataclass
class Tiny:
    """A tiny checkpoint: HF tensors of every layer, its config, and what the graph's
    arguments must be for layer 1 (built here by hand, not by the loader's tables)."""

    tensors: dict[str, np.ndarray]
    config: dict[str, object]
    expected: Callable[[int], dict[str, np.ndarray]]
    dims: dict[str, int]
    stored: Callable[[int], dict[str, np.ndarray]] | None = None
    """A low-precision checkpoint's arguments of the low-precision program: the stored codes
    and scales in its layout."""


def per_expert(rng: np.random.Generator, prefix: str, names: tuple[str, str, str], f: int = F) -> dict[str, np.ndarray]:
    gate, up, down = names
    out = {}
    for e in range(E):
        out[f"{prefix}.experts.{e}.{gate}.weight"] = bf16(rng, f, D)
        out[f"{prefix}.experts.{e}.{up}.weight"] = bf16(rng, f, D)
        out[f"{prefix}.experts.{e}.{down}.weight"] = bf16(rng, D, f)
    return out


def stacked_t(tensors: dict[str, np.ndarray], prefix: str, name: str) -> np.ndarray:
    return np.stack([tensors[f"{prefix}.experts.{e}.{name}.weight"].T for e in range(E)])


def mixtral(rng: np.random.Generator) -> Tiny:
    t: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}.block_sparse_moe"
        t[f"{p}.gate.weight"] = bf16(rng, E, D)
        t.update(per_expert(rng, p, ("w1", "w3", "w2")))
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = bf16(rng, D, D)  # not read

    def expected(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}.block_sparse_moe"
        return {"router": t[f"{p}.gate.weight"].T, "w_gate": stacked_t(t, p, "w1"), "w_up": stacked_t(t, p, "w3"),
                "w_down": stacked_t(t, p, "w2")}

    config = {"model_type": "mixtral", "hidden_size": D, "intermediate_size": F, "num_local_experts": E,
              "num_experts_per_tok": 2, "num_hidden_layers": LAYERS}
    return Tiny(t, config, expected, {"D": D, "F": F, "E": E, "K": 2})


def qwen3_moe(rng: np.random.Generator, fused: bool = False) -> Tiny:
    t: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp"
        t[f"{p}.gate.weight"] = bf16(rng, E, D)
        if fused:
            t[f"{p}.experts.gate_up_proj"] = bf16(rng, E, 2 * F, D)
            t[f"{p}.experts.down_proj"] = bf16(rng, E, D, F)
        else:
            t.update(per_expert(rng, p, ("gate_proj", "up_proj", "down_proj")))

    def expected(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}.mlp"
        if fused:
            gu = t[f"{p}.experts.gate_up_proj"]
            experts = {"w_gate": gu[:, :F, :].transpose(0, 2, 1), "w_up": gu[:, F:, :].transpose(0, 2, 1),
                       "w_down": t[f"{p}.experts.down_proj"].transpose(0, 2, 1)}
        else:
            experts = {"w_gate": stacked_t(t, p, "gate_proj"), "w_up": stacked_t(t, p, "up_proj"),
                       "w_down": stacked_t(t, p, "down_proj")}
        return {"router": t[f"{p}.gate.weight"].T, **experts}

    config = {"model_type": "qwen3_moe", "hidden_size": D, "moe_intermediate_size": F, "num_experts": E,
              "num_experts_per_tok": 2, "num_hidden_layers": LAYERS, "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    return Tiny(t, config, expected, {"D": D, "F": F, "E": E, "K": 2})


def deepseek_v3(rng: np.random.Generator) -> Tiny:
    t: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp"
        t[f"{p}.gate.weight"] = bf16(rng, E, D)
        t[f"{p}.gate.e_score_correction_bias"] = rng.standard_normal(E).astype(np.float32)
        t.update(per_expert(rng, p, ("gate_proj", "up_proj", "down_proj")))
        for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            t[f"{p}.shared_experts.{name}.weight"] = bf16(rng, *shape)

    def expected(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}.mlp"
        return {"router": t[f"{p}.gate.weight"].T, "bias": t[f"{p}.gate.e_score_correction_bias"],
                "w_gate": stacked_t(t, p, "gate_proj"), "w_up": stacked_t(t, p, "up_proj"),
                "w_down": stacked_t(t, p, "down_proj"),
                "ws_gate": t[f"{p}.shared_experts.gate_proj.weight"].T, "ws_up": t[f"{p}.shared_experts.up_proj.weight"].T,
                "ws_down": t[f"{p}.shared_experts.down_proj.weight"].T}

    config = {"model_type": "deepseek_v3", "hidden_size": D, "moe_intermediate_size": F, "n_routed_experts": E,
              "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
              "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_hidden_layers": LAYERS,
              "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    return Tiny(t, config, expected, {"D": D, "F": F, "FS": F, "E": E, "K": 2, "NG": 2, "TG": 1})


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def mxfp4(rng: np.random.Generator, *shape: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random MXFP4 codes for a [..., N] weight: the packed blocks [..., N/32, 16], the e8m0
    scales [..., N/32], the values they stand for (built from the codes, not unpacked), and
    the codes as f4e2m1 (one a byte)."""
    codes = rng.integers(0, 16, size=shape)
    scales = rng.integers(120, 130, size=(*shape[:-1], shape[-1] // 32)).astype(np.uint8)
    sign = np.where(codes >= 8, -1.0, 1.0)
    values = sign * np.array(E2M1)[codes % 8] * 2.0 ** (np.repeat(scales, 32, axis=-1).astype(np.int64) - 127)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed.reshape(*shape[:-1], shape[-1] // 32, 16), scales, values, codes.astype(np.uint8).view(float4_e2m1fn)


def gpt_oss(rng: np.random.Generator, quantized: bool = False) -> Tiny:
    """bf16 experts ([E, D, 2F] interleaved), or the released MXFP4 ones ([E, 2F, D] interleaved
    and [E, D, F], blocks along the input axis)."""
    t: dict[str, np.ndarray] = {}
    dense: dict[str, np.ndarray] = {}  # the MXFP4 weights' values, in the bf16 layout
    codes: dict[str, np.ndarray] = {}  # their codes and scales, in the bf16 layout
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp"
        t[f"{p}.router.weight"] = bf16(rng, E, D)
        t[f"{p}.router.bias"] = bf16(rng, E)
        if quantized:
            for name, shape in (("gate_up_proj", (E, 2 * F, D)), ("down_proj", (E, D, F))):
                t[f"{p}.experts.{name}_blocks"], scales, values, f4 = mxfp4(rng, *shape)
                t[f"{p}.experts.{name}_scales"] = scales
                dense[f"{p}.experts.{name}"] = values.transpose(0, 2, 1)
                codes[f"{p}.experts.{name}"] = f4.transpose(0, 2, 1)
                codes[f"{p}.experts.{name}_scale"] = scales.view(float8_e8m0fnu).transpose(0, 2, 1)
        else:
            t[f"{p}.experts.gate_up_proj"] = bf16(rng, E, D, 2 * F)
            t[f"{p}.experts.down_proj"] = bf16(rng, E, F, D)
        t[f"{p}.experts.gate_up_proj_bias"] = bf16(rng, E, 2 * F)
        t[f"{p}.experts.down_proj_bias"] = bf16(rng, E, D)

    def expected(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}.mlp"
        weights = dense if quantized else t
        gu, gub = weights[f"{p}.experts.gate_up_proj"], t[f"{p}.experts.gate_up_proj_bias"]
        return {"router": t[f"{p}.router.weight"].T, "router_bias": t[f"{p}.router.bias"],
                "w_gate": gu[..., 0::2], "b_gate": gub[..., 0::2], "w_up": gu[..., 1::2], "b_up": gub[..., 1::2],
                "w_down": weights[f"{p}.experts.down_proj"], "b_down": t[f"{p}.experts.down_proj_bias"]}

    def stored(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}.mlp.experts"
        gu, gus = codes[f"{p}.gate_up_proj"], codes[f"{p}.gate_up_proj_scale"]
        return {"w_gate": gu[..., 0::2], "w_gate_scale": gus[..., 0::2], "w_up": gu[..., 1::2],
                "w_up_scale": gus[..., 1::2], "w_down": codes[f"{p}.down_proj"], "w_down_scale": codes[f"{p}.down_proj_scale"]}

    config = {"model_type": "gpt_oss", "hidden_size": D, "intermediate_size": F, "num_local_experts": E,
              "num_experts_per_tok": 2, "num_hidden_layers": LAYERS, "swiglu_limit": 7.0}
    if quantized:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                            "model.layers.*.mlp.router"]}
    return Tiny(t, config, expected, {"D": D, "F": F, "E": E, "K": 2}, stored if quantized else None)


def llama4(rng: np.random.Generator) -> Tiny:
    t: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        p = f"language_model.model.layers.{i}.feed_forward"
        t[f"{p}.router.weight"] = bf16(rng, E, D)
        t[f"{p}.experts.gate_up_proj"] = bf16(rng, E, D, 2 * F)
        t[f"{p}.experts.down_proj"] = bf16(rng, E, F, D)
        for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            t[f"{p}.shared_expert.{name}.weight"] = bf16(rng, *shape)

    def expected(i: int) -> dict[str, np.ndarray]:
        p = f"language_model.model.layers.{i}.feed_forward"
        gu = t[f"{p}.experts.gate_up_proj"]
        return {"router": t[f"{p}.router.weight"].T, "w_gate": gu[..., :F], "w_up": gu[..., F:],
                "w_down": t[f"{p}.experts.down_proj"],
                "ws_gate": t[f"{p}.shared_expert.gate_proj.weight"].T, "ws_up": t[f"{p}.shared_expert.up_proj.weight"].T,
                "ws_down": t[f"{p}.shared_expert.down_proj.weight"].T}

    text = {"model_type": "llama4_text", "hidden_size": D, "intermediate_size": F, "intermediate_size_mlp": 4 * F,
            "num_local_experts": E, "num_experts_per_tok": 1, "num_hidden_layers": LAYERS,
            "interleave_moe_layer_step": 1}
    return Tiny(t, {"model_type": "llama4", "text_config": text}, expected, {"D": D, "F": F, "FS": F, "E": E, "K": 1})


FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss,
            "llama4": llama4}


def write(tmp: Path, tiny: Tiny, shards: int = 1, config: bool = True) -> Path:
    """A snapshot directory: config.json and the tensors in `shards` files (with an index when
    more than one, as HF writes them)."""
    tmp.mkdir(parents=True, exist_ok=True)
    names = sorted(tiny.tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({n: np.ascontiguousarray(tiny.tensors[n]) for n in part}, str(tmp / file))
        weight_map.update({n: file for n in part})
    if shards > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config:
        (tmp / "config.json").write_text(json.dumps(tiny.config))
    return tmp


def tcpc(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_checkpoint_runs_checks_and_matches_npz(family: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    tiny = FAMILIES[family](np.random.default_rng(7))
    ckpt = write(tmp_path / "ckpt", tiny, shards=2)
    program = EXAMPLES / f"{family}.moe"
    code, out, err = tcpc(capsys, "run", program, "--weights", ckpt, "--layer", 1, "--check",
                          "--out", tmp_path / "from_ckpt.npz")
    assert code == 0, err
    assert "check: outputs" in out and f"weights: layer 1 of {ckpt}" in out
    # The same weights by hand, as an npz, with the dims given by --set.
    np.savez(tmp_path / "weights.npz", **{k: np.asarray(v, np.float32) for k, v in tiny.expected(1).items()})
    sets = [a for k, v in tiny.dims.items() for a in ("--set", f"{k}={v}")]
    code, _, err = tcpc(capsys, "run", program, "--inputs", tmp_path / "weights.npz", *sets,
                        "--out", tmp_path / "from_npz.npz")
    assert code == 0, err
    a, b = np.load(tmp_path / "from_ckpt.npz"), np.load(tmp_path / "from_npz.npz")
    assert np.array_equal(a["out0"], b["out0"])
    assert np.abs(a["out0"]).max() > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loaded_weights_are_the_hf_tensors_in_program_layout(family: str, tmp_path: Path) -> None:
    tiny = FAMILIES[family](np.random.default_rng(3))
    ckpt = open_checkpoint(write(tmp_path, tiny))
    for layer in range(LAYERS):
        loaded = compile_with_weights(EXAMPLES / f"{family}.moe", ckpt, layer, {})
        assert loaded.dims == tiny.dims
        want = tiny.expected(layer)
        assert set(loaded.weights) == set(want)
        for name, value in want.items():
            assert loaded.weights[name].shape == value.shape, name
            assert np.array_equal(loaded.weights[name].astype(np.float32), value.astype(np.float32)), name


def test_fused_qwen3_layout_and_a_single_file(tmp_path: Path) -> None:
    tiny = qwen3_moe(np.random.default_rng(5), fused=True)
    write(tmp_path, tiny)
    ckpt = open_checkpoint(tmp_path / "model.safetensors")  # a file: config.json beside it is read
    loaded = compile_with_weights(EXAMPLES / "qwen3_moe.moe", ckpt, 0, {"T": 8})
    assert loaded.program.dims["T"] == 8 and loaded.program.dims["F"] == F
    for name, value in tiny.expected(0).items():
        assert np.array_equal(loaded.weights[name].astype(np.float32), value.astype(np.float32)), name


def test_without_config_dims_come_from_the_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = mixtral(np.random.default_rng(1))
    ckpt = write(tmp_path, tiny, config=False)
    sets = [a for k, v in tiny.dims.items() for a in ("--set", f"{k}={v}")]
    code, _, err = tcpc(capsys, "run", EXAMPLES / "mixtral.moe", "--weights", ckpt, "--layer", 0, *sets, "--reference")
    assert code == 0, err
    # without --set, the program's default dims do not fit the checkpoint: a shape error
    code, _, err = tcpc(capsys, "run", EXAMPLES / "mixtral.moe", "--weights", ckpt, "--layer", 0, "--reference")
    assert code == 1
    assert "tensor 'model.layers.0.block_sparse_moe.experts.4.w1.weight' not found" in err  # E = 8 there
    code, _, err = tcpc(capsys, "run", EXAMPLES / "mixtral.moe", "--weights", ckpt, "--layer", 0, "--set", "E=4",
                        "--reference")
    assert code == 1
    assert (f"model.safetensors: tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight' has shape [{F}, {D}], "
            f"expected [128, {D}] (argument 'w_gate' bf16[4, 64, 128] of mixtral.moe)") in err  # F = 128 there


def error(capsys: pytest.CaptureFixture[str], ckpt: Path, family: str = "qwen3_moe", layer: int = 0,
          *more: object, status: int = 1) -> str:
    code, _, err = tcpc(capsys, "run", EXAMPLES / f"{family}.moe", "--weights", ckpt, "--layer", layer, *more)
    assert code == status, err
    assert err.startswith("tcpc: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_errors_name_the_tensor_shapes_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    base = qwen3_moe(rng)
    # a missing tensor
    tiny = qwen3_moe(rng)
    del tiny.tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    err = error(capsys, write(tmp_path / "missing", tiny))
    assert "tensor 'model.layers.0.mlp.experts.3.up_proj.weight' not found" in err and "missing" in err
    # a wrong shape
    tiny = qwen3_moe(rng)
    tiny.tensors["model.layers.0.mlp.experts.1.down_proj.weight"] = bf16(rng, D, F + 1)
    err = error(capsys, write(tmp_path / "shape", tiny))
    assert (f"{tmp_path / 'shape' / 'model.safetensors'}: tensor 'model.layers.0.mlp.experts.1.down_proj.weight' "
            f"has shape [{D}, {F + 1}], expected [{D}, {F}]") in err
    # a wrong dtype
    tiny = qwen3_moe(rng)
    tiny.tensors["model.layers.0.mlp.gate.weight"] = np.ones((E, D), np.int32)
    err = error(capsys, write(tmp_path / "dtype", tiny))
    assert "tensor 'model.layers.0.mlp.gate.weight' is I32, expected a float tensor" in err
    # a layer out of range
    err = error(capsys, write(tmp_path / "ok", base), "qwen3_moe", 5)
    assert "layer 5 is out of range" in err and "num_hidden_layers = 2 (layers 0..1)" in err
    # a program of another family
    err = error(capsys, tmp_path / "ok", "mixtral")
    assert ("a qwen3_moe checkpoint; its programs are examples/qwen3_moe.moe (graph 'qwen3_moe'), "
            "examples/qwen3_moe_fp8.moe (graph 'qwen3_moe_fp8'), not graph 'mixtral'") in err
    # a model with no mapping
    other = qwen3_moe(rng)
    other.config["model_type"] = "llama"
    err = error(capsys, write(tmp_path / "llama", other))
    assert "model_type 'llama' has no tensor mapping" in err
    # a config value the program bakes in
    other = qwen3_moe(rng)
    other.config["norm_topk_prob"] = False
    err = error(capsys, write(tmp_path / "norm", other))
    assert "norm_topk_prob = False, but examples/qwen3_moe.moe needs True" in err
    # a dense layer
    dense = deepseek_v3(rng)
    dense.config["first_k_dense_replace"] = 1
    err = error(capsys, write(tmp_path / "dense", dense), "deepseek_v3", 0)
    assert "layer 0 of this deepseek_v3 checkpoint is a dense MLP" in err and "MoE layers: 1" in err
    # flags
    err = error(capsys, tmp_path / "ok", "qwen3_moe", 0, "--cost-only", status=2)  # usage errors exit 2
    assert "--weights does not apply to --cost-only" in err
    code, _, err = tcpc(capsys, "run", EXAMPLES / "qwen3_moe.moe", "--weights", tmp_path / "ok")
    assert code == 2 and "--weights and --layer go together" in err
    err = error(capsys, tmp_path / "nowhere")
    assert "nowhere: no such file or directory" in err


def test_only_the_chosen_layer_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tcpc import checkpoints

    tiny = mixtral(np.random.default_rng(2))
    ckpt = open_checkpoint(write(tmp_path, tiny))
    read: list[str] = []
    original = checkpoints._Reader.read

    def spy(self: checkpoints._Reader, name: str, file: Path) -> np.ndarray:
        read.append(name)
        return original(self, name, file)

    monkeypatch.setattr(checkpoints._Reader, "read", spy)
    compile_with_weights(EXAMPLES / "mixtral.moe", ckpt, 1, {})
    assert read and all(n.startswith("model.layers.1.block_sparse_moe.") for n in read)
    assert len(read) == 1 + 3 * E


def test_bad_checkpoint_files(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="junk.safetensors: not a readable safetensors file"):
        open_checkpoint(tmp_path / "junk.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors file"):
        open_checkpoint(tmp_path / "empty")


def test_a_program_with_no_table(tmp_path: Path) -> None:
    ckpt = open_checkpoint(write(tmp_path, mixtral(np.random.default_rng(0)), config=False))
    with pytest.raises(CheckpointError, match="graph 'toy' has no checkpoint mapping"):
        compile_with_weights(EXAMPLES / "toy.moe", ckpt, 0, {})


HF_CONFIGS = sorted((Path(__file__).parent / "fixtures" / "hf_configs").glob("*/*/config.json"))
"""config.json files written by transformers' own config classes (tests/fixtures/make_hf_configs.py)."""


@pytest.mark.parametrize("fixture", HF_CONFIGS, ids=lambda p: f"{p.parent.parent.name}-{p.parent.name}")
def test_configs_written_by_transformers(fixture: Path, tmp_path: Path) -> None:
    """Each family's config.json as transformers 4.x and 5.x write it gives the program its
    dims and picks the MoE layers; the layer's reference run equals the one with the weights
    and dims given by hand (the lowering of these programs is checked above)."""
    family = fixture.parent.name
    tiny = FAMILIES[family](np.random.default_rng(13))
    tiny.config = json.loads(fixture.read_text())
    ckpt = open_checkpoint(write(tmp_path, tiny))
    program = EXAMPLES / f"{family}.moe"
    loaded = compile_with_weights(program, ckpt, 1, {})
    assert loaded.dims == tiny.dims
    want = {k: v.astype(np.float32) for k, v in tiny.expected(1).items()}
    for name, value in want.items():
        assert np.array_equal(loaded.weights[name].astype(np.float32), value), name
    (got,) = loaded.program.run(loaded.weights, seed=4).outputs
    (by_hand,) = compile_file(program, tiny.dims).run(want, seed=4).outputs
    assert np.array_equal(got, by_hand) and np.abs(got).max() > 0
    if family in ("qwen3_moe", "deepseek_v3"):  # mlp_only_layers = [0], first_k_dense_replace = 1
        with pytest.raises(CheckpointError, match="layer 0 of this .* checkpoint is a dense MLP"):
            compile_with_weights(program, ckpt, 0, {})


@pytest.mark.parametrize("family, key, alias", [
    ("mixtral", "num_local_experts", "num_experts"), ("qwen3_moe", "num_experts", "num_local_experts"),
    ("deepseek_v3", "n_routed_experts", "num_local_experts"), ("gpt_oss", "num_local_experts", "num_experts"),
    ("gpt_oss", "num_experts_per_tok", "experts_per_token")])
def test_a_key_under_its_alias(family: str, key: str, alias: str, tmp_path: Path) -> None:
    """transformers' attribute_map aliases (5.x writes Qwen3-MoE's E as num_local_experts), and
    the name another release writes: the same dims, and the two together must agree."""
    tiny = FAMILIES[family](np.random.default_rng(0))
    tiny.config[alias] = tiny.config.pop(key)
    loaded = compile_with_weights(EXAMPLES / f"{family}.moe", open_checkpoint(write(tmp_path / "alias", tiny)), 0, {})
    assert loaded.dims == tiny.dims
    tiny.config[key] = tiny.config[alias] + 1
    with pytest.raises(CheckpointError, match=f"config.json: {key} = {tiny.config[key]} but {alias} = "
                                              f"{tiny.config[alias]}; transformers reads both as {key}"):
        compile_with_weights(EXAMPLES / f"{family}.moe", open_checkpoint(write(tmp_path / "both", tiny)), 0, {})


def test_omitted_keys_take_transformers_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    # DeepSeek-V3: first_k_dense_replace 3, so a 2-layer model has no MoE layer
    tiny = deepseek_v3(rng)
    for key in ("first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "norm_topk_prob",
                "scoring_func", "topk_method", "n_shared_experts"):
        del tiny.config[key]
    err = error(capsys, write(tmp_path / "deepseek", tiny), "deepseek_v3", 1)
    assert "layer 1 of this deepseek_v3 checkpoint is a dense MLP" in err and "MoE layers: none" in err
    # Qwen3-MoE: norm_topk_prob false; mlp_only_layers null is no layer
    tiny = qwen3_moe(rng)
    del tiny.config["norm_topk_prob"]
    err = error(capsys, write(tmp_path / "qwen3", tiny))
    assert "norm_topk_prob = False, but examples/qwen3_moe.moe needs True" in err
    tiny.config.update(norm_topk_prob=True, mlp_only_layers=None)
    del tiny.config["num_hidden_layers"], tiny.config["decoder_sparse_step"]
    loaded = compile_with_weights(EXAMPLES / "qwen3_moe.moe", open_checkpoint(write(tmp_path / "qwen3", tiny)), 1, {})
    assert loaded.dims == tiny.dims
    # Llama-4: K is 1, every layer is MoE
    tiny = llama4(rng)
    text = tiny.config["text_config"]
    assert isinstance(text, dict)
    del text["num_experts_per_tok"], text["interleave_moe_layer_step"]
    loaded = compile_with_weights(EXAMPLES / "llama4.moe", open_checkpoint(write(tmp_path / "llama4", tiny)), 1, {})
    assert loaded.dims == tiny.dims


def test_config_keys_missing_or_of_the_wrong_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    tiny = qwen3_moe(rng)
    del tiny.config["num_experts"]
    ckpt = write(tmp_path / "missing", tiny)
    err = error(capsys, ckpt)
    assert (f"{ckpt / 'config.json'}: no 'num_experts' or its alias 'num_local_experts' (the E dim of qwen3_moe.moe; "
            "or give it with --set E=N)") in err
    assert compile_with_weights(EXAMPLES / "qwen3_moe.moe", open_checkpoint(ckpt), 0, {"E": E}).program.dims["E"] == E
    tiny = gpt_oss(rng)
    del tiny.config["num_experts_per_tok"]
    err = error(capsys, write(tmp_path / "k", tiny), "gpt_oss")
    assert "no 'num_experts_per_tok' or its alias 'experts_per_token' (the K dim of gpt_oss.moe" in err
    tiny = deepseek_v3(rng)
    del tiny.config["moe_intermediate_size"]  # FS = moe_intermediate_size x n_shared_experts
    err = error(capsys, write(tmp_path / "fs", tiny), "deepseek_v3", 0, "--set", f"F={F}")
    assert "no 'moe_intermediate_size' (the FS dim of deepseek_v3.moe; or give it with --set FS=N)" in err
    for key, value, message in (
            ("n_group", None, "n_group = null, expected a positive integer"),
            ("n_routed_experts", 0, "n_routed_experts = 0, expected a positive integer"),
            ("topk_group", 1.0, "topk_group = 1.0, expected a positive integer"),
            ("first_k_dense_replace", None,
             "first_k_dense_replace = null, expected a value like transformers' default 3"),
            ("norm_topk_prob", 1, "norm_topk_prob = 1, expected a value like transformers' default true"),
            ("routed_scaling_factor", "2.5", "routed_scaling_factor = \"2.5\", expected a value like transformers' "
                                             "default 2.5")):
        tiny = deepseek_v3(rng)
        tiny.config[key] = value
        assert message in error(capsys, write(tmp_path / key, tiny), "deepseek_v3"), key
