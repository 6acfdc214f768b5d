"""Property tests of the block manager and scheduler, with a fake model step (no graphs needed)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.runtime.block_manager import BlockManager
from deepinfer.runtime.scheduler import Scheduler, SchedulerConfig
from deepinfer.runtime.sequence import SamplingParams, Sequence, Status


def check_invariants(sched: Scheduler) -> None:
    bm = sched.blocks
    held = Counter(b for s in sched.running for b in s.block_table)
    assert dict(held) == bm.refs, "a block's reference count is not the number of sequences holding it"
    assert not any(s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
    assert len(held) + bm.num_free == bm.num_blocks, "a block leaked"
    free, evictable = set(bm.free_blocks), set(bm.evictable)
    assert len(free) == len(bm.free_blocks) and free.isdisjoint(evictable)
    assert set(held).isdisjoint(free | evictable)
    assert evictable <= set(bm.key_of) and {b: k for k, b in bm.cached.items()} == bm.key_of
    for s in sched.running:
        assert len(s.block_table) * bm.block_size >= s.num_computed
        assert s.num_registered <= s.num_computed // bm.block_size
        for i, b in enumerate(s.block_table[: s.num_registered]):
            assert bm.key_of.get(b, s.block_key(bm.block_size, i)) == s.block_key(bm.block_size, i), \
                "a sequence holds a cached block of another prefix"


class FakePool:
    """The KV pool as the model would leave it: each slot holds the token prefix whose last token's KV it is.
    Checks that a step attends only to its sequence's own prefix and never writes a shared or cached block."""

    def __init__(self, sched: Scheduler):
        self.sched, self.slots = sched, {}

    def run(self, step) -> None:
        bm = self.sched.blocks
        for e in step.entries:
            s = e.seq
            tokens = tuple(s.prompt_ids + s.output_ids)
            for p in range(e.start):
                assert self.slots.get(bm.slot(s, p)) == tokens[: p + 1], f"position {p}: another prefix's KV"
            for p in range(e.start, e.start + e.num_tokens):
                b = s.block_table[p // bm.block_size]
                assert bm.refs[b] == 1 and b not in bm.key_of, f"block {b} is written while shared or cached"
                self.slots[bm.slot(s, p)] = tokens[: p + 1]


def fake_step(sched: Scheduler, step) -> None:
    """What the engine does after a step, with the model replaced by 'every sampled token is 7'."""
    sched.advance(step)
    for e in step.entries:
        if e.wants_logits:
            e.seq.output_ids.append(7)
            if len(e.seq.output_ids) >= e.seq.params.max_tokens:
                sched.finish(e.seq, "length")


def run_to_completion(cfg: SchedulerConfig, requests: list[tuple[list[int], int]],
                      arrivals: list[int], overlap: bool = False) -> list[Sequence]:
    """Requests (prompt, max_tokens) arrive at step `arrivals[i]`; every step 'generates' token 7. `overlap`: as
    the overlapped engine, each step is chained (Scheduler.chain) before its tokens are appended, where it can be."""
    sched = Scheduler(cfg)
    pool = FakePool(sched)
    seqs = [Sequence(list(p), SamplingParams(max_tokens=n)) for p, n in requests]
    pending = sorted(zip(arrivals, range(len(seqs))))
    step_no = 0
    chained = None
    while pending or sched.has_work:
        while pending and pending[0][0] <= step_no:
            sched.add(seqs[pending.pop(0)[1]])
        step, chained = (chained, None) if chained is not None else (sched.schedule(), None)
        if step is not None and overlap:
            chained = sched.chain(step)
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
            assert e.num_tokens >= 1 and e.start + e.num_tokens <= e.seq.num_tokens
        if step.kind == "prefill":     # packed sequences: whole blocks each, back to back in one context row
            spans = [-(-(e.start + e.num_tokens) // cfg.block_size) * cfg.block_size for e in step.entries]
            assert sum(spans) <= step.context
            # packing never raises the context bucket above a full chunk of the first sequence alone
            first_alone = max(spans[0], max(cfg.prefill_buckets))
            assert len(spans) == 1 or step.context <= min(c for c in cfg.context_buckets if c >= first_alone)
            assert len(step.entries) <= min(step.tokens, cfg.max_num_seqs)
            assert len({e.seq for e in step.entries}) == len(step.entries)
        pool.run(step)
        fake_step(sched, step)
        check_invariants(sched)
    return seqs


# A request: (shared prefix 0-2, its length, suffix length, suffix seed, max_tokens): prompts that share prefixes
# of any length, so the prefix cache hits whole blocks, partial ones and nothing.
requests = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(1, 50), st.integers(0, 3),
                              st.integers(1, 20)), min_size=1, max_size=12)
PREFIXES = [[(7 * i + 3 * j) % 11 + 1 for j in range(60)] for i in range(3)]


def prompt(prefix: int, n_prefix: int, n_suffix: int, seed: int) -> list[int]:
    return PREFIXES[prefix][:n_prefix] + [(seed * 5 + 3 * j) % 13 + 20 for j in range(n_suffix)]


@settings(max_examples=200, deadline=None)
@given(requests=requests, data=st.data(), num_blocks=st.integers(8, 40), prefill=st.booleans(),
       streak=st.integers(1, 5), caching=st.booleans(), overlap=st.booleans())
def test_every_request_finishes_without_leaks(requests, data, num_blocks, prefill, streak, caching, overlap):
    cfg = SchedulerConfig(decode_buckets=(1, 2, 4), prefill_buckets=(16, 32) if prefill else (),
                          context_buckets=(64, 128), context_limit=128, block_size=16, num_blocks=num_blocks,
                          max_prefill_streak=streak, prefix_caching=caching)
    reqs = [(prompt(*r[:4]), r[4]) for r in requests]
    reqs = [(p, min(n, 128 - len(p))) for p, n in reqs if len(p) < 128]
    arrivals = data.draw(st.lists(st.integers(0, 30), min_size=len(reqs), max_size=len(reqs)))
    seqs = run_to_completion(cfg, reqs, arrivals, overlap)
    for s, (p, n) in zip(seqs, reqs):
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
                              context_limit=64, block_size=16, num_blocks=64, max_prefill_streak=streak,
                              prefix_caching=False)
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


def test_chunk_size_follows_the_decoding_and_the_padding():
    """With several prefill buckets a long prompt takes the largest chunks while nothing else decodes, the smallest
    while a running sequence waits for its tokens, and a remainder goes in the chunks that pad least."""
    cfg = SchedulerConfig(decode_buckets=(1, 4), prefill_buckets=(16, 64), context_buckets=(64, 128),
                          context_limit=128, block_size=16, num_blocks=64, prefix_caching=False)

    def steps(prompt_len: int, decoding: bool) -> list[tuple[str, int, int]]:
        sched = Scheduler(cfg)
        if decoding:
            sched.add(Sequence([5] * 2, SamplingParams(max_tokens=100)))
            fake_step(sched, sched.schedule())
        seq = Sequence([3] * prompt_len, SamplingParams(max_tokens=1))
        sched.add(seq)
        out = []
        while seq.status is not Status.FINISHED:
            step = sched.schedule()
            if any(e.seq is seq for e in step.entries):
                out.append((step.kind, step.tokens, next(e.num_tokens for e in step.entries if e.seq is seq)))
            fake_step(sched, step)
        return out

    # 100 tokens alone: a 64-token chunk, then 36 as 16 + 16 (+ 4 in a decode step) rather than a padded 64
    assert steps(100, decoding=False) == [("prefill", 64, 64), ("prefill", 16, 16), ("prefill", 16, 16),
                                          ("decode", 4, 4)]
    # 60 tokens alone: one 64-token chunk (4 padded) rather than 16-token chunks
    assert steps(60, decoding=False) == [("prefill", 64, 60)]
    # 40 tokens alone: 16 + 16 (+ 8: another 16-token chunk), 48 tokens' worth against a 64-token chunk
    assert steps(40, decoding=False) == [("prefill", 16, 16), ("prefill", 16, 16), ("prefill", 16, 8)]
    # beside a decoding sequence: 16-token chunks throughout (its stall bounded by the smallest bucket)
    assert [s[1] for s in steps(100, decoding=True) if s[0] == "prefill"] == [16] * 6


def test_short_prompts_share_a_prefill_chunk():
    """Eight 12-token prompts (too long for a decode step) share chunks instead of taking a padded chunk each; a
    prompt cut at the chunk's end finishes later (here in a decode step: 4 tokens are left). The first chunk is
    the largest bucket; after it two prompts wait for their next token, so the rest go in the smallest."""
    cfg = SchedulerConfig(decode_buckets=(1, 2, 4, 8), prefill_buckets=(16, 32), context_buckets=(64, 128),
                          context_limit=128, block_size=16, num_blocks=64, prefix_caching=False)
    sched = Scheduler(cfg)
    seqs = [Sequence([3] * 12, SamplingParams(max_tokens=2)) for _ in range(8)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert step.kind == "prefill" and step.tokens == 32 and step.context == 64
    assert [(e.seq, e.start, e.num_tokens, e.wants_logits) for e in step.entries] == [
        (seqs[0], 0, 12, True), (seqs[1], 0, 12, True), (seqs[2], 0, 8, False)]
    fake_step(sched, step)
    chunks = [32]
    while sched.has_work:
        step = sched.schedule()
        if step.kind == "prefill":
            chunks.append(step.tokens)
            assert len(step.entries) >= 2 or step.num_real_tokens == 12
        fake_step(sched, step)
    assert chunks == [32, 16, 16, 16], chunks
    assert all(s.status is Status.FINISHED and len(s.output_ids) == 2 for s in seqs)


def test_a_burst_of_short_prompts_is_packed_into_prefill_chunks():
    """Prompts short enough for decode steps but more of them than one decode step holds go packed into prefill
    chunks: sixteen 8-token prompts (decode bucket 8 holds one) take two 64-token chunks, not sixteen steps; a
    few that fit the next decode step stay in it."""
    cfg = SchedulerConfig(decode_buckets=(1, 8), prefill_buckets=(32, 64), context_buckets=(64, 256),
                          context_limit=256, block_size=8, num_blocks=64, prefix_caching=False)
    sched = Scheduler(cfg)
    seqs = [Sequence([3 + i] * 8, SamplingParams(max_tokens=2)) for i in range(16)]
    for s in seqs:
        sched.add(s)
    kinds = []
    while any(not s.output_ids for s in seqs):
        step = sched.schedule()
        kinds.append((step.kind, step.tokens, len(step.entries)))
        fake_step(sched, step)
    # at most 8 sequences run at once (the largest decode bucket): 8 prompts a chunk, then their decode step,
    # which finishes them, then the other 8 (two 32-token chunks here would pad to the same 64)
    assert kinds == [("prefill", 64, 8), ("decode", 8, 8), ("prefill", 64, 8)], kinds

    sched = Scheduler(cfg)
    few = [Sequence([3] * 3, SamplingParams(max_tokens=2)) for _ in range(2)]
    for s in few:
        sched.add(s)
    step = sched.schedule()
    assert step.kind == "decode" and [e.num_tokens for e in step.entries] == [3, 3]


def _cfg(**kw) -> SchedulerConfig:
    base = dict(decode_buckets=(1, 2, 4), prefill_buckets=(16, 32), context_buckets=(64, 128), context_limit=128,
                block_size=16, num_blocks=12)
    return SchedulerConfig(**{**base, **kw})


def _drain(sched: Scheduler) -> list:
    steps = []
    while sched.has_work:
        step = sched.schedule()
        steps.append(step)
        fake_step(sched, step)
    return steps


def test_a_prompt_starts_after_its_cached_prefix():
    """A prompt that repeats an earlier one computes only what follows its cached full blocks (in a decode step
    when that is short), always its last token (its logits are wanted)."""
    sched = Scheduler(_cfg(decode_buckets=(1, 4, 32)))
    shared = list(range(1, 41))
    first = Sequence(shared + [90], SamplingParams(max_tokens=3))
    sched.add(first)
    step = sched.schedule()
    first_blocks = list(first.block_table[:2])
    fake_step(sched, step)
    _drain(sched)
    assert sched.blocks.num_cached == 2 and sched.blocks.num_free == 12        # 41 + 2 tokens computed: 2 full
    again = Sequence(shared + [91, 92], SamplingParams(max_tokens=2))
    exact = Sequence(list(range(1, 33)), SamplingParams(max_tokens=2))          # two full blocks, nothing after
    sched.add(again)
    sched.add(exact)
    step = sched.schedule()
    assert step.kind == "decode" and [(e.seq, e.start, e.num_tokens) for e in step.entries] == [
        (again, 32, 10), (exact, 16, 16)]     # exact's second block holds its last token: computed again
    assert again.block_table[:2] == first_blocks and exact.block_table[0] == first_blocks[0]
    assert sched.blocks.refs[first_blocks[0]] == 2
    assert (again.num_cached_tokens, exact.num_cached_tokens) == (32, 16)
    fake_step(sched, step)
    _drain(sched)
    assert sched.blocks.hits == 32 + 16 and sched.blocks.queries == (41 - 1) + (42 - 1) + (32 - 1)
    assert sched.blocks.num_free == 12


def test_cached_blocks_are_evicted_last_and_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=4, prefix_caching=True)
    a, b = Sequence(list(range(9)), SamplingParams()), Sequence(list(range(50, 59)), SamplingParams())
    for s in (a, b):
        bm.allocate(s, 9)               # 3 blocks each: 2 full, 1 partial
        s.num_computed = 9
        bm.register(s)
    a_full, b_full = a.block_table[:2], b.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and bm.num_cached == 4
    c = Sequence(list(range(100, 108)), SamplingParams())
    bm.allocate(c, 8)                   # the two never-registered blocks first
    assert bm.num_cached == 4 and not set(c.block_table) & set(a_full + b_full)
    probe = Sequence(list(range(9)), SamplingParams())
    assert bm.match(probe) == a_full
    d = Sequence(list(range(200, 208)), SamplingParams())
    bm.allocate(d, 8)                   # then a's (freed first), its last block first
    assert d.block_table == [a_full[1], a_full[0]] and bm.match(probe) == []     # the memoised match too
    assert bm.match(Sequence(list(range(50, 60)), SamplingParams())) == b_full
    assert bm.reset_cache() == 2 and bm.num_cached == 0 and bm.num_free == 2


def test_prefix_caching_off_never_shares():
    sched = Scheduler(_cfg(prefix_caching=False))
    for _ in range(2):
        sched.add(Sequence(list(range(1, 41)), SamplingParams(max_tokens=2)))
        steps = _drain(sched)
        assert steps[0].entries[0].start == 0
    assert sched.blocks.num_cached == 0 and sched.blocks.hits == 0


def test_siblings_wait_a_step_for_the_blocks_another_computes():
    """Four copies of a 20-token prompt (n choices) arriving together: without the cache two share the first chunk
    and all compute the whole prompt; with it the first computes the shared block while the others, instead of
    computing it again in that chunk, wait one step and start after it."""
    for caching in (True, False):
        sched = Scheduler(_cfg(decode_buckets=(1, 4, 16), prefill_buckets=(64,), prefix_caching=caching))
        seqs = [Sequence(list(range(1, 21)), SamplingParams(max_tokens=2)) for _ in range(4)]
        for s in seqs:
            sched.add(s)
        steps = _drain(sched)
        firsts: dict = {}
        for st in steps:
            for e in st.entries:
                firsts.setdefault(e.seq, e.start)
        prompt_tokens = sum(min(e.num_tokens, 20 - e.start) for st in steps for e in st.entries if e.start < 20)
        if caching:
            assert [firsts[s] for s in seqs] == [0, 16, 16, 16] and prompt_tokens == 20 + 3 * 4
        else:
            assert [firsts[s] for s in seqs] == [0, 0, 0, 0] and prompt_tokens == 4 * 20
            assert len(steps[0].entries) == 2          # packed: each computes its own
        assert all(s.status is Status.FINISHED for s in seqs)


def test_a_sibling_waiting_for_shared_blocks_keeps_its_place():
    """First come, first served holds with in-batch sharing: a prompt that arrived after a sibling waiting for the
    blocks another computes does not start in the step the sibling waits (it could take the slot the sibling needs),
    in decode steps (here every prompt runs as decode) and in packed prefill chunks alike."""
    for kw in (dict(decode_buckets=(1, 4, 64), prefill_buckets=()), dict(decode_buckets=(1, 4, 16),
                                                                        prefill_buckets=(64,))):
        sched = Scheduler(_cfg(prefix_caching=True, **kw))
        a, b = (Sequence(list(range(1, 21)), SamplingParams(max_tokens=2)) for _ in range(2))
        late = Sequence(list(range(100, 120)), SamplingParams(max_tokens=2))
        for s in (a, b, late):
            sched.add(s)
        steps = _drain(sched)
        first_step = {}
        for i, st in enumerate(steps):
            for e in st.entries:
                first_step.setdefault(e.seq, i)
        assert first_step[a] == 0 and first_step[b] >= 1 and first_step[late] >= 1, (kw, first_step)
        if not kw["prefill_buckets"]:
            assert steps[1].entries[-1].seq is late        # in arrival order behind the sibling
        assert all(s.status is Status.FINISHED for s in (a, b, late))


@st.composite
def steps_to_build(draw):
    """A step of either kind over sequences with random tokens, block tables and entries (any span of a sequence's
    tokens, its drafts included): prefill entries of any length packed back to back, decode entries of a token or a prompt's few (prompt-as-decode), some fed from the
    step before, some wanting every row's logits, some verifying drafts."""
    from deepinfer.runtime.scheduler import ScheduledStep, StepEntry
    kind = draw(st.sampled_from(["prefill", "decode"]))
    bs, entries, T, blocks = 4, [], 0, iter(draw(st.permutations(range(200))))
    for _ in range(draw(st.integers(1, 5))):
        prompt = draw(st.lists(st.integers(0, 99), min_size=1, max_size=40))
        out = draw(st.lists(st.integers(0, 99), max_size=10))
        seq = Sequence(prompt, SamplingParams())
        seq.output_ids = out
        total = len(prompt) + len(out)
        drafts = draw(st.lists(st.integers(0, 99), max_size=4)) if kind == "decode" else []
        seq.draft_ids = drafts
        seq.block_table = [next(blocks) for _ in range(-(-(total + len(drafts)) // bs))]
        start = draw(st.integers(0, total - 1))
        n = draw(st.integers(1, total - start + len(drafts)))
        fed = draw(st.sampled_from([-1, 0, 3])) if kind == "decode" and n == 1 else -1
        entries.append(StepEntry(seq, start, n, True, all_logits=draw(st.booleans()) and not drafts,
                                 num_draft=len(drafts), fed=fed))
        T += n
    context = bs * max(len(e.seq.block_table) for e in entries) * (len(entries) if kind == "prefill" else 1)
    return ScheduledStep(kind, T, context, tuple(entries))


@given(steps_to_build())
@settings(max_examples=200, deadline=None)
def test_step_inputs_are_the_same_built_in_slices_or_a_token_at_a_time(step):
    """build_inputs fills long entries with numpy slices and short ones token by token: both give one result."""
    import numpy as np

    from deepinfer.common.manifest import CompileConfig
    from deepinfer.runtime import model_runner
    cc = CompileConfig(backend="cpu", dtype="float32", cp=1, ep=1, decode_buckets=(1, 8), prefill_buckets=(64,),
                       context_buckets=(step.context,), context_limit=step.context, block_size=4, num_kv_blocks=256,
                       moe_capacity=(64,), capacity_factor=None)
    sliced = model_runner.build_inputs(step, cc)
    saved = model_runner.VECTOR_MIN_TOKENS
    model_runner.VECTOR_MIN_TOKENS = 1 << 30
    try:
        looped = model_runner.build_inputs(step, cc)
    finally:
        model_runner.VECTOR_MIN_TOKENS = saved
    for name in ("token_ids", "positions", "slot_mapping", "block_tables", "logit_indices", "context_starts",
                 "fed_rows", "fed_from"):
        a, b = getattr(sliced, name), getattr(looped, name)
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), name
    assert sliced.num_logits == looped.num_logits
