"""`stmoe capture`: record routing traces from a local transformers MoE checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from stmoe.cli.common import (
    check_inputs,
    check_range,
    clean_label,
    npz_output,
    out,
    path_option,
)
from stmoe.errors import StmoeError


def capture_cmd(
    output: Annotated[Path, path_option("--output", "-o", help="Native .npz trace to write.")],
    model: Annotated[
        Path | None,
        path_option(
            help="Local transformers MoE checkpoint folder (never downloaded). "
            "Default: stmoe's own shipped model."
        ),
    ] = None,
    prompts: Annotated[
        Path | None,
        path_option(
            help="Plain text (one prompt per line) or JSON Lines with 'prompt' and "
            "optional 'domain'. Default: built-in code, prose and math prompts."
        ),
    ] = None,
    domain: Annotated[
        str | None, typer.Option(help="Domain label for prompts that carry none.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt (>= 1).")] = 32,
    batch_size: Annotated[int, typer.Option(help="Prompts per generate() call (>= 1).")] = 1,
) -> None:
    """Generate greedily and record which experts the router chose for every token.

    Records every MoE layer of every prompt and generated token (router rank order,
    gate weights, prefill/decode marked, domains kept); padding is never recorded
    and a sequence that emits EOS stops there. Works for every transformers family
    whose experts use transformers' experts interface (Mixtral, Qwen2/3-MoE,
    DeepSeek-V2/V3, OLMoE, GPT-OSS, GraniteMoE, PhiMoE, ...).
    """
    check_range("--max-new-tokens", max_new_tokens, 1)
    check_range("--batch-size", batch_size, 1)
    check_inputs("a prompts file (text or JSON Lines)", prompts)
    npz_output(output)
    try:
        from stmoe.hf.capture_generate import DEFAULT_PROMPTS, capture_prompts, read_prompts
    except ImportError as exc:
        raise StmoeError(f"capture needs torch and transformers ({exc}); install them with "
                         "pip install -e '.[hf]'") from None
    from stmoe.trace import save_trace
    from stmoe.trace.schema import UNLABELLED

    chosen = read_prompts(prompts) if prompts is not None else list(DEFAULT_PROMPTS)
    if domain is not None:
        chosen = [dataclasses.replace(p, domain=domain) if p.domain == UNLABELLED else p
                  for p in chosen]
    if model is None:
        from stmoe.models import SHIPPED_MODEL

        model = SHIPPED_MODEL
    trace = capture_prompts(model, chosen, max_new_tokens=max_new_tokens, batch_size=batch_size)
    save_trace(trace, output)
    out.print(f"wrote {clean_label(output)}: {clean_label(repr(trace))}")
