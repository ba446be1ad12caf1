"""The main job, ``stmoe demo``: the whole pipeline on the shipped model, in one report.

    run.py      the runs (capture, tables, replay, analysis, simulator, offloaded generation)
    offload.py  the offloaded generation: at real expert sizes (the headline) and the
                shipped model's own
    report.py   the report's page
    text.py     its sentences, drawn from the measured numbers
    plots.py    its figures
"""

from stmoe.demo.offload import REAL_LINK, SHIPPED_LINK, real_size_section, shipped_section
from stmoe.demo.run import DEMO_PROMPTS, run_demo

__all__ = ["DEMO_PROMPTS", "REAL_LINK", "SHIPPED_LINK", "real_size_section", "run_demo",
           "shipped_section"]
