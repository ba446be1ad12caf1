"""The CLI prints what files and users name as plain text, and refuses absurd option values.

Issue 16, items 8 and 10: a model name or domain holding rich markup (``[/]``) or
terminal escapes crashed ``import``/``info``/``eval``/``analyze`` after their output
was written, or reached the terminal; NaN, infinite, negative and out-of-range
values were accepted silently or failed with a raw numpy error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import one_line_error  # exit 1, one `error:` line, no traceback
from stmoe.cli.common import clean_label, plain_label
from stmoe.trace import save_trace, synthesize
from stmoe.trace.synth import SynthSpec

EVIL_MODEL = "evil[/]model[bold red]x\x1b[2J\x07"
EVIL_DOMAINS = ("d[/]one\x1b[2J", "[bold red]x\x07")
SHOWN = ("evil[/]model[bold red]x[2J", "d[/]one[2J", "[bold red]x")  # literally, no controls


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A synthetic trace, N=8 experts, two domains."""
    path = tmp_path_factory.mktemp("traces") / "small.npz"
    spec = SynthSpec(tokens=160, layers=4, experts=8, top_k=2, sequences=2, domains=2)
    save_trace(synthesize(spec), path)
    return path


@pytest.fixture(scope="module")
def evil(small, tmp_path_factory):
    """The same trace, its model and domain names full of markup and terminal escapes."""
    from stmoe import load_trace

    trace = load_trace(small)
    meta = dataclasses.replace(trace.meta, model=EVIL_MODEL)
    path = tmp_path_factory.mktemp("evil") / "evil.npz"
    save_trace(dataclasses.replace(trace, meta=meta, domains=EVIL_DOMAINS), path)
    return path


def assert_literal(result, *shown: str) -> None:
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    for text in shown:
        assert text in result.output, (text, result.output)


def test_clean_label_drops_terminal_controls_and_escapes_markup():
    assert plain_label("a\x1b[2Jb\x07\x9bc\u202ed\ne") == "a[2Jbcde"
    assert plain_label("line\none\ttab\x1b", multiline=True) == "line\none\ttab"
    assert clean_label("[bold red]x[/]") == "\\[bold red]x\\[/]"


def test_markup_and_escapes_in_labels_print_literally(cli, evil, tmp_path):
    out = tmp_path / "imported.npz"
    assert_literal(cli("import", evil, "-o", out), "evil[/]model[bold red]x")
    assert out.is_file()
    assert_literal(cli("info", evil), *SHOWN)
    assert_literal(cli("eval", evil, "--cross-domain"), *SHOWN)
    report = tmp_path / "report"
    assert_literal(cli("analyze", evil, "-o", report), SHOWN[0])
    assert (report / "report.html").is_file() and (report / "report.md").is_file()
    assert "\x1b" not in (report / "report.html").read_text()  # no terminal escapes in HTML


def test_emoji_codes_in_labels_print_literally(cli, small, tmp_path):
    from stmoe import load_trace

    trace = load_trace(small)
    path = tmp_path / "emoji.npz"
    save_trace(dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, model="a:smile:b")),
               path)
    assert_literal(cli("info", path), "a:smile:b")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["eval", "{t}", "--seed", "-1"], ["--seed -1", "integer >= 0"]),
        (["eval", "{t}", "--capacity", "100"], ["--capacity '100'", "so at most 8", "2 to 8"]),
        (["eval", "{t}", "--capacity", "0"], ["--capacity '0'", "below the router's top-2"]),
        (["eval", "{t}", "--set-size", "9"], ["--set-size 9", "from 0 to 8"]),
        (["eval", "{t}", "--set-size", "-1"], ["--set-size -1", "from 0 to 8"]),
        (["eval", "{t}", "--horizon", "4"], ["--horizon 4", "from 1 to 3"]),
        (["eval", "{t}", "--split", "nan"], ["--split nan", "strictly between 0 and 1"]),
        (["eval", "{t}", "--predictor", "stmoe", "--lookahead", "early"],
         ["--lookahead early", "none of stmoe takes a gate lookahead"]),
        (["eval", "{t}", "--lookahead", "bogus"], ["--lookahead bogus", "auto, early or late"]),
        (["generate", "--prompt", "x", "--sequence", "3"], ["--sequence applies to --routing"]),
        (["profile", "{t}", "-o", "{d}/t.npz", "--split", "1"], ["--split 1.0", "strictly"]),
        (["profile", "{t}", "-o", "{d}/t.npz", "--row-width", "0"], ["--row-width 0"]),
        (["profile", "{t}", "-o", "{d}/t.npz", "--row-width", "9"],
         ["--row-width 9", "8 experts per layer"]),
        (["import", "{t}", "-o", "{d}/x.npz", "--num-experts", "0"], ["--num-experts 0", ">= 1"]),
        (["simulate", "{t}", "--model", "x", "--batch", "0"], ["--batch 0", ">= 1"]),
        (["simulate", "{t}", "--model", "x", "--pregate-accuracy", "nan"],
         ["--pregate-accuracy nan", "from 0 to 1"]),
        (["simulate", "{t}", "--model", "x", "--adap-threshold", "inf"],
         ["--adap-threshold inf", "from 0 to 1"]),
        (["train-tiny", "-o", "{d}/m", "--minutes", "inf"], ["--minutes inf", "from 0.1 to"]),
        (["train-tiny", "-o", "{d}/m", "--minutes", "nan"], ["--minutes nan"]),
        (["train-tiny", "-o", "{d}/m", "--seed", "-3"], ["--seed -3", ">= 0"]),
        (["capture", "-o", "{d}/c.npz", "--max-new-tokens", "0"], ["--max-new-tokens 0"]),
        (["capture", "-o", "{d}/c.npz", "--batch-size", "-1"], ["--batch-size -1", ">= 1"]),
        (["generate", "--prompt", "x", "--workers", "-1"], ["--workers -1", "from 0 to 64"]),
        (["generate", "--prompt", "x", "--workers", "100000"], ["--workers 100000"]),
        (["generate", "--prompt", "x", "--threads", "0"], ["--threads 0", "from 1 to 1024"]),
        (["generate", "--prompt", "x", "--max-loads", "-2"], ["--max-loads -2", ">= 0"]),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens 0", ">= 1"]),
    ],
)
def test_absurd_option_values_are_one_clear_line(cli, small, tmp_path, args, fragments):
    args = [a.format(t=small, d=tmp_path) for a in args]
    one_line_error(cli(*args), *fragments)


@pytest.mark.parametrize("command", ["info", "eval", "simulate"])
def test_json_into_a_directory_is_refused_before_any_work(cli, small, tmp_path, command):
    extra = ["--model", "qwen1.5-moe-a2.7b"] if command == "simulate" else []
    one_line_error(cli(command, small, *extra, "--json", tmp_path), "is a directory")


def test_json_files_are_written_whole(cli, small, tmp_path):
    dest = tmp_path / "sub" / "eval.json"
    result = cli("eval", small, "--predictor", "oracle", "--json", dest)
    assert result.exit_code == 0, result.output
    assert json.loads(dest.read_text())["predictors"]["oracle"]["recall"] == 1.0
    assert [p.name for p in dest.parent.iterdir()] == ["eval.json"]  # no temporary left


@pytest.mark.parametrize(
    "args",
    [
        ["info", "{m}"],
        ["eval", "{m}"],
        ["analyze", "{m}", "-o", "{d}/r"],
        ["profile", "{m}", "-o", "{d}/t.npz"],
        ["export", "{m}", "-o", "{d}/e.jsonl"],
        ["import", "{m}", "-o", "{d}/x.npz"],
        ["simulate", "{t}", "--model", "{m}.toml"],
        ["capture", "-o", "{d}/c.npz", "--prompts", "{m}"],
        ["generate", "--prompt", "x", "--tables", "{m}"],
    ],
)
def test_a_missing_input_file_is_exit_1(cli, small, tmp_path, args):
    missing = tmp_path / "missing"
    args = [a.format(m=missing, t=small, d=tmp_path) for a in args]
    one_line_error(cli(*args), str(missing), "no such file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize(
    "args",
    [
        ["capture", "-o", "{d}/c.npz", "--prompts", "{f}"],
        ["generate", "--prompt", "x", "--tables", "{f}"],
        ["simulate", "{f}", "--model", "qwen1.5-moe-a2.7b"],
        ["eval", "{f}"],
    ],
)
def test_a_fifo_input_is_refused_not_read(cli, tmp_path, args):
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    one_line_error(cli(*[a.format(f=fifo, d=tmp_path) for a in args]), "not a regular file")


def test_generate_refuses_a_model_path_that_is_not_a_folder(cli, small):
    one_line_error(cli("generate", "--prompt", "x", "--model", small), "not a folder")


# The runtime's own checks (stmoe.offload takes the same values as the CLI).


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        ("inf%", "from 0% to 100%"),
        ("nan%", "from 0% to 100%"),
        ("200%", "from 0% to 100%"),
        (17, "at most 16"),
        ("17", "at most 16"),
        ("-5", "a whole number of experts"),
        ("1e400GB", "above zero"),
        (True, "not a count, a share or a size"),
    ],
)
def test_capacity_beyond_the_experts_is_refused(capacity, message):
    pytest.importorskip("torch")
    from stmoe.errors import OffloadError
    from stmoe.runtime.options import resolve_capacities

    with pytest.raises(OffloadError, match=message):
        resolve_capacities(capacity, 4, 16, 2, 1000)


def test_capacity_that_fits_everything_is_all_experts():
    pytest.importorskip("torch")
    from stmoe.runtime.options import resolve_capacities

    assert resolve_capacities("100%", 4, 16, 2, 1000) == (16,) * 4
    assert resolve_capacities(16, 4, 16, 2, 1000) == (16,) * 4
    assert resolve_capacities("64GB", 4, 16, 2, 1000) == (16,) * 4  # a budget is a ceiling


@pytest.mark.parametrize("text", ["inf", "nan", "0", "-1MB", "1e400", "infMB"])
def test_parse_bytes_refuses_non_finite_and_non_positive(text):
    pytest.importorskip("torch")
    from stmoe.util.units import UnitError, parse_bytes

    with pytest.raises(UnitError):
        parse_bytes(text)


def test_sizes_take_terabytes():
    """Issue 44: ``--memory 1TB`` was refused as an unknown unit."""
    from stmoe.util.units import parse_bytes

    assert parse_bytes("1TB") == 1e12 and parse_bytes("2TiB") == 2 * 2**40
    assert parse_bytes("1.5tb") == 1.5e12 and parse_bytes("1TB/s") == 1e12


# One capacity parser (issue 42, item 3): 16 experts per layer, top-4, 4 layers of 1000-byte
# experts; every caller reads a capacity through it.


@pytest.mark.parametrize(
    ("capacity", "per_layer"),
    [
        (8, 8), ("8", 8), (" 16 ", 16), (4, 4),  # counts, top-k to N
        ("50%", 8), ("100%", 16), ("25%", 4), ("31.25%", 5),  # shares of N, rounded
        ("24KB", 6), ("16000B", 4), ("64GB", 16), ("1TB", 16),  # bytes: a ceiling
    ],
)
def test_a_capacity_in_every_form_gives_experts_per_layer(capacity, per_layer):
    from stmoe.util.units import capacity_per_layer

    assert capacity_per_layer(capacity, 16, 4, num_layers=4, expert_bytes=1000) == per_layer


@pytest.mark.parametrize(
    ("capacity", "problem"),
    [
        (17, "there are 16 experts per layer, so at most 16"),
        ("3", "gives 3 experts per layer, below the router's top-4"),
        (0, "gives 0 experts per layer, below the router's top-4"),
        (-1, "gives -1 experts per layer"),
        ("20%", "gives 3 experts per layer, below the router's top-4"),
        ("0%", "gives 0 experts per layer"),
        ("100.5%", "a share is from 0% to 100%"),
        ("-5%", "a share is from 0% to 100%"),
        ("nan%", "a share is from 0% to 100%"),
        ("x%", "not a share"),
        ("15999B", "gives 3 experts per layer"),  # bytes: 3 of 1000 in each of 4 layers
        ("1KB", "gives 0 experts per layer"),
        ("-5MB", "not a finite size above zero"),
        ("1e400GB", "not a finite size above zero"),
        ("3.5", "a count is a whole number of experts, and a size needs its unit"),  # (0 experts
        ("1e3", "a count is a whole number of experts, and a size needs its unit"),  # as bytes)
        ("-5", "a count is a whole number of experts"),
        ("3 parsecs", "unknown unit 'parsecs'"),
        ("lots", "not a count, a share or a size"),
        (True, "not a count, a share or a size"),
    ],
)
def test_a_capacity_out_of_bounds_names_what_was_given_and_what_is_allowed(capacity, problem):
    from stmoe.util.units import UnitError, capacity_per_layer

    with pytest.raises(UnitError) as refused:
        capacity_per_layer(capacity, 16, 4, num_layers=4, expert_bytes=1000)
    message = str(refused.value)
    given = repr(capacity) if isinstance(capacity, str) else str(capacity)
    assert message.startswith(f"capacity {given}"), message
    assert problem in message, message
    assert message.endswith("expected 4 to 16 experts per layer, a share of the experts (50%, "
                            "at most 100%) or a size in bytes (64MB)"), message


def test_a_router_top_k_above_the_layers_experts_is_said_as_such():
    """(A config.json with num_experts_per_tok 20 of 16 experts: "expected 20 to 16".)"""
    from stmoe.util.units import UnitError, capacity_per_layer

    with pytest.raises(UnitError, match=r"^the model's router picks 20 experts per token of "
                                        r"the 16 a layer has: its config's top-k"):
        capacity_per_layer("50%", 16, 20)


def test_a_capacity_of_the_forms_a_caller_takes_refused_in_its_error_and_name():
    from stmoe.errors import OffloadError
    from stmoe.util.units import capacity_per_layer

    with pytest.raises(OffloadError, match=r"^--capacity '64MB': not a count or a share; "
                       r"expected 2 to 8 experts per layer or a share of the experts"):
        capacity_per_layer("64MB", 8, 2, forms=("count", "share"), name="--capacity",
                           error=OffloadError)
    with pytest.raises(OffloadError, match=r"^--capacity '50%': not a count; expected 2 to 8 "
                       r"experts per layer$"):
        capacity_per_layer("50%", 8, 2, forms=("count",), name="--capacity", error=OffloadError)
    assert capacity_per_layer("0", 8, 0, forms=("count",)) == 0  # a bound of 0: none is allowed


def test_a_byte_budget_before_the_experts_size_is_known_is_checked_for_its_grammar_only():
    from stmoe.util.units import UnitError, capacity_per_layer

    assert capacity_per_layer("1B", 16, 4) is None  # its count: once the store is open
    assert capacity_per_layer("50%", 16, 4) == 8
    with pytest.raises(UnitError, match="unknown unit"):
        capacity_per_layer("1XB", 16, 4)


def test_the_config_names_are_read_from_a_config_object_or_its_json():
    from types import SimpleNamespace

    from stmoe.util.config_names import NUM_EXPERTS, TOP_K, config_int

    mixtral = {"num_local_experts": 8, "num_experts_per_tok": 2}
    assert (config_int(mixtral, NUM_EXPERTS), config_int(mixtral, TOP_K)) == (8, 2)
    multimodal = SimpleNamespace(text_config=SimpleNamespace(n_routed_experts=64, moe_topk=6))
    assert (config_int(multimodal, NUM_EXPERTS), config_int(multimodal, TOP_K)) == (64, 6)
    assert config_int({"num_experts": True, "top_k": 0}, NUM_EXPERTS + TOP_K) is None
    assert config_int(None, TOP_K) is None and config_int([1], TOP_K) is None


@pytest.mark.parametrize("text", ["inf", "nan", "-5s", "-1ms", "1e400"])
def test_parse_seconds_refuses_non_finite_and_negative(text):
    pytest.importorskip("torch")
    from stmoe.util.units import UnitError, parse_seconds

    with pytest.raises(UnitError, match="finite duration >= 0"):
        parse_seconds(text)


@pytest.mark.parametrize(
    ("tier", "bandwidth", "latency", "message"),
    [
        ("disk", "abc", 0.0, "--bandwidth applies to --tier emulated only"),
        ("gpu", "1GB", 0.0, "--bandwidth applies to --tier emulated only"),
        ("disk", None, "2ms", "--latency applies to --tier emulated only"),
        ("emulated", None, 0.0, "needs a bandwidth"),
        ("emulated", "1GB", "inf", "--latency 'inf'"),
        ("emulated", "1GB", "-5s", "--latency '-5s'"),
        ("emulated", "1GB", "2h", "--latency '2h'"),
        ("emulated", "1GB", 100.0, "0 to 60 s"),
        ("emulated", float("nan"), 0.0, "--bandwidth nan"),
        ("emulated", "10B", 0.0, "at least 1KB"),
        ("emulated", "abc", 0.0, "--bandwidth 'abc'"),
    ],
)
def test_link_settings_are_checked_before_anything_loads(tier, bandwidth, latency, message):
    pytest.importorskip("torch")
    from stmoe.errors import OffloadError
    from stmoe.runtime.options import OffloadOptions

    options = OffloadOptions(tier=tier, bandwidth=bandwidth, latency=latency)
    with pytest.raises(OffloadError, match=message.replace("(", r"\(")):
        options.check()
    assert OffloadOptions(tier="emulated", bandwidth="200MB", latency="50us").check() is None


def test_generate_refuses_a_bandwidth_on_the_disk_tier(cli, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path / "cache"))
    result = cli("generate", "--prompt", "x", "--bandwidth", "abc")
    one_line_error(result, "--bandwidth applies to --tier emulated only")


# Outputs: never an input of the same command, never a device or FIFO; links written through.


@pytest.mark.parametrize(
    "args",
    [
        ["profile", "{t}", "-o", "{t}"],
        ["export", "{t}", "--format", "jsonl", "-o", "{t}"],
        ["info", "{t}", "--json", "{t}"],
        ["import", "{t}", "-o", "{t}"],
    ],
)
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(cli, small, tmp_path, args):
    trace = tmp_path / "t.npz"
    trace.write_bytes(small.read_bytes())
    one_line_error(cli(*[a.format(t=trace) for a in args]), str(trace), "is also an input")
    assert trace.read_bytes() == small.read_bytes()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("args", [["profile", "{t}", "-o", "{f}"], ["info", "{t}", "--json", "{f}"],
                                  ["synth", "--tokens", "50", "-o", "{f}"]])
def test_an_output_that_is_a_fifo_or_device_is_refused_not_replaced(cli, small, tmp_path, args):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    one_line_error(cli(*[a.format(t=small, f=fifo) for a in args]), "not a regular file")
    assert fifo.is_fifo()


def test_an_output_link_is_written_through(cli, small, tmp_path):
    target, link = tmp_path / "real.npz", tmp_path / "link.npz"
    link.symlink_to(target)
    assert cli("profile", small, "-o", link).exit_code == 0
    assert link.is_symlink() and target.is_file()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to make a file unreadable to stmoe")
def test_an_unreadable_input_is_exit_1_not_a_usage_error(small, tmp_path):
    locked = tmp_path / "locked.npz"
    locked.write_bytes(small.read_bytes())
    locked.chmod(0)
    stmoe = [sys.executable, "-m", "stmoe"]
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--ambient-caps=-all"]
    done = subprocess.run([*drop, *stmoe, "info", str(locked)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: ") and "permission denied" in done.stderr


def test_eval_takes_a_capacity_as_a_share_as_generate_does(cli, small, tmp_path):
    """50% of the trace's 8 experts is the count 4: the same replay, the same JSON."""
    for capacity in ("4", "50%"):
        res = cli("eval", small, "--predictor", "oracle", "--capacity", capacity, "--json",
                  tmp_path / f"{capacity[-1]}.json")
        assert res.exit_code == 0, res.output
    by_count, by_share = (json.loads((tmp_path / f"{c}.json").read_text()) for c in "4%")
    assert by_share["predictors"] == by_count["predictors"]
    assert by_share["predictors"]["oracle"]["cache"]["capacity"] == 4


def test_a_missing_model_folder_or_store_is_said_to_be_missing(cli, tmp_path):
    res = cli("pack", tmp_path / "nowhere", "-o", tmp_path / "s1")
    one_line_error(res, f"{tmp_path / 'nowhere'}: no such folder; give a local transformers "
                   "checkpoint folder")
    assert "--model" not in res.output  # (pack takes the folder as its argument)
    (tmp_path / "notes.txt").write_text("mine")
    one_line_error(cli("pack", tmp_path / "notes.txt", "-o", tmp_path / "s2"),
                   "notes.txt: a file; give the checkpoint's folder")
    one_line_error(cli("generate", "--store", tmp_path / "gone", "--prompt", "hi"),
                   f"{tmp_path / 'gone'}: no such folder; write a store there with `stmoe pack`")
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s2").exists()


def test_an_unknown_policy_is_refused_even_without_a_capacity(cli, small):
    one_line_error(cli("eval", small, "--policy", "xyz"), "unknown cache policy 'xyz'")


def test_eval_with_score_eviction_says_which_predictors_ran_lru(cli, small, tmp_path):
    import json

    from stmoe.predictors import profile, save_tables
    from stmoe.trace import load_trace

    tables = save_tables(profile(load_trace(small)), tmp_path / "t.npz")
    res = cli("eval", small, "--tables", tables, "--capacity", "4", "--policy", "score",
              "--predictor", "stmoe-plus", "--predictor", "stmoe", "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert "note: --policy score: stmoe scores no expert, so its cache ran lru" in res.output
    caches = {n: p["cache"]["policy"]
              for n, p in json.loads((tmp_path / "r.json").read_text())["predictors"].items()}
    assert caches == {"stmoe-plus": "score", "stmoe": "lru"}
    res = cli("eval", small, "--tables", tables, "--capacity", "4", "--policy", "score",
              "--predictor", "stmoe", "--predictor", "ondemand")
    assert "stmoe, ondemand score no expert, so their caches ran lru" in res.output


def test_a_fit_of_another_version_is_said_not_silently_replaced(cli, small, tmp_path):
    from stmoe.predictors import profile, save_tables
    from stmoe.trace import load_trace

    tables = profile(load_trace(small))
    info = {**tables.info, "plus": {**tables.info["plus"], "version": 99}}
    save_tables(dataclasses.replace(tables, info=info), tmp_path / "t99.npz")
    res = cli("eval", small, "--tables", tmp_path / "t99.npz", "--predictor", "stmoe-plus")
    assert res.exit_code == 0, res.output
    assert "fit of version 99" in res.output and "default weights" in res.output


def test_the_cross_domain_matrix_is_the_named_predictors(cli, small):
    res = cli("eval", small, "--predictor", "oracle", "--cross-domain")
    assert res.exit_code == 0 and "cross-domain recall (oracle)" in res.output, res.output


@pytest.mark.parametrize("command", [["profile", "-o", "{d}/t.npz"], ["split-capacity"],
                                     ["import", "-o", "{d}/i.npz"]])
def test_the_same_trace_given_twice_is_refused(cli, small, tmp_path, command):
    """Under another name too (a hard link): its routing would count twice, and a held-out
    part could hold a copy of a profiled one (review item 10)."""
    link = tmp_path / "link.npz"
    os.link(small, link)
    name, *opts = command
    args = [name, str(small), str(link), *(a.format(d=tmp_path) for a in opts)]
    one_line_error(cli(*args), "the same file as", "given twice")


def test_a_file_where_an_output_folder_goes_says_so(cli, small, tmp_path):
    (tmp_path / "afile").write_text("mine")
    one_line_error(cli("analyze", small, "-o", tmp_path / "afile"), "afile: File exists",
                   "a folder was expected there")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["eval", "{t}", "--json", "{f}/sub/e.json"], "--json"),
        (["simulate", "{t}", "--model", "qwen1.5-moe-a2.7b", "--json", "{f}/s.json"], "--json"),
        (["analyze", "{t}", "-o", "{f}/report"], "-o/--output"),
        (["profile", "{t}", "-o", "{f}/t.npz"], "-o/--output"),
        (["generate", "--prompt", "x", "--json", "{f}/run.json"], "--json"),
    ],
)
def test_an_output_under_a_file_is_refused_before_any_work(cli, small, tmp_path, args, flag):
    """Found after the work (a generation, a replay), the work was lost."""
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    args = [a.format(t=small, f=afile) for a in args]
    result = cli(*args)
    one_line_error(result, f"({flag}): {afile} is a file, not a folder")
    assert "tokens/s" not in result.output and "recall" not in result.output  # no work done
    assert afile.read_text() == "mine"


def test_a_dangling_output_link_is_judged_by_its_target(cli, small, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.symlink_to(tmp_path / "notes.txt" / "e.json")
    good.symlink_to(tmp_path / "out" / "e.json")
    one_line_error(cli("eval", small, "--json", bad), f"{bad} (--json): "
                   f"{tmp_path / 'notes.txt'} is a file")
    assert cli("eval", small, "--predictor", "oracle", "--json", good).exit_code == 0
    assert (tmp_path / "out" / "e.json").is_file()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to make a folder unwritable to stmoe")
def test_an_output_in_a_folder_this_user_cannot_write_is_refused_first(small, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--ambient-caps=-all"]
    done = subprocess.run([*drop, sys.executable, "-m", "stmoe", "eval", str(small), "--json",
                           str(locked / "sub" / "e.json")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: ") and "recall" not in done.stdout
    assert f"the folder {locked} is not writable by this user" in done.stderr, done.stderr


def test_a_tables_file_given_as_a_trace_is_named_for_what_it_is(cli, small, tmp_path):
    assert cli("profile", small, "-o", tmp_path / "t.npz").exit_code == 0
    one_line_error(cli("info", tmp_path / "t.npz"), "this is a tables file")


def test_a_split_that_rounds_to_whole_sequences_says_so(cli, small, tmp_path):
    res = cli("profile", small, "--split", "0.0001", "-o", tmp_path / "t.npz")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "--split 0.0001 splits the trace's 2 sequences whole" in said, said
    res = cli("profile", small, "--split", "0.5", "-o", tmp_path / "h.npz")
    assert res.exit_code == 0 and "note:" not in res.output, res.output


@pytest.mark.parametrize("raised", ["plain", "inside numba"])
def test_ctrl_c_is_one_word_and_status_130(raised, capsys):
    """(A reliability review: Ctrl-C during `stmoe profile` landed inside a compiled kernel,
    which numba wraps in a SystemError: a traceback and status 1.)"""
    import typer

    from stmoe.cli.common import friendly

    @friendly
    def command() -> None:
        if raised == "plain":
            raise KeyboardInterrupt
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise SystemError("CPUDispatcher(...) returned a result with an exception set") \
                from exc

    with pytest.raises(typer.Exit) as ended:
        command()
    assert ended.value.exit_code == 130
    assert capsys.readouterr().err.strip() == "interrupted"

    @friendly
    def broken() -> None:  # another SystemError is not an interrupt
        raise SystemError("something else")

    with pytest.raises(SystemError, match="something else"):
        broken()
