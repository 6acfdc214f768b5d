"""The batched sampler against its plain definition (`sampling_probs`): the distribution each path draws from
(no filter, top-k, top-p over the candidates, top-p past them), a row's draw independent of its batch, and no
draw of a token the filters or the logits processing ruled out."""

from __future__ import annotations

import pytest
import torch

from deepinfer.runtime import sampler
from deepinfer.runtime.sampler import sample, sample_rows, sampling_probs
from deepinfer.runtime.sequence import SamplingParams, Sequence

V = 12
DRAWS = 20000


def _frequencies(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    toks = sample_rows(row.expand(DRAWS, -1), [temperature] * DRAWS, [top_k] * DRAWS, [top_p] * DRAWS, [g] * DRAWS)
    return torch.bincount(toks, minlength=row.numel()).float() / DRAWS


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0),            # no filter: the whole row
    (0.7, 5, 1.0),            # top-k: its k largest
    (1.3, 0, 0.8),            # top-p over the candidates (a peaked row) or past them (a flat one)
    (1.0, 6, 0.6),            # both
    (0.5, V, 0.95),           # k = V is no top-k
])
@pytest.mark.parametrize("flat", [False, True])
def test_draws_follow_the_reference_distribution(monkeypatch, temperature, top_k, top_p, flat):
    monkeypatch.setattr(sampler, "CANDIDATES", 4)     # a flat row's nucleus reaches past 4 candidates
    g = torch.Generator().manual_seed(1)
    row = torch.randn(V, generator=g) * (0.3 if flat else 3.0)
    want = sampling_probs(row, temperature, top_k, top_p)
    got = _frequencies(row, temperature, top_k, top_p)
    assert torch.allclose(got, want, atol=0.015), (got, want)
    assert bool((got[want == 0] == 0).all())


def test_a_rows_draw_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=g) * 2
    params = [(0.8, 0, 1.0), (1.0, 40, 1.0), (0.9, 0, 0.9), (1.1, 250, 0.7), (0.6, 7, 0.5), (1.0, 0, 0.99)]

    def draw(rows: list[int]) -> list[int]:
        ts, ks, ps = zip(*(params[i] for i in rows))
        gens = [torch.Generator().manual_seed(100 + i) for i in rows]
        return sample_rows(logits[rows], list(ts), list(ks), list(ps), gens).tolist()
    alone = [draw([i])[0] for i in range(6)]
    assert draw(list(range(6))) == alone
    assert draw([5, 3, 1]) == [alone[5], alone[3], alone[1]]


def test_equal_logits_are_kept_or_dropped_together(monkeypatch):
    """Top-k's k-th largest and top-p's last logit keep every token equal to them (bf16 logits tie often): the
    draws follow the reference, whatever order the ties sort in."""
    monkeypatch.setattr(sampler, "CANDIDATES", 4)
    row = torch.tensor([3.0, 2.0, 0.0, 2.0, 1.0, 2.0, 1.0, 0.5, 2.0, -1.0, 1.0, 0.0])
    for top_k, top_p in ((2, 1.0), (0, 0.3), (3, 0.6), (0, 0.9)):
        want = sampling_probs(row, 1.0, top_k, top_p)
        got = _frequencies(row, 1.0, top_k, top_p)
        assert torch.allclose(got, want, atol=0.015), (top_k, top_p, got, want)
        assert bool((got[want == 0] == 0).all())
    assert bool((sampling_probs(row, 1.0, 2, 1.0)[[1, 3, 5, 8]] > 0).all())       # all four 2.0s with top-k 2


def test_a_rows_draw_does_not_depend_on_its_batch_past_the_candidates():
    """A vocabulary past CANDIDATES, bf16-rounded logits (ties everywhere): top-p rows over the candidates and
    flat ones past them, top-k rows, plain ones; each row's token alone equals its token in the batch, for many
    draws."""
    V = 3000
    g = torch.Generator().manual_seed(6)
    logits = torch.cat([torch.randn(4, V, generator=g) * 6, torch.randn(4, V, generator=g) * 0.2])
    logits = logits.to(torch.bfloat16).float()
    params = [(0.8, 0, 0.9), (1.0, 40, 1.0), (0.9, 0, 1.0), (1.1, 1500, 0.7),
              (1.0, 0, 0.9), (0.7, 0, 0.95), (1.0, 5, 0.5), (1.2, 0, 1.0)]
    for seed in range(25):
        def draw(rows: list[int]) -> list[int]:
            ts, ks, ps = zip(*(params[i] for i in rows))
            gens = [torch.Generator().manual_seed(1000 * seed + i) for i in rows]
            return sample_rows(logits[rows], list(ts), list(ks), list(ps), gens).tolist()
        alone = [draw([i])[0] for i in range(8)]
        assert draw(list(range(8))) == alone
        assert draw([7, 4, 0]) == [alone[7], alone[4], alone[0]]


def test_draws_without_a_host_sync_are_the_same_draws():
    """sync=False (overlapped scheduling: nothing may wait for the device) decides on the device which top-p rows
    take the whole sorted row's floor; the tokens are the ones the host-side decision gives: top-p rows over the
    candidates and flat ones past them, top-k + top-p rows, plain ones, in one batch and in part of one."""
    V = 3000
    g = torch.Generator().manual_seed(8)
    logits = torch.cat([torch.randn(4, V, generator=g) * 6, torch.randn(4, V, generator=g) * 0.2])
    params = [(0.8, 0, 0.9), (1.0, 40, 0.8), (0.9, 0, 1.0), (1.1, 0, 0.7),
              (1.0, 0, 0.9), (0.7, 0, 0.95), (1.0, 5, 0.5), (1.2, 0, 0.99)]
    for seed in range(10):
        for rows in (list(range(8)), [4, 0, 5], [1, 6]):
            ts, ks, ps = zip(*(params[i] for i in rows))
            got = [sample_rows(logits[rows], list(ts), list(ks), list(ps),
                               [torch.Generator().manual_seed(100 * seed + i) for i in rows], sync=sync).tolist()
                   for sync in (True, False)]
            assert got[0] == got[1], (seed, rows)


def test_top_p_at_the_candidates_total_takes_the_whole_row(monkeypatch):
    """top_p equal to the candidates' own total, as the float sums give it: whether the nucleus reaches past the
    1024 candidates is decided on the same sums the boundary comes from (a sum() and a cumsum() disagree in the
    last bit for ~30% of rows), so the kept set is the reference's."""
    kept = []
    draw = sampler._draw
    monkeypatch.setattr(sampler, "_draw", lambda probs, u: kept.append(probs > 0) or draw(probs, u))
    g = torch.Generator().manual_seed(7)
    for _ in range(40):
        row = torch.randn(2048, generator=g) * 0.3
        vals, ids = row.topk(sampler.CANDIDATES)
        within = row.softmax(-1)[ids]
        for p in (float(within.sum()), float(within.cumsum(0)[-1])):
            kept.clear()
            sample_rows(row[None], [1.0], [0], [p], [None])
            assert torch.equal(kept[0][0], sampling_probs(row, 1.0, 0, p) > 0), p


def test_the_draw_never_lands_on_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]])
    for u in (0.0, 0.5, 1.0 - 2 ** -24, 1.0):        # 1.0: u x total rounded up to the total
        assert int(sampler._draw(probs, torch.tensor([u]))[0]) in (1, 3)
    # nothing left to draw (all -inf or NaN logits): still a token id in range, not V or an out-of-range gather
    for row in (torch.full((1, 6), float("-inf")), torch.tensor([[0.0, float("nan"), 1.0, 0.0, 0.0, 0.0]])):
        for k, p in ((0, 1.0), (2, 1.0), (0, 0.5)):
            assert 0 <= int(sample_rows(row, [1.0], [k], [p], [None])[0]) < 6


def test_the_devices_draw_finds_what_the_cpus_finds():
    """`_first_past` (accelerators: no sorted cdf assumed) and the CPU's searchsorted pick the same index."""
    g = torch.Generator().manual_seed(8)
    probs = torch.rand(64, 200, generator=g) * (torch.rand(64, 200, generator=g) > 0.6)
    u = torch.rand(64, generator=g)
    u[:4] = torch.tensor([0.0, 1.0 - 2 ** -24, 0.5, 1.0])
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    v = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    assert torch.equal(sampler._first_past(cdf, v, probs), sampler._draw(probs, u))


def test_processed_and_filtered_rows_in_one_batch():
    """Greedy, sampled, logprobs and a logit bias that rules out all but two tokens, in one call: each row as if
    alone; the biased row only ever draws its two tokens; logprobs are the model's (before the bias)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=g)
    bias = tuple((t, -1e9) for t in range(50) if t not in (7, 9))
    seqs = [Sequence([1], SamplingParams(max_tokens=2)),
            Sequence([1], SamplingParams(max_tokens=2, temperature=1.0, logit_bias=bias, seed=4)),
            Sequence([1], SamplingParams(max_tokens=2, temperature=0.9, top_p=0.9, logprobs=3, seed=5))]
    tokens, lps, tops = sample(logits, seqs)
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] in (7, 9)
    ref = torch.log_softmax(logits[2], -1)
    assert lps[2] == pytest.approx(float(ref[tokens[2]]), abs=1e-6)
    assert list(tops[2]) == ref.topk(3).indices.tolist()
    alone = sample(logits[2:], [Sequence([1], SamplingParams(max_tokens=2, temperature=0.9, top_p=0.9, logprobs=3,
                                                             seed=5))])
    assert alone[0][0] == tokens[2]
    assert lps[0] == 0.0 and tops[0] == {}


def test_the_offline_benchmark_takes_sampling_flags(checkpoints, compile_artifact, capsys, monkeypatch):
    """deepinfer-bench offline --temperature/--top-p/--top-k and the penalties: every request samples with them,
    and the table comes out."""
    from deepinfer.runtime import bench
    from deepinfer.runtime.engine import Engine
    art = compile_artifact(checkpoints["base"])
    seen = []
    add = Engine.add_request
    monkeypatch.setattr(Engine, "add_request", lambda self, ids, params: seen.append(params) or add(self, ids, params))
    bench.main(["offline", str(art), "--prompt-lens", "6", "--concurrency", "3", "--max-tokens", "5",
                "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--json"])
    import json
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["concurrency"] == 3 and rows[0]["output_tok_s"] > 0
    assert len(seen) == 4 and all((p.temperature, p.top_p, p.top_k) == (0.8, 0.9, 20) for p in seen[1:])  # a warm-up first
    seen.clear()        # the penalties alone: greedy, penalised
    bench.main(["offline", str(art), "--prompt-lens", "6", "--concurrency", "2", "--max-tokens", "5",
                "--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--repetition-penalty", "1.2", "--json"])
    capsys.readouterr()
    assert len(seen) == 3 and all((p.temperature, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) ==
                                  (0.0, 0.5, 0.25, 1.2) for p in seen[1:])


def test_the_benchmark_reports_bad_input_as_the_other_commands(tmp_path, capsys):
    """deepinfer-bench: a typed error is one line on stderr and exit code 2, as deepinfer-compile/run's."""
    from deepinfer.runtime import bench
    with pytest.raises(SystemExit) as e:
        bench.main(["offline", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "missing" in err
    with pytest.raises(SystemExit):
        bench.main(["--debug", "offline", str(tmp_path / "missing")])
    assert "Traceback" in capsys.readouterr().err


def test_the_offline_benchmark_prints_region_timing_per_row(checkpoints, compile_artifact, capsys, monkeypatch):
    """DEEPINFER_REGION_TIMING=1 deepinfer-bench offline: after each row, that row's region timing table (the
    warm-up and earlier rows left out), split into the layers' parts on a --region-marks build."""
    from deepinfer.runtime import bench
    monkeypatch.setenv("DEEPINFER_REGION_TIMING", "1")
    art = compile_artifact(checkpoints["base"], region_marks=True)
    bench.main(["offline", str(art), "--prompt-lens", "6", "--concurrency", "3,2", "--max-tokens", "5", "--json"])
    err = capsys.readouterr().err
    tables = err.split("region timing, prompt_len 6, concurrency ")[1:]
    assert [t.split(":")[0] for t in tables] == ["3", "2"]
    for t in tables:
        rows = {tuple(ln.split()[:2]): ln.split() for ln in t.splitlines() if ln.startswith(("decode", "prefill"))}
        assert rows[("decode", "(step)")][2] == "4" and rows[("prefill", "(step)")][2] == "1"   # 5 tokens a request
        assert [ln.split()[0] for ln in t.splitlines() if ln.startswith(" ")].count("attention") == 4
