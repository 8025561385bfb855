"""The two weight formats of the seed document on quantized MoE kernels (examples/
qwen3_moe_fp4_groups.moe, examples/qwen3_moe_trellis3.moe), against numpy written from the
seed's formulas alone:

- FP4 with a float scale per group along K: value(e2m1 bits) * scales[e, k // g, n], scales
  [E, ceil(K / g), N] (a ragged last group), bf16 or f32;
- 3-bit trellis: codes packed in 16 x 16 tiles of 96 bytes, code (k, n) of a tile at bit
  3 * (16 * n + k) (least significant bit of byte 0 first), dequantized as
  grid[code] * scale * su[k] * sv[n].

Both the graph level and the lowered program (lower-quant's vector-engine ops) give numpy's
bits; the layer examples are checked against independent models in tests/test_reference.py.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tcpc
from dialects.tensor_types import U3, code_tile_bytes, stored_bytes
from runtime_sim.perf.tcp_cost import row_bytes
from runtime_sim.semantics.numerics import code3
from runtime_sim.semantics.quantization import dequantize, pack_code_tiles
from tcpc.arrays import InputError, to_declared
from tcpc.cli import main
from tcpc.diagnostics import CompileError
from xdsl.dialects.builtin import TensorType

ROOT = Path(__file__).resolve().parent.parent
F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
LOWERED = "lower-quant"
"""The pass that lowers a whole-tensor dequantize (the graph's only op here)."""


# --- numpy from the seed's formulas -------------------------------------------------------


def seed_e2m1(bits: np.ndarray) -> np.ndarray:
    """e2m1 from its four bits: (-1)^s * (man * 0.5 if exp == 0 else 2^(exp - 1) * (1 + man / 2)).
    The seed writes the subnormal as man * 0.25; OCP MX and ml_dtypes (tcpc's f4e2m1) have 0.5,
    which continues the normal range (exponent 1 gives 1.0 and 1.5)."""
    sign, exp, man = bits >> 3 & 1, bits >> 1 & 3, bits & 1
    magnitude = np.where(exp == 0, man * 0.5, 2.0 ** (exp - 1) * (1 + man * 0.5))
    return np.where(sign == 1, -magnitude, magnitude).astype(F32)


def seed_scale(scales: np.ndarray, k: int, group: int) -> np.ndarray:
    """scale for weight (e, k, n) = scales[e, k // group_size, n]."""
    return scales.astype(F32)[:, [i // group for i in range(k)], :]


def seed_tiles(codes: np.ndarray) -> np.ndarray:
    """packed_weights [E, ceil(K / 16), ceil(N / 16), 96], written bit by bit as the seed reads
    them: idx_in_tile = n_in_tile * 16 + k_in_tile, bit_offset = idx_in_tile * 3."""
    e, k, n = codes.shape
    out = np.zeros((e, -(-k // 16), -(-n // 16), 96), np.uint8)
    for (x, i, j), code in np.ndenumerate(codes):
        offset = ((j % 16) * 16 + i % 16) * 3
        for bit in range(3):
            if int(code) >> bit & 1:
                out[x, i // 16, j // 16, (offset + bit) // 8] |= 1 << (offset + bit) % 8
    return out


# --- the decode, bit for bit -----------------------------------------------------------------


def run_both(source: str, inputs: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    program = tcpc.compile_source(source)
    return program.run(inputs).outputs, program.run(inputs, reference=False, pipeline=LOWERED).outputs


@pytest.mark.parametrize("scale_type", ["bf16", "f32"])
@pytest.mark.parametrize(("k", "group"), [(80, 32), (64, 32), (7, 3), (5, 8)])
def test_fp4_groups_decode_is_the_seed_formula(scale_type: str, k: int, group: int) -> None:
    rng = np.random.default_rng(k * group)
    e, n = 2, 5
    bits = rng.integers(0, 16, (e, k, n)).astype(np.uint8)
    groups = -(-k // group)
    scales = (rng.standard_normal((e, groups, n)) * 0.1).astype(BF16 if scale_type == "bf16" else F32)
    source = (f"dims E = {e}, K = {k}, N = {n}, G = {group}\n"
              f"graph g(w: f4e2m1[E, K, N], s: {scale_type}[E, ceil(K / G), N]) -> f32[E, K, N] {{\n"
              "    return dequantize(w, s, block=[1, G, 1])\n}\n")
    want = seed_e2m1(bits) * seed_scale(scales, k, group)
    for out in run_both(source, {"w": bits.view(np.dtype("V1")), "s": scales.astype(F32)}):
        np.testing.assert_array_equal(out[0].view(np.uint32), want.view(np.uint32))


def test_trellis_decode_is_the_seed_formula() -> None:
    """Codes given as the seed's packed tiles (ragged K and N), a bf16 grid, f32 scales per
    group of 32 (ragged), bf16 sign vectors."""
    rng = np.random.default_rng(3)
    e, k, n, group = 2, 40, 19, 32
    codes = rng.integers(0, 8, (e, k, n))
    grid = rng.standard_normal(8).astype(BF16)
    scales = (rng.standard_normal((e, 2, n)) * 0.1).astype(F32)
    su, sv = (rng.choice([-1.0, 1.0], shape).astype(BF16) for shape in ((e, k), (e, n)))
    source = (f"dims E = {e}, K = {k}, N = {n}, G = {group}\n"
              "graph g(c: u3[E, K, N], grid: bf16[8], s: f32[E, ceil(K / G), N], su: bf16[E, K], sv: bf16[E, N]) "
              "-> f32[E, K, N] {\n"
              "    return dequantize(c, s, block=[1, G, 1], grid=grid, signs=(su, sv))\n}\n")
    want = grid.astype(F32)[codes] * seed_scale(scales, k, group)
    want = want * su.astype(F32)[:, :, None] * sv.astype(F32)[:, None, :]
    inputs = {"c": seed_tiles(codes), "grid": grid.astype(F32), "s": scales, "su": su.astype(F32), "sv": sv.astype(F32)}
    for out in run_both(source, inputs):
        np.testing.assert_array_equal(out[0].view(np.uint32), want.view(np.uint32))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_code_tiles_round_trip_the_seed_layout(k: int, n: int, seed: int) -> None:
    codes = np.random.default_rng(seed).integers(0, 8, (1, k, n))
    packed = pack_code_tiles(codes)
    np.testing.assert_array_equal(packed, seed_tiles(codes))
    np.testing.assert_array_equal(to_declared("c", packed, TensorType(U3, [1, k, n])), codes)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_group_scales_any_group(k: int, group: int, seed: int) -> None:
    """tcpc's one dequantization (every level's) is the seed's formula for any K and group."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 16, (2, k, 3)).astype(np.uint8)
    scales = rng.standard_normal((2, -(-k // group), 3)).astype(BF16)
    got = dequantize(bits.view(ml_dtypes.float4_e2m1fn), scales, (1, group, 1))
    np.testing.assert_array_equal(got, seed_e2m1(bits) * seed_scale(scales, k, group))


# --- stored width --------------------------------------------------------------------------------


def test_codes_are_costed_in_their_tiles() -> None:
    """3 bits a code in whole 16 x 16 tiles (96 bytes), a ragged edge padded: what HBM and DMA
    move, for a type and for a value (a row of a gather)."""
    assert stored_bytes(TensorType(U3, [2, 40, 19])) == 2 * 3 * 2 * 96
    assert code_tile_bytes((2048, 768)) == 2048 * 768 * 3 // 8
    assert row_bytes(np.zeros((4, 40, 19), code3)) == 3 * 2 * 96


# --- the examples -----------------------------------------------------------------------------


@pytest.mark.parametrize("example", ["qwen3_moe_fp4_groups", "qwen3_moe_trellis3"])
def test_example_checks(example: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The lowered, scheduled layer gives the reference's bits (ragged groups and tiles)."""
    path = str(ROOT / "examples" / f"{example}.moe")
    assert main(["run", path, "--set", "T=4", "--set", "E=4", "--set", "K=2", "--set", "B=2", "--check"]) == 0
    assert "check: outputs equal the reference" in capsys.readouterr().out


@pytest.mark.parametrize("example", ["qwen3_moe_fp4_groups", "qwen3_moe_trellis3"])
@pytest.mark.parametrize("passes", ["lower-topk,lower-routing,lower-dispatch",
                                    "lower-topk,lower-routing,lower-dispatch,lower-quant,lower-math"])
def test_changed_passes_keep_the_bits(example: str, passes: str) -> None:
    """Translation validation of the two passes that changed: the IR after lower-dispatch (the
    decode moved into the blocks) and after lower-quant (the decode on the vector engine)
    gives the graph's bits."""
    program = tcpc.compile_file(ROOT / "examples" / f"{example}.moe", {"T": 4, "E": 4, "K": 2, "B": 2})
    want = program.run(seed=2).outputs[0]
    got = program.run(seed=2, reference=False, pipeline=passes).outputs[0]
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_decode_is_per_block_at_the_stored_width() -> None:
    """The codes move at 3 bits each and only the blocks' experts are decoded: the trellis
    layer's gathers of codes carry no whole-tensor decode before them."""
    program = tcpc.compile_file(ROOT / "examples" / "qwen3_moe_trellis3.moe", {"B": 4})
    ir = str(program.lower("lower-topk,lower-routing,lower-dispatch,lower-quant,lower-math"))
    assert "tensor<16x80x40xf32>" not in ir  # no [E, D, F] decode of every expert
    assert "ve.lookup %w_gathered" in ir and "tcp.dma_gather %w_gate[%expert_ids]" in ir


QWEN3_REAL = {"T": 1, "B": 1, "D": 2048, "F": 768, "E": 128, "K": 8, "GS": 128}
"""Qwen3-30B-A3B's shapes, one token (benchmarks/precisions.py's decode row)."""


@pytest.mark.parametrize("example, cycles", [("qwen3_moe_fp4_groups", 32_442), ("qwen3_moe_trellis3", 32_202)])
def test_decode_cycles_at_one_token(example: str, cycles: int) -> None:
    """Pinned: each weight decoded in one vector-engine invocation (fuse-ve-chains; before it,
    the codes widened to an f32 copy in SRAM first: 41,984 and 41,780 cycles; 32,553 and
    32,313 before one token's expert ids came straight from the counts, lower-routing; 32,415 and 32,175
    before the pinned routing was read after the router's top-k, `tcp.order`)."""
    program = tcpc.compile_file(ROOT / "examples" / f"{example}.moe", QWEN3_REAL)
    assert program.simulate(cost_only=True, routing="balanced").report.total_cycles == cycles


# --- errors ------------------------------------------------------------------------------------

HEAD = """dims E = 2, K = 80, N = 8, G = 32
graph g(w: f4e2m1[E, K, N], s: bf16[E, 3, N], c: u3[E, K, N], grid: f32[8], su: bf16[E, K], sv: bf16[E, N],
        i: i32[E, 3, N], g4: f32[4], x: bf16[E, K, N]) -> f32[E, K, N] {
"""

ERRORS = {  # case: the line, the text the caret points at, the message
    "zero group": ("return dequantize(w, s, block=[1, 0, 1])", "0, 1]", "a block size must be a positive integer, got 0"),
    "scales not ceil": ("return dequantize(w, s, block=[1, 16, 1])", "s, block",
                        "dequantize scales must be [2, 5, 8] (f4e2m1[2, 80, 8] in blocks of [1, 16, 1], ceil-divided), "
                        "got bf16[2, 3, 8]"),
    "no block, not dividing": ("return dequantize(w, s)", "s)",
                               "dequantize scales must be of the values' rank dividing f4e2m1[2, 80, 8] into whole blocks"),
    "scale type": ("return dequantize(w, i, block=[1, G, 1])", "i, block", "block scales must be f32, bf16 or e8m0, got i32[2, 3, 8]"),
    "block rank": ("return dequantize(w, s, block=[G, 1])", "[G, 1]", "block= takes a list of 3 sizes"),
    "codes without grid": ("return dequantize(c, s, block=[1, G, 1])", "dequantize",
                           "dequantize() of u3 codes needs their grid: grid=g, bf16 or f32 [8]"),
    "grid shape": ("return dequantize(c, s, block=[1, G, 1], grid=g4)", "g4",
                   "the grid of u3 codes must be bf16 or f32 [8] (one value per code), got f32[4]"),
    "grid on fp4": ("return dequantize(w, s, block=[1, G, 1], grid=grid)", "grid)", "grid= decodes u3 codes"),
    "signs shape": ("return dequantize(c, s, block=[1, G, 1], grid=grid, signs=(sv, su))", "(sv, su)",
                    "signs=(su, sv): su must be bf16 or f32 [2, 80] for values u3[2, 80, 8], got bf16[2, 8]"),
    "codes arithmetic": ("return f32(c) * 2.0", "f32(c)", "u3[2, 80, 8] is stored-only and takes no arithmetic"),
    "codes conversion": ("return f32(u3(x))", "u3(", "u3(...): codebook indices are stored data"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_declarations_are_located(case: str) -> None:
    line, at, message = ERRORS[case]
    source = HEAD + f"    {line}\n}}\n"
    with pytest.raises(CompileError) as info:
        tcpc.compile_source(source)
    rendered = info.value.render("f.moe", source)
    assert rendered.startswith(f"f.moe:4:{5 + line.index(at)}: error: {message}"), rendered


def test_bad_codes_are_input_errors() -> None:
    t = TensorType(U3, [1, 20, 3])
    with pytest.raises(InputError, match="codes outside \\[0, 8\\): 8 to 8"):
        to_declared("c", np.full((1, 20, 3), 8), t)
    with pytest.raises(InputError, match=r"or their 16 x 16 tiles: uint8 \[1, 2, 1, 96\]"):
        to_declared("c", np.zeros((1, 2, 1, 95), np.uint8), t)
    with pytest.raises(InputError, match="integer codes"):
        to_declared("c", np.zeros((1, 20, 3), np.float32), t)
