"""What the GPU check's decode table runs on: a real-shape checkpoint made there (RANDOM
weights), its store, recorded routing held out from the predictors' tables, and the plan
that forces it on every MoE layer.

Why each: a real shape (Qwen3.6-35B-A3B's 6 MiB experts, 256 a layer, top-8) moves real
bytes over the link; random weights need no download (the machine is offline); the router of
a random model routes unrealistically, so recorded routing replaces it
(``runtime.forced_routing``); and tables profiled on the very tokens replayed overstate
every predictor, so the trace is split by tokens as bench_offload_real.py splits it (its
first ``SPLIT_AT`` tokens profiled, the rest replayed after the ``SPLIT_PROMPT`` tokens
before them as the prompt). The trace is the shared sample
(../shared/traces, which the project cannot ship): ``prepare_routing`` copies its first
layers to ``out/gpu_check/routing.npz`` (ignored by git), which is carried to the GPU
machine. A dry run synthesizes routing of the tiny preset's shape instead; a rehearsal (a
dry run at the real shape, ``--rehearse``) makes the real checkpoint, one layer by default,
and replays the recorded routing, on the CPU.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stmoe.errors import StmoeError
from stmoe.sim.specs import model_preset
from stmoe.trace.select import held_out_tail, select_layers

if TYPE_CHECKING:
    from stmoe.runtime.forced_routing import RoutingPlan
    from stmoe.runtime.gpu_check.record import Check
    from stmoe.trace.schema import RoutingTrace

LIKE, DRY_LIKE = "qwen3.6-35b-a3b", "stmoe-tiny"  # the checkpoint's shape (a sim preset)
LAYERS, DRY_LAYERS = 4, 2  # MoE layers made (4: 6 GiB of experts, written in ~1 minute)
REHEARSAL_LAYERS = 1  # a rehearsal's, on the CPU (1.5 GiB of experts)
SAMPLE = "qwen3.6-35b-a3b_chat-1prompt.npz"  # in ../shared/traces
CARRIED = Path("out") / "gpu_check" / "routing.npz"  # under the checkout: what is carried
SPLIT_AT, SPLIT_PROMPT = 100, 8  # bench_offload_real.py's held-out split of the sample
DRY_SPLIT_AT, DRY_SPLIT_PROMPT = 20, 4
KEPT_LAYERS = 8  # the sample's first layers carried (the check makes up to 8)
PREPARED = "gpu_check_split"  # the carried file's extra: stmoe-plus-split's caches, sized
SPLIT_SHARE = 0.5  # the share of the experts stmoe-plus-split's per-layer caches add up to


@dataclass
class Setup:
    """The decode table's checkpoint, store, tables and forced routing."""

    like: str
    layers: int
    model_dir: Path
    store: Path
    tables: Path
    routing: Path  # the replayed sequence (a trace file: calibrate takes it)
    plan: RoutingPlan
    source: str  # where the routing came from, said beside every figure
    steps: int  # new tokens per replay
    # each layer's cache at SPLIT_SHARE for stmoe-plus, sized from the profiled head alone
    # (its own tail replayed with tables of its start: ``layer_capacity.size_split``), so
    # the replayed routing stays held out; None where it could not be sized (``split_error``
    # says why): only stmoe-plus-split's run is lost, not the table
    split: tuple[int, ...] | None
    split_error: str = ""
    split_sized: str = "here"  # or "at --prepare" (read from the carried routing's file)


def prepare_routing(shared: Path, out: Path) -> Path:
    """The shared sample's first KEPT_LAYERS layers as ``out`` (a native trace file), for a
    GPU machine that has no ../shared; a clear error where the sample is missing."""
    from stmoe.trace import load_trace, save_trace

    sample = shared / SAMPLE
    if not sample.is_file():
        raise StmoeError(f"{sample}: no such trace; --prepare needs ../shared/traces")
    out.parent.mkdir(parents=True, exist_ok=True)
    trace = select_layers(load_trace(sample), str(KEPT_LAYERS))
    head, _ = held_out_tail(select_layers(trace, str(LAYERS)), SPLIT_AT, SPLIT_PROMPT)
    extra = dict(trace.meta.extra)
    try:  # (what cannot be sized here is sized, or its run lost, on the GPU machine)
        extra[PREPARED] = {**_split_key(head), "capacities": list(_size_split(head))}
    except Exception as exc:
        print(f"stmoe-plus-split's caches not sized here ({type(exc).__name__}: {exc})")
    save_trace(dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, extra=extra)),
               out)
    return out


def _split_key(head: RoutingTrace) -> dict[str, int]:
    """What a split was sized for: the profiled tokens' very routing (a checksum: their
    layers, their split point and their rows), the total it shares out, and the code that
    sized it; a prepared split is used only where all three match."""
    return {"experts_cached": round(SPLIT_SHARE * head.num_experts),
            "head": zlib.crc32(np.ascontiguousarray(head.experts).tobytes()),
            "code": _package_checksum()}


def _package_checksum() -> int:
    """A checksum of stmoe's sources (the sizing's, its predictors' and replay's among
    them): a split sized before any of them changed is sized again, not trusted."""
    import stmoe

    root, crc = Path(stmoe.__file__).parent, 0
    for path in sorted(root.rglob("*.py")):
        crc = zlib.crc32(path.read_bytes(), zlib.crc32(path.relative_to(root).as_posix()
                                                       .encode(), crc))
    return crc


def _size_split(head: RoutingTrace) -> tuple[int, ...]:
    from stmoe.evaluate.layer_capacity import size_split

    return size_split(head, _split_key(head)["experts_cached"]).capacities


def _prepared_split(head: RoutingTrace) -> tuple[int, ...] | None:
    """The split ``--prepare`` sized for this very head (numba's replay kernels compile
    for about 20 s on a cold machine: the GPU machine's time), or None."""
    prepared, key = head.meta.extra.get(PREPARED), _split_key(head)
    if not isinstance(prepared, dict) or {k: prepared.get(k) for k in key} != key:
        return None
    caps = prepared.get("capacities")
    if (not isinstance(caps, list) or len(caps) != head.num_layers
            or not all(isinstance(n, int) and head.top_k <= n <= head.num_experts
                       for n in caps)
            or sum(caps) != key["experts_cached"] * head.num_layers):
        return None  # (not what prepare writes: sized again here)
    return tuple(caps)


def setup(c: Check) -> Setup:
    """Made once per run (the stages after the decode table reuse it): the checkpoint and
    store under ``c.work``, the routing split, the tables profiled on its head."""
    if "setup" not in c.shared:
        c.shared["setup"] = _make(c)
    made: Setup = c.shared["setup"]
    return made


def _make(c: Check) -> Setup:
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint
    from stmoe.predictors import profile, save_tables
    from stmoe.runtime.forced_routing import plan_routing
    from stmoe.runtime.store import pack_folder
    from stmoe.trace import save_trace

    like = DRY_LIKE if c.tiny else LIKE
    layers = c.layers or (DRY_LAYERS if c.tiny else REHEARSAL_LAYERS if c.dry else LAYERS)
    head, tail, label = held_out(c, layers)
    model_dir = make_checkpoint(plan_checkpoint(like, layers, "float32" if c.tiny else
                                                "bfloat16"), c.work / "model")
    store = pack_folder(model_dir, c.work / "store")
    tables = save_tables(profile(head), c.work / "tables.npz")
    routing = c.work / "replayed.npz"
    save_trace(tail, routing)
    spec = model_preset(like)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size
    plan = plan_routing(tail, 0, layers, spec.num_experts, spec.top_k, vocab, routing)
    split_error, sized = "", "here"
    split = None if c.tiny else _prepared_split(head)
    if split is not None:
        sized = "at --prepare"
    else:
        try:
            split = _size_split(head)
        except Exception as exc:  # (a head with too few decode tokens, say): that run's loss
            split_error = f"{type(exc).__name__}: {exc}"
    return Setup(like, layers, model_dir, store, tables, routing, plan, label,
                 min(c.tokens, plan.new_tokens), split, split_error, sized)


def held_out(c: Check, layers: int) -> tuple[RoutingTrace, RoutingTrace, str]:
    """The routing's first ``layers`` layers split by tokens: (profiled, replayed, where it
    came from and how it was split)."""
    trace, source = _trace(c, layers)
    at, prompt = (DRY_SPLIT_AT, DRY_SPLIT_PROMPT) if c.tiny else (SPLIT_AT, SPLIT_PROMPT)
    head, tail = held_out_tail(select_layers(trace, str(layers)), at, prompt)
    decode = tail.num_tokens - prompt
    return head, tail, (f"{source}; HELD-OUT tables (profiled on tokens 0..{at - 1}, the "
                        f"{decode} decode tokens from {at} on replayed)")


def _trace(c: Check, layers: int) -> tuple[RoutingTrace, str]:
    """The recorded routing (the carried file, else the shared sample), or in a dry run a
    synthetic trace of the tiny preset's shape; with where it came from."""
    from stmoe.trace import load_trace, synthesize

    if c.tiny:
        spec = model_preset(DRY_LIKE)
        tokens = DRY_SPLIT_AT + c.tokens + 1
        trace = synthesize(tokens=tokens, layers=layers, experts=spec.num_experts,
                           top_k=spec.top_k, sequences=1, prefill_fraction=0.1, seed=3)
        return trace, "SYNTHETIC routing (dry run)"
    for path in (c.routing, c.repo / CARRIED if c.repo else None,
                 c.repo.parent / "shared" / "traces" / SAMPLE if c.repo else None):
        if path is not None and path.is_file():
            return load_trace(path), f"routing recorded from Qwen3.6-35B-A3B ({path.name})"
    raise StmoeError("no recorded routing: run `benchmarks/gpu_check.py --prepare` where "
                     "../shared/traces is, and carry out/gpu_check to the GPU machine")
