"""Continuous batching over compiled buckets: decode tokens and short prompts share a prompt-as-decode
step; long prompts go in prefill chunks, several to a chunk when they fit; every step is padded to a bucket
the artifact holds."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

from ..common.errors import CapacityError
from .block_manager import BlockManager, blocks_for
from .sequence import Sequence, Status
from .speculative import NgramProposer


@dataclass(frozen=True)
class SchedulerConfig:
    decode_buckets: tuple[int, ...]
    prefill_buckets: tuple[int, ...]
    context_buckets: tuple[int, ...]
    context_limit: int
    block_size: int
    num_blocks: int
    max_waiting: int = 1024
    # Prefill chunks run first (they admit new requests: better throughput and TTFT), but at most this many in
    # a row while decode-ready sequences wait: it bounds the stall a burst of long prompts adds to their TPOT.
    max_prefill_streak: int = 4
    # New sequences start after the longest prefix of full KV blocks some earlier sequence left in the pool.
    prefix_caching: bool = True
    # Speculative decoding with n-gram drafts (runtime/speculative.py): up to this many draft tokens a decoding
    # sequence, in decode steps' spare tokens (after every running sequence and every admitted prompt); 0 = off.
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self):
        if self.max_prefill_streak < 1:
            raise ValueError(f"max_prefill_streak={self.max_prefill_streak} must be at least 1")

    @property
    def max_num_seqs(self) -> int:
        """Running sequences at once: all of them must fit one decode step."""
        return max(self.decode_buckets)

    @property
    def prompt_as_decode_limit(self) -> int:
        """Prompts with at most this many tokens left run in decode steps (all of them, without prefill graphs)."""
        return max(self.decode_buckets) if self.prefill_buckets else self.context_limit


@dataclass(slots=True)
class StepEntry:
    # not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__ (~1 us an entry
    # against ~0.2, every sequence every step); nothing changes an entry once the scheduler made it
    seq: Sequence
    start: int           # first position computed in this step
    num_tokens: int
    wants_logits: bool   # this step reaches the sequence's last known token: sample the next one
    all_logits: bool = False   # logits of every position (prompt logprobs), the last one's sampled if wanted
    num_draft: int = 0   # speculative tokens after the last known one (seq.draft_ids), verified after the step
    fed: int = -1        # a chained step (Scheduler.chain): the row of the step before's sampled tokens that
    # holds this entry's one token, which the host does not know yet (-1: the host has it)

    @property
    def every_row(self) -> bool:
        """Logits at every position: prompt logprobs, or a draft to verify."""
        return self.all_logits or self.num_draft > 0

    @staticmethod
    def of(seq: Sequence, num_tokens: int) -> "StepEntry":
        """The sequence's next `num_tokens` tokens."""
        start = seq.num_computed
        return StepEntry(seq, start, num_tokens, start + num_tokens == seq.num_tokens,
                         seq.wants_prompt_logprobs and start < len(seq.prompt_ids) - 1)


@dataclass(frozen=True)
class ScheduledStep:
    kind: str            # decode | prefill
    tokens: int          # the bucket T
    context: int         # the context bucket C
    entries: tuple[StepEntry, ...]

    @property
    def num_real_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


EXPLORE_GAP, MAX_EXPLORE_GAP = 16, 512     # tokens between a sequence's drafts tried as if certain (_add_drafts)
STALE_COST_STEPS = 2000                    # decode steps after which a shape's measured cost is measured again


def smallest_at_least(buckets: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefill_streak = 0      # consecutive prefill chunks while decode-ready sequences waited
        self._packing_burst = False   # this step's prefill chunk packs a burst of short prompts: see _burst()
        self._step_cost: dict[tuple[int, int], float] = {}     # decode seconds per (T, C): see observe()
        self._shapes_seen: set[tuple[int, int]] = set()
        self._cost_at: dict[tuple[int, int], int] = {}       # the decode step that last measured a shape
        self._decode_steps = 0
        self.draft_hits = self.draft_trials = 0                 # every sequence's drafts: see record_draft()
        self.proposer = NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) \
            if cfg.num_speculative_tokens else None

    # -- requests ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.cfg.max_waiting:
            raise CapacityError(f"the waiting queue is full ({self.cfg.max_waiting} requests); retry later")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.abort(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        prefill = self._prefill_candidate()
        decode_ready = any(s.num_uncomputed <= self.cfg.prompt_as_decode_limit for s in self.running) or any(
            self._pending(s) <= self.cfg.prompt_as_decode_limit for s in self.waiting)
        if prefill is not None and (self._prefill_streak < self.cfg.max_prefill_streak or not decode_ready):
            step = self._schedule_prefill(prefill)
            if step is not None:
                self._prefill_streak = self._prefill_streak + 1 if decode_ready else 0
                return step
        step = self._schedule_decode()
        if step is None and prefill is not None:
            step = self._schedule_prefill(prefill)
        if step is not None and step.kind == "decode":
            self._prefill_streak = 0
        return step

    def _prefill_candidate(self) -> Sequence | None:
        self._packing_burst = False
        if not self.cfg.prefill_buckets:
            return None
        for s in self.running:
            if s.num_uncomputed > self.cfg.prompt_as_decode_limit:
                return s
        for s in self.waiting:
            if self._pending(s) > self.cfg.prompt_as_decode_limit:
                return s if len(self.running) < self.cfg.max_num_seqs else None
        return self._burst()

    def _burst(self) -> Sequence | None:
        """The first waiting prompt when the short prompts that could start now hold more tokens than the next
        decode step has room for: then they go packed into prefill chunks rather than a decode step's worth at a
        time. A burst of 32 prompts of 32 tokens took 32 decode steps for their first tokens (the largest decode
        bucket, 32 tokens, holds one such prompt), where two packed 512-token chunks hold them all."""
        if not self.waiting:
            return None
        limit = self.cfg.prompt_as_decode_limit
        room = max(self.cfg.decode_buckets) - sum(min(s.num_uncomputed, limit) for s in self.running
                                                  if s.num_uncomputed <= limit)
        slots = self.cfg.max_num_seqs - len(self.running)
        short = list(itertools.islice(self.waiting, max(slots, 0)))
        if not short or sum(self._pending(s) for s in short) <= room:
            return None
        self._packing_burst = True
        return short[0]

    def _pending(self, seq: Sequence) -> int:
        """Tokens a sequence has left to compute; a waiting one would start after its cached prefix."""
        if seq.block_table or not self.cfg.prefix_caching or seq.wants_prompt_logprobs:
            return seq.num_uncomputed
        return seq.num_tokens - len(self.blocks.match(seq)) * self.cfg.block_size

    def _claim(self, seq: Sequence) -> None:
        """A waiting sequence about to be admitted takes its cached prefix (undone by _unclaim if it is not)."""
        if seq.status is Status.WAITING and not seq.block_table and not seq.wants_prompt_logprobs:
            self.blocks.take(seq, self.blocks.match(seq))

    def _completes(self, e: StepEntry) -> set[bytes]:
        """Prefix-cache keys of the full blocks this entry's step fills (registered after the step)."""
        bs = self.cfg.block_size
        full = (e.start + e.num_tokens) // bs
        if not self.cfg.prefix_caching or full <= e.seq.num_registered:
            return set()
        return {e.seq.block_key(bs, i) for i in range(e.seq.num_registered, full)}

    def _shares_work(self, seq: Sequence, computing: set[bytes]) -> bool:
        """A waiting sequence whose next uncached block is one this step fills for another (the n choices of a
        prompt, a burst sharing a system prompt) waits one step and then takes it from the cache instead of
        computing it again (SGLang's in-batch prefix sharing)."""
        if not computing or seq.block_table or seq.wants_prompt_logprobs:
            return False
        m = len(self.blocks.match(seq))
        return m < (seq.num_tokens - 1) // self.cfg.block_size and seq.block_key(self.cfg.block_size, m) in computing

    def _unclaim(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING and seq.block_table:
            self.blocks.free(seq)
            seq.num_computed = 0

    def _schedule_prefill(self, seq: Sequence) -> ScheduledStep | None:
        """A chunk of `seq`, then as many other prompts as fit the chunk's spare tokens (packed back to back;
        never preempting for them) without a larger context bucket than a full chunk of `seq` alone would take:
        attention cost follows the bucket, so packing never makes the chunk's attention dearer."""
        self._claim(seq)
        budget = self._chunk_bucket(seq)
        n = min(seq.num_uncomputed, budget)
        need = self.blocks.blocks_needed(seq, n)
        preempted = False
        if not self.blocks.can_allocate(need):
            if seq.status is Status.WAITING or not self._preempt_for(need, seq, keep={seq}):
                self._unclaim(seq)
                return None
            preempted = True      # the preempted are waiting again: not packed into the chunk that displaced them
        self._admit(seq)
        self.blocks.allocate(seq, n)
        entries = [StepEntry.of(seq, n)]
        computing = self._completes(entries[0])
        used, span = n, self._span(seq.num_computed + n)
        room = self._context_bucket(max(span, budget))
        for other in ([] if preempted else self._prefill_queue(seq)):
            if used >= budget or (other.status is Status.WAITING and len(self.running) >= self.cfg.max_num_seqs):
                break
            if self._shares_work(other, computing):
                break           # first come, first served: nobody behind it starts before it does
            self._claim(other)
            k = min(other.num_uncomputed, budget - used)
            more = self._span(other.num_computed + k)
            if span + more > room or not self.blocks.can_allocate(self.blocks.blocks_needed(other, k)):
                self._unclaim(other)
                break
            self._admit(other)
            self.blocks.allocate(other, k)
            entries.append(StepEntry.of(other, k))
            computing |= self._completes(entries[-1])
            used += k
            span += more
        bucket = smallest_at_least(self.cfg.prefill_buckets, used)
        # prefill graphs exist for context buckets of at least their token bucket
        return ScheduledStep("prefill", bucket, self._context_bucket(max(span, bucket)), tuple(entries))

    def _chunk_bucket(self, seq: Sequence) -> int:
        """The prefill bucket this chunk fills (with `seq` first, then whatever packs behind it).

        With several prefill buckets: the smallest while running sequences wait for their next token (it bounds
        their stall, as --max-prefill-streak bounds the chunks in a row), the largest otherwise (the fastest
        prefill of a long prompt: larger GEMMs, and the context's latents expanded for attention once a chunk,
        not once a small chunk). Where the prompts pending hold fewer tokens than that, the first chunk of the
        plan that pads least: `mid` model on 2 CPU threads with 256- and 1024-token buckets, a 512-token prompt
        runs as two 256-token chunks (1030 tok/s) rather than a 1024-token one half padding (769)."""
        buckets = self.cfg.prefill_buckets
        limit = self.cfg.prompt_as_decode_limit
        if len(buckets) == 1 or any(s.num_uncomputed <= limit for s in self.running if s is not seq):
            return buckets[0]
        top = buckets[-1]
        want = seq.num_uncomputed
        for other in self._prefill_queue(seq):
            if want >= top:
                break
            want += self._pending(other)
        if want >= top:
            return top
        # Plans: whole chunks of one bucket, then the smallest bucket that holds the rest; or one chunk that holds
        # it all. The fewest padded tokens wins, then the larger first chunk (fewer, larger steps).
        one = smallest_at_least(buckets, want)
        best, first = one, one
        for b in buckets:
            if b >= want:
                break
            rest = want % b
            padded = want - rest + (smallest_at_least(buckets, rest) if rest else 0)
            if padded < best or (padded == best and b > first):
                best, first = padded, b
        return first

    def _prefill_queue(self, first: Sequence):
        """Prompts, other than `first`, too long for a decode step (in a burst of short prompts, every waiting
        one): running ones, then waiting ones in order (lazily: packing usually stops after a few)."""
        limit = self.cfg.prompt_as_decode_limit
        return (s for s in (*self.running, *self.waiting) if s is not first and (
            self._pending(s) > limit or (self._packing_burst and s.status is Status.WAITING)))

    def _span(self, tokens: int) -> int:
        """Context slots a sequence of `tokens` takes in a packed prefill row: whole blocks."""
        return blocks_for(tokens, self.cfg.block_size) * self.cfg.block_size

    def _schedule_decode(self) -> ScheduledStep | None:
        budget = max(self.cfg.decode_buckets)
        limit = self.cfg.prompt_as_decode_limit
        entries: list[StepEntry] = []
        chosen: set[Sequence] = set()
        computing: set[bytes] = set()
        used = 0
        for seq in list(self.running):
            # preempted by a sequence before it in this loop: waiting again (not `in self.running`: O(n) each)
            if seq.status is not Status.RUNNING or seq.num_uncomputed > limit or used >= budget:
                continue
            n = min(seq.num_uncomputed, budget - used)
            need = self.blocks.blocks_needed(seq, n)
            if not self.blocks.can_allocate(need) and not self._preempt_for(need, seq, keep=chosen | {seq}):
                self._preempt(seq)
                continue
            self.blocks.allocate(seq, n)
            entries.append(StepEntry.of(seq, n))
            computing |= self._completes(entries[-1])
            chosen.add(seq)
            used += n
        for seq in list(self.waiting):
            if used >= budget or len(self.running) >= self.cfg.max_num_seqs:
                break
            if self._pending(seq) > limit:
                continue
            if self._shares_work(seq, computing):
                break           # first come, first served: nobody behind it starts before it does
            self._claim(seq)
            n = min(seq.num_uncomputed, budget - used)
            if not self.blocks.can_allocate(self.blocks.blocks_needed(seq, n)):
                self._unclaim(seq)
                break
            self._admit(seq)
            self.blocks.allocate(seq, n)
            entries.append(StepEntry.of(seq, n))
            computing |= self._completes(entries[-1])
            chosen.add(seq)
            used += n
        if not entries:
            return None
        if self.proposer is not None and used < budget:
            used += self._add_drafts(entries, used)
        ctx = self._context_bucket(max(e.start + e.num_tokens for e in entries))
        return ScheduledStep("decode", smallest_at_least(self.cfg.decode_buckets, used), ctx, tuple(entries))

    def _add_drafts(self, entries: list[StepEntry], used: int) -> int:
        """Give decoding sequences n-gram drafts in the step's spare tokens; returns the tokens added.

        Drafts in the rows the bucket pads anyway cost next to nothing; a larger bucket costs what its steps were
        measured to take, so it is taken only when the drafts' expected accepted tokens repay it: the plan with
        the most expected tokens per second wins, no drafts included. A sequence's chance of acceptance is its
        own record, starting from everyone's; now and then (EXPLORE_GAP tokens apart, twice as far after each
        miss, up to MAX_EXPLORE_GAP) a draft is tried as if certain, so a sequence that starts repeating itself
        is noticed. Not for sequences whose logits are processed (penalties, grammars, min_tokens: each token's
        processing depends on the ones before), nor beyond max_tokens or the context limit; never preempting for
        a draft."""
        buckets, limit = self.cfg.decode_buckets, self.cfg.context_limit
        room_max = max(buckets) - used
        prior = (self.draft_hits + 1) / (self.draft_trials + 2)
        cands = []          # (entry index, most draft tokens, chance each is accepted)
        for j, e in enumerate(entries):
            seq = e.seq
            if e.num_tokens != 1 or not e.wants_logits or e.start < len(seq.prompt_ids) or seq.processes_logits:
                continue
            k = min(room_max, self.proposer.k, seq.params.max_tokens - len(seq.output_ids) - 1,
                    limit - seq.num_tokens)
            if k > 0:
                p = 1.0 if len(seq.output_ids) >= seq.draft_explore_at else \
                    (seq.draft_hits + 2 * prior) / (seq.draft_trials + 2)
                cands.append((j, k, p))
        if not cands:
            return 0
        sampled = sum(e.wants_logits for e in entries)       # tokens the step outputs without drafts
        need = max(e.start + e.num_tokens for e in entries)
        base = smallest_at_least(buckets, used)
        base_rate = sampled / self.step_cost(base, self._context_bucket(need))

        def best_plan(lengths: dict[int, int]):
            best_rate, best = base_rate, None
            for T in (t for t in buckets if t >= base):
                room, plan, gain, ctx = T - used, [], 0.0, need
                for j, _, p in cands:
                    n = min(lengths.get(j, 0), room)
                    if n <= 0:
                        continue
                    plan.append((j, n))
                    room -= n
                    gain += sum(p ** i for i in range(1, n + 1))
                    ctx = max(ctx, entries[j].start + 1 + n)
                rate = (sampled + gain) / self.step_cost(T, self._context_bucket(ctx))
                if rate > best_rate:
                    best_rate, best = rate, plan
            return best
        # drafts cost a lookup each: only where full-length drafts could pay at all
        if best_plan({j: k for j, k, _ in cands}) is None:
            return 0
        drafts = {}
        for j, k, _ in cands:
            d = self.proposer.propose_for(entries[j].seq, k)
            if d:
                drafts[j] = d
        added = 0
        taken = 0           # blocks the drafts took so far
        for j, n in best_plan({j: len(d) for j, d in drafts.items()}) or ():
            e = entries[j]
            seq, draft = e.seq, drafts[j][:n]
            while draft and not self._can_draft(self.blocks.blocks_needed(seq, 1 + len(draft)), taken):
                draft = draft[:-1]
            if not draft:
                continue
            taken += self.blocks.blocks_needed(seq, 1 + len(draft))
            self.blocks.allocate(seq, 1 + len(draft))
            seq.draft_ids = draft
            seq.draft_exploring = len(seq.output_ids) >= seq.draft_explore_at
            entries[j] = StepEntry(seq, e.start, 1 + len(draft), True, False, len(draft))
            added += len(draft)
        return added

    def _can_draft(self, blocks: int, taken: int) -> bool:
        """Drafts take never-cached free blocks only (a draft that may be rejected evicts no cached prefix) and
        leave one for each running sequence (which may need a new block next step: no preemption for drafts)."""
        return blocks + taken + len(self.running) <= len(self.blocks.free_blocks) or blocks == 0

    def record_draft(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens, `accepted` of them kept."""
        verified = accepted + (accepted < drafted)          # tried up to the first rejection
        seq.draft_hits += accepted
        seq.draft_trials += verified
        if seq.draft_exploring:         # a try as if certain: back off unless it all held
            seq.draft_exploring = False
            full = accepted == drafted
            seq.draft_explore_gap = EXPLORE_GAP if full else min(2 * seq.draft_explore_gap, MAX_EXPLORE_GAP)
            seq.draft_explore_at = len(seq.output_ids) + seq.draft_explore_gap
        self.draft_hits += accepted
        self.draft_trials += verified

    def observe(self, step: ScheduledStep, seconds: float) -> None:
        """A decode step's wall time, averaged per (token bucket, context bucket): what drafts weigh. A shape's
        first step is left out (it may carry a GPU's compile-at-first-use or graph capture)."""
        if step.kind != "decode":
            return
        key = (step.tokens, step.context)
        self._decode_steps += 1
        old = self._step_cost.get(key)
        if old is not None and self._decode_steps - self._cost_at[key] > STALE_COST_STEPS:
            old = None                  # stale: measured afresh
        self._cost_at[key] = self._decode_steps
        if key not in self._shapes_seen:
            self._shapes_seen.add(key)
        else:
            self._step_cost[key] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def step_cost(self, tokens: int, context: int) -> float:
        """A decode step's measured seconds. One never measured, or not for STALE_COST_STEPS decode steps, is
        taken as dear as the dearest freshly measured shape it contains (optimistic: it is tried and measured
        again; a cost inflated by a stall would otherwise keep its bucket out for good), or 1 when nothing is."""
        key = (tokens, context)
        cost = self._step_cost.get(key)
        if cost is not None and self._decode_steps - self._cost_at[key] <= STALE_COST_STEPS:
            return max(cost, 1e-9)
        below = [c for (t, ctx), c in self._step_cost.items() if t <= tokens and ctx <= context and (t, ctx) != key
                 and self._decode_steps - self._cost_at[(t, ctx)] <= STALE_COST_STEPS]
        return max(max(below) if below else min(self._step_cost.values(), default=1.0), 1e-9)

    def _context_bucket(self, n: int) -> int:
        c = smallest_at_least(self.cfg.context_buckets, n)
        assert c is not None, f"{n} tokens exceed the context limit {self.cfg.context_limit}"
        return c

    def _admit(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING:
            self.blocks.queries += seq.num_tokens - 1       # the last token is always computed
            self.blocks.hits += seq.num_computed
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _preempt_for(self, need: int, requester: Sequence, keep: set[Sequence]) -> bool:
        """Free blocks by preempting running sequences newer than `requester` (they are recomputed later),
        newest first. The oldest running sequence can therefore always make progress."""
        while not self.blocks.can_allocate(need):
            victims = [s for s in self.running if s not in keep and s.seq_id > requester.seq_id]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda s: s.seq_id))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def chain(self, step: ScheduledStep) -> ScheduledStep | None:
        """The decode step after `step` that runs its sequences once more each, built before `step`'s tokens are
        known (overlapped scheduling: Engine); None where the step after may have to differ from it. Each entry's
        one token is the token `step` samples for it (StepEntry.fed), at the position after `step`'s last.

        Only while nothing waits to start, every running sequence is in `step` and wants its next token, no
        sequence processes logits (penalties, grammars, min_tokens: they depend on the token not known yet) or
        asks for logprobs, none finishes by length at its pending token, and the blocks fit without preempting
        anyone. A sequence that stops at its pending token (EOS, a stop string) or is aborted still runs in the
        chained step; its row is then dropped (the KV it writes lies in its own blocks, before any later step
        that could take them over runs on the same stream)."""
        if (step.kind != "decode" or self.waiting or self.proposer is not None
                or len(step.entries) != len(self.running)):
            return None
        limit = self.cfg.context_limit
        need = 0
        for e in step.entries:
            seq, p = e.seq, e.seq.params
            if (not e.wants_logits or e.every_row or seq.status is not Status.RUNNING or p.logprobs is not None
                    or p.processes_logits or seq.constraint is not None
                    or len(seq.output_ids) + 1 < p.min_tokens or len(seq.output_ids) + 1 >= p.max_tokens
                    or seq.num_tokens + 1 >= limit):
                return None
            # its KV so far is e.start; this step's tokens, then the pending one
            need += self.blocks.blocks_needed(seq, e.num_tokens + 1)
        if not self.blocks.can_allocate(need):
            return None
        entries = []
        for j, e in enumerate(step.entries):
            self.blocks.allocate(e.seq, e.num_tokens + 1)
            entries.append(StepEntry(e.seq, e.start + e.num_tokens, 1, True, fed=j))
        ctx = self._context_bucket(max(x.start + 1 for x in entries))
        return ScheduledStep("decode", smallest_at_least(self.cfg.decode_buckets, len(entries)), ctx, tuple(entries))

    # -- after the step ---------------------------------------------------------------------------
    def advance(self, step: ScheduledStep) -> None:
        for e in step.entries:
            # a draft's KV counts once verified (Engine._postprocess): its rejected tokens' slots are rewritten
            e.seq.num_computed = e.start + e.num_tokens - e.num_draft
            self.blocks.register(e.seq)
