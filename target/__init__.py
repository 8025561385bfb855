"""The machine tcpc compiles for and simulates: machine files, their loading and validation,
and the machine attached to the IR. The lowest layer, beside `dialects`: passes and the
simulator read the same object."""
