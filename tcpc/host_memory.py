"""Whether a run with values fits in this computer's memory, decided before anything is allocated.

The interpreter keeps every value of a function alive until it returns, so a run needs at least
the bytes of its arguments plus the bytes of every op result it computes (views included: an
estimate from the IR cannot tell which numpy returns without a copy). A run that needs more
than the memory available would swap or be killed mid-way; it is refused up front with the
estimate, and `--cost-only` (no values) is the way to cost such sizes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Attribute

from runtime_sim.semantics.numerics import tensor_dtype


class ResourceError(Exception):
    """A run this computer cannot hold; the message gives the estimate and the limit."""


@dataclass(frozen=True)
class RunFootprint:
    """What a run of one function keeps alive: its arguments and its op results, in bytes."""

    argument_bytes: int
    result_bytes: int
    ops: int

    @property
    def total(self) -> int:
        return self.argument_bytes + self.result_bytes


def value_bytes(t: Attribute) -> int:
    """The bytes a value of type `t` takes as a numpy array (0 for non-tensors, such as the
    routing plan, whose arrays are counted where they are made)."""
    if not isinstance(t, TensorType):
        return 0
    try:
        itemsize = tensor_dtype(t).itemsize
    except ValueError:  # an element type without a numpy dtype: count its bits
        itemsize = max(1, math.ceil(getattr(t.get_element_type(), "bitwidth", 32) / 8))
    return math.prod(max(d, 0) for d in t.get_shape()) * itemsize


def footprint(module: ModuleOp, function: str) -> RunFootprint:
    """The bytes a run of `function` (and the functions it calls) keeps alive."""
    from runtime_sim.perf.simulate import reachable_functions
    from runtime_sim.semantics.executor import function_named

    entry = function_named(module, function)
    arguments = sum(value_bytes(t) for t in entry.function_type.inputs.data)
    results, ops = 0, 0
    for fn in reachable_functions(module, entry):
        for op in fn.walk():
            if op is fn or isinstance(op, func.ReturnOp):
                continue
            ops += 1
            results += sum(value_bytes(r.type) for r in op.results)
    return RunFootprint(arguments, results, ops)


def available_bytes() -> int | None:
    """The memory this computer can give a new allocation now (Linux: MemAvailable), else its
    physical memory, or None when neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB", "EB"):
        if n < 1000 or unit == "EB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_fits(module: ModuleOp, function: str, what: str, available: int | None = None) -> RunFootprint:
    """Raise ResourceError when running `function` with values needs more memory than is
    available (`available`, or what this computer reports)."""
    need = footprint(module, function)
    limit = available_bytes() if available is None else available
    if limit is not None and need.total > limit:
        raise ResourceError(
            f"{what} needs at least {human_bytes(need.total)} of memory for its values "
            f"(arguments {human_bytes(need.argument_bytes)}, results of {need.ops:,} ops "
            f"{human_bytes(need.result_bytes)}), more than the {human_bytes(limit)} this computer has available; "
            "--cost-only computes the cycles without values"
        )
    return need
