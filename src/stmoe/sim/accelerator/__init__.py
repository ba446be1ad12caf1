"""The paper's accelerator pipeline (docs/method.md) and the systems it is compared with.

    pipeline.py   the per-layer timing model, compiled
    systems.py    the paper's baselines (``PAPER_BASELINES``), ST-MoE and replay predictors
    simulate.py   every system on one trace, the ablation, sweeps
    plots.py      its figures
"""
