"""``stmoe.offload``: run a transformers MoE model with its experts offloaded.

    with stmoe.offload("path/to/model", capacity="50%", predictor="stmoe") as om:
        result = om.generate("def fib(n):", max_new_tokens=64)
        print(result.text, result.decode_tokens_per_s, result.hit_rate)

The model keeps every non-expert weight resident; each MoE layer's experts come
from the store through the chosen tier into a bounded cache, prefetched ahead
by the predictor. Outputs are bit-identical to the resident model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from stmoe.capture import experts_modules
from stmoe.predictors import make
from stmoe.predictors.base import ModelShape, Predictor
from stmoe.runtime.cache import POLICIES
from stmoe.runtime.engine import IMPL_NAME, OffloadEngine, register
from stmoe.runtime.loading import load_without_experts
from stmoe.runtime.stats import RuntimeStats
from stmoe.runtime.store import ExpertStore, StoreError, pack
from stmoe.runtime.tiers import (
    DiskTier,
    EmulatedLinkTier,
    PinnedHostTier,
    Tier,
    parse_bytes,
    parse_seconds,
)

T = TypeVar("T")
TIERS = ("disk", "emulated", "gpu")
SHIPPED_TABLES = "stmoe-tables.npz"  # next to the shipped model: profiled on DEFAULT_PROMPTS
_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k",
                "experts_per_token", "n_activated_experts")  # fmt: skip


# The offloading systems the demo and benchmarks/bench_runtime.py compare, at one cache size.
COMPARED_SYSTEMS = {  # name: (predictor, cache policy)
    "on-demand": ("ondemand", "none"),  # no prefetch, no reuse: the usual baseline
    "lru-only": ("ondemand", "lru"),  # no prefetch, LRU cache
    "stmoe": ("stmoe", "predicted"),
    "stmoe-plus": ("stmoe-plus", "predicted"),
    "hybrid": ("hybrid", "predicted"),
    "oracle": ("oracle", "predicted"),
}
PLUS_BUDGET = 1.5  # stmoe-plus and hybrid predict 1.5K experts per layer in those comparisons


def compared_predictor(predictor: str, tables: Any) -> str | Predictor:
    """The predictor of a compared system: stmoe-plus and hybrid at 1.5K experts."""
    if predictor in ("stmoe-plus", "hybrid"):
        return make(predictor, tables.shape, tables, budget=PLUS_BUDGET * tables.shape.top_k)
    return predictor


def top_k_of(config: Any) -> int:
    """The router's K from a transformers config (text sub-config included)."""
    for cfg in (config, getattr(config, "text_config", None)):
        for name in _TOP_K_NAMES:
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    raise StoreError(f"cannot tell the router's top-k from the {type(config).__name__}; "
                     f"expected one of {', '.join(_TOP_K_NAMES)}")  # fmt: skip


def resolve_capacity(capacity: int | str, num_layers: int, num_experts: int, top_k: int,
                     expert_bytes: int) -> int:  # fmt: skip
    """Experts per layer from a count (8), a share of the experts ('50%'), or a byte
    budget for the whole model ('64MB'); below top-K is an error."""
    text = str(capacity).strip()
    try:
        if isinstance(capacity, int) or text.isdigit():
            count = int(text)
        elif text.endswith("%"):
            count = round(float(text[:-1]) / 100 * num_experts)
        else:
            count = int(parse_bytes(text) // (expert_bytes * num_layers))
    except (ValueError, StoreError):
        raise StoreError(f"capacity {capacity!r}: expected experts per layer (8), a share "
                         "of the experts (50%) or a byte budget (64MB)") from None  # fmt: skip
    if count < top_k:
        raise StoreError(f"capacity {capacity!r} gives {count} experts per layer, below the "
                         f"router's top-{top_k}; one token's experts must fit, so use at least "
                         f"{top_k} (of {num_experts})")  # fmt: skip
    return min(count, num_experts)


def default_store_dir(model_dir: Path) -> Path:
    """Where a model folder's store is packed on first use (``STMOE_CACHE`` overrides)."""
    root = Path(os.environ.get("STMOE_CACHE", Path.home() / ".cache" / "stmoe")) / "stores"
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in [*sorted(model_dir.glob("*.safetensors")), model_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return root / f"{model_dir.name}-{h.hexdigest()[:16]}"


def ensure_store(model_dir: Path, store: str | Path | None) -> Path:
    """The given store, or the model's cached one, packed now if missing."""
    if store is not None:
        return Path(store)
    out = default_store_dir(model_dir)
    if not (out / "index.json").is_file():
        from stmoe.capture_generate import load_causal_lm

        pack(load_causal_lm(model_dir), out)
    return out


@dataclass
class GenerationResult:
    """Generated tokens and what the runtime measured (decode figures headline)."""

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
    """A model whose experts are served by an ``OffloadEngine``; close() (or ``with``) ends it."""

    def __init__(self, model: torch.nn.Module, engine: OffloadEngine, tokenizer: Any,
                 config: dict[str, Any], cleanup: Path | None = None) -> None:  # fmt: skip
        self.model, self.engine, self.tokenizer, self.config = model, engine, tokenizer, config
        self._cleanup = cleanup

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.engine.close()
        if self._cleanup is not None:
            shutil.rmtree(self._cleanup, ignore_errors=True)

    def generate(
        self, prompt: str | list[int], max_new_tokens: int = 32, cold: bool = True
    ) -> GenerationResult:
        """Greedy generation from ``prompt`` (text, or token ids), measured (from an
        empty cache when ``cold``)."""
        if max_new_tokens < 1:
            raise StoreError("max_new_tokens must be at least 1")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise StoreError("this offloaded model has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        else:
            ids = _prompt_ids(prompt, self.model.config)
        if ids.shape[1] == 0:
            raise StoreError("the prompt has no tokens")
        ids = ids.to(self.engine.device)
        out, stats = self.measure(lambda: self._run(ids, max_new_tokens), cold=cold)
        ends = self.engine.forward_ends
        ttft = ends[0] - self.engine.started
        decode_tokens = len(ends) - 1
        decode_s = ends[-1] - ends[0] if decode_tokens else 0.0
        new = out[0, ids.shape[1] :].tolist()
        phase = stats.phases["decode" if decode_tokens else "prefill"].summary()
        text = self.tokenizer.decode(new) if self.tokenizer is not None else ""
        return GenerationResult(
            tokens=new, text=text, prompt_tokens=int(ids.shape[1]), ttft_s=ttft,
            decode_tokens=decode_tokens, decode_s=decode_s,
            decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
            hit_rate=phase["hit_rate"], prefetch_recall=phase["prefetch_recall"],
            prefetch_precision=phase["prefetch_precision"], bytes_moved=stats.bytes_moved,
            bytes_wasted=stats.bytes_wasted, stall_s=phase["stall_s"],
            stall_share=phase["stall_s"] / decode_s if decode_s > 0 else 0.0,
            config=dict(self.config), stats=stats.to_dict(),
        )  # fmt: skip

    def measure(self, fn: Callable[[], T], cold: bool = True) -> tuple[T, RuntimeStats]:
        """Run ``fn`` (any use of ``self.model``) as one measured run, from an empty
        cache when ``cold`` (else the experts left by the previous run stay).

        For the oracle, ``fn`` runs twice: a first pass records the routing the
        oracle then knows in advance (outputs are the same, being lossless).
        """
        if self.engine.predictor.sees_future:
            self.engine.reset(future={}, cold=cold)
            fn()
            self.engine.reset(future=dict(self.engine.routing_log), cold=cold)
        else:
            self.engine.reset(future=None, cold=cold)
        result = fn()
        return result, self.engine.finish()

    def _run(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        gen = self.model.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
        if isinstance(pad, list):
            pad = pad[0]
        with torch.no_grad():
            return self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=pad)  # fmt: skip


def _prompt_ids(prompt: Any, config: Any) -> torch.Tensor:
    """[1, S] token ids from a flat list of ints within the vocabulary."""
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None)  # fmt: skip
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise StoreError(
                f"prompt token {i} is {t!r}; expected text or a flat list of token ids"
            )
        if t < 0 or (vocab is not None and t >= vocab):
            raise StoreError(f"prompt token {i} is {t}, outside the vocabulary 0..{vocab - 1}"
                             if vocab else f"prompt token {i} is negative")  # fmt: skip
        ids.append(int(t))
    return torch.tensor([ids], dtype=torch.long)


def offload(
    model_or_dir: torch.nn.Module | str | Path,
    store: str | Path | None = None,
    *,
    capacity: int | str = "50%",
    predictor: str | Predictor = "stmoe",
    tables: str | Path | None = None,
    policy: str = "predicted",
    tier: str = "disk",
    bandwidth: float | str | None = None,
    latency: float | str = 0.0,
    workers: int | None = None,
    budget: int | None = None,
    lookahead: str = "auto",
) -> OffloadedModel:
    """Offload a model's routed experts (see the module docstring).

    ``model_or_dir``: a loaded model (its expert tensors are released) or a
    model folder (the experts are never loaded). ``store``: a folder written by
    ``stmoe pack``; by default one is packed on first use (a cache directory for
    a folder, a temporary one for a loaded model). ``tier``: ``disk`` (real reads
    bypassing the page cache), ``emulated`` (host memory behind a link of
    ``bandwidth`` bytes/s and ``latency`` s, EMULATED) or ``gpu`` (pinned host
    memory to a CUDA cache). ``workers``: prefetch threads; by default 2 for the
    disk (a device serves reads in parallel) and 1 for the single-link tiers, where
    a second thread only queues another transfer ahead of the next miss.
    ``lookahead`` (hybrid, gate-lookahead): which gate lookahead, ``early`` (the
    next layer's router on this layer's MoE input, predicted as this layer routes)
    or ``late`` (the next layer's router on its own input through its pre-MoE norm,
    predicted as that layer starts: closer to the router, less time to load);
    ``auto``: late where the model's norms are recognised.
    """
    if tier not in TIERS:
        raise StoreError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    if policy not in POLICIES:
        raise StoreError(f"unknown cache policy {policy!r}; choose from {', '.join(POLICIES)}")
    register()
    tokenizer, cleanup, model_dir = None, None, None
    if isinstance(model_or_dir, (str, Path)):
        model_dir = Path(model_or_dir)
        store_path = ensure_store(model_dir, store)
        model = load_without_experts(model_dir).model
        tokenizer = _tokenizer(model_dir)
    else:
        model = model_or_dir
        if getattr(model.config, "_experts_implementation", None) == IMPL_NAME:
            raise StoreError("this model is already offloaded (or was, and is closed); "
                             "offload a freshly loaded model or its folder")  # fmt: skip
        if store is None:
            cleanup = Path(tempfile.mkdtemp(prefix="stmoe-store-"))
            try:
                pack(model, cleanup)
            except BaseException:
                shutil.rmtree(cleanup, ignore_errors=True)
                raise
        store_path = Path(store) if store is not None else cleanup
    assert store_path is not None
    try:
        return _offload(model, store_path, tokenizer, model_dir, cleanup, capacity, predictor,
                        tables, policy, tier, bandwidth, latency, workers, budget,
                        lookahead)  # fmt: skip
    except BaseException:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise


def _offload(model: torch.nn.Module, store_path: Path, tokenizer: Any, model_dir: Path | None,
             cleanup: Path | None, capacity: int | str, predictor: str | Predictor,
             tables: str | Path | None, policy: str, tier: str, bandwidth: float | str | None,
             latency: float | str, workers: int | None, budget: int | None,
             lookahead: str = "auto") -> OffloadedModel:  # fmt: skip
    expert_store = ExpertStore(store_path)
    expert_store.check_model(model)
    shape = ModelShape(len(experts_modules(model)), int(expert_store.model["num_experts"]),
                       top_k_of(model.config))  # fmt: skip
    per_layer = resolve_capacity(capacity, shape.num_layers, shape.num_experts, shape.top_k,
                                 expert_store.blocks[(0, 0)].nbytes)  # fmt: skip
    if isinstance(predictor, Predictor):
        pred = predictor
        if lookahead != "auto":
            _check_lookahead_option(pred.name, pred.uses_lookahead, lookahead)
            pred.lookahead_pref = lookahead
    else:
        pred = _predictor(predictor, shape, tables, model_dir, lookahead)
    device = None
    if tier == "gpu":
        if not torch.cuda.is_available():
            raise StoreError("--tier gpu needs CUDA, and torch sees no GPU here; use --tier disk "
                             "or --tier emulated")  # fmt: skip
        device = torch.device("cuda")
        _move_resident(model, device)
    source = _tier(tier, expert_store, bandwidth, latency)
    if workers is None:
        workers = 2 if tier == "disk" else 1
    try:
        engine = OffloadEngine(model, expert_store, source, per_layer, pred, policy, workers,
                               device, budget)  # fmt: skip
    except BaseException:
        source.close()
        raise
    model.set_experts_implementation(IMPL_NAME)
    config = {"store": str(store_path), "capacity": per_layer, "capacity_share":
              per_layer / shape.num_experts, "predictor": pred.name, "policy": policy,
              "tier": tier, "emulated": source.emulated, "workers": workers,
              "prefetch_budget": engine.budget,
              "lookahead": pred.point if pred.uses_lookahead else None,
              "num_layers": shape.num_layers, "num_experts": shape.num_experts,
              "top_k": shape.top_k, "expert_bytes": engine.expert_bytes,
              "cache_bytes": engine.cache_bytes}  # fmt: skip
    if tier == "emulated":
        config.update(bandwidth=source.bandwidth, latency=source.latency)  # type: ignore[attr-defined]
    if tier == "disk":
        config.update(direct_io=source.direct)  # type: ignore[attr-defined]
    return OffloadedModel(model, engine, tokenizer, config, cleanup)


def _tier(name: str, store: ExpertStore, bandwidth: float | str | None,
          latency: float | str) -> Tier:  # fmt: skip
    if isinstance(latency, str):
        latency = parse_seconds(latency)
    if name == "disk":
        return DiskTier(store)
    if name == "gpu":
        return PinnedHostTier(store)
    if bandwidth is None:
        raise StoreError("the emulated tier needs a bandwidth (bytes/s, e.g. 200MB)")
    bw = parse_bytes(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
    return EmulatedLinkTier(store, bw, latency)


def _predictor(name: str, shape: ModelShape, tables: str | Path | None,
               model_dir: Path | None, lookahead: str = "auto") -> Predictor:  # fmt: skip
    from stmoe.predictors import REGISTRY
    from stmoe.predictors.tables import load_tables

    cls = REGISTRY.get(name)
    options = {}
    if lookahead != "auto":
        _check_lookahead_option(name, cls is not None and cls.uses_lookahead, lookahead)
        options["lookahead"] = lookahead
    loaded = None
    if cls is not None and cls.needs_tables:
        if tables is None and model_dir is not None and (model_dir / SHIPPED_TABLES).is_file():
            tables = model_dir / SHIPPED_TABLES
        if tables is None:
            raise StoreError(f"predictor {name!r} needs profiled tables: pass --tables "
                             "(write them with `stmoe capture` then `stmoe profile`)")  # fmt: skip
        loaded = load_tables(tables)
    return make(name, shape, loaded, **options)


def _check_lookahead_option(name: str, uses_lookahead: bool, lookahead: str) -> None:
    from stmoe.predictors.plus import check_point

    if not uses_lookahead:
        raise StoreError(f"lookahead {lookahead!r} applies to predictors that use the gate "
                         f"lookahead (hybrid, gate-lookahead), not {name!r}")  # fmt: skip
    check_point(lookahead)


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return None


def _move_resident(model: torch.nn.Module, device: torch.device) -> None:
    """Move every non-meta parameter and buffer (the experts stay in the store)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.is_meta:
                module._parameters[name] = torch.nn.Parameter(p.data.to(device),
                                                              requires_grad=False)  # fmt: skip
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta:
                module._buffers[name] = b.to(device)
