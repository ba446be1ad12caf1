"""A store proves it belongs before the first token (issue 16): one bit of its index, a
hand-made index, a store of other weights, a pack killed half way: one clear line, or the
resident model's exact tokens; never other tokens with exit 0."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import StmoeNote  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.store import ExpertStore, StoreError, open_store, pack, pack_folder  # noqa: E402
from stmoe.runtime.store import packing as store_mod  # noqa: E402
from stmoe.runtime.store.index import block_crc, checksum  # noqa: E402
from stmoe.runtime.store.verify import verify_store  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

PROMPT, NEW = [5, 6, 7, 8, 9], 4


def tokens(store: Path | None = None, seed: int = 0, folder: Path | None = None) -> list[int]:
    """Greedy tokens of the tiny model (seed), resident (no store) or offloaded at 100%."""
    if folder is not None:
        with offload(folder, store, capacity="100%", predictor="ondemand") as om:
            return om.generate(PROMPT, max_new_tokens=NEW).tokens
    model, _ = tiny_model("mixtral", seed=seed)
    if store is None:
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                                 min_new_tokens=NEW, pad_token_id=0)
        return out[0, len(PROMPT) :].tolist()
    with offload(model, store, capacity="100%", predictor="ondemand") as om:
        return om.generate(PROMPT, max_new_tokens=NEW).tokens


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The tiny model's folder, a store packed from it, and its resident tokens."""
    root = tmp_path_factory.mktemp("integrity")
    model, _ = tiny_model("mixtral")
    model.save_pretrained(root / "model")
    store = pack(model, root / "store", source=root / "model")
    return root / "model", store, tokens()


def rewrite(store: Path, dest: Path, mutate, recompute: bool) -> Path:
    """A copy of ``store`` whose index went through ``mutate`` (checksum redone or not)."""
    shutil.copytree(store, dest)
    index = json.loads((dest / "index.json").read_text())
    mutate(index)
    if recompute:
        index["checksum"] = checksum(index)
    (dest / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    return dest


def one_line_naming(exc: pytest.ExceptionInfo, store: Path) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and str(store) in msg, msg
    return msg


def _set(path: tuple, value):
    def mutate(index):
        node = index
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value

    return mutate


def _del(path: tuple):
    def mutate(index):
        node = index
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return mutate


def _layer0(fn):
    """Apply ``fn`` to the first tensor of every block of layer 0 (a consistent layout)."""

    def mutate(index):
        for b in index["blocks"]:
            if b["layer"] == 0:
                fn(b)

    return mutate


def _digit(n: int) -> int:  # one digit changed, as a hand (or a bit) would
    return n + 1 if n % 10 != 9 else n - 1


B = ("blocks", 1)
# field -> (mutation, what the entry checks say once the checksum is recomputed)
FIELDS = {
    "layer": (_set((*B, "layer"), 7), "layer is 7, expected a whole number 0..2"),
    "expert": (_set((*B, "expert"), 0), "layer 0, expert 0 twice"),
    "offset": (_set((*B, "offset"), _digit), "is not a multiple of 4096"),
    "offset-overlap": (_set((*B, "offset"), 0), "where packing puts this block at 24576"),
    "offset-past-end": (_set((*B, "offset"), 1 << 30), "expected a whole number"),
    "nbytes": (_set((*B, "nbytes"), _digit), "but its tensors hold"),
    "crc32c": (_set((*B, "crc32c"), _digit), "holds other weights than the model's"),
    "tensor-name": (_set((*B, "tensors", 0, 0), "up_proj"), "tensors differ from the layer's"),
    "tensor-name-layer": (_layer0(lambda b: b["tensors"][0].__setitem__(0, "w1")),
                          "layer 0 holds"),
    "dtype": (_set((*B, "tensors", 1, 1), "float16"), "but its tensors hold"),
    "dtype-layer": (_layer0(lambda b: b["tensors"][0].__setitem__(1, "int32")), "layer 0 holds"),
    "shape": (_set((*B, "tensors", 1, 2, 0), _digit), "but its tensors hold"),
    "shape-layer": (_layer0(lambda b: b["tensors"][1].__setitem__(2, b["tensors"][1][2][::-1])),
                    "layer 0 holds"),
    "inner-offset": (_set((*B, "tensors", 1, 3), _digit), "inner offset"),
    "tensor-malformed": (_set((*B, "tensors", 0), "w1"), "expected [name, dtype, shape"),
    "block-missing": (lambda i: i["blocks"].pop(), "23 blocks, expected one per"),
    "block-extra": (lambda i: i["blocks"].append(copy.deepcopy(i["blocks"][0])), "25 blocks"),
    "block-key-missing": (_del((*B, "crc32c")), "expected an object with keys"),
    "model-missing": (_del(("model",)), "top level: keys"),
    "model-type": (_set(("model", "model_type"), "qwen3_moe"), "packed for"),
    "hidden-size": (_set(("model", "hidden_size"), 33), "packed for"),
    "moe-layers": (_set(("model", "moe_layers"), 2), "24 blocks, expected one per"),
    "num-experts": (_set(("model", "num_experts"), 7), "24 blocks, expected one per"),
    "format": (_set(("format",), "other"), "not an stmoe expert store index"),
    "version": (_set(("version",), 1), "store version 1, this stmoe reads 3 to 6"),
    "align": (_set(("align",), 512), "aligned to 512 bytes"),
    "weights-name": (_set(("weights", "name"), "int3"), "weights: weight format 'int3' is not"),
    "weights-group": (_set(("weights", "group_size"), 64), "a group size is for int4 only"),
    "weights-int8": (_set(("weights", "name"), "int8"), "layer 0 holds"),
    "data": (_set(("data",), "../experts-0000000000000000.bin"), "not a data file name"),
    "data-missing": (_set(("data",), "experts-0000000000000000.bin"), "missing, though"),
    "data-bytes": (_set(("data_bytes",), lambda n: n + 4096), "but the blocks end at"),
    "source": (_set(("source",), {"kind": "module"}), "packed from a model in memory"),
    "source-files": (_set(("source", "files", 0, 3), "00"), "[name, size, mtime_ns, sha256]"),
}
OWN_CHECK = ("format", "version")  # refused before the checksum is read


@pytest.mark.parametrize("field", list(FIELDS))
def test_one_changed_field_of_the_index_fails_its_checksum(packed, tmp_path, field):
    folder, store, _ = packed
    mutate, message = FIELDS[field]
    bad = rewrite(store, tmp_path / "bad", mutate, recompute=False)
    with pytest.raises(StoreError) as exc:
        tokens(bad, folder=folder)
    want = message if field in OWN_CHECK else "index.json fails its checksum"
    assert want in one_line_naming(exc, bad / "index.json")


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_consistent_but_wrong_index_is_refused_naming_the_entry(packed, tmp_path, field):
    folder, store, _ = packed
    mutate, message = FIELDS[field]
    bad = rewrite(store, tmp_path / "bad", mutate, recompute=True)
    with pytest.raises(StoreError) as exc:  # a model in memory: its bytes are compared
        tokens(bad, folder=folder if field == "source" else None)
    assert message in one_line_naming(exc, bad), field


def test_the_checksum_itself_and_whitespace(packed, tmp_path):
    folder, store, ref = packed
    bad = rewrite(store, tmp_path / "bad", _set(("checksum",), lambda s: s[::-1]), False)
    with pytest.raises(StoreError, match=r"index\.json fails its checksum"):
        ExpertStore(bad)
    text = (store / "index.json").read_text()  # layout only: the same index, the same tokens
    same = tmp_path / "same"
    shutil.copytree(store, same)
    (same / "index.json").write_text(" " + text.replace(": ", ":").replace("\n", "\n\t"))
    assert tokens(same, folder=folder) == ref


def test_a_one_digit_offset_through_the_cli_is_an_error_not_other_text(cli, tmp_path):
    from stmoe.models import SHIPPED_MODEL

    assert cli("pack", SHIPPED_MODEL, "-o", tmp_path / "good").exit_code == 0
    for recompute, want in ((False, "fails its checksum"), (True, "not a multiple of 4096")):
        bad = rewrite(tmp_path / "good", tmp_path / f"bad{recompute}",
                      _set(("blocks", 3, "offset"), _digit), recompute)
        result = cli("generate", "--prompt", "def f(", "--store", bad, "--capacity", "100%",
                     "--max-new-tokens", "2")
        assert result.exit_code == 1 and want in result.output, result.output
        assert "Traceback" not in result.output


def test_a_store_of_other_weights_of_the_same_shape_is_refused(packed, tmp_path):
    folder, store, ref = packed
    other, _ = tiny_model("mixtral", seed=1)
    other.save_pretrained(tmp_path / "other")
    foreign = pack(other, tmp_path / "foreign", source=tmp_path / "other")
    with pytest.raises(StoreError) as exc:  # the in-memory model's bytes differ
        tokens(foreign)
    assert "holds other weights than the model's" in one_line_naming(exc, foreign)
    with pytest.raises(StoreError) as exc:  # the folder's checkpoint differs
        tokens(foreign, folder=folder)
    msg = one_line_naming(exc, foreign)
    assert f"packed from other weights than {folder}" in msg
    # the way out never packs the other model over this store: a new folder, or its model
    assert f"-o {foreign}" not in msg
    assert (f"name the model it was packed from, or pack this one into a new folder: stmoe "
            f"pack {folder} -o NEW_FOLDER (packing into {foreign} replaces that store)") in msg
    mem = pack(other, tmp_path / "mem")  # no checkpoint recorded: cannot vouch for a folder
    with pytest.raises(StoreError, match="packed from a model in memory"):
        tokens(mem, folder=folder)
    assert tokens(store, folder=folder) == ref  # its own store still serves it


def test_a_copied_folder_is_hashed_again_and_a_swapped_file_caught(packed, tmp_path):
    folder, store, ref = packed
    copied = tmp_path / "copied"
    shutil.copytree(folder, copied, copy_function=shutil.copyfile)  # new mtimes, same bytes
    assert tokens(store, folder=copied) == ref
    other, _ = tiny_model("mixtral", seed=1)
    other.save_pretrained(tmp_path / "other")  # same size, other weights
    shutil.copyfile(tmp_path / "other" / "model.safetensors", copied / "model.safetensors")
    with pytest.raises(StoreError, match=r"model\.safetensors differs"):
        tokens(store, folder=copied)


def test_the_pack_command_records_the_checkpoint(cli, tmp_path, packed):
    folder, store, _ = packed
    assert cli("pack", folder, "-o", tmp_path / "s").exit_code == 0
    source = ExpertStore(tmp_path / "s").index.source
    assert source["kind"] == "folder" and source["files"][0][0] == "model.safetensors"
    # streamed from the shards, byte for byte the store packed from the loaded model
    assert (tmp_path / "s" / "index.json").read_bytes() == (store / "index.json").read_bytes()
    data = ExpertStore(store).data_path.name
    assert (tmp_path / "s" / data).read_bytes() == (store / data).read_bytes()


# ---- a pack killed at each step --------------------------------------------------------------
class Killed(BaseException):
    """Stands for SIGKILL: nothing after the step runs (BaseException, as KeyboardInterrupt)."""


def _kill_at(monkeypatch, step: str, old_data: str) -> None:
    if step == "data":  # half way through writing the new data file
        real, calls = store_mod.block_bytes, []

        def block_bytes(*args):
            calls.append(1)
            if len(calls) == 5:
                raise Killed
            return real(*args)

        monkeypatch.setattr(store_mod, "block_bytes", block_bytes)
    elif step == "index":  # the new data file written, index.json not yet switched
        monkeypatch.setattr(store_mod, "atomic_write_text", _raise)
    else:  # switched, the old data file not yet removed (the leftovers are removed
        real_remove = store_mod.remove_unnamed  # before the data is written, as before)

        def remove_unnamed(out, keep):
            if keep != old_data:  # keeping the new data: the switch happened
                raise Killed
            real_remove(out, keep)

        monkeypatch.setattr(store_mod, "remove_unnamed", remove_unnamed)


def _raise(*args, **kwargs):
    raise Killed


@pytest.mark.parametrize("packer", ["model", "folder"])  # pack, pack_folder (streamed)
@pytest.mark.parametrize("step", ["data", "index", "cleanup"])
def test_a_killed_pack_leaves_a_store_that_serves(packed, tmp_path, monkeypatch, step, packer):
    folder, store, ref = packed
    dest = tmp_path / "store"
    shutil.copytree(store, dest)
    other, _ = tiny_model("mixtral", seed=1)
    other.save_pretrained(tmp_path / "other")
    with monkeypatch.context() as m:
        _kill_at(m, step, ExpertStore(dest).data_path.name)
        with pytest.raises(Killed):
            pack(other, dest) if packer == "model" else pack_folder(tmp_path / "other", dest)
    if step == "cleanup":  # the switch happened: the new store, whole
        assert tokens(dest, seed=1) == tokens(seed=1)
    else:  # the old store, whole
        assert tokens(dest, folder=folder) == ref
    pack(tiny_model("mixtral")[0], dest, source=folder)  # the next pack leaves nothing behind
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in store.iterdir())
    assert tokens(dest, folder=folder) == ref


def test_a_dead_packs_temporary_files_and_a_version_1_store_are_cleaned(packed, tmp_path):
    folder, store, _ = packed
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(done.stdout)
    dest = tmp_path / "store"
    dest.mkdir()
    for name in (f".experts.bin.{dead}.abc.tmp", f".index.json.{dead}.xyz.tmp", "experts.bin",
                 "experts.bin.tmp"):
        (dest / name).write_bytes(b"x" * 100)
    (dest / "index.json").write_text(json.dumps({"format": "stmoe-expert-store", "version": 1}))
    with pytest.raises(StoreError, match="store version 1, this stmoe reads 3 to 6;"):
        ExpertStore(dest)
    pack(tiny_model("mixtral")[0], dest, source=folder)
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in store.iterdir())


def _damage(index_json: Path) -> str:
    """One digit of an offset changed in place, the checksum left as it was."""
    text = index_json.read_text()
    index = json.loads(text)
    _set(("blocks", 2, "offset"), _digit)(index)
    text = json.dumps(index, indent=1, sort_keys=True)
    index_json.write_text(text)
    return text


def test_the_cached_store_is_packed_again_with_a_note_and_a_given_one_refused(
    packed, tmp_path, monkeypatch
):
    folder, _, ref = packed
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    with monkeypatch.context() as m:  # killed during the first use's pack: half-written
        m.setattr(store_mod, "atomic_write_text", _raise)
        with pytest.raises(Killed):
            open_store(folder, None)
    with pytest.warns(StmoeNote, match="a half-written store"):
        cached = open_store(folder, None).path
    assert tokens(folder=folder) == ref
    _damage(cached / "index.json")
    with pytest.warns(StmoeNote, match="fails its checksum.*packing it again"):
        assert tokens(folder=folder) == ref
    index = json.loads((cached / "index.json").read_text())
    index["version"] = 1
    (cached / "index.json").write_text(json.dumps(index))
    with pytest.warns(StmoeNote, match="store version 1"):
        assert tokens(folder=folder) == ref
    # a store the user names is refused, never overwritten
    given = tmp_path / "given"
    shutil.copytree(cached, given)
    text = _damage(given / "index.json")
    with pytest.raises(StoreError, match="fails its checksum"):
        tokens(given, folder=folder)
    assert (given / "index.json").read_text() == text


# ---- an index edited by hand, its checksum recomputed (docs/runtime.md: what it can do) -------
def _swap(layer: int, a: int, b: int, *keys: str):
    """Blocks (layer, a) and (layer, b) swap ``keys`` (their expert numbers: the entries
    trade places; their CRC-32Cs: each keeps its bytes but lists the other's)."""

    def mutate(index):
        one, two = (next(x for x in index["blocks"] if (x["layer"], x["expert"]) == (layer, e))
                    for e in (a, b))
        for key in keys:
            one[key], two[key] = two[key], one[key]

    return mutate


@pytest.mark.parametrize("fmt", ["native", "int8", "int4"])
def test_an_index_with_two_experts_swapped_is_refused_at_open(packed, tmp_path, fmt):
    from stmoe.quant import parse_format

    folder, _, _ = packed
    store = pack_folder(folder, tmp_path / "store", weights=parse_format(fmt))
    bad = rewrite(store, tmp_path / "bad", _swap(1, 2, 5, "expert"), recompute=True)
    with pytest.raises(StoreError) as exc:
        open_store(folder, bad)
    msg = one_line_naming(exc, bad / "index.json")
    assert "layer 1, expert 2: offset" in msg and "where packing puts this block" in msg
    assert verify_store(folder, store).weights.name == fmt  # its own store is proven


def test_an_index_whose_checksums_are_swapped_fails_the_read_not_silently(packed, tmp_path):
    _, store, _ = packed
    bad = rewrite(store, tmp_path / "bad", _swap(0, 1, 2, "crc32c"), recompute=True)
    opened = ExpertStore(bad)  # sound on its own terms: each block where packing puts it
    with pytest.raises(StoreError, match="layer 0, expert 1 fails its checksum"):
        opened.read(0, 1)


def test_a_data_file_edited_with_its_index_is_caught_by_verify(packed, tmp_path, cli):
    """Two blocks' bytes swapped in the data file AND their CRC-32Cs in the index: the store
    opens (what the checks at open cannot prove), and --verify refuses it."""
    folder, store, _ = packed
    bad = rewrite(store, tmp_path / "bad", _swap(1, 2, 5, "crc32c"), recompute=True)
    opened = ExpertStore(bad)
    one, two = opened.blocks[(1, 2)], opened.blocks[(1, 5)]
    with open(opened.data_path, "r+b") as f:
        a, b = (os.pread(f.fileno(), x.nbytes, x.offset) for x in (one, two))
        os.pwrite(f.fileno(), b, one.offset)
        os.pwrite(f.fileno(), a, two.offset)
    assert block_crc(b) == one.crc32c  # consistent: every read passes its checksum
    ExpertStore(bad).check_source(folder)
    with pytest.raises(StoreError) as exc:
        verify_store(folder, bad)
    assert "layer 1, expert 2 is not what packing" in one_line_naming(exc, bad)
    result = cli("pack", folder, "-o", bad, "--verify")
    assert result.exit_code == 1 and "layer 1, expert 2 is not what packing" in result.output
    result = cli("pack", folder, "-o", store, "--verify")
    assert result.exit_code == 0 and f"verified {store}" in result.output, result.output
