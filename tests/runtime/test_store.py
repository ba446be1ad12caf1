"""The expert store: deterministic, one checked read per expert, loud when damaged."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from checkpoint_folders import FOLDERS, make_model_folder, saved_folder  # noqa: E402
from stmoe.errors import BlockError  # noqa: E402
from stmoe.hf.layout import experts_modules  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.store import ALIGN, ExpertStore, StoreError, pack  # noqa: E402
from stmoe.runtime.store.index import checksum  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    model, _ = tiny_model("mixtral")
    return model, pack(model, tmp_path_factory.mktemp("store"))


def test_blocks_hold_each_experts_weights_aligned(packed):
    model, path = packed
    store = ExpertStore(path)
    modules = experts_modules(model)
    assert len(store.blocks) == len(modules) * 8
    for (layer, expert), block in store.blocks.items():
        assert block.offset % ALIGN == 0
        tensors = store.read(layer, expert)
        for name, param in modules[layer][1].named_parameters(recurse=False):
            assert np.array_equal(tensors[name], param.detach()[expert].numpy())


def test_packing_twice_gives_the_same_bytes(packed, tmp_path):
    model, path = packed
    again = pack(model, tmp_path / "again")
    data = ExpertStore(path).data_path
    assert (again / data.name).read_bytes() == data.read_bytes()
    assert (again / "index.json").read_text() == (path / "index.json").read_text()


def test_damage_and_mismatch_are_clear_errors(packed, tmp_path):
    model, path = packed
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "index.json").write_text((path / "index.json").read_text())
    name = ExpertStore(path).data_path.name
    data = bytearray((path / name).read_bytes())
    data[10] ^= 0xFF
    (broken / name).write_bytes(bytes(data))
    with pytest.raises(StoreError, match="layer 0, expert 0 fails its checksum") as err:
        ExpertStore(broken).read(0, 0)
    # the block is named to the code too: what needs that expert fails, not the rest
    again = pickle.loads(pickle.dumps(err.value))
    for e in (err.value, again):
        assert isinstance(e, BlockError) and (e.layer, e.expert) == (0, 0)
    assert str(again) == str(err.value)
    (broken / name).write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(StoreError, match="truncated"):
        ExpertStore(broken)
    with pytest.raises(StoreError, match="not an expert store"):
        ExpertStore(tmp_path)
    other, _ = tiny_model("qwen3_moe")
    ExpertStore(path).check_model(model)  # its own model passes
    with pytest.raises(StoreError, match="packed for"):
        ExpertStore(path).check_model(other)


def test_pack_command(cli, tmp_path):
    from stmoe.models import SHIPPED_MODEL

    result = cli("pack", SHIPPED_MODEL, "-o", tmp_path / "store")
    assert result.exit_code == 0, result.output
    store = ExpertStore(tmp_path / "store")
    assert len(store.blocks) == 8 * 16
    bad = cli("pack", tmp_path, "-o", tmp_path / "x")
    assert bad.exit_code == 1 and "no config.json" in bad.output
    # bf16 names a bf16 checkpoint's native format: of a float32 one it would write float32
    bf16 = cli("pack", SHIPPED_MODEL, "-o", tmp_path / "b", "--format", "bf16")
    assert bf16.exit_code == 1 and "weights are float32" in bf16.output, bf16.output
    assert not (tmp_path / "b").exists()


# ---- a fuzzed index: one clear line, or the resident model's exact tokens --------------------
PROMPT = [5, 6, 7, 8]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    """Every place in a parsed index: (path to it, as keys and list positions)."""
    yield prefix
    if isinstance(node, (dict, list)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            yield from _paths(child, (*prefix, key))


def _at(index, path):
    for key in path:
        index = index[key]
    return index


def _mutated(text: str, data) -> str:
    kind = data.draw(st.sampled_from(["flip", "replace", "nudge", "delete", "layout"]))
    if kind == "flip":
        raw = bytearray(text.encode())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        return raw.decode("utf-8", "surrogateescape")
    if kind == "layout":  # the same index, other white space
        return text.replace("\n", data.draw(st.sampled_from(["", "\n\n", " \r\n"])))
    index = json.loads(text)
    paths = [p for p in _paths(index) if p and (kind != "delete" or isinstance(p[-1], str))]
    if kind == "nudge":  # a number a little off, as one changed digit makes it
        paths = [p for p in paths if type(_at(index, p)) is int]
    path = data.draw(st.sampled_from(paths))
    node = _at(index, path[:-1])
    if kind == "replace":
        node[path[-1]] = data.draw(JSON)
    elif kind == "nudge":
        node[path[-1]] += data.draw(st.sampled_from([-4096, -2, -1, 1, 2, 4096, 1 << 20]))
    else:
        del node[path[-1]]
    if data.draw(st.booleans()):  # a hand-made index: its checksum made to agree
        index["checksum"] = checksum(index)
    return json.dumps(index, indent=data.draw(st.sampled_from([None, 1])))


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory):
    model, _ = tiny_model("mixtral")
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=3, min_new_tokens=3,
                             do_sample=False, pad_token_id=0)
    ref = out[0, len(PROMPT) :].tolist()
    return pack(model, tmp_path_factory.mktemp("fuzz")), ref, model


_EXAMPLES = int(os.environ.get("STMOE_FUZZ_EXAMPLES", "100"))  # ~7 s; more to explore


@pytest.mark.parametrize("path", [("version",), ("align",), ("data",),
                                  ("blocks", 3, "crc32c"), ("blocks", 0, "nbytes")])
def test_a_value_with_a_newline_is_shown_quoted_on_one_line(fuzz_base, tmp_path, path):
    """Found by the fuzz below: an index value holding a newline (checksum made to agree)
    was printed raw, so its error took two lines."""
    store, _, _ = fuzz_base
    bad = tmp_path / "store"
    shutil.copytree(store, bad)
    index = json.loads((store / "index.json").read_text())
    _at(index, path[:-1])[path[-1]] = "one\ntwo"
    index["checksum"] = checksum(index)
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError) as err:
        ExpertStore(bad)
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and "'one\\ntwo'" in msg, msg


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_fuzzed_index_is_one_clear_error_or_the_same_tokens(fuzz_base, data):
    store, ref, resident = fuzz_base
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "store"
        shutil.copytree(store, bad)
        text = _mutated((store / "index.json").read_text(), data)
        (bad / "index.json").write_bytes(text.encode("utf-8", "surrogateescape"))
        try:
            ExpertStore(bad).check_model(resident)  # cheap first: most mutations end here
            model, _ = tiny_model("mixtral")
            with offload(model, bad, capacity="100%", predictor="ondemand") as om:
                got = om.generate(PROMPT, max_new_tokens=3).tokens
        except StoreError as exc:
            msg = str(exc)
            assert "\n" not in msg and str(bad) in msg, msg
            return
        assert got == ref


# ---- packing a folder streams its shards: the same bytes as packing the loaded model ---------
def _same_store(a: Path, b: Path) -> None:
    """Byte for byte: index.json (blocks, CRC32s, checkpoint fingerprints) and data file."""
    assert (a / "index.json").read_bytes() == (b / "index.json").read_bytes()
    data = ExpertStore(a).data_path.name
    assert sorted(p.name for p in b.iterdir()) == sorted(p.name for p in a.iterdir())
    assert (a / data).read_bytes() == (b / data).read_bytes()


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_a_folder_packs_streamed_to_the_loaded_models_bytes(kind, tmp_path, monkeypatch):
    from stmoe.hf import loading as capture_generate
    from stmoe.runtime.store import pack_folder, pack_stream

    folder = FOLDERS[kind](tmp_path / "model")
    want = pack(capture_generate.load_causal_lm(folder), tmp_path / "memory", source=folder)
    # streaming never loads the model; maps released after every block on half the cases
    monkeypatch.setattr(capture_generate, "load_causal_lm", None)
    if len(kind) % 2:
        monkeypatch.setattr(pack_stream, "RELEASE_BYTES", 1)
    seen = []
    got = pack_folder(folder, tmp_path / "streamed",
                      progress=lambda total, label: _recorder(seen, total, label))
    _same_store(want, got)
    blocks = ExpertStore(got).blocks.values()
    assert seen[0][0] == sum(b.nbytes for b in blocks) == sum(seen[1:])  # a byte bar, all of it


@contextlib.contextmanager
def _recorder(seen: list, total: int, label: str):
    seen.append((total, label))
    yield seen.append


def _with_extra_expert_tensor(folder: Path) -> str:
    """Add a tensor under an experts module that no parameter takes; returns its name."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.0.block_sparse_moe.experts.0.w9.weight"
    tensors[name] = torch.zeros(3, 4)
    save_file(tensors, f, metadata={"format": "pt"})
    return name


def _with_config_dtype(folder: Path) -> str:
    """bfloat16 tensors under a config that says float32 (transformers casts them)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(cfg))
    return "one expert is torch.bfloat16"


@pytest.mark.parametrize("case", ["unexpected tensor", "cast dtype"])
def test_a_checkpoint_that_cannot_stream_is_packed_loaded_with_a_note(case, tmp_path):
    from stmoe.errors import StmoeNote
    from stmoe.hf.loading import load_causal_lm
    from stmoe.runtime.store import pack_folder

    if case == "unexpected tensor":
        folder = saved_folder("mixtral", tmp_path / "model")
        said = _with_extra_expert_tensor(folder)
    else:
        folder = make_model_folder("qwen3_moe", tmp_path / "model", "bfloat16")
        said = _with_config_dtype(folder)
    want = pack(load_causal_lm(folder), tmp_path / "memory", source=folder)
    with pytest.warns(StmoeNote, match=re.escape(said)) as notes:
        got = pack_folder(folder, tmp_path / "fallback")
    assert len(notes) == 1 and "\n" not in str(notes[0].message)
    assert "packing from the whole model loaded in memory" in str(notes[0].message)
    _same_store(want, got)


def test_a_checkpoint_changed_while_packing_is_refused_the_old_store_kept(tmp_path, monkeypatch):
    from stmoe.runtime.store import pack_folder, pack_stream

    folder = make_model_folder("olmoe", tmp_path / "model")
    old = pack_folder(folder, tmp_path / "store")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    real = pack_stream.CheckpointExperts.tensors

    def touching(self, layer, expert):
        if (layer, expert) == (1, 3):  # another process rewrites a shard half way
            shard = sorted(folder.glob("*.safetensors"))[0]
            os.utime(shard, ns=(1, 1))
        return real(self, layer, expert)

    monkeypatch.setattr(pack_stream.CheckpointExperts, "tensors", touching)
    with pytest.raises(StoreError, match=r"model-00001-of-\d+\.safetensors: changed while it "
                                         "was being packed"):
        pack_folder(folder, tmp_path / "store")
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before


def test_a_damaged_shard_is_one_clear_error(tmp_path, cli):
    folder = make_model_folder("qwen2_moe", tmp_path / "model")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.write_bytes(b"\x10" + b"\0" * 7 + b'{"a": 1}')
    res = cli("pack", folder, "-o", tmp_path / "store")
    assert res.exit_code == 1
    assert f"{shard}: not a readable safetensors file" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_two_packs_into_one_folder_run_one_after_the_other(tmp_path, monkeypatch):
    """Issue 30, item 5: one pack paused between publishing its data and writing
    index.json; the other used to finish first, and the first then deleted its data (an
    index naming a missing file). Under the folder's lock the second waits."""
    import threading

    from stmoe.errors import StmoeNote
    from stmoe.runtime.store import packing

    models = [tiny_model("mixtral", seed=s)[0] for s in (1, 2)]
    out = tmp_path / "store"
    published, release = threading.Event(), threading.Event()
    real = packing.index_text

    def paused(*args, **kwargs):
        if threading.current_thread().name == "first":
            published.set()  # its data file is in the folder, its index not yet
            assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(packing, "index_text", paused)
    errors: list[BaseException] = []

    def run(model):
        try:
            pack(model, out)
        except BaseException as exc:  # reported below
            errors.append(exc)

    first = threading.Thread(target=run, args=(models[0],), name="first")
    second = threading.Thread(target=run, args=(models[1],), name="second")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first.start()
        assert published.wait(60)
        second.start()
        second.join(1.0)
        assert second.is_alive()  # waiting on the lock, not racing the first
        release.set()
        first.join(60)
        second.join(60)
    assert not errors, errors
    assert any(issubclass(w.category, StmoeNote) and "another pack" in str(w.message)
               for w in caught)
    store = ExpertStore(out)  # the second pack's store, whole
    assert store.data_path.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".pack.lock", "index.json", store.data_path.name])
    want = ExpertStore(pack(models[1], tmp_path / "alone"))
    assert store.data_path.name == want.data_path.name
    for key in list(store.blocks)[:4]:
        got, ref = store.read(*key), want.read(*key)
        assert all(np.array_equal(got[k], ref[k]) for k in ref)


def test_a_full_disk_while_packing_names_the_store_and_keeps_the_old_one(packed, tmp_path,
                                                                         monkeypatch):
    """Issue 30, item 9: ENOSPC from write(2) names no file; the error names the store."""
    import builtins
    import errno

    from stmoe.runtime.store import packing

    model, _ = packed
    out = pack(model, tmp_path / "store")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    class Full:
        def __init__(self, *args, **kwargs):
            self.f = builtins.open(*args, **kwargs)  # noqa: SIM115 - closed in __exit__

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):  # the lock file's fileno
            return getattr(self.f, name)

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packing, "open", Full, raising=False)
    with pytest.raises(OSError) as caught:
        pack(model, out)
    assert caught.value.filename == str(out) and "No space left" in caught.value.strerror
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_pack_the_disk_cannot_hold_is_refused_in_one_line(tmp_path, monkeypatch):
    from stmoe.runtime.store import pack_folder

    folder = saved_folder("mixtral", tmp_path / "model")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))  # a nearly full disk
    with pytest.raises(StoreError, match=r"needs about [\d.]+ [KM]iB and its disk has 1000 "
                                         r"bytes free; free some space"):
        pack_folder(folder, tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_packing_on_first_use_is_announced_off_a_terminal_too(tmp_path, monkeypatch, capsys):
    folder = saved_folder("mixtral", tmp_path / "model")
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    with offload(folder, capacity=4, predictor="ondemand"):
        pass
    err = capsys.readouterr().err
    assert "packing model's experts" in err and "first use" in err, err
