"""stmoe-plus and hybrid: probabilistic table predictors (no neural network: counts,
a memory of routing, and ten weights fitted at profiling).

stmoe-plus scores every expert of the target layer with smoothed conditional
frequencies over the *full* co-occurrence counts (not just a top-K row):

* spatial: the experts chosen at the token's last four known layers;
* temporal: the previous token's experts at the target layer;
* a per-layer prior (how often each expert is chosen at that layer);
* recency: the experts the sequence chose at the target layer lately;
* a token memory: what the most similar of the last ``MEMORY_TOKENS`` tokens
  (profiled, then streamed) chose at the target layer, similarity being the
  overlap over every known layer (nearer layers weighing more, ``sim_decay``);
* the same vote narrowed to the nearest of the near (power x 4), and a constant;

weighted by ``w`` (fitted on held-back profiling data by ``fit``, never on the
evaluation trace: a grid search for a linear pool, then a logistic fit that
makes the scores each expert's log-odds of being chosen), learning online with
exponential forgetting (``decay`` per token). It returns the ``set_size`` best
experts, or with ``adaptive`` every expert whose share of the scores (of the
probabilities, with logistic weights) clears one threshold, steered so the mean
set size is ``set_size``. With ``horizon`` h it predicts layer l+h from layers <= l.

hybrid adds **gate lookahead** (``stmoe.predictors.lookahead``): the next layer's
router applied ahead of time, early or late, fused with the table scores by
weight ``beta`` or, where the fit found it better, joined to the log-odds as one
more signal of a joint logistic fit (``look_logit``; only where it is added).

One thing per module: ``config`` (the knobs), ``fitted`` (the fitted values, as
the tables file stores them), ``layout`` (the weight vector's order), ``state``
(the grouped arrays the kernels take), the compiled kernels ``scoring``,
``sizing`` and ``steps``, ``fitting`` (the fit) and ``predictor`` (the two
predictors). numba's cache notices edits to a kernel's own file only: after
editing one kernel module, clear ``__pycache__`` here.
"""

from stmoe.predictors.lookahead_points import check_point
from stmoe.predictors.plus.config import PlusConfig
from stmoe.predictors.plus.fitted import (
    DEFAULT_W,
    FIT_VERSION,
    JointFit,
    LookaheadFit,
    PlusFit,
)
from stmoe.predictors.plus.fitting import fit, fit_weights
from stmoe.predictors.plus.layout import Signal, WeightRow
from stmoe.predictors.plus.predictor import HybridPredictor, PlusPredictor
from stmoe.predictors.plus.state import MEMORY_TOKENS

# (after the predictors: gate-lookahead registers after stmoe-plus and hybrid, as the
# registry has always listed them; re-exported here for the old import path)
from stmoe.predictors.lookahead import LookaheadPredictor  # isort: skip

__all__ = [
    "DEFAULT_W",
    "FIT_VERSION",
    "MEMORY_TOKENS",
    "HybridPredictor",
    "JointFit",
    "LookaheadFit",
    "LookaheadPredictor",
    "PlusConfig",
    "PlusFit",
    "PlusPredictor",
    "Signal",
    "WeightRow",
    "check_point",
    "fit",
    "fit_weights",
]
