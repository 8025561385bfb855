"""bf16 vs fp8 vs MXFP4 expert weights, at real dims, decode and prefill, cost-only.

    python benchmarks/precisions.py            # the table (9-17 minutes on 2 shared cores): precisions.md
    python benchmarks/precisions.py --quick    # T = 1 only; writes the file only with --out
    python benchmarks/precisions.py --out DIR
    python benchmarks/precisions.py --tokens 1 64   # chosen token counts
    python benchmarks/precisions.py --formats fp4_groups trellis3 --tokens 1 2048   # the seed's formats
    python benchmarks/precisions.py --tokens 1 --family qwen3   # and families

For DeepSeek-V3, Qwen3-30B-A3B and gpt-oss-120b, each in three formats:

- `bf16`: the bf16 example (examples/deepseek_v3.moe, qwen3_moe.moe, gpt_oss.moe);
- `fp8`: f8e4m3 weights with f32 block scales and activations quantized per token group
  (examples/deepseek_v3_fp8.moe and qwen3_moe_fp8.moe: 128 x 128 blocks, groups of 128, the
  checkpoints' layout). gpt-oss has no fp8 checkpoint and 2880 is no multiple of 128: its fp8
  variant is examples/gpt_oss_mxfp4.moe with the weights declared f8e4m3, f32 scales and
  64 x 64 blocks, groups of 64 (written by `variant` below);
- `mxfp4`: f4e2m1 weights with e8m0 scales per 32 along the reduction axis and activations in
  f8e4m3 groups of 32 (examples/gpt_oss_mxfp4.moe, gpt-oss's checkpoint; DeepSeek-V3's and
  Qwen3's MXFP4 variants are their fp8 examples with the weights declared f4e2m1 and e8m0
  scales, `variant` below). The shared expert of DeepSeek-V3 takes its routed experts' format.

Two more formats, the seed document's on quantized MoE kernels, for Qwen3-30B-A3B (their
examples use Qwen3's routing), with bf16 activations and the weights decoded to bf16 block by
block: `fp4_groups` (f4e2m1 with a bf16 scale per group of 128 along K,
examples/qwen3_moe_fp4_groups.moe) and `trellis3` (3-bit codes in 16 x 16 tiles, an 8-entry
grid, bf16 scales per group of 128 and bf16 sign vectors, examples/qwen3_moe_trellis3.moe).
`--formats` computes only the formats named (with bf16, their ratio's reference) and, writing,
replaces that run's own section of precisions.md, so the file says which rows come from which
run.

Each is compiled with the full pipeline and simulated cost-only with balanced routing, at
T = 1 and 64 (decode) and 2048 and 4096 (prefill), the block size B chosen by the compiler (`block=auto`,
tcpc/autotune.py: the candidate of fewest simulated cycles with balanced routing; column `B`;
`--block rule` takes benchmarks/run.py's rule instead), lower-topk's strategy chosen by the
cost model (`strategy=auto`: each strategy simulated, the fewer cycles kept; column `top-k`),
as benchmarks/schedule.py does. Columns: simulated
time; its ratio to the bf16 layer's; the chip limit of the format, computed here from the
layer's FLOPs at the format's peak (the experts' contractions at the fp8 rate for fp8 and
MXFP4, the rest at bf16's) and its minimal HBM bytes at HBM bandwidth (the weights of the
experts balanced routing uses, at their stored width with their scales (and the trellis
format's sign vectors), the router's, the shared expert's, the tokens in and out; the seed's
formats contract in bf16, so their limit takes bf16's rate), on the simulated machine (the whole chip); the simulated time over that limit;
the format's scales floor, that limit with the experts' block-scaled contractions at the rate
of the vector engine that scales their f32 partial sums where it is slower than the MACs (one
pass per K-block of each result, 4 a cycle per slice against 512 fp8 MACs: MXFP4's blocks of
32 take 4x the MAC time, gpt-oss's fp8 blocks of 64 2x, blocks of 128 1x; docs/passes.md,
lower-quant); for the seed's formats, that limit with every weight of the experts balanced
routing uses decoded once on the vector engine beside the contractions (one pass of its
chain per weight, f32 multiplies by scale (and signs) at `float_ways` a cycle per slice, on
the tensor unit the contractions also take: the two add), and the contractions no faster
than fetching each decoded bf16 weight once (32 B a cycle per slice), which no schedule beats without
changing the program's arithmetic, and the simulated time over it; the HBM bytes the simulation moved (the layer's own
commands); the critical path split into experts and the rest; and the weight stream's stages
(the issue's "show stage by stage why"): when the first expert weight load starts (everything
before it is the router, top-k and routing, on the critical path before the first weight
byte), how long the loads take from the first one's start to the last one's end against the
weights' bytes at HBM bandwidth (`stream` / `HBM`), and what follows the last load (the last
block's contractions, its store, the combine).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import tcpc  # noqa: E402
from runtime_sim.perf.cost_only import simulate_cost_only  # noqa: E402
from target.machine import Machine, load_machine  # noqa: E402
from tcpc.pipelines import apply_pipeline  # noqa: E402


if str(ROOT / "benchmarks") not in sys.path:  # run.py, the model table, next to this script
    sys.path.insert(0, str(ROOT / "benchmarks"))

import run as bench  # noqa: E402

EXAMPLES = ROOT / "examples"
TOKENS: tuple[int, ...] = (1, 64, 2048, 4096)
QUICK_TOKENS: tuple[int, ...] = (1,)
FORMATS: tuple[str, ...] = ("bf16", "fp8", "mxfp4")
SEED_FORMATS: tuple[str, ...] = ("fp4_groups", "trellis3")
"""The formats of the seed document on quantized MoE kernels (not in the default table)."""
TARGETS = {"fp8": 0.55, "mxfp4": 0.30}
"""Decode targets (issue 14): the format's simulated time over bf16's."""


@dataclass(frozen=True)
class Family:
    title: str
    dims: dict[str, int]
    """The real model's dims (every dim but T, B and the block sizes)."""
    shared: int
    """Width of the shared expert (0: none)."""
    router_bytes: int
    """Bytes per router weight (f32 for DeepSeek-V3's, bf16 otherwise)."""
    sources: dict[str, tuple[str, dict[str, int]]]
    """Format -> (example stem, the block dims it is compiled with)."""


FP8_BLOCKS = dict(QK=128, QN=128, QG=128)
MX_BLOCKS = dict(QK=32, QN=1, QG=32)
SEED_GROUPS = dict(GS=128)
"""The seed formats' scale group along K (the dim `GS` of their examples)."""
FAMILIES: tuple[Family, ...] = (
    Family("DeepSeek-V3", dict(D=7168, F=2048, FS=2048, E=256, K=8, NG=8, TG=4), 2048, 4,
           {"bf16": ("deepseek_v3", {}), "fp8": ("deepseek_v3_fp8", FP8_BLOCKS), "mxfp4": ("deepseek_v3_fp8", MX_BLOCKS)}),
    Family("Qwen3-30B-A3B", dict(D=2048, F=768, E=128, K=8), 0, 2,
           {"bf16": ("qwen3_moe", {}), "fp8": ("qwen3_moe_fp8", FP8_BLOCKS), "mxfp4": ("qwen3_moe_fp8", MX_BLOCKS),
            "fp4_groups": ("qwen3_moe_fp4_groups", SEED_GROUPS), "trellis3": ("qwen3_moe_trellis3", SEED_GROUPS)}),
    Family("gpt-oss-120b", dict(D=2880, F=2880, E=128, K=4), 0, 2,
           {"bf16": ("gpt_oss", {}), "fp8": ("gpt_oss_mxfp4", dict(QK=64, QN=64, QG=64)), "mxfp4": ("gpt_oss_mxfp4", MX_BLOCKS)}),
)

STORED = {"bf16": "bf16", "fp8": "f8e4m3", "mxfp4": "f4e2m1"}
SCALE = {"fp8": "f32", "mxfp4": "e8m0"}
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp4": 0.5, "fp4_groups": 0.5, "trellis3": 3 / 8}
SCALE_BYTES = {"bf16": 0.0, "fp8": 4.0, "mxfp4": 1.0, "fp4_groups": 2.0, "trellis3": 2.0}
SIGN_BYTES = {"trellis3": 2}
"""Bytes per element of a format's sign vectors (su along K, sv along N, per expert matrix)."""
FP8_RATE = ("fp8", "mxfp4")
"""Formats whose experts contract at the fp8 rate."""


def variant(source: str, fmt: str) -> str:
    """A low-precision example's program with its weights (parameters whose name starts with
    `w`) declared in `fmt`'s stored type and their `*_scale` parameters in its scale type."""
    source = re.sub(r"\b(w\w*): (f8e4m3|f4e2m1)\[", lambda m: f"{m.group(1)}: {STORED[fmt]}[", source)
    return re.sub(r"\b(w\w*_scale): (f32|e8m0)\[", lambda m: f"{m.group(1)}: {SCALE[fmt]}[", source)


@dataclass
class Row:
    title: str
    fmt: str
    tokens: int
    block: int
    total_cycles: int
    limit_cycles: float
    hbm_bytes: int
    experts_cycles: int
    microseconds: float
    limit_microseconds: float
    seconds: float
    strategy: str = "rank"
    """lower-topk's strategy, chosen by the cost model."""
    first_load: int = 0
    """Cycle the first expert weight load (`tile.load_expert`) starts."""
    last_load: int = 0
    """Cycle the last one ends."""
    load_bytes: int = 0
    """HBM bytes the expert weight loads move."""
    floor_cycles: float = 0.0
    """The format's scales floor (`chip_limit(..., scales=True)`)."""
    bf16_cycles: int = 0

    @property
    def ratio(self) -> float:
        """Simulated time over the bf16 layer's."""
        return self.total_cycles / self.bf16_cycles

    @property
    def over_limit(self) -> float:
        return self.total_cycles / self.limit_cycles

    @property
    def over_floor(self) -> float:
        return self.total_cycles / self.floor_cycles


def chip_limit(machine: Machine, family: Family, fmt: str, tokens: int, blocks: dict[str, int],
               *, scales: bool = False) -> float:
    """Cycles of the format's chip limit (see the module docstring); with `scales`, its scales
    floor: the same, the block-scaled contractions of the experts (shared one included) at the
    slower of the fp8 MAC rate and their `vector scales` stage's (target/contraction_mapping.py:
    one f32 partial sum per K-block of the weights' block and the activations' group, whichever
    is smaller, of each result, `float_ways` a cycle in every slice's vector engine); for the
    seed's formats, the contractions (no faster than their decoded bf16 weights fetched once,
    `fetch_bytes_per_cycle` in every slice) plus each weight decoded once (`float_ways` a cycle
    in every slice's vector engine, the same tensor unit)."""
    d = family.dims
    pairs = tokens * d["K"]
    used = min(d["E"], pairs)
    expert_weights = 3 * d["D"] * d["F"]
    shared_weights = 3 * d["D"] * family.shared
    scale_block = blocks.get("QK", 1) * blocks.get("QN", 1) * blocks.get("GS", 1) if fmt != "bf16" else 1
    per_weight = WEIGHT_BYTES[fmt] + SCALE_BYTES[fmt] / scale_block
    signs = used * 3 * (d["D"] + d["F"]) * SIGN_BYTES.get(fmt, 0)
    nbytes = ((used * expert_weights + shared_weights) * per_weight + signs + d["D"] * d["E"] * family.router_bytes
              + 2 * tokens * d["D"] * 2)
    expert_flops = 2 * (pairs * expert_weights + tokens * shared_weights)
    router_flops = 2 * tokens * d["D"] * d["E"]
    fast = 2 * machine.peak_fp8_macs_per_cycle if fmt in FP8_RATE else machine.peak_flops_per_cycle
    expert_cycles = expert_flops / fast
    if scales and fmt in FP8_RATE:
        k_block = min(blocks["QK"], blocks["QG"])
        expert_cycles = max(expert_cycles, expert_flops / 2 / k_block / (machine.float_ways * machine.slices))
    if scales and fmt in SEED_FORMATS:
        decoded = used * expert_weights + shared_weights
        fetched = decoded * 2 / (machine.fetch_bytes_per_cycle * machine.slices)
        expert_cycles = max(expert_cycles, fetched) + decoded / (machine.float_ways * machine.slices)
    flop_cycles = (expert_cycles + router_flops / machine.peak_flops_per_cycle) / machine.clusters
    return max(flop_cycles, nbytes / machine.hbm_bytes_per_cycle)


def precision_row(family: Family, fmt: str, tokens: int, machine: Machine, block: str = "auto") -> Row:
    """`family` in `fmt` at T = tokens; `block` "auto" lets the compiler choose B (`block=auto`,
    tcpc/autotune.py), "rule" takes run.py's (`block_size`)."""
    stem, blocks = family.sources[fmt]
    path = EXAMPLES / f"{stem}.moe"
    source = path.read_text()
    if fmt in FP8_RATE:
        source = variant(source, fmt)
    b: int | str = "auto" if block == "auto" else bench.block_size(tokens, family.dims["K"], family.dims["E"])
    dims = {**family.dims, **blocks, "T": tokens, "B": b}
    start = time.perf_counter()
    program = tcpc.compile_source(source, dims=dims, filename=str(path))
    chosen = next((int(c.chosen) for c in program.choices if c.what == "block"), None) if b == "auto" else b
    name = program.function().sym_name.data
    passes, choices = program.passes(pipeline_with_auto_topk(program.full_pipeline()), routing="balanced")
    module = apply_pipeline(program.module, passes)
    report = simulate_cost_only(module, name, routing="balanced").report
    strategy = next((str(c.chosen) for c in choices if c.what == "lower-topk strategy"), "rank")
    seconds = time.perf_counter() - start
    experts = next((p.critical_cycles for p in report.phases if p.name == "experts"), 0)
    limit = chip_limit(machine, family, fmt, tokens, blocks)
    loads = [o for o in report.ops if o.name == "tile.load_expert" and o.cycles]
    return Row(family.title, fmt, tokens, chosen if chosen is not None else program.dims["B"], report.total_cycles, limit, report.roofline.hbm_bytes, experts,
               report.microseconds, machine.cycles_to_us(limit), seconds, strategy,
               min((o.start for o in loads), default=0), max((o.end for o in loads), default=0),
               sum(o.hbm_bytes for o in loads), chip_limit(machine, family, fmt, tokens, blocks, scales=True))


def pipeline_with_auto_topk(pipeline: str) -> str:
    """`pin-routing` and `pipeline` with lower-topk's strategy left to the cost model
    (`strategy=auto`, resolved by tcpc/autotune.py) where the pipeline does not name one."""
    return ",".join(["pin-routing", *("lower-topk{strategy=auto}" if p == "lower-topk" else p for p in pipeline.split(","))])


def rows_for(tokens: Sequence[int], machine: Machine, block: str = "auto",
             formats: Sequence[str] = FORMATS, families: Sequence[str] = ()) -> list[Row]:
    """Each family's rows in `formats` (bf16 first, the reference of their ratio; families
    without a source for a format skip it, and skip the family if it has none), for the
    families whose title starts with one of `families` (case-insensitive; all when empty)."""
    rows: list[Row] = []
    for family in FAMILIES:
        if families and not any(family.title.lower().startswith(f.lower()) for f in families):
            continue
        mine = [f for f in dict.fromkeys(("bf16", *formats)) if f in family.sources]
        if mine == ["bf16"] and "bf16" not in formats:
            continue
        for t in tokens:
            group = [precision_row(family, fmt, t, machine, block) for fmt in mine]
            for row in group:
                row.bf16_cycles = group[0].total_cycles
            rows.extend(group)
    return rows


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(rows: Sequence[Row], machine: Machine) -> str:
    head = ["model", "T", "format", "B", "simulated µs", "x bf16", "target", "chip limit µs", "x limit",
            "scales floor µs", "x floor", "HBM MB",
            "experts µs", "rest µs", "first load µs", "stream µs", "HBM µs", "tail µs", "top-k"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i < 3 or i == len(head) - 1 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        target = f"<= {TARGETS[r.fmt]:.2f}" if r.fmt in TARGETS and r.tokens <= 64 else ""
        rest = r.total_cycles - r.experts_cycles
        lines.append(f"| {r.title} | {r.tokens} | {r.fmt} | {r.block} | {_num(r.microseconds)} | {r.ratio:.3f} | {target} | "
                     f"{_num(r.limit_microseconds)} | {r.over_limit:.2f} | "
                     f"{_num(machine.cycles_to_us(r.floor_cycles))} | {r.over_floor:.2f} | {r.hbm_bytes / 1e6:,.1f} | "
                     f"{_num(machine.cycles_to_us(r.experts_cycles))} | {_num(machine.cycles_to_us(rest))} | "
                     f"{_num(machine.cycles_to_us(r.first_load))} | {_num(machine.cycles_to_us(r.last_load - r.first_load))} | "
                     f"{_num(machine.cycles_to_us(r.load_bytes / machine.hbm_bytes_per_cycle))} | "
                     f"{_num(machine.cycles_to_us(r.total_cycles - r.last_load))} | {r.strategy} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 1 only")
    parser.add_argument("--tokens", type=int, nargs="+", help="the token counts (default 1 64 2048 4096)")
    parser.add_argument("--out", type=Path, help="directory for precisions.md (default: benchmarks/, not with --quick)")
    parser.add_argument("--block", choices=("auto", "rule"), default="auto",
                        help="the block size: the compiler's choice (default) or run.py's rule")
    parser.add_argument("--formats", nargs="+", choices=(*FORMATS, *SEED_FORMATS),
                        help="only these formats (with bf16), written as their own section of precisions.md")
    parser.add_argument("--family", nargs="+", default=(),
                        help="only these families (a prefix of the title: deepseek, qwen3, gpt-oss)")
    args = parser.parse_args(argv)
    known = [f.title.lower() for f in FAMILIES]
    for name in args.family:
        if not any(title.startswith(name.lower()) for title in known):
            parser.error(f"--family {name}: no such family (one of {', '.join(f.title for f in FAMILIES)})")
    machine = load_machine()
    formats = tuple(args.formats or FORMATS)
    rows = rows_for(args.tokens or (QUICK_TOKENS if args.quick else TOKENS), machine, args.block, formats, args.family)
    text = table(rows, machine)
    print(text)
    out = args.out or (None if args.quick else Path(__file__).parent)
    if out is not None:
        command = "python benchmarks/precisions.py" + (" --quick" if args.quick else "") + (
            " --tokens " + " ".join(map(str, args.tokens)) if args.tokens else "") + (
            " --block rule" if args.block == "rule" else "") + (
            " --formats " + " ".join(args.formats) if args.formats else "") + (
            " --family " + " ".join(args.family) if args.family else "")
        out.mkdir(parents=True, exist_ok=True)
        path = out / "precisions.md"
        if args.formats:
            write_section(path, f"## {', '.join(args.formats)} (`{command}`, machine {machine.name})", text)
        else:
            sections = path.read_text().split("\n## ", 1) if path.exists() else [""]
            kept = "\n## " + sections[1] if len(sections) > 1 else ""
            path.write_text(f"# Precisions: bf16, fp8, MXFP4 (`{command}`, machine {machine.name})\n\n{text}\n{kept}")
    return 0


def write_section(path: Path, heading: str, text: str) -> None:
    """`text` under `heading` in the file at `path`, replacing a section of the same formats
    (its heading's first words) and keeping every other part of the file."""
    key = heading.split(" (", 1)[0]
    head, *sections = path.read_text().split("\n## ") if path.exists() else [""]
    kept = [s for s in sections if s.split(" (", 1)[0] != key.removeprefix("## ")]
    body = "\n## ".join([head.rstrip("\n") + "\n", *kept, f"{heading.removeprefix('## ')}\n\n{text}\n"])
    path.write_text(body)


if __name__ == "__main__":
    raise SystemExit(main())
