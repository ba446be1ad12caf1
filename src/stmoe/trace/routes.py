"""Nested per-token routing JSON (the shape community tracers write), one sequence per file.

    {"meta": {"model_id", "num_experts", "top_k", "num_moe_layers", "domain"?, ...},
     "routes": [{"token_pos": p, "token_id": id, "phase": "prefill" | "decode",
                 "layers": {"0": {"experts": [K ids], "weights": [K floats]}, ...}}, ...]}

``routes`` run over strictly increasing, consecutive token positions, prefill routes
before decode ones; every route has every MoE layer; the counts ``meta`` declares
(``total_tokens``, ``prompt_len``, ``generated_len``) are what the routes
hold. See ``../shared/traces/README.md`` for a real example.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.assemble import (
    agreed_num_experts,
    check_counts,
    check_keys,
    check_phase_order,
    expert_ids,
    gate_weights,
    layer_numbering,
    order_by_weight,
)
from stmoe.trace.engines.jsonio import load_json
from stmoe.trace.schema import (
    UNLABELLED,
    RoutingTrace,
    TraceMeta,
    inferred_num_experts,
    meta_int,
    validate,
)


def read(path: Path, *, num_experts: int | None = None) -> RoutingTrace:
    """Parse a routes JSON file into a validated one-sequence trace."""
    doc = _load_json(path)
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        raise TraceError("'meta' is not an object", expected="a JSON object of model facts")
    routes = doc["routes"]
    if not isinstance(routes, list) or not routes:
        raise TraceError("'routes' is empty or not a list", expected="a list of per-token routes")
    first_layers = _layers_of(routes[0], 0)
    layer_map, layer_extra = layer_numbering(_layer_key(k, 0) for k in first_layers)
    n_layers = len(layer_map)
    first_entry = next(iter(first_layers.values()))
    first_ids, _ = _entry(first_entry, None, "route 0")
    top_k = meta_int(meta, "top_k", len(first_ids))
    if top_k != len(first_ids):  # checked before [T, L, top_k] is allocated
        raise TraceError(f"{len(first_ids)} experts but the metadata's top_k is {top_k}",
                         position="route 0", expected=f"K={top_k} experts per layer")
    layers_key = "num_moe_layers" if "num_moe_layers" in meta else "num_layers"
    expected_layers = meta_int(meta, layers_key, n_layers)
    if expected_layers != n_layers:
        raise TraceError(
            f"route 0 has {n_layers} layers but the metadata says {expected_layers}",
            position="route 0",
            expected=f"{expected_layers} MoE layers per route",
        )
    t = len(routes)
    experts = np.full((t, n_layers, top_k), -1, dtype=np.int64)  # [T, L, K]
    has_weights = isinstance(first_entry, dict) and "weights" in first_entry
    weights = np.zeros(experts.shape, dtype=np.float32) if has_weights else None
    is_decode = np.zeros(t, dtype=bool)  # [T]
    token_ids: list[Any] = []
    prev_pos: int | None = None
    for i, route in enumerate(routes):
        if not isinstance(route, dict):
            raise TraceError(
                f"route is a JSON {type(route).__name__}",
                position=f"route {i}",
                expected="an object with 'token_pos', 'phase' and 'layers'",
            )
        prev_pos = _position(route, i, prev_pos)
        where = f"route {i} (token_pos {prev_pos})"
        phase = route.get("phase", "prefill")
        if phase not in ("prefill", "decode"):
            raise TraceError(
                f"'phase' is {phase!r}", position=where, expected="'prefill' or 'decode'"
            )
        is_decode[i] = phase == "decode"
        token_ids.append(_token_id(route, where))
        _fill_layers(_layers_of(route, i), i, where, layer_map, experts, weights)
    check_phase_order(is_decode, np.zeros(1, np.int64),
                      lambda i: f"route {i} (token_pos {routes[i].get('token_pos', i)})")
    n_decode = int(is_decode.sum())
    check_counts(meta, [("total_tokens", t, "routes"), ("prompt_len", t - n_decode,
                        "prefill routes"), ("generated_len", n_decode, "decode routes")])
    has_ids = token_ids.count(None) == 0
    if not has_ids and token_ids.count(None) != len(token_ids):
        i = token_ids.index(None)
        raise TraceError(
            "the route has no integer 'token_id' while others have one",
            position=f"route {i}",
            expected="token ids on every route or none",
        )
    extra: dict[str, Any] = dict(layer_extra)
    extra.update({k: v for k, v in meta.items() if k in ("model_type", "backend", "run_id")})
    if weights is not None:
        experts, weights, changed = order_by_weight(experts, weights)
        if changed:
            extra["reordered_by_weight"] = changed
    declared = meta_int(meta, "num_experts") if meta.get("num_experts") is not None else None
    n = agreed_num_experts(num_experts, declared)
    if n is None:
        n = inferred_num_experts(experts, lambda t, layer, _: f"route {t}, layer {layer}")
        extra["num_experts_inferred"] = True
    trace = RoutingTrace(
        experts=experts,
        seq_starts=np.zeros(1, dtype=np.int64),
        is_decode=is_decode,
        weights=weights,
        token_ids=np.asarray(token_ids, dtype=np.int64) if has_ids else None,
        domains=(str(meta.get("domain", UNLABELLED)),),
        meta=TraceMeta(
            num_experts=int(n),
            top_k=top_k,
            num_layers=n_layers,
            model=str(meta.get("model_id", meta.get("model", "unknown"))),
            source=f"imported from {path.name}",
            extra=extra,
        ),
    )
    validate(trace, file=str(path))  # range-checks ids before they are narrowed to int16
    return dataclasses.replace(trace, experts=experts.astype(np.int16))


def _position(route: dict[str, Any], i: int, prev_pos: int | None) -> int:
    """The route's token position, checked to follow ``prev_pos`` directly."""
    pos = route.get("token_pos", i)
    if not isinstance(pos, int) or isinstance(pos, bool) or not 0 <= pos < 2**62:
        raise TraceError(
            f"'token_pos' is {pos!r}", position=f"route {i}", expected="an integer token position"
        )
    if prev_pos is None and pos != 0:
        raise TraceError(
            f"the first route has token position {pos}",
            position=f"route {i}",
            expected=f"positions from 0 (tokens 0..{pos - 1} are missing)",
        )
    if prev_pos is not None and pos != prev_pos + 1:
        raise TraceError(
            f"token position {pos} follows {prev_pos}",
            position=f"route {i} (token_pos {pos})",
            expected="strictly increasing token positions"
            if pos <= prev_pos
            else "consecutive token positions (no missing token)",
        )
    return pos


def _fill_layers(
    layers: dict[str, Any],
    i: int,
    where: str,
    layer_map: dict[int, int],
    experts: np.ndarray,
    weights: np.ndarray | None,
) -> None:
    """Copy one route's layers into row ``i``; every layer present, weights all or none."""
    seen = set()
    for key, entry in layers.items():
        lid = _layer_key(key, i)
        if lid not in layer_map:
            raise TraceError(
                f"layer {lid} is not among route 0's layers",
                position=where,
                expected=f"layers {sorted(layer_map)}",
            )
        if lid in seen:
            raise TraceError(f"layer {lid} appears twice (key {key!r})", position=where,
                             expected="one entry per layer")
        seen.add(lid)
        ids, w = _entry(entry, experts.shape[2], f"{where}, layer {lid}")
        experts[i, layer_map[lid]] = ids
        if (w is not None) != (weights is not None):
            raise TraceError(
                "weights on some layers and not on others",
                position=f"{where}, layer {lid}",
                expected="weights on every layer of every route or none",
            )
        if weights is not None:
            weights[i, layer_map[lid]] = w
    if len(seen) != len(layer_map):
        missing = min(set(layer_map) - seen)
        raise TraceError(
            f"layer {missing} is missing",
            position=where,
            expected=f"all {len(layer_map)} MoE layers in every route",
        )


def _load_json(path: Path) -> dict[str, Any]:
    doc = load_json(path, "a routes document")
    if not isinstance(doc, dict) or "routes" not in doc:
        raise TraceError(
            "the JSON has no 'routes' list", expected="an object {'meta': ..., 'routes': [...]}"
        )
    return doc


def _layers_of(route: Any, i: int) -> dict[str, Any]:
    layers = route.get("layers") if isinstance(route, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise TraceError(
            "the route has no 'layers' object",
            position=f"route {i}",
            expected="{'0': {'experts': [...]}, ...}",
        )
    return layers


def _layer_key(key: str, i: int) -> int:
    """A layer number written in ASCII digits: ``int`` also reads "1_0" as 10, " 1" and
    "+1" as 1, so two spellings could name one layer."""
    if not (key.isascii() and key.isdigit()) or len(key) > 9:
        raise TraceError(
            f"layer key {key!r}", position=f"route {i}", expected="integer layer numbers as keys"
        )
    return int(key)


def _entry(entry: Any, top_k: int | None, where: str) -> tuple[list[int], list[float] | None]:
    """One layer's ``{"experts": [...], "weights": [...]}``, checked."""
    if not isinstance(entry, dict):
        raise TraceError(f"the layer entry is {_kind(entry)}", position=where,
                         expected='{"experts": [...], "weights": [...]}')
    check_keys(entry, ("experts", "weights"), where)
    ids = expert_ids(entry.get("experts"), where)
    if top_k is None:
        return ids, None
    if len(ids) != top_k:
        raise TraceError(f"{len(ids)} experts but top_k is {top_k}", position=where,
                         expected=f"K={top_k} experts")
    w = entry.get("weights")
    return ids, None if w is None else gate_weights(w, top_k, where)


def _kind(value: Any) -> str:
    return f"a JSON {type(value).__name__}" if value is not None else "null"


def _token_id(route: dict[str, Any], where: str) -> int | None:
    tid = route.get("token_id")
    if tid is None:
        return None
    if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < 2**62:
        raise TraceError(f"'token_id' is {tid!r}", position=where, expected="an integer id >= 0")
    return tid
