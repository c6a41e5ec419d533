"""Scheduler policy on fake model outputs: budgets, chunking, preemption, fail-fast, no head-of-line blocking."""

from leanserve.core.kv_cache_manager import KVCacheManager
from leanserve.core.request import Request, RequestStatus
from leanserve.core.scheduler import Scheduler
from leanserve.sampling_params import SamplingParams

import pytest


def req(rid: str, prompt_len: int, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, [7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens, **kw)


def run_step(s: Scheduler, token: int = 5):
    out = s.schedule()
    sampled = {x.request.request_id: token for x in out.scheduled if x.samples}
    return out, s.update_from_output(out, sampled)


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=1000)
    s.add_request(req("short", 3, max_tokens=20))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 3)]
    s.add_request(req("long", 25))
    out, _ = run_step(s)
    # the decode of "short" first, then a 9-token chunk of "long"
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 1), ("long", 9)]
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 1), ("long", 9)]
    out, results = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 1), ("long", 7)]
    assert {r.request.request_id for r in results} == {"short", "long"}  # long sampled its first token


def test_max_num_seqs_caps_running():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=None, max_model_len=1000)
    for i in range(3):
        s.add_request(req(f"r{i}", 4))
    out, _ = run_step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 1


def test_preemption_frees_newest_and_recomputes():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=None, max_model_len=1000)
    s.add_request(req("old", 7, max_tokens=8))
    s.add_request(req("new", 7, max_tokens=8))
    run_step(s)  # both prefilled: 2 blocks each (the pool is full), 1 token sampled each
    run_step(s)  # token 8 still fits in the second block
    out, _ = run_step(s)  # token 9 needs a third block: the newest request is preempted
    assert s.num_preemptions == 1
    assert [x.request.request_id for x in out.scheduled] == ["old"]
    new = next(r for r in s.waiting)
    assert new.request_id == "new" and new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.output_token_ids == [5, 5]  # output kept
    while s.has_unfinished_requests():
        run_step(s)
    assert kv.pool.num_free_blocks == 4


def test_request_larger_than_pool_is_an_invariant_violation():
    """Admission (tests/engine/test_admission.py) refuses such a request; the scheduler only asserts it."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=None, max_model_len=1000)
    with pytest.raises(AssertionError, match="cannot fit the KV pool"):
        s.add_request(req("huge", 20))
    assert not s.has_unfinished_requests()


def test_big_waiting_prompt_does_not_block_smaller_ones():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=None, max_model_len=1000)
    s.add_request(req("running", 8, max_tokens=4))
    run_step(s)  # holds 3 blocks now (9 tokens after sampling... 2 blocks + growth)
    s.add_request(req("big", 20, max_tokens=2))  # 6 blocks: must wait for "running"
    s.add_request(req("small", 3, max_tokens=2))
    out, _ = run_step(s)
    ids = [x.request.request_id for x in out.scheduled]
    assert "small" in ids and "big" not in ids
    assert s.waiting[0].request_id == "big"  # keeps its place at the head
    while s.has_unfinished_requests():
        run_step(s)
    assert kv.pool.num_free_blocks == 6


def test_finish_request_frees_blocks_and_reports_once():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=None, max_model_len=1000)
    s.add_request(req("a", 6, max_tokens=20))
    run_step(s)
    assert kv.pool.num_free_blocks == 6
    r = s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert r.status.finish_reason == "abort" and kv.pool.num_free_blocks == 8
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert s.schedule().finished_req_ids == {"a"}


def test_priority_policy_orders_waiting():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=None, max_model_len=1000, policy="priority")
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("high", 4, priority=0))
    out, _ = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]


def test_long_prompt_is_chunked_while_others_wait_and_shorts_pass():
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=2000,
                  long_prefill_token_threshold=64, max_long_partial_prefills=1)
    for i in range(2):
        s.add_request(req(f"long{i}", 300))
        s.add_request(req(f"short{i}", 10))
    out, _ = run_step(s)
    got = [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]
    # one long prompt prefills 64 tokens at a time; the second waits; both shorts start at once
    assert got == [("long0", 64), ("short0", 10), ("short1", 10)]
    assert [r.request_id for r in s.waiting] == ["long1"]
    assert kv.prefix_cache_queries == 320 and kv.prefix_cache_hits == 0


def test_lone_long_prompt_is_chunked_too():
    """A step stays short even for a lone long prompt: a request arriving meanwhile starts after one chunk."""
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=2000,
                  long_prefill_token_threshold=64)
    s.add_request(req("long", 300))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 64)]
    s.add_request(Request("short", [9] * 10, SamplingParams(max_tokens=4), 4))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 64), ("short", 10)]


def test_no_threshold_uses_the_whole_budget():
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=2000)
    s.add_request(req("long", 300))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 300)]


def test_long_prompt_is_chunked_beside_a_single_running_request():
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=2000,
                  long_prefill_token_threshold=64)
    s.add_request(req("short", 5, max_tokens=50))
    run_step(s)
    s.add_request(req("long", 300))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 1), ("long", 64)]


def test_chunks_leave_no_short_last_piece():
    """With min_chunk_tokens, a chunked prompt never ends in a piece of a few tokens (they would round
    differently from a longer chunk); the budget is respected."""
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=2000,
                  long_prefill_token_threshold=64, min_chunk_tokens=8)
    s.add_request(req("a", 66))  # 64 + 2 would leave 2: finish in one step instead
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 66)]
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=50, max_model_len=2000, min_chunk_tokens=8)
    s.add_request(req("b", 53))  # the budget forbids 53 at once: 45 now, 8 next
    sizes = [x.num_new_tokens for _ in range(2) for x in run_step(s)[0].scheduled]
    assert sizes == [45, 8]


def test_no_short_first_piece_when_other_requests_hold_the_step():
    """The budget the step's other requests leave never starts or continues a prompt with a piece shorter than
    min_chunk_tokens (it would round differently from a chunk, so a prompt's numbers would depend on its
    neighbours): the prompt waits a step; a piece that finishes it, or a whole step budget that short, is fine."""
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=24, max_model_len=2000, min_chunk_tokens=8)
    s.add_request(req("a", 20, max_tokens=30))
    b = req("b", 40)
    b.prompt_token_ids[:] = [9] * 40  # no prefix-cache hit on "a"'s blocks
    s.add_request(b)  # 4 tokens of budget left after "a": not a 4-token piece
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 20)]
    out, _ = run_step(s)  # "a" decodes (1), "b" starts with 23 (a piece of at least 8)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 23)]
    s.add_request(req("c", 3))  # 0 left for c this step, then a 3-token prompt fits whole
    for _ in range(3):
        out, _ = run_step(s)
        pieces = [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]
        assert all(n == 1 or n >= 8 or (rid == "c" and n == 3) for rid, n in pieces), pieces
    assert s.requests["b"].num_computed_tokens >= 40 and s.requests["c"].num_computed_tokens >= 3  # no stall
    kv = KVCacheManager(num_blocks=200, block_size=4)
    tiny = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=5, max_model_len=2000, min_chunk_tokens=8)
    tiny.add_request(req("d", 12))  # the whole budget is 5: pieces of 5 (the budget forces it), no stall
    assert [x.num_new_tokens for _ in range(3) for x in run_step(tiny)[0].scheduled] == [5, 5, 2]
