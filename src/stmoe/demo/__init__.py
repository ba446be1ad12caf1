"""The main job, ``stmoe demo``: the whole pipeline on the shipped model, in one report.

    run.py     the runs (capture, tables, replay, analysis, simulator, offloaded generation)
    report.py  the report's page
    text.py    its sentences, drawn from the measured numbers
    plots.py   its figures
"""

from stmoe.demo.run import (
    DEMO_PROMPTS,
    OFFLOAD_LINK,
    offload_section,
    resident_tokens,
    run_demo,
)

__all__ = ["DEMO_PROMPTS", "OFFLOAD_LINK", "offload_section", "resident_tokens", "run_demo"]
