"""`stmoe calibrate`: measure this machine as a hardware preset for `stmoe simulate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli.common import check_range, clean_label, out, path_option
from stmoe.runtime.options import MAX_SECONDS, TOKENS, CalibrateOptions

_D = CalibrateOptions()  # the one place calibrate's defaults are written


def calibrate_cmd(
    output: Annotated[Path, path_option("--output", "-o", help="Hardware .toml to write.")],
    model: Annotated[
        Path | None, path_option("--model", help="Model folder (a checkpoint `stmoe pack` "
                                 "packed). Default: stmoe's shipped model, as generate.")
    ] = None,
    store: Annotated[
        Path | None, path_option("--store", help="Its expert store (default: as generate).")
    ] = None,
    tier: Annotated[str, typer.Option(
        help="Tier to measure: disk, emulated, gpu (the store in pinned host memory) or "
             "gpu-disk (disk -> GPU).")] = _D.tier,
    bandwidth: Annotated[
        str | None, typer.Option(help="The emulated link's bandwidth (e.g. 1GB).")
    ] = _D.bandwidth,
    latency: Annotated[str, typer.Option(help="Link latency, e.g. 50us.")] = f"{_D.latency:g}",
    capacity: Annotated[
        str, typer.Option(help="The cache the preset describes (8, 50%, 64MB).")
    ] = _D.capacity,
    seconds: Annotated[float, typer.Option(help="Seconds of each read measurement.")] = _D.seconds,
    tokens: Annotated[int, typer.Option(help="Decode tokens of compute measured.")] = _D.tokens,
    threads: Annotated[int, typer.Option(help="Torch compute threads (generate's bounds).")
                       ] = _D.threads,
    workers: Annotated[
        int | None, typer.Option(help="Prefetch threads (default: the runtime's for the tier).")
    ] = _D.workers,
    routing: Annotated[
        Path | None,
        path_option(
            "--routing",
            help="A trace: read the blocks the runtime would read for it (the misses "
            "of an LRU cache of --capacity over its decode tokens, in order) instead "
            "of random ones, and take the single reader's speed from the runtime's own "
            "reads in an LRU-only replay of it.",
        ),
    ] = _D.routing,
    tables: Annotated[
        Path | None,
        path_option("--tables", help="Profiled tables the predictors' own time is measured "
                    "with (default: the model folder's shipped ones; none: not measured)."),
    ] = _D.tables,
    predictors: Annotated[str, typer.Option(
        help="Predictors whose time per decode layer call (learning, predicting) goes into "
             "the preset's [host.predictors], comma-separated, or none.")
    ] = ",".join(_D.predictors),
) -> None:
    """Measure the tier (bandwidth and latency reading expert blocks of the store, alone
    and with the prefetch workers), the compute per decode token at the model's sizes and,
    with tables, each predictor's own time per layer, with the runtime's own code; write
    them as a hardware preset whose every number says how, when and on what it was
    measured. `stmoe simulate --pipeline runtime --hardware
    OUT.toml` then predicts the runtime's decode time on this machine (docs/simulator.md).
    """
    from stmoe.errors import StmoeError
    from stmoe.runtime.calibrate import calibrate
    from stmoe.sim.host.calibrated import hardware_toml
    from stmoe.sim.specs import hardware_preset
    from stmoe.util.fileio import atomic_write_text, check_output_path

    if not 0 < seconds <= MAX_SECONDS:  # the API's bounds (NaN fails too)
        raise StmoeError(f"--seconds {seconds}: expected a number above 0 and at most "
                         f"{MAX_SECONDS:g}")
    check_range("--tokens", tokens, *TOKENS)
    check_range("--threads", threads, 1, 1024)  # generate's bounds (100000 crashed torch)
    check_range("--workers", workers, 0, 64)
    if output.suffix != ".toml":
        raise StmoeError(f"--output {clean_label(output)}: expected a .toml file name")
    check_output_path(output)
    options = CalibrateOptions(tier=tier, bandwidth=bandwidth, latency=latency, seconds=seconds,
                               tokens=tokens, threads=threads, workers=workers,
                               capacity=capacity, routing=routing, tables=tables,
                               predictors=_predictor_names(predictors))
    if model is None:
        from stmoe.models import SHIPPED_MODEL

        model = Path(SHIPPED_MODEL)
    figures = calibrate(model, store, options)
    atomic_write_text(output, hardware_toml(figures))
    spec = hardware_preset(str(output))  # what was written loads as a hardware spec
    host = spec.host
    assert host is not None
    if figures.get("runtime_reads"):
        out.print(f"the runtime's reads: {figures['runtime_reads']['mean_s'] * 1e3:.2f} ms an "
                  f"expert; calibrate's loop: {figures['loop_bytes_per_s'] / 1e9:.3f} GB/s "
                  "alone")
    out.print(f"read {spec.link_bytes_per_s / 1e9:.3f} GB/s alone, "
              f"{host.read_parallel_bytes_per_s / 1e9:.3f} GB/s with {host.workers + 1} readers, "
              f"latency {spec.link_latency_s * 1e6:.0f} us, first touch "
              f"{host.first_touch_s * 1e3:.2f} ms; per decode token: "
              f"{figures['token_s'] * 1e3:.1f} ms "
              f"({figures['experts_s'] * 1e3:.1f} in experts)")
    timed = figures.get("predictors") or {}
    if timed:
        out.print("per decode layer call: " + ", ".join(
            f"{name} {(t['learn_s'] + t['predict_s'] + t['admission_s']) * 1e6:.0f} us "
            f"(planner {t['learn_s'] * 1e6:.0f}, predictor {t['predict_s'] * 1e6:.0f}, "
            f"admission {t['admission_s'] * 1e6:.0f})" for name, t in timed.items()))
    elif options.predictors:
        out.print("the predictors' time not measured: no tables (--tables)")
    out.print(f"wrote {clean_label(output)}")


def _predictor_names(text: str) -> tuple[str, ...]:
    """``--predictors``: comma-separated names of the timed ones, or none."""
    from stmoe.errors import StmoeError
    from stmoe.runtime.calibrate.predictor_time import TIMED_PREDICTORS

    if text.strip().lower() == "none":
        return ()
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",")))
    bad = [n for n in names if n not in TIMED_PREDICTORS]
    if bad or not names:
        raise StmoeError(f"--predictors {clean_label(text)}: expected some of "
                         f"{', '.join(TIMED_PREDICTORS)} (comma-separated), or none")
    return names
