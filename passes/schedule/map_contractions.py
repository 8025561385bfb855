"""`map-contractions`: every contraction command placed on its cluster's Slice, Lane, Time and
Packet, the cheapest legal mapping by the book's cost of each stage.

The schedule level fixes what each `tcp.contract` and `tcp.scaled_contract` computes; this pass
fixes how the contraction engine runs it (target/contraction_mapping.py: the rules, the stage
costs, the candidates and the deterministic choice), reading the machine from the module's
target, and records it as the op's `mapping`:

    %y = tcp.contract "gbd,gdf->gbf" %x, %w : ... {mapping = #tcp.mapping<trf = lhs,
         slices = [1, 4, 64], lanes = 8, broadcast = 4, packet = 32, k_chunk = 512, trf_mode = half>}

A mapping already on an op (hand-written IR) is kept and checked against the target: a rule it
breaks (more slices than a cluster has, a packet wider than 64 bytes, a stationary operand the
TRF cannot hold, ...) fails the pass with the op, the numbers and the limit. The values never
depend on the mapping; only the cycles do (runtime_sim/perf/tcp_cost.py costs the attribute).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import PassFailedException

from dialects import tcp
from target.contraction_mapping import ContractionShape, Mapping, MappingError, check, choose
from target.machine import Machine
from target.target_spec import machine_of


def mapping_attr(mapping: Mapping) -> tcp.MappingAttr:
    """The IR's form of a chosen mapping."""
    return tcp.MappingAttr.make(mapping.engine, mapping.trf, mapping.slices, mapping.lanes, mapping.broadcast,
                                mapping.packet, mapping.k_chunk, mapping.trf_mode)


def map_contraction(inner: tcp.ContractOp | tcp.ScaledContractOp, machine: Machine,
                    chosen_for: dict[ContractionShape, tcp.MappingAttr] | None = None) -> None:
    """Give `inner`, which has no mapping, the cheapest legal one (`chosen_for`: those chosen
    so far, by shape)."""
    shape = ContractionShape.of(inner.roles())
    chosen = None if chosen_for is None else chosen_for.get(shape)
    if chosen is None:
        chosen = mapping_attr(choose(shape, machine).best.mapping)
        if chosen_for is not None:
            chosen_for[shape] = chosen
    # before the other attributes: the phase and cluster stay last on the line
    inner.attributes = {"mapping": chosen, **inner.attributes}


@dataclass(frozen=True)
class MapContractionsPass(ModulePass):
    """Give every contraction without a mapping the cheapest legal one; check the others."""

    name = "map-contractions"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        machine = machine_of(op)
        chosen_for: dict[ContractionShape, tcp.MappingAttr] = {}  # an unrolled loop repeats a few shapes
        for inner in op.walk():
            if not isinstance(inner, tcp.ContractOp | tcp.ScaledContractOp):
                continue
            if inner.mapping is None:
                map_contraction(inner, machine, chosen_for)
                continue
            roles = inner.roles()
            shape = ContractionShape.of(roles)
            try:
                check(Mapping(**inner.mapping.fields()), shape, machine)  # type: ignore[arg-type]
            except MappingError as e:
                sizes = ", ".join(f"{letters}={getattr(roles, role)}" for role, letters in roles.letters.items())
                raise PassFailedException(f"map-contractions: {inner.name} ({sizes}) on {machine.name}: {e}") from None
