"""The step batcher: several requests of a server decode together, each exactly as alone
(``batcher``), its requests as a client sees them (``requests``) and as the batcher keeps
them (``member``), and what a step shares in int8/int4 (``step_forward``, ``step_rows``)."""

from stmoe.runtime.batcher.batcher import StepBatcher
from stmoe.runtime.batcher.requests import Cancelled, QueueFull, Request, Usage, replay_request

__all__ = ["Cancelled", "QueueFull", "Request", "StepBatcher", "Usage", "replay_request"]
