"""ModelRunner's input building for a hand-built step: decodes (grouped by length), a first prefill chunk and a
prefix-cache hit. Expected ids, positions, slots, block tables, masks and logits indices are written out by hand
(block_size 4: slot = block_table[pos // 4] * 4 + pos % 4). A fake model records what execute_model feeds it;
a tiny random LlamaModel checks that the built metadata drives paged attention to the same hidden states as a
plain prefill of each sequence alone."""

from __future__ import annotations

import random
from types import SimpleNamespace

from leanserve.config import ModelConfig
from leanserve.core.request import Request
from leanserve.core.scheduler import ScheduledRequest, SchedulerOutput
from leanserve.model.attention import AttentionMetadata, PrefillChunk
from leanserve.model.llama import LlamaModel
from leanserve.sampling_params import SamplingParams
from leanserve.worker.model_runner import ModelRunner, allocate_kv_cache, decode_groups
from leanserve.worker.sampler import Sampler

import pytest
import torch

BS = 4  # tokens per block in every test here
VOCAB = 300


# ---------------------------------------------------------------------------------------------- decode_groups
def test_decode_groups_empty():
    assert decode_groups([], 16) == []


def test_decode_groups_split_by_blocks_of_the_first_member():
    # blocks: 1 1 2 2 | 3 3 4 | 13 ; a group admits up to first_blocks * 1.25 + 1 blocks (2.25, then 4.75)
    lens = [1, 16, 17, 32, 33, 48, 64, 200]
    assert decode_groups(lens, 16) == [[0, 1, 2, 3], [4, 5, 6], [7]]


def test_decode_groups_compare_with_the_first_member_not_the_previous():
    # block_size 1: blocks = lens. 4 admits up to 6; 7 starts a group admitting up to 9.75
    assert decode_groups([4, 5, 6, 7, 8, 9], 1) == [[0, 1, 2], [3, 4, 5]]


def test_decode_groups_slack():
    assert decode_groups([2, 3, 4], 1, slack=1.0) == [[0, 1], [2]]  # limit 2 * 1.0 + 1 = 3
    assert decode_groups([2, 3, 4], 1, slack=1.5) == [[0, 1, 2]]  # limit 4
    assert decode_groups([10, 10, 10], 1, slack=0.0) == [[0], [1], [2]]  # limit 1 < 10: each alone


# ------------------------------------------------------------------------------------------ the hand-built step
def make_request(rid: str, prompt: list[int], output: list[int], num_computed: int, **params) -> Request:
    params = {"temperature": 0.0} | params  # greedy unless a test asks otherwise
    req = Request(rid, prompt, SamplingParams(max_tokens=16, **params), 16)
    req.output_token_ids = list(output)
    req.num_computed_tokens = num_computed
    return req


def mixed_step(**params_by_rid) -> dict[str, ScheduledRequest]:
    """Five requests over a 16-block pool (block ids disjoint except where noted):

    short  decode  prompt 11..16, output 17 18   computed 7  -> pos 7,  table [7, 2]         (2 blocks)
    mid    decode  prompt 21..29, output 30      computed 9  -> pos 9,  table [5, 0, 9]      (3 blocks)
    long   decode  prompt 31..43, output 44      computed 13 -> pos 13, table [12, 4, 14, 6] (4 blocks)
    chunk  first 8-token chunk of a 20-token prompt 100..119 -> pos 0..7, table [3, 8]     (does not sample)
    hit    prompt 200..210, first 8 tokens from the prefix cache -> pos 8..10, table [1, 11, 13]
    """
    p = params_by_rid
    reqs = [
        (make_request("short", list(range(11, 17)), [17, 18], 7, **p.get("short", {})), 1, [7, 2]),
        (make_request("mid", list(range(21, 30)), [30], 9, **p.get("mid", {})), 1, [5, 0, 9]),
        (make_request("long", list(range(31, 44)), [44], 13, **p.get("long", {})), 1, [12, 4, 14, 6]),
        (make_request("chunk", list(range(100, 120)), [], 0, **p.get("chunk", {})), 8, [3, 8]),
        (make_request("hit", list(range(200, 211)), [], 8, **p.get("hit", {})), 3, [1, 11, 13]),
    ]
    reqs[4][0].num_cached_tokens = 8
    return {r.request_id: ScheduledRequest(r, n, table) for r, n, table in reqs}


SORTED = ["short", "mid", "long", "chunk", "hit"]  # decodes by context length, then prefill chunks
EXPECTED_IDS = [18, 30, 44, *range(100, 108), 208, 209, 210]
EXPECTED_POS = [7, 9, 13, *range(8), 8, 9, 10]
# short: 2*4+3; mid: table[2]=9 -> 9*4+1; long: table[3]=6 -> 6*4+1; chunk: blocks 3, 8; hit: table[2]=13 -> 52..54
EXPECTED_SLOTS = [11, 37, 25, 12, 13, 14, 15, 32, 33, 34, 35, 52, 53, 54]
EXPECTED_LOGITS_IDX = [0, 1, 2, 13]  # the last token of each request that samples (chunk does not)


def fake_model(batch_invariant: bool = False, record: list | None = None):
    """The attributes ModelRunner reads, and a forward that returns [input_id, position] as the hidden state."""

    def forward(input_ids, positions, kv_caches, meta):
        if record is not None:
            record.append(("forward", input_ids.clone(), positions.clone(), meta))
        return torch.stack([input_ids, positions], dim=1).float()  # [T, 2]

    def compute_logits(hidden):
        if record is not None:
            record.append(("logits", hidden.clone()))
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].long() + 1] = 50.0  # next token: input id + 1
        return logits

    return SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, batch_invariant=batch_invariant,
                           forward=forward, compute_logits=compute_logits)


def make_runner(model=None, **kw) -> ModelRunner:
    return ModelRunner(model or fake_model(), [], BS, Sampler(frozenset()), **kw)


def slot(table: list[int], pos: int) -> int:
    return table[pos // BS] * BS + pos % BS


def test_expected_slots_follow_the_formula():
    """The hand-written slots agree with block_table[pos // block_size] * block_size + pos % block_size."""
    step = mixed_step()
    by_formula = []
    for rid in SORTED:
        s = step[rid]
        start = s.request.num_computed_tokens
        by_formula += [slot(s.block_ids, p) for p in range(start, start + s.num_new_tokens)]
    assert by_formula == EXPECTED_SLOTS


def test_build_inputs_flattens_ids_positions_slots_and_logits_indices():
    step = mixed_step()
    input_ids, positions, meta, logits_idx = make_runner().build_inputs([step[r] for r in SORTED])
    assert input_ids.dtype == positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert input_ids.tolist() == EXPECTED_IDS
    assert positions.tolist() == EXPECTED_POS
    assert meta.slot_mapping.tolist() == EXPECTED_SLOTS
    assert logits_idx == EXPECTED_LOGITS_IDX
    assert meta.num_decode_tokens == 3
    assert meta.decode_kernel is None


def test_build_inputs_decode_groups_pad_tables_and_mask_by_length():
    step = mixed_step()
    _, _, meta, _ = make_runner().build_inputs([step[r] for r in SORTED])
    # seq lens 8, 10, 14 -> blocks 2, 3, 4: short and mid share a group (3 <= 2 * 1.25 + 1), long is alone
    g0, g1 = meta.decode_groups
    assert (g0.start, g0.count) == (0, 2) and (g1.start, g1.count) == (2, 1)
    assert g0.block_table.tolist() == [[7, 2, 0], [5, 0, 9]]  # short padded with block 0
    assert g1.block_table.tolist() == [[12, 4, 14, 6]]
    assert g0.seq_lens.tolist() == [8, 10] and g1.seq_lens.tolist() == [14]  # the new token included
    assert g0.mask.shape == (2, 1, 1, 12) and g1.mask.shape == (1, 1, 1, 16)
    assert g0.mask.dtype == torch.bool
    assert g0.mask[0, 0, 0].tolist() == [True] * 8 + [False] * 4
    assert g0.mask[1, 0, 0].tolist() == [True] * 10 + [False] * 2
    assert g1.mask[0, 0, 0].tolist() == [True] * 14 + [False] * 2


def test_build_inputs_prefill_chunks_first_chunk_and_prefix_hit():
    step = mixed_step()
    _, _, meta, _ = make_runner().build_inputs([step[r] for r in SORTED])
    chunk, hit = meta.prefills
    assert (chunk.query_start, chunk.query_len, chunk.context_len) == (3, 8, 0)
    assert chunk.block_ids.tolist() == [3, 8] and chunk.block_ids.dtype == torch.int64
    assert chunk.mask is None  # no context: plain causal attention
    assert (hit.query_start, hit.query_len, hit.context_len) == (11, 3, 8)
    assert hit.block_ids.tolist() == [1, 11, 13]
    # queries padded to 32 rows; keys = 8 cached + 3 new; row r (position 8 + r) sees keys 0 .. 8 + r
    assert hit.mask.shape == (32, 11) and hit.mask.dtype == torch.bool
    assert hit.mask[0].tolist() == [True] * 9 + [False] * 2
    assert hit.mask[1].tolist() == [True] * 10 + [False]
    assert hit.mask[2].tolist() == [True] * 11
    assert bool(hit.mask[3:].all())  # padding rows attend to every key


def test_a_chunk_after_an_earlier_chunk_has_context_and_an_offset_mask():
    req = make_request("c2", list(range(100, 120)), [], 8)  # second chunk: positions 8..15 of 20
    s = ScheduledRequest(req, 8, [3, 8, 10, 15])
    ids, pos, meta, logits_idx = make_runner().build_inputs([s])
    assert ids.tolist() == list(range(108, 116)) and pos.tolist() == list(range(8, 16))
    assert meta.slot_mapping.tolist() == [40, 41, 42, 43, 60, 61, 62, 63]  # blocks 10 and 15
    assert logits_idx == []  # 16 of 20 tokens: does not sample
    (p,) = meta.prefills
    assert (p.query_start, p.query_len, p.context_len) == (0, 8, 8)
    assert p.mask.shape == (32, 16)
    assert p.mask[0].tolist() == [True] * 9 + [False] * 7
    assert p.mask[7].tolist() == [True] * 16
    assert meta.decode_groups == []


def test_a_prompt_spanning_prompt_and_output_tokens():
    """Recompute after preemption: the scheduled range covers prompt and output tokens."""
    req = make_request("re", [5, 6, 7], [8, 9, 10], 0)
    ids, pos, meta, logits_idx = make_runner().build_inputs([ScheduledRequest(req, 6, [4, 2])])
    assert ids.tolist() == [5, 6, 7, 8, 9, 10] and pos.tolist() == [0, 1, 2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [16, 17, 18, 19, 8, 9]
    assert logits_idx == [5]


def test_a_one_token_prefix_hit_tail_runs_as_a_decode():
    req = make_request("tail", list(range(9)), [], 8)  # 8 tokens cached, only the last one to compute
    _, pos, meta, logits_idx = make_runner().build_inputs([ScheduledRequest(req, 1, [6, 3, 1])])
    assert pos.tolist() == [8] and meta.slot_mapping.tolist() == [4] and logits_idx == [0]
    assert meta.prefills == []
    (g,) = meta.decode_groups
    assert g.seq_lens.tolist() == [9] and g.block_table.tolist() == [[6, 3, 1]]


def test_decodes_after_a_prefill_chunk_are_rejected():
    step = mixed_step()
    with pytest.raises(ValueError, match="decodes must come before prefill chunks"):
        make_runner().build_inputs([step["chunk"], step["short"]])


def test_batch_invariant_model_attends_each_decode_alone_without_padding():
    step = mixed_step()
    _, _, meta, _ = make_runner(fake_model(batch_invariant=True)).build_inputs([step[r] for r in SORTED])
    groups = meta.decode_groups
    assert [(g.start, g.count) for g in groups] == [(0, 1), (1, 1), (2, 1)]
    assert [g.block_table.tolist() for g in groups] == [[[7, 2]], [[5, 0, 9]], [[12, 4, 14, 6]]]
    assert [g.mask.shape[-1] for g in groups] == [8, 12, 16]
    assert [int(g.mask.sum()) for g in groups] == [8, 10, 14]


def test_native_decode_kernel_gets_one_group_and_no_mask():
    step = mixed_step()
    runner = make_runner()

    def kernel(*args):  # never called by build_inputs
        raise AssertionError

    runner.decode_kernel = kernel
    _, _, meta, _ = runner.build_inputs([step[r] for r in SORTED])
    assert meta.decode_kernel is kernel
    (g,) = meta.decode_groups
    assert (g.start, g.count, g.mask) == (0, 3, None)
    assert g.block_table.tolist() == [[7, 2, 0, 0], [5, 0, 9, 0], [12, 4, 14, 6]]
    assert g.seq_lens.tolist() == [8, 10, 14]


def test_runner_without_native_kernels_uses_the_torch_path():
    runner = ModelRunner(fake_model(), [(torch.zeros(2, BS, 1, 4), torch.zeros(2, BS, 1, 4))], BS,
                         Sampler(frozenset()), use_native_kernels=False)
    assert runner.decode_kernel is None


# --------------------------------------------------------------------------------------------- execute_model
def test_execute_model_sorts_gathers_logits_rows_and_samples():
    record: list = []
    runner = make_runner(fake_model(record=record))
    step = mixed_step(hit={"logprobs": 2})
    order = ["hit", "long", "chunk", "short", "mid"]  # as a scheduler might list them
    out = runner.execute_model(SchedulerOutput([step[r] for r in order]))
    (_, ids, pos, meta), (_, hidden) = record
    assert ids.tolist() == EXPECTED_IDS and pos.tolist() == EXPECTED_POS
    assert meta.slot_mapping.tolist() == EXPECTED_SLOTS
    # logits only for the rows that sample: [input id, position] of short, mid, long and hit's last token
    assert hidden.tolist() == [[18, 7], [30, 9], [44, 13], [210, 10]]
    # greedy: argmax = input id + 1 (fake logits)
    assert out.sampled == {"short": [19], "mid": [31], "long": [45], "hit": [211]}
    assert list(out.logprobs) == ["hit"]  # only the request that asked
    (lp,) = out.logprobs["hit"]  # one entry per token of the step
    assert lp.token_id == 211 and lp.rank == 1 and len(lp.top) == 2 and lp.top[0][0] == 211
    assert runner.generators == {}  # all greedy


def test_execute_model_step_without_sampling_skips_logits():
    record: list = []
    runner = make_runner(fake_model(record=record))
    out = runner.execute_model(SchedulerOutput([mixed_step()["chunk"]]))
    assert [r[0] for r in record] == ["forward"]
    assert out.sampled == {} and out.logprobs == {}


def test_execute_model_empty_step_does_not_run_the_model():
    record: list = []
    out = make_runner(fake_model(record=record)).execute_model(SchedulerOutput())
    assert record == [] and out.sampled == {}


def test_generators_seeded_per_request_and_dropped_when_finished():
    runner = make_runner(seed=3)
    step = mixed_step(mid={"temperature": 1.0, "seed": 7}, long={"temperature": 0.8})
    runner.execute_model(SchedulerOutput([step["short"], step["mid"], step["long"]]))
    assert set(runner.generators) == {"mid", "long"}  # greedy "short" has none
    assert runner.generators["mid"].initial_seed() == 7
    assert runner.generators["long"].initial_seed() == random.Random(3).getrandbits(63)  # the runner's seed
    g_long = runner.generators["long"]
    runner.execute_model(SchedulerOutput([step["long"]]))
    assert runner.generators["long"] is g_long  # one generator for the request's whole life
    runner.execute_model(SchedulerOutput(finished_req_ids={"mid"}))
    assert set(runner.generators) == {"long"}


# ------------------------------------------------------------------------------------------------ KV caches
def test_allocate_kv_cache_shapes_and_dtypes():
    model = SimpleNamespace(config=SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8),
                            device=torch.device("cpu"), dtype=torch.float32)
    caches = allocate_kv_cache(model, num_blocks=5, block_size=BS)
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, BS, 2, 8) and k.dtype == torch.float32
        assert not k.any() and not v.any() and k.data_ptr() != v.data_ptr()
    (k, _), *_ = allocate_kv_cache(model, 5, BS, kv_cache_dtype="float16")
    assert k.dtype == torch.float16
    (k, _), *_ = allocate_kv_cache(model, 5, BS, dtype=torch.bfloat16)
    assert k.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- tiny random model, end to end
def tiny_model() -> LlamaModel:
    cfg = ModelConfig(architecture="llama", num_layers=2, hidden_size=32, intermediate_size=48, num_heads=4,
                      num_kv_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    w = {"model.embed_tokens.weight": rnd(VOCAB, 32), "model.norm.weight": 1 + rnd(32)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rnd(32), p + "post_attention_layernorm.weight": 1 + rnd(32),
              p + "self_attn.q_proj.weight": rnd(32, 32), p + "self_attn.k_proj.weight": rnd(16, 32),
              p + "self_attn.v_proj.weight": rnd(16, 32), p + "self_attn.o_proj.weight": rnd(32, 32),
              p + "mlp.gate_proj.weight": rnd(48, 32), p + "mlp.up_proj.weight": rnd(48, 32),
              p + "mlp.down_proj.weight": rnd(32, 48)}
    return LlamaModel(cfg, w, max_position=64, native_kernels=False)


def prefill_alone(model: LlamaModel, caches, tokens: list[int], table: list[int]) -> torch.Tensor:
    """Hidden states of ``tokens`` as one cold prefill written at ``table``'s slots (metadata built here)."""
    n = len(tokens)
    meta = AttentionMetadata(slot_mapping=torch.tensor([slot(table, p) for p in range(n)]),
                             prefills=[PrefillChunk(0, n, 0, torch.tensor(table))])
    return model.forward(torch.tensor(tokens), torch.arange(n), caches, meta)


@torch.inference_mode()
def test_built_metadata_gives_the_hidden_states_of_each_sequence_alone():
    model = tiny_model()
    caches = allocate_kv_cache(model, 16, BS)
    step = mixed_step()
    # the cache holds each request's computed context (its prefix, prefilled cold at its own blocks)
    for s in step.values():
        start = s.request.num_computed_tokens
        if start:
            prefill_alone(model, caches, s.request.token_at(0, start), s.block_ids)
    ids, pos, meta, _ = make_runner(model, use_native_kernels=False).build_inputs([step[r] for r in SORTED])
    hidden = model.forward(ids, pos, caches, meta)
    # reference: each whole sequence prefilled alone in a scratch cache
    row = 0
    for rid in SORTED:
        s = step[rid]
        start, n = s.request.num_computed_tokens, s.num_new_tokens
        scratch = allocate_kv_cache(model, 8, BS)
        ref = prefill_alone(model, scratch, s.request.token_at(0, start + n), list(range(8)))[start:]
        torch.testing.assert_close(hidden[row:row + n], ref, atol=1e-4, rtol=1e-4, msg=rid)
        row += n
    assert row == hidden.shape[0] == len(EXPECTED_IDS)
