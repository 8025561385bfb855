"""`tcpc sweep SPEC.toml`: cost-only simulations over a grid of programs, dims, machine
variants, routing scenarios and pass options, run on Dask distributed.

A spec (examples/sweeps/*.toml) gives each parameter one value or a list of values; every
combination of the lists is one *point* (a grid), crossed with the optional `[[cases]]` (each
a partial point, e.g. one model's program and dims). A point is one cost-only compile and
simulation, the same code path as `tcpc run --cost-only` (Program.simulate). Points are
independent, so they run as Dask tasks: on a LocalCluster of this machine by default, or on
any Dask scheduler (`--scheduler ADDRESS`: SSH, Kubernetes, Slurm clusters run the same code).

Results: one row per point in `results.parquet` and `results.csv` (the inputs, cycles and
microseconds, the roofline and the ratio to it, cycles by phase on the critical path, peak
SRAM, HBM bytes, the chosen block size when the report gives one). A point that fails records
its error and the sweep goes on. Rows are keyed by a hash of the point (its parameters and the
text of the files it reads): a rerun skips the points already done, and retries the failed ones.

A mistake in the spec itself (a missing program, an unknown dim, routing scenario, machine or
pass option, more points than MAX_POINTS) is one error from load_spec, before any cluster starts.
The package, by job: `spec` (load and check a spec, its points), `points` (one point's compile,
simulation and row), `results` (Parquet and CSV), `cluster` (running on Dask), `charts`.
"""

from tcpc.sweep.charts import plot, swept_parameters
from tcpc.sweep.cluster import SweepOutcome, SweepProgress, check_out, run_sweep
from tcpc.sweep.points import chosen_block, report_columns, run_point
from tcpc.sweep.results import RESULTS, RESULTS_CSV, read_results, write_results
from tcpc.sweep.spec import MAX_POINTS, Point, Spec, SweepError, load_spec, point_key

__all__ = ["MAX_POINTS", "RESULTS", "RESULTS_CSV", "Point", "Spec", "SweepError", "SweepOutcome", "SweepProgress",
           "check_out", "chosen_block", "load_spec", "plot", "point_key", "read_results", "report_columns",
           "run_point", "run_sweep", "swept_parameters", "write_results"]
