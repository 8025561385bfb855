"""Graph inputs and outputs as numpy arrays: checking, converting, drawing and saving them.

npz has no bf16: a bf16 argument accepts any real array (rounded to nearest even) or raw bf16
bytes (`|V2`, what numpy writes for an ml_dtypes array); bf16 results are saved as f32 (exact).
A low-precision argument (f8e4m3, f8e5m2, f4e2m1, e8m0) accepts any real array (converted with
saturation, round to nearest even) or its raw bytes (`|V1`). A u3 argument [..., K, N] accepts
integer codes in [0, 8) of its shape, or the codes as stored: uint8 [..., ceil(K / 16),
ceil(N / 16), 96], 16 x 16 tiles of 3-bit codes (`quantization.unpack_code_tiles`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import ml_dtypes
import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType
from xdsl.ir import SSAValue

from dialects import lowp, moe, tcp, tile
from dialects.annotations import routing_arguments
from dialects.tensor_types import CODE_TILE, format_type, shape_of
from runtime_sim.perf.array_files import ArrayFileError, read_arrays
from runtime_sim.perf.routing_scenarios import DEFAULT_SCENARIO, RoutingError, scenario_choices
from runtime_sim.semantics.numerics import LOW_PRECISION_DTYPES, bfloat16, code3, float8_e8m0, round_to, tensor_dtype
from runtime_sim.semantics.quantization import unpack_code_tiles

SCALE_OPERANDS: dict[type, tuple[int, ...]] = {
    lowp.DequantizeOp: (1,),
    lowp.ScaledMatmulOp: (2, 3),
    moe.ScaledGroupedMatmulOp: (3, 4),
    tcp.ScaledContractOp: (2, 3),
}
"""Operand positions that hold block scales, at every level."""

_MOVES = (tcp.ViewOp, tcp.DmaGatherOp, tcp.LoadOp, tile.SliceOp, tile.LoadOp, tile.GatherOp, tile.LoadExpertOp)
"""Ops that pass their first operand on unchanged in kind (a scale gathered, loaded or sliced
is still a scale), at every level."""


class InputError(Exception):
    """Inputs that do not fit the graph's signature. `argument` is the name of the given array
    the error is about (None for a file or a drawn input), so that a caller that read the
    arrays from a file can name the file."""

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


def arg_names(fn: func.FuncOp) -> list[str]:
    return [a.name_hint or f"arg{i}" for i, a in enumerate(fn.body.blocks.first.args)]


def to_declared(name: str, value: np.ndarray, t: TensorType) -> np.ndarray:
    """`value` in the storage dtype of `t`, or an InputError saying what is wrong."""
    value = np.asarray(value)
    want = tensor_dtype(t)
    if want == code3:
        return _codes(name, value, t)
    if value.shape != shape_of(t):
        raise InputError(f"input '{name}' has shape {list(value.shape)}, the graph declares {format_type(t)}", name)
    if value.dtype == want:
        return value
    if value.dtype == np.dtype("V2") and want == bfloat16:
        return value.view(bfloat16)
    if value.dtype == np.dtype("V1") and want.itemsize == 1:  # raw f8, f4 (one per byte) or e8m0
        return value.view(want)
    if want == np.int32:
        if value.dtype.kind not in "iu":
            raise InputError(f"input '{name}' is {value.dtype}, the graph declares {format_type(t)} (integers)", name)
        info = np.iinfo(np.int32)
        if value.size and (value.min() < info.min or value.max() > info.max):
            raise InputError(f"input '{name}' has values outside the i32 range", name)
        return value.astype(np.int32)
    if value.dtype.kind not in "fiu" and value.dtype != bfloat16:
        raise InputError(f"input '{name}' is {value.dtype}, the graph declares {format_type(t)}", name)
    return round_to(value.astype(np.float32), want)


def _codes(name: str, value: np.ndarray, t: TensorType) -> np.ndarray:
    """u3 codes of `t` from integer codes of its shape or from their stored tiles."""
    *lead, k, n = shape_of(t)
    tiles = (*lead, -(-k // CODE_TILE), -(-n // CODE_TILE), CODE_TILE * CODE_TILE * 3 // 8)
    if value.dtype == np.uint8 and value.shape == tiles:
        return unpack_code_tiles(value, k, n, CODE_TILE)
    if value.shape != shape_of(t):
        raise InputError(f"input '{name}' has shape {list(value.shape)}, the graph declares {format_type(t)} "
                         f"(codes, or their 16 x 16 tiles: uint8 {list(tiles)})", name)
    if value.dtype.kind not in "iu":
        raise InputError(f"input '{name}' is {value.dtype}, the graph declares {format_type(t)} (integer codes in [0, 8))", name)
    if value.size and (value.min() < 0 or value.max() > 7):
        raise InputError(f"input '{name}' has codes outside [0, 8): {value.min()} to {value.max()}", name)
    return value.astype(code3)


def is_sign(value: SSAValue) -> bool:
    """Whether a value is a sign vector of a dequantization (`signs=(su, sv)`)."""
    return any(isinstance(u.operation, lowp.DequantizeOp) and value in (u.operation.su, u.operation.sv) for u in value.uses)


def is_scale(value: SSAValue) -> bool:
    """Whether a value is used as block scales, directly or after views, gathers and loads."""
    for use in value.uses:
        op = use.operation
        if use.index in SCALE_OPERANDS.get(type(op), ()):
            return True
        if isinstance(op, _MOVES) and use.index == 0 and is_scale(op.results[0]):
            return True
    return False


def draw(t: TensorType, rng: np.random.Generator, first: bool, scale: bool = False, sign: bool = False) -> np.ndarray:
    """A deterministic random input: activations (the first argument) ~ N(0, 1); other float
    tensors of rank >= 2 ~ N(0, 1 / fan_in) with fan_in the second-to-last axis, like weights;
    i32 tensors uniform in [0, 4), u3 codes in [0, 8), sign vectors (`sign`) +-1. Low-precision
    values ~ N(0, 1) * max_finite / 4, saturated; block scales (`scale`, and every e8m0 tensor)
    2^u with u uniform in [-8, -4] (an integer u for e8m0)."""
    shape = shape_of(t)
    want = tensor_dtype(t)
    if want == np.int32:
        return rng.integers(0, 4, size=shape, dtype=np.int32)
    if want == code3:
        return rng.integers(0, 8, size=shape, dtype=code3)
    if sign:
        return round_to(rng.choice(np.array([-1.0, 1.0], np.float32), size=shape), want)
    if scale or want == float8_e8m0:
        exponent = rng.integers(-8, -3, size=shape) if want == float8_e8m0 else rng.uniform(-8, -4, size=shape)
        return round_to(np.exp2(exponent).astype(np.float32), want)
    if want in LOW_PRECISION_DTYPES:
        spread = float(ml_dtypes.finfo(want).max) / 4
        return round_to((rng.standard_normal(shape) * spread).astype(np.float32), want)
    scale = 1.0 if first or len(shape) < 2 else 1.0 / np.sqrt(shape[-2])
    return round_to((rng.standard_normal(shape) * scale).astype(np.float32), want)


def drawn_as(fn: func.FuncOp) -> dict[str, str]:
    """Argument name -> "scale" or "sign" for the arguments `draw` treats so: what the graph
    uses them as. A lowering may hide it (a dequantization's scales become a vector-engine
    multiplication), so a lowered function is drawn by its graph's roles."""
    roles = {}
    for name, arg in zip(arg_names(fn), fn.body.blocks.first.args):
        if is_scale(arg):
            roles[name] = "scale"
        elif is_sign(arg):
            roles[name] = "sign"
    return roles


def prepare_inputs(fn: func.FuncOp, given: Mapping[str, np.ndarray], seed: int = 0,
                   roles: Mapping[str, str] | None = None) -> list[np.ndarray]:
    """Every argument of `fn` in declared order: from `given` by name, else drawn from the seed
    (each argument from its own stream, so giving one input never changes another), as a
    scale or a sign where `roles` (by default `drawn_as(fn)`) says so. A routing argument
    (`tcpc.routing_experts`, see runtime_sim/perf/routing_scenarios.py) not given takes the
    balanced scenario's expert choices: random indices would repeat experts."""
    if seed < 0:
        raise InputError(f"the seed must be a non-negative integer, got {seed}")
    names = arg_names(fn)
    for name, t in zip(names, fn.function_type.inputs.data):
        if not isinstance(t, TensorType):
            raise InputError(f"argument '{name}' of graph '{fn.sym_name.data}' is {t}, not a tensor; "
                             "tcpc feeds functions tensors")
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InputError(
            f"'{unknown[0]}' is not an argument of graph '{fn.sym_name.data}' (arguments: {', '.join(names)})", unknown[0]
        )
    values = []
    roles = drawn_as(fn) if roles is None else roles
    routing = routing_arguments(fn)
    for i, (name, t) in enumerate(zip(names, fn.function_type.inputs.data)):
        if name in given:
            values.append(to_declared(name, given[name], t))
        elif i in routing and len(shape_of(t)) == 2:
            tokens, k = shape_of(t)
            try:
                values.append(scenario_choices(DEFAULT_SCENARIO, tokens, k, routing[i], seed))
            except RoutingError as e:
                raise InputError(f"routing argument '{name}': {e}") from None
        else:
            role = roles.get(name)
            values.append(draw(t, np.random.default_rng([seed, i]), first=i == 0, scale=role == "scale", sign=role == "sign"))
    return values


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    """The named arrays of an .npz file; never unpickles (an object array is an InputError)."""
    try:
        arrays = read_arrays(path)
    except ArrayFileError as e:
        raise InputError(str(e)) from None
    if isinstance(arrays, np.ndarray):
        raise InputError(f"{path}: an .npy file holds one unnamed array; give the inputs by name in an .npz (numpy.savez)")
    return arrays


def portable(value: np.ndarray) -> np.ndarray:
    """bf16 as f32 (exact), so any numpy reads the file."""
    return value.astype(np.float32) if value.dtype == bfloat16 else value


def save_outputs(file: str | Path | IO[bytes], outputs: Sequence[np.ndarray]) -> None:
    """Write `out0`, `out1`, ... to exactly `file` (numpy would append `.npz` to a bare name)."""
    arrays = {f"out{i}": portable(v) for i, v in enumerate(outputs)}
    if isinstance(file, str | Path):
        with open(file, "wb") as f:
            np.savez(f, **arrays)
    else:
        np.savez(file, **arrays)
