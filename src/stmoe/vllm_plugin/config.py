"""The plugin's settings, read from ``STMOE_VLLM`` (comma-separated ``key=value``).

    STMOE_VLLM="capacity=50%,predictor=stmoe-plus,capture=traces/"

Why an environment variable: vLLM starts its engine core (and its workers) in other
processes, by spawn, and loads plugins in each; the environment is the one channel that
reaches all of them the same way for ``vllm.LLM`` and vLLM's OpenAI server alike. Every
key is checked here, in the process that reads it, and a bad one is refused in one line
naming the key and what it takes.

The keys are ``stmoe.offload``'s options (``runtime.options.OffloadOptions``: capacity,
predictor, tables, policy, tier, bandwidth, latency, workers, max_loads, admission,
lookahead, format, group_size; their defaults too) and the plugin's own: ``store`` (the
kernel-layout store's folder), ``capture`` (a folder for each finished request's routing)
and ``experts`` (``loaded``: vLLM loads them and the store is packed from memory;
``stream``: vLLM never loads them, the store is packed from the checkpoint one expert at a
time, for a model bigger than the memory vLLM is given; ``in-place``: never loaded either,
and no store written: read where the checkpoint's safetensors hold them) and ``kernel``
(``portable``: vLLM's portable CPU kernel only, checked bit for bit; ``variants``: its ISA
kernels too, such as the AMX one bfloat16 takes, not bit for bit at every batch).

``format=int4`` (or ``int8``) serves an unquantized checkpoint's experts in stmoe's own
weight-only format, computed by stmoe's kernels (``vllm_plugin.own_format``): the store is
stmoe's own, packed from the checkpoint's files as ``stmoe pack --format`` packs it, so vLLM
never loads the experts (``experts`` is ``stream`` then; ``loaded`` and ``in-place`` are
refused).

``routing=TRACE`` is for measurement only: a recorded trace's routing replaces the router's
(``vllm_plugin.forced``), so that a random-weight checkpoint of a real shape moves experts
as a trained model would; the tokens are meaningless.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from stmoe.errors import StmoeError
from stmoe.quant.formats import WeightFormat
from stmoe.runtime.options import OffloadOptions


class PluginConfigError(StmoeError):
    """``STMOE_VLLM`` asks for something the plugin cannot do."""


# what the plugin takes of OffloadOptions, and how each value is read
_INTS = ("workers", "max_loads", "group_size")
_OPTIONS = ("capacity", "predictor", "tables", "policy", "tier", "bandwidth", "latency",
            *_INTS, "admission", "lookahead", "format")
_OWN = ("store", "capture", "experts", "kernel", "routing")
KEYS = (*_OPTIONS, *_OWN)
# the tiers inside vLLM's CPU build: its experts' store on disk (reads bypass the page
# cache), or host memory behind an EMULATED link
TIERS = ("disk", "emulated")
# where the experts come from: vLLM's loaded weights (a store packed from them), the
# checkpoint streamed into a store, or the checkpoint read in place (no store)
EXPERTS = ("loaded", "stream", "in-place")


@dataclass(frozen=True)
class PluginConfig:
    """What ``STMOE_VLLM`` asks for: ``stmoe.offload``'s options, the store's folder
    (None: under ``~/.cache/stmoe/vllm``) and the capture folder (None: no capture)."""

    options: OffloadOptions = field(default_factory=OffloadOptions)
    store: Path | None = None
    capture: Path | None = None
    experts: str = "loaded"  # or "stream" (``streamed``), "in-place" (``in_place``)
    kernel: str = "portable"  # or "variants": vLLM's ISA kernels too (not bit for bit)
    text: str = ""  # the raw value, for the log line
    routing: Path | None = None  # a trace replayed in place of the router's (``forced``)

    @property
    def weights(self) -> WeightFormat | None:
        """stmoe's own format for the experts (``format=int4``/``int8``: stmoe's store and
        kernels), or None: the checkpoint's weights, computed by vLLM's kernel."""
        fmt = self.options.weight_format()
        return fmt if fmt is not None and fmt.quantized else None


def parse(text: str) -> PluginConfig:
    """``STMOE_VLLM``'s value as settings; ``1``/``on`` alone: every default. Anything
    that is not a known ``key=value`` is refused by name."""
    values: dict[str, object] = {}
    for position, item in enumerate(text.split(","), start=1):
        item = item.strip()
        if not item or item.lower() in ("1", "on", "true", "yes"):
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise PluginConfigError(f"STMOE_VLLM item {position} ({item!r}): expected "
                                    f"key=value with one of {', '.join(KEYS)}")
        if key not in KEYS:
            raise PluginConfigError(f"STMOE_VLLM item {position}: unknown key {key!r}; "
                                    f"the keys are {', '.join(KEYS)}")
        if key in values:
            raise PluginConfigError(f"STMOE_VLLM: {key!r} is given twice")
        if ";" in value:  # "capacity=4;predictor=x" was read as one capacity
            raise PluginConfigError(f"STMOE_VLLM item {position} ({item!r}): a ';' in its "
                                    "value; the items are separated by commas")
        values[key] = _value(key, value)
    own = {k: values.pop(k) for k in _OWN if k in values}
    options = dataclasses.replace(OffloadOptions(), **values)  # type: ignore[arg-type]
    _check(options)
    if own.get("experts") == "in-place" and options.tier != "disk":
        raise PluginConfigError(f"STMOE_VLLM experts=in-place reads the checkpoint from the "
                                f"disk tier; tier={options.tier} holds a store in memory")
    weights = options.weight_format()
    experts = own.get("experts", "loaded")
    if weights is not None and weights.quantized:
        if "experts" in own and experts != "stream":
            asked = (f"format={options.format}" if options.format else
                     f"group_size={options.group_size} (int4 in groups of that size)")
            raise PluginConfigError(f"STMOE_VLLM {asked} packs stmoe's own "
                                    f"{weights.name} store from the checkpoint's files, so vLLM "
                                    f"never loads the experts: experts={experts} cannot go with "
                                    "it (leave experts out, or give experts=stream)")
        experts = "stream"
    if options.predictor == "oracle":
        raise PluginConfigError("STMOE_VLLM predictor=oracle: the oracle knows each step's "
                                "routing before it runs, which `stmoe generate` measures in a "
                                "second pass; vLLM runs each step once (it is the bound of "
                                "`stmoe eval` and `stmoe simulate`, not a serving predictor)")
    if "routing" in own and _reads_routers(options.predictor):
        raise PluginConfigError(f"STMOE_VLLM predictor={options.predictor}: it reads the "
                                "model's own routers, which routing= overrides; replay with a "
                                "predictor that learns from the routing (stmoe, stmoe-plus, "
                                "...)")
    if "routing" in own and "capture" in own:
        raise PluginConfigError("STMOE_VLLM routing= replays a trace in place of the router's, "
                                "so capture= would record that trace, not the model's routing: "
                                "give one of them")
    return PluginConfig(options, own.get("store"), own.get("capture"),  # type: ignore[arg-type]
                        experts,  # type: ignore[arg-type]
                        own.get("kernel", "portable"), text,  # type: ignore[arg-type]
                        own.get("routing"))  # type: ignore[arg-type]


def _reads_routers(predictor: object) -> bool:
    """Whether the predictor named takes the gate lookahead (hybrid): the model's own
    routers, which a forced routing bypasses. Known from its name, so refused as vLLM
    starts, not after the model has loaded."""
    from stmoe.predictors import REGISTRY

    return isinstance(predictor, str) and predictor in REGISTRY and REGISTRY[
        predictor].uses_lookahead


def _value(key: str, value: str) -> object:
    if key == "experts":
        if value not in EXPERTS:
            raise PluginConfigError(f"STMOE_VLLM experts={value!r}: expected loaded (vLLM "
                                    "loads them), stream (never loaded: read from the store) "
                                    "or in-place (never loaded: read from the checkpoint)")
        return value
    if key == "kernel":
        if value not in ("portable", "variants"):
            raise PluginConfigError(f"STMOE_VLLM kernel={value!r}: expected portable (checked "
                                    "bit for bit) or variants (vLLM's ISA kernels too)")
        return value
    if key == "capacity":  # one count per MoE layer as 48/60/12: the items' comma is taken
        return value.replace("/", ",")
    if key in ("tables", "store", "capture", "routing"):
        return Path(value).expanduser()
    if key in _INTS:
        try:
            n = int(value)
        except ValueError:
            n = -1
        if n < 0:
            raise PluginConfigError(f"STMOE_VLLM {key}={value!r}: expected a count >= 0")
        return n
    if key == "admission":
        if value.lower() not in ("on", "off", "true", "false", "1", "0"):
            raise PluginConfigError(f"STMOE_VLLM admission={value!r}: expected on or off")
        return value.lower() in ("on", "true", "1")
    return value


def check_paths(config: PluginConfig) -> None:
    """The folders and files ``config`` names, checked as vLLM starts (``install``, in its
    first process, before an engine loads anything; ``parse`` stays free of the disk): a
    capture folder that cannot be made or written, a store that is a file, tables or a
    routing trace that are not there were each a bare OS error in the worker, after the
    model had loaded. A capture folder that can be is made."""
    capture, store = config.capture, config.store
    if capture is not None:
        try:
            capture.mkdir(parents=True, exist_ok=True)
            if not os.access(capture, os.W_OK | os.X_OK):
                raise PermissionError("not writable")
        except OSError as exc:
            raise PluginConfigError(f"STMOE_VLLM capture={capture}: a folder each finished "
                                    f"request's routing is written to, and it cannot be "
                                    f"made or written ({exc.strerror or exc})") from None
    if store is not None and store.exists() and not store.is_dir():
        raise PluginConfigError(f"STMOE_VLLM store={store}: a file; store= names the store's "
                                "folder (made on first use)")
    tables = config.options.tables
    if tables is not None and not Path(tables).is_file():
        raise PluginConfigError(f"STMOE_VLLM tables={tables}: no such file (tables "
                                "`stmoe profile` wrote)")
    if config.routing is not None and not config.routing.is_file():
        raise PluginConfigError(f"STMOE_VLLM routing={config.routing}: no such trace file")


def _check(options: OffloadOptions) -> None:
    """The options stmoe.offload checks, and what differs inside vLLM, refused in a line."""
    if options.tier not in TIERS:
        raise PluginConfigError(f"STMOE_VLLM tier={options.tier!r}: inside vLLM's CPU build "
                                f"the tiers are {', '.join(TIERS)}")
    if options.lookahead not in ("early", "auto"):
        raise PluginConfigError(f"STMOE_VLLM lookahead={options.lookahead!r}: inside vLLM "
                                "only 'early' (its decoder layers give no pre-MoE norm to hook)")
    try:
        options.check()
    except StmoeError as exc:
        raise PluginConfigError(in_keys(f"STMOE_VLLM: {exc}")) from None


def in_keys(message: str) -> str:
    """A runtime message in STMOE_VLLM's words: its CLI options (``--group-size``) named as
    the keys that set them here (``group_size``)."""
    def key(m: re.Match[str]) -> str:
        name = m[1].replace("-", "_")
        return name if name in KEYS else m[0]

    return re.sub(r"--([a-z][a-z-]*)", key, message)
