"""Next-token choice per sequence: logits processing (structured outputs' grammars, min_tokens, logit_bias,
repetition / presence / frequency penalties), then greedy or temperature, top-k, top-p, each request with its own
seeded RNG. The batch is processed together on the logits' device (an accelerator's logits never come to the host
whole); one uniform number a sampled token comes from the request's generator, so given the same logits a seeded
request draws the same tokens whatever else shares its steps (the logits can differ in their last bits between
token buckets: README, Sampling)."""

from __future__ import annotations

import numpy as np
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
    if any(s.processes_logits for s in seqs):
        logits = process_logits(logits.clone(), seqs, eos_ids)    # the runner's output buffer stays as it was
    drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
    tokens = _argmax(logits) if len(drawn) < n else [0] * n
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


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The tokens `sample` would choose, as [n] int64 on the logits' device, for sequences that neither process
    logits nor ask for logprobs (overlapped scheduling: the next step reads them there before the host does).
    Greedy rows take the first maximum, as `sample`; sampled rows draw their request's uniform number in the same
    order. No host sync: nothing waits for the steps queued on the device."""
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if drawn:
        ps = [seqs[i].params for i in drawn]
        at = host_to_device(drawn, logits.device, torch.int64)
        picks = sample_rows(logits if len(drawn) == len(seqs) else logits[at], [p.temperature for p in ps],
                            [p.top_k for p in ps], [p.top_p for p in ps], [seqs[i].generator for i in drawn],
                            sync=False)
        if len(drawn) == len(seqs):
            return picks
        tokens[at] = picks
    return tokens


def host_to_device(values, dev: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list, a numpy array) as a tensor on `dev`. On a GPU through pinned memory, copied
    asynchronously: a copy from pageable memory first waits for everything queued on the stream (with overlapped
    scheduling, the chained step; a step launched without a CUDA graph made six such waits)."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum: numpy's on the CPU (~20 us for 16 x 4096 where torch's parallel kernel took
    ~150-300), else on the device (n ids copied back)."""
    if logits.device.type == "cpu":
        return logits.float().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


# Top-p alone looks at this many of a row's largest logits first (one topk, not a sort of the vocabulary), and
# sorts the whole row only where the nucleus reaches past them (a flat distribution)
CANDIDATES = 1024


def sample_rows(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                generators: list[torch.Generator | None], sync: bool = True) -> torch.Tensor:
    """One token per row of logits [m, V], drawn from `sampling_probs` of the row with its own parameters, on the
    logits' device. Each row's filters come down to the smallest logit it keeps (a value: the same whatever order
    equal logits sort in); then one uniform number from the row's generator (None: torch's default) picks, in
    vocabulary order, the first kept token whose cumulative probability passes it. The rows are computed
    together, each by per-row operations only, so a row's token does not depend on the batch it came in.
    Returns [m] int64 on the logits' device. `sync=False`: never wait for the device (the next step may be queued
    behind these rows): top-p rows then take the whole sorted row's floor where their nucleus reaches past the
    candidates, chosen on the device, instead of the host looking first (the same tokens, a sort more)."""
    m, V = logits.shape
    dev = logits.device
    u = host_to_device([float(torch.rand((), generator=g)) for g in generators], dev, torch.float32)
    # softmax and topk take the row's maximum out themselves: no shifted copy of the rows
    x = logits.float() / host_to_device(temperatures, dev, torch.float32)[:, None]
    probs = x.softmax(dim=-1)
    floor = torch.full((m,), float("-inf"), device=dev)          # per row, the smallest logit it keeps
    # by path: top-k, over the row's k largest (k); top-p alone, over the CANDIDATES largest (-1), or the whole
    # row sorted (V) where it has no more or its nucleus reaches past them; no filter: no path
    groups: dict[int, list[int]] = {}
    for i, (k, p) in enumerate(zip(top_ks, top_ps)):
        if 0 < k < V or p < 1.0:
            groups.setdefault(k if 0 < k < V else -1 if CANDIDATES < V else V, []).append(i)
    whole = groups.pop(V, [])
    for path, rows in groups.items():
        at = host_to_device(rows, dev, torch.int64)
        xs = x if len(rows) == m else x[at]          # one path for the whole batch: no copy of its rows
        vals, ids = xs.topk(CANDIDATES if path < 0 else path, dim=-1)
        ps = [top_ps[i] for i in rows]
        if path > 0:    # top-k keeps the logits down to the k-th largest; top-p within what it keeps
            kth = vals[:, -1:]
            if all(p >= 1.0 for p in ps):
                floor[at] = kth[:, 0]
                continue
            within = xs.masked_fill(xs < kth, float("-inf")).softmax(dim=-1).gather(1, ids)
            floor[at] = torch.maximum(kth[:, 0], _nucleus_floor(vals, within, ps))
        else:
            within = (probs if len(rows) == m else probs[at]).gather(1, ids)
            # the candidates' total as _nucleus_floor sums them (cumsum: in double on the CPU, where sum() is not)
            reached = within.cumsum(dim=-1)[:, -1] >= host_to_device(ps, dev, torch.float32)
            floor[at] = _nucleus_floor(vals, within, ps)
            if not sync:                             # every row's whole-row floor, taken where it is needed
                wv, wi = xs.sort(dim=-1, descending=True)
                wp = (probs if len(rows) == m else probs[at]).gather(1, wi)
                floor[at] = torch.where(reached, floor[at], _nucleus_floor(wv, wp, ps))
            elif not bool(reached.all()):            # flat rows: their nucleus reaches past the candidates
                whole += at[~reached].tolist()
    if whole:
        whole.sort()
        at = host_to_device(whole, dev, torch.int64)
        vals, ids = x[at].sort(dim=-1, descending=True)
        floor[at] = _nucleus_floor(vals, probs[at].gather(1, ids), [top_ps[i] for i in whole])
    return _draw(probs.masked_fill(x < floor[:, None], 0.0), u)


def _nucleus_floor(vals: torch.Tensor, probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Top-p over logits sorted largest first (vals) and their probabilities: per row the smallest logit whose
    strictly larger ones hold less than p of the probability (the top one at least; equal logits go together).
    -inf for rows with p >= 1."""
    if all(p >= 1.0 for p in top_ps):
        return torch.full(vals.shape[:1], float("-inf"), device=vals.device)
    p = host_to_device(top_ps, vals.device, torch.float32)[:, None]
    before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))    # mass ahead of each position
    last = ((before < p).sum(dim=-1, keepdim=True) - 1).clamp_(0, vals.shape[-1] - 1)
    return torch.where(p[:, 0] < 1.0, vals.gather(1, last)[:, 0], float("-inf"))


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row the first index whose cumulative probability exceeds u x the row's total (never a
    zero-probability index; a row with nothing left, all -inf or NaN logits, still gets an index in range)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # kept under the total (u x total can round up to it): then some cdf value exceeds it, first where a token's
    # probability is positive
    v = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    if probs.device.type != "cpu":
        return _first_past(cdf, v, probs)
    return torch.searchsorted(cdf, v, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def _first_past(cdf: torch.Tensor, v: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The first position whose cdf passes v and that holds probability, without assuming the cdf sorted: a
    parallel scan's float sums need not be monotone (the CPU's cumsum adds in double, in order)."""
    return ((cdf > v) & (probs > 0)).int().argmax(dim=-1)


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids=frozenset()) -> torch.Tensor:
    """In place on fp32 logits [n, V] (row i: seqs[i]'s next token), in vLLM's order: a structured output's grammar
    masks what it does not allow, min_tokens masks the stop tokens, logit_bias adds, then the penalties (repetition
    over prompt and output, as transformers' RepetitionPenaltyLogitsProcessor; presence and frequency over the
    output, as OpenAI defines them). Rows whose sequences process nothing are left as they are.

    Each stage is a few operations over all its rows' (row, token) pairs at once, the pairs built on the host from
    each sequence's `TokenStats` (its distinct tokens, folded in as the output grows): one row at a time cost
    ~70-150 us a row on the CPU (16 penalised sequences doubled a demo model's decode step) and, on a GPU, a sync
    a row (`unique`)."""
    dev = logits.device
    con = [i for i, s in enumerate(seqs) if s.constraint is not None]
    if con:                                 # structured outputs: what the grammar does not allow next
        at = torch.tensor(con, device=dev)
        allowed = torch.from_numpy(np.stack([seqs[i].constraint.allowed() for i in con])).to(dev)
        logits[at] = logits[at].masked_fill(~allowed, float("-inf"))
    rows, toks = [], []
    for i, s in enumerate(seqs):
        if len(s.output_ids) < s.params.min_tokens:
            stops = sorted(set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else set(eos_ids)))
            rows += [i] * len(stops)
            toks += stops
    if rows:                                # min_tokens: no stop token yet...
        at = torch.tensor(sorted(set(rows)), device=dev)
        kept = logits[at]
        logits[torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)] = float("-inf")
        masked = logits[at]
        # ...unless a grammar allows only a stop token now: it wins over min_tokens
        logits[at] = torch.where(torch.isfinite(masked).any(dim=-1, keepdim=True), masked, kept)
    bias = [(i, t, b) for i, s in enumerate(seqs) for t, b in s.params.logit_bias]
    if bias:
        r, t, b = zip(*bias)
        logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                          torch.tensor(b, dtype=logits.dtype, device=dev), accumulate=True)
    rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if rep:
        seen = [seqs[i].token_stats().seen for i in rep]
        r, t = _per_entry(rep, seen, np.int64, dev), torch.from_numpy(np.concatenate(seen)).to(dev)
        pen = _per_entry([seqs[i].params.repetition_penalty for i in rep], seen, np.float32, dev).to(logits.dtype)
        x = logits[r, t]
        logits[r, t] = torch.where(x > 0, x / pen, x * pen)
    pf = [i for i, s in enumerate(seqs) if (s.params.presence_penalty or s.params.frequency_penalty) and s.output_ids]
    if pf:
        stats = [seqs[i].token_stats() for i in pf]
        outputs = [st.outputs for st in stats]
        counts = torch.from_numpy(np.concatenate([st.counts for st in stats]).astype(np.float32))
        freq, pres = (_per_entry([getattr(seqs[i].params, k) for i in pf], outputs, np.float32, torch.device("cpu"))
                      for k in ("frequency_penalty", "presence_penalty"))
        logits.index_put_((_per_entry(pf, outputs, np.int64, dev), torch.from_numpy(np.concatenate(outputs)).to(dev)),
                          (-(freq * counts + pres)).to(dev, logits.dtype), accumulate=True)
    return logits


def _per_entry(per_row: list, arrays: list[np.ndarray], dtype, dev: torch.device) -> torch.Tensor:
    """Each row's value repeated for every entry of its array, the arrays laid end to end (a row index, a
    penalty)."""
    return torch.from_numpy(np.repeat(np.array(per_row, dtype), [len(a) for a in arrays])).to(dev)


def _sample_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> int:
    return int(sample_rows(row[None], [temperature], [top_k], [top_p], [generator])[0])


def sampling_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `sample_rows` draws a row's token from, written plainly (the reference its tests hold it
    to): temperature; top-k keeps the logits down to the k-th largest (ties with it too); top-p keeps each token
    whose strictly larger tokens hold less than top_p of what top-k left (so at least the top token, and equal
    logits together)."""
    x = row.float() / temperature
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        vals, order = x.sort(descending=True)
        before = torch.cat([vals.new_zeros(1), x.softmax(-1)[order].cumsum(0)[:-1]])  # mass ahead of each position
        _, group, counts = vals.unique_consecutive(return_inverse=True, return_counts=True)
        larger = before[torch.cumsum(counts, 0) - counts][group]     # mass strictly above: its tie group's first
        x = x.masked_fill(torch.empty_like(larger).scatter_(0, order, larger) >= top_p, float("-inf"))
    return x.softmax(-1)
