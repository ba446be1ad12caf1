"""A step's quantized resident linears: one kernel call for all its requests' rows.

Why: at Qwen1.5-MoE's shape a decode token reads about 1.3 GB of resident weights in bf16
(the lm_head alone 622 MB), and the step batcher computes every request's rows alone, so
each request reads them again (docs/serve.md). torch's weight-only kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) compute each output row from its
own input row in an order that does not change with the row count: M rows in one call
give, bit for bit, the M one-row calls (measured on every Qwen1.5 matrix, M = 2..16, 1 and
2 threads; ``tests/serve/test_step_rows.py`` keeps it checked), while bf16's blocking
depends on M. So with ``--quantize-resident int8|int4`` each request's ``QuantizedLinear``
call in a decode step of several requests waits here for the step's other requests to
reach the same call, and the batcher's thread serves them in one call: the weight read
once for the step. Nothing else is computed across requests.

A large product (the lm_head, a shared expert's up projection) is split by output columns
over the batcher's compute threads (each column the same bits whatever the split), so the
step's one call still uses both cores, as the requests' own calls side by side did.

A step's gathering starts once its requests wait at the first MoE layer and ends at the
lm_head call, the forward's last linear; that is why it needs the lm_head quantized.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from typing import Any

import torch

from stmoe.errors import OffloadError
from stmoe.quant.linears import QuantizedLinear
from stmoe.runtime.batcher.member import Member


def gathered_linears(model: torch.nn.Module) -> list[QuantizedLinear]:
    """The linears a step gathers: every ``QuantizedLinear``, if the lm_head is one (it
    ends a step's gathering), else none."""
    head = model.get_output_embeddings()
    if not isinstance(head, QuantizedLinear):
        return []
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


class StepRows:
    """The request threads' side (``call``) and the batcher's (``compute``, under its lock)."""

    def __init__(self, model: torch.nn.Module, cv: threading.Condition,
                 local: threading.local, pool: Executor | None = None, workers: int = 1) -> None:
        self.linears = gathered_linears(model)
        self.pool, self.workers = pool, workers
        self.head = model.get_output_embeddings()
        self.cv, self.local = cv, local
        self.calls = 0  # gathered calls served (for tests and /metrics)

    @property
    def active(self) -> bool:
        return bool(self.linears)

    def install(self) -> None:
        for m in self.linears:
            m.gather = self.call

    def remove(self) -> None:
        for m in self.linears:
            m.gather = None

    def call(self, module: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        """A linear's call on a request's thread: alone unless the request is in a step."""
        r: Member | None = getattr(self.local, "member", None)
        if r is None or not r.in_step:
            return module.rows(x)
        with self.cv:
            r.row_call, r.result = (module, x), None
            self.cv.notify_all()
            while r.result is None:
                self.cv.wait()
            result, r.result = r.result, None
        if isinstance(result, BaseException):
            raise result
        return result

    def compute(self, live: list[Member], members: dict[int, Member]) -> bool:
        """(``cv`` held) If every live member of the step waits at the same gathered
        linear, compute it for all of them (the lock released meanwhile) and hand each its
        rows; True if it did. Members waiting at different calls fail with a clear error
        (a step's requests run the same layers in the same order: a bug, not a hang)."""
        here = [r for r in live if r.slot in members and r.in_step]
        if not here or any(r.row_call is None and r.arrival is None for r in here):
            return False
        at = [r for r in here if r.row_call is not None]
        if not at:
            return False  # every one at its experts call: the batcher's to serve
        module = at[0].row_call[0]  # type: ignore[index]
        if len(at) < len(here) or any(r.row_call[0] is not module for r in at):  # type: ignore[index]
            error = OffloadError("the step's requests reached different layers' calls")
            for r in here:
                r.row_call, r.arrival, r.result, r.in_step = None, None, error, False
            self.cv.notify_all()
            return True
        xs = [r.row_call[1] for r in at]  # type: ignore[index]
        for r in at:
            r.row_call = None
        self.cv.release()
        try:
            out: Any = split_rows(module, xs, self.pool, self.workers)
        except Exception as exc:  # every request of the call gets it
            out = [exc] * len(at)
        finally:
            self.cv.acquire()
        self.calls += 1
        for r, y in zip(at, out, strict=True):
            r.result = y
            if module is self.head or isinstance(y, BaseException):
                r.in_step = False  # the forward's last linear: the step's gathering ends
        self.cv.notify_all()
        return True


SPLIT_COLUMNS = 4096  # products at least this wide are split over the compute threads


def split_rows(module: QuantizedLinear, xs: list[torch.Tensor], pool: Executor | None = None,
               workers: int = 1) -> list[torch.Tensor]:
    """``module`` on every request's input in one product (its columns split over
    ``pool``'s ``workers`` threads when wide), split back into each request's shape."""
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    rows = torch.cat(flat)
    n = module.out_features
    # on a GPU one kernel spans the device (and CUDA's int4 layout has no columns to cut):
    # threads split only the CPU's products
    if pool is None or workers < 2 or n < SPLIT_COLUMNS or rows.is_cuda \
            or module.qweight.dim() != 2:
        y = module.rows(rows)
    else:
        cuts = [n * i // workers // 64 * 64 for i in range(workers)] + [n]  # int4 packs by 64
        parts = pool.map(lambda i: module.columns(rows, cuts[i], cuts[i + 1]), range(workers))
        y = torch.cat(list(parts), dim=-1)
        if module.bias is not None:
            y = y + module.bias
    sizes = [f.shape[0] for f in flat]
    return [part.view(*x.shape[:-1], module.out_features)
            for part, x in zip(torch.split(y, sizes), xs, strict=True)]
