"""Numpy semantics of the `ccl` ops: one definition over all chips' values, and the exchange
that runs an SPMD function on every chip of a mesh at once.

Each collective is a pure function of the values every chip of its group contributes
(`all_to_all`, `all_gather`, `reduce_sum`), so there is one semantics whatever runs it.
`run_mesh` runs the function once per chip, each chip on its own thread with its own
interpreter; at a collective every chip hands its value to a `MeshExchange` and waits for the
others (every chip runs every collective at the same point of the program), then takes its own
share of the result. Reductions sum in chip order 0, 1, ... in f32 and round once, so the order
is fixed and the same on every run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls
from xdsl.ir import Operation
from xdsl.utils.exceptions import InterpretationError

from dialects import ccl
from runtime_sim.semantics.executor import make_interpreter
from runtime_sim.semantics.numerics import compute, round_to, tensor_dtype


def all_to_all(values: Sequence[np.ndarray]) -> list[np.ndarray]:
    """result[c][s] = values[s][c]: slice c of chip s's buffer goes to chip c."""
    return [received(values, c) for c in range(len(values))]


def received(values: Sequence[np.ndarray], chip: int) -> np.ndarray:
    """What `chip` receives in the all-to-all of `values`: slice `chip` of each chip's buffer, in
    chip order (each chip's thread builds only its own share, not every chip's)."""
    return np.stack([np.asarray(v)[chip] for v in values])


def unpacked(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A packed all-to-all's input laid out by slice: slice d's rows[d] rows, which follow the
    earlier slices' in `x`'s rows, at the head of slice d, zeros after."""
    slices, per = x.shape[:2]
    flat = x.reshape(slices * per, *x.shape[2:])
    out = np.zeros_like(x)
    start = 0
    for d, n in enumerate(int(r) for r in rows):
        out[d, :n] = flat[start:start + n]
        start += n
    return out


def all_gather(values: Sequence[np.ndarray], dim: int = 0) -> np.ndarray:
    return np.concatenate([np.asarray(v) for v in values], axis=dim)


def reduce_sum(values: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The sum of every chip's value in chip order, in f32 from +0.0, rounded once to `dtype`."""
    total = np.zeros(np.shape(values[0]), dtype=np.float32)
    for v in values:
        total = total + compute(np.asarray(v))
    return round_to(total, dtype)


def a2a_plan(experts_idx: np.ndarray, chips: int, experts: int, slots: int,
             capacity: int | None = None, earlier: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`ccl.a2a_plan`: slot rows [T, K], slot experts (local + 1, 0 empty) [chips, S], counts
    [chips]. `earlier` [E]: each expert's pairs from the tokens before these (they rank first)."""
    per_chip = experts // chips
    flat = experts_idx.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < -1 or flat.max() >= experts):
        bad = int(flat.min() if flat.min() < -1 else flat.max())
        raise InterpretationError(f"ccl.a2a_plan: expert index {bad} is outside [0, {experts}) (-1: no pair)")
    kept = flat >= 0
    flat = np.maximum(flat, 0)
    if capacity is not None:  # an expert's first C pairs (of this chip, or after `earlier`), token-major
        position = (np.cumsum((flat[:, None] == np.arange(experts)) & kept[:, None], axis=0) - 1)[np.arange(flat.size), flat]
        if earlier is not None:
            position = position + np.asarray(earlier, np.int64)[flat]
        kept &= position < capacity
    dest = flat // per_chip
    rank = (np.cumsum((dest[:, None] == np.arange(chips)) & kept[:, None], axis=0) - 1)[np.arange(flat.size), dest]
    if kept.any() and rank[kept].max() >= slots:
        raise InterpretationError(f"ccl.a2a_plan: {int(rank[kept].max()) + 1} pairs for one chip, more than the "
                                  f"{slots} slots (a token chose one expert twice?)")
    rows = np.where(kept, dest * slots + rank, -1)
    slot_experts = np.zeros(chips * slots, dtype=np.int32)
    slot_experts[rows[kept]] = (flat[kept] % per_chip) + 1
    counts = np.bincount(dest[kept], minlength=chips).astype(np.int32)
    return rows.reshape(experts_idx.shape).astype(np.int32), slot_experts.reshape(chips, slots), counts


def _destinations(slot_rows: np.ndarray, chips: int, slots: int,
                  whole_first: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of a plan's pairs: each one's destination chip [T, K] (-1: dropped), whether it is bound
    for chip d [T, K, chips], and each token's rank among the tokens with a pair bound for chip
    d [T, chips] (its row of that chip's slice of the token send buffer; `whole_first`: the
    tokens whose kept pairs are all bound for one chip first, ccl's `_A2AOrder`)."""
    dest = np.where(slot_rows >= 0, slot_rows // max(slots, 1), -1)
    bound = dest[:, :, None] == np.arange(chips)
    has = bound.any(axis=1)  # [T, chips]
    if not whole_first:
        return dest, bound, np.cumsum(has, axis=0) - 1
    whole = (has.sum(axis=1) == 1)[:, None]
    first, then = has & whole, has & ~whole
    rank = np.where(whole, np.cumsum(first, axis=0) - 1, first.sum(axis=0) + np.cumsum(then, axis=0) - 1)
    return dest, bound, rank


def a2a_tokens(slot_rows: np.ndarray, chips: int, slots: int, me: int,
               whole_first: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`ccl.a2a_tokens`: token rows [T, chips] (d * T + rank, -1), slot tokens [chips, S]
    (me * T + the slot's token's rank, -1 empty), counts [chips]."""
    t = slot_rows.shape[0]
    kept = slot_rows >= 0
    dest, bound, rank = _destinations(slot_rows, chips, slots, whole_first)
    has = bound.any(axis=1)  # [T, chips]
    token_rows = np.where(has, np.arange(chips) * t + rank, -1)
    slot_tokens = np.full(chips * slots, -1, dtype=np.int64)
    tokens = np.broadcast_to(np.arange(t)[:, None], slot_rows.shape)
    slot_tokens[slot_rows[kept]] = me * t + rank[tokens[kept], dest[kept]]
    return (token_rows.astype(np.int32), slot_tokens.reshape(chips, slots).astype(np.int32),
            has.sum(axis=0).astype(np.int32))


def a2a_token_lists(slot_rows: np.ndarray, values: np.ndarray, chips: int, slots: int,
                    entries: int, whole_first: bool = False) -> np.ndarray:
    """`ccl.a2a_token_lists` over a plan of `slots` slots per chip: [chips, T, entries], a
    token's row at each destination its rank among the tokens sent there (as a2a_tokens'
    token rows); -1 (integers) or 0 (floats) past a token's last pair."""
    t, _ = slot_rows.shape
    dest, bound, rank = _destinations(slot_rows, chips, slots, whole_first)
    entry = np.cumsum(bound, axis=1) - 1  # [T, K, chips]: a pair's place in its token's list there
    tt, kk = np.nonzero(slot_rows >= 0)
    d = dest[tt, kk]
    j = entry[tt, kk, d]
    if j.size and j.max() >= entries:
        raise InterpretationError(f"ccl.a2a_token_lists: a token has {int(j.max()) + 1} pairs for one chip, "
                                  f"more than the {entries} list entries (a token chose one expert twice?)")
    empty = -1 if np.issubdtype(values.dtype, np.integer) else 0
    lists = np.full((chips, t, entries), empty, dtype=values.dtype)
    lists[d, rank[tt, d], j] = values[tt, kk]
    return lists


def _ranks(groups: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Each item's rank among the items of its group, in the items' order, and the groups' sizes."""
    sizes = np.bincount(groups, minlength=count).astype(np.int32)
    order = np.argsort(groups, kind="stable")
    rank = np.empty(groups.size, dtype=np.int64)
    rank[order] = np.arange(groups.size) - (np.cumsum(sizes) - sizes)[groups[order]]
    return rank, sizes


def a2a_returns(slot_rows: np.ndarray, chips: int, slots: int, entries: int,
                me: int, whole_first: bool = False,
                wave: tuple[np.ndarray, int, int, int] | None = None) -> tuple[np.ndarray, ...]:
    """`ccl.a2a_returns` over a plan of `slots` slots per chip: pair slots [chips, S]
    ((me * T + r) * entries + j + 1, 0 none), pair counts [chips], token returns [T, 1]
    (d * T + r, -1), pair returns [T, K] (d * S + p, -1) and sum counts [chips] (the whole
    tokens bound for d with `whole_first`, else every token sent there). `wave` (the pairs'
    experts [T, K], E, a, b): the split pairs' tables of those of local experts [a, b) only."""
    t, k = slot_rows.shape
    dest, bound, rank = _destinations(slot_rows, chips, slots, whole_first)
    kept = slot_rows >= 0
    entry = np.cumsum(bound, axis=1) - 1  # [T, K, chips]: a pair's place in its token's list there
    tt, kk = np.nonzero(kept)
    if tt.size and entry[tt, kk, dest[tt, kk]].max() >= entries:
        raise InterpretationError(f"ccl.a2a_returns: a token has {int(entry[tt, kk, dest[tt, kk]].max()) + 1} pairs "
                                  f"for one chip, more than the {entries} list entries (a token chose one expert twice?)")
    has = bound.any(axis=1)  # [T, chips]
    whole = has.sum(axis=1) == 1  # [T]
    sum_counts = (has & whole[:, None] if whole_first else has).sum(axis=0).astype(np.int32)
    tokens = np.nonzero(whole)[0]
    home = dest.max(axis=1)[tokens]  # a whole token's one destination
    token_returns = np.full((t, 1), -1, dtype=np.int32)
    token_returns[tokens, 0] = home * t + rank[tokens, home]
    split = kept & ~whole[:, None]
    if wave is not None:
        experts_idx, e, a, b = wave
        local = experts_idx % (e // chips)
        split &= (a <= local) & (local < b)
    tt, kk = np.nonzero(split)
    order = np.argsort(slot_rows[tt, kk], kind="stable")  # slot order within each destination
    tt, kk = tt[order], kk[order]
    d = slot_rows[tt, kk] // slots
    p, pair_counts = _ranks(d, chips)
    pair_slots = np.zeros((chips, slots), dtype=np.int32)
    pair_slots[d, p] = (me * t + rank[tt, d]) * entries + entry[tt, kk, d] + 1
    pair_returns = np.full((t, k), -1, dtype=np.int32)
    pair_returns[tt, kk] = d * slots + p
    return pair_slots, pair_counts, token_returns, pair_returns, sum_counts


class MeshExchange:
    """Where the chips of a mesh meet at each collective. `collect` hands over this chip's
    value and returns every chip's (in chip order) once all have arrived; a chip that fails
    breaks the barrier, so the others stop instead of waiting forever. Every chip says where it
    is (`what`, and at the end of the function `finish`): chips that meet at different points
    of the program (one ran a collective the others did not, or finished) is an error on every
    chip, not a hang or an exchange of unrelated values."""

    def __init__(self, mesh: ccl.Mesh):
        self.mesh = mesh
        self._values: list[Any] = [None] * mesh.chips
        self._where: list[str] = [""] * mesh.chips
        self._barrier = threading.Barrier(mesh.chips)

    def collect(self, chip: int, value: Any, what: str = "a collective") -> list[Any]:
        self._values[chip] = value
        self._where[chip] = what
        self._barrier.wait()
        values, where = list(self._values), list(self._where)
        if len(set(where)) > 1:
            points = "; ".join(f"chip {c}: {w}" for c, w in enumerate(where))
            raise InterpretationError(f"the chips of the mesh reached different points of the program ({points})")
        self._barrier.wait()  # nobody overwrites a value before everyone has read it
        return values

    def finish(self, chip: int) -> None:
        """Meet the other chips at the end of the function."""
        self.collect(chip, None, "the end of the function")

    def abort(self) -> None:
        self._barrier.abort()


def collective_label(op: Operation) -> str:
    """`ccl.all_to_all %recv_x`: how the chips name the collective they meet at."""
    return " ".join([op.name, *(f"%{r.name_hint}" for r in op.results if r.name_hint)])


@register_impls
class CCLFunctions(InterpreterFunctions):
    """The `ccl` ops of one chip of a mesh run by `run_mesh`."""

    def __init__(self, exchange: MeshExchange | None = None, chip: int = 0):
        self.exchange = exchange
        self.chip = chip

    def _group(self, op: ccl._Collective, value: Any) -> tuple[list[Any], int]:
        """Every value of this chip's group along the op's axis, and this chip's place in it."""
        if self.exchange is None:
            raise InterpretationError(f"{op.name} exchanges values between chips: run the function on a mesh")
        mesh = self.exchange.mesh
        if mesh.size(op.axis_name) != op.group_size:
            raise InterpretationError(f"{op.name} spans {op.group_size} chips along {op.axis_name}, "
                                      f"the mesh {mesh} has {mesh.size(op.axis_name)}")
        everyone = self.exchange.collect(self.chip, value, collective_label(op))
        group = mesh.group(self.chip, op.axis_name)
        return [everyone[c] for c in group], group.index(self.chip)

    def _all_to_all(self, op: ccl.AllToAllExchange, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = np.asarray(args[0])
        sent = unpacked(x, np.asarray(args[1])) if op.packed is not None else x
        if op.expects is None:
            values, me = self._group(op, sent)
            return (received(values, me),)
        # What this chip expects is what the others send it: a chip skips the exchange on it.
        both, me = self._group(op, (sent, np.asarray(args[1])))
        coming = [int(rows[me]) for _, rows in both]
        expected = [int(r) for r in np.asarray(args[2])]
        if any(c != e for s, (c, e) in enumerate(zip(coming, expected)) if s != me):
            raise InterpretationError(f"{collective_label(op)}: chip {self.chip} expects rows {expected}, "
                                      f"the group sends it {coming}")
        return (received([v for v, _ in both], me),)

    @impl(ccl.AllToAllOp)
    def run_all_to_all(self, interpreter: Interpreter, op: ccl.AllToAllOp, args: tuple[Any, ...]):
        return self._all_to_all(op, args)

    @impl(ccl.AllToAllStartOp)
    def run_all_to_all_start(self, interpreter: Interpreter, op: ccl.AllToAllStartOp, args: tuple[Any, ...]):
        """The chips meet where the exchange starts; what arrives is the done's."""
        return self._all_to_all(op, args)

    @impl(ccl.AllToAllDoneOp)
    def run_all_to_all_done(self, interpreter: Interpreter, op: ccl.AllToAllDoneOp, args: tuple[Any, ...]):
        return (args[0],)

    @impl(ccl.AllGatherOp)
    def run_all_gather(self, interpreter: Interpreter, op: ccl.AllGatherOp, args: tuple[Any, ...]):
        values, _ = self._group(op, np.asarray(args[0]))
        return (all_gather(values, ccl.split_dim(op)),)

    @impl(ccl.ReduceScatterOp)
    def run_reduce_scatter(self, interpreter: Interpreter, op: ccl.ReduceScatterOp, args: tuple[Any, ...]):
        values, me = self._group(op, np.asarray(args[0]))
        dim = ccl.split_dim(op)
        size = op.result.type.get_shape()[dim]
        return (reduce_sum([np.take(v, range(me * size, (me + 1) * size), axis=dim) for v in values],
                           tensor_dtype(op.result.type)),)

    @impl(ccl.AllReduceOp)
    def run_all_reduce(self, interpreter: Interpreter, op: ccl.AllReduceOp, args: tuple[Any, ...]):
        values, _ = self._group(op, np.asarray(args[0]))
        return (reduce_sum(values, tensor_dtype(op.result.type)),)

    @impl(ccl.ChipIdOp)
    def run_chip_id(self, interpreter: Interpreter, op: ccl.ChipIdOp, args: tuple[Any, ...]):
        mesh = self.exchange.mesh if self.exchange is not None else ccl.Mesh(((op.axis_name, op.group_size),))
        return (np.array(mesh.coordinates(self.chip).get(op.axis_name, 0), dtype=np.int32),)

    @impl(ccl.A2APlanOp)
    def run_a2a_plan(self, interpreter: Interpreter, op: ccl.A2APlanOp, args: tuple[Any, ...]):
        earlier = None
        if op.chip_counts is not None:
            shard = self.exchange.mesh.token_shard(self.chip) if self.exchange is not None else 0
            earlier = np.asarray(args[1], np.int64)[:shard].sum(axis=0)
        return a2a_plan(np.asarray(args[0]), op.group_size, op.experts.value.data, op.slots, op.capacity_limit,
                        earlier)

    def _place(self, op: ccl._Collective) -> int:
        """This chip's place in its group along the op's axis (0 off a mesh)."""
        return 0 if self.exchange is None else self.exchange.mesh.group(self.chip, op.axis_name).index(self.chip)

    @impl(ccl.A2ATokensOp)
    def run_a2a_tokens(self, interpreter: Interpreter, op: ccl.A2ATokensOp, args: tuple[Any, ...]):
        return a2a_tokens(np.asarray(args[0]), op.group_size, op.slots, self._place(op), op.whole_first is not None)

    @impl(ccl.A2ATokenListsOp)
    def run_a2a_token_lists(self, interpreter: Interpreter, op: ccl.A2ATokenListsOp, args: tuple[Any, ...]):
        return (a2a_token_lists(np.asarray(args[0]), np.asarray(args[1]), op.group_size, op.slots.value.data,
                                op.entries, op.whole_first is not None),)

    @impl(ccl.A2AReturnsOp)
    def run_a2a_returns(self, interpreter: Interpreter, op: ccl.A2AReturnsOp, args: tuple[Any, ...]):
        wave = op.wave_of
        return a2a_returns(np.asarray(args[0]), op.group_size, op.slots, op.list_entries, self._place(op),
                           op.whole_first is not None, None if wave is None else (np.asarray(args[1]), *wave))


ChipInterpreter = Callable[[ModuleOp, "MeshExchange", int], Interpreter]
"""(module, exchange, chip) -> the interpreter chip `chip` runs on, its listeners attached."""


def plain_chip(listeners: Callable[[int], Sequence[Interpreter.Listener]] = lambda chip: ()) -> ChipInterpreter:
    """The reference semantics with the chip's `ccl` ops and `listeners(chip)`."""

    def build(module: ModuleOp, exchange: MeshExchange, chip: int) -> Interpreter:
        interpreter = make_interpreter(module, listeners(chip))
        interpreter.register_implementations(CCLFunctions(exchange, chip))
        return interpreter

    return build


def run_mesh(module: ModuleOp, function: str, mesh: ccl.Mesh, args: Sequence[Sequence[Any]],
             interpreter: ChipInterpreter = plain_chip()) -> list[tuple[Any, ...]]:
    """Run `function` on every chip of `mesh` (chip c on `args[c]`), exchanging values at the
    collectives; the outputs of every chip, in chip order. `interpreter` builds each chip's
    interpreter (`plain_chip(listeners)`, or cost-only mode's shape-only one)."""
    exchange = MeshExchange(mesh)
    outputs: list[tuple[Any, ...] | None] = [None] * mesh.chips
    errors: list[BaseException | None] = [None] * mesh.chips

    def chip_main(chip: int) -> None:
        try:
            runner = interpreter(module, exchange, chip)
            with np.errstate(all="ignore"):
                outputs[chip] = tuple(runner.call_op(function, tuple(args[chip])))
            exchange.finish(chip)
        except threading.BrokenBarrierError as e:
            errors[chip] = e
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[chip] = e
            exchange.abort()

    threads = [threading.Thread(target=chip_main, args=(c,), name=f"chip{c}") for c in range(mesh.chips)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [o for o in outputs if o is not None]
