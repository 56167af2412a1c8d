"""``jaxpar sweep``: run every valid layout of N devices on the same problem and measure it.

* :mod:`~jaxpar.analysis.sweep.grid`: which layouts run, their names, the cluster of the estimates.
* :mod:`~jaxpar.analysis.sweep.measure`: one layout compiled, analysed, run and timed.
* :mod:`~jaxpar.analysis.sweep.worker`: the child process the layouts run in.
* :mod:`~jaxpar.analysis.sweep.passes`: the passes over the grid and the loss check.
* :mod:`~jaxpar.analysis.sweep.report`: results.csv / .json, report.md and the figures.
"""

from jaxpar.analysis.sweep.grid import (
    AXES,
    cpu_cluster,
    device_cluster,
    layout_name,
    measure_copy_gbps,
    select,
    sweep_layouts,
)
from jaxpar.analysis.sweep.measure import PROBE_STEPS, HostProbe, SweepRecord, run_layout, summarize_times, time_again
from jaxpar.analysis.sweep.passes import PASS_STEPS, STATUSES, TOLERANCE, check_losses, run_sweep_layouts
from jaxpar.analysis.sweep.worker import ABORT_ENV, COLLECTIVE_TIMEOUT_FLAGS, Workers

__all__ = [
    "ABORT_ENV",
    "AXES",
    "COLLECTIVE_TIMEOUT_FLAGS",
    "PASS_STEPS",
    "PROBE_STEPS",
    "STATUSES",
    "TOLERANCE",
    "HostProbe",
    "SweepRecord",
    "Workers",
    "check_losses",
    "cpu_cluster",
    "device_cluster",
    "layout_name",
    "measure_copy_gbps",
    "run_layout",
    "run_sweep_layouts",
    "select",
    "summarize_times",
    "sweep_layouts",
    "time_again",
]
