"""Routing scenarios: made-up top-k expert choices [T, K] for cost-only runs.

A routing argument is a function argument carrying the arg attribute
`tcpc.routing_experts = E`: the [T, K] i32 expert choices of one MoE routing over E experts
(the `pin-routing` pass makes one of each `moe.scatter`'s expert indices). A scenario fills it:

- `balanced`: round robin, token t takes experts (t*K + k) mod E for k = 0..K-1, so every
  expert receives T*K/E pairs, give or take one. The best case for the blockwise layout. Over
  a mesh whose ep chips each hold E/ep consecutive experts (`chips`), the round robin goes
  over the chips as well: the pairs are dealt in runs of r = gcd(K, E/ep), run q to chip
  q mod ep (that chip's experts in turn), so every chip receives T*K/ep pairs give or take r
  even when T*K < E, a token's pairs still sit on K/r consecutive chips (one when K divides
  E/ep), and each expert still receives T*K/E give or take one (the same counts as on one
  chip, the experts renamed). Once every chip's tokens cover all E experts (T*K/(dp*ep) a
  multiple of E), each chip sends as many pairs and tokens to each chip as without the runs.
- `skewed`: Zipf-like popularity, P(expert e) proportional to 1 / (e + 1)^SKEW_EXPONENT
  (SKEW_EXPONENT = 1.0: expert 0 is the most popular), K distinct experts per token drawn
  without replacement in proportion to it (the Gumbel-top-k trick, which is exactly
  sequential sampling without replacement), from the seed. What trained routers look like
  when load balancing is imperfect.
- `one-expert`: router collapse, every token chooses experts 0..K-1 (the same K experts).
- a file: an .npz holding one array (or an array named `experts`), or an .npy, of shape
  [T, K] with integers in [0, E), distinct within each row (the top-k indices of a real run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime_sim.perf.array_files import ArrayFileError, read_arrays

SCENARIOS: tuple[str, ...] = ("balanced", "skewed", "one-expert")
DEFAULT_SCENARIO = "balanced"
SKEW_EXPONENT = 1.0
FILE_KEY = "experts"


class RoutingError(Exception):
    """A routing scenario that cannot be used (unknown name, bad file, wrong shape)."""


def balanced(tokens: int, k: int, experts: int, chips: int = 1) -> np.ndarray:
    """Round robin over the experts, and over `chips` chips of E/chips experts each (module
    docstring): on one chip, token t's k-th expert is (t*K + k) mod E."""
    j = np.arange(tokens * k, dtype=np.int64).reshape(tokens, k) % experts
    if chips > 1:
        if experts % chips:
            raise RoutingError(f"{experts} experts do not divide over {chips} chips")
        per_chip = experts // chips
        run = math.gcd(k, per_chip)
        q = j // run
        j = (q % chips) * per_chip + (q // chips) * run + j % run
    return j.astype(np.int32)


def skewed(tokens: int, k: int, experts: int, seed: int = 0) -> np.ndarray:
    weights = 1.0 / np.arange(1, experts + 1, dtype=np.float64) ** SKEW_EXPONENT
    rng = np.random.default_rng([seed, experts, k])
    keys = np.log(weights / weights.sum()) + rng.gumbel(size=(tokens, experts))
    # The K largest keys, largest first (stable on ties, which have probability zero).
    return np.argsort(-keys, axis=1, kind="stable")[:, :k].astype(np.int32)


def one_expert(tokens: int, k: int, experts: int) -> np.ndarray:
    return np.broadcast_to(np.arange(k, dtype=np.int32), (tokens, k)).copy()


def load_choices(path: str | Path) -> np.ndarray:
    try:
        data = read_arrays(path)
    except ArrayFileError as e:
        raise RoutingError(str(e)) from None
    if isinstance(data, np.ndarray):
        return data
    if FILE_KEY in data:
        return data[FILE_KEY]
    if len(data) == 1:
        return next(iter(data.values()))
    raise RoutingError(f"{path}: holds {len(data)} arrays ({', '.join(data)}); name the expert choices '{FILE_KEY}'")


def check_choices(choices: np.ndarray, tokens: int, k: int, experts: int, where: str) -> np.ndarray:
    """`choices` as i32 [T, K], or a RoutingError saying what is wrong."""
    choices = np.asarray(choices)
    if choices.shape != (tokens, k):
        raise RoutingError(f"{where}: expert choices have shape {list(choices.shape)}, the routing needs [{tokens}, {k}]")
    if choices.dtype.kind not in "iu":
        raise RoutingError(f"{where}: expert choices must be integers, not {choices.dtype}")
    if choices.size and (choices.min() < 0 or choices.max() >= experts):
        raise RoutingError(f"{where}: expert choices must lie in [0, {experts})")
    ordered = np.sort(choices, axis=1)
    if k > 1 and (ordered[:, 1:] == ordered[:, :-1]).any():
        row = int(np.nonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))[0][0])
        raise RoutingError(f"{where}: token {row} chooses one expert twice: {choices[row].tolist()}")
    return choices.astype(np.int32)


def scenario_choices(scenario: str | Path, tokens: int, k: int, experts: int, seed: int = 0,
                     chips: int = 1) -> np.ndarray:
    """The [T, K] i32 expert choices of a named scenario or a file; `chips` is the mesh's ep
    chips, over which `balanced` deals its pairs too."""
    if k > experts:
        raise RoutingError(f"a routing of top-{k} over {experts} experts is impossible")
    name = str(scenario)
    if name == "balanced":
        choices = balanced(tokens, k, experts, chips)
    elif name == "skewed":
        choices = skewed(tokens, k, experts, seed)
    elif name == "one-expert":
        choices = one_expert(tokens, k, experts)
    elif Path(name).suffix in (".npz", ".npy") or Path(name).exists():
        choices = load_choices(name)
    else:
        raise RoutingError(f"unknown routing '{name}' (expected {', '.join(SCENARIOS)} or an .npz file)")
    return check_choices(choices, tokens, k, experts, name)


@dataclass(frozen=True)
class Routing:
    """The routing a cost-only run used for one routing argument."""

    scenario: str
    experts: int
    choices: np.ndarray
    """[T, K] i32 expert indices."""

    def describe(self) -> str:
        """One line: the scenario, how many experts are used and the busiest one's load."""
        counts = np.bincount(self.choices.reshape(-1), minlength=self.experts)
        t, k = self.choices.shape
        return (f"{self.scenario}: {t} tokens x top-{k} of {self.experts} experts, "
                f"{int((counts > 0).sum())} experts used, busiest {int(counts.max()) if counts.size else 0} pairs")
