"""`stmoe serve`: an OpenAI-compatible HTTP server over the offloaded model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from stmoe.cli.common import check_range, out
from stmoe.cli.help_panels import SERVER
from stmoe.cli.offload_options import (
    _DEFAULT,
    AdmissionOpt,
    BandwidthOpt,
    CapacityOpt,
    FormatOpt,
    GroupSizeOpt,
    InPlaceOpt,
    LatencyOpt,
    MemoryOpt,
    ModelOpt,
    PolicyOpt,
    PredictorOpt,
    QuantizeResidentOpt,
    StoreOpt,
    TablesOpt,
    ThreadsOpt,
    TierOpt,
    WorkersOpt,
    checked_model,
    offload_for,
)
from stmoe.errors import StmoeError
from stmoe.runtime.warm_up import warm_up

if TYPE_CHECKING:
    from stmoe.runtime.batcher import StepBatcher


def serve_cmd(
    model: ModelOpt = None,
    store: StoreOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on: 127.0.0.1 (this machine) "
                                      "or 0.0.0.0 (every interface, unauthenticated).",
                                      rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port, 1 to 65535.",
                                      rich_help_panel=SERVER)] = 8000,
    max_batch: Annotated[int, typer.Option(help="Requests decoding together in each step, 1 "
                                           "to 64 (with --quantize-resident int8|int4 one "
                                           "batched forward; docs/serve.md).",
                                           rich_help_panel=SERVER)] = 4,
    max_queue: Annotated[int, typer.Option(help="Requests waiting for a place, 0 to 10000 "
                                           "(a request of n choices counts n); beyond "
                                           "it 429.", rich_help_panel=SERVER)] = 16,
    name: Annotated[str | None, typer.Option(help="The model's name in the API. Default: the "
                                             "folder's name.", rich_help_panel=SERVER)]
    = None,
    capacity: CapacityOpt = None,
    memory: MemoryOpt = None,
    predictor: PredictorOpt = _DEFAULT.predictor,
    tables: TablesOpt = _DEFAULT.tables,
    policy: PolicyOpt = _DEFAULT.policy,
    admission: AdmissionOpt = _DEFAULT.admission,
    tier: TierOpt = _DEFAULT.tier,
    bandwidth: BandwidthOpt = _DEFAULT.bandwidth,
    latency: LatencyOpt = f"{_DEFAULT.latency:g}",
    workers: WorkersOpt = _DEFAULT.workers,
    threads: ThreadsOpt = None,
    weights: FormatOpt = _DEFAULT.format,
    group_size: GroupSizeOpt = _DEFAULT.group_size,
    in_place: InPlaceOpt = _DEFAULT.in_place,
    quantize_resident: QuantizeResidentOpt = _DEFAULT.quantize_resident,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level: warning, info "
                                           "(one line per request) or debug.",
                                           rich_help_panel=SERVER)] = "info",
) -> None:
    """Serve the model over HTTP with the OpenAI API, its experts offloaded.

    Endpoints: POST /v1/completions and /v1/chat/completions (streaming with
    "stream": true), GET /v1/models, /health and /metrics (Prometheus). Requests
    running at once share decode steps: their experts are loaded once per step and
    prefetched as the union of their predictions; each request's tokens are those of
    the same request run alone on the resident model (greedy at temperature 0; sampled
    with a seed: that seed's draws), whatever else runs (docs/serve.md). Stop with
    Ctrl-C.
    """
    check_range("--port", port, 1, 65535)
    check_range("--max-batch", max_batch, 1, 64)
    check_range("--max-queue", max_queue, 0, 10000)
    check_range("--threads", threads, 1, 1024)
    check_range("--workers", workers, 0, 64)
    if log_level not in ("warning", "info", "debug"):
        raise StmoeError(f"--log-level {log_level}: expected warning, info or debug")
    model = checked_model(model, capacity, memory)
    try:
        from stmoe.serve.runner import listening_socket, serve_forever
        from stmoe.serve.service import Service
    except ImportError as exc:
        raise StmoeError(f"serve needs fastapi and uvicorn ({exc}); install them with "
                         "pip install -e '.[hf]'") from None
    sock = listening_socket(host, port)  # before the load: a port in use fails at once
    with sock, offload_for("serve", model, store, capacity, threads, memory=memory,
                     predictor=predictor, tables=tables, policy=policy, tier=tier,
                     bandwidth=bandwidth, latency=latency, workers=workers,
                     admission=admission, format=weights, group_size=group_size,
                     in_place=in_place,
                     quantize_resident=quantize_resident,
                     lookahead=_lookahead(predictor)) as om:
        warm_up(om)  # the first request does not wait for numba's kernels
        service = Service(om, name or model.name, max_batch=max_batch, max_queue=max_queue)
        c = om.config
        out.print(f"serving {service.name} on http://{host}:{port}/v1 ({c['weights_label']} "
                  f"experts, {c['capacity']} of {c['num_experts']} per layer cached, predictor "
                  f"{c['predictor']}, tier {c['tier']}, up to {max_batch} requests per step; "
                  + _step_mode(service.batcher), markup=False)
        serve_forever(service, sock, log_level)  # closes the service


def _step_mode(batcher: StepBatcher) -> str:
    """What a decode step of several requests computes together, for the start line."""
    if batcher.batched:
        return ("a decode step is one batched forward: the int8/int4 kernels keep each "
                "row's bits, attention and routers row by row)")
    if batcher.share_rows:
        why = batcher.step_forward.why_not
        return (f"a step's linears computed together, each request's own forward: {why})")
    return "each request's rows computed alone: its bits)"


def _lookahead(predictor: str) -> str:
    """The early gate lookahead for the predictors that take one (a step of several
    requests has no per-layer start to predict the late one at), else the default."""
    from stmoe.predictors import REGISTRY

    cls = REGISTRY.get(predictor)
    return "early" if cls is not None and cls.uses_lookahead else _DEFAULT.lookahead
