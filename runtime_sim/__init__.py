"""The tcpc runtime: numpy semantics for every dialect, run by xDSL's interpreter.

The graph-level semantics here are the reference that every lowering is checked against.
"""
