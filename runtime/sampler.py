"""Next-token choice per sequence: logits processing (structured outputs' grammars, min_tokens, logit_bias,
repetition / presence / frequency penalties), then greedy or temperature, top-k, top-p, each request with its own
seeded RNG. The batch is processed together on the logits' device (an accelerator's logits never come to the host
whole); one uniform number a sampled token comes from the request's generator, so a seeded request draws the same
tokens whatever else shares its steps."""

from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int] | set[int] = frozenset()
           ) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """logits [n, V] -> (token ids, their logprobs, top-N logprobs where asked), on the logits' device: only the
    ids and the asked logprobs come back to the host. Logprobs are the model's own (before processing), as vLLM's."""
    if all(s.params.greedy and s.params.logprobs is None and not s.processes_logits for s in seqs):
        return _argmax(logits), [0.0] * len(seqs), [{} for _ in seqs]
    n = len(seqs)
    logits = logits.float()
    lp_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None     # before processing
    processed = [i for i, s in enumerate(seqs) if s.processes_logits]
    if processed:
        logits = logits.clone()           # the runner's output buffer stays as the model left it
        for i in processed:
            process_logits(logits[i], seqs[i], eos_ids)
    tokens = _argmax(logits)
    drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if drawn:
        ps = [seqs[i].params for i in drawn]
        picks = sample_rows(logits[drawn], [p.temperature for p in ps], [p.top_k for p in ps],
                            [p.top_p for p in ps], [seqs[i].generator for i in drawn]).tolist()
        for i, tok in zip(drawn, picks):
            tokens[i] = tok
    chosen_lp, tops = [0.0] * n, [{} for _ in range(n)]
    if logprobs is not None:
        at = torch.tensor([tokens[i] for i in lp_rows], device=logprobs.device)
        for i, v in zip(lp_rows, logprobs.gather(1, at[:, None])[:, 0].tolist()):
            chosen_lp[i] = v
        top_n = max(seqs[i].params.logprobs or 0 for i in lp_rows)
        if top_n:
            values, ids = (t.tolist() for t in logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1))
            for r, i in enumerate(lp_rows):
                k = seqs[i].params.logprobs or 0
                tops[i] = {t: v for t, v in zip(ids[r][:k], values[r][:k])}
    return tokens, chosen_lp, tops


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum: numpy's on the CPU (~20 us for 16 x 4096 where torch's parallel kernel took
    ~150-300), else on the device (n ids copied back)."""
    if logits.device.type == "cpu":
        return logits.float().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


# Top-k and top-p look at this many of a row's largest logits first (one topk, not a sort of the vocabulary),
# and sort the whole row only where the nucleus reaches past them (a flat distribution)
CANDIDATES = 1024


def sample_rows(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of logits [m, V], drawn from `sampling_probs` of the row with its own parameters, on the
    logits' device: one uniform number per row from the row's generator (None: torch's default), then the
    first token whose cumulative probability passes it. The rows are computed together, but each row's path and
    draw follow from that row alone (not from the batch it came in). Returns [m] int64 on the logits' device."""
    m, V = logits.shape
    dev = logits.device
    u = torch.tensor([float(torch.rand((), generator=g)) for g in generators], device=dev)
    # softmax, topk and logsumexp take the row's maximum out themselves: no shifted copy of the rows
    x = logits.float() / torch.tensor(temperatures, device=dev)[:, None]
    tokens = torch.empty(m, dtype=torch.long, device=dev)
    # by path: no filter (0); top-k over the row's k largest (k); top-p alone over the CANDIDATES largest (-1),
    # or over the whole row sorted where it has no more (V) or its nucleus reaches past them
    groups: dict[int, list[int]] = {}
    for i, (k, p) in enumerate(zip(top_ks, top_ps)):
        path = k if 0 < k < V else 0 if p >= 1.0 else -1 if CANDIDATES < V else V
        groups.setdefault(path, []).append(i)
    whole = groups.pop(V, [])
    for path, rows in groups.items():
        at = torch.tensor(rows, device=dev)
        xs = x if len(rows) == m else x[at]           # one path for the whole batch: no copy of its rows
        if path == 0:
            tokens[at] = _draw(xs.softmax(dim=-1), u[at])
            continue
        p = torch.tensor([top_ps[i] for i in rows], device=dev)
        n = CANDIDATES if path < 0 else path
        vals, ids = xs.topk(n, dim=-1)
        if path < 0:    # the candidates' probabilities within the whole row
            probs = (vals - xs.logsumexp(dim=-1, keepdim=True)).exp()
            short = probs.sum(dim=-1) < p            # flat rows: their nucleus reaches past the candidates
            if bool(short.any()):
                whole += at[short].tolist()
        else:
            probs = vals.softmax(dim=-1)             # top-k keeps exactly these
        tokens[at] = ids.gather(1, _draw(_nucleus(probs, p), u[at])[:, None])[:, 0]
    if whole:
        at = torch.tensor(sorted(whole), device=dev)
        vals, ids = x[at].sort(dim=-1, descending=True)
        p = torch.tensor([top_ps[i] for i in sorted(whole)], device=dev)
        tokens[at] = ids.gather(1, _draw(_nucleus(vals.softmax(dim=-1), p), u[at])[:, None])[:, 0]
    return tokens


def _nucleus(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Top-p on probabilities sorted largest first: zero past each row's smallest prefix whose sum reaches p
    (always at least the first; p >= 1 keeps the row)."""
    if bool((p >= 1.0).all()):
        return probs
    cum = probs.cumsum(dim=-1)
    return probs.masked_fill((cum - probs >= p[:, None]) & (p[:, None] < 1.0), 0.0)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row the first index whose cumulative probability exceeds u x the row's total (never a
    zero-probability index)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # kept under the total (u x total can round up to it): then some cdf value exceeds it, first where a token's
    # probability is positive
    v = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True)[:, 0]


def process_logits(row: torch.Tensor, seq: Sequence, eos_ids=frozenset()) -> torch.Tensor:
    """In place on one sequence's fp32 logits [V], in vLLM's order: a structured output's grammar masks what it does
    not allow, min_tokens masks the stop tokens, logit_bias adds, then the penalties (repetition over prompt and output, as transformers' RepetitionPenaltyLogitsProcessor;
    presence and frequency over the output, as OpenAI defines them)."""
    p = seq.params
    if seq.constraint is not None:          # structured output: what the grammar does not allow next
        row[torch.from_numpy(~seq.constraint.allowed()).to(row.device)] = float("-inf")
    if len(seq.output_ids) < p.min_tokens:
        stops = torch.tensor(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))),
                             dtype=torch.long, device=row.device)
        kept = row.clone()
        row[stops] = float("-inf")
        if not torch.isfinite(row).any():     # a grammar that allows only EOS now: it wins over min_tokens
            row.copy_(kept)
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=row.device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), device=row.device)
        x = row[seen]
        row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
        ids, counts = torch.tensor(seq.output_ids, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row


def _sample_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> int:
    return int(sample_rows(row[None], [temperature], [top_k], [top_p], [generator])[0])


def sampling_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `sample_rows` draws a row's token from, written plainly (the reference its tests hold it
    to): temperature, then top-k (the k largest), then top-p (the smallest prefix of what is left, largest first,
    whose probability reaches top_p; always at least the top token)."""
    row = (row.float() - row.max()) / temperature     # shifted first: no inf - inf = NaN for small temperatures
    sorted_logits, order = row.sort(descending=True)
    if 0 < top_k < row.numel():
        sorted_logits[top_k:] = float("-inf")
    if top_p < 1.0:
        probs = sorted_logits.softmax(-1)
        sorted_logits = sorted_logits.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    return torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits).softmax(-1)
