"""``/metrics``: the server's counters and the engine's, in Prometheus' text format.

The engine's figures are those of the whole life of the server (one measured run
from its start): decode-phase hit rate, prefetch recall and precision, stall,
bytes read and wasted so far (prefetches still unused are counted when evicted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stmoe.serve.service import Service


def metrics_text(service: Service) -> str:
    """The metrics page of ``service``."""
    c = service.counters
    with service.lock:
        requests = dict(c.requests)
        prompt, completion, decode_s = c.prompt_tokens, c.completion_tokens, c.decode_s
    decode, moved, wasted = service.om.engine.counters()
    running, queued = service.batcher.queue_depth()
    sizes = service.batcher.decode_sizes()[-256:]
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, values: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP stmoe_{name} {help_}")
        lines.append(f"# TYPE stmoe_{name} {kind}")
        lines.extend(f"stmoe_{name}{labels} {value:g}" for labels, value in values)

    outcomes = ("ok", "error", "cancelled", "rejected", "invalid")
    metric("requests_total", "counter", "Requests by outcome (rejected: a full queue's 429 "
           "or a closing server's 503; invalid: a 4xx refusal of the request itself).",
           [(f'{{outcome="{o}"}}', requests.get(o, 0)) for o in outcomes])
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
           [("", prompt)])
    metric("completion_tokens_total", "counter", "Generated tokens of finished requests.",
           [("", completion)])
    metric("decode_tokens_per_second", "gauge",
           "Per-request decode speed: finished requests' tokens over their decode time.",
           [("", completion / decode_s if decode_s > 0 else 0.0)])
    metric("hit_rate", "gauge", "Decode experts found in the cache.", [("", decode["hit_rate"])])
    metric("stall_seconds_total", "counter", "Time MoE layers waited for experts (decode).",
           [("", decode["stall_s"])])
    metric("bytes_read_total", "counter", "Expert bytes read from the tier.", [("", moved)])
    metric("bytes_wasted_total", "counter", "Prefetched bytes evicted unused.", [("", wasted)])
    metric("prefetch_recall", "gauge", "Needed experts that were predicted (decode).",
           [("", decode["prefetch_recall"])])
    metric("prefetch_precision", "gauge", "Predicted experts that were needed (decode).",
           [("", decode["prefetch_precision"])])
    metric("queue_depth", "gauge", "Requests in the batch and waiting for a place.",
           [('{state="running"}', running), ('{state="queued"}', queued)])
    metric("batch_size_mean", "gauge", "Mean requests per decode step (the last 256 steps).",
           [("", sum(sizes) / len(sizes) if sizes else 0.0)])
    metric("gathered_linear_calls_total", "counter", "Resident linear calls computed for a "
           "step's requests together (int8/int4 only).", [("", service.batcher.rows.calls)])
    metric("batched_forward_steps_total", "counter", "Decode steps run as one batched forward "
           "(int8/int4 only).", [("", service.batcher.step_forward.steps)])
    return "\n".join(lines) + "\n"
