"""Load a script of benchmarks/ (not a package) as a module, for the tests of its functions."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module `tcpc_benchmark_NAME` (registered, so dataclasses work)."""
    spec = importlib.util.spec_from_file_location(f"tcpc_benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
