"""A checkpoint its config.json does not describe (a reliability review, 2026-12-07): packing
it or loading it ended in a 77-line traceback of transformers' ("You set
`ignore_mismatched_sizes` to `False` ... look at the above report", a report its silenced
log never showed), and the first, useful reason (the streamed pack's) was lost."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from checkpoint_folders import saved_folder
from stmoe.errors import StmoeError, StoreError
from stmoe.hf.loading import load_causal_lm, meta_model
from stmoe.runtime.store import pack_folder


def _edited(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_config_with_fewer_experts_than_the_weights_is_one_line_naming_both(tmp_path):
    folder = _edited(saved_folder("qwen3_moe", tmp_path / "model"), num_local_experts=4)
    with pytest.raises(StmoeError, match=r"its weights do not match its config\.json \(tensors "
                                         r"of other shapes than it gives\)$"):
        load_causal_lm(folder)
    with pytest.raises(StoreError) as caught:
        pack_folder(folder, tmp_path / "store")
    said = str(caught.value)
    assert "experts.4.down_proj.weight: expected one of" in said, said  # the streamed reason
    assert "nor does the whole model load" in said and "\n" not in said, said


def test_a_config_transformers_refuses_names_the_file(tmp_path):
    folder = _edited(saved_folder("qwen3_moe", tmp_path / "model"), hidden_size="wide")
    with pytest.raises(StmoeError, match=r"config\.json: transformers refuses it \("):
        meta_model(folder)
