"""The step batcher: several requests of a server decode together, each exactly as alone
(``batcher``), its requests as a client sees them (``requests``) and as the batcher keeps
them (``member``), how each picks its tokens (``sampling``), and what a step shares in
int8/int4 (``step_forward``, ``step_rows``)."""

from stmoe.runtime.batcher.batcher import StepBatcher
from stmoe.runtime.batcher.requests import Cancelled, QueueFull, Request, Usage, replay_request
from stmoe.runtime.batcher.sampling import Sampling, TokenLogprob, choice_seed

__all__ = ["Cancelled", "QueueFull", "Request", "Sampling", "StepBatcher", "TokenLogprob",
           "Usage", "choice_seed", "replay_request"]
