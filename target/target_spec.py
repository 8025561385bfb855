"""The machine in the IR: a module's `dlti.target_system_spec`, as MLIR's DLTI target specs
carry a target's properties (https://mlir.llvm.org/docs/Dialects/DLTIDialect/).

The driver attaches the machine it compiles for to the module (`attach`); every pass reads its
SRAM, clusters, slices, DMA and vector figures from there (`machine_of`), so a program is
tiled for the machine it names, and the printed IR says which. The device's entries are the
machine file's own keys (`"sram.bytes_per_slice" = 524288 : i64`), plus its `"name"`. IR
without the attribute (hand-written, or from before this attribute) compiles for the default
machine, RNGD.
"""

from __future__ import annotations

from functools import cache

from xdsl.dialects.builtin import ArrayAttr, Float64Type, FloatAttr, IntegerAttr, ModuleOp, StringAttr, i64
from xdsl.dialects.dlti import DataLayoutEntryAttr, TargetDeviceSpecAttr, TargetSystemSpecAttr
from xdsl.ir import Attribute, Operation

from target.machine import SCHEMA, Machine, MachineError, default_machine

TARGET_ATTR = "dlti.target_system_spec"
"""The module attribute that holds the target system (MLIR's DLTI name for it)."""
DEVICE = "tcp"
"""The device id of the chip in the target system spec."""


def device_spec(machine: Machine) -> TargetDeviceSpecAttr:
    """The machine's numbers as a DLTI device spec, keyed as in the machine file."""
    entries: dict[str, Attribute] = {"name": StringAttr(machine.name)}
    for name, f in SCHEMA.items():
        value = getattr(machine, name)
        entries[f.dotted] = IntegerAttr(value, i64) if f.integer else FloatAttr(float(value), Float64Type())
    return TargetDeviceSpecAttr(entries)


def attach(module: ModuleOp, machine: Machine) -> None:
    """Make `machine` the module's target (replacing any target it had)."""
    module.attributes[TARGET_ATTR] = TargetSystemSpecAttr({DEVICE: device_spec(machine)})


def machine_of(op: Operation) -> Machine:
    """The machine the module holding `op` targets; the default machine when it names none."""
    top = op
    while (parent := top.parent_op()) is not None:
        top = parent
    spec = top.attributes.get(TARGET_ATTR)
    if spec is None:
        return default_machine()
    if not isinstance(spec, TargetSystemSpecAttr):
        raise MachineError(f"{TARGET_ATTR}: expected #dlti.target_system_spec<...>, got {spec}")
    try:
        device = spec[DEVICE]
    except KeyError:
        raise MachineError(f"{TARGET_ATTR}: no device \"{DEVICE}\"") from None
    if not isinstance(device, TargetDeviceSpecAttr):
        raise MachineError(f"{TARGET_ATTR} \"{DEVICE}\": expected #dlti.target_device_spec<...>")
    return _machine(device.entries)


@cache
def _machine(entries: ArrayAttr[DataLayoutEntryAttr]) -> Machine:
    """The machine of a device spec's entries, cached by them: an ArrayAttr compares by value,
    while xDSL 0.74's DLTI attributes compare (and hash) equal whatever their entries."""
    device = TargetDeviceSpecAttr(entries)
    values: dict[str, int | float] = {}
    for name, f in SCHEMA.items():
        key = f.dotted
        try:
            entry = device[key]
        except KeyError:
            raise MachineError(f"{TARGET_ATTR} \"{DEVICE}\": no \"{key}\"") from None
        if not isinstance(entry, IntegerAttr | FloatAttr):
            raise MachineError(f"{TARGET_ATTR} \"{DEVICE}\": \"{key}\" is not a number")
        value = entry.value.data
        if not value >= f.minimum or value > f.maximum or f.integer and not isinstance(value, int):
            raise MachineError(f"{TARGET_ATTR} \"{DEVICE}\": \"{key}\" = {value} is out of range")
        values[name] = value
    name = device["name"] if any(e.key == StringAttr("name") for e in device.entries) else None
    return Machine(name=name.data if isinstance(name, StringAttr) else "target", description="the IR's target",
                   **values)  # type: ignore[arg-type]
