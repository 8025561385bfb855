"""Every cost model the simulator knows, registered through one explicit list.

Like `runtime_sim.semantics.executor.SEMANTICS` for what ops compute, `COST_MODELS` says where
the cost of every op comes from: a dialect with costs of its own adds its registration
function here. The simulator registers them (once) before it costs anything.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from runtime_sim.perf.ccl_cost import register_ccl_costs
from runtime_sim.perf.cost_model import register_builtin_costs
from runtime_sim.perf.tcp_cost import register_tcp_costs
from runtime_sim.perf.tile_cost import register_tile_costs
from runtime_sim.perf.ve_cost import register_ve_costs

COST_MODELS: list[Callable[[], object]] = [
    register_builtin_costs,
    register_tcp_costs,
    register_ve_costs,
    register_tile_costs,
    register_ccl_costs,
]
"""Each registers the costs of one dialect's ops (cost_model.register_cost and friends)."""


@cache
def register_cost_models() -> None:
    """Register every cost model of `COST_MODELS`, once per process."""
    for register in COST_MODELS:
        register()
