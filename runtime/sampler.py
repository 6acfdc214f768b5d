"""Next-token choice per sequence: logits processing (structured outputs' grammars, min_tokens, logit_bias,
repetition / presence / frequency penalties), then greedy or temperature, top-k, top-p, each request with its own seeded RNG."""

from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int] | set[int] = frozenset()
           ) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """logits [n, V] -> (token ids, their logprobs, top-N logprobs where asked). Logits on an accelerator: an
    all-greedy batch without logprobs or logits processing takes the argmax there and copies n ids back; anything
    else samples on the CPU, as for CPU logits. Logprobs are the model's own (before processing), as vLLM's."""
    if logits.device.type != "cpu":
        if all(s.params.greedy and s.params.logprobs is None and not s.processes_logits for s in seqs):
            return logits.argmax(dim=-1).tolist(), [0.0] * len(seqs), [{} for _ in seqs]
        logits = logits.float().cpu()
    want_lp = any(s.params.logprobs is not None for s in seqs)
    logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
    processed = [i for i, s in enumerate(seqs) if s.processes_logits]
    if processed:
        logits = logits.clone()          # the runner's output buffer stays as the model left it
        for i in processed:
            process_logits(logits[i], seqs[i], eos_ids)
    # numpy's argmax (first maximum, like torch's): ~20 us for 16 x 4096 where torch's parallel kernel took ~150-300
    greedy = logits.numpy().argmax(axis=-1).tolist()
    tokens: list[int] = []
    chosen_lp: list[float] = []
    tops: list[dict[int, float]] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            tok = greedy[i]
        else:
            tok = _sample_row(logits[i], p.temperature, p.top_k, p.top_p, seq.generator)
        tokens.append(tok)
        if logprobs is not None:
            chosen_lp.append(float(logprobs[i, tok]))
            n = p.logprobs or 0
            if n > 0:
                v, ix = logprobs[i].topk(n)
                tops.append({int(t): float(x) for t, x in zip(ix, v)})
            else:
                tops.append({})
        else:
            chosen_lp.append(0.0)
            tops.append({})
    return tokens, chosen_lp, tops


def process_logits(row: torch.Tensor, seq: Sequence, eos_ids=frozenset()) -> torch.Tensor:
    """In place on one sequence's fp32 logits [V], in vLLM's order: a structured output's grammar masks what it does
    not allow, min_tokens masks the stop tokens, logit_bias adds, then the penalties (repetition over prompt and output, as transformers' RepetitionPenaltyLogitsProcessor;
    presence and frequency over the output, as OpenAI defines them)."""
    p = seq.params
    if seq.constraint is not None:          # structured output: what the grammar does not allow next
        row[torch.from_numpy(~seq.constraint.allowed())] = float("-inf")
    if len(seq.output_ids) < p.min_tokens:
        stops = torch.tensor(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))),
                             dtype=torch.long)
        kept = row.clone()
        row[stops] = float("-inf")
        if not torch.isfinite(row).any():     # a grammar that allows only EOS now: it wins over min_tokens
            row.copy_(kept)
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias])
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)))
        x = row[seen]
        row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
        ids, counts = torch.tensor(seq.output_ids).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row


def _sample_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> int:
    return int(torch.multinomial(sampling_probs(row, temperature, top_k, top_p), 1, generator=generator))


def sampling_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a row is sampled from: temperature, then top-k, then top-p."""
    row = (row.float() - row.max()) / temperature     # shifted first: no inf - inf = NaN for small temperatures
    if 0 < top_k < row.numel():
        kth = row.topk(top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = row.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
    return row.softmax(-1)
