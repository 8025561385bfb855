"""Running a sweep on Dask: a LocalCluster or a scheduler, progress, and skipping the points
already done."""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tcpc.progress import Progress
from tcpc.sweep.points import error_text, run_point
from tcpc.sweep.results import RESULTS, read_results, write_results
from tcpc.sweep.spec import EXTRA, Spec, SweepError, input_columns, point_key



class SweepProgress(Progress):
    """`sweep: done / total points (failed)` on a terminal (the op-level Progress, counting points)."""

    def __init__(self, total: int, stream: IO[str] | None = None, *, force: bool = False):
        super().__init__(total, stream, delay=0.0, force=force)
        self.failed = 0
        if self.enabled:  # at once: starting a cluster takes seconds
            self._draw(f"sweep: 0 / {total:,} points")

    def point_done(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.interval and self.done < (self.total or 0)):
            return
        self.last = now
        failed = f", {self.failed} failed" if self.failed else ""
        self._draw(f"sweep: {self.done:,} / {self.total:,} points{failed}")


@dataclass
class SweepOutcome:
    out: Path
    rows: list[dict[str, Any]]
    """Every row of the results file: this spec's points and any earlier ones."""
    ran: int
    skipped: int
    failed: list[dict[str, Any]] = field(default_factory=list)
    """The rows of this run's points that failed."""
    succeeded: int = 0
    """How many of the spec's points have a row with status ok (from this run or an earlier one)."""
    seconds: float = 0.0
    """Wall seconds from handing this run's points to the cluster to the last result (the
    cluster's start-up apart)."""

    @property
    def points_per_second(self) -> float:
        """This run's points over `seconds`: the sweep's rate on its cluster."""
        return self.ran / self.seconds if self.seconds > 0 else 0.0


def check_out(out: Path, named: str) -> None:
    """Make `out` the results directory, or refuse it (an existing file, a directory that
    cannot be made or written) before any point runs, so a sweep never ends unable to save.
    `named` says where the path came from (`-o DIR`)."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"{named}: is a file; the results go in a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise SweepError(f"{named}: cannot make the results directory: {(e.strerror or str(e)).lower()}") from None
    if not os.access(out, os.W_OK):
        raise SweepError(f"{named}: permission denied")


def _client(scheduler: str | None, workers: int | None, processes: bool) -> tuple[Any, Any]:
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise SweepError(f"tcpc sweep runs on Dask distributed: {EXTRA}") from None
    if scheduler is not None:
        try:
            return Client(scheduler, timeout="10s"), None
        except (OSError, TimeoutError, ValueError) as e:  # ValueError: not an address
            message = f"--scheduler {scheduler}: cannot connect ({e})"
        # The half-built Client is garbage now: collect it here, so its __del__ (which stops its
        # event loop) does not run at a random later allocation, such as inside the next
        # LocalCluster's loop start, where distributed's LoopRunner lock deadlocks against it.
        gc.collect()
        raise SweepError(message)
    cluster = LocalCluster(n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=processes,
                           dashboard_address=":0", silence_logs=logging.ERROR)
    return Client(cluster), cluster


def run_sweep(spec: Spec, out: Path, *, scheduler: str | None = None, workers: int | None = None,
              processes: bool = True, progress: IO[str] | None = None, save_every: float = 10.0) -> SweepOutcome:
    """Run the spec's points not already done in `out`, on a LocalCluster (`workers` worker
    processes, or threads with processes=False) or on the Dask scheduler at `scheduler`."""
    check_out(out, str(out))
    earlier = {r["key"]: r for r in read_results(out)}
    todo = [p for p in spec.points if earlier.get(point_key(p), {}).get("status") != "ok"]
    rows = dict(earlier)
    outcome = SweepOutcome(out, [], len(todo), len(spec.points) - len(todo))
    if todo:
        client, cluster = _client(scheduler, workers, processes)
        from dask.distributed import as_completed

        bar = SweepProgress(len(todo), progress)
        saved = started = time.monotonic()
        try:
            futures = client.map(run_point, todo, pure=False)
            points = {f.key: p for f, p in zip(futures, todo)}
            for future in as_completed(futures):
                try:
                    row = future.result()
                except Exception as e:  # a worker that died: the point's row says so
                    point = points[future.key]
                    row = {"key": point_key(point), **input_columns(point), "status": "error",
                           "error": f"the worker failed: {error_text(e, point)}"}
                rows[row["key"]] = row
                if row["status"] != "ok":
                    outcome.failed.append(row)
                bar.point_done(row["status"] == "ok")
                if time.monotonic() - saved > save_every:
                    write_results(list(rows.values()), out)
                    saved = time.monotonic()
            outcome.seconds = time.monotonic() - started
        finally:
            bar.close()
            write_results(list(rows.values()), out)  # whatever finished, even when interrupted
            client.close()
            if cluster is not None:
                cluster.close()
    elif not (out / RESULTS).exists():
        write_results([], out)
    order = [point_key(p) for p in spec.points]
    outcome.rows = [rows[k] for k in order if k in rows] + [r for k, r in rows.items() if k not in set(order)]
    outcome.succeeded = sum(rows[k]["status"] == "ok" for k in order if k in rows)
    if todo:
        write_results(outcome.rows, out)
    return outcome


# ---------------------------------------------------------------- charts
