"""``lmfuse.serving.scheduler``: admission, growth, preemption and prefix sharing over a
``PagedKVCache`` (no model: the engine's bookkeeping done by hand)."""

from __future__ import annotations

import torch

from lmfuse import PagedKVCache
from lmfuse.serving.request import Request, SamplingParams, Status
from lmfuse.serving.runner import _bucket
from lmfuse.serving.scheduler import Scheduler


def make(num_blocks: int = 16, **kw) -> Scheduler:
    cache = PagedKVCache(num_blocks, 4, 1, 8, torch.float32, "cpu")
    return Scheduler(cache, **{"max_batch": 8, "max_prefill_tokens": 64, **kw})


def request(rid: int, prompt: list[int], new: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams.make(max_new_tokens=new))


def run_step(s: Scheduler, token: int = 1):
    """What the engine does after a step: the tokens counted cached, one sampled each."""
    batch = s.schedule()
    for r in batch.requests:
        r.num_cached = r.length
        if batch.kind == "prefill":
            s.register_prefix(r)
        r.output.append(token)
    return batch


def test_prefill_then_decode_and_the_token_budget() -> None:
    s = make(max_prefill_tokens=10)
    reqs = [request(i, list(range(1 + i, 7 + i))) for i in range(3)]  # 6 tokens each
    for r in reqs:
        s.add(r)
    b = run_step(s)
    assert b.kind == "prefill" and b.requests == reqs[:1]  # 12 > 10: the second waits
    assert b.new == [reqs[0].prompt]
    b = run_step(s)
    assert b.kind == "prefill" and b.requests == reqs[1:2]
    b = run_step(s)
    assert b.kind == "prefill" and b.requests == reqs[2:]
    b = run_step(s)
    assert b.kind == "decode" and b.requests == reqs
    # Table widths are powers of two of blocks (7 tokens: 2 blocks).
    assert b.step.block_table.shape == (3, 2)
    assert b.step.seqlens.tolist() == [7, 7, 7]


def test_admission_keeps_a_block_of_growth_for_every_running_request() -> None:
    s = make(num_blocks=5)
    a, b = request(0, list(range(8))), request(1, list(range(10, 18)))
    s.add(a)
    run_step(s)  # a: 8 tokens + 1 -> 3 blocks once it grows; 2 held now
    s.add(b)
    batch = s.schedule()  # b needs 2 blocks: 3 free, but a needs one to grow -> 1 left < 2
    assert batch.kind == "decode" and batch.requests == [a]
    assert list(s.waiting) == [b] and s.cache.num_free_blocks == 2


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    s = make(num_blocks=6)
    a, b = request(0, list(range(7)), 20), request(1, list(range(10, 17)), 20)
    s.add(a)
    s.add(b)
    assert run_step(s).requests == [a, b]  # 2 + 2 blocks, 2 free
    for _ in range(2):
        run_step(s)  # 9 tokens: 3 blocks each -> 0 free
    batch = run_step(s)  # growing both needs nothing new (10 tokens, 3 blocks)...
    assert batch.kind == "decode"
    for _ in range(3):  # ...until 13 tokens: a 4th block each, only one can have it
        batch = run_step(s)
    assert s.preemptions == 1 and b.status == Status.WAITING and list(s.waiting) == [b]
    assert b.seq_id is None and b.num_cached == 0 and b.preemptions == 1
    assert batch.requests == [a]


def test_prefix_sharing_index_and_its_cleanup() -> None:
    s = make()
    base = list(range(100, 113))  # 13 tokens: 3 full blocks
    a = request(0, base)
    s.add(a)
    run_step(s)
    b = request(1, base[:9] + [1, 2])  # shares 2 full blocks
    c = request(2, base[:12])  # 12 tokens: shares 2 (one token must be computed)
    s.add(b)
    s.add(c)
    batch = run_step(s)
    assert batch.requests == [b, c] and batch.new == [b.prompt[8:], c.prompt[8:]]
    assert s.cache.block_ids(b.seq_id)[:2] == s.cache.block_ids(a.seq_id)[:2]
    assert s.shared_tokens == 16
    s.finish(a)
    assert all(a not in holders for holders in s._prefix.values())
    # b and c still hold the shared blocks, and share them on: a later prompt with the
    # prefix shares b's (the next holder), though a, the first, has left.
    assert s.cache.block_ids(b.seq_id)[:2] == s.cache.block_ids(c.seq_id)[:2]
    d = request(3, base[:8] + [7, 7])
    s.add(d)
    batch = run_step(s)
    assert batch.requests == [d] and batch.new == [d.prompt[8:]] and s.shared_tokens == 24
    assert s.cache.block_ids(d.seq_id)[:2] == s.cache.block_ids(b.seq_id)[:2]
    for r in (b, c, d):
        s.finish(r)
    assert s.cache.num_free_blocks == 16 and not s.has_unfinished() and not s._prefix


def test_a_hash_collision_does_not_share(monkeypatch) -> None:
    s = make()
    a = request(0, list(range(100, 109)))
    s.add(a)
    run_step(s)
    monkeypatch.setattr(s, "_chain", lambda tokens, blocks: [h for h in s._hashes[a.seq_id]
                                                             ][:blocks])
    b = request(1, list(range(200, 209)))  # same hashes (forced), other tokens
    s.add(b)
    batch = run_step(s)
    assert batch.new == [b.prompt] and s.shared_tokens == 0


def test_batch_buckets() -> None:
    assert [_bucket(n, 256) for n in (1, 2, 3, 5, 9, 16, 17, 33, 250)] == [
        1, 2, 4, 8, 16, 16, 32, 48, 256]
    assert _bucket(3, 3) == 3 and _bucket(20, 20) == 20


def drive(s: Scheduler, steps: int) -> list:
    """``steps`` steps of the engine's bookkeeping, a long prompt's chunks included: the
    batches."""
    out = []
    for _ in range(steps):
        batch = s.schedule()
        if batch is None:
            break
        out.append(batch)
        if batch.partial:  # a chunk before the prompt's last: cached, no token
            batch.requests[0].num_cached += len(batch.new[0])
            continue
        for r in list(batch.requests):
            r.num_cached = r.length
            if batch.kind == "prefill":
                s.register_prefix(r)
            r.output.append(1)
            if len(r.output) == r.params.max_new_tokens:
                s.finish(r)
    return out


def test_a_long_prompt_is_prefilled_in_chunks_with_decode_steps_between() -> None:
    s = make(max_prefill_tokens=4)
    a, b = request(0, [1, 2, 3]), request(1, list(range(10, 21)))  # 3 and 11 tokens
    s.add(a)
    drive(s, 1)
    s.add(b)
    batches = drive(s, 6)
    assert [(x.kind, x.partial) for x in batches] == [
        ("prefill", True), ("decode", False), ("prefill", True), ("decode", False),
        ("prefill", False), ("decode", False)]
    assert [x.new[0] for x in batches if x.kind == "prefill"] == [
        b.prompt[:4], b.prompt[4:8], b.prompt[8:]]
    # b stays out of the decode batches until its last chunk; its blocks were all reserved
    # when it was admitted
    assert [x.requests for x in batches if x.kind == "decode"] == [[a], [a], [a, b]]
    assert s.prefilling is None and s.running == [a, b] and b.num_cached == 12
    # a prompt within the budget is not split
    c = request(2, [5, 6, 7, 8])
    s.add(c)
    (batch,) = drive(s, 1)
    assert batch.requests == [c] and not batch.partial


def test_a_stream_of_arrivals_never_stalls_the_running_requests() -> None:
    """One new request a step (each admitted alone): the running requests decode a step
    after every ``max_prefill_streak`` prefill steps, not only when the batch is full."""
    for streak in (1, 4):
        s = make(num_blocks=256, max_batch=64)
        s.max_prefill_streak = streak
        first = request(0, [1, 2, 3], 5)
        s.add(first)
        kinds = []
        for i in range(1, 31):
            s.add(request(i, [4, 5], 5))
            kinds += [b.kind for b in drive(s, 1)]
        # runs of `streak` prefills (the first admits `first`), a decode after each
        want = (["prefill"] * streak + ["decode"]) * 30
        assert kinds == want[:30], (streak, kinds)
        assert len(first.output) == min(5, 1 + kinds.count("decode"))


def test_chunks_off_prefill_a_long_prompt_whole() -> None:
    s = make(max_prefill_tokens=4, chunk_prefill=False)
    b = request(1, list(range(10, 21)))
    s.add(b)
    (batch,) = drive(s, 1)
    assert batch.new == [b.prompt] and not batch.partial and s.prefilling is None


def test_a_prompt_between_chunks_is_aborted_or_requeued() -> None:
    s = make(max_prefill_tokens=4)
    b = request(1, list(range(10, 21)))
    s.add(b)
    drive(s, 1)
    assert s.prefilling is b and s.cache.num_free_blocks == 16 - 3
    s.abort(b)
    assert s.prefilling is None and not s.has_unfinished()
    assert s.cache.num_free_blocks == 16 and b.status == Status.FINISHED
    # A running request that cannot grow takes the prefilling one's blocks: it goes back to
    # the front of the queue, prefilled again later (chunks of one token: eleven of them,
    # a decode step between two).
    s = make(num_blocks=6, max_prefill_tokens=1)  # a at full length: all 6 blocks
    a, b = request(0, [1, 2, 3], 20), request(1, list(range(10, 21)), 2)
    s.add(a)
    drive(s, 1)
    s.add(b)
    drive(s, 30)
    assert b.preemptions >= 1 and s.preemptions == b.preemptions and a.preemptions == 0
    drive(s, 200)
    assert not s.has_unfinished() and len(a.output) == 20 and len(b.output) == 2
    assert s.cache.num_free_blocks == 6
