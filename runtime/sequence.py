"""A request's state as it moves through the engine: tokens, KV blocks, sampling parameters."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch


# As vLLM: temperatures this small are greedy (dividing logits by them overflows to inf).
GREEDY_BELOW = 1e-5

@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token after the first (echo + logprobs)
    # Logits processing, as OpenAI and vLLM define it (applied in this order, before temperature and top-k/p;
    # greedy takes the argmax after it; logprobs stay the model's own, as vLLM's default reports them):
    min_tokens: int = 0               # EOS and stop_token_ids are masked, stop strings ignored, before this many
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token id, added to its logit)
    repetition_penalty: float = 1.0   # tokens of the prompt or output: logit / p if > 0 else logit * p
    presence_penalty: float = 0.0     # minus this for every token the output holds
    frequency_penalty: float = 0.0    # minus this times the token's count in the output
    stop_token_ids: tuple[int, ...] = ()   # generating one of these finishes the sequence ("stop")
    structure: str | None = None      # an llguidance grammar the output must match (runtime/structured.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def processes_logits(self) -> bool:
        """Whether logits processing other than min_tokens applies."""
        return bool(self.logit_bias or self.repetition_penalty != 1.0 or self.presence_penalty or
                    self.frequency_penalty)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0             # tokens whose KV is in the pool
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    _text: str = field(default="", repr=False)     # output_text once the detokenizer is done
    detokenizer: object | None = field(default=None, repr=False)   # tokenizer.IncrementalDetokenizer while it runs
    num_preemptions: int = 0
    prompt_token_logprobs: list[float] = field(default_factory=list)       # of prompt tokens 1, 2, ...
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    stop_from: int = 0                # stop strings are searched from this offset of output_text (min_tokens)
    num_registered: int = 0           # leading blocks of block_table registered in the prefix cache
    num_cached_tokens: int = 0        # prompt tokens whose KV came from the prefix cache at the last admission
    _keys: list = field(default_factory=list, repr=False)   # prefix-cache keys of the leading full blocks
    cache_match: tuple | None = field(default=None, repr=False)   # BlockManager.match's memo
    constraint: object | None = field(default=None, repr=False)   # structured.Constraint of params.structure
    failure: str | None = None        # why it ended in failure (its grammar broke): an error, not its text
    draft_ids: list[int] = field(default_factory=list)   # speculative tokens after the last one, for one step
    draft_hits: int = 0               # draft tokens accepted, and draft tokens verified up to each first rejection
    draft_trials: int = 0
    draft_explore_at: int = 16        # output length at which a draft is next tried whatever the record says
    draft_explore_gap: int = 16
    draft_exploring: bool = False     # its current draft is such a try
    ngrams: object | None = field(default=None, repr=False)       # speculative.NgramIndex of its tokens
    _stats: "TokenStats | None" = field(default=None, repr=False)

    def __post_init__(self):
        if not self.params.greedy:
            self.generator = torch.Generator()
            seed = self.params.seed if self.params.seed is not None else torch.seed()
            self.generator.manual_seed(seed)

    @property
    def output_text(self) -> str:
        """The text of its output tokens (stop strings cut): its detokenizer's while it runs, which keeps the text as
        pieces (joined here, so read it at the end, or use the detokenizer's `text_from` for a tail)."""
        return self.detokenizer.text if self.detokenizer is not None else self._text

    @output_text.setter
    def output_text(self, text: str) -> None:
        """The final text: the detokenizer is let go."""
        self._text, self.detokenizer = text, None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def block_key(self, block_size: int, i: int) -> bytes:
        """The prefix-cache key of full block i ((i + 1) * block_size <= num_tokens): a hash of every token up to
        the block's end, chained block by block and computed once each (a sequence's tokens only ever grow)."""
        from .block_manager import ROOT, chain_hash
        keys = self._keys
        while len(keys) <= i:
            j = len(keys)
            lo, hi, n = j * block_size, (j + 1) * block_size, len(self.prompt_ids)
            toks = self.prompt_ids[lo:hi] if hi <= n else self.prompt_ids[lo:n] + self.output_ids[max(0, lo - n):hi - n]
            assert len(toks) == block_size, "block_key() of a block that is not full"
            keys.append(chain_hash(keys[-1] if keys else ROOT, toks))
        return keys[i]

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        if pos < n:
            return self.prompt_ids[pos]
        m = len(self.output_ids)
        return self.output_ids[pos - n] if pos - n < m else self.draft_ids[pos - n - m]

    def tokens(self, start: int, end: int) -> list[int]:
        """Its tokens at positions [start, end): `token_at` of each, in one piece."""
        n, m = len(self.prompt_ids), len(self.output_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        out = self.prompt_ids[start:n] if start < n else []
        out = out + self.output_ids[max(start - n, 0): end - n]
        if end > n + m:
            out = out + self.draft_ids[max(start - n - m, 0): end - n - m]
        return out

    def token_stats(self) -> "TokenStats":
        """Its distinct tokens for the penalties (sampler.process_logits), up to date with its output."""
        if self._stats is None:
            self._stats = TokenStats(self.prompt_ids)
        self._stats.fold(self.output_ids)
        return self._stats

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all collected (a preempted sequence does not collect them twice)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_token_logprobs) < len(self.prompt_ids) - 1

    @property
    def processes_logits(self) -> bool:
        """Whether its next token's logits are processed (min_tokens only while the output is shorter)."""
        return (self.params.processes_logits or len(self.output_ids) < self.params.min_tokens or
                self.constraint is not None)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


class TokenStats:
    """A sequence's distinct tokens, prompt and output (`seen`: the repetition penalty), and its distinct output
    tokens with their counts (`outputs`, `counts`: presence and frequency), as int64 arrays that a step's rows
    concatenate without a Python loop over tokens. Output tokens are folded in as they come, a step's one or few at
    a time, into arrays that grow by doubling: nothing a step costs grows with the prompt or the output."""

    def __init__(self, prompt_ids: list[int]):
        self._seen_set = set(prompt_ids)
        self._seen = _Growing(sorted(self._seen_set))
        self._slot: dict[int, int] = {}           # output token -> its place in outputs / counts
        self._outputs = _Growing()
        self._counts = _Growing()
        self._folded = 0                          # output tokens counted so far

    def fold(self, output_ids: list[int]) -> None:
        for t in output_ids[self._folded:]:
            if t not in self._seen_set:
                self._seen_set.add(t)
                self._seen.append(t)
            j = self._slot.get(t)
            if j is None:
                self._slot[t] = self._outputs.n
                self._outputs.append(t)
                self._counts.append(1)
            else:
                self._counts.buf[j] += 1
        self._folded = len(output_ids)

    @property
    def seen(self) -> np.ndarray:
        return self._seen.view()

    @property
    def outputs(self) -> np.ndarray:
        return self._outputs.view()

    @property
    def counts(self) -> np.ndarray:
        return self._counts.view()


class _Growing:
    """An int64 array appended to at its end, its buffer doubled when full."""

    def __init__(self, values=()):
        self.buf = np.zeros(max(16, 2 * len(values)), np.int64)
        self.buf[:len(values)] = values
        self.n = len(values)

    def append(self, v: int) -> None:
        if self.n == len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros_like(self.buf)])
        self.buf[self.n] = v
        self.n += 1

    def view(self) -> np.ndarray:
        return self.buf[:self.n]
