"""Low-precision values (f8e4m3, f8e5m2, f4e2m1, e8m0 scales): their one definition of
quantization against ml_dtypes, the lowering checked bit for bit against the graph level, the
fp8 expert projection within its derived tolerance of the bf16 one, the located errors, and the
costs at the fp8 rate and the stored width."""

from __future__ import annotations

import io
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import TensorType, f32
from xdsl.ir import Block
from xdsl.parser import Parser
from xdsl.printer import Printer

import tcpc
from dialects import tcp
from dialects.moe import RouteType
from passes.lowering.lower_quant import LowerQuantPass
from runtime_sim.perf import cost_model
from target.machine import load_machine
from runtime_sim.perf.tcp_cost import (
    cost_contract,
    cost_dma_gather,
    cost_scaled_contract,
)
from runtime_sim.semantics.executor import run_function
from runtime_sim.semantics.moe_semantics import dispatch, route_plan
from runtime_sim.semantics.numerics import (
    float4_e2m1,
    float8_e4m3,
    float8_e5m2,
    float8_e8m0,
    round_to,
    tensor_dtype,
)
from runtime_sim.semantics.quantization import QUANTIZE_EPS, dequantize, quantize, quantize_blocks
from tcpc.diagnostics import CompileError
from tcpc.pipelines import apply_pipeline, make_context
from support import bits

ROOT = Path(__file__).resolve().parent.parent
LOW_EXAMPLES = ["deepseek_v3_fp8", "qwen3_moe_fp8", "gpt_oss_mxfp4"]
BF16 = np.dtype(ml_dtypes.bfloat16)



# --- conversion and quantization against ml_dtypes --------------------------------------------


@pytest.mark.parametrize("dtype", [float8_e4m3, float8_e5m2, float4_e2m1])
def test_conversion_rounds_to_nearest_even_and_saturates(dtype: np.dtype) -> None:
    """Every representable value, the midpoints between neighbours (ties go to the even code)
    and points just beside them convert as ml_dtypes does; beyond the largest finite value,
    and +-inf, saturate to it; NaN stays NaN where the type has one."""
    codes = np.arange(256 if dtype.itemsize == 1 and dtype != float4_e2m1 else 16, dtype=np.uint8)
    values = np.unique(codes.view(dtype).astype(np.float32))
    values = values[np.isfinite(values)]
    mids = (values[1:] + values[:-1]) / 2
    probes = np.concatenate([values, mids, np.nextafter(mids, np.float32(np.inf)),
                             np.nextafter(mids, np.float32(-np.inf))]).astype(np.float32)
    got = round_to(probes, dtype)
    assert np.array_equal(bits(got), bits(probes.astype(dtype)))
    top = np.float32(ml_dtypes.finfo(dtype).max)
    beyond = np.array([top * 1.5, top * 1e6, np.inf, -top * 1.5, -np.inf], np.float32)
    assert np.array_equal(round_to(beyond, dtype).astype(np.float32), [top, top, top, -top, -top])
    if dtype != float4_e2m1:
        assert np.isnan(round_to(np.array([np.nan], np.float32), dtype).astype(np.float32)).all()


floats = st.floats(width=32, allow_nan=True, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(floats, min_size=8, max_size=8).map(lambda v: v * 4),
       st.sampled_from([float8_e4m3, float8_e5m2]), st.sampled_from([1, 4, 8, 32]))
def test_quantize_is_vllm_per_group_with_ml_dtypes(values: list[float], dtype: np.dtype, group: int) -> None:
    """One group at a time in plain Python: scale = max(amax, eps) / max_finite in f32, each
    value x / scale clamped to +-max_finite and cast by ml_dtypes."""
    x = np.array(values, np.float32).reshape(1, 32)
    q, s = quantize(x, dtype, group)
    top = np.float32(ml_dtypes.finfo(dtype).max)
    for g in range(32 // group):
        chunk = x[0, g * group:(g + 1) * group]
        amax = np.float32(np.nan) if np.isnan(chunk).any() else np.float32(np.abs(chunk).max())
        scale = np.float32(np.maximum(amax, QUANTIZE_EPS) / top)
        assert bits(np.array([s[0, g]])) == bits(np.array([scale])) or (np.isnan(scale) and np.isnan(s[0, g]))
        want = np.clip(chunk / scale, -top, top).astype(dtype)
        assert np.array_equal(bits(q[0, g * group:(g + 1) * group]), bits(want))


@pytest.mark.parametrize("dtype", [float8_e4m3, float4_e2m1])
def test_dequantize_is_value_times_block_scale(dtype: np.dtype) -> None:
    rng = np.random.default_rng(1)
    values = round_to(rng.standard_normal((2, 64, 6)).astype(np.float32) * 2, dtype)
    scales = round_to(np.exp2(rng.integers(-10, 4, size=(2, 2, 3))).astype(np.float32), float8_e8m0)
    got = dequantize(values, scales)
    for e, k, n in np.ndindex(2, 64, 6):
        want = np.float32(values[e, k, n]) * np.float32(scales[e, k // 32, n // 2])
        assert got[e, k, n] == want



def test_dequantize_with_ragged_blocks() -> None:
    """A checkpoint's ceil-divided blocks: the last block along an axis overhangs the values."""
    values = np.arange(15, dtype=np.float32).reshape(3, 5).astype(float8_e4m3)
    scales = np.array([[1, 2], [3, 4]], np.float32)
    got = dequantize(values, scales, (2, 3))
    for i, j in np.ndindex(3, 5):
        assert got[i, j] == np.float32(values[i, j]) * scales[i // 2, j // 3]


@pytest.mark.parametrize("dtype", [float8_e4m3, float4_e2m1])
def test_quantize_blocks_e8m0_is_the_ocp_mx_rule(dtype: np.dtype) -> None:
    """OCP Microscaling v1.0, 6.3: scale = 2^(floor(log2(amax)) - emax), emax the exponent of
    the type's largest value (f4e2m1: 6 = 1.5 * 2^2; f8e4m3: 448 = 1.75 * 2^8), each value
    x / scale saturated; a block of zeros takes e8m0's smallest scale, 2^-127."""
    emax = {float8_e4m3: 8, float4_e2m1: 2}[dtype]
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 64, 4)) * np.exp2(rng.integers(-6, 6, size=(3, 1, 4)))).astype(np.float32)
    x[1, :32, 2] = 0
    q, s = quantize_blocks(x, dtype, (1, 32, 1), float8_e8m0)
    assert q.dtype == dtype and s.dtype == float8_e8m0 and s.shape == (3, 2, 4)
    top = np.float32(ml_dtypes.finfo(dtype).max)
    for e, k, n in np.ndindex(3, 2, 4):
        block = x[e, 32 * k:32 * (k + 1), n]
        amax = np.abs(block).max()
        scale = 2.0 ** (math.floor(math.log2(amax)) - emax) if amax else 2.0 ** -127
        assert float(s[e, k, n]) == scale
        want = np.clip(block / np.float32(scale), -top, top).astype(dtype)
        assert np.array_equal(bits(q[e, 32 * k:32 * (k + 1), n]), bits(want))


def test_quantize_blocks_f32_is_per_block_amax() -> None:
    """A weight's 2-D blocks (DeepSeek-V3's 128 x 128, here 4 x 2): scale = max(amax, eps) /
    max_finite over the whole block; groups along the last axis are `quantize`'s."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    q, s = quantize_blocks(x, float8_e4m3, (4, 2))
    assert s.shape == (2, 3) and s.dtype == np.float32
    for i, j in np.ndindex(2, 3):
        block = x[4 * i:4 * (i + 1), 2 * j:2 * (j + 1)]
        scale = np.float32(np.abs(block).max() / np.float32(448))
        assert s[i, j] == scale
        assert np.array_equal(bits(q[4 * i:4 * (i + 1), 2 * j:2 * (j + 1)]), bits((block / scale).astype(float8_e4m3)))
    qg, sg = quantize(x, float8_e4m3, 3)
    qb, sb = quantize_blocks(x, float8_e4m3, (1, 3))
    assert np.array_equal(bits(qg), bits(qb)) and np.array_equal(sg, sb)

# --- the lowering is exact ---------------------------------------------------------------------

SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 6e4, 1e30, -448.0, 449.0]


def special_arrays(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, size=shape))).astype(np.float32)
    flat = x.reshape(-1)
    picks = rng.integers(0, flat.size, size=flat.size // 4)
    flat[picks] = rng.choice(np.array(SPECIALS, np.float32), size=picks.size)
    x[0, ...] = 0.0  # an all-zero row: every group's scale is eps / max
    return round_to(x, dtype)


def before_after(source: str, args: list[np.ndarray]) -> tuple[tuple, tuple]:
    module = tcpc.compile_source(source).module
    lowered = apply_pipeline(module, [LowerQuantPass()])
    assert not [op for op in lowered.walk() if op.name.startswith("lowp.")]
    name = module.ops.first.sym_name.data
    return run_function(module, name, args), run_function(lowered, name, args)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype_name,target", [("bf16", "f8e4m3"), ("f32", "f8e5m2"), ("f32", "f8e4m3")])
def test_lower_quant_quantize_and_dequantize_bit_identical(seed: int, dtype_name: str, target: str) -> None:
    source = f"""
dims T = 6, D = 64
graph g(x: {dtype_name}[T, D]) -> ({target}[T, D], f32[T, D / 16], f32[T, D]) {{
    q, s = quantize(x, {target}, group=16)
    return q, s, dequantize(q, s)
}}"""
    dtype = BF16 if dtype_name == "bf16" else np.dtype(np.float32)
    want, got = before_after(source, [special_arrays((6, 64), dtype, seed)])
    for w, g in zip(want, got):
        assert w.dtype == g.dtype
        assert np.array_equal(bits(w), bits(g))


@pytest.mark.parametrize("seed", range(3))
def test_lower_quant_scaled_matmul_bit_identical(seed: int) -> None:
    source = """
dims M = 5, K = 256, N = 96
graph g(x: bf16[M, K], w: f4e2m1[K, N], ws: e8m0[K / 32, N]) -> bf16[M, N] {
    xq, xs = quantize(x, f8e4m3, group=32)
    return scaled_matmul(xq, w, scales=(xs, ws))
}"""
    rng = np.random.default_rng(seed)
    x = round_to(rng.standard_normal((5, 256)).astype(np.float32), BF16)
    w = round_to((rng.standard_normal((256, 96)) * 2).astype(np.float32), float4_e2m1)
    ws = round_to(np.exp2(rng.integers(-6, 0, size=(8, 96))).astype(np.float32), float8_e8m0)
    (want,), (got,) = before_after(source, [x, w, ws])
    assert np.array_equal(bits(want), bits(got))
    # and it is the product of the dequantized operands up to f32 accumulation order
    ref = dequantize(*quantize(x, float8_e4m3, 32)) @ dequantize(w, ws)
    np.testing.assert_allclose(want.astype(np.float32), ref, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("example", LOW_EXAMPLES)
@pytest.mark.parametrize("seed", [0, 5])
def test_examples_lowered_bit_identical_to_the_reference(example: str, seed: int) -> None:
    program = tcpc.compile_file(ROOT / "examples" / f"{example}.moe")
    reference = program.run(seed=seed)
    simulated = program.simulate(seed=seed)
    assert simulated.report.total_cycles > 0
    for want, got in zip(reference.outputs, simulated.outputs):
        assert np.isfinite(want.astype(np.float32)).all()
        assert np.array_equal(bits(want), bits(got))


# --- the fp8 projection against the same projection on dequantized bf16 weights ----------------

FP8_VS_BF16 = """
dims T = 16, D = 256, F = 128, E = 8, K = 2, B = 4
graph fp8(x: bf16[T, D], top_e: i32[T, K], w: f8e4m3[E, D, F], ws: f32[E, D / 128, F / 128]) -> bf16[G, B, F] {
    xb, route = scatter(x, top_e, experts=E, block=B)
    xq, xs = quantize(xb, f8e4m3, group=128)
    return grouped_matmul(xq, w, route, scales=(xs, ws))
}
graph bf16_ref(x: bf16[T, D], top_e: i32[T, K], w: bf16[E, D, F]) -> bf16[G, B, F] {
    xb, route = scatter(x, top_e, experts=E, block=B)
    return grouped_matmul(xb, w, route)
}
"""


@pytest.mark.parametrize("seed", range(3))
def test_fp8_projection_within_the_derived_tolerance_of_bf16(seed: int) -> None:
    """y8 = the fp8 projection (activations quantized per token group of 128, fp8 weights with
    128 x 128 f32 block scales); y16 = the same projection on bf16 activations and the weights
    dequantized to bf16. Per output element, with w the dequantized weights in f32,
    S = sum_k |x_k w_k| and A = sum_k amax_g(k) |w_k| / 448:

      |y8 - y16| <= (2^-4 + 2^-8) S + 2^-10 A + ulp(y8) + ulp(y16)

    2^-4: f8e4m3 keeps 3 mantissa bits, so rounding x / s to a normal f8e4m3 value errs by at
    most 2^-4 relative; below 2^-6 (subnormal) the spacing is 2^-9, an absolute error of at
    most 2^-10 in units of the scale s = amax / 448 (the A term). 2^-8: bf16 weights round the
    dequantized value by at most 2^-9 relative, plus f32 accumulation (at most D * 2^-24 <
    2^-9 relative to S for D <= 2^15). The last terms: each result is rounded once to bf16
    (half an ulp each; an ulp is a safe margin). Routing is the same for both (given)."""
    source = FP8_VS_BF16.replace("G, B, F", "14, 4, F")
    program = tcpc.compile_source(source)
    rng = np.random.default_rng(seed)
    x = round_to(rng.standard_normal((16, 256)).astype(np.float32), BF16)
    top_e = np.stack([rng.choice(8, size=2, replace=False) for _ in range(16)]).astype(np.int32)
    w = round_to((rng.standard_normal((8, 256, 128)) * 100).astype(np.float32), float8_e4m3)
    ws = np.exp2(rng.uniform(-12, -8, size=(8, 2, 1))).astype(np.float32)
    y8 = program.run({"x": x, "top_e": top_e, "w": w, "ws": ws}, graph="fp8").outputs[0].astype(np.float32)
    w_real = dequantize(w, ws)
    y16 = program.run({"x": x, "top_e": top_e, "w": round_to(w_real, BF16)}, graph="bf16_ref").outputs[0].astype(np.float32)
    # The bound, from the blocked inputs the graphs see.
    plan = route_plan(top_e, RouteType.make(16, 2, 8, 4))
    blocks = dispatch(x, plan).astype(np.float32)  # [G, B, D]
    experts = np.maximum(plan.expert_ids, 0)
    wg = np.abs(w_real[experts])  # [G, D, F]
    s = np.einsum("gbd,gdf->gbf", np.abs(blocks), wg)
    amax = np.abs(blocks).reshape(*blocks.shape[:2], 2, 128).max(axis=-1)  # [G, B, 2]
    a = np.einsum("gbk,gkf->gbf", amax / 448, wg.reshape(wg.shape[0], 2, 128, -1).sum(axis=2))
    ulp = lambda v: np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126))) - 7)
    bound = (2**-4 + 2**-8) * s + 2**-10 * a + ulp(y8) + ulp(y16)
    unused = plan.expert_ids < 0
    assert (y8[unused] == 0).all() and (y16[unused] == 0).all()
    err = np.abs(y8 - y16)
    assert (err <= bound).all(), float((err / bound).max())
    # Not vacuous: the error is real (fp8 is not bf16) and a scale error would break the bound.
    assert err.max() > 0
    assert not (np.abs(2 * y8 - y16) <= bound).all()


# --- errors ------------------------------------------------------------------------------------

HEAD = """dims T = 4, D = 64, F = 32, E = 4, K = 2, B = 2
graph g(x: bf16[T, D], e: i32[T, K], w: f8e4m3[E, D, F], ws: f32[E, D / 32, F / 32], wb: bf16[E, D, F],
        w4: f4e2m1[E, D, F], s4: e8m0[E, D / 32, F]) -> bf16[G, B, F] {
    xb, route = scatter(x, e, experts=E, block=B)
"""
ERRORS = {
    "fp8 x bf16": ("return grouped_matmul(xb, w, route)", 5, 12, "cannot multiply bf16[6, 2, 64] by f8e4m3[4, 64, 32]"),
    "bf16 x fp8 with scales": ("xq, xs = quantize(xb, f8e4m3, group=32)\n    return grouped_matmul(xq, wb, route, scales=(xs, ws))", 6, 12,
                               "cannot multiply f8e4m3[6, 2, 64] by bf16[4, 64, 32]"),
    "e5m2 x e4m3": ("xq, xs = quantize(xb, f8e5m2, group=32)\n    return grouped_matmul(xq, w, route, scales=(xs, ws))", 6, 12,
                    "cannot multiply f8e5m2[6, 2, 64] by f8e4m3[4, 64, 32]"),
    "missing scales": ("xq, xs = quantize(xb, f8e4m3, group=32)\n    return grouped_matmul(xq, w, route)", 6, 12, "needs their block scales"),
    "one scale tensor": ("xq, xs = quantize(xb, f8e4m3, group=32)\n    return grouped_matmul(xq, w, route, scales=xs)", 6, 48,
                         "scales= takes two tensors"),
    "scales not nesting": ("xq, xs = quantize(xb, f8e4m3, group=64)\n    return grouped_matmul(xq, w4, route, scales=(xs, reshape(s4, [E, 1, D * F / 32])))", 6, 49,
                           "weight scales must be [E, D / kw, F / nb]"),
    "input scales shape": ("xq, xs = quantize(xb, f8e4m3, group=32)\n    return grouped_matmul(xq, w, route, scales=(ws, ws))", 6, 48,
                           "input scales must be [G, B, D / group] dividing f8e4m3[6, 2, 64] into whole blocks, got f32[4, 2, 1]"),
    "group does not divide": ("xq, xs = quantize(xb, f8e4m3, group=48)\n    return xb", 5, 41, "group 48 does not divide the last axis of bf16[6, 2, 64]"),
    "quantize to fp4": ("xq, xs = quantize(xb, f4e2m1, group=32)\n    return xb", 5, 27, "quantize() gives f8e4m3 or f8e5m2"),
    "arithmetic on fp8": ("y = w * 2.0\n    return xb", 5, 11, "f8e4m3[4, 64, 32] is stored-only and takes no arithmetic"),
    "cast to fp8": ("y = f8e4m3(x)\n    return xb", 5, 9, "would drop the block scales"),
    "sum of fp4": ("y = sum(w4)\n    return xb", 5, 9, "is stored-only"),
    "dequantize scale shape": ("y = dequantize(w, reshape(ws, [E, 2]))\n    return xb", 5, 23, "dequantize scales must be of the values' rank dividing"),
    "dequantize scale type": ("y = dequantize(w, e)\n    return xb", 5, 23, "block scales must be f32, bf16 or e8m0, got i32[4, 2]"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_located_errors(case: str) -> None:
    line, row, col, message = ERRORS[case]
    source = HEAD.replace("bf16[G, B, F]", "bf16[6, 2, F]") + f"    {line}\n}}\n"
    with pytest.raises(CompileError) as info:
        tcpc.compile_source(source)
    rendered = info.value.render("f.moe", source)
    assert message in rendered, rendered
    assert rendered.startswith(f"f.moe:{row}:{col}: error:"), rendered


# --- IR round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("example", LOW_EXAMPLES)
def test_low_precision_ir_round_trips(example: str) -> None:
    program = tcpc.compile_file(ROOT / "examples" / f"{example}.moe")
    for module in (program.module, program.lower()):
        for generic in (False, True):
            out = io.StringIO()
            Printer(stream=out, print_generic_format=generic).print_op(module)
            parsed = Parser(make_context(), out.getvalue()).parse_module()
            parsed.verify()
            assert parsed.is_structurally_equivalent(module)


def test_drawn_scales_are_positive_powers_or_reals() -> None:
    program = tcpc.compile_file(ROOT / "examples" / "gpt_oss_mxfp4.moe")
    inputs = program.run(seed=2).inputs
    assert inputs["w_gate_scale"].dtype == float8_e8m0
    assert (inputs["w_gate_scale"].astype(np.float32) > 0).all()
    deepseek = tcpc.compile_file(ROOT / "examples" / "deepseek_v3_fp8.moe").run(seed=2).inputs
    assert (deepseek["w_down_scale"] > 0).all() and (deepseek["ws_up_scale"] > 0).all()
    assert (deepseek["router"] < 0).any()  # other f32 tensors are still drawn as weights


# --- costs -------------------------------------------------------------------------------------


def test_scaled_contraction_runs_at_the_fp8_rate_and_fetches_stored_bytes() -> None:
    machine = load_machine()
    source = """
dims G = 64, B = 64, D = 2048, F = 768
graph g(x: f8e4m3[G, B, D], xs: f32[G, B, D / 128], w: f8e4m3[G, D, F], ws: f32[G, D / 128, F / 128],
        w4: f4e2m1[G, D, F], s4: e8m0[G, D / 32, F], xb: bf16[G, B, D], wb: bf16[G, D, F]) -> bf16[G, B, D] {
    return xb
}"""
    fn = tcpc.compile_source(source).module.ops.first
    args = fn.body.blocks.first.args
    block = Block()
    fp8 = tcp.ScaledContractOp(args[0], args[2], args[1], args[3])
    fp4 = tcp.ScaledContractOp(args[0], args[4], args[1], args[5])
    bf16 = tcp.ContractOp("gbd,gdf->gbf", args[6], args[7], TensorType(f32, [64, 64, 768]))
    for op in (fp8, fp4, bf16):
        block.add_op(op)
    z = lambda v: np.zeros(tuple(v.type.get_shape()), dtype=tensor_dtype(v.type))
    out = np.zeros((64, 64, 768), np.float32)
    c8 = cost_scaled_contract(fp8, tuple(z(v) for v in fp8.operands), (out,), machine)
    c4 = cost_scaled_contract(fp4, tuple(z(v) for v in fp4.operands), (out,), machine)
    c16 = cost_contract(bf16, tuple(z(v) for v in bf16.operands), (out,), machine)
    macs = 64 * 64 * 768 * 2048
    assert c8.bound == "outer" and c16.bound == "outer"
    assert c8.cycles - machine.config_overhead_cycles - machine.tree_depth_fp8_cycles - machine.alu_latency_cycles \
        == math.ceil(macs / (512 * machine.slices))
    assert c16.cycles - machine.config_overhead_cycles - machine.tree_depth_cycles == math.ceil(macs / (256 * machine.slices))
    assert c8.fp8_flops == 2 * macs and c16.fp8_flops == 0
    # fetch: the f4e2m1 weight is half a byte a value, the e8m0 scales one byte per 32
    fetch8 = 64 * 64 * 2048 + 64 * 64 * 16 * 4 + 64 * 2048 * 768 + 64 * 16 * 6 * 4
    fetch4 = 64 * 64 * 2048 + 64 * 64 * 16 * 4 + 64 * 2048 * 768 // 2 + 64 * 64 * 768
    assert c8.bytes_moved == fetch8 + out.nbytes and c4.bytes_moved == fetch4 + out.nbytes
    # the vector stage: one partial sum per K-block of 128 (fp8) or 32 (MXFP4) per result
    assert c4.cycles >= math.ceil(64 * 64 * 768 * (2048 // 32) / (machine.float_ways * machine.slices))


def test_fp4_weights_move_half_the_hbm_bytes_of_fp8() -> None:
    machine = load_machine()
    source = """
dims E = 8, D = 512, F = 256
graph g(w8: f8e4m3[E, D, F], w4: f4e2m1[E, D, F], ids: i32[4]) -> i32[4] { return ids }"""
    fn = tcpc.compile_source(source).module.ops.first
    w8, w4, ids = fn.body.blocks.first.args
    g8, g4 = tcp.DmaGatherOp(w8, ids), tcp.DmaGatherOp(w4, ids)
    idx = np.array([0, 3, 5, -1], np.int32)
    c8 = cost_dma_gather(g8, (np.zeros((8, 512, 256), float8_e4m3), idx), (), machine)
    c4 = cost_dma_gather(g4, (np.zeros((8, 512, 256), float4_e2m1), idx), (), machine)
    assert cost_model.in_hbm(w8)
    assert c8.hbm_bytes == 3 * 512 * 256 and c4.hbm_bytes == 3 * 512 * 256 // 2


def test_npz_inputs_take_raw_or_real_low_precision_arrays(tmp_path: Path) -> None:
    """--inputs: fp8 and e8m0 arguments from raw ml_dtypes arrays (npz writes them as |V1) or
    from real values, which are saturated and rounded; both give the run from those values."""
    from tcpc.cli import main

    program = tcpc.compile_file(ROOT / "examples" / "gpt_oss_mxfp4.moe")
    inputs = program.run(seed=4).inputs
    raw = tmp_path / "raw.npz"
    np.savez(raw, **inputs)
    real = tmp_path / "real.npz"
    np.savez(real, **{k: v.astype(np.float32) for k, v in inputs.items()})
    outs = []
    for path in (raw, real):
        out = tmp_path / f"out_{path.stem}.npz"
        assert main(["run", str(ROOT / "examples" / "gpt_oss_mxfp4.moe"), "--reference", "--inputs", str(path),
                     "--out", str(out)]) == 0
        outs.append(np.load(out)["out0"])
    want = program.run(inputs).outputs[0].astype(np.float32)
    assert np.array_equal(outs[0], want) and np.array_equal(outs[1], want)



LAYER = """
dims T = 16, D = 256, F = 128, E = 8, K = 2, B = 4
graph fp8(x: bf16[T, D], router: bf16[D, E], w_gate: f8e4m3[E, D, F], w_gate_scale: f32[E, D / 128, F / 128],
          w_up: f8e4m3[E, D, F], w_up_scale: f32[E, D / 128, F / 128],
          w_down: f8e4m3[E, F, D], w_down_scale: f32[E, F / 128, D / 128])
        -> (bf16[T, D], bf16[14, 4, F], bf16[14, 4, F], bf16[14, 4, F], bf16[14, 4, D], i32[T, K], bf16[T, K]) {
    top_p, top_e = topk(softmax(f32(x @ router)), K)
    weights = bf16(top_p / sum(top_p, axis=-1, keepdims=true))
    xb, route = scatter(x, top_e, experts=E, block=B)
    xq, xs = quantize(xb, f8e4m3, group=128)
    g = grouped_matmul(xq, w_gate, route, scales=(xs, w_gate_scale))
    u = grouped_matmul(xq, w_up, route, scales=(xs, w_up_scale))
    h = silu(g) * u
    hq, hs = quantize(h, f8e4m3, group=128)
    y = grouped_matmul(hq, w_down, route, scales=(hs, w_down_scale))
    return combine(y, route, weights), g, u, h, y, top_e, weights
}
graph ref(x: bf16[T, D], router: bf16[D, E], w_gate: bf16[E, D, F], w_up: bf16[E, D, F], w_down: bf16[E, F, D])
        -> (bf16[T, D], bf16[14, 4, F], bf16[14, 4, F], bf16[14, 4, F], bf16[14, 4, D], i32[T, K], bf16[T, K]) {
    top_p, top_e = topk(softmax(f32(x @ router)), K)
    weights = bf16(top_p / sum(top_p, axis=-1, keepdims=true))
    xb, route = scatter(x, top_e, experts=E, block=B)
    g = grouped_matmul(xb, w_gate, route)
    u = grouped_matmul(xb, w_up, route)
    h = silu(g) * u
    y = grouped_matmul(h, w_down, route)
    return combine(y, route, weights), g, u, h, y, top_e, weights
}
"""


def ulp_bf16(v: np.ndarray) -> np.ndarray:
    """One bf16 ulp at |v| (at least the smallest normal's)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126))) - 7)


def projection_bound(x: np.ndarray, w: np.ndarray, group: int = 128) -> np.ndarray:
    """(2^-4 + 2^-8) S + 2^-10 A of test_fp8_projection_within_the_derived_tolerance_of_bf16, for
    blocked rows x [G, B, D] and each block's real weight w [G, D, F]."""
    ax, aw = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    s = np.einsum("gbd,gdf->gbf", ax, aw)
    amax = ax.reshape(*ax.shape[:2], -1, group).max(axis=-1)
    a = np.einsum("gbk,gkf->gbf", amax / 448, aw.reshape(aw.shape[0], -1, group, aw.shape[2]).sum(axis=2))
    return (2**-4 + 2**-8) * s + 2**-10 * a


@pytest.mark.parametrize("seed", range(2))
def test_fp8_layer_within_the_propagated_tolerance_of_bf16(seed: int) -> None:
    """The whole Qwen3-style layer in fp8 (w8a8, 128 x 128 blocks) against the same layer in bf16
    on the dequantized weights (the same router, so the same routing and weights). The bound is
    propagated per element through the layer from the projection bound P(x, w) above:

      gate, up:  Eg = P(x, Wg) + 2 ulp,  Eu = P(x, Wu) + 2 ulp
      silu:      Es = 1.1 Eg + 2 ulp              (|silu'| <= 1.0998; each side rounds to bf16)
      h = s * u: Eh = |s16| Eu + |u8| Es + 2 ulp
      down:      Ey = P(h8, Wd) + sum_f Eh_f |Wd16_f| + 3 ulp
      combine:   Eout = sum_k |p_k| Ey_k + 2 ulp  (the same bf16 routing weights p)

    (ulp: one bf16 ulp at the larger of the two sides' values.) It is a worst case: the
    measured difference stays below 2% of it here; the projection bound is the tight one."""
    rng = np.random.default_rng(seed)
    program = tcpc.compile_source(LAYER)
    x = round_to(rng.standard_normal((16, 256)).astype(np.float32), BF16)
    router = round_to((rng.standard_normal((256, 8)) / 16).astype(np.float32), BF16)
    q = {}
    for name, shape in (("w_gate", (8, 256, 128)), ("w_up", (8, 256, 128)), ("w_down", (8, 128, 256))):
        q[name] = round_to((rng.standard_normal(shape) * 100).astype(np.float32), float8_e4m3)
        q[f"{name}_scale"] = np.exp2(rng.uniform(-12, -9, size=(8, shape[1] // 128, shape[2] // 128))).astype(np.float32)
    real = {n: dequantize(q[n], q[f"{n}_scale"]) for n in ("w_gate", "w_up", "w_down")}
    out8, g8, u8, h8, y8, top_e, weights = program.run({"x": x, "router": router, **q}, graph="fp8").outputs
    out16, g16, u16, h16, y16, top_e16, weights16 = program.run(
        {"x": x, "router": router, **{n: round_to(w, BF16) for n, w in real.items()}}, graph="ref").outputs
    assert np.array_equal(top_e, top_e16) and np.array_equal(bits(weights), bits(weights16))
    out8, g8, u8, h8, y8, out16, g16, u16, h16, y16 = (
        np.asarray(v, np.float64) for v in (out8, g8, u8, h8, y8, out16, g16, u16, h16, y16))

    def ulp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return ulp_bf16(np.maximum(np.abs(a), np.abs(b)))

    def silu(v: np.ndarray) -> np.ndarray:
        return v / (1 + np.exp(-v))

    plan = route_plan(top_e, RouteType.make(16, 2, 8, 4))
    experts = np.maximum(plan.expert_ids, 0)
    xb = dispatch(x, plan).astype(np.float64)
    wg, wu, wd = (real[n][experts] for n in ("w_gate", "w_up", "w_down"))
    wd16 = np.abs(np.asarray(round_to(real["w_down"], BF16), np.float64)[experts])
    eg = projection_bound(xb, wg) + 2 * ulp(g8, g16)
    eu = projection_bound(xb, wu) + 2 * ulp(u8, u16)
    es = 1.1 * eg + 2 * ulp(silu(g8), silu(g16))
    eh = np.abs(silu(g16)) * eu + np.abs(u8) * es + 2 * ulp(h8, h16)
    ey = projection_bound(h8, wd) + np.einsum("gbf,gfd->gbd", eh, wd16) + 3 * ulp(y8, y16)
    assert (np.abs(y8 - y16) <= ey).all(), float((np.abs(y8 - y16) / ey).max())
    rows = ey.reshape(-1, ey.shape[-1])
    p = np.abs(np.asarray(weights, np.float64))
    eout = sum(p[:, k, None] * rows[plan.scatter_idx[:, k]] for k in range(2)) + 2 * ulp(out8, out16)
    err = np.abs(out8 - out16)
    assert (err <= eout).all(), float((err / eout).max())
    assert err.max() > 0
