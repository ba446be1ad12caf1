"""Overhead of routing capture on generation (target: at most +10%).

A tiny random-weight Qwen3-MoE (SYNTHETIC weights: the routing means nothing,
the cost is what is measured) generates greedily on CPU, alternately with and
without a RoutingRecorder; the recorder run includes building the trace. Prints
the median of each and their ratio.

    python benchmarks/bench_capture.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from stmoe.hf.capture import RoutingRecorder


def tiny_qwen3_moe() -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=32, num_experts_per_tok=4, max_position_embeddings=512,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier timings on a 2-core machine
    model = tiny_qwen3_moe()
    ids = torch.randint(3, 512, (4, 32))

    def generate() -> None:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                       pad_token_id=0)

    def plain() -> float:
        start = time.perf_counter()
        generate()
        return time.perf_counter() - start

    def recorded() -> float:
        start = time.perf_counter()
        with RoutingRecorder(model) as rec:
            generate()
        rec.trace()
        return time.perf_counter() - start

    with torch.no_grad():
        plain(), recorded()  # warm up
        base, capture = [], []
        for _ in range(args.repeats):
            base.append(plain())
            capture.append(recorded())
    b, c = statistics.median(base), statistics.median(capture)
    verdict = "PASS" if c / b <= 1.10 else "FAIL"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; tiny Qwen3-MoE "
          f"(8 MoE layers, 32 experts, top-4; random weights), batch 4, 32-token prompts, "
          f"{args.new_tokens} new tokens, 1 thread, median of {args.repeats}")
    print(
        f"generate {b * 1000:.1f} ms, with capture {c * 1000:.1f} ms: "
        f"ratio {c / b:.3f} (target <= 1.10, {verdict})"
    )


if __name__ == "__main__":
    main()
