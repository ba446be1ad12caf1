"""STMOE_VLLM's grammar (stmoe.vllm_plugin.config): stmoe.offload's options and the
plugin's own keys, each checked where it is read, a bad one refused in one line naming it.
Needs no vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from stmoe.vllm_plugin import ENV_VAR, register
from stmoe.vllm_plugin.config import KEYS, PluginConfigError, check_paths, parse


def test_every_default_where_it_is_only_switched_on():
    for text in ("1", "on", "", " , "):
        c = parse(text)
        assert c.options.capacity == "50%" and c.options.predictor == "stmoe-plus"
        assert c.options.tier == "disk" and c.store is None and c.capture is None


def test_keys_become_offload_options_and_the_plugins_own():
    c = parse("capacity=4, predictor=stmoe-plus,tables=~/t.npz,policy=lfu,workers=0,"
              "max_loads=2,admission=off,store=/s,capture=caps,lookahead=early")
    o = c.options
    assert (o.capacity, o.predictor, o.policy, o.workers, o.max_loads, o.admission) == (
        "4", "stmoe-plus", "lfu", 0, 2, False)
    assert o.tables == Path("~/t.npz").expanduser() and c.store == Path("/s")
    assert c.capture == Path("caps") and o.lookahead == "early" and c.experts == "loaded"
    assert parse("experts=stream").experts == "stream"
    assert parse("experts=in-place").experts == "in-place"
    assert c.kernel == "portable" and parse("kernel=variants").kernel == "variants"
    e = parse("tier=emulated,bandwidth=1GB,latency=50us").options
    assert (e.tier, e.bandwidth, e.latency) == ("emulated", "1GB", "50us")
    assert c.weights is None and parse("format=native").weights is None


def test_a_capacity_per_layer_is_split_by_slashes():
    """`stmoe split-capacity` prints one count per MoE layer with commas, which separate
    STMOE_VLLM's items: there the counts take slashes, and resolve as the runtime's list."""
    from stmoe.errors import OffloadError
    from stmoe.runtime.options import resolve_capacities

    c = parse("capacity=4/6/2,predictor=stmoe-plus")
    assert c.options.capacity == "4,6,2" and c.options.predictor == "stmoe-plus"
    assert resolve_capacities(c.options.capacity, 3, 8, 2, 1 << 20) == (4, 6, 2)
    with pytest.raises(OffloadError, match="3"):  # a count per layer, as many as the layers
        resolve_capacities(parse("capacity=4/6").options.capacity, 3, 8, 2, 1 << 20)


def test_a_format_is_stmoes_own_store_and_vllm_never_loads_the_experts():
    for text in ("format=int4", "format=int4,experts=stream", "format=int8"):
        c = parse(text)
        assert c.experts == "stream" and c.weights is not None and c.weights.quantized
    c = parse("format=int4,group_size=64")
    assert c.weights is not None and (c.weights.name, c.weights.group_size) == ("int4", 64)


@pytest.mark.parametrize(("text", "says"), [
    ("capacity", "item 1 ('capacity'): expected key=value"),
    ("capacity=4,speed=9", "item 2: unknown key 'speed'"),
    ("capacity=4,capacity=8", "'capacity' is given twice"),
    ("capacity=4;predictor=stmoe", "item 1 ('capacity=4;predictor=stmoe'): a ';' in its value; "
     "the items are separated by commas"),
    ("workers=two", "workers='two': expected a count >= 0"),
    ("max_loads=-1", "max_loads='-1': expected a count >= 0"),
    ("admission=maybe", "admission='maybe': expected on or off"),
    ("tier=gpu", "tier='gpu': inside vLLM's CPU build the tiers are disk, emulated"),
    ("lookahead=late", "only 'early'"),
    ("experts=disk", "experts='disk': expected loaded"),
    ("experts=in-place,tier=emulated,bandwidth=1GB", "experts=in-place reads the checkpoint "
     "from the disk tier; tier=emulated"),
    ("kernel=amx", "kernel='amx': expected portable"),
    ("format=int4,experts=in-place", "format=int4 packs stmoe's own int4 store from the "
     "checkpoint's files, so vLLM never loads the experts: experts=in-place cannot go"),
    ("format=int8,experts=loaded", "experts=loaded cannot go with it"),
    ("format=int3", "weight format 'int3' is not one of native, int8, int4"),
    ("format=int4,group_size=48", "int4 group size 48: expected one of 32, 64, 128, 256"),
    ("format=int8,group_size=32", "a group size is for int4 only"),
    ("group_size=x", "group_size='x': expected a count >= 0"),
    ("policy=fifo", "STMOE_VLLM: "),
    # in STMOE_VLLM's words, not the CLI's (--bandwidth, --tier)
    ("tier=disk,bandwidth=1GB", "STMOE_VLLM: bandwidth applies to tier emulated only"),
    # group_size alone asks for int4 (as the CLI's --group-size): named so, not format=None
    ("group_size=64,experts=loaded", "STMOE_VLLM group_size=64 (int4 in groups of that size) "
     "packs stmoe's own int4 store"),
    ("predictor=oracle", "predictor=oracle: the oracle knows each step's routing before"),
    # known from the name, so refused as vLLM starts (it was refused after the model loaded)
    ("predictor=hybrid,routing=r.npz", "STMOE_VLLM predictor=hybrid: it reads the model's own "
     "routers, which routing= overrides"),
])
def test_a_bad_item_is_refused_by_name(text, says):
    with pytest.raises(PluginConfigError) as e:
        parse(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_path_that_cannot_serve_is_refused_as_vllm_starts(tmp_path):
    """``check_paths``, before an engine loads anything (each was a bare OS error in the
    worker, after the model had loaded): a capture folder under a file, or a file; a store
    that is a file; tables or a routing trace that are not there. A capture folder that can
    be is made."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for text, says in ((f"capture={afile}", f"capture={afile}: a folder each finished "
                        "request's routing is written to, and it cannot be made or written"),
                       (f"capture={afile / 'sub'}", "cannot be made or written"),
                       (f"store={afile}", f"store={afile}: a file; store= names the store's "
                        "folder"),
                       ("tables=/no/such/t.npz", "tables=/no/such/t.npz: no such file"),
                       ("routing=/no/such/r.npz", "routing=/no/such/r.npz: no such trace")):
        with pytest.raises(PluginConfigError) as e:
            check_paths(parse(text))
        assert says in str(e.value) and "\n" not in str(e.value)
    made = parse(f"capture={tmp_path / 'new' / 'traces'},tables={afile}")
    check_paths(made)
    assert made.capture is not None and made.capture.is_dir()


def test_the_refusal_lists_the_keys():
    with pytest.raises(PluginConfigError, match=", ".join(KEYS)):
        parse("nope=1")


def test_register_does_nothing_unless_asked(monkeypatch):
    """vLLM calls register in every process: without STMOE_VLLM it imports nothing."""
    import sys

    monkeypatch.delenv(ENV_VAR, raising=False)
    before = set(sys.modules)
    register()
    assert not {m for m in set(sys.modules) - before if m.startswith(("vllm", "stmoe.vllm"))}
    monkeypatch.setenv(ENV_VAR, "  ")
    register()
    for off in ("0", "off", "False", " no "):  # switched off as it reads, not refused
        monkeypatch.setenv(ENV_VAR, off)
        register()
    assert not {m for m in set(sys.modules) - before if m.startswith(("vllm", "stmoe.vllm"))}
