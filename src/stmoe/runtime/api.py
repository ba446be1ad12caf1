"""``stmoe.offload``: run a transformers MoE model with its experts offloaded.

    with stmoe.offload("path/to/model", capacity="50%", predictor="stmoe") as om:
        result = om.generate("def fib(n):", max_new_tokens=64)
        print(result.text, result.decode_tokens_per_s, result.hit_rate)

The model keeps every non-expert weight resident; each MoE layer's experts come from the
store (in its weight format) through the chosen tier into a bounded cache, prefetched ahead
by the predictor. Outputs are bit-identical to the resident model in that format."""

from __future__ import annotations

import shutil
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from stmoe.errors import OffloadError
from stmoe.hf.completion_text import AfterPrompt
from stmoe.hf.layout import ModelLayout
from stmoe.hf.loading import load_without_experts
from stmoe.predictors.base import ModelShape
from stmoe.quant.experts import plan_format, select
from stmoe.quant.linears import quantize_linears
from stmoe.runtime.accelerator import GPU_TIERS, accelerator
from stmoe.runtime.arguments import checked_call
from stmoe.runtime.engine import OffloadEngine
from stmoe.runtime.forced_routing import RoutingPlan, RoutingSource
from stmoe.runtime.hf_glue import IMPL_NAME, register
from stmoe.runtime.options import OffloadOptions, resolve_predictor, top_k_of
from stmoe.runtime.placement import place
from stmoe.runtime.prompts import greedy_generate, prompt_ids
from stmoe.runtime.state import EngineSettings
from stmoe.runtime.stats import RuntimeStats
from stmoe.runtime.step import Holder
from stmoe.runtime.store import ExpertStore, default_store_dir, open_store, pack
from stmoe.runtime.store.packing import temporary_store_dir
from stmoe.runtime.store.reading import open_tier
from stmoe.trace.ranks import unranked_error
from stmoe.util.progress import announced_byte_progress

T = TypeVar("T")


@dataclass
class GenerationResult:
    """Generated tokens and what the runtime measured (decode's; the prompt's if none was)."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float
    decode_tokens: int
    decode_s: float
    decode_tokens_per_s: float
    hit_rate: float
    prefetch_recall: float
    prefetch_precision: float
    bytes_moved: int
    bytes_wasted: int
    stall_s: float
    stall_share: float
    config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OffloadedModel:
    """A model whose experts are served by an ``OffloadEngine``; close() (or ``with``) ends it.

    Safe to share between threads: ``generate``, ``measure`` and ``close`` take one lock,
    so calls run one after the other, each exactly as it would alone. A forward of
    ``model`` called directly while another thread's call runs is refused (one line)."""

    def __init__(self, model: torch.nn.Module, engine: OffloadEngine, tokenizer: Any,
                 config: dict[str, Any], cleanup: Path | None = None) -> None:
        self.model, self.engine, self.tokenizer, self.config = model, engine, tokenizer, config
        self._cleanup = cleanup
        self._serial = threading.Lock()  # one measured run at a time
        self._batchers: weakref.WeakSet[Holder] = weakref.WeakSet()  # StepBatchers on it

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the model, after a call another thread is running (called from inside a
        run, it ends that run at its next layer) and any step batcher serving it (its
        requests cancelled). A second close does nothing."""
        for batcher in list(self._batchers):
            batcher.close()
        with nullcontext() if self.engine.serves_caller() else self._serial:
            self.engine.close()
        if self._cleanup is not None:
            shutil.rmtree(self._cleanup, ignore_errors=True)

    @contextmanager
    def exclusive(self, routing: RoutingSource | None = None) -> Iterator[None]:
        """This thread's measured run (``routing`` forced on it): after any other thread's,
        the engine claimed (refused while another thread's call runs or a batcher serves)."""
        self.engine.refuse_nested()  # before the lock: waiting for ourselves would hang
        me = threading.current_thread()
        if any(b.thread is not me and not b.closed for b in self._batchers):
            raise OffloadError("this offloaded model is serving a StepBatcher, which holds it "
                               "until it is closed: submit requests to the batcher, or close "
                               "it first")
        with self._serial, self.engine.claimed_run(routing):
            yield

    def attach(self, batcher: Holder) -> None:
        """A step batcher now serves this model (``close`` closes it first)."""
        self._batchers.add(batcher)

    def generate(
        self, prompt: str | list[int] | torch.Tensor, max_new_tokens: int = 32, cold: bool = True
    ) -> GenerationResult:
        """Greedy generation from ``prompt`` (text, or token ids: a list or a 1-D tensor),
        measured (from an empty cache when ``cold``)."""
        if max_new_tokens < 1:
            raise OffloadError("max_new_tokens must be at least 1")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise OffloadError("this offloaded model has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        else:
            ids = prompt_ids(prompt, self.model.config)
        if ids.shape[1] == 0:
            raise OffloadError("the prompt has no tokens")
        return self._generate(ids, max_new_tokens, cold, None)

    def force_routing(self, plan: RoutingPlan, max_new_tokens: int | None = None,
               cold: bool = True) -> GenerationResult:
        """Generate with ``plan``'s recorded routing in place of the router's
        (``runtime.forced_routing``): the time, stalls, hits and bytes of that routing
        at this model's sizes. The text is meaningless and left empty."""
        if self.engine.predictor.uses_lookahead:
            raise OffloadError(f"predictor {self.engine.predictor.name!r} reads the model's own "
                               "routers, which a routing replay overrides; replay with a "
                               "predictor that learns from the routing (stmoe, stmoe-plus, "
                               "...)")
        reason = self.engine.predictor.rank_order_reason()
        if reason and not plan.ranked:  # the forced rows teach the predictor
            raise unranked_error(f"predictor {self.engine.predictor.name!r}", reason,
                                 plan.source or "this routing")
        steps = plan.new_tokens if max_new_tokens is None else min(max_new_tokens, plan.new_tokens)
        if steps < 1:
            raise OffloadError("max_new_tokens must be at least 1")
        ids = torch.tensor([plan.token_ids], device=self.engine.device)
        result = self._generate(ids, steps, cold, RoutingSource(plan))
        result.text = ""
        result.config["routing_replay"] = True
        return result

    replay = force_routing  # the former name, for one release

    def _generate(self, ids: torch.Tensor, max_new_tokens: int, cold: bool,
                  replay: RoutingSource | None) -> GenerationResult:
        ids = ids.to(self.engine.device)
        with self.exclusive(replay):  # the run is read after it, before another starts
            out, stats = self._measure(lambda: self._run(ids, max_new_tokens), cold)
            run = self.engine.run
        ends = run.forward_ends
        if not ends.count:
            raise OffloadError("the generation ran no forward call of the model")
        ttft = ends.first - run.started
        decode_tokens = ends.count - 1
        decode_s = ends.last - ends.first if decode_tokens else 0.0
        new = out[0, ids.shape[1] :].tolist()
        phase = stats.phases["decode" if decode_tokens else "prefill"].summary()
        text = (AfterPrompt(self.tokenizer, ids[0].tolist())(new)  # (its first space kept)
                if self.tokenizer is not None else "")
        return GenerationResult(
            tokens=new, text=text, prompt_tokens=int(ids.shape[1]), ttft_s=ttft,
            decode_tokens=decode_tokens, decode_s=decode_s,
            decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
            hit_rate=phase["hit_rate"], prefetch_recall=phase["prefetch_recall"],
            prefetch_precision=phase["prefetch_precision"], bytes_moved=stats.bytes_moved,
            bytes_wasted=stats.bytes_wasted, stall_s=phase["stall_s"],
            stall_share=phase["stall_s"] / decode_s if decode_s > 0 else 0.0,
            config=dict(self.config), stats=stats.to_dict(),
        )

    def measure(self, fn: Callable[[], T], cold: bool = True) -> tuple[T, RuntimeStats]:
        """Run ``fn`` (any use of ``self.model``) as one measured run, from an empty
        cache when ``cold`` (else the experts left by the previous run stay).

        For the oracle, ``fn`` runs twice: a first pass records the routing the oracle
        then knows in advance, so ``fn`` must give the same routing twice (greedy, or a
        sampler seeded inside ``fn``; a streamer it feeds gets both passes). Runs of
        several threads are serialised (see the class docstring).
        """
        with self.exclusive():
            return self._measure(fn, cold)

    def _measure(self, fn: Callable[[], T], cold: bool) -> tuple[T, RuntimeStats]:
        if self.engine.predictor.sees_future:
            self.engine.reset(future={}, cold=cold)
            fn()
            self.engine.reset(future=dict(self.engine.run.routing_log), cold=cold)
        else:
            self.engine.reset(future=None, cold=cold)
        result = fn()
        stats = self.engine.finish()
        self.engine.state.device_times(stats)  # a gpu tier's copies and waits, device-timed
        return result, stats

    def _run(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        return greedy_generate(self.model, ids, max_new_tokens, ignore_eos=True)


def offload(
    model_or_dir: torch.nn.Module | str | Path,
    store: str | Path | None = None,
    options: OffloadOptions | None = None,
    **overrides: Any,
) -> OffloadedModel:
    """Offload a model's routed experts (see the module docstring).

    ``model_or_dir``: a loaded model (its expert tensors are released) or a
    model folder (the experts are never loaded). ``store``: a folder written by
    ``stmoe pack``; by default one is packed on first use (a cache directory for
    a folder, a temporary one for a loaded model). ``options``: an
    ``OffloadOptions`` (default: its defaults); ``overrides``: any of its fields by
    name, e.g. ``offload(d, capacity="25%", tier="emulated", bandwidth="1GB")`` (an
    unknown name is refused with the list). The fields: capacity, predictor, tables,
    policy, tier, bandwidth, latency, workers, max_loads, lookahead, admission, format,
    group_size, quantize_resident, memory, in_place
    (``help(stmoe.runtime.options.OffloadOptions)`` says what each does).
    """
    options = checked_call(model_or_dir, store, options, overrides)
    options.check()
    if options.tier in GPU_TIERS:
        accelerator(options.tier)  # no GPU: refused before anything loads
    register()
    if isinstance(model_or_dir, (str, Path)):
        model_dir = _checked_model_dir(model_or_dir)
        # the store matched to the folder's checkpoint before anything is loaded
        weights, in_place = options.weight_format(), options.in_place
        verb = "indexing (reading once)" if in_place else "packing"
        expert_store = open_store(model_dir, store, progress=announced_byte_progress(
            lambda total: f"{verb} {model_dir.name}'s experts ({total / 2**20:.0f} MiB) into "
            f"{default_store_dir(model_dir, weights, in_place)} (first use; later runs reuse "
            "it)"), weights=weights, in_place=in_place)
        model = load_without_experts(model_dir).model
        return _offload(model, expert_store, options, model_dir, _tokenizer(model_dir), None)
    model = model_or_dir
    if options.in_place:
        raise OffloadError("in_place reads a model folder's checkpoint files; offload the "
                           "folder, not a loaded model")
    if getattr(model.config, "_experts_implementation", None) == IMPL_NAME:
        raise OffloadError("this model is already offloaded (or was, and is closed); "
                           "offload a freshly loaded model or its folder")
    cleanup = None
    if store is None:
        cleanup = temporary_store_dir()
        try:
            pack(model, cleanup, weights=options.weight_format())
        except BaseException:
            shutil.rmtree(cleanup, ignore_errors=True)
            raise
    store_path = Path(store) if store is not None else cleanup
    assert store_path is not None
    try:  # the model's own expert bytes are compared with the store's (``check_model``)
        return _offload(model, ExpertStore(store_path), options, None, None, cleanup)
    except BaseException:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise


def _offload(model: torch.nn.Module, expert_store: ExpertStore, options: OffloadOptions,
             model_dir: Path | None, tokenizer: Any,
             cleanup: Path | None) -> OffloadedModel:
    resident = options.resident_format()
    kept = quantize_linears(model, resident) if resident is not None else []
    layout = ModelLayout.of(model)  # found once, handed to the checks and the engine
    modules, weights = [m for _, m in layout.modules], expert_store.weights
    planned = plan_format(modules, weights, options.weight_format(), str(expert_store.path))
    expert_store.check_model(model, layout, planned)  # the blocks' layouts and weights first
    select(model, modules, planned, weights)  # a native model's experts in the store's format
    shape = ModelShape(layout.num_layers, int(expert_store.model["num_experts"]),
                       top_k_of(model.config))
    # first: its tables and compiled kernels (stmoe-plus: ~22 MiB) are in the process measured
    pred = resolve_predictor(options, shape, model_dir)
    placed = place(model, expert_store, options, shape)  # the cache's size; the device
    capacities, plan = placed.capacities, placed.plan
    if placed.accel is not None:  # the move put new Parameters in place: the routers the
        layout = ModelLayout.of(model)  # lookahead reads are found again on the device
    acc = placed.accel
    source = open_tier(options.tier, expert_store, options.bandwidth, options.latency,
                       acc.ops if acc else None, acc.pinning if acc else None,
                       options.worker_count())
    settings = EngineSettings(capacities, options.policy, options.worker_count(),
                              placed.device, options.max_loads, options.admission)
    try:
        engine = OffloadEngine(model, expert_store, source, pred, settings, layout)
    except BaseException:
        source.close()
        raise
    model.set_experts_implementation(IMPL_NAME)
    uniform = len(set(capacities)) == 1  # "capacity": one count, or each layer's
    config = {"store": str(expert_store.path),
              "capacity": capacities[0] if uniform else list(capacities), "capacity_share":
              sum(capacities) / (len(capacities) * shape.num_experts),
              "predictor": pred.name, "policy": settings.policy,
              "tier": options.tier, "emulated": source.emulated, "workers": settings.workers,
              "max_loads": engine.max_loads, "admission": settings.admission,
              "lookahead": pred.point if pred.uses_lookahead else None,
              "num_layers": shape.num_layers, "num_experts": shape.num_experts,
              "top_k": shape.top_k, "weights": weights.short, "weights_label": weights.label,
              "in_place": expert_store.in_place,
              "resident_weights": resident.name if resident else "native", "resident_kept": kept,
              "expert_bytes": engine.expert_bytes, "cache_bytes": engine.cache_bytes,
              "memory_plan": asdict(plan) if plan else None,
              "device": acc.name if acc else None}
    if options.tier == "emulated":
        config.update(bandwidth=source.bandwidth, latency=source.latency)  # type: ignore[attr-defined]
    if options.tier in ("disk", "gpu-disk"):
        config.update(direct_io=source.direct)  # type: ignore[attr-defined]
    return OffloadedModel(model, engine, tokenizer, config, cleanup)


def _checked_model_dir(model_or_dir: str | Path) -> Path:
    """The model folder, refused in one line when it is not a checkpoint folder."""
    d = Path(model_or_dir)
    if not (d / "config.json").is_file():
        why = ("no config.json; not a transformers checkpoint folder" if d.is_dir() else
               "not a folder" if d.exists() else "no such folder")
        raise OffloadError(f"{d}: {why}; stmoe.offload takes a local checkpoint folder "
                           "(config.json, *.safetensors) or a loaded model")
    return d


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return None
