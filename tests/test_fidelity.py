"""The furiosa-opt book's worked figures (tcpc/fidelity.py), each within 5% when tcpc computes it
with the cost functions the simulator uses, and the switch engine's formula
(target/switch_engine.py) on the inputs it must refuse."""

from __future__ import annotations

import re

import pytest

from target.machine import default_machine
from target.switch_engine import flits_per_packet, switch_cycles
from tcpc import docgen
from tcpc.fidelity import FIGURES, TOLERANCE, BookFigure

MACHINE = default_machine()


@pytest.mark.parametrize("figure", FIGURES, ids=[f.name for f in FIGURES])
def test_the_book_figure_is_reproduced(figure: BookFigure) -> None:
    assert re.fullmatch(r"[a-z-]+(/[a-z0-9-]+)+\.md, .+", figure.chapter), "chapter: `part/chapter.md, section`"
    assert abs(figure.computed(MACHINE) - figure.book) / figure.book <= TOLERANCE


def test_the_table_lists_every_figure_with_its_error() -> None:
    table = docgen.render()["fidelity.md"]
    for figure in FIGURES:
        assert f"| {figure.name} | {figure.chapter} | {docgen._figure(figure.book)} |" in table
    assert f"{len(FIGURES)} figures, largest error" in table


def test_a_switch_costs_ring_size_times_time_times_flits() -> None:
    # A packet that is not a whole number of 32-byte flits still takes its last flit whole.
    assert [flits_per_packet(n, MACHINE) for n in (1, 32, 33, 256)] == [1, 1, 2, 8]
    assert switch_cycles(1, 5, 40, MACHINE) == 1 * 5 * 2
    for ring_size, message in ((3, "ring_size 3"), (512, "ring_size 512"), (0, "ring_size 0")):
        with pytest.raises(ValueError, match=f"switch {message}: it must be a power of two dividing the 256 slices"):
            switch_cycles(ring_size, 8, 32, MACHINE)
    with pytest.raises(ValueError, match="over 0 time steps"):
        switch_cycles(4, 0, 32, MACHINE)
    with pytest.raises(ValueError, match="packet of 0 bytes"):
        switch_cycles(4, 8, 0, MACHINE)
