"""Speculative decoding with n-gram drafts (prompt lookup, vLLM's `ngram` method): no draft model.

A decoding sequence's last n tokens (n from `max_n` down to `min_n`) are looked up earlier in its own prompt and
output; the tokens that followed the latest match are the draft. The draft rides in the sequence's next decode
step (the prompt-as-decode graphs already run several tokens of one sequence in a step), the step's logits at
every draft position verify it, and the accepted tokens plus one more (the correction, or the bonus token after a
fully accepted draft) are output: up to k + 1 tokens for one pass over the weights. Verification keeps the
output distribution exactly the model's: greedy accepts a draft token while it is the argmax; sampling accepts
draft token d with probability p(d) and otherwise samples from p with d removed (a draft that proposes one token
with certainty is the deterministic case of speculative sampling, Leviathan et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import _argmax, _sample_row
from .sequence import Sequence


INDEX_PER_CALL = 4096      # context positions NgramIndex.extend enters per call at most (see there)


class NgramIndex:
    """A sequence's n-grams (n in [min_n, max_n]) -> where the tokens after their latest occurrence start, grown
    as the sequence grows: a lookup costs a few dict probes, not a scan of the context."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.indexed = 1           # n-grams ending before this position are entered
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new: list[int], budget: int | None = None) -> None:
        """Append tokens and enter the n-grams that now have a continuation, oldest first, at most `budget`
        positions (a long prompt is indexed over several steps instead of stalling one: until then its latest
        part is not matched, which costs drafts, never correctness)."""
        toks = self.tokens
        toks.extend(new)
        stop = len(toks) if budget is None else min(len(toks), self.indexed + budget)
        for e in range(self.indexed, stop):       # the n-grams ending just before e continue with toks[e]
            for n, m in self.maps.items():
                if e >= n:
                    m[tuple(toks[e - n:e])] = e
        self.indexed = max(self.indexed, stop)

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        L = len(toks)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = self.maps[n].get(tuple(toks[L - n:]))
            if e is not None:
                return toks[e:e + k]
        return []


@dataclass(frozen=True)
class NgramProposer:
    k: int            # draft tokens per step at most
    min_n: int = 2
    max_n: int = 4

    def __post_init__(self):
        if self.k < 0:
            raise ValueError(f"num_speculative_tokens={self.k} must be >= 0")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prompt lookup n-gram sizes [{self.min_n}, {self.max_n}]: need 1 <= min <= max")

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (n tokens,
        max_n down to min_n) of `tokens`; [] without a match."""
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)
        return index.propose(min(k, self.k)) if k > 0 and self.k > 0 else []

    def propose_for(self, seq: Sequence, k: int) -> list[int]:
        """propose() over the sequence's prompt and output, with its index kept on it between steps."""
        index = seq.ngrams
        if index is None:
            index = seq.ngrams = NgramIndex(self.min_n, self.max_n)
        n = len(index.tokens)
        P = len(seq.prompt_ids)
        new = (seq.prompt_ids[n:] + seq.output_ids) if n < P else seq.output_ids[n - P:]
        index.extend(new, INDEX_PER_CALL)
        return index.propose(min(k, self.k)) if k > 0 else []


def verify(rows: torch.Tensor, seq: Sequence, draft: list[int]) -> list[int]:
    """The tokens a verified draft yields: rows [len(draft) + 1, V] are the step's logits at the sequence's
    last token and at each draft token. Each row is sampled in turn as the plain path samples it (greedy: its
    argmax; else temperature, top-k, top-p and one draw from the sequence's generator) while the samples equal
    the draft: accepted draft tokens, then the first sample that differs (or the one after the whole draft).
    For a draft that is one token for certain this is exact speculative sampling (accept d with probability
    p(d), else draw from p without d) and it draws from the generator exactly as often as the plain path does,
    so seeded outputs are the same with drafts and without."""
    p = seq.params
    n = len(draft) + 1
    if p.greedy:        # first maxima, as the plain path: numpy's on the CPU, else on the device (n ids copied)
        picks = _argmax(rows)
    out = []
    for i in range(n):
        # sampled on the rows' device, as the plain path samples them (the same arithmetic, the same token)
        tok = picks[i] if p.greedy else _sample_row(rows[i], p.temperature, p.top_k, p.top_p, seq.generator)
        out.append(tok)
        if i == len(draft) or tok != draft[i]:
            return out
    return out
