"""`tcpc run --weights` with the low-precision checkpoints that exist: DeepSeek-V3's fp8 (f8e4m3
experts with an f32 `weight_scale_inv` per 128 x 128 block, ceil-divided at ragged edges) and
gpt-oss's MXFP4 (`*_blocks` with two e2m1 codes a byte, `*_scales` e8m0, interleaved gate/up
rows), written with safetensors' numpy API in the Hub's names and layouts. They feed the
fp8 / MXFP4 programs as stored (checked code for code), run with --check, and stay near the
bf16 layer on the same weights dequantized by hand; a precision that does not match the
program's needs an explicit conversion; and the errors name the tensor, the shapes and the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16, float4_e2m1fn, float8_e4m3fn, float8_e8m0fnu
from test_checkpoints import EXAMPLES, LAYERS, Tiny, error, gpt_oss, qwen3_moe, tcpc, write

from runtime_sim.semantics.quantization import quantize_blocks
from tcpc.checkpoints import CheckpointError, compile_with_weights, open_checkpoint
from tcpc.program import compile_file

D8, F8, E8 = 256, 128, 4  # two and one 128-blocks
FAST = {"T": 8, "B": 4}  # no block=auto search: its cost-only runs would dominate these tests
SETS = ("--set", "T=8", "--set", "B=4")


def fp8_weight(rng: np.random.Generator, out: int, inp: int, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """An nn.Linear weight [out, in] as DeepSeek-V3 stores it: f8e4m3 codes (saturated, as
    its quantizer clamps them) and f32 weight_scale_inv [ceil(out / 128), ceil(in / 128)]."""
    codes = np.clip(rng.standard_normal((out, inp)) * 100, -448, 448).astype(np.float32).astype(float8_e4m3fn)
    scales = np.exp2(rng.uniform(-12, -9, size=(-(-out // block), -(-inp // block)))).astype(np.float32)
    return codes, scales


def real(codes: np.ndarray, scales: np.ndarray, block: int = 128) -> np.ndarray:
    """What a weight and its weight_scale_inv stand for (transformers' `Fp8Dequantize`, cropped
    at ragged edges), in f32."""
    out, inp = codes.shape
    return codes.astype(np.float32) * np.repeat(np.repeat(scales, block, axis=0), block, axis=1)[:out, :inp]


def deepseek_v3_fp8(rng: np.random.Generator, f: int = F8) -> Tiny:
    """DeepSeek-V3's fp8 checkpoint (deepseek-ai/DeepSeek-V3): every expert's and the shared
    expert's projections in f8e4m3 with weight_scale_inv; the router (bf16) and the correction
    bias (f32) as they are. `expected` gives the bf16 program's arguments (dequantized by
    hand), `stored` the fp8 program's (codes and scales transposed to [in, out])."""
    t: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp"
        t[f"{p}.gate.weight"] = (rng.standard_normal((E8, D8)) / 16).astype(bfloat16)
        t[f"{p}.gate.e_score_correction_bias"] = rng.standard_normal(E8).astype(np.float32)
        for owner in [f"experts.{e}" for e in range(E8)] + ["shared_experts"]:
            for name, shape in (("gate_proj", (f, D8)), ("up_proj", (f, D8)), ("down_proj", (D8, f))):
                w = f"{p}.{owner}.{name}"
                t[f"{w}.weight"], t[f"{w}.weight_scale_inv"] = fp8_weight(rng, *shape)

    def by_argument(i: int, pick: str) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}.mlp"

        def arrays(w: str) -> tuple[np.ndarray, np.ndarray]:
            return t[f"{w}.weight"], t[f"{w}.weight_scale_inv"]

        out: dict[str, np.ndarray] = {}
        for arg, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            pairs = [arrays(f"{p}.experts.{e}.{name}") for e in range(E8)]
            shared = arrays(f"{p}.shared_experts.{name}")
            if pick == "real":
                out[f"w_{arg}"] = np.stack([real(*q).T for q in pairs])
                out[f"ws_{arg}"] = real(*shared).T
            else:
                out[f"w_{arg}"], out[f"w_{arg}_scale"] = (np.stack([q[k].T for q in pairs]) for k in (0, 1))
                out[f"ws_{arg}"], out[f"ws_{arg}_scale"] = shared[0].T, shared[1].T
        if pick == "stored":
            return out
        return {"router": t[f"{p}.gate.weight"].T, "bias": t[f"{p}.gate.e_score_correction_bias"], **out}

    config = {"model_type": "deepseek_v3", "hidden_size": D8, "moe_intermediate_size": f, "n_routed_experts": E8,
              "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0,
              "num_hidden_layers": LAYERS,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    dims = {"D": D8, "F": f, "E": E8, "K": 2, "NG": 2, "TG": 1, "FS": f}
    return Tiny(t, config, lambda i: by_argument(i, "real"), dims, lambda i: by_argument(i, "stored"))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


@pytest.mark.parametrize("build, program", [(deepseek_v3_fp8, "deepseek_v3_fp8"),
                                            (lambda rng: gpt_oss(rng, quantized=True), "gpt_oss_mxfp4")],
                         ids=["fp8", "mxfp4"])
def test_stored_codes_and_scales_reach_the_program_unchanged(build, program: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The fp8 program's weights are the checkpoint's f8e4m3 codes and f32 scales, the MXFP4
    program's its f4e2m1 codes and e8m0 scales, bit for bit, only transposed (and gpt-oss's
    interleaved gate and up rows split): nothing dequantized on the host."""
    tiny = build(np.random.default_rng(4))
    ckpt = open_checkpoint(write(tmp_path, tiny, shards=2))
    loaded = compile_with_weights(EXAMPLES / f"{program}.moe", ckpt, 1, FAST)
    assert not loaded.conversions
    stored = tiny.stored(1)
    for name, value in stored.items():
        assert same_bits(loaded.weights[name], value), name
    bf16_args = tiny.expected(1)
    for name in set(bf16_args) - set(stored):  # router, biases: as the bf16 program takes them
        assert np.array_equal(loaded.weights[name].astype(np.float32), bf16_args[name].astype(np.float32)), name
    if program == "deepseek_v3_fp8":  # the weight block dims from quantization_config.weight_block_size
        assert {k: loaded.dims[k] for k in ("QN", "QK", "QG")} == {"QN": 128, "QK": 128, "QG": 128}


@pytest.mark.parametrize("build, program, bf16_program", [
    (deepseek_v3_fp8, "deepseek_v3_fp8", "deepseek_v3"),
    (lambda rng: gpt_oss(rng, quantized=True), "gpt_oss_mxfp4", "gpt_oss")], ids=["fp8", "mxfp4"])
def test_low_precision_checkpoint_runs_checked_and_near_its_bf16_layer(build, program: str, bf16_program: str,  # type: ignore[no-untyped-def]
                                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tcpc run PROGRAM --weights CKPT --layer 1 --check` simulates the layer and equals its
    reference; its output stays near the bf16 layer run on the same weights dequantized by
    hand (the low-precision layer quantizes its activations to f8e4m3 too: a few percent,
    where a weight in the wrong place gives the order of the output itself)."""
    tiny = build(np.random.default_rng(8))
    ckpt = write(tmp_path / "ckpt", tiny)
    x = np.random.default_rng(9).standard_normal((FAST["T"], tiny.dims["D"])).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    code, out, err = tcpc(capsys, "run", EXAMPLES / f"{program}.moe", "--weights", ckpt, "--layer", 1, "--check",
                          "--inputs", tmp_path / "x.npz", "--set", "T=8", "--set", "B=4", "--out", tmp_path / "low.npz")
    assert code == 0, err
    assert "check: outputs equal the reference" in out and f"weights: layer 1 of {ckpt}" in out
    low = np.load(tmp_path / "low.npz")["out0"].astype(np.float64)
    weights = {k: np.asarray(v, np.float32) for k, v in tiny.expected(1).items()}
    (ref,) = compile_file(EXAMPLES / f"{bf16_program}.moe", {**tiny.dims, **FAST}).run({"x": x, **weights}).outputs
    ref = np.asarray(ref, np.float64)
    assert np.abs(ref).max() > 0
    assert np.linalg.norm(low - ref) < 0.1 * np.linalg.norm(ref)


def test_qwen3_fp8_checkpoint(tmp_path: Path) -> None:
    """Qwen/Qwen3-30B-A3B-FP8's layout: each expert's projections in f8e4m3 with
    weight_scale_inv, the router in bf16; here in blocks of 64 (its config says so)."""
    rng = np.random.default_rng(10)
    t: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp"
        t[f"{p}.gate.weight"] = (rng.standard_normal((E8, D8)) / 16).astype(bfloat16)
        for e in range(E8):
            for name, shape in (("gate_proj", (F8, D8)), ("up_proj", (F8, D8)), ("down_proj", (D8, F8))):
                t[f"{p}.experts.{e}.{name}.weight"], t[f"{p}.experts.{e}.{name}.weight_scale_inv"] = fp8_weight(
                    rng, *shape, block=64)
    config = {"model_type": "qwen3_moe", "hidden_size": D8, "moe_intermediate_size": F8, "num_experts": E8,
              "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": LAYERS,
              "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}
    ckpt = open_checkpoint(write(tmp_path, Tiny(t, config, lambda i: {}, {})))
    loaded = compile_with_weights(EXAMPLES / "qwen3_moe_fp8.moe", ckpt, 1, FAST)
    assert {k: loaded.dims[k] for k in ("QN", "QK", "QG")} == {"QN": 64, "QK": 64, "QG": 64}
    p = "model.layers.1.mlp"
    for arg, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        for k, suffix in ((arg, "weight"), (f"{arg}_scale", "weight_scale_inv")):
            want = np.stack([t[f"{p}.experts.{e}.{name}.{suffix}"].T for e in range(E8)])
            assert same_bits(loaded.weights[k], want), k
    assert np.array_equal(loaded.weights["router"], t[f"{p}.gate.weight"].T)


def test_a_precision_the_program_does_not_declare_is_an_explicit_conversion(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """fp8 or MXFP4 weights into a bf16 program, or bf16 ones into an fp8 program: refused,
    saying which conversion to ask for; asked for, dequantized or quantized by the one
    definition (runtime_sim/semantics/quantization.py), and the weights line says so."""
    rng = np.random.default_rng(5)
    fp8 = deepseek_v3_fp8(rng)
    ckpt = write(tmp_path / "fp8", fp8)
    p = "model.layers.0.mlp.experts.0.gate_proj"
    err = error(capsys, ckpt, "deepseek_v3", 0, *SETS)
    assert (f"tensor '{p}.weight' is F8_E4M3 with block scales '{p}.weight_scale_inv' (in blocks of 1 x 128 x 128 "
            f"here), and argument 'w_gate' bf16[{E8}, {D8}, {F8}] of deepseek_v3.moe is bf16: dequantizing is a "
            "conversion tcpc makes only when asked (--convert-weights dequantize); or run examples/deepseek_v3_fp8.moe") in err
    err = error(capsys, ckpt, "deepseek_v3", 0, "--convert-weights", "quantize", *SETS)
    assert "that needs --convert-weights dequantize, not quantize" in err
    loaded = compile_with_weights(EXAMPLES / "deepseek_v3.moe", open_checkpoint(ckpt), 1, FAST, convert="dequantize")
    for name, value in fp8.expected(1).items():
        want = np.asarray(value, np.float32).astype(bfloat16) if loaded.weights[name].dtype == bfloat16 else value
        assert np.array_equal(loaded.weights[name], want), name
    assert "dequantized by --convert-weights: w_gate, w_up, w_down, ws_gate, ws_up, ws_down" in loaded.describe(
        open_checkpoint(ckpt), 1)
    # MXFP4 into the bf16 gpt-oss program: exact
    mx = gpt_oss(rng, quantized=True)
    ckpt = write(tmp_path / "mxfp4", mx)
    err = error(capsys, ckpt, "gpt_oss", 0, *SETS)
    assert "tensor 'model.layers.0.mlp.experts.gate_up_proj_blocks' is MXFP4" in err
    assert "--convert-weights dequantize); or run examples/gpt_oss_mxfp4.moe" in err
    loaded = compile_with_weights(EXAMPLES / "gpt_oss.moe", open_checkpoint(ckpt), 1, FAST, convert="dequantize")
    for name, value in mx.expected(1).items():
        assert np.array_equal(loaded.weights[name].astype(np.float64), value.astype(np.float64)), name
    # bf16 into the fp8 Qwen3 program (blocks of 32 here, the program's)
    qwen = qwen3_moe(rng)
    ckpt = write(tmp_path / "bf16", qwen)
    blocks = {"QK": 32, "QN": 32, "QG": 32}
    sets = [a for k, v in blocks.items() for a in ("--set", f"{k}={v}")]
    err = error(capsys, ckpt, "qwen3_moe_fp8", 0, *sets, *SETS)
    assert ("tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' is BF16, and argument 'w_gate' f8e4m3[4, 64, 32] "
            "of qwen3_moe_fp8.moe takes f8e4m3 with f32 scales in blocks of 1 x 32 x 32: quantizing is a conversion "
            "tcpc makes only when asked (--convert-weights quantize); or run examples/qwen3_moe.moe") in err
    loaded = compile_with_weights(EXAMPLES / "qwen3_moe_fp8.moe", open_checkpoint(ckpt), 1, {**FAST, **blocks},
                                  convert="quantize")
    for name in ("w_gate", "w_up", "w_down"):
        values, scales = quantize_blocks(qwen.expected(1)[name], np.dtype(float8_e4m3fn), (1, 32, 32))
        assert same_bits(loaded.weights[name], values) and same_bits(loaded.weights[f"{name}_scale"], scales), name
    assert loaded.conversions == {"w_gate": "quantize", "w_up": "quantize", "w_down": "quantize"}
    # bf16 gpt-oss into the MXFP4 program: e8m0 scales per 32 along the reduction axis (OCP MX)
    oss = gpt_oss(rng)
    loaded = compile_with_weights(EXAMPLES / "gpt_oss_mxfp4.moe", open_checkpoint(write(tmp_path / "oss", oss)), 1, FAST,
                                  convert="quantize")
    for name in ("w_gate", "w_up", "w_down"):
        values, scales = quantize_blocks(oss.expected(1)[name], np.dtype(float4_e2m1fn), (1, 32, 1),
                                         np.dtype(float8_e8m0fnu))
        assert same_bits(loaded.weights[name], values) and same_bits(loaded.weights[f"{name}_scale"], scales), name
    assert same_bits(loaded.weights["b_gate"], oss.expected(1)["b_gate"])  # the bf16 biases as they are
    code, out, err = tcpc(capsys, "run", EXAMPLES / "qwen3_moe_fp8.moe", "--weights", ckpt, "--layer", 1, *sets, *SETS,
                          "--convert-weights", "quantize", "--reference")
    assert code == 0, err
    assert "quantized by --convert-weights: w_gate, w_up, w_down" in out


def test_ragged_fp8_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """F = 96 in blocks of 128: weight_scale_inv has ceil(96 / 128) = 1 block along it, the
    last block ragged. A block-scaled type's blocks are whole, so the fp8 program cannot take
    it (the error says so); dequantized into the bf16 program, each value takes its block's
    scale (the ragged block cropped, as transformers and vLLM read it)."""
    tiny = deepseek_v3_fp8(np.random.default_rng(6), f=96)
    ckpt = write(tmp_path, tiny)
    err = error(capsys, ckpt, "deepseek_v3_fp8", 0, *SETS)
    assert "deepseek_v3_fp8.moe does not compile with the checkpoint's dims" in err
    assert "96 / 128 does not divide exactly" in err and "fp8 blocks of 128 x 128 do not divide its weights" in err
    assert "run a bf16 program with --convert-weights dequantize" in err
    loaded = compile_with_weights(EXAMPLES / "deepseek_v3.moe", open_checkpoint(ckpt), 1, FAST, convert="dequantize")
    for name in ("w_gate", "w_down", "ws_up"):
        assert np.array_equal(loaded.weights[name], tiny.expected(1)[name].astype(bfloat16)), name


def test_low_precision_checkpoint_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    p = "model.layers.0.mlp.experts"
    # scales of the wrong shape: they name the scale tensor, both shapes and the file
    tiny = deepseek_v3_fp8(rng)
    tiny.tensors[f"{p}.2.down_proj.weight_scale_inv"] = np.ones((2, 2), np.float32)
    ckpt = write(tmp_path / "scale_shape", tiny)
    assert (f"{ckpt / 'model.safetensors'}: tensor '{p}.2.down_proj.weight_scale_inv' is F32 [2, 2], expected F32 "
            f"[2, 1]: the scales of '{p}.2.down_proj.weight' F8_E4M3 [{D8}, {F8}] in blocks of 128 x 128 (argument "
            f"'w_down' f8e4m3[{E8}, {F8}, {D8}] of deepseek_v3_fp8.moe)") in error(capsys, ckpt, "deepseek_v3_fp8", 0, *SETS)
    # an fp8 weight without its scales
    tiny = deepseek_v3_fp8(rng)
    del tiny.tensors[f"{p}.1.up_proj.weight_scale_inv"]
    err = error(capsys, write(tmp_path / "no_scale", tiny), "deepseek_v3_fp8", 0, *SETS)
    assert (f"tensor '{p}.1.up_proj.weight' is F8_E4M3, but its block scales '{p}.1.up_proj.weight_scale_inv' are not "
            "in the checkpoint") in err
    # experts stored differently
    tiny = deepseek_v3_fp8(rng)
    tiny.tensors[f"{p}.3.gate_proj.weight"] = tiny.tensors[f"{p}.3.gate_proj.weight"].astype(bfloat16)
    err = error(capsys, write(tmp_path / "mixed", tiny), "deepseek_v3_fp8", 0, *SETS)
    assert (f"tensor '{p}.3.gate_proj.weight' is BF16, but tensor '{p}.0.gate_proj.weight' is F8_E4M3 with block "
            f"scales '{p}.0.gate_proj.weight_scale_inv': the experts of one argument must be stored alike") in err
    # a weight_block_size that is not [out, in]
    tiny = deepseek_v3_fp8(rng)
    tiny.config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128]}
    ckpt = write(tmp_path / "block", tiny)
    assert (f"{ckpt / 'config.json'}: quantization_config.weight_block_size = [128], expected [out, in] block sizes"
            in error(capsys, ckpt, "deepseek_v3_fp8", 0, *SETS))
    # MXFP4 scales of the wrong dtype
    mx = gpt_oss(rng, quantized=True)
    gu = "model.layers.0.mlp.experts.gate_up_proj_scales"
    mx.tensors[gu] = mx.tensors[gu].astype(np.int32)
    err = error(capsys, write(tmp_path / "mxfp4", mx), "gpt_oss_mxfp4", 0, *SETS)
    assert f"tensor '{gu}' is I32 [4, 64, 2], expected U8 [4, 64, 2]" in err
    # the flags go with --weights
    for flag, value in (("--convert-weights", "quantize"), ("--family", "f.toml")):
        code, _, err = tcpc(capsys, "run", EXAMPLES / "qwen3_moe.moe", flag, value)
        assert code == 2 and f"{flag} applies to --weights PATH --layer N" in err
    # blocks of 96 along D = 256 (ragged), declared by quantization_config: the scales checked by them
    tiny = deepseek_v3_fp8(rng)
    tiny.config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 96]}
    with pytest.raises(CheckpointError, match="256 / 96 does not divide exactly.*fp8 blocks of 128 x 96"):
        compile_with_weights(EXAMPLES / "deepseek_v3_fp8.moe", open_checkpoint(write(tmp_path / "b96", tiny)), 1, FAST)
