"""Evaluation: predictors replayed over traces and the systems compared (pure, no torch).

    metrics.py       recall, precision, set size over their scope
    replay.py        predictors over a trace -> results
    cache_replay.py  a per-layer cache fed by a prefetch plan
    systems.py       the compared offloading systems (``OFFLOAD_SYSTEMS``)
    compare.py       the arithmetic of a comparison: gap closed, rotated rounds, spreads
"""
