"""Engine dump files in: SGLang's recorder (torch.save), transformers' router logits,
MoE-Infinity's expert-drop trace; and counts-only files refused by name."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from stmoe import TraceError, load_trace
from stmoe.trace import import_files, sniff_format
from stmoe.trace.engines import EngineOptions

PROMPTS, GENS = (5, 3, 7), (4, 1, 6)  # generated tokens; the last never runs
L_MODEL, N_LOGICAL, N_PHYSICAL, K = 4, 6, 8, 2


def recorder_dump(rank: int = 0, with_map: bool = True) -> tuple[dict, list, np.ndarray]:
    """python/sglang/srt/eplb/expert_distribution.py (sgl-project/sglang),
    _DetailSinglePassGatherer.collect and _DetailAccumulator.dump: records of one
    forward pass each (input_ids, positions, extend_seq_lens None in decode,
    forward_mode 1 extend / 2 decode / 4 idle, topk_ids_of_layer int32 [L, tokens, 8]
    reset to -1, physical ids) and last_physical_to_logical_map [L, physical]."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(rank)
    phys_to_log = np.array([[e % N_LOGICAL for e in range(N_PHYSICAL)]] * L_MODEL)
    truth = [[] for _ in PROMPTS]  # logical routing per request token: [L, K] each
    records = []

    def routed(n):
        ids = np.full((L_MODEL, n, 8), -1, dtype=np.int32)
        logical = np.full((n, L_MODEL, K), -1, dtype=np.int32)
        for t in range(n):
            for layer in range(1, L_MODEL):  # layer 0 is dense: never routed
                chosen = rng.permutation(N_LOGICAL)[:K]
                phys = chosen + N_LOGICAL * (chosen < N_PHYSICAL - N_LOGICAL) * rng.integers(2)
                ids[layer, t, :K] = phys
                logical[t, layer] = chosen
        return ids, logical

    def add(mode, ids, pos, lens, which):
        topk, logical = routed(len(ids))
        for j, r in enumerate(which):
            truth[r].append(logical[j])
        records.append(
            {
                "forward_pass_id": len(records),
                "rank": rank,
                "gatherer_key": "primary",
                "input_ids": ids,
                "positions": pos,
                "extend_seq_lens": lens,
                "forward_mode": mode,
                "topk_ids_of_layer": torch.from_numpy(topk),
                "misc_objects": [],
                "global_physical_count": torch.zeros(L_MODEL, 8),
            }
        )

    # requests 0 and 1 prefill together, 0 decodes; request 2 joins later
    add(1, [7] * 8, [*range(5), *range(3)], [5, 3], [0] * 5 + [1] * 3)
    add(2, [8], [5], None, [0])  # request 1 generated one token: it never runs
    add(4, [], [], None, [])  # idle pass
    add(1, [9] * 7, list(range(7)), [7], [2] * 7)
    for step in range(1, 5):
        rows = [(0, 5 + step)] if step < GENS[0] - 1 else []
        rows += [(2, 7 + step - 1)]
        add(2, [8] * len(rows), [p for _, p in rows], None, [r for r, _ in rows])
    add(2, [8], [7 + 4], None, [2])
    dump = {"records": records}
    if with_map:
        dump["last_physical_to_logical_map"] = torch.from_numpy(phys_to_log)
    return dump, [np.stack(t) for t in truth], phys_to_log


# the note is asserted in test_engines.py (its CLI output)
@pytest.mark.filterwarnings('ignore:dropped dense layer 0:stmoe.errors.StmoeNote')
def test_sglang_per_token_recorder(tmp_path, cli):
    torch = pytest.importorskip("torch")
    dump, truth, _ = recorder_dump()
    path = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    torch.save(dump, path)
    assert sniff_format(path) == "torch"
    trace = load_trace(path)
    lengths = [len(t) for t in truth]
    assert lengths == [p + g - 1 for p, g in zip(PROMPTS, GENS, strict=True)]
    assert trace.seq_starts.tolist() == [0, lengths[0], lengths[0] + lengths[1]]
    assert np.array_equal(trace.experts, np.concatenate(truth)[:, 1:])  # logical ids
    assert trace.meta.extra["model_layer_ids"] == [1, 2, 3]
    decode = [int(trace.is_decode[sl].sum()) for _, sl in trace.sequences()]
    assert decode == [g - 1 for g in GENS]
    assert trace.token_ids[:5].tolist() == [7] * 5
    # two ranks of a tensor-parallel run hold the same passes: read once
    torch.save(dump, tmp_path / "expert_distribution_recorder_1.0_1.pt")
    both = import_files([path, tmp_path / "expert_distribution_recorder_1.0_1.pt"])
    assert both.num_tokens == trace.num_tokens
    torch.save(recorder_dump(with_map=False)[0], tmp_path / "nomap.pt")
    result = cli("import", tmp_path / "nomap.pt", "-o", tmp_path / "o.npz")
    assert result.exit_code == 1 and "last_physical_to_logical_map" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_counts_files_are_refused_by_name(tmp_path, cli):
    """SGLang stat mode (_StatAccumulator.dump in python/sglang/srt/eplb/
    expert_distribution.py: rank, logical_count [buffer, L, E]); MoE-Infinity's expert
    activation matrix [capacity, L, E] float counts."""
    torch = pytest.importorskip("torch")
    torch.save(
        {
            "rank": 0,
            "logical_count": torch.zeros(4, 3, 64, dtype=torch.int32),
            "average_utilization_rate_over_window": None,
        },
        tmp_path / "stat.pt",
    )
    np.save(tmp_path / "eam.npy", np.random.default_rng(0).poisson(1, (16, 3, 64)) * 1.0)
    for name in ("stat.pt", "eam.npy"):
        result = cli("import", tmp_path / name, "-o", tmp_path / "o.npz")
        assert result.exit_code == 1
        assert "expert-count summary, not per-token routing" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


def test_transformers_router_logits(tmp_path):
    """transformers MoE models (e.g. src/transformers/models/mixtral/modeling_mixtral.py)
    with output_router_logits=True return one [batch * seq, E] logits tensor per MoE
    layer, batch-major, padding rows included; top-k of the softmax is the routing."""
    torch = pytest.importorskip("torch")
    logits = tuple(torch.randn(2 * 6, 8, generator=torch.Generator().manual_seed(i))
                   for i in range(3))
    torch.save(logits, tmp_path / "router_logits.pt")
    with pytest.raises(TraceError, match="--top-k"):
        load_trace(tmp_path / "router_logits.pt")
    trace = load_trace(tmp_path / "router_logits.pt",
                       engine=EngineOptions(top_k=2, prompt_lengths=(6, 4)))
    assert trace.seq_starts.tolist() == [0, 6] and trace.num_tokens == 10
    want = torch.topk(logits[1][6:10], 2).indices.numpy()
    assert np.array_equal(trace.experts[6:, 1], want) and trace.num_experts == 8


def test_router_logits_batch_by_seq_and_rows_without_a_softmax(tmp_path):
    """[batch, seq, E] logits (a model that keeps the batch axis) import as the batch's
    sequences; a row of NaN, +inf or all -inf logits (no softmax) is refused naming the
    layer and row, where before it read as a NaN gate weight, or 3-D tensors as an
    unknown file."""
    torch = pytest.importorskip("torch")
    flat = [torch.randn(2 * 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    torch.save(tuple(x.reshape(2, 6, 8) for x in flat), tmp_path / "three_d.pt")
    trace = load_trace(tmp_path / "three_d.pt", engine=EngineOptions(top_k=2))
    assert trace.seq_starts.tolist() == [0, 6] and trace.num_tokens == 12
    torch.save(tuple(flat), tmp_path / "flat.pt")
    same = load_trace(tmp_path / "flat.pt", engine=EngineOptions(top_k=2, prompt_lengths=(6, 6)))
    assert np.array_equal(trace.experts, same.experts)
    for value, said in ((float("nan"), "nan among them"), (float("inf"), "inf among them"),
                        (float("-inf"), "all -inf")):
        bad = [x.clone() for x in flat]
        if value == float("-inf"):
            bad[2][5, :] = value
        else:
            bad[2][5, 3] = value
        torch.save(tuple(bad), tmp_path / "bad.pt")
        with pytest.raises(TraceError, match=f"MoE layer 2, row 5 are {said}"):
            load_trace(tmp_path / "bad.pt", engine=EngineOptions(top_k=2))
    mixed = [x.clone() for x in flat]
    mixed[1][4, 0], mixed[1][4, 2] = float("-inf"), float("nan")  # the NaN is named, not -inf
    torch.save(tuple(mixed), tmp_path / "mixed.pt")
    with pytest.raises(TraceError, match="MoE layer 1, row 4 are nan among them"):
        load_trace(tmp_path / "mixed.pt", engine=EngineOptions(top_k=2))
    padded = [x.clone() for x in flat]
    padded[0][5, :] = float("-inf")  # row 5 is padding past sequence 0's 4 tokens: dropped
    torch.save(tuple(padded), tmp_path / "padded.pt")
    kept = load_trace(tmp_path / "padded.pt", engine=EngineOptions(top_k=2, prompt_lengths=(4, 6)))
    assert kept.num_tokens == 10
    with pytest.raises(TraceError, match="3 --prompt-lengths for router logits of 2 sequences"):
        load_trace(tmp_path / "three_d.pt", engine=EngineOptions(top_k=2, prompt_lengths=(2, 2, 2)))
    masked = [x.clone() for x in flat]
    masked[0][3, :6] = float("-inf")  # masked experts: the two left are the top-2
    torch.save(tuple(masked), tmp_path / "masked.pt")
    got = load_trace(tmp_path / "masked.pt", engine=EngineOptions(top_k=2))
    assert sorted(got.experts[3, 0].tolist()) == [6, 7]


def expert_drop_records():
    """benchmarks/expert_drop/trace_parser.py (EfficientMoE/MoE-Infinity): records of
    (seq, layer, rows, residency_known, weights [rows, E], mask [rows, E], resident [E]);
    layers 1 and 3 are MoE; a prompt pass has several rows, decode passes one."""
    rng = np.random.default_rng(3)
    ne, recs = 8, []
    for seq, rows in enumerate([4, 1, 1, 3, 1]):
        for layer in (1, 3):
            w = rng.random((rows, ne)).astype(np.float32)
            m = np.zeros((rows, ne), np.uint8)
            m[np.arange(rows)[:, None], np.argsort(-w, axis=1)[:, :2]] = 1
            recs.append((seq, layer, rows, w, m))
    return ne, recs


def moedropt(ne: int, records) -> bytes:
    """ExpertDispatcher::DumpExpertDropTrace's binary of ``records`` (seq, layer, rows,
    weights, mask) over 4 model layers, every residency known."""
    out = bytearray(b"MOEDROPT" + struct.pack("<iiiiq", 1, ne, 4, 0, len(records)))
    out += np.zeros(4 * ne, "<i8").tobytes()
    for seq, layer, rows, w, m in records:
        out += struct.pack("<qiiB", seq, layer, rows, 1) + w.tobytes() + m.tobytes()
        out += np.ones(ne, np.uint8).tobytes()
    return bytes(out)


def drop_npz_arrays(records) -> dict[str, np.ndarray]:
    """The parser's npz members of ``records``: the decode (one-row) records only."""
    dec = [r for r in records if r[2] == 1]
    return dict(weights=np.concatenate([r[3] for r in dec]),
                mask=np.concatenate([r[4] for r in dec]),
                layer=np.array([r[1] for r in dec], np.int32),
                seq=np.array([r[0] for r in dec], np.int64))


def test_moe_infinity_expert_drop_binary_and_npz(tmp_path, cli):
    ne, recs = expert_drop_records()
    out = moedropt(ne, recs)
    (tmp_path / "drop.bin").write_bytes(out)
    assert sniff_format(tmp_path / "drop.bin") == "expert-drop"
    trace = load_trace(tmp_path / "drop.bin")
    assert trace.seq_starts.tolist() == [0, 6] and trace.num_tokens == 10
    assert trace.is_decode.tolist() == [False] * 4 + [True] * 2 + [False] * 3 + [True]
    assert trace.meta.extra["model_layer_ids"] == [1, 3]
    seq0 = recs[0]
    assert trace.experts[0, 0].tolist() == np.argsort(-seq0[3][0])[:2].tolist()
    (tmp_path / "cut.bin").write_bytes(bytes(out[:-30]))
    result = cli("import", tmp_path / "cut.bin", "-o", tmp_path / "o.npz")
    assert result.exit_code == 1 and "truncated" in result.output
    arrays = drop_npz_arrays(recs)  # the parser's npz keeps decode rows only
    np.savez_compressed(tmp_path / "drop.npz", **arrays,
                        resident=np.ones((len(arrays["seq"]), ne), np.uint8),
                        byte_size=np.zeros((4, ne), np.int64), num_experts=np.int64(ne),
                        num_layers=np.int64(4))
    assert sniff_format(tmp_path / "drop.npz") == "expert-drop"
    npz = load_trace(tmp_path / "drop.npz")
    assert npz.num_tokens == 3 and npz.num_layers == 2
    assert np.array_equal(npz.experts, trace.experts[trace.is_decode])


def test_moe_infinity_passes_follow_its_own_step_grouping(tmp_path):
    """cost_model.group_steps: records in seq order, a new step where the layer does not
    increase; a seq that counts records (not passes) imports to the same trace."""
    ne, recs = expert_drop_records()

    def write(records, name):
        (tmp_path / name).write_bytes(moedropt(ne, records))
        return load_trace(tmp_path / name)

    per_pass = write(recs, "a.bin")
    per_record = write([(i * 10, *r[1:]) for i, r in enumerate(recs)], "b.bin")
    shuffled = write([(i * 10, *r[1:]) for i, r in enumerate(recs)][::-1], "c.bin")
    for t in (per_record, shuffled):
        assert np.array_equal(t.experts, per_pass.experts)
        assert t.seq_starts.tolist() == per_pass.seq_starts.tolist()

