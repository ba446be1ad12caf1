"""Train stmoe's own small MoE language model on CPU (`stmoe train-tiny`).

A standard transformers Qwen2-MoE checkpoint (config.json + safetensors + a
byte-level BPE tokenizer that ``AutoTokenizer`` loads), trained on real text of
three domains that install from the package registries:

- code: the Python standard library's own sources (PSF licence), as installed;
- prose: the English reference documentation Python ships in
  ``pydoc_data.topics`` (PSF licence);
- math: the CHAMP competition problems and solutions of the ``champ-dataset``
  PyPI package (MIT licence).

Nothing is downloaded at run time; ``pip install champ-dataset`` is the only
extra need (the ``train`` extra).
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from stmoe.errors import StmoeError

DOMAINS = ("code", "prose", "math")


@dataclass(frozen=True)
class TrainSpec:
    """Model shape and training budget (defaults: the shipped checkpoint's recipe)."""

    vocab_size: int = 4096
    hidden_size: int = 192
    layers: int = 8  # all MoE
    heads: int = 6
    kv_heads: int = 2
    experts: int = 16
    top_k: int = 4
    expert_intermediate: int = 96
    shared_intermediate: int = 96
    aux_loss_coef: float = 0.02  # load-balancing loss weight (Switch-style, transformers')
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    minutes: float = 40.0  # wall-clock training budget
    seed: int = 0
    corpus_chars_per_domain: int = 3_000_000


def corpus(chars: int) -> dict[str, str]:
    """Text per domain, deterministic: sorted files, truncated to ``chars``."""
    try:
        import champ_dataset
    except ImportError:
        raise StmoeError("the math domain needs the champ-dataset package: "
                         "pip install -e '.[train]'") from None
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code_parts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        code_parts.append(text)
        size += len(text)
        if size >= chars:
            break
    prose = "\n\n".join(topics[k] for k in sorted(topics))
    champ = json.loads(
        (Path(champ_dataset.__file__).parent / "dataset_files" / "v0.json").read_text()
    )
    math_parts = []  # human-written problems, solutions, hints and concepts (no model outputs)
    for key in sorted(champ["problems"]):
        p = champ["problems"][key]
        steps = " ".join(s["_text"] for s in p["solution"]["steps"])
        math_parts.append(f"Problem: {p['_text']}\nSolution: {steps}\nAnswer: {p['_answer']}")
    for table in ("hints", "concepts"):
        math_parts += [f"Fact: {champ[table][k]['_text']}" for k in sorted(champ[table])]
    return {"code": "\n".join(code_parts)[:chars], "prose": prose[:chars],
            "math": "\n\n".join(math_parts)[:chars]}


def train_tokenizer(texts: dict[str, str], vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|pad|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(texts.values()), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                   eos_token="<|endoftext|>")


def build_model(spec: TrainSpec, vocab: int, pad: int, eos: int):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=4 * spec.hidden_size,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, num_experts=spec.experts,
        num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.expert_intermediate,
        shared_expert_intermediate_size=spec.shared_intermediate, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=1024, tie_word_embeddings=True,
        router_aux_loss_coef=spec.aux_loss_coef, output_router_logits=True, norm_topk_prob=True,
        pad_token_id=pad, eos_token_id=eos, bos_token_id=eos,
    )
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config)


def train(out_dir: str | Path, spec: TrainSpec = TrainSpec(), log=print) -> dict:  # type: ignore[no-untyped-def]
    """Build the corpus and tokenizer, train for ``spec.minutes``, save, and report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    random.seed(spec.seed)
    texts = corpus(spec.corpus_chars_per_domain)
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    ids = {d: torch.tensor(tokenizer(t)["input_ids"]) for d, t in texts.items()}
    split = {d: int(len(x) * 0.95) for d, x in ids.items()}
    model = build_model(spec, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.05, betas=(0.9, 0.95))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"corpus tokens: { {d: len(x) for d, x in ids.items()} }, parameters: {n_params:,}")
    start, step, tokens_seen = time.time(), 0, 0
    budget = spec.minutes * 60
    model.train()
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        lr = (
            spec.lr
            * min(1.0, (step + 1) / 100)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        batch = _batch(ids, split, spec, train=True)
        outputs = model(input_ids=batch, labels=batch)
        opt.zero_grad(set_to_none=True)
        outputs.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += batch.numel()
        if step % 25 == 0:
            log(f"step {step} loss {outputs.loss.item():.3f} lr {lr:.2e} "
                f"{(time.time() - start) / 60:.1f} min")
    model.eval()
    val = {d: _val_loss(model, ids[d][split[d] :], spec) for d in DOMAINS}
    model.config.output_router_logits = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = {
        "spec": asdict(spec),
        "parameters": n_params,
        "steps": step,
        "tokens_seen": tokens_seen,
        "minutes": (time.time() - start) / 60,
        "validation_loss": val,
        "corpus_tokens": {d: len(x) for d, x in ids.items()},
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _batch(ids: dict[str, torch.Tensor], split: dict[str, int], spec: TrainSpec,
           train: bool) -> torch.Tensor:
    rows = []
    for i in range(spec.batch_size):
        d = DOMAINS[i % len(DOMAINS)]  # domains balanced in every batch
        lo, hi = (0, split[d]) if train else (split[d], len(ids[d]))
        a = random.randint(lo, hi - spec.seq_len - 1)
        rows.append(ids[d][a : a + spec.seq_len])
    return torch.stack(rows)


@torch.no_grad()
def _val_loss(model, tokens: torch.Tensor, spec: TrainSpec, windows: int = 32) -> float:  # type: ignore
    losses = []
    step = max(1, (len(tokens) - spec.seq_len - 1) // windows)
    for a in range(0, len(tokens) - spec.seq_len - 1, step)[:windows]:
        x = tokens[a : a + spec.seq_len][None]
        out = model(input_ids=x, labels=x)
        losses.append(
            out.loss.item() - float(getattr(out, "aux_loss", 0) or 0) * spec.aux_loss_coef
        )
    return float(sum(losses) / max(len(losses), 1))
