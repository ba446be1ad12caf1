"""The offloading runtime's own pipeline on a host CPU (``stmoe simulate --pipeline runtime``).

    pipeline.py    the timing model: compute thread, prefetch workers, stale drops, pause
    inputs.py      what it takes: the host's costs and the run
    tier.py        the reads in progress: pieces, parks (demand first), page faults
    link.py        how reads share the tier: a shared disk, or one serial link
    systems.py     the runtime's compared systems simulated on a trace, with host costs
    calibrated.py  a ``stmoe calibrate`` measurement written as a hardware preset
    check_plot.py  the simulated-against-measured figure
"""

from stmoe.sim.host.inputs import HostCosts, HostRun
from stmoe.sim.host.pipeline import simulate_host

__all__ = ["HostCosts", "HostRun", "simulate_host"]
