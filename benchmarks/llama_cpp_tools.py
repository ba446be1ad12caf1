"""llama.cpp for the compute comparison: find the build, convert a checkpoint, quantize, bench.

The build comes from ``benchmarks/build_llama_cpp.sh`` (llama-cpp-python's source
distribution carries llama.cpp's tree). Converting uses that tree's own
``convert_hf_to_gguf.py``, run by this file as a subprocess:

    python benchmarks/llama_cpp_tools.py convert CHECKPOINT OUT.gguf [--outtype bf16]

with one accommodation: the converter identifies a BPE tokenizer's pre-tokenizer by the hash
of its tokens on a test string, and a tokenizer it has no hash for (``stmoe make-model``'s,
trained for stmoe's own model) is refused. The converter's documented remedy
(``convert_hf_to_gguf_update.py``) downloads the reference tokenizers from the hub, which
this machine cannot reach; so where the hash is unknown and ``tokenizer.json`` declares
exactly GPT-2's pre-tokenizer (ByteLevel, its regex, no prefix space) it is converted as
"gpt-2", with a note. Any other unknown tokenizer is refused as before.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

VERSION = "0.3.36"  # llama-cpp-python's, as build_llama_cpp.sh builds it
GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": True}


def llama_dir() -> Path:
    """Where build_llama_cpp.sh put llama.cpp (same rule as the script)."""
    if "STMOE_LLAMA_DIR" in os.environ:
        return Path(os.environ["STMOE_LLAMA_DIR"])
    cache = Path(os.environ.get("STMOE_CACHE", Path.home() / ".cache" / "stmoe"))
    return cache / f"llama.cpp-{VERSION}"


def binary(name: str) -> Path:
    path = llama_dir() / "build" / "bin" / name
    if not path.is_file():
        raise SystemExit(f"error: {path} missing; build llama.cpp first: "
                         "bash benchmarks/build_llama_cpp.sh")
    return path


def convert(checkpoint: Path, out: Path, outtype: str = "bf16") -> Path:
    """``checkpoint`` (a transformers folder) as a GGUF file through llama.cpp's converter."""
    if not out.exists():
        subprocess.run([sys.executable, __file__, "convert", str(checkpoint), str(out),
                        "--outtype", outtype], check=True)
    return out


def quantize(source: Path, out: Path, kind: str) -> Path:
    """``source`` GGUF requantized by llama-quantize (Q8_0, Q4_K_M, ...)."""
    if not out.exists():
        done = subprocess.run([str(binary("llama-quantize")), str(source), str(out), kind],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"error: llama-quantize {kind} failed:\n{done.stderr[-2000:]}")
    return out


def bench(gguf: Path, threads: int, gen: int = 64, prompt: int = 0, load_mode: str = "auto",
          cpus: str | None = None) -> dict[str, Any]:
    """One llama-bench run: decode (``gen`` tokens) or prefill (``prompt`` tokens) tok/s;
    ``load_mode``: llama-bench's ``--load-mode`` (auto, mmap, none, ...)."""
    cmd = [str(binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-r", "1",
           "-p", str(prompt), "-n", str(gen), "--load-mode", load_mode, "-o", "json"]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = json.loads(done.stdout)
    return {"tokens_per_s": float(rows[0]["avg_ts"]), "row": rows[0]}


def gguf_bytes_per_weight(gguf: Path) -> tuple[float, float, str]:
    """(the whole file's bytes per weight, the routed experts' tensors' bytes per weight,
    their types): what a GGUF really stores (Q4_K_M falls back to q5_0 / q8_0 for rows
    whose length is not a multiple of 256, e.g. Qwen1.5's 1408-wide ffn_down_exps)."""
    sys.path.insert(0, str(llama_dir() / "src" / "vendor" / "llama.cpp" / "gguf-py"))
    from gguf import GGUFReader  # type: ignore[import-not-found]

    reader = GGUFReader(str(gguf))
    weights = sum(int(t.n_elements) for t in reader.tensors)
    experts = [t for t in reader.tensors if "_exps" in t.name]
    kinds = sorted({t.tensor_type.name.lower() for t in experts})
    expert_bpw = sum(int(t.n_bytes) for t in experts) / sum(int(t.n_elements) for t in experts)
    return gguf.stat().st_size / weights, expert_bpw, ", ".join(kinds)


def _convert_main(argv: list[str]) -> None:
    tree = llama_dir() / "src" / "vendor" / "llama.cpp"
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import conversion.base as base  # type: ignore[import-not-found]

    original = base.TextModel.get_vocab_base_pre

    def vocab_pre(self: Any, tokenizer: Any) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            spec = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())
            if spec.get("pre_tokenizer") != GPT2_PRE:
                raise
            print("note: the tokenizer's hash is unknown to the converter; its pre-tokenizer "
                  "is GPT-2's (ByteLevel, GPT-2's regex), converted as 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_pre
    checkpoint, out, *rest = argv
    sys.argv = ["convert_hf_to_gguf.py", checkpoint, "--outfile", out, *rest]
    runpy.run_path(str(tree / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "convert":
        raise SystemExit(__doc__)
    _convert_main(sys.argv[2:])
