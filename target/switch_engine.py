"""The switch engine's cost (book, Computing Tensors, "Switch Engine", Performance).

The switch engine moves data between the slices of a cluster around a ring of its slices, cut
into slices / ring_size sub-rings that all advance in parallel. A switch takes about

    ring_size x Time::SIZE x flits_per_packet cycles

for the whole cluster: one flit crosses a sub-ring in ring_size cycles, once per time step of
the input and once per flit of its packet, a flit being the machine's `vector.flit_bytes`
(32 B on RNGD) and flits_per_packet = ceil(packet bytes / flit bytes), the packet's bytes
being its element size x Packet::SIZE. tcpc/fidelity.py checks every estimate the chapter
works out (96 to 16,384 cycles) against this function.

Pure formulas over a `Machine`, no IR: the contraction mapping model costs the switches a
mapping needs with it.
"""

from __future__ import annotations

from target.machine import Machine


def flits_per_packet(packet_bytes: int, machine: Machine) -> int:
    """Flits a packet of `packet_bytes` takes through the switch (a partial flit is a flit)."""
    if packet_bytes < 1:
        raise ValueError(f"a switch packet of {packet_bytes} bytes: it must be at least 1")
    return -(-packet_bytes // machine.flit_bytes)


def switch_cycles(ring_size: int, time_steps: int, packet_bytes: int, machine: Machine) -> int:
    """Cycles of one switch over sub-rings of `ring_size` slices (a power of two dividing the
    cluster's slices; 1 forwards each slice's data unchanged) of an input with `time_steps`
    time steps (Time::SIZE) and packets of `packet_bytes` bytes."""
    if ring_size < 1 or ring_size & (ring_size - 1) or machine.slices % ring_size:
        raise ValueError(f"switch ring_size {ring_size}: it must be a power of two dividing the "
                         f"{machine.slices} slices of a cluster")
    if time_steps < 1:
        raise ValueError(f"a switch over {time_steps} time steps: it must be at least 1")
    return ring_size * time_steps * flits_per_packet(packet_bytes, machine)
