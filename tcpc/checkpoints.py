"""Real weights: one MoE layer of a HuggingFace safetensors checkpoint as a graph's inputs.

`tcpc run examples/qwen3_moe.moe --weights PATH --layer 12` reads layer 12's router and expert
tensors from PATH (a `.safetensors` file, a directory of shards with
`model.safetensors.index.json`, or a snapshot directory with `config.json`), turns them into
the layouts the program declares (tcpc/checkpoint_families.py holds one table per family, and a
user's TOML file adds one: tcpc/family_file.py), and takes the program's dims from config.json.
Tensors are read lazily through safetensors' `safe_open` (memory-mapped; fp8, which its numpy
API cannot give, from the file's bytes): only the chosen layer's tensors are touched, so a 60 GB
checkpoint costs the memory of one layer.

Low-precision checkpoints keep their precision: an fp8 weight (f8e4m3 with f32
`weight_scale_inv` per block) or an MXFP4 one (e2m1 codes and e8m0 scales) feeds a program that
declares it so (`w: f8e4m3[...]` with `w_scale: f32[...]`) as stored, only its index layout
changed (transposed, split, unpacked to one code a byte). A checkpoint in one precision runs a
program declared in another only by a conversion the caller asks for (`convert`: "quantize" or
"dequantize", by the one definition in runtime_sim/semantics/quantization.py). Every mistake (a
missing tensor, a wrong shape or dtype, a layer out of range or not an MoE layer, a model with
no table, a precision that does not match) is a CheckpointError naming the tensor, the
expected and found shapes and the file.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType

from dialects.tensor_types import block_shape, format_type, is_low_precision_type, is_scale_type, shape_of
from runtime_sim.semantics.numerics import (
    compute,
    float4_e2m1,
    float8_e4m3,
    float8_e5m2,
    float8_e8m0,
    round_to,
    tensor_dtype,
)
from runtime_sim.semantics.quantization import dequantize, quantize_blocks
from tcpc.arrays import InputError, arg_names, to_declared
from tcpc.checkpoint_families import FAMILIES, REQUIRED, Family, Layout, Source
from tcpc.diagnostics import CompileError
from tcpc.program import Program, compile_file

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""safetensors dtypes a float argument accepts (rounded to the declared type, as --inputs are)."""
FP8_DTYPES = {"F8_E4M3": float8_e4m3, "F8_E5M2": float8_e5m2}
"""fp8 weights. numpy has no such types, so safetensors' numpy API cannot give them: they are
read from the file's bytes (memory-mapped) as ml_dtypes arrays."""
SCALE_DTYPES = ("F32", "BF16", "F16")
"""Block scales beside an fp8 weight: exact in f32."""
FP8_BLOCK = (128, 128)
"""An fp8 checkpoint's block [out, in] when its config.json says none (transformers'
FineGrainedFP8Config default, DeepSeek-V3's and Qwen3-FP8's)."""
BLOCK_DIMS = {"QN": 0, "QK": 1, "QG": 1}
"""The low-precision programs' weight block dims (output, reduction axis), taken from an fp8
checkpoint's `quantization_config.weight_block_size` [out, in], and their activation group,
which vLLM takes from the block's reduction size (`per_token_group_quant_fp8`)."""
CONVERSIONS = ("quantize", "dequantize")
"""What `convert` (`--convert-weights`) may ask for."""
MXFP4_SUFFIXES = ("_blocks", "_scales")
MXFP4_BLOCK = 32


class CheckpointError(Exception):
    """A checkpoint that cannot feed the program; the message names the tensor and the file."""


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass
class Checkpoint:
    path: Path
    files: dict[str, Path]
    """Tensor name -> the file holding it (from the index, or the files' own headers)."""
    config: dict[str, Any] | None
    config_path: Path | None

    def describe_config(self) -> str:
        return str(self.config_path) if self.config_path else str(self.path)


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError:
        raise CheckpointError("reading checkpoints needs safetensors: pip install 'tcpc[weights]'") from None
    return safetensors


def _tensor_names(file: Path) -> list[str]:
    """The names in one file's header (safe_open reads only the header)."""
    st = _safetensors()
    try:
        with st.safe_open(str(file), framework="numpy") as f:
            return list(f.keys())
    except (st.SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Find a checkpoint's tensors and its config.json, reading only headers."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: expected a .safetensors file or a checkpoint directory")
        files = {name: path for name in _tensor_names(path)}
        config_path = path.parent / CONFIG
    elif (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{path / INDEX}: not a safetensors index (no 'weight_map')") from None
        files = {name: path / shard for name, shard in weight_map.items()}
        config_path = path / CONFIG
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{path}: no .safetensors file and no {INDEX} in this directory")
        files = {name: shard for shard in shards for name in _tensor_names(shard)}
        config_path = path / CONFIG
    config = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as e:
            raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object")
    return Checkpoint(path, files, config, config_path if config is not None else None)


def find_family(checkpoint: Checkpoint, graph: str, families: Sequence[Family] = FAMILIES) -> Family:
    """The family of the checkpoint's config.json `model_type` (or, without a config, of the
    program's graph), checked against the program; `families` are searched in order (a user's
    declared family before the built-in ones)."""
    if checkpoint.config is None:
        family = next((f for f in families if graph in f.programs), None)
        if family is None:
            raise CheckpointError(f"graph '{graph}' has no checkpoint mapping "
                                  f"(families: {', '.join(f.name for f in families)})")
        return family
    model_type = checkpoint.config.get("model_type")
    family = next((f for f in families if model_type in f.model_types), None)
    if family is None:
        raise CheckpointError(f"{checkpoint.config_path}: model_type {model_type!r} has no tensor mapping "
                              f"(known: {', '.join(t for f in families for t in f.model_types)}; declare it "
                              "in a TOML file given with --family, see docs/checkpoints.md)")
    if graph not in family.programs:
        raise CheckpointError(f"{checkpoint.config_path}: a {model_type} checkpoint; its programs are "
                              f"{family.graphs}, not graph '{graph}'")
    return family


def _same_kind(value: Any, default: Any) -> bool:
    """Whether config.json's `value` is of the kind transformers' `default` is (an int for a
    float, never a bool for a number; a None or list default stands for a list or None, as
    transformers' config classes read a null list as empty)."""
    if default is None or isinstance(default, list):
        return value is None or isinstance(value, list)
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    return isinstance(value, type(default))


def family_config(checkpoint: Checkpoint, family: Family) -> dict[str, Any]:
    """config.json as transformers reads it for `family` (Llama-4: its `text_config`): each of
    the family's keys by its name, found under the name or an alias, else transformers'
    default; a required key (a dim) config.json lacks is absent."""
    raw = checkpoint.config or {}
    if family.config_section and isinstance(raw.get(family.config_section), dict):
        raw = raw[family.config_section]
    where = checkpoint.describe_config()
    config: dict[str, Any] = {}
    for key in family.keys:
        found = [(name, raw[name]) for name in (key.name, *key.aliases) if name in raw]
        for name, value in found[1:]:
            if value != found[0][1]:
                raise CheckpointError(f"{where}: {found[0][0]} = {json.dumps(found[0][1])} but {name} = "
                                      f"{json.dumps(value)}; transformers reads both as {key.name}")
        if found:
            name, value = found[0]
            if key.default is REQUIRED:
                if not _same_kind(value, 1) or value <= 0:
                    raise CheckpointError(f"{where}: {name} = {json.dumps(value)}, expected a positive integer")
            elif not _same_kind(value, key.default):
                raise CheckpointError(f"{where}: {name} = {json.dumps(value)}, expected a value like "
                                      f"transformers' default {json.dumps(key.default)}")
            config[key.name] = value
        elif key.default is not REQUIRED:
            config[key.name] = key.default
    return config


def fp8_block(checkpoint: Checkpoint) -> tuple[int, int] | None:
    """The [out, in] block of an fp8 checkpoint's weight scales: config.json's
    `quantization_config.weight_block_size`; None for a checkpoint whose config declares no
    fp8 quantization."""
    raw = (checkpoint.config or {}).get("quantization_config")
    if not isinstance(raw, dict) or raw.get("quant_method") != "fp8":
        return None
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_same_kind(b, 1) and b > 0 for b in block)):
        raise CheckpointError(f"{checkpoint.describe_config()}: quantization_config.weight_block_size = "
                              f"{json.dumps(block)}, expected [out, in] block sizes (tcpc reads block-scaled "
                              "fp8, whose scales are 'weight_scale_inv', not per-tensor scales)")
    return block[0], block[1]


def config_dims(checkpoint: Checkpoint, family: Family, graph: str, given: Collection[str] = ()) -> dict[str, int]:
    """The dims of `graph`'s program from config.json ({} without one), after checking the
    values the program bakes in; dims in `given` (by --set) are not read. An fp8 checkpoint's
    block gives the weight block dims (BLOCK_DIMS) of the programs that have them."""
    if checkpoint.config is None:
        return {}
    config = family_config(checkpoint, family)
    where = checkpoint.describe_config()
    program = family.programs[graph]
    for r in family.requirements:
        if config[r.key] != r.expected:
            raise CheckpointError(f"{where}: {r.key} = {config[r.key]!r}, but {program} needs "
                                  f"{r.expected!r} ({r.why})")
    dims: dict[str, int] = {}
    for dim, value in family.dims.items():
        if dim in given:
            continue
        try:
            dims[dim] = value(config) if callable(value) else config[value]
        except KeyError as e:
            raise CheckpointError(f"{where}: no {family.key(e.args[0]).describe()} (the {dim} dim of "
                                  f"{Path(program).name}; or give it with --set {dim}=N)") from None
    block = fp8_block(checkpoint)
    if block is not None:
        dims.update({dim: block[axis] for dim, axis in BLOCK_DIMS.items() if dim not in given})
    return dims


def check_layer(checkpoint: Checkpoint, family: Family, layer: int) -> None:
    if layer < 0:
        raise CheckpointError(f"--layer {layer}: a layer index is 0 or more")
    if checkpoint.config is None:
        return
    config = family_config(checkpoint, family)
    where = checkpoint.describe_config()
    count = config.get(family.layers_key)
    if isinstance(count, int) and layer >= count:
        raise CheckpointError(f"layer {layer} is out of range: {where} has {family.layers_key} = {count} "
                              f"(layers 0..{count - 1})")
    if not family.moe_layer(config, layer):
        moe = [i for i in range(count if isinstance(count, int) else layer + 1) if family.moe_layer(config, i)]
        shown = ", ".join(map(str, moe[:8])) + (", ..." if len(moe) > 8 else "")
        raise CheckpointError(f"layer {layer} of this {family.name} checkpoint is a dense MLP, not an MoE layer "
                              f"(by {where}; MoE layers: {shown or 'none'})")


class _Reader:
    """Open safetensors files (memory-mapped), each opened once."""

    def __init__(self, stack: ExitStack):
        self.stack = stack
        self.handles: dict[Path, Any] = {}
        self.headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def handle(self, file: Path) -> Any:
        if file not in self.handles:
            st = _safetensors()
            try:
                self.handles[file] = self.stack.enter_context(st.safe_open(str(file), framework="numpy"))
            except (st.SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
        return self.handles[file]

    def meta(self, name: str, file: Path) -> tuple[str, list[int]]:
        """dtype (safetensors' name, e.g. BF16) and shape, from the header."""
        s = self.handle(file).get_slice(name)
        return s.get_dtype(), list(s.get_shape())

    def read(self, name: str, file: Path) -> np.ndarray:
        dtype, shape = self.meta(name, file)
        if dtype in FP8_DTYPES:
            return self._raw(name, file, FP8_DTYPES[dtype], shape)
        return self.handle(file).get_tensor(name)

    def _raw(self, name: str, file: Path, dtype: np.dtype, shape: list[int]) -> np.ndarray:
        """A tensor from the file's bytes (safetensors: an 8-byte little-endian header size, the
        JSON header, then the data; `data_offsets` count from the data's start), memory-mapped."""
        if file not in self.headers:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self.headers[file] = 8 + size, json.loads(f.read(size))
        start, header = self.headers[file]
        begin, end = header[name]["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise CheckpointError(f"{file}: tensor '{name}' holds {end - begin} bytes, not the {count * dtype.itemsize} "
                                  f"of its shape {_shape(shape)}")
        data = np.memmap(file, np.uint8, "r", offset=start + begin, shape=(count,)) if count else np.empty(0, np.uint8)
        return data.view(dtype).reshape(shape)


@contextmanager
def _reader() -> Iterator[_Reader]:
    with ExitStack() as stack:
        yield _Reader(stack)


def _names(source: Source, prefix: str, experts: int) -> list[str]:
    if source.per_expert:
        return [f"{prefix}.{source.tensor.format(e=e)}" for e in range(experts)]
    return [f"{prefix}.{source.tensor}"]


def _stored_names(source: Source, prefix: str, experts: int) -> list[str]:
    """The tensors the checkpoint must hold for `source` (an MXFP4 weight is two)."""
    names = _names(source, prefix, experts)
    return [n + suffix for n in names for suffix in MXFP4_SUFFIXES] if source.mxfp4 else names


def _blocks(block: tuple[int, ...]) -> str:
    return " x ".join(map(str, block))


@dataclass
class Stored:
    """One weight as the checkpoint holds it (its values in their own type and, when quantized,
    its block scales: `block` elements per scale along each axis, the last block along an axis
    possibly ragged, as an fp8 checkpoint's ceil-divided scales are), and where it came from."""

    name: str
    file: Path
    kind: str
    """How it is stored, for messages: "BF16", "F8_E4M3 with block scales '...'", "MXFP4 (...)"."""
    values: np.ndarray
    scales: np.ndarray | None = None
    block: tuple[int, ...] | None = None

    @property
    def precision(self) -> str:
        """What the experts of one argument must share."""
        return "dense" if self.scales is None else f"{self.values.dtype} {self.scales.dtype} {self.block}"

    def describe(self) -> str:
        return f"tensor '{self.name}' is {self.kind}"


def unpack_fp4(blocks: np.ndarray) -> np.ndarray:
    """MXFP4's packed codes, [..., G, 16] uint8 (value 2j in the low nibble, 2j + 1 in the high
    one, as transformers' `convert_moe_packed_tensors` unpacks them), as f4e2m1 [..., G * 32],
    one code a byte (numpy's storage of f4e2m1): the same codes, not dequantized."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)
    return codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK).view(float4_e2m1)


def _read_mxfp4(reader: _Reader, checkpoint: Checkpoint, name: str, want: tuple[int, ...], what: str) -> Stored:
    """The MXFP4 weight `name` (its _blocks and _scales) as f4e2m1 codes of the stored shape
    `want` and their e8m0 scales, one per 32 values along the last axis."""
    if want[-1] % MXFP4_BLOCK:
        raise CheckpointError(f"{checkpoint.path}: '{name}' is MXFP4, in blocks of {MXFP4_BLOCK} along an axis of "
                              f"{want[-1]} ({what})")
    groups = want[-1] // MXFP4_BLOCK
    arrays = []
    for suffix, shape in zip(MXFP4_SUFFIXES, ((*want[:-1], groups, MXFP4_BLOCK // 2), (*want[:-1], groups))):
        file = checkpoint.files[name + suffix]
        dtype, found = reader.meta(name + suffix, file)
        if tuple(found) != shape or dtype != "U8":
            raise CheckpointError(f"{file}: tensor '{name + suffix}' is {dtype} {_shape(found)}, expected U8 "
                                  f"{_shape(shape)} ({what})")
        arrays.append(reader.read(name + suffix, file))
    blocks, scales = arrays
    blocks_name, scales_name = (name + suffix for suffix in MXFP4_SUFFIXES)
    return Stored(blocks_name, checkpoint.files[blocks_name], f"MXFP4 (f4e2m1 codes with e8m0 scales '{scales_name}')",
                  unpack_fp4(blocks), scales.view(float8_e8m0), (1,) * (len(want) - 1) + (MXFP4_BLOCK,))


def _read(reader: _Reader, checkpoint: Checkpoint, name: str, scale: str | None, want: tuple[int, ...],
          source: Source, what: str) -> Stored:
    """One checkpoint tensor as stored (an fp8 one with its block scales, an MXFP4 one
    unpacked), after checking its shape and dtype against `want`."""
    if source.mxfp4:
        return _read_mxfp4(reader, checkpoint, name, want, what)
    file = checkpoint.files[name]
    dtype, shape = reader.meta(name, file)
    if tuple(shape) != want:
        raise CheckpointError(f"{file}: tensor '{name}' has shape {_shape(shape)}, expected {_shape(want)} ({what})")
    if dtype in FP8_DTYPES:
        if scale is None or scale not in checkpoint.files:
            missing = (f"its block scales '{scale}' are not in the checkpoint" if scale
                       else "the family's table names no block scales for it")
            raise CheckpointError(f"{file}: tensor '{name}' is {dtype}, but {missing} ({what})")
        block = (1,) * (len(want) - 2) + (fp8_block(checkpoint) or FP8_BLOCK)
        expected = tuple(-(-n // b) for n, b in zip(want, block))  # ceil: a ragged last block has its scale
        scale_file = checkpoint.files[scale]
        scale_dtype, scale_shape = reader.meta(scale, scale_file)
        if tuple(scale_shape) != expected or scale_dtype not in SCALE_DTYPES:
            raise CheckpointError(f"{scale_file}: tensor '{scale}' is {scale_dtype} {_shape(scale_shape)}, expected F32 "
                                  f"{_shape(expected)}: the scales of '{name}' {dtype} {_shape(want)} in blocks of "
                                  f"{_blocks(block[-2:])} ({what})")
        return Stored(name, file, f"{dtype} with block scales '{scale}'", reader.read(name, file),
                      compute(reader.read(scale, scale_file)), block)
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{file}: tensor '{name}' is {dtype}, expected a float tensor "
                              f"({', '.join(FLOAT_DTYPES)}) or fp8 with block scales for {what}")
    return Stored(name, file, dtype, reader.read(name, file))


def _transform(stored: Stored, source: Source) -> Stored:
    """The stored tensor in the program's layout: one part of a fused tensor, transposed. Its
    scales move with it, so a part must hold whole blocks."""
    values, scales, block = stored.values, stored.scales, stored.block
    if source.part is not None:
        axis = source.parts_axis % values.ndim
        n = values.shape[axis] // 2
        index = slice(source.part, None, 2) if source.interleaved else slice(source.part * n, (source.part + 1) * n)
        values = values[(slice(None),) * axis + (index,)]
        if scales is not None and block is not None:
            b = block[axis]
            if b != 1 if source.interleaved else n % b:
                rows = "every other row" if source.interleaved else f"{n} of its {2 * n} rows"
                raise CheckpointError(f"{stored.file}: {stored.describe()}, and its {('gate', 'up')[source.part]} part "
                                      f"({rows}) is not whole blocks of {b}: no block-scaled type holds it as stored")
            step = index if source.interleaved else slice(source.part * n // b, (source.part + 1) * n // b)
            scales = scales[(slice(None),) * axis + (step,)]
    if source.transpose:
        values = np.swapaxes(values, -1, -2)
        if scales is not None and block is not None:
            scales = np.swapaxes(scales, -1, -2)
            block = (*block[:-2], block[-1], block[-2])
    return Stored(stored.name, stored.file, stored.kind, values, scales, block)


def _stack(parts: list[Stored]) -> Stored:
    """Each expert's stored weight, stacked on a new first axis."""
    first = parts[0]
    for other in parts[1:]:
        if other.precision != first.precision:
            raise CheckpointError(f"{other.file}: {other.describe()}, but {first.describe()}: the experts of one "
                                  "argument must be stored alike")
    scales = np.stack([p.scales for p in parts if p.scales is not None]) if first.scales is not None else None
    block = (1, *first.block) if first.block is not None else None
    return Stored(first.name, first.file, first.kind, np.stack([p.values for p in parts]), scales, block)


def _type_name(t: TensorType) -> str:
    return format_type(t).split("[")[0]


def _by_expert(stored: Stored, block: tuple[int, ...] | None) -> Iterator[slice]:
    """The slices of the first axis to convert at a time: one expert at a time when no block
    spans experts (so the f32 temporaries stay one expert's size), else the whole."""
    blocks = [b for b in (stored.block, block) if b is not None]
    if stored.values.ndim < 3 or any(b[0] != 1 for b in blocks):
        yield slice(None)
    else:
        yield from (slice(i, i + 1) for i in range(stored.values.shape[0]))


def _real(stored: Stored, part: slice) -> np.ndarray:
    """What the stored values of `part` stand for, in f32."""
    if stored.scales is None:
        return compute(stored.values[part])
    return dequantize(stored.values[part], stored.scales[part], stored.block)


def _as_declared(arg: str, stored: Stored, declared: Mapping[str, TensorType], convert: str | None, program: str,
                 hint: str) -> tuple[dict[str, np.ndarray], str | None]:
    """`stored` (in the program's layout) as argument `arg` of its declared type, and a
    low-precision argument's scales as `arg`_scale: as stored when the precisions match, else
    quantized or dequantized when `convert` asks for it (the conversion made is returned)."""
    t = declared[arg]

    def refuse(needed: str, takes: str) -> CheckpointError:
        said = (f"that needs --convert-weights {needed}, not {convert}" if convert is not None
                else f"{needed.removesuffix('e')}ing is a conversion tcpc makes only when asked (--convert-weights {needed}){hint}")
        blocks = f" (in blocks of {_blocks(stored.block)} here)" if stored.block else ""
        return CheckpointError(f"{stored.file}: {stored.describe()}{blocks}, and argument '{arg}' {format_type(t)} of "
                               f"{program} {takes}: {said}")

    if not is_low_precision_type(t.get_element_type()):
        if stored.scales is None:
            return {arg: to_declared(arg, stored.values, t)}, None
        if convert != "dequantize":
            raise refuse("dequantize", f"is {_type_name(t)}")
        out = np.empty(shape_of(t), tensor_dtype(t))
        for part in _by_expert(stored, None):
            out[part] = round_to(_real(stored, part), out.dtype)  # as to_declared rounds a float array
        return {arg: out}, "dequantize"
    scale_arg = f"{arg}_scale"
    ts = declared.get(scale_arg)
    block = block_shape(shape_of(t), shape_of(ts)) if ts is not None else None
    if ts is None or not is_scale_type(ts.get_element_type()) or block is None:
        raise CheckpointError(f"argument '{arg}' {format_type(t)} of {program} has no block scales: a low-precision "
                              f"weight's are the argument '{scale_arg}' (f32 or e8m0, dividing it into blocks)")
    dtype, scale_dtype = tensor_dtype(t), tensor_dtype(ts)
    if stored.scales is not None and stored.values.dtype == dtype and stored.block == block:
        if stored.scales.dtype == scale_dtype or scale_dtype == np.float32:  # e8m0 scales are exact in f32
            return {arg: np.ascontiguousarray(stored.values),
                    scale_arg: np.ascontiguousarray(stored.scales.astype(scale_dtype))}, None
    if convert != "quantize":
        raise refuse("quantize", f"takes {_type_name(t)} with {_type_name(ts)} scales in blocks of {_blocks(block)}")
    values, scales = np.empty(shape_of(t), dtype), np.empty(shape_of(ts), scale_dtype)
    for part in _by_expert(stored, block):
        values[part], scales[part] = quantize_blocks(_real(stored, part), dtype, block, scale_dtype)
    return {arg: values, scale_arg: scales}, "quantize"


def _choose(checkpoint: Checkpoint, family: Family, layer: int,
            declared: Mapping[str, TensorType]) -> tuple[str, Layout]:
    """The first prefix and layout whose tensors the checkpoint holds, or an error naming the
    first missing tensor of the closest candidate."""
    best: tuple[int, str, Layout, str] | None = None
    for template in family.prefixes:
        prefix = template.format(layer=layer)
        for layout in family.layouts:
            wanted = [n for arg, s in layout.arguments.items() if arg in declared
                      for n in _stored_names(s, prefix, shape_of(declared[arg])[0])]
            missing = [n for n in wanted if n not in checkpoint.files]
            if not missing:
                return prefix, layout
            if best is None or len(missing) < best[0]:
                best = (len(missing), prefix, layout, missing[0])
    assert best is not None
    _, prefix, layout, name = best
    others = [lay.name for lay in family.layouts if lay is not layout]
    alternatives = f"; also tried: {', '.join(others)}" if others else ""
    raise CheckpointError(f"{checkpoint.path}: tensor '{name}' not found (layer {layer} of a {family.name} "
                          f"checkpoint, layout '{layout.name}'{alternatives})")


def load_layer(checkpoint: Checkpoint, family: Family, layer: int, fn: func.FuncOp,
               convert: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Graph argument name -> its weights from layer `layer`, in the declared shape and dtype
    (a low-precision argument's block scales included); and argument -> the conversion
    (`convert`: "quantize" or "dequantize") that made it, for those converted."""
    if convert not in (None, *CONVERSIONS):
        raise ValueError(f"convert is one of {', '.join(CONVERSIONS)} or None, not {convert!r}")
    check_layer(checkpoint, family, layer)
    graph = fn.sym_name.data
    types = dict(zip(arg_names(fn), fn.function_type.inputs.data))
    declared = {name: t for name, t in types.items() if isinstance(t, TensorType)}
    prefix, layout = _choose(checkpoint, family, layer, declared)
    program = Path(family.programs[graph]).name
    others = [p for g, p in family.programs.items() if g != graph]
    hint = f"; or run {' or '.join(others)}" if others else ""
    weights: dict[str, np.ndarray] = {}
    conversions: dict[str, str] = {}
    fused: dict[str, Stored] = {}  # a fused gate_up tensor feeds two arguments: read it once
    with _reader() as reader:
        for arg, source in layout.arguments.items():
            if arg not in declared:
                raise CheckpointError(f"graph '{graph}' has no argument '{arg}', which the "
                                      f"{family.name} table fills from '{prefix}.{source.tensor}'")
            t = declared[arg]
            what = f"argument '{arg}' {format_type(t)} of {program}"
            want = source.stored_shape(shape_of(t))
            names = _names(source, prefix, shape_of(t)[0])
            scales = _names(Source(source.scale), prefix, shape_of(t)[0]) if source.scale else [None] * len(names)
            parts = []
            for name, scale in zip(names, scales):
                if source.part is None:
                    stored = _read(reader, checkpoint, name, scale, want, source, what)
                else:
                    if name not in fused:
                        fused[name] = _read(reader, checkpoint, name, scale, want, source, what)
                    stored = fused[name]
                parts.append(_transform(stored, source))
            try:
                arrays, conversion = _as_declared(arg, _stack(parts) if source.per_expert else parts[0], declared,
                                                  convert, program, hint)
            except InputError as e:  # cannot happen after the shape check, unless the table is wrong
                raise CheckpointError(f"{prefix}: {e}") from None
            weights.update(arrays)
            if conversion:
                conversions[arg] = conversion
    return weights, conversions


@dataclass
class LayerWeights:
    """What `tcpc run --weights` feeds the simulation: the program compiled with the
    checkpoint's dims and the layer's weights by argument name."""

    program: Program
    weights: dict[str, np.ndarray]
    family: Family
    dims: dict[str, int]
    """The dims that came from config.json."""
    conversions: dict[str, str] = field(default_factory=dict)
    """Argument -> "quantize" or "dequantize": the weights converted to the program's precision."""

    def describe(self, checkpoint: Checkpoint, layer: int) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.dims.items())
        converted = "".join(f"; {how}d by --convert-weights: {', '.join(a for a, h in self.conversions.items() if h == how)}"
                            for how in CONVERSIONS if how in self.conversions.values())
        return (f"weights: layer {layer} of {checkpoint.path} ({self.family.name}: {', '.join(self.weights)}"
                + (f"; dims {dims} from {checkpoint.config_path}" if dims else "") + converted + ")")


def compile_with_weights(file: str | Path, checkpoint: Checkpoint, layer: int, overrides: Mapping[str, int],
                         graph: str | None = None, *, convert: str | None = None,
                         families: Sequence[Family] = FAMILIES, **choose_for: Any) -> LayerWeights:
    """Compile `file` with the checkpoint's dims (`overrides`, from --set, win) and read the
    layer's weights for `graph` (default: the first), converting their precision to the
    program's only as `convert` asks; `families` are searched for the checkpoint's (a user's
    declared ones first); `choose_for` goes to compile_file (the machine, routing and seed
    block=auto is chosen for)."""
    names = compile_file(file, overrides, **choose_for)
    graph_name = names.function(graph).sym_name.data
    family = find_family(checkpoint, graph_name, families)
    dims = {k: v for k, v in config_dims(checkpoint, family, graph_name, overrides).items() if k in names.dims}
    try:
        program = compile_file(file, {**dims, **overrides}, **choose_for)
    except CompileError as e:  # it compiled with its own dims: the checkpoint's do not fit it
        block = fp8_block(checkpoint)
        ragged = (f"; the checkpoint's fp8 blocks of {block[0]} x {block[1]} do not divide its weights (their last "
                  "blocks are ragged), and a block-scaled type's blocks are whole: run a bf16 program with "
                  "--convert-weights dequantize" if block and "does not divide" in e.message else "")
        raise CheckpointError(f"{checkpoint.describe_config()}: {Path(file).name} does not compile with the "
                              f"checkpoint's dims ({', '.join(f'{k}={v}' for k, v in dims.items())}): "
                              f"{e.message}{ragged}") from None
    weights, conversions = load_layer(checkpoint, family, layer, program.function(graph_name), convert)
    return LayerWeights(program, weights, family, dims, conversions)
