"""vLLM refusing to start with the plugin asked for what it cannot do: one line naming
the setting, from the process that reads STMOE_VLLM (a bad key) or from the worker once it
knows the model (a dtype in-place reads cannot give). Skipped where vLLM is not installed
(``make test`` runs these in ``.venv-vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test` runs these in "
                    ".venv-vllm (pip install 'stmoe[vllm]')")

from stmoe.models import SHIPPED_MODEL
from vllm_runs import PROMPTS, start


def test_a_bad_setting_stops_vllm_with_one_line_naming_it(tmp_path):
    p = start(tmp_path, {"model": str(SHIPPED_MODEL), "prompts": PROMPTS[:1],
                         "runs": [{"name": "bad", "stmoe": "capacity=4,speed=fast",
                                   "max_tokens": 2, "batches": [[0]]}]})
    assert p.returncode != 0
    assert "STMOE_VLLM item 2: unknown key 'speed'; the keys are capacity" in p.stderr


def test_in_place_refuses_a_dtype_vllm_casts_to_in_one_line(tmp_path):
    """The shipped checkpoint is float32: vLLM in bfloat16 would cast each expert, which
    in-place reads cannot do as they land."""
    p = start(tmp_path, {"model": str(SHIPPED_MODEL), "prompts": PROMPTS[:1],
                         "dtype": "bfloat16",
                         "runs": [{"name": "bf16", "stmoe": "capacity=4,experts=in-place,"
                                   f"kernel=variants,store={tmp_path / 'index'}",
                                   "max_tokens": 2, "batches": [[0]]}]})
    assert p.returncode != 0
    assert ("stmoe: the checkpoint's experts are float32 and vLLM runs bfloat16: "
            "experts=in-place reads them as they are") in p.stdout + p.stderr


def test_another_vllm_version_is_refused(monkeypatch):
    import vllm

    from stmoe.vllm_plugin.config import PluginConfigError
    from stmoe.vllm_plugin.install import install

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(PluginConfigError, match=r"vLLM 0\.31\.2 is not supported; the plugin "
                       r"is tested with vLLM 0\.30"):
        install("capacity=4")
