"""stmoe inside vLLM: offloads vLLM's routed experts with stmoe's cache, store and predictor.

vLLM calls :func:`register` in every process through the ``vllm.general_plugins`` entry
point; it does nothing unless the environment variable ``STMOE_VLLM`` asks for it
(docs/vllm.md). This module imports no vLLM: the plugin's work lives beside it.
"""

from __future__ import annotations

import os

ENV_VAR = "STMOE_VLLM"


OFF = ("", "0", "off", "false", "no")  # STMOE_VLLM values that leave the plugin off


def register() -> None:
    """vLLM's plugin hook: switch stmoe on where ``STMOE_VLLM`` is set (and not to one of
    OFF), else nothing."""
    if os.environ.get(ENV_VAR, "").strip().lower() in OFF:
        return
    from stmoe.vllm_plugin.install import install

    install(os.environ[ENV_VAR])
