"""Real weights: one MoE layer of a HuggingFace safetensors checkpoint as a graph's inputs.

`tcpc run examples/qwen3_moe.moe --weights PATH --layer 12` reads layer 12's router and expert
tensors from PATH (a `.safetensors` file, a directory of shards with
`model.safetensors.index.json`, or a snapshot directory with `config.json`), turns them into
the layouts the program declares (tcpc/checkpoint_families.py holds one table per family), and
takes the program's dims from config.json. Tensors are read lazily through safetensors'
`safe_open` (memory-mapped): only the chosen layer's tensors are touched, so a 60 GB checkpoint
costs the memory of one layer. Every mistake (a missing tensor, a wrong shape or dtype, a layer
out of range or not an MoE layer, a model with no table) is a CheckpointError naming the
tensor, the expected and found shapes and the file.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType

from dialects.tensor_types import format_type, shape_of
from runtime_sim.semantics.numerics import bfloat16
from tcpc.arrays import InputError, arg_names, to_declared
from tcpc.checkpoint_families import FAMILIES, REQUIRED, Family, Layout, Source
from tcpc.program import Program, compile_file

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""safetensors dtypes a float argument accepts (rounded to the declared type, as --inputs are)."""


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


def find_family(checkpoint: Checkpoint, graph: str) -> Family:
    """The family of the checkpoint's config.json `model_type` (or, without a config, of the
    program's graph), checked against the program."""
    if checkpoint.config is None:
        family = next((f for f in FAMILIES if f.graph == graph), None)
        if family is None:
            raise CheckpointError(f"graph '{graph}' has no checkpoint mapping "
                                  f"(families: {', '.join(f.name for f in FAMILIES)})")
        return family
    model_type = checkpoint.config.get("model_type")
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is None:
        raise CheckpointError(f"{checkpoint.config_path}: model_type {model_type!r} has no tensor mapping "
                              f"(known: {', '.join(t for f in FAMILIES for t in f.model_types)})")
    if family.graph != graph:
        raise CheckpointError(f"{checkpoint.config_path}: a {model_type} checkpoint; its program is "
                              f"examples/{family.program} (graph '{family.graph}'), not graph '{graph}'")
    return family


def _same_kind(value: Any, default: Any) -> bool:
    """Whether config.json's `value` is of the kind transformers' `default` is (an int for a
    float, never a bool for a number; a None default stands for a list or None)."""
    if default is None:
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


def config_dims(checkpoint: Checkpoint, family: Family, given: Collection[str] = ()) -> dict[str, int]:
    """The program's dims from config.json ({} without one), after checking the values the
    program bakes in; dims in `given` (by --set) are not read."""
    if checkpoint.config is None:
        return {}
    config = family_config(checkpoint, family)
    where = checkpoint.describe_config()
    for r in family.requirements:
        if config[r.key] != r.expected:
            raise CheckpointError(f"{where}: {r.key} = {config[r.key]!r}, but examples/{family.program} needs "
                                  f"{r.expected!r} ({r.why})")
    dims: dict[str, int] = {}
    for dim, value in family.dims.items():
        if dim in given:
            continue
        try:
            dims[dim] = value(config) if callable(value) else config[value]
        except KeyError as e:
            raise CheckpointError(f"{where}: no {family.key(e.args[0]).describe()} (the {dim} dim of "
                                  f"{family.program}; or give it with --set {dim}=N)") from None
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
        return self.handle(file).get_tensor(name)


@contextmanager
def _reader() -> Iterator[_Reader]:
    with ExitStack() as stack:
        yield _Reader(stack)


def fp8_weight(name: str, file: Path, dtype: str, scale_name: str | None) -> np.ndarray:
    """The slot for block-quantized fp8 weights (DeepSeek-V3, Qwen3-FP8): an f8e4m3 weight and
    its f32 `weight_scale_inv` (`scale_name`, one per 128 x 128 block; Source.scale in the
    tables). Until the programs take low-precision weights, such a checkpoint stops here with
    an error saying so."""
    scale = f" with block scales '{scale_name}'" if scale_name else ""
    raise CheckpointError(f"{file}: tensor '{name}' is {dtype}{scale}: fp8 checkpoints are not supported yet "
                          "(use a bf16 checkpoint of the model)")


def _names(source: Source, prefix: str, experts: int) -> list[str]:
    if source.per_expert:
        return [f"{prefix}.{source.tensor.format(e=e)}" for e in range(experts)]
    return [f"{prefix}.{source.tensor}"]


def _stored_names(source: Source, prefix: str, experts: int) -> list[str]:
    """The tensors the checkpoint must hold for `source` (an MXFP4 weight is two)."""
    names = _names(source, prefix, experts)
    return [n + suffix for n in names for suffix in MXFP4_SUFFIXES] if source.mxfp4 else names


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""The sixteen e2m1 (fp4) values by code (OCP Microscaling Formats spec v1.0)."""
MXFP4_SUFFIXES = ("_blocks", "_scales")
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 to bf16, exactly: blocks [..., G, 16] uint8 (two e2m1 codes a byte, low nibble
    first), scales [..., G] uint8 e8m0 (2 ** (s - 127)); the result is [..., G * 32]. Dequantized
    one slice of the first axis at a time, so the f32 temporaries stay one expert's size."""
    out = np.empty((*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK), bfloat16)
    for i in range(blocks.shape[0]):
        codes = np.stack([blocks[i] & 0x0F, blocks[i] >> 4], axis=-1)  # [..., G, 16, 2]
        values = FP4_VALUES[codes].reshape(*blocks.shape[1:-1], MXFP4_BLOCK)
        values = np.ldexp(values, scales[i].astype(np.int32)[..., None] - 127)
        out[i] = values.reshape(out.shape[1:]).astype(bfloat16)
    return out


def _read_mxfp4(reader: _Reader, checkpoint: Checkpoint, name: str, want: tuple[int, ...], what: str) -> np.ndarray:
    """The MXFP4 weight `name` (its _blocks and _scales) dequantized to the stored shape `want`."""
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
    return dequantize_mxfp4(*arrays)


def _transform(value: np.ndarray, source: Source) -> np.ndarray:
    if source.part is not None:
        axis = source.parts_axis % value.ndim
        n = value.shape[axis] // 2
        index = slice(source.part, None, 2) if source.interleaved else slice(source.part * n, (source.part + 1) * n)
        value = value[(slice(None),) * axis + (index,)]
    return np.swapaxes(value, -1, -2) if source.transpose else value


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


def _stored(reader: _Reader, checkpoint: Checkpoint, name: str, scale: str | None, want: tuple[int, ...],
            source: Source, what: str) -> np.ndarray:
    """One checkpoint tensor as stored (an MXFP4 one dequantized), after checking its shape
    and dtype against `want`."""
    if source.mxfp4:
        return _read_mxfp4(reader, checkpoint, name, want, what)
    file = checkpoint.files[name]
    dtype, shape = reader.meta(name, file)
    if tuple(shape) != want:
        raise CheckpointError(f"{file}: tensor '{name}' has shape {_shape(shape)}, expected {_shape(want)} ({what})")
    if dtype.startswith("F8"):
        fp8_weight(name, file, dtype, scale if scale in checkpoint.files else None)
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{file}: tensor '{name}' is {dtype}, expected a float tensor "
                              f"({', '.join(FLOAT_DTYPES)}) for {what}")
    return reader.read(name, file)


def load_layer(checkpoint: Checkpoint, family: Family, layer: int, fn: func.FuncOp) -> dict[str, np.ndarray]:
    """Graph argument name -> its weights from layer `layer`, in the declared shape and dtype."""
    check_layer(checkpoint, family, layer)
    types = dict(zip(arg_names(fn), fn.function_type.inputs.data))
    declared = {name: t for name, t in types.items() if isinstance(t, TensorType)}
    prefix, layout = _choose(checkpoint, family, layer, declared)
    weights: dict[str, np.ndarray] = {}
    fused: dict[str, np.ndarray] = {}  # a fused gate_up tensor feeds two arguments: read it once
    with _reader() as reader:
        for arg, source in layout.arguments.items():
            if arg not in declared:
                raise CheckpointError(f"graph '{fn.sym_name.data}' has no argument '{arg}', which the "
                                      f"{family.name} table fills from '{prefix}.{source.tensor}'")
            t = declared[arg]
            what = f"argument '{arg}' {format_type(t)} of {family.program}"
            want = source.stored_shape(shape_of(t))
            names = _names(source, prefix, shape_of(t)[0])
            scales = _names(Source(source.scale), prefix, shape_of(t)[0]) if source.scale else [None] * len(names)
            parts = []
            for name, scale in zip(names, scales):
                if source.part is None:
                    stored = _stored(reader, checkpoint, name, scale, want, source, what)
                else:
                    if name not in fused:
                        fused[name] = _stored(reader, checkpoint, name, scale, want, source, what)
                    stored = fused[name]
                parts.append(_transform(stored, source))
            value = np.stack(parts) if source.per_expert else np.ascontiguousarray(parts[0])
            try:
                weights[arg] = to_declared(arg, value, t)
            except InputError as e:  # cannot happen after the shape check, unless the table is wrong
                raise CheckpointError(f"{prefix}: {e}") from None
    return weights


@dataclass
class LayerWeights:
    """What `tcpc run --weights` feeds the simulation: the program compiled with the
    checkpoint's dims and the layer's weights by argument name."""

    program: Program
    weights: dict[str, np.ndarray]
    family: Family
    dims: dict[str, int]
    """The dims that came from config.json."""

    def describe(self, checkpoint: Checkpoint, layer: int) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.dims.items())
        return (f"weights: layer {layer} of {checkpoint.path} ({self.family.name}: {', '.join(self.weights)}"
                + (f"; dims {dims} from {checkpoint.config_path}" if dims else "") + ")")


def compile_with_weights(file: str | Path, checkpoint: Checkpoint, layer: int, overrides: Mapping[str, int],
                         graph: str | None = None, **choose_for: Any) -> LayerWeights:
    """Compile `file` with the checkpoint's dims (`overrides`, from --set, win) and read the
    layer's weights for `graph` (default: the first); `choose_for` goes to compile_file (the
    machine, routing and seed block=auto is chosen for)."""
    names = compile_file(file, overrides, **choose_for)
    graph_name = names.function(graph).sym_name.data
    family = find_family(checkpoint, graph_name)
    dims = {k: v for k, v in config_dims(checkpoint, family, overrides).items() if k in names.dims}
    program = compile_file(file, {**dims, **overrides}, **choose_for)
    return LayerWeights(program, load_layer(checkpoint, family, layer, program.function(graph_name)), family, dims)
