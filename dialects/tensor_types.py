"""Element types, shapes and the type rules every dialect shares.

The .moe frontend, the verifiers of `tmath`, `moe`, `tcp` and `ve`, the simulator and the CLI
all state a tensor's type, broadcast shapes and promote element types by these functions, so a
rule reads the same in an error message and in a verifier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from xdsl.dialects.builtin import (
    BFloat16Type,
    Float4E2M1FNType,
    Float8E4M3FNType,
    Float8E5M2Type,
    Float8E8M0FNUType,
    Float32Type,
    IntegerType,
    Signedness,
    TensorType,
    bf16,
    f32,
    i1,
    i32,
)
from xdsl.ir import Attribute
from xdsl.utils.exceptions import VerifyException

LOW_PRECISION_TYPES: dict[str, Attribute] = {
    "f8e4m3": Float8E4M3FNType(),
    "f8e5m2": Float8E5M2Type(),
    "f4e2m1": Float4E2M1FNType(),
}
"""Stored-only float types of quantized values (OCP 8-bit and MX formats). f8e4m3 is the `FN`
variant (no infinities, one NaN pattern, max 448): what DeepSeek-V3, Qwen3-FP8 and vLLM use
(torch.float8_e4m3fn). They take no arithmetic: they are quantized from, dequantized to, or
multiplied by the contraction engine in matched pairs (`contraction_pair`)."""

E8M0 = Float8E8M0FNUType()
"""A block scale stored as a bare exponent (2^(e - 127), MXFP4's scale): exact in f32."""

U3 = IntegerType(3, Signedness.UNSIGNED)
"""A 3-bit codebook index (`u3`, MLIR's ui3): the trellis format's weights, each the index of
its value in an 8-entry grid that `dequantize(..., grid=...)` supplies. Stored-only, like the
low-precision types, in 16 x 16 tiles of 96 bytes (`CODE_TILE`)."""

CODE_TILE = 16
"""u3 codes are stored in CODE_TILE x CODE_TILE tiles of the last two axes, 3 bits each
(96 bytes a tile), a ragged edge padded to whole tiles: the trellis layout of the seed's MoE
kernels (`packed_weights: [experts, ceil(K / 16), ceil(N / 16), 96]`)."""

SCALE_TYPES: tuple[Attribute, ...] = (f32, bf16, E8M0)
"""Element types a block scale may have."""

ELEMENT_TYPES: dict[str, Attribute] = {"bf16": bf16, "f32": f32, "i32": i32, "i1": i1,
                                       **LOW_PRECISION_TYPES, "e8m0": E8M0, "u3": U3}


def type_name(element_type: Attribute) -> str:
    """The element type as the .moe language says it; comparison results are `bool`."""
    if is_bool_type(element_type):
        return "bool"
    for name, t in ELEMENT_TYPES.items():
        if t == element_type:
            return name
    return str(element_type)


def is_float_type(element_type: Attribute) -> bool:
    """bf16 or f32: the float types that take arithmetic."""
    return isinstance(element_type, BFloat16Type | Float32Type)


def is_low_precision_type(element_type: Attribute) -> bool:
    return element_type in LOW_PRECISION_TYPES.values()


def is_scale_type(element_type: Attribute) -> bool:
    return element_type in SCALE_TYPES


def is_code_type(element_type: Attribute) -> bool:
    return element_type == U3


def is_stored_only(element_type: Attribute) -> bool:
    """Types that take no arithmetic: low-precision values, e8m0 scales and u3 codes are
    dequantized (or contracted in matched pairs), never computed with directly."""
    return is_low_precision_type(element_type) or element_type == E8M0 or is_code_type(element_type)


def stored_bits(element_type: Attribute) -> int:
    """Bits one element occupies in memory (f4e2m1 packs two values per byte)."""
    if isinstance(element_type, Float4E2M1FNType):
        return 4
    if element_type == U3:
        return 3
    if isinstance(element_type, Float8E4M3FNType | Float8E5M2Type | Float8E8M0FNUType):
        return 8
    if isinstance(element_type, BFloat16Type):
        return 16
    if isinstance(element_type, IntegerType) and element_type.width.data == 1:
        return 8
    return 32


def stored_bytes(t: Attribute) -> int:
    """Bytes a tensor of type `t` occupies in memory (sub-byte elements packed; 0 if no tensor)."""
    if not isinstance(t, TensorType):
        return 0
    if t.get_element_type() == U3:
        return code_tile_bytes(tuple(t.get_shape()))
    return -(-math.prod(t.get_shape()) * stored_bits(t.get_element_type()) // 8)


def code_tile_bytes(shape: Sequence[int]) -> int:
    """Bytes of u3 codes of `shape` in their 16 x 16 tiles of the last two axes (`CODE_TILE`),
    a ragged edge padded to a whole tile."""
    if len(shape) < 2:
        return -(-math.prod(shape) * 3 // 8)
    tiles = -(-shape[-2] // CODE_TILE) * -(-shape[-1] // CODE_TILE)
    return math.prod(shape[:-2]) * tiles * CODE_TILE * CODE_TILE * 3 // 8


def window_pieces(whole: Sequence[int], window: Sequence[int]) -> int:
    """Contiguous pieces of a window of shape `window` in a row-major tensor of shape `whole`:
    one per index of the axes before the last axis the window cuts (the axes after it are
    whole). A DMA command moves each piece in whole requests."""
    cut = [i for i, (w, n) in enumerate(zip(whole, window)) if n < w]
    return math.prod(window[:cut[-1]]) if cut else 1


CONTRACTION_PAIRS: dict[tuple[str, str], str] = {
    ("f8e4m3", "f8e4m3"): "f8e4m3 x f8e4m3",
    ("f8e5m2", "f8e5m2"): "f8e5m2 x f8e5m2",
    ("f8e4m3", "f4e2m1"): "f8e4m3 x f4e2m1 (the fetch stage's lookup table turns f4e2m1 into f8e4m3)",
}
"""The low-precision operand pairs of the contraction engine (docs/hardware.md,
Precisions): matched fp8 pairs into f32, and MXFP4 values through the fetch stage's lookup
table. Pairs cannot be mixed: there is no fp8 x bf16."""


def contraction_pair(lhs: Attribute, rhs: Attribute) -> str | None:
    """The contraction engine's name for a low-precision operand pair, or None if it has none."""
    return CONTRACTION_PAIRS.get((type_name(lhs), type_name(rhs)))


def describe_pairs() -> str:
    return "; ".join(CONTRACTION_PAIRS.values())


def block_shape(values: Sequence[int], scales: Sequence[int]) -> tuple[int, ...] | None:
    """The block each scale covers (values[i] / scales[i] along every axis), or None when the
    ranks differ or an axis does not divide."""
    if len(values) != len(scales) or any(s < 1 or v % s for v, s in zip(values, scales)):
        return None
    return tuple(v // s for v, s in zip(values, scales))


def scales_shape(values: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The shape of the scales of `values` in blocks of `block`: ceil(values[i] / block[i])
    along each axis, so a last block cut short by the end of an axis has a scale of its own
    (the seed's `scales: [experts, ceil(K / group_size), N]`)."""
    return tuple(-(-v // b) for v, b in zip(values, block))


def is_int_type(element_type: Attribute) -> bool:
    return isinstance(element_type, IntegerType) and element_type.width.data == 32


def is_bool_type(element_type: Attribute) -> bool:
    return isinstance(element_type, IntegerType) and element_type.width.data == 1


def shape_of(t: Attribute) -> tuple[int, ...]:
    assert isinstance(t, TensorType)
    return tuple(t.get_shape())


def format_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_type(t: Attribute) -> str:
    """A tensor type as the .moe language writes it: `bf16[16, 64]`."""
    if isinstance(t, TensorType):
        return type_name(t.get_element_type()) + format_shape(shape_of(t))
    return str(t)


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """numpy's broadcast rule, or None when the shapes do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    result: list[int] = []
    for axis in range(rank):
        dims = {s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0}
        dims.discard(1)
        if len(dims) > 1:
            return None
        result.append(dims.pop() if dims else 1)
    return tuple(result)


def promote(a: Attribute, b: Attribute) -> Attribute | None:
    """The arithmetic result type of two element types, or None if they do not mix."""
    if a == b:
        return a
    if is_float_type(a) and is_float_type(b):
        return f32
    return None


def normalize_axis(axis: int, rank: int) -> int | None:
    """An axis in [-rank, rank) as a non-negative index, or None when out of range."""
    if -rank <= axis < rank:
        return axis % rank
    return None


def matmul_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """numpy.matmul's shape rule for operands of rank >= 2 (leading axes broadcast)."""
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    batch = broadcast_shapes(a[:-2], b[:-2])
    if batch is None:
        return None
    return (*batch, a[-2], b[-1])


def reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def float_literal(v: float) -> str:
    """`v` as an MLIR float literal that parses back to the same double: repr, with a `.0`
    added to the mantissa where repr leaves it out (`1e-20` -> `1.0e-20`)."""
    text = repr(v)
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text


def check_reshape(a: Attribute, r: Attribute, what: str) -> None:
    """The rule of every row-major reshape (tmath.reshape, tcp.view): same element type and
    element count."""
    expect(a.get_element_type() == r.get_element_type(), f"{what} keeps the element type")
    expect(math.prod(shape_of(a)) == math.prod(shape_of(r)), f"cannot {what} {format_type(a)} to {format_type(r)}")


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise VerifyException(message)
