"""The main job: a reduced `stmoe demo --quick` on the shipped model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.models import SHIPPED_MODEL


def test_shipped_model_loads_with_plain_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)
    assert model.config.model_type == "qwen2_moe"
    assert 16 <= model.config.num_experts <= 64 and 8 <= model.config.num_hidden_layers <= 16
    assert len(tok("def f(x):\n    return x")["input_ids"]) > 3
    size = sum(p.stat().st_size for p in SHIPPED_MODEL.iterdir())
    assert size <= 50 * 2**20


def test_quick_demo_writes_the_report(cli, tmp_path):
    result = cli("demo", "--quick", "-o", tmp_path / "demo")
    assert result.exit_code == 0, result.output
    assert "report:" in result.output and "index.html" in result.output
    page = (tmp_path / "demo" / "index.html").read_text()
    for fragment in ("Recall", "Cross-domain", "Correlation analysis", "Simulator", "generates"):
        assert fragment in page
    evaluation = json.loads((tmp_path / "demo" / "eval.json").read_text())
    assert set(evaluation["per_domain"]) == {"code", "prose", "math"}
    assert (tmp_path / "demo" / "analysis" / "report.html").exists()
    assert (tmp_path / "demo" / "simulator" / "normalized_time.png").exists()
