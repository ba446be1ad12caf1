"""Which replayed tokens were profiled into the tables (``cli.table_notes``).

The tables keep a digest of every profiled token (its routing and the one's before it), so
``eval`` and ``simulate`` say how many of the tokens their figures are about were profiled:
a third of them (a review's case: +9 points for stmoe-plus, no note, when the note came only
past half), or a ``--split`` of one long sequence profiled whole (beyond the token memory's
1,024 tokens, no note at all)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import stmoe
from stmoe.cli.table_notes import in_sample_tokens
from stmoe.evaluate.metrics import scope_tokens
from stmoe.predictors import PredictorError, load_tables, profile, profiling, save_tables
from stmoe.trace.ranks import token_digests


def _synth(seed: int, tokens: int = 600, sequences: int = 2, **spec: object) -> stmoe.RoutingTrace:
    return stmoe.synthesize(tokens=tokens, layers=4, experts=16, top_k=2,
                            sequences=sequences, seed=seed, **spec)


def _note(output: str) -> str:
    said = " ".join(output.split())
    return said[said.index("note:"):] if "note:" in said else ""


def test_a_split_of_one_long_sequence_profiled_whole_is_in_sample(cli, tmp_path):
    trace, whole, half = tmp_path / "long.npz", tmp_path / "w.npz", tmp_path / "h.npz"
    stmoe.save_trace(_synth(2, tokens=6000, sequences=1, prefill_fraction=0.0), trace)
    assert cli("profile", trace, "-o", whole).exit_code == 0
    res = cli("eval", trace, "--tables", whole, "--split", "0.5", "--predictor", "cct-static")
    assert res.exit_code == 0, res.output
    # all but the first three (whose digests reach into the profiled half: not compared)
    assert "2997 of the 3000 decode tokens replayed (99%)" in _note(res.output), res.output
    assert cli("profile", trace, "--split", "0.5", "-o", half).exit_code == 0
    res = cli("eval", trace, "--tables", half, "--split", "0.5", "--predictor", "cct-static")
    assert res.exit_code == 0 and "in-sample" not in res.output, res.output


def test_a_third_of_the_tokens_profiled_is_said_with_its_share(cli, tmp_path):
    parts = [_synth(seed) for seed in (1, 2, 3)]
    trace, tables = tmp_path / "all.npz", tmp_path / "t.npz"
    stmoe.save_trace(stmoe.concat(parts), trace)
    save_tables(profile(parts[1]), tables)
    decode = [int(p.is_decode.sum()) for p in parts]
    res = cli("eval", trace, "--tables", tables, "--predictor", "stmoe")
    assert res.exit_code == 0, res.output
    share = f"{decode[1] / sum(decode):.0%}"
    assert (f"{decode[1]} of the {sum(decode)} decode tokens replayed ({share})"
            in _note(res.output)), res.output


def test_a_prompt_prefix_shared_with_the_profiled_routing_is_not_counted():
    """A chat template's tokens route alike in every prompt: the figures count decode
    tokens, so a held-out prompt behind the same template is held out."""
    profiled, held_out = _synth(1, sequences=1), _synth(2, sequences=1)
    prefix = 40  # the first 40 (prefill) tokens of both are the same routing
    assert not profiled.is_decode[:prefix].any() and not held_out.is_decode[:prefix].any()
    experts = held_out.experts.copy()
    experts[:prefix] = profiled.experts[:prefix]
    held_out = dataclasses.replace(held_out, experts=experts, weights=None)
    tables = profile(profiled)
    assert np.isin(token_digests(held_out)[:prefix], tables.profiled_tokens).all()
    assert in_sample_tokens(held_out, tables) == 0
    assert in_sample_tokens(profiled, tables) == int(scope_tokens(profiled).sum())


def test_beyond_the_kept_digests_a_sample_estimates_the_share(monkeypatch, tmp_path):
    monkeypatch.setattr(profiling, "PROFILED_TOKENS_MAX", 500)
    parts = [_synth(seed, tokens=2000) for seed in (1, 2)]
    tables = profile(parts[0])
    bits = tables.info["token_sample_bits"]
    assert bits >= 2 and len(tables.profiled_tokens) <= 500
    save_tables(tables, tmp_path / "t.npz")
    tables = load_tables(tmp_path / "t.npz")
    assert tables.info["token_sample_bits"] == bits
    decode = int(parts[0].is_decode.sum())
    assert abs(in_sample_tokens(parts[0], tables) - decode) <= 0.25 * decode
    assert in_sample_tokens(parts[1], tables) == 0


def test_older_tables_without_digests_fall_back_to_sequences_and_memory():
    trace = _synth(4)
    tables = dataclasses.replace(profile(trace), profiled_tokens=None)
    assert in_sample_tokens(trace, tables) == int(trace.is_decode.sum())
    assert in_sample_tokens(_synth(5), tables) == 0


def test_no_note_where_every_expert_routes(cli, tmp_path):
    """(Every token's routing is the same there: a held-out token matches a profiled one.)"""
    trace, tables = tmp_path / "s.npz", tmp_path / "t.npz"
    stmoe.save_trace(stmoe.synthesize(tokens=200, layers=3, experts=4, top_k=4, seed=1), trace)
    assert cli("profile", trace, "--split", "0.5", "-o", tables).exit_code == 0
    res = cli("eval", trace, "--tables", tables, "--split", "0.5", "--predictor", "frequency")
    assert res.exit_code == 0 and "in-sample" not in res.output, res.output


@pytest.mark.parametrize("bad,said", [
    (lambda d: d[::-1].copy(), "out of order or repeated"),
    (lambda d: d.astype(np.int64), "dtype int64"),
    (lambda d: d.reshape(1, -1), "shape"),
])
def test_damaged_digests_are_refused_by_name(tmp_path, bad, said):
    tables = profile(_synth(1))
    save_tables(dataclasses.replace(tables, profiled_tokens=bad(tables.profiled_tokens)),
                tmp_path / "t.npz")
    with pytest.raises(PredictorError, match=f"profiled_tokens.*{said}"):
        load_tables(tmp_path / "t.npz")


def test_a_sample_of_more_bits_than_a_digest_holds_is_refused(tmp_path):
    tables = profile(_synth(1))
    save_tables(dataclasses.replace(tables, info={**tables.info, "token_sample_bits": 64}),
                tmp_path / "t.npz")
    with pytest.raises(PredictorError, match="token_sample_bits"):
        load_tables(tmp_path / "t.npz")


@pytest.mark.parametrize("layers,experts", [(2, 8), (3, 4)])
def test_a_held_out_half_of_a_small_routing_space_is_not_called_in_sample(layers, experts):
    """Few distinct rows (3 layers of 4 experts, top-2: 216): two tokens in a row matched a
    third of a held-out half by chance (a review); four in a row match next to none."""
    trace = stmoe.synthesize(tokens=8000, layers=layers, experts=experts, top_k=2,
                             sequences=4, seed=1)
    profiled, held_out = stmoe.split(trace, 0.5)
    tables = profile(profiled)
    assert in_sample_tokens(held_out, tables) < 0.01 * held_out.is_decode.sum()
    assert in_sample_tokens(profiled, tables) == int(profiled.is_decode.sum())


def test_the_shipped_tables_know_what_they_were_profiled_on():
    """The shipped model's tables keep their profiled tokens' digests (made again with the
    model card's command: the same counts and fit, these added), so a replay of the routing
    they came from (``stmoe capture``'s built-in prompts) is said to be in-sample; before,
    they kept none and said nothing."""
    from stmoe.models import SHIPPED_MODEL, SHIPPED_TABLES

    tables = load_tables(f"{SHIPPED_MODEL}/{SHIPPED_TABLES}")
    assert tables.profiled_tokens is not None
    # (unique digests: two of the 890 tokens repeat another's routing and the one's before)
    assert tables.info["tokens"] == 890 and 800 < len(tables.profiled_tokens) <= 890
    assert len(tables.info["sequences"]) == 6  # the six built-in prompts
