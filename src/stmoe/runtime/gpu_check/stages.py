"""The GPU check's measuring stages, each ``Check -> its record``: the environment, host
to device copies, torch's CUDA int8/int4 kernels on the stored layouts, the decode table
(``decode``), accelerate's offload and calibrate with the simulator (``baselines``), the
cuda-marked tests, ``--tier gpu`` against the GPU-resident shipped model.

Why each takes only the ``Check``: a dry run (``c.dry``) runs the same code on the CPU
with tiny sizes, so the plumbing is tested where no GPU is; ``run_stages`` takes any
mapping of them, so a test can put a failing one in a stage's place.
"""

from __future__ import annotations

import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stmoe.errors import OffloadError
from stmoe.runtime.gpu_check.baselines import accelerate_offload, calibrate_simulator
from stmoe.runtime.gpu_check.decode import decode_table, device_context
from stmoe.runtime.gpu_check.record import KIB, MIB, Check

if TYPE_CHECKING:
    import torch

    from stmoe.quant.formats import WeightFormat

MODEL_PRESET = "qwen3.6-35b-a3b"  # the expert the copies and kernels are sized by
Stage = Callable[[Check], dict[str, Any]]


def expert_shape() -> tuple[int, int, int]:
    """(hidden, expert width, bytes) of the preset's expert."""
    from stmoe.sim.specs import model_preset

    spec = model_preset(MODEL_PRESET)
    return spec.hidden, spec.expert_intermediate, spec.expert_bytes


def environment(c: Check) -> dict[str, Any]:
    torch = c.torch
    from stmoe.quant.cuda_kernels import has_cuda_kernel
    from stmoe.quant.int4_layout import cpu_layout

    rec: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(), "cpu_int4_layout": cpu_layout(),
        "kernels": {op: has_cuda_kernel(op) for op in (
            "_weight_int4pack_mm", "_convert_weight_to_int4pack", "_weight_int8pack_mm")}}
    for mod in ("transformers", "accelerate", "safetensors", "numba", "crc32c"):
        try:
            rec[mod] = getattr(__import__(mod), "__version__", "present")
        except ImportError:
            rec[mod] = None
    if c.cuda:
        from stmoe.runtime.store.device_ops import loaded_library

        free, total = torch.cuda.mem_get_info()
        major, minor = torch.cuda.get_device_capability()
        lib = loaded_library("libcudart.so")  # where a failed page-lock's error is cleared
        rec.update(device_name=torch.cuda.get_device_name(), capability=f"{major}.{minor}",
                   free_bytes=free, total_bytes=total,
                   cudart_library=getattr(lib, "_name", None), nvidia_smi=nvidia_smi())
    with open("/proc/meminfo") as f:
        rec["host_mem_total_kib"] = int(f.readline().split()[1])
    return rec


SMI_FIELDS = ("compute_mode", "driver_version", "pcie.link.gen.current",
              "pcie.link.width.current", "pcie.link.gen.max", "clocks.max.sm")


def nvidia_smi() -> dict[str, str]:
    """What the bandwidths and the cuda tests' stage are read against: the link the copies
    took (PCIe generation and width), and the compute mode (an exclusive one keeps the
    tests' second process off the GPU); an error's text where nvidia-smi cannot say."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    lines = out.stdout.splitlines()
    if not lines:  # (the environment stage must not fail on what it only records)
        return {"error": f"nvidia-smi printed nothing; stderr: {out.stderr.strip()[:200]}"}
    values = [v.strip() for v in lines[0].split(",")]
    return dict(zip(SMI_FIELDS, values, strict=False))


def h2d(c: Check) -> dict[str, Any]:
    torch = c.torch
    from stmoe.runtime.store.device_ops import CudaHostPinning
    from stmoe.runtime.store.stand_in import NoPinning

    sizes = [64 * KIB, 1 * MIB] if c.dry else [64 * KIB << (2 * i) for i in range(8)]  # to 1 GiB
    pinning = CudaHostPinning() if c.cuda else NoPinning()
    rows = []
    for n in sizes:
        dst = torch.empty(n, dtype=torch.uint8, device=c.device)
        reps = max(1, min(50, (256 * MIB) // n)) if not c.dry else 2
        row: dict[str, Any] = {"bytes": n}
        kinds = {"pageable": torch.empty(n, dtype=torch.uint8),
                 "pinned": torch.empty(n, dtype=torch.uint8, pin_memory=c.cuda)}
        mapped = mmap.mmap(-1, n)
        registered = torch.frombuffer(mapped, dtype=torch.uint8)
        try:  # a refusal (some virtualised GPUs) is recorded: the runs then allocate locked
            pinning.register(registered.data_ptr(), n)
            kinds["registered"] = registered
        except OffloadError as exc:
            row["registered_error"] = str(exc)
        try:
            for kind, src in kinds.items():
                src.fill_(1)
                s = c.timed(lambda src=src, dst=dst: dst.copy_(src, non_blocking=True), reps)
                row[f"{kind}_GBps"] = round(n / s / 1e9, 3)
        finally:
            if "registered" in kinds:
                pinning.unregister(registered.data_ptr())
            del kinds, registered
        rows.append(row)
    expert = expert_shape()[2] if not c.dry else 64 * KIB
    src = torch.empty(expert, dtype=torch.uint8, pin_memory=c.cuda)
    slots = torch.empty(8, expert, dtype=torch.uint8, device=c.device)
    # one copy alone (its latency included), and a token's top-8 back to back on one stream
    one = c.timed(lambda: slots[0].copy_(src, non_blocking=True), 1, 21 if not c.dry else 3)
    eight = c.timed(lambda: [slots[i].copy_(src, non_blocking=True) for i in range(8)], 1,
                    11 if not c.dry else 3)
    issue = []
    for _ in range(50 if not c.dry else 3):
        t = time.perf_counter()
        slots[1].copy_(src, non_blocking=True)
        issue.append(time.perf_counter() - t)
        if c.cuda:
            torch.cuda.synchronize()
    peak = max(r["pinned_GBps"] for r in rows)
    return {"sizes": rows, "pinned_peak_GBps": peak, "expert_bytes": expert,
            "expert_copy_us": round(one * 1e6, 2), "top8_copy_us": round(eight * 1e6, 2),
            "copy_issue_us": round(statistics.median(issue) * 1e6, 2),
            "expert_copy_GBps": round(expert / one / 1e9, 3)}


def kernels(c: Check) -> dict[str, Any]:
    torch = c.torch
    from stmoe.quant import parse_format
    from stmoe.quant.kernels import dequantize, quantize_matrix

    hidden, width, _ = expert_shape()
    shapes = {"gate_up": (2 * width, hidden), "down": (hidden, width)} if not c.tiny else {
        "tiny": (64, 128)}
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        wd = w.to(c.device)
        for fmt in (parse_format("int8"), parse_format("int4", 128 if not c.tiny else 32)):
            m = quantize_matrix(w, fmt)  # on the CPU, as a store is packed
            ref = dequantize(*m, fmt)
            qw, qs = m.qweight.to(c.device), m.qscale.to(c.device)
            for rows in (1, 8) if not c.dry else (1,):
                x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                rec = _kernel_row(c, x, wd, qw, qs, fmt, x.float() @ ref.t())
                out[f"{name}_{fmt.short}_m{rows}"] = {
                    k2: round(v, 4) if isinstance(v, float) else v for k2, v in rec.items()}
    return {"shapes": {k: list(v) for k, v in shapes.items()}, "results": out}


def _kernel_row(c: Check, x: torch.Tensor, wd: torch.Tensor, qw: torch.Tensor,
                qs: torch.Tensor, fmt: WeightFormat, want: torch.Tensor) -> dict[str, float]:
    """One shape, format and row count: the error against ``want`` and the times (us)."""
    torch = c.torch
    from stmoe.quant.cuda_kernels import dequantized_linear, device_weight, to_cuda_int4
    from stmoe.quant.kernels import qlinear

    xd = x.to(c.device)
    got = qlinear(xd, qw, qs, fmt).float().cpu()
    # int4 given as stored converts to the kernel's layout at every call: that key says so
    # (the kernel alone, as a cache's slots run it: kernel_converted_once_us)
    stored = "kernel_us" if fmt.name != "int4" else "kernel_with_per_call_conversion_us"
    rec: dict[str, float] = {
        "rel_err": float((got - want).abs().max() / want.abs().max()),
        stored: c.timed(lambda: qlinear(xd, qw, qs, fmt), 50) * 1e6,
        "bf16_linear_us": c.timed(lambda: torch.nn.functional.linear(xd, wd), 50) * 1e6}
    if fmt.name == "int8":
        def deq() -> torch.Tensor:
            w = (qw.float() * qs.float()[:, None]).to(xd.dtype)
            return torch.nn.functional.linear(xd, w)
    else:
        def deq() -> torch.Tensor:
            return dequantized_linear(xd, qw, qs, fmt)
    rec["dequantize_then_matmul_us"] = c.timed(deq, 20) * 1e6
    if fmt.name == "int4" and c.cuda:
        once = device_weight(qw, qs, fmt, c.device)
        rec["kernel_converted_once_us"] = c.timed(lambda: qlinear(xd, once, qs, fmt), 50) * 1e6
        rec["convert_us"] = c.timed(lambda: to_cuda_int4(qw), 20) * 1e6
    return rec


def cuda_tests(c: Check) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/runtime/test_cuda_identity.py", "tests/quant/test_cuda_kernels.py",
           "tests/runtime/test_gpu_tiers.py", "tests/runtime/test_gpu_quantized.py",
           "tests/runtime/test_host_lock.py", "tests/runtime/test_stream_order.py",
           "tests/serve/test_step_rows.py", "tests/serve/test_step_forward.py"]
    if c.dry:
        return {"command": cmd, "ran": False, "why": "dry run: CI runs these, and they skip"}
    if c.repo is None:
        raise RuntimeError("no checkout to run the cuda-marked tests in (run_stages' repo)")
    import importlib.util

    if importlib.util.find_spec("pytest") is None:  # not judged: not failed
        return {"command": cmd, "ran": False, "why": "pytest is not installed here (carry "
                "its wheels in .whl: benchmarks/gpu_check.sh's header)"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(c.repo / "src"), os.environ.get("PYTHONPATH", "")])}
    # at most a minute past the run's budget: the machine's own limit kills the whole command
    timeout = min(300.0, max(60.0, c.budget_s + 60.0 - c.elapsed()))
    try:
        run = subprocess.run(cmd, cwd=c.repo, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        tail = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-4000:]
        return {"command": cmd, "ran": True, "returncode": None,
                "summary": f"stopped after {timeout:.0f} s (the run's time budget)",
                "output_tail": tail}
    tail = (run.stdout + run.stderr)[-4000:]
    summary = next((line for line in reversed(tail.splitlines()) if " in " in line), "")
    rec = {"command": cmd, "ran": True, "returncode": run.returncode, "summary": summary,
           "output_tail": tail}
    if run.returncode and BUSY in run.stdout + run.stderr:  # not the code's failure: not judged
        rec.update(judged=False, why="the GPU refused the tests' process (an exclusive "
                   "compute mode: the check's own process holds it)")
    return rec


BUSY = "busy or unavailable"  # cudaErrorDevicesUnavailable's text


def tier_gpu(c: Check) -> dict[str, Any]:
    from stmoe.evaluate.systems import OFFLOAD_SYSTEMS
    from stmoe.hf.loading import load_causal_lm
    from stmoe.models import SHIPPED_MODEL
    from stmoe.runtime.api import offload

    tokens = c.tokens
    tok = __import__("transformers").AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    ids = tok("def fib(n):", return_tensors="pt").input_ids.to(c.device)
    want, rate, dtype = _resident(c, load_causal_lm(SHIPPED_MODEL).to(c.device), ids, tokens)
    rec: dict[str, Any] = {"tokens": tokens, "dtype": dtype, "resident_decode_tok_s": rate}
    tier = "gpu"
    configs: list[tuple[str, int | str]] = [
        ("on-demand", 4), ("lru-only", "50%"), ("stmoe", "50%"), ("stmoe-plus", "50%"),
        ("oracle", "50%"), ("stmoe-plus", "100%")]
    if c.dry:
        configs = configs[2:3]
    runs = []
    for system, capacity in configs:
        predictor, policy = OFFLOAD_SYSTEMS[system]
        try:
            with device_context(c), offload(SHIPPED_MODEL, tier=tier, capacity=capacity,
                                            predictor=predictor, policy=policy) as om:
                r = om.generate(ids[0].tolist(), max_new_tokens=tokens)
            runs.append({"system": system, "capacity": capacity,
                         "identical": r.tokens == want,
                         "decode_tok_s": round(r.decode_tokens_per_s, 2),
                         "hit_rate": round(r.hit_rate, 4), "stall_share": round(
                             r.stall_share, 4), "bytes_moved": r.bytes_moved})
        except Exception as exc:  # that run's, recorded
            runs.append({"system": system, "capacity": capacity, "identical": None,
                         "error": f"{type(exc).__name__}: {exc}"})
    rec.update(tier=tier, runs=runs)
    return rec


def _resident(c: Check, model: torch.nn.Module, ids: torch.Tensor,
              tokens: int) -> tuple[list[int], float, str]:
    """The GPU-resident model's greedy tokens, its decode tokens/s (``tokens`` minus one
    token's run: the prompt's time out) and dtype."""
    torch = c.torch
    from stmoe.runtime.prompts import greedy_generate

    def run(n: int) -> tuple[list[int], float]:
        if c.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = greedy_generate(model, ids, n, ignore_eos=True)
        if c.cuda:
            torch.cuda.synchronize()
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t

    want, t_all = run(tokens)
    _, t_one = run(1)
    rate = round((tokens - 1) / max(t_all - t_one, 1e-9), 2)
    return want, rate, str(next(model.parameters()).dtype)


# the most telling first (a run cut short by its budget keeps them)
STAGES: dict[str, Stage] = {"environment": environment, "h2d": h2d, "kernels": kernels,
                            "decode_table": decode_table,
                            "accelerate_offload": accelerate_offload,
                            "calibrate_simulator": calibrate_simulator,
                            "cuda_tests": cuda_tests, "tier_gpu": tier_gpu}
