"""The tcpc runtime, in two layers.

- `runtime_sim.semantics`: what every op computes, on numpy, run by xDSL's interpreter. The
  graph-level semantics there are the reference every lowering is checked against.
- `runtime_sim.perf`: what every op costs on the machine model, and the simulator built on it
  (scheduler, memory plan, reports, traces, cost-only runs). It depends on the semantics; the
  semantics never depend on it.
"""
