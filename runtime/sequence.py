"""A request's state as it moves through the engine: tokens, KV blocks, sampling parameters."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
    output_text: str = ""
    num_preemptions: int = 0

    def __post_init__(self):
        if not self.params.greedy:
            self.generator = torch.Generator()
            seed = self.params.seed if self.params.seed is not None else torch.seed()
            self.generator.manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
