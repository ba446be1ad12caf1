"""The live server of the shipped model (per test module) and its resident solo runs."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server():
    """`stmoe serve` of the shipped model at 50%: (url, its Service); 3 running, 2 queued."""
    pytest.importorskip("fastapi")
    from serve_live import NAME

    from stmoe.models import SHIPPED_MODEL
    from stmoe.runtime.api import offload
    from stmoe.serve.runner import ServerThread
    from stmoe.serve.service import Service

    om = offload(SHIPPED_MODEL, capacity="50%", predictor="stmoe-plus")
    service = Service(om, NAME, max_batch=3, max_queue=2)
    try:
        with ServerThread(service) as url:
            yield url, service
    finally:
        om.close()


@pytest.fixture(scope="module")
def solo():
    """The resident model's greedy output, alone (``serve_live.Solo``)."""
    from serve_live import Solo
    from transformers import AutoModelForCausalLM

    from stmoe.models import SHIPPED_MODEL

    return Solo(AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval())
