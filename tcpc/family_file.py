"""A checkpoint family a user declares: a TOML file (`tcpc run --weights PATH --family FILE`)
holding the same table as a built-in family of tcpc/checkpoint_families.py, for a model tcpc
has no table for (docs/checkpoints.md shows OLMoE's, examples/families/olmoe.toml).

Top-level keys are the Family's (`name`, `model_types`, `prefixes`, optional `layers_key` and
`config_section`); `[programs]` maps graph names to their program files; each `[[layouts]]` has
a `name` and `[layouts.arguments]`, one inline table per graph argument with the fields of a
Source (`tensor`, `transpose`, `part`, `parts_axis`, `interleaved`, `mxfp4`, `scale`); `[keys]`
has one table per config.json key (`default`, absent for a required size; `aliases`); `[dims]`
maps a dim to a key's name or to a list of names (their product); `[moe_layer]` is a
MoeLayers (`first`, `step`, `offset`, `dense`, `listed`; absent: every layer); each
`[[requirements]]` has `key`, `expected` and `why`. Every mistake is a CheckpointError naming
the file and the key.
"""

from __future__ import annotations

import json
import string
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tcpc.checkpoint_families import REQUIRED, ConfigKey, Family, Layout, MoeLayers, Product, Requirement, Source
from tcpc.checkpoints import CheckpointError

_MISSING: Any = object()


def _kind(value: Any) -> str:
    return "a table" if isinstance(value, dict) else json.dumps(value, default=str)


class _Table:
    """One TOML table being read: each key taken once, checked against what it may be; the
    keys left over are unknown."""

    def __init__(self, path: Path, where: str, data: Any):
        self.path, self.where = path, where
        if not isinstance(data, dict):
            raise self.error(f"expected a table, got {_kind(data)}")
        self.data = data
        self.taken: set[str] = set()

    def error(self, message: str, key: str | None = None) -> CheckpointError:
        at = f"{self.where}.{key}" if self.where and key else key or self.where
        return CheckpointError(f"{self.path}: {at}: {message}" if at else f"{self.path}: {message}")

    def get(self, key: str, what: str, ok: Callable[[Any], bool], default: Any = _MISSING) -> Any:
        """The value of `key` if `ok(value)`, else an error saying it should be `what`."""
        self.taken.add(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.error(f"missing ({what})", key)
            return default
        value = self.data[key]
        if not ok(value):
            raise self.error(f"expected {what}, got {_kind(value)}", key)
        return value

    def text(self, key: str, default: Any = _MISSING) -> Any:
        return self.get(key, "a string", lambda v: isinstance(v, str) and v != "", default)

    def texts(self, key: str) -> tuple[str, ...]:
        return tuple(self.get(key, "a list of strings", lambda v: isinstance(v, list) and bool(v)
                              and all(isinstance(x, str) and x for x in v)))

    def flag(self, key: str) -> bool:
        return self.get(key, "true or false", lambda v: isinstance(v, bool), False)

    def table(self, key: str, default: Any = _MISSING) -> _Table:
        value = self.get(key, "a table", lambda v: isinstance(v, dict), default)
        return _Table(self.path, f"{self.where}.{key}" if self.where else key, value)

    def tables(self, key: str, default: Any = _MISSING) -> list[_Table]:
        items = self.get(key, "an array of tables ([[...]])", lambda v: isinstance(v, list) and bool(v)
                         and all(isinstance(x, dict) for x in v), default)
        return [_Table(self.path, f"{key}[{i}]", item) for i, item in enumerate(items)]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.taken)
        if unknown:
            raise self.error(f"unknown key (known here: {', '.join(sorted(self.taken))})", unknown[0])


def _fields_of(template: str, allowed: set[str]) -> bool:
    """Whether `template`'s {fields} are all in `allowed` (and it is a valid format string)."""
    try:
        return all(f is None or f in allowed for _, f, _, _ in string.Formatter().parse(template))
    except ValueError:
        return False


def _source(t: _Table) -> Source:
    tensor = t.get("tensor", "a tensor name under the prefix ({e}: one per expert)",
                   lambda v: isinstance(v, str) and v != "" and _fields_of(v, {"e"}))
    scale = t.get("scale", "a tensor name ({e} as in tensor)",
                  lambda v: isinstance(v, str) and v != "" and _fields_of(v, {"e"}) and ("{e}" in v) == ("{e}" in tensor),
                  None)
    part = t.get("part", "0 (the gate) or 1 (the up projection)", lambda v: v in (0, 1) and not isinstance(v, bool), None)
    axis = t.get("parts_axis", "an axis (an integer)", lambda v: isinstance(v, int) and not isinstance(v, bool), -1)
    source = Source(tensor, transpose=t.flag("transpose"), part=part, parts_axis=axis,
                    interleaved=t.flag("interleaved"), mxfp4=t.flag("mxfp4"), scale=scale)
    t.done()
    if (source.interleaved or "parts_axis" in t.data) and part is None:
        raise t.error("interleaved and parts_axis describe a fused tensor's part: give part too", "part")
    return source


def _key(name: str, t: _Table) -> ConfigKey:
    default = t.get("default", "transformers' default (a string, number, boolean or list)",
                    lambda v: isinstance(v, str | int | float | bool | list), REQUIRED)
    aliases = tuple(t.get("aliases", "a list of strings", lambda v: isinstance(v, list)
                          and all(isinstance(x, str) and x for x in v), []))
    t.done()
    return ConfigKey(name, default, aliases)


def _moe_layer(t: _Table) -> MoeLayers:
    def number_or_key(v: Any) -> bool:
        return isinstance(v, str) and v != "" or isinstance(v, int) and not isinstance(v, bool) and v >= 0

    rule = MoeLayers(first=t.get("first", "a layer (an integer) or a config key", number_or_key, 0),
                     step=t.get("step", "a positive integer or a config key",
                                lambda v: number_or_key(v) and v != 0, 1),
                     offset=t.get("offset", "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool), 0),
                     dense=t.text("dense", None), listed=t.text("listed", None))
    t.done()
    return rule


def load_family(path: str | Path) -> Family:
    """The family a TOML file declares, checked as the built-in tables are."""
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: {(e.strerror or str(e)).lower()}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid TOML ({e})") from None
    top = _Table(path, "", data)
    name = top.text("name")
    model_types = top.texts("model_types")
    prefixes = tuple(top.get("prefixes", "a list of tensor-name prefixes with {layer}", lambda v: isinstance(v, list)
                             and bool(v) and all(isinstance(x, str) and "{layer}" in x and _fields_of(x, {"layer"})
                                                 for x in v)))
    programs_table = top.table("programs")
    programs = {graph: programs_table.text(graph) for graph in programs_table.data}
    programs_table.done()
    if not programs:
        raise top.error("missing (graph name = its program file)", "programs")
    layouts = []
    for t in top.tables("layouts"):
        arguments = t.table("arguments")
        layout = Layout(t.text("name"), {arg: _source(arguments.table(arg)) for arg in arguments.data})
        arguments.done()
        t.done()
        if not layout.arguments:
            raise t.error("missing (graph argument = its tensor)", "arguments")
        layouts.append(layout)
    keys_table = top.table("keys")
    keys = tuple(_key(key, keys_table.table(key)) for key in keys_table.data)
    keys_table.done()
    dims_table = top.table("dims")
    dims = {dim: dims_table.get(dim, "a config key or a list of them (their product)",
                                lambda v: isinstance(v, str) and v != "" or isinstance(v, list) and bool(v)
                                and all(isinstance(x, str) and x for x in v)) for dim in dims_table.data}
    dims_table.done()
    moe_layer = _moe_layer(top.table("moe_layer", {}))
    requirements = []
    for t in top.tables("requirements", []):
        requirements.append(Requirement(t.text("key"), t.get("expected", "the value the program needs", lambda v: True),
                                        t.text("why")))
        t.done()
    layers_key = top.text("layers_key", "num_hidden_layers")
    config_section = top.text("config_section", None)
    top.done()
    try:
        return Family(name=name, model_types=model_types, programs=programs, prefixes=prefixes, layouts=tuple(layouts),
                      keys=keys, dims={d: v if isinstance(v, str) else Product(tuple(v)) for d, v in dims.items()},
                      moe_layer=moe_layer, requirements=tuple(requirements), config_section=config_section,
                      layers_key=layers_key)
    except ValueError as e:  # a key named but not declared
        raise CheckpointError(f"{path}: {e}") from None

