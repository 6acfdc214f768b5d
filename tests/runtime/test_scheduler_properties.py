"""Property tests of the block manager and scheduler, with a fake model step (no graphs needed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.runtime.block_manager import BlockManager
from deepinfer.runtime.scheduler import Scheduler, SchedulerConfig
from deepinfer.runtime.sequence import SamplingParams, Sequence, Status


def check_invariants(sched: Scheduler) -> None:
    bm = sched.blocks
    owned = [b for s in sched.running for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert not any(s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
    assert len(owned) + bm.num_free == bm.num_blocks, "a block leaked"
    assert set(owned).isdisjoint(bm.free_blocks)
    for s in sched.running:
        assert len(s.block_table) * bm.block_size >= s.num_computed


def fake_step(sched: Scheduler, step) -> None:
    """What the engine does after a step, with the model replaced by 'every sampled token is 7'."""
    sched.advance(step)
    for e in step.entries:
        if e.wants_logits:
            e.seq.output_ids.append(7)
            if len(e.seq.output_ids) >= e.seq.params.max_tokens:
                sched.finish(e.seq, "length")


def run_to_completion(cfg: SchedulerConfig, requests: list[tuple[int, int]], arrivals: list[int]) -> list[Sequence]:
    """Requests (prompt_len, max_tokens) arrive at step `arrivals[i]`; every step 'generates' token 7."""
    sched = Scheduler(cfg)
    seqs = [Sequence([3] * p, SamplingParams(max_tokens=n)) for p, n in requests]
    pending = sorted(zip(arrivals, range(len(seqs))))
    step_no = 0
    while pending or sched.has_work:
        while pending and pending[0][0] <= step_no:
            sched.add(seqs[pending.pop(0)[1]])
        step = sched.schedule()
        step_no += 1
        assert step_no < 10_000, "no progress"
        if step is None:
            assert not sched.running or pending, "work left but nothing schedulable"
            continue
        assert step.num_real_tokens <= step.tokens
        buckets = cfg.decode_buckets if step.kind == "decode" else cfg.prefill_buckets
        assert step.tokens in buckets and step.context in cfg.context_buckets
        assert step.kind == "decode" or step.context >= step.tokens      # prefill graphs have C >= T
        for e in step.entries:
            assert e.start + e.num_tokens <= step.context
            assert len(e.seq.block_table) * cfg.block_size >= e.start + e.num_tokens
        if step.kind == "prefill":     # packed sequences: whole blocks each, back to back in one context row
            spans = [-(-(e.start + e.num_tokens) // cfg.block_size) * cfg.block_size for e in step.entries]
            assert sum(spans) <= step.context
            # packing never raises the context bucket above a full chunk of the first sequence alone
            first_alone = max(spans[0], max(cfg.prefill_buckets))
            assert len(spans) == 1 or step.context <= min(c for c in cfg.context_buckets if c >= first_alone)
            assert len(step.entries) <= min(step.tokens, cfg.max_num_seqs)
            assert len({e.seq for e in step.entries}) == len(step.entries)
        fake_step(sched, step)
        check_invariants(sched)
    return seqs


requests = st.lists(st.tuples(st.integers(1, 100), st.integers(1, 20)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(requests=requests, data=st.data(), num_blocks=st.integers(8, 40), prefill=st.booleans(),
       streak=st.integers(1, 5))
def test_every_request_finishes_without_leaks(requests, data, num_blocks, prefill, streak):
    cfg = SchedulerConfig(decode_buckets=(1, 2, 4), prefill_buckets=(16, 32) if prefill else (),
                          context_buckets=(64, 128), context_limit=128, block_size=16, num_blocks=num_blocks,
                          max_prefill_streak=streak)
    requests = [(p, min(n, 128 - p)) for p, n in requests if p < 128]
    if not requests:
        return
    arrivals = data.draw(st.lists(st.integers(0, 30), min_size=len(requests), max_size=len(requests)))
    seqs = run_to_completion(cfg, requests, arrivals)
    for s, (p, n) in zip(seqs, requests):
        assert s.status is Status.FINISHED and len(s.output_ids) == n


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40), st.booleans()), max_size=60))
def test_block_manager_check_then_act(ops):
    bm = BlockManager(num_blocks=10, block_size=4)
    seqs = [Sequence([1], SamplingParams()) for _ in range(6)]
    for i, n, free in ops:
        s = seqs[i]
        if free:
            bm.free(s)
            s.num_computed = 0
            continue
        need = bm.blocks_needed(s, n)
        before = (bm.num_free, list(s.block_table))
        if bm.can_allocate(need):
            bm.allocate(s, n)
            s.num_computed += n
            assert len(s.block_table) * 4 >= s.num_computed
        else:
            assert (bm.num_free, s.block_table) == before
        owned = [b for q in seqs for b in q.block_table]
        assert len(owned) == len(set(owned)) and len(owned) + bm.num_free == 10


def test_prefill_runs_first_but_at_most_max_prefill_streak_in_a_row():
    """One sequence is decoding when six long prompts arrive: prefills admit them first, yet the decoding
    sequence gets a step after every `max_prefill_streak` chunks (its TPOT stall is bounded)."""
    for streak in (1, 3):
        cfg = SchedulerConfig(decode_buckets=(1, 2, 4, 8), prefill_buckets=(16,), context_buckets=(64,),
                              context_limit=64, block_size=16, num_blocks=64, max_prefill_streak=streak)
        sched = Scheduler(cfg)
        first = Sequence([3] * 2, SamplingParams(max_tokens=50))
        sched.add(first)
        kinds = []
        for i in range(40):
            if i == 2:
                for _ in range(6):
                    sched.add(Sequence([3] * 20, SamplingParams(max_tokens=4)))
            step = sched.schedule()
            if step is None:
                break
            kinds.append("P" if step.kind == "prefill" else "D")
            fake_step(sched, step)
        run = "".join(kinds)
        assert "P" * (streak + 1) not in run, run
        assert run[2:2 + streak] == "P" * streak, run       # the burst is admitted first
        assert run.count("P") == 6, run                     # one 16-token chunk each (the 4 left go in decode)


def test_short_prompts_share_a_prefill_chunk():
    """Eight 12-token prompts (too long for a decode step) share 32-token chunks instead of taking a padded chunk
    each; a prompt cut at the chunk's end finishes later (here in a decode step: 4 tokens are left)."""
    cfg = SchedulerConfig(decode_buckets=(1, 2, 4, 8), prefill_buckets=(16, 32), context_buckets=(64, 128),
                          context_limit=128, block_size=16, num_blocks=64)
    sched = Scheduler(cfg)
    seqs = [Sequence([3] * 12, SamplingParams(max_tokens=2)) for _ in range(8)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert step.kind == "prefill" and step.tokens == 32 and step.context == 64
    assert [(e.seq, e.start, e.num_tokens, e.wants_logits) for e in step.entries] == [
        (seqs[0], 0, 12, True), (seqs[1], 0, 12, True), (seqs[2], 0, 8, False)]
    fake_step(sched, step)
    kinds = ["P"]
    while sched.has_work:
        step = sched.schedule()
        kinds.append("P" if step.kind == "prefill" else "D")
        fake_step(sched, step)
    assert kinds.count("P") == 3, kinds
    assert all(s.status is Status.FINISHED and len(s.output_ids) == 2 for s in seqs)
