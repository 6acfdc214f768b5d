"""Speculative decoding with n-gram drafts: the proposer, exact verification, and the engine's outputs unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.runtime.engine import Engine
from deepinfer.runtime.sampler import sampling_probs
from deepinfer.runtime.scheduler import STALE_COST_STEPS, ScheduledStep, Scheduler, SchedulerConfig
from deepinfer.runtime.sequence import SamplingParams, Sequence
from deepinfer.runtime.speculative import NgramProposer, verify


def test_the_proposer_continues_the_latest_longest_match():
    p = NgramProposer(k=3, min_n=2, max_n=3)
    # suffix [7, 8, 9] occurs at 1..3 (followed by 4, 5, 6); [8, 9] alone also at 10..11 (followed by 1)
    toks = [0, 7, 8, 9, 4, 5, 6, 2, 2, 2, 8, 9, 1, 3, 7, 8, 9]
    assert p.propose(toks, 3) == [4, 5, 6]               # the 3-gram wins over the later 2-gram
    assert p.propose(toks, 2) == [4, 5]                  # at most k asked
    assert NgramProposer(k=3, min_n=2, max_n=2).propose(toks, 3) == [1, 3, 7]      # the latest 2-gram match
    assert p.propose([1, 2, 3, 4], 3) == []               # nothing repeats
    assert p.propose([5, 6, 5, 6], 3) == [5, 6]           # the continuation stops at the end of the context
    assert NgramProposer(k=0).propose(toks, 3) == [] and p.propose([1], 3) == []
    with pytest.raises(ValueError):
        NgramProposer(k=2, min_n=3, max_n=2)


def test_the_index_finds_what_a_scan_finds_and_catches_up_over_steps(monkeypatch):
    import random

    import deepinfer.runtime.speculative as spec

    def scan(toks, k, lo, hi):       # the latest earlier occurrence of the longest suffix, by brute force
        L = len(toks)
        for n in range(min(hi, L - 1), lo - 1, -1):
            for s in range(L - n - 1, -1, -1):
                if toks[s:s + n] == toks[L - n:]:
                    return toks[s + n:s + n + k]
        return []
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        assert NgramProposer(k=3, min_n=2, max_n=4).propose(toks, 3) == scan(toks, 3, 2, 4), toks
    # a long prompt is indexed a few positions a step (here 5): never a wrong draft, the same ones once caught up
    monkeypatch.setattr(spec, "INDEX_PER_CALL", 5)
    p = NgramProposer(k=3, min_n=2, max_n=4)
    seq = Sequence([rng.randrange(5) for _ in range(60)], SamplingParams())
    for step in range(30):
        d = p.propose_for(seq, 3)
        toks = seq.prompt_ids + seq.output_ids
        if seq.ngrams.indexed == len(toks):
            assert d == scan(toks, 3, 2, 4)
        else:
            assert not d or any(toks[s:s + len(d)] == d for s in range(len(toks)))
        seq.output_ids.append(rng.randrange(5))
    assert seq.ngrams.indexed == len(seq.ngrams.tokens)


def test_greedy_verification_keeps_the_argmax_prefix():
    rows = torch.full((4, 6), -5.0)
    for i, t in enumerate([3, 1, 4, 2]):
        rows[i, t] = 5.0
    seq = Sequence([1, 2], SamplingParams(max_tokens=8))
    assert verify(rows, seq, [3, 1, 4]) == [3, 1, 4, 2]      # all accepted, plus the bonus token
    assert verify(rows, seq, [3, 0, 4]) == [3, 1]             # rejected at the second: the model's token instead
    assert verify(rows, seq, [5, 1, 4]) == [3]


def test_sampled_verification_keeps_the_models_distribution():
    """The first token a draft step outputs is distributed as p: accepted with probability p(d), else drawn
    from p without d (and a second token follows only after an accepted first)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, generator=g) * 1.5
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=4, seed=1)
    seq = Sequence([1], params)
    p = sampling_probs(logits[0], 0.8, 4, 1.0)
    for d in (int(p.argmax()), int(p.argmin())):           # a likely and an impossible draft (top-k drops it)
        counts = torch.zeros(5)
        accepted = 0
        n = 6000
        for _ in range(n):
            out = verify(logits, seq, [d])
            counts[out[0]] += 1
            accepted += out[0] == d
            assert len(out) == (2 if out[0] == d else 1)
        assert torch.allclose(counts / n, p, atol=0.025), (d, counts / n, p)
        assert abs(accepted / n - float(p[d])) < 0.025


def _cfg(**kw) -> SchedulerConfig:
    base = dict(decode_buckets=(1, 4), prefill_buckets=(), context_buckets=(64,), context_limit=64, block_size=16,
                num_blocks=8, num_speculative_tokens=3)
    return SchedulerConfig(**{**base, **kw})


def test_drafts_take_only_the_spare_tokens_and_skip_processed_logits():
    sched = Scheduler(_cfg())
    rep = [5, 6, 7, 8] * 3
    a = Sequence(rep, SamplingParams(max_tokens=20))
    b = Sequence(rep, SamplingParams(max_tokens=20, presence_penalty=0.5))
    for s in (a, b):
        sched.add(s)
    while not (a.output_ids and b.output_ids):          # the prompts, 4 tokens a step, then a first token each
        step = sched.schedule()
        sched.advance(step)
        for e in step.entries:
            if e.wants_logits:              # the pattern goes on, one token a step (as if drafts were rejected)
                e.seq.output_ids.append(rep[e.seq.num_tokens % 4])
                e.seq.draft_ids = []
    want = sched.proposer.propose(a.prompt_ids + a.output_ids, 2)
    assert len(want) == 2
    step = sched.schedule()
    by = {e.seq: e for e in step.entries}
    # the step has 4 - 2 spare tokens: a's draft takes them; b has penalties: not drafted
    assert by[a].num_draft == 2 and a.draft_ids == want and by[a].num_tokens == 3 and by[a].every_row
    assert by[b].num_draft == 0 and b.draft_ids == []
    assert step.tokens == 4
    sched.advance(step)
    assert a.num_computed == by[a].start + 1   # the draft's KV counts only once verified (by the engine)


def _decoding(sched: Scheduler, prompt: list[int]) -> Sequence:
    """A sequence of `prompt` run to its first output token (the prompt's period-4 pattern going on): its next
    step is a decode step."""
    seq = Sequence(prompt, SamplingParams(max_tokens=20))
    sched.add(seq)
    while not seq.output_ids:
        step = sched.schedule()
        sched.advance(step)
        if step.entries[0].wants_logits:
            seq.output_ids.append(prompt[seq.num_tokens % 4])
    return seq


def _measured(sched: Scheduler, costs: dict) -> None:
    """Decode steps of these (tokens, context) shapes took these seconds (each shape's first step is left out)."""
    for (t, c), seconds in costs.items():
        step = ScheduledStep("decode", t, c, ())
        for _ in range(2):
            sched.observe(step, seconds)


def test_a_larger_bucket_is_taken_only_when_the_drafts_repay_its_measured_cost():
    """One decoding sequence (bucket 1): a draft needs bucket 4. Measured 10x dearer and the sequence's drafts
    rarely accepted, no draft; measured 1.2x and drafts mostly accepted, the draft goes."""
    rep = [5, 6, 7, 8] * 3
    for cost4, hits, taken in ((10.0, 0, False), (1.2, 20, True), (1.2, 0, False)):
        sched = Scheduler(_cfg())
        a = _decoding(sched, rep)
        a.draft_hits, a.draft_trials = hits, 20
        _measured(sched, {(1, 64): 1.0, (4, 64): cost4})
        step = sched.schedule()
        assert (step.entries[0].num_draft > 0) == taken, (cost4, hits)
        assert step.tokens == (4 if taken else 1)


@pytest.fixture(scope="module")
def artifact(checkpoints, compile_artifact):
    return compile_artifact(checkpoints["base"])


def _always_drafting(engine: Engine) -> Engine:
    """Step costs never measured (all equal): drafts go wherever they fit, whatever this machine's timings."""
    engine.scheduler.observe = lambda step, seconds: None
    return engine


def _repeating_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    unit = torch.randint(2, 320, (6,), generator=g).tolist()
    return [unit * 4, torch.randint(2, 320, (9,), generator=g).tolist() * 2 + [7], [3, 4] * 10]


def test_greedy_outputs_and_logprobs_are_the_same_with_drafts(artifact):
    """Greedy tokens and their logprobs with n-gram drafts equal the plain engine's, alone and batched, with
    stop strings, max_tokens and EOS in the mix; drafts were verified and accepted (fewer steps)."""
    plain = Engine.from_artifact(artifact)
    spec = _always_drafting(Engine.from_artifact(artifact, num_speculative_tokens=3))
    ps = _repeating_prompts()
    params = SamplingParams(max_tokens=30, logprobs=2)
    want = plain.generate(ps, params)
    got = spec.generate(ps, params)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    for g, w in zip(got, want):
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4)
        assert [sorted(t) for t in g.output_logprobs] == [sorted(t) for t in w.output_logprobs]
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    alone = [spec.generate([p], params)[0].output_ids for p in ps]
    assert alone == [s.output_ids for s in want]
    steps = spec.num_steps
    spec.generate([ps[0]], params)
    plain_steps = plain.num_steps
    plain.generate([ps[0]], params)
    assert spec.num_steps - steps < plain.num_steps - plain_steps      # tokens came several to a step
    # stop strings and max_tokens cut where the plain engine cuts
    text = plain.tokenizer.decode(want[0].output_ids)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        sp = SamplingParams(max_tokens=30, stop=(stop,))
        assert spec.generate([ps[0]], sp)[0].output_text == plain.generate([ps[0]], sp)[0].output_text
    short = SamplingParams(max_tokens=5)
    assert spec.generate([ps[0]], short)[0].output_ids == want[0].output_ids[:5]
    for eng in (plain, spec):
        assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_seeded_sampling_gives_the_same_tokens_with_drafts(artifact):
    """verify() samples each row as the plain path does, one draw a token from the request's generator: a
    seeded request's tokens do not depend on whether, or how often, its steps carried drafts."""
    plain = Engine.from_artifact(artifact)
    spec = _always_drafting(Engine.from_artifact(artifact, num_speculative_tokens=3))
    params = SamplingParams(max_tokens=25, temperature=0.1, top_k=40, seed=3, logprobs=0)
    want = plain.generate(_repeating_prompts(), params)
    seqs = spec.generate(_repeating_prompts(), params)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in want]
    assert spec.num_accepted_tokens > 0
    assert all(len(s.token_logprobs) == len(s.output_ids) for s in seqs)
    assert spec.scheduler.blocks.num_free == spec.scheduler.blocks.num_blocks


def test_step_costs_skip_first_runs_and_are_measured_again_when_stale():
    sched = Scheduler(_cfg())
    one, four = ScheduledStep("decode", 1, 64, ()), ScheduledStep("decode", 4, 64, ())
    sched.observe(one, 50.0)                     # a first run (compile, capture): left out
    assert sched.step_cost(1, 64) == 1.0
    sched.observe(one, 2.0)
    assert sched.step_cost(1, 64) == 2.0 and sched.step_cost(4, 64) == 2.0    # unmeasured: as dear as 1
    _measured(sched, {(4, 64): 30.0})            # a stall inflated it
    assert sched.step_cost(4, 64) == 30.0
    for _ in range(STALE_COST_STEPS + 1):
        sched.observe(one, 2.0)
    assert sched.step_cost(4, 64) == 2.0         # stale: tried again
    sched.observe(four, 3.0)
    assert sched.step_cost(4, 64) == 3.0         # and measured afresh, not averaged with the stall


def test_drafts_take_no_cached_block_and_leave_running_sequences_theirs():
    """A draft that needs a new block gets one only from never-cached free blocks and only while one stays free
    per running sequence (cut shorter otherwise): a draft that may be rejected evicts no cached prefix and
    causes no preemption."""
    rep = [5, 6, 7, 8] * 3 + [5, 6]              # 14 tokens; the first output goes to position 14 of block 0
    for num_blocks, cached, want in ((4, False, 3), (2, False, 1), (3, True, 1)):
        sched = Scheduler(_cfg(num_blocks=num_blocks))
        if cached:                               # a finished sequence left one registered block, evictable
            old = Sequence(list(range(100, 117)), SamplingParams(max_tokens=1))
            sched.add(old)
            while not old.is_finished:
                step = sched.schedule()
                sched.advance(step)
                if step.entries[0].wants_logits:
                    sched.finish(old, "stop")
            assert sched.blocks.num_cached == 1 and len(sched.blocks.free_blocks) == num_blocks - 1
        a = _decoding(sched, rep)
        step = sched.schedule()           # drafts [8, 5, 6] at 15, 16, 17: 16 and 17 need block 1
        assert step.entries[0].num_draft == want, (num_blocks, cached)
        assert sched.blocks.num_cached == int(cached)
