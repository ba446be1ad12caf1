"""The demo's offloaded generation, twice: at real expert sizes (the headline) and at the
shipped model's own (the second table).

The shipped model's experts are 216 KiB: over the demo's emulated link their transfers
cost little beside compute, so prediction's headroom over an LRU cache is about the
shared machine's noise. The headline is measured where the method is meant to work:
a checkpoint with the shipped model's routing shape (8 MoE layers, 16 experts, top-4)
and Qwen3.6-35B-A3B's expert shape (6 MiB experts), RANDOM weights, made once and cached
(``STMOE_CACHE``), replaying the routing the demo captured from the shipped model, with
tables profiled on the demo's other prompts (held out). Both sections run every system
in interleaved rounds and check every run's tokens against a reference.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from stmoe.errors import StmoeError
from stmoe.util.cache_dir import cache_dir, existing_above

SHIPPED_LINK = "200MB"  # EMULATED link of the shipped model's section
REAL_LIKE = "demo-real-experts"  # sim/data/models.toml: the real-size model's shape
REAL_LINK = "1GB"  # EMULATED link of the headline: ~6 ms an expert, NVMe-class
CAPACITY = "50%"
REAL_SYSTEMS = {  # name: (predictor, cache policy, admission); hybrid needs its own routers
    "on-demand": ("ondemand", "none", True),
    "lru-only": ("ondemand", "lru", True),
    "stmoe": ("stmoe", "lru", True),
    "stmoe-plus": ("stmoe-plus", "lru", True),
    "stmoe-plus-all": ("stmoe-plus", "lru", False),  # every predicted load: admission off
    "oracle": ("oracle", "lru", True),
}
# per-run figures kept (medians over the rounds); tokens are checked, not averaged
_MEASURED = ("decode_tokens_per_s", "stall_share", "hit_rate", "prefetch_recall",
             "prefetch_precision", "bytes_moved", "bytes_wasted")


def measure_rounds(runs: dict[str, Callable[[], Any]], rounds: int, reference: list[int],
                   progress: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Each of ``runs`` (name: one untimed-setup-free generation) ``rounds`` times, rotated
    per round (a slow spell of a shared machine hits every system alike), after one
    untimed warm-up each; medians, ranges and whether every run gave ``reference``.
    ``progress`` is told as each round ends (a round can take a minute)."""
    names = list(runs)
    results: dict[str, list[Any]] = {n: [] for n in names}
    for fn in runs.values():  # untimed: first calls pay one-off set-up costs
        fn()
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            results[name].append(runs[name]())
        if progress is not None:
            progress(f"  round {r + 1} of {rounds} done")
    systems = {}
    for name, rs in results.items():
        row: dict[str, Any] = {k: statistics.median(getattr(x, k) for x in rs) for k in _MEASURED}
        speeds = [x.decode_tokens_per_s for x in rs]
        row["decode_tokens_per_s_range"] = [min(speeds), max(speeds)]
        stalls = [x.stall_share for x in rs]
        row["stall_share_range"] = [min(stalls), max(stalls)]
        row["decode_tokens_per_s_runs"] = speeds
        row["identical_to_reference"] = all(x.tokens == reference for x in rs)
        systems[name] = row
    return systems


def shipped_section(model: Any, tokenizer: Any, model_dir: Path, out: Path, prompt: str, *,
                    new_tokens: int, rounds: int) -> dict[str, Any]:
    """The shipped model at 50% capacity over the emulated link, every run checked against
    the resident model's greedy tokens."""
    from stmoe.evaluate.systems import DEMO_SYSTEMS, OFFLOAD_SYSTEMS, compared_predictor
    from stmoe.models import SHIPPED_TABLES
    from stmoe.predictors import load_tables
    from stmoe.runtime.api import offload
    from stmoe.runtime.prompts import greedy_generate
    from stmoe.runtime.store import pack

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    reference = greedy_generate(model, ids, new_tokens, ignore_eos=True)[0, ids.shape[1]:].tolist()
    store = pack(model, out / "store", source=model_dir)
    tables = load_tables(Path(model_dir) / SHIPPED_TABLES)
    with ExitStack() as stack:
        models = {name: stack.enter_context(
            offload(model_dir, store, capacity=CAPACITY, policy=policy, tier="emulated",
                    predictor=compared_predictor(predictor, tables), bandwidth=SHIPPED_LINK))
            for name, (predictor, policy) in OFFLOAD_SYSTEMS.items() if name in DEMO_SYSTEMS}
        systems = measure_rounds(
            {n: (lambda m=m: m.generate(prompt, max_new_tokens=new_tokens))
             for n, m in models.items()}, rounds, reference)
    experts = model.config
    mib = (3 * experts.hidden_size * experts.moe_intermediate_size
           * next(model.parameters()).element_size() / 2**20)
    return {"model": "the shipped model", "expert_mib": mib,
            "link": SHIPPED_LINK, "capacity": CAPACITY, "prompt": prompt,
            "new_tokens": new_tokens, "rounds": rounds,
            "statistic": "median over the rounds (range: min-max)",
            "reference": "the resident model's greedy tokens", "reference_tokens": reference,
            "text": tokenizer.decode(reference),
            "identical_tokens": all(s["identical_to_reference"] for s in systems.values()),
            "systems": systems}


def real_size_section(trace: Any, *, sequence: int, layers: int, new_tokens: int, rounds: int,
                      stage: Callable[[str], None]) -> dict[str, Any]:
    """The headline: the real-size model replaying ``trace``'s sequence ``sequence`` at 50%
    capacity over the emulated link, tables profiled on the other sequences, every run
    checked against the same routing with every expert cached."""
    from stmoe.evaluate.systems import compared_predictor
    from stmoe.predictors import REGISTRY, make, profile
    from stmoe.runtime.api import offload
    from stmoe.runtime.forced_routing import plan_routing
    from stmoe.trace import select_sequences

    model_dir, store, expert_bytes = real_model(layers, stage)
    others = [s for s in range(trace.num_sequences) if s != sequence]
    tables = profile(select_sequences(trace, others))
    n, k = trace.num_experts, trace.top_k
    with ExitStack() as stack:
        def opened(predictor: str, policy: str, admission: bool, capacity: str = CAPACITY) -> Any:
            pred = compared_predictor(predictor, tables)
            if isinstance(pred, str) and REGISTRY[pred].needs_tables:  # this run's tables
                pred = make(pred, tables.shape, tables)
            return stack.enter_context(offload(
                model_dir, store, capacity=capacity, policy=policy, tier="emulated",
                bandwidth=REAL_LINK, predictor=pred, admission=admission))

        everything = opened("ondemand", "lru", True, capacity="100%")
        plan = plan_routing(trace, sequence, layers, n, k, everything.model.config.vocab_size)
        steps = min(new_tokens, plan.new_tokens)
        everything.force_routing(plan, max_new_tokens=steps)  # every expert into the cache
        reference = everything.force_routing(plan, max_new_tokens=steps, cold=False).tokens
        models = {name: opened(*spec) for name, spec in REAL_SYSTEMS.items()}
        stage(f"real expert sizes: {rounds} interleaved rounds of {len(models)} systems, "
              f"{steps} tokens each (EMULATED {REAL_LINK}/s link, half the experts cached)")
        systems = measure_rounds(
            {name: (lambda m=m: m.force_routing(plan, max_new_tokens=steps))
             for name, m in models.items()}, rounds, reference, progress=stage)
    return {"model": f"RANDOM weights, {REAL_LIKE}", "expert_mib": expert_bytes / 2**20,
            "layers": layers,
            "link": REAL_LINK, "capacity": CAPACITY, "new_tokens": steps, "rounds": rounds,
            "statistic": "median over the rounds (range: min-max)",
            "routing": f"the shipped model's routing of demo prompt {sequence}, replayed",
            "tables": f"profiled on the demo's other {len(others)} prompts (held out)",
            "reference": "the same routing with every expert cached",
            "reference_tokens": reference,
            "identical_tokens": all(s["identical_to_reference"] for s in systems.values()),
            "systems": systems}


def disk_needed(layers: int) -> int:
    """Bytes the real-size model of ``layers`` layers takes: its checkpoint, then its
    packed store (the experts only)."""
    from stmoe.hf.checkpoints import plan_checkpoint

    plan = plan_checkpoint(REAL_LIKE, layers)
    return plan.nbytes + layers * plan.spec.num_experts * plan.spec.expert_bytes


def real_model(layers: int, stage: Callable[[str], None]) -> tuple[Path, Path, int]:
    """The real-size checkpoint, its store and its expert's bytes, made on first use in
    ``STMOE_CACHE``/demo (said so, with the disk it takes; refused in one line when the
    disk cannot hold it)."""
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint
    from stmoe.runtime.store.packing import pack_folder

    root = cache_dir("demo")
    model_dir = root / f"{REAL_LIKE}-L{layers}"
    plan = plan_checkpoint(REAL_LIKE, layers)
    if not (model_dir / "config.json").is_file():
        need = disk_needed(layers)
        where = existing_above(root)
        free = shutil.disk_usage(where).free
        if free < need:
            raise StmoeError(f"{root}: the demo's real-size model needs about "
                             f"{need / 2**30:.1f} GiB and {where} has {free / 2**30:.1f} GiB "
                             "free; free some space or set STMOE_CACHE to another disk")
        stage(f"first use: writing a RANDOM-weight checkpoint with real-size experts "
              f"({layers} layers x {plan.spec.num_experts} experts of "
              f"{plan.spec.expert_bytes / 2**20:.1f} MiB) and its store, "
              f"{need / 2**30:.1f} GiB in {root} (kept for the next run)")
        make_checkpoint(plan, model_dir)
    store = root / f"{REAL_LIKE}-L{layers}.store"  # beside it: one folder holds both
    if not (store / "index.json").is_file():
        pack_folder(model_dir, store)
    return model_dir, store, plan.spec.expert_bytes
