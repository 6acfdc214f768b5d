"""The engine end to end on a compiled artifact: batching, sampling, stopping, validation."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from deepinfer.common.errors import RequestError
from deepinfer.runtime.engine import Engine
from deepinfer.runtime.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def artifact(checkpoints, compile_artifact):
    return compile_artifact(checkpoints["base"])


@pytest.fixture(scope="module")
def engine(artifact):
    return Engine.from_artifact(artifact)


def test_mixed_batch_generates_what_each_gives_alone(engine):
    # 1 and 3 tokens (shorter than a decode bucket), 20 (between), 70 and 90 (several prefill chunks)
    ps = prompts([1, 3, 20, 70, 90, 5])
    alone = [engine.generate([p], GREEDY)[0].output_ids for p in ps]
    together = [s.output_ids for s in engine.generate(ps, GREEDY)]
    assert together == alone
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


def test_preemption_under_a_small_pool_still_finishes_everything(checkpoints, compile_artifact):
    art = compile_artifact(checkpoints["base"], num_kv_blocks=9)    # 8 blocks hold one full sequence
    engine = Engine.from_artifact(art)
    ps = prompts([40, 50, 30, 60], seed=3)
    ps[2] = ps[0][:20] + ps[2][20:]         # a shared prefix: preempted sequences and others hit cached blocks
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    alone = [engine.generate([p], params)[0].output_ids for p in ps]
    for caching in (True, False):
        engine = Engine.from_artifact(art, prefix_caching=caching)
        seqs = engine.generate(ps, params)
        assert sum(s.num_preemptions for s in seqs) > 0
        assert [s.output_ids for s in seqs] == alone
        assert engine.scheduler.blocks.num_free == 9
        assert (engine.scheduler.blocks.hits > 0) == caching


def test_prefix_cache_hits_change_no_token(artifact, engine):
    """Prompts that share a system prompt, repeat one, or end exactly where cached blocks end, served from the
    prefix cache (one at a time: each hits what the ones before left; together: they share blocks in the same
    steps; under a pool small enough to preempt: preempted ones hit their own blocks) give the tokens and
    logprobs of an engine without the cache, while computing fewer tokens."""
    system = prompts([40], seed=21)[0]
    ps = [system + q for q in prompts([5, 30, 1, 12], seed=22)] + [system[:32], system, system[:17]]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    cold = Engine.from_artifact(artifact, prefix_caching=False)
    want = [cold.generate([p], params)[0] for p in ps]
    assert cold.scheduler.blocks.hits == 0
    for together in (False, True):
        warm = Engine.from_artifact(artifact)
        warm.generate([system + [7]], params)
        got = warm.generate(ps, params) if together else [warm.generate([p], params)[0] for p in ps]
        for w, g in zip(want, got):
            assert g.output_ids == w.output_ids
            assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4)
        assert [g.num_cached_tokens for g in got] == [32, 32, 32, 32, 16, 32, 16]
        assert warm.scheduler.blocks.num_free == warm.scheduler.blocks.num_blocks
    assert engine.scheduler.cfg.prefix_caching       # on by default


def test_repetition_penalty_and_min_tokens_match_transformers_generate(checkpoints, engine):
    """repetition_penalty over prompt and output, and min_tokens masking EOS, as transformers' generate applies
    them (RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor), greedy on the same weights; and
    batched with other requests that do not process their logits."""
    from checkpoints import hf_model
    hf = hf_model(checkpoints["base"])
    assert set(engine.eos_ids) == {hf.generation_config.eos_token_id}
    changed = 0
    for p in prompts([6, 30, 45], seed=31):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              repetition_penalty=1.6)[0, len(p):].tolist()
        params = SamplingParams(max_tokens=12, min_tokens=12, repetition_penalty=1.6)
        alone = engine.generate([p], params)[0]
        batched = engine.generate([p, p[:3]], [params, GREEDY])[0]
        assert alone.output_ids == batched.output_ids == ref and alone.finish_reason == "length"
        changed += ref != engine.generate([p], GREEDY)[0].output_ids
    assert changed       # the penalty changed what greedy picks


def test_presence_frequency_penalties_and_logit_bias_as_openai_defines_them():
    """process_logits against the formulas: bias added, repetition over prompt and output, presence and frequency
    over the output's counts; min_tokens masks EOS and stop_token_ids (not an ignored EOS)."""
    from deepinfer.runtime.sampler import process_logits
    from deepinfer.runtime.sequence import Sequence
    row = torch.randn(50, generator=torch.Generator().manual_seed(0))
    seq = Sequence([3, 5, 11], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3,
                                              logit_bias=((7, 2.0), (11, -1.5))))
    seq.output_ids = [5, 5, 9, 7]
    want = row.clone()
    want[7] += 2.0
    want[11] -= 1.5
    for t in (3, 5, 11, 9, 7):
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, n in ((5, 2), (9, 1), (7, 1)):
        want[t] -= 0.25 * n + 0.5
    assert torch.allclose(process_logits(row.clone()[None], [seq], {1})[0], want)
    for ignore_eos, masked in ((False, {1, 4}), (True, {4})):
        seq = Sequence([3], SamplingParams(min_tokens=2, stop_token_ids=(4,), ignore_eos=ignore_eos))
        out = process_logits(row.clone()[None], [seq], {1})[0]
        assert {i for i in range(50) if out[i] == float("-inf")} == masked
        seq.output_ids = [8, 8]
        assert torch.equal(process_logits(row.clone()[None], [seq], {1})[0], row)


def test_logits_processing_of_a_batch_is_each_row_alone():
    """process_logits works on all rows at once: each row comes out as it would alone, rows that process nothing
    are untouched, and the token counts a sequence keeps as its output grows (folded step by step) give what they
    give counted afresh."""
    import random
    from deepinfer.runtime.sampler import process_logits
    from deepinfer.runtime.sequence import Sequence
    rng = random.Random(3)
    V = 64

    def params():
        kw = rng.choice([{}, {"presence_penalty": 0.7}, {"frequency_penalty": -0.4, "presence_penalty": 0.2},
                         {"repetition_penalty": rng.choice([0.8, 1.5])}, {"logit_bias": ((rng.randrange(V), 3.0),)},
                         {"min_tokens": 5, "stop_token_ids": (9,)},
                         {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "logit_bias": ((2, -1.0), (40, 0.5)),
                          "min_tokens": 3}])
        return SamplingParams(max_tokens=40, **kw)
    seqs = [Sequence([rng.randrange(V) for _ in range(rng.randrange(1, 30))], params()) for _ in range(12)]
    for step in range(6):
        logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(step))
        batch = process_logits(logits.clone(), seqs, {1})
        for i, s in enumerate(seqs):
            fresh = Sequence(list(s.prompt_ids), s.params)
            fresh.output_ids = list(s.output_ids)
            alone = process_logits(logits[i:i + 1].clone(), [fresh], {1})[0]
            assert torch.equal(batch[i], alone), (step, i, s.params)
            if not s.processes_logits:
                assert torch.equal(batch[i], logits[i])
            s.output_ids += [rng.randrange(V) for _ in range(rng.choice([1, 1, 3]))]
    assert any(not torch.equal(batch[i], logits[i]) for i in range(len(seqs)))


def test_logit_bias_stop_token_ids_min_tokens_and_penalties_end_to_end(engine):
    p = prompts([8], seed=41)[0]
    full = engine.generate([p], GREEDY)[0]
    forced = engine.generate([p], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias=((77, 100.0),)))[0]
    assert forced.output_ids == [77] * 5
    banned = engine.generate([p], SamplingParams(max_tokens=5, ignore_eos=True,
                                                 logit_bias=((full.output_ids[0], -100.0),)))[0]
    assert banned.output_ids[0] != full.output_ids[0]
    # a stop token ends the output; its text is not output (as EOS's)
    stop = full.output_ids[4]
    i = full.output_ids.index(stop)
    s = engine.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,)))[0]
    assert s.output_ids == full.output_ids[: i + 1] and s.finish_reason == "stop"
    assert s.output_text == engine.tokenizer.decode(full.output_ids[:i])
    # ... but not before min_tokens, which masks it: the output goes on without it
    s = engine.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,),
                                            min_tokens=i + 2))[0]
    assert len(s.output_ids) >= i + 2 and stop not in s.output_ids[: i + 2]
    # stop strings count only in the text after min_tokens' tokens
    text, first = full.output_text, engine.tokenizer.decode(full.output_ids[:1])
    assert len(first) == 1 and text.count(first) == 1            # this prompt's first token: one ASCII character
    s = engine.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, stop=(first,)))[0]
    assert s.output_text == "" and s.finish_reason == "stop"
    s = engine.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, stop=(first,), min_tokens=3))[0]
    assert s.output_ids == full.output_ids and s.finish_reason == "length"
    # a strong frequency penalty makes greedy avoid repeats it would otherwise make
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = engine.generate([p], long)[0].output_ids
    spread = engine.generate([p], dataclasses.replace(long, frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert len(set(plain)) < len(plain) and len(set(spread.output_ids)) > len(set(plain))


def test_prompt_logprobs_match_transformers(checkpoints, compile_artifact, engine):
    """Prompt logprobs (echo + logprobs) of prompts run as decode steps, in one and several prefill chunks and
    packed with others: transformers' log-softmax of the next prompt token at every position, and its top-3; a
    prompt scored twice is computed twice (the prefix cache cannot give logits), and a preempted one (a small
    pool) does not collect them twice."""
    from checkpoints import hf_logits, hf_model
    hf = hf_model(checkpoints["base"])
    ps = prompts([1, 3, 20, 45, 90, 7], seed=51)
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    for seqs in (engine.generate(ps, params), [engine.generate([p], params)[0] for p in ps]):
        for p, s in zip(ps, seqs):
            ref = torch.log_softmax(hf_logits(hf, p), dim=-1)
            want = [float(ref[i, p[i + 1]]) for i in range(len(p) - 1)]
            assert s.prompt_token_logprobs == pytest.approx(want, abs=1e-4)
            assert len(s.prompt_top_logprobs) == len(p) - 1
            for i, top in enumerate(s.prompt_top_logprobs):
                assert set(top) == set(ref[i].topk(3).indices.tolist())
            assert s.num_cached_tokens == 0
    small = Engine.from_artifact(compile_artifact(checkpoints["base"], num_kv_blocks=9))
    seqs = small.generate(prompts([60, 50, 40], seed=52), SamplingParams(max_tokens=30, ignore_eos=True,
                                                                          prompt_logprobs=0))
    assert sum(s.num_preemptions for s in seqs) > 0
    for p, s in zip(prompts([60, 50, 40], seed=52), seqs):
        ref = torch.log_softmax(hf_logits(hf, p), dim=-1)
        assert s.prompt_token_logprobs == pytest.approx([float(ref[i, p[i + 1]]) for i in range(len(p) - 1)],
                                                        abs=1e-4)


def test_an_artifact_without_prompt_logprob_heads_refuses_them_and_serves_the_rest(engine):
    """An artifact from before prompt logprobs (no head over every row of its prefill chunks): such a request is a
    RequestError naming the cause, not a failed step; other requests are served as before."""
    m = engine.manifest
    old = dataclasses.replace(m, graphs=tuple(g for g in m.graphs if g.name != "head.prefill.t32.l32"))
    e = Engine(old, engine.runner, engine.tokenizer)
    with pytest.raises(RequestError, match="compiled without the prefill heads"):
        e.add_request([5, 6, 7], SamplingParams(prompt_logprobs=1))
    assert e.generate([[5, 6, 7]], GREEDY)[0].output_ids == engine.generate([[5, 6, 7]], GREEDY)[0].output_ids


def test_structured_output_constrains_only_its_own_sequence(engine):
    """A Lark grammar's sequence generates a sentence of the grammar and stops there ("stop"); batched with it, an
    unconstrained sequence generates what it does alone; a grammar that does not build is a RequestError."""
    import re
    from deepinfer.runtime.structured import grammar_of
    p = prompts([8], seed=61)[0]
    free = engine.generate([p], GREEDY)[0].output_ids
    lark = 'start: "(" num "," num ")"\nnum: /[0-9]{1,2}/'
    for temperature in (0.0, 1.0):
        a, b = engine.generate([p, p], [SamplingParams(max_tokens=40, temperature=temperature, seed=5,
                                                       structure=grammar_of("grammar", lark)), GREEDY])
        assert re.fullmatch(r"\([0-9]{1,2},[0-9]{1,2}\)", a.output_text) and a.finish_reason == "stop"
        assert b.output_ids == free
    with pytest.raises(RequestError, match="structured output"):
        engine.add_request(p, SamplingParams(structure=grammar_of("grammar", "start: missing")))
    assert not engine.has_work


def test_the_engine_loop_builds_grammar_matchers_off_its_thread(engine, monkeypatch):
    """EngineLoop.submit builds a structured output's matcher in a worker thread (llguidance may take long over a
    large schema: the engine thread would stall every running sequence), once per grammar, copied for the
    request's other sequences, each of which then follows the grammar on its own."""
    import asyncio
    import re
    import threading
    from deepinfer.runtime.engine_loop import EngineLoop, TokenEvent
    from deepinfer.runtime.structured import Grammars, grammar_of
    built = []
    constraint = Grammars.constraint
    monkeypatch.setattr(Grammars, "constraint", lambda self, g: built.append(threading.current_thread()) or
                        constraint(self, g))
    lark = 'start: "(" num "," num ")"\nnum: /[0-9]{1,2}/'
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        sp = SamplingParams(max_tokens=40, temperature=1.0, structure=grammar_of("grammar", lark))
        streams = await loop.submit([(prompts([8], seed=61)[0], dataclasses.replace(sp, seed=j)) for j in range(3)])
        outs = []
        for s in streams:
            ev, text = TokenEvent(0, "", 0, 0.0, {}, False, None), ""
            while not ev.finished:
                ev = await asyncio.wait_for(s.events.get(), 60)
                assert isinstance(ev, TokenEvent), ev
                text = text[:ev.delta_at] + ev.delta
            assert text == s.seq.output_text
            outs.append((text, ev.finish_reason))
        return outs
    try:
        outs = asyncio.run(main())
    finally:
        loop.stop()
    assert len(built) == 1 and built[0] is not loop._thread and built[0] is not threading.main_thread()
    assert all(re.fullmatch(r"\([0-9]{1,2},[0-9]{1,2}\)", text) and why == "stop" for text, why in outs), outs


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    p = prompts([10, 12], seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = engine.generate([p[0]], params)[0].output_ids
    b = engine.generate(p, params)[0].output_ids
    c = engine.generate([p[0]], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=99,
                                               ignore_eos=True))[0].output_ids
    assert a == b and a != c


def test_top_k_1_is_greedy(engine):
    p = prompts([9], seed=7)[0]
    greedy = engine.generate([p], GREEDY)[0].output_ids
    topk = engine.generate([p], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=0,
                                               ignore_eos=True))[0].output_ids
    assert topk == greedy


def test_a_failed_prefill_chunk_fails_its_request_only(engine, monkeypatch):
    """EngineLoop: a step that raises fails the requests it held; a sequence decoding beside it goes on to its end
    (it was failed too: every running sequence's request got the prefill chunk's error)."""
    import asyncio
    from deepinfer.runtime.engine_loop import EngineLoop, TokenEvent
    run = engine.runner.run

    def failing(si):
        if si.kind == "prefill":
            raise RuntimeError("injected prefill failure")
        return run(si)
    monkeypatch.setattr(engine.runner, "run", failing)
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        [a] = await loop.submit([(prompts([3], seed=1)[0], SamplingParams(max_tokens=100, ignore_eos=True))])
        events = [await asyncio.wait_for(a.events.get(), 60)]         # decoding
        [b] = await loop.submit([(prompts([90], seed=2)[0], GREEDY)])   # prefill chunks
        failed = await asyncio.wait_for(b.events.get(), 60)
        while isinstance(events[-1], TokenEvent) and not events[-1].finished:
            events.append(await asyncio.wait_for(a.events.get(), 60))
        return failed, events
    try:
        failed, events = asyncio.run(main())
    finally:
        loop.stop()
    assert isinstance(failed, RuntimeError) and "injected" in str(failed)
    assert all(isinstance(ev, TokenEvent) for ev in events), events[-1]
    assert len(events) == 100 and events[-1].finish_reason == "length"
    assert not engine.has_work


def test_generation_config_eos_ids_stop_sequences_too(engine):
    """generation_config.json's eos_token_id (what transformers' generate stops at; a chat model's end of turn)
    joins config.json's; an id outside the vocabulary is refused, naming the file to look at."""
    import copy
    from deepinfer.common.errors import ArtifactError
    tok = copy.copy(engine.tokenizer)
    tok.generation_eos_ids = (77, 78)
    e = Engine(engine.manifest, engine.runner, tok)
    assert e.eos_ids == set(engine.manifest.model.eos_token_ids) | {77, 78}
    s = e.generate(prompts([6], seed=3), SamplingParams(max_tokens=5, logit_bias=((78, 100.0),)))[0]
    assert s.output_ids == [78] and s.finish_reason == "stop"
    tok.generation_eos_ids = (engine.manifest.model.vocab_size,)
    with pytest.raises(ArtifactError, match="outside the model's vocabulary .*generation_config.json"):
        Engine(engine.manifest, engine.runner, tok)


def test_eos_and_stop_strings_finish_a_sequence(engine):
    p = prompts([8], seed=11)[0]
    full = engine.generate([p], GREEDY)[0]
    eos = full.output_ids[3]
    saved, engine.eos_ids = engine.eos_ids, {eos}
    try:
        stopped = engine.generate([p], SamplingParams(max_tokens=12))[0]
    finally:
        engine.eos_ids = saved
    assert stopped.output_ids == full.output_ids[: full.output_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    text = full.output_text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop and stop in text:
        s = engine.generate([p], SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True))[0]
        assert s.finish_reason == "stop" and s.output_text == text[: text.index(stop)]


@pytest.mark.parametrize("prompt,params,message", [
    ([], GREEDY, "empty"),
    ([5, 320], GREEDY, "token id 320 is outside the vocabulary"),
    ([5, -1], GREEDY, "token id -1"),
    ([5] * 100, SamplingParams(max_tokens=29), "exceeds the compiled context limit 128"),
    ([5], SamplingParams(max_tokens=0), "max_tokens=0"),
    ([5], SamplingParams(top_p=0.0), "top_p=0.0"),
    ([5], SamplingParams(temperature=-1.0), "temperature=-1.0"),
    ([5], SamplingParams(logprobs=-1), "logprobs=-1"),              # topk(-1) failed the step, others with it
    ([5], SamplingParams(logprobs=321), "logprobs=321"),            # more than the vocabulary (320)
    ([5, 6], SamplingParams(prompt_logprobs=321), "prompt_logprobs=321"),
    ([5], SamplingParams(logit_bias=((7, 1.0), (7, 2.0))), "more than once"),
    ([5], SamplingParams(stop_token_ids=tuple(range(1025))), "at most 1024"),
    ([5], SamplingParams(repetition_penalty=1e-50), "repetition_penalty"),
    ([10 ** 9] * 10 ** 6, GREEDY, "exceeds the compiled context limit"),      # before looking at every id
    # values of the wrong type, which a request built in Python can carry (the server's schema refuses them):
    # each was accepted, then raised inside a step and failed every request of that step
    ([5], SamplingParams(temperature=1.0, top_k=5.0), "top_k=5.0 must be an integer"),
    ([5], SamplingParams(logprobs=2.0), "logprobs=2.0 must be an integer"),
    ([5, 6], SamplingParams(prompt_logprobs=2.0), "prompt_logprobs=2.0 must be an integer"),
    ([5], SamplingParams(max_tokens=3.0), "max_tokens=3.0 must be an integer"),   # broke drafted steps only
    ([5], SamplingParams(max_tokens=True), "max_tokens=True must be an integer"),
    ([5], SamplingParams(stop=(5,)), "stop=.* must be a sequence of strings"),
    ([5], SamplingParams(stop="ab"), "stop=ab must be a sequence of strings"),
    ([5], SamplingParams(stop=("",)), "stop strings must not be empty"),
    ([5], SamplingParams(temperature="0.5"), "temperature=0.5 must be a number"),
    ([5], SamplingParams(logit_bias=((7.0, 1.0),)), "logit_bias=.* must be \\(token id, bias\\) pairs"),
    ([5], SamplingParams(ignore_eos=1), "ignore_eos=1 must be true or false"),
])
def test_bad_requests_are_refused_and_lose_nothing(engine, prompt, params, message):
    queued = engine.add_request([7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params)
    while engine.has_work:
        engine.step()
    assert queued.finish_reason == "length" and len(queued.output_ids) == 4
    assert engine.generate([[4, 5, 6]], GREEDY)[0].finish_reason == "length"


def test_abort_frees_blocks(engine):
    s = engine.add_request(prompts([50])[0], SamplingParams(max_tokens=20))
    engine.step()
    engine.step()
    assert engine.scheduler.blocks.num_used > 0
    engine.abort(s)
    assert engine.scheduler.blocks.num_used == 0 and not engine.has_work and s.finish_reason == "abort"


def test_incremental_detokenizer_streams_the_full_text_from_short_windows():
    """Streamed pieces concatenate to the full decode (multi-byte characters held back until complete), and
    each step decodes a few tokens, not the whole output (which made long generations quadratic): through
    tokenizers' DecodeStream, through the Python-side window, and through the window from where a stream failed.
    The text is kept in pieces whose tails read alone (the stop-string search's)."""
    import random
    from deepinfer.compile.options import DEMO_MODEL
    from deepinfer.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
    tok = Tokenizer(DEMO_MODEL / "tokenizer.json", DEMO_MODEL / "tokenizer_config.json", None)
    assert tok.decode_stream() is not None          # tokenizers >= 0.21 (what the constraints install)
    lengths: list[int] = []
    decode = tok.decode
    tok.decode = lambda ids: (lengths.append(len(ids)), decode(ids))[1]
    rng = random.Random(0)
    cases = [tok.encode("naïve café — 日本語 🤖 text\n\twith  spaces", add_special_tokens=False)]
    cases += [[rng.randrange(2, tok.vocab_size) for _ in range(400)] for _ in range(5)]
    make_stream = tok.decode_stream

    def failing_stream(after: int):
        step, n = make_stream(), [0]

        def fail(t):
            n[0] += 1
            if n[0] > after:
                raise RuntimeError("DecodeStreamError: invalid prefix")
            return step(t)
        return lambda: fail
    for mode in ("stream", "window", "stream then window"):
        tok.decode_stream = {"stream": make_stream, "window": lambda: None}.get(mode) or failing_stream(7)
        for ids in cases:
            det = IncrementalDetokenizer(tok)
            lengths.clear()
            streamed = "".join(det.add([i]) for i in ids[:50]) + det.add(ids[50:60]) + \
                "".join(det.add([i]) for i in ids[60:])
            assert max(lengths, default=0) < 40, mode        # short windows, whatever the output length
            assert (mode == "stream") == (not lengths)
            full = decode(ids)
            assert full.startswith(streamed) and len(full) - len(streamed) <= 4, mode
            assert det.text == streamed and det.length == len(streamed)
            # kept as a few pieces (no string copied whole a token), any tail read without the rest
            assert len(det._pieces) <= len(ids) // det.PIECES + det.PIECES + 1
            for start in (-3, 0, 1, len(streamed) // 2, len(streamed) - 5, len(streamed), len(streamed) + 2):
                assert det.text_from(start) == streamed[max(start, 0):], (mode, start)
            assert det.flush() == full and det.text == full and det.text_from(len(full) - 3) == full[-3:]


def test_a_window_that_never_completes_a_character_is_released_as_it_goes():
    """Bytes that never finish a UTF-8 character (a random model's output) are not held until the end: after
    IncrementalDetokenizer.HOLD tokens the text no later token can change comes out, each step still decodes a
    short window, and every streamed text is a prefix of the whole decode at that point, in both decode modes
    (the stream hands such a sequence to the window). Checked on runs of one lead byte, invalid bytes, and random
    mixes of lone high bytes, whole multi-byte characters split across tokens, and ASCII, fed in chunks of 1-5."""
    import random
    from deepinfer.compile.options import DEMO_MODEL
    from deepinfer.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
    tok = Tokenizer(DEMO_MODEL / "tokenizer.json", DEMO_MODEL / "tokenizer_config.json", None)
    byte_id = {tok.token_bytes(i)[0]: i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    assert len(byte_id) == 256                       # a byte-level BPE: every byte is a token
    lengths: list[int] = []
    decode = tok.decode
    tok.decode = lambda ids: (lengths.append(len(ids)), decode(ids))[1]
    rng = random.Random(5)
    chars = [c.encode() for c in "é日本語🤖€"] + [b"a", b" the", b"\n"]

    def mixed(n: int) -> list[int]:
        out = []
        while len(out) < n:
            pick = rng.random()
            if pick < 0.5:
                out.append(byte_id[rng.randrange(0x80, 0x100)])          # a lone high byte: lead, continuation, invalid
            elif pick < 0.8:
                out += [byte_id[b] for b in rng.choice(chars)]             # a character, a byte a token
            else:
                out += tok.encode(rng.choice(["word", " text", "語"]), add_special_tokens=False)
        return out[:n]
    cases = [[byte_id[0xE4]] * 300, [byte_id[0xFF]] * 100 + [byte_id[0xF0]] * 200] + [mixed(300) for _ in range(12)]
    hold = IncrementalDetokenizer.HOLD
    make_stream = tok.decode_stream
    for mode in ("stream", "window"):
        tok.decode_stream = make_stream if mode == "stream" else (lambda: None)
        for ids in cases:
            det = IncrementalDetokenizer(tok)
            lengths.clear()
            streamed, i = "", 0
            while i < len(ids):
                n = rng.randint(1, 5)
                streamed += det.add(ids[i:i + n])
                i += n
                assert decode(ids[:i]).startswith(streamed), (mode, i)
                assert len(det.ids) - det.read <= hold + 5, (mode, i)       # what is held stays bounded
            assert det.text == streamed and max(lengths, default=0) <= 3 * hold, (mode, max(lengths))
            if ids[0] == byte_id[0xE4]:
                assert len(streamed) >= 300 - hold - 5                     # 300 U+FFFD, all but the held tail out
            assert det.flush() == decode(ids)


def test_cpu_weights_load_into_an_anonymous_arena_with_the_file_values(artifact):
    """CPU weights are copied out of the safetensors file mapping into one huge-page-advised arena: same names,
    values, dtypes and shapes as the file, each 64-byte aligned, sharing one buffer."""
    from safetensors.torch import load_file
    from deepinfer.runtime.artifact import _into_huge_page_arena, load_weights, open_artifact
    art = open_artifact(artifact)
    loaded = load_weights(art, 0, torch.device("cpu"))
    on_disk = load_file(str(art.file(art.manifest.weights[0].path)))
    assert list(loaded) == list(on_disk)
    for name, t in on_disk.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
        assert loaded[name].data_ptr() % 64 == 0 and loaded[name].is_contiguous()
    assert len({t.untyped_storage().data_ptr() for t in loaded.values()}) == 1
    odd = {"empty": torch.zeros(0, 3), "flags": torch.tensor([True, False]), "half": torch.randn(5, 3).bfloat16()}
    for name, t in _into_huge_page_arena(odd).items():
        assert t.dtype == odd[name].dtype and torch.equal(t, odd[name])


def test_a_device_the_host_or_artifact_cannot_run_is_refused_before_loading(artifact):
    from deepinfer.common.errors import OptionError
    from deepinfer.runtime.artifact import check_device, open_artifact
    m = open_artifact(artifact).manifest          # eager: cpu or cuda
    check_device(m, "cpu")
    with pytest.raises(OptionError, match="--device cpu:3: the CPU is one device"):   # was safetensors' traceback
        check_device(m, "cpu:3")
    with pytest.raises(OptionError, match="--device 'foo' is not a device"):
        Engine.from_artifact(artifact, device="foo")
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match="--device cuda:0: no CUDA device is available here"):
            check_device(m, "cuda:0")
    aoti = dataclasses.replace(m, compile=dataclasses.replace(m.compile, backend="cpu"))
    with pytest.raises(OptionError, match="backend is cpu, which runs on cpu"):
        check_device(aoti, "cuda")


def test_ranks_on_one_host_need_a_gpu_each(artifact, monkeypatch):
    from deepinfer.common.errors import OptionError
    from deepinfer.runtime.artifact import check_device, open_artifact
    m = open_artifact(artifact).manifest
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device(m, "cuda", ranks_here=2)
    check_device(m, "cuda:1")
    with pytest.raises(OptionError, match="4 of this artifact's ranks \\(cp x ep\\) run on this host, which has 2 "
                                          "CUDA device"):
        check_device(m, "cuda", ranks_here=4)
    # under torchrun, this host's share of the ranks is its LOCAL_WORLD_SIZE (checked before any loading)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(OptionError, match="3 of this artifact's ranks"):
        Engine.from_artifact(artifact, device="cuda", torchrun=(1, 4))
    with pytest.raises(OptionError, match="--device cuda:1 names one GPU, but this artifact's 2 ranks"):
        check_device(m, "cuda:1", ranks_here=2)
    with pytest.raises(OptionError, match="this host has 2 CUDA device"):
        check_device(m, "cuda:2")


def test_a_kv_pool_too_large_for_the_host_is_named(artifact):
    from deepinfer.common.errors import ArtifactError
    from deepinfer.runtime.artifact import open_artifact
    from deepinfer.runtime.model_runner import ModelRunner
    m = open_artifact(artifact).manifest
    huge = dataclasses.replace(m, compile=dataclasses.replace(m.compile, num_kv_blocks=1 << 40))
    with pytest.raises(ArtifactError, match=r"the KV pool \(\d+ blocks a rank, [\d.]+ GiB\) does not fit on cpu .*"
                                            r"recompile with a smaller --num-kv-blocks"):
        ModelRunner(huge, {}, {})


def test_region_timing_covers_every_region_per_step_kind(checkpoints, compile_artifact):
    """DEEPINFER_REGION_TIMING: each step kind's table has every graph region that ran and the host's two
    shares, with per-step totals that add up."""
    from deepinfer.runtime.artifact import open_artifact
    from deepinfer.runtime.engine import make_runner
    art = open_artifact(compile_artifact(checkpoints["base"]))
    engine = Engine(art.manifest, make_runner(art, rank=0, timing=True), None)
    engine.generate([list(range(3, 40)), [5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))
    timer = engine.runner.timer
    for kind in ("prefill", "decode"):
        regions = {r for k, r in timer.totals if k == kind}
        assert regions == {"embed", "dense_layer", "moe_layer", "head", "schedule", "sample"}, (kind, regions)
        assert all(timer.totals[(kind, r)] > 0 for r in regions)
        assert timer.counts[(kind, "moe_layer")] == 2 * timer.steps[kind]        # two MoE layers a step
    lines = timer.table().splitlines()
    step = {ln.split()[0]: float(ln.split()[-2]) for ln in lines if "(step)" in ln}
    for kind in ("prefill", "decode"):
        parts = sum(float(ln.split()[-2]) for ln in lines[1:] if ln.split()[0] == kind and "(step)" not in ln)
        assert step[kind] == pytest.approx(parts, abs=0.3)


def test_region_timer_splits_a_graph_at_its_marks():
    """RegionTimer.time_graph on a stand-in graph with known parts: the work before a collective goes to the part
    that encloses it (attention, moe), the collective's own time to `collectives`, the return to the last part."""
    from deepinfer.runtime.model_runner import RegionTimer
    from deepinfer.runtime.ops import MARK_CONTINUE, MARK_PARTS
    mark = lambda part: torch.ops.deepinfer.region_mark(torch.zeros(4), MARK_CONTINUE if part is None
                                                        else MARK_PARTS.index(part))
    def graph(steps):
        for seconds, part in steps:
            time.sleep(seconds)
            mark(part)
        time.sleep(0.01)                     # returning
        return "out"
    layer = [(0.05, None), (0.02, "collectives"), (0.03, "attention"),                     # CP gather inside
             (0.06, None), (0.04, "collectives"), (0.005, "moe"), (0.015, None), (0.025, "collectives"),
             (0.005, "moe")]                                                               # EP all-reduce, overflow
    rerun = [(0.06, None), (0.02, "collectives"), (0.005, "moe")]                            # moe_dense
    timer = RegionTimer(torch.device("cpu"))
    assert timer.time_graph("prefill", "moe_layer", graph, layer) == "out"
    timer.time_graph("prefill", "moe_dense", graph, rerun)
    want = {"moe_layer": {"attention": 0.08, "collectives": 0.085, "moe": 0.095},
            "moe_dense": {"collectives": 0.02, "moe": 0.075}}
    for region, parts in want.items():
        got = {p: t for (k, r, p), t in timer.parts.items() if r == region}
        assert set(got) == set(parts)
        assert all(abs(got[p] - parts[p]) < 0.012 for p in parts), (region, got)
        assert sum(got.values()) == pytest.approx(timer.totals[("prefill", region)], rel=1e-9)


def test_region_marks_split_each_layer_into_its_parts(checkpoints, compile_artifact):
    """compile --region-marks: the timing table splits each layer graph's time into attention and MoE or MLP
    (the parts sum to the graph's time), the tokens are the unmarked artifact's, and an artifact without the
    option carries no trace of it in its manifest (its hashes are those of before the option)."""
    import json
    from deepinfer.runtime.artifact import open_artifact
    from deepinfer.runtime.engine import make_runner
    prompts = [list(range(3, 40)), [5, 6, 7]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    plain = compile_artifact(checkpoints["base"])
    want = [s.output_ids for s in Engine.from_artifact(plain).generate(prompts, params)]
    assert "region_marks" not in json.loads((plain / "manifest.json").read_text())["compile"]
    art = open_artifact(compile_artifact(checkpoints["base"], region_marks=True))
    assert art.manifest.compile.region_marks is True
    engine = Engine(art.manifest, make_runner(art, rank=0, timing=True), None)
    assert [s.output_ids for s in engine.generate(prompts, params)] == want
    timer = engine.runner.timer
    for kind in ("prefill", "decode"):
        for region, parts in (("dense_layer", {"attention", "mlp"}), ("moe_layer", {"attention", "moe"})):
            got = {p: t for (k, r, p), t in timer.parts.items() if (k, r) == (kind, region)}
            assert set(got) == parts and all(t > 0 for t in got.values()), (kind, region, got)
            assert sum(got.values()) == pytest.approx(timer.totals[(kind, region)], rel=1e-9)
    lines = timer.table().splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["decode", "moe_layer"])
    assert [ln.split()[0] for ln in lines[i + 1: i + 3]] == ["attention", "moe"]
    # the unmarked artifact's timer has no parts
    plain_art = open_artifact(plain)
    engine = Engine(plain_art.manifest, make_runner(plain_art, rank=0, timing=True), None)
    engine.generate(prompts, params)
    assert engine.runner.timer.parts == {}
    assert engine.runner.timer.table().splitlines()[-1].startswith("layer graphs timed whole: an artifact compiled "
                                                                   "with --region-marks splits them")
    assert "--region-marks" not in timer.table()


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's allocator only")
@pytest.mark.parametrize("keep", ["1", "0"])
def test_cpu_runner_keeps_freed_activation_memory(keep):
    """keep_freed_memory (make_runner applies it on the CPU) serves MB-sized buffers from the heap, which is never
    trimmed, instead of fresh mappings that go back to the kernel when freed: a 24 MB tensor lands next to a
    small one (glibc as it comes maps it apart), and a repeated step of four 4 MB buffers stops faulting pages in
    once the heap has grown to it. In a subprocess: the setting is process-wide."""
    import os
    import subprocess
    import sys
    code = """
import resource, torch
from deepinfer.runtime.engine import keep_freed_memory
applied = keep_freed_memory()
small, big = torch.empty(16), torch.empty(6 << 20)
near = abs(big.data_ptr() - small.data_ptr()) < (1 << 30)
del big
def step():
    ts = [torch.empty(1 << 20) for _ in range(4)]
    for t in ts:
        t.fill_(1.0)
for _ in range(20):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, near, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DEEPINFER_MALLOC_KEEP": keep}).stdout.split()
    applied, near, faults = out[0] == "True", out[1] == "True", int(out[2])
    if keep == "1":
        assert applied and near and faults < 256, (applied, near, faults)
    else:
        assert not applied and not near, (applied, near)


def test_warmup_runs_every_step_shape_on_padding_and_changes_nothing(artifact, engine):
    """The server's start-up warm-up (on by default off the CPU): every graph but the static path's dense rerun
    runs once, on padding only, and the engine then generates exactly what an engine without it does."""
    want = [s.output_ids for s in engine.generate(prompts([3, 40, 9]), GREEDY)]
    warm = Engine.from_artifact(artifact)
    calls = {name: 0 for name in warm.runner.graphs}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call
    warm.runner.graphs = {name: counted(name, fn) for name, fn in warm.runner.graphs.items()}
    free = warm.scheduler.blocks.num_free
    steps = warm.warmup(log=lambda line: None)
    assert steps >= len(warm.manifest.compile.decode_buckets) and warm.scheduler.blocks.num_free == free
    assert [name for name, n in calls.items() if n == 0 and not name.startswith("moe_dense")] == []
    assert [s.output_ids for s in warm.generate(prompts([3, 40, 9]), GREEDY)] == want


def test_the_engine_loop_stops_on_a_rank_failure_also_when_idle_or_out_of_step():
    """With followers: a rank that died while no request ran stops the loop (and so the server, /health) within
    the idle poll, not at the next request; a step that raises on the leader is fatal (the followers ran or wait
    in its collectives: the ranks are out of step), where alone it fails only its own requests."""
    import threading
    from deepinfer.common.errors import RankFailure
    from deepinfer.runtime.engine_loop import EngineLoop

    class Followers:
        failure = None

        def check(self):
            if self.failure is not None:
                raise self.failure

    class Idle:                          # an engine with nothing to do
        followers = Followers()
        has_work = False

    fatal = threading.Event()
    idle = Idle()
    loop = EngineLoop(idle, on_fatal=lambda e: fatal.set())
    loop.start()
    try:
        time.sleep(0.2)
        assert loop.alive
        idle.followers.failure = RankFailure("follower rank 1 exited with code -9 (SIGKILL)")
        assert fatal.wait(5) and isinstance(loop.error, RankFailure) and not loop.alive
    finally:
        loop.stop()

    class Failing(Idle):                 # a step that raises, followers alive
        followers = Followers()
        has_work = True

        def step(self):
            raise RuntimeError("injected")
    fatal.clear()
    loop = EngineLoop(Failing(), on_fatal=lambda e: fatal.set())
    loop.start()
    try:
        assert fatal.wait(5) and isinstance(loop.error, RankFailure) and "out of step" in str(loop.error)
    finally:
        loop.stop()


def _overlapped(engine) -> Engine:
    return Engine(engine.manifest, engine.runner, engine.tokenizer, overlap=True)


def _outputs(seqs):
    return [(s.output_ids, s.output_text, s.finish_reason, s.token_logprobs) for s in seqs]


def test_overlapped_scheduling_changes_no_output(engine):
    """The next decode step launched before this one's tokens reach the host (its tokens fed on the device):
    every request gets what the plain loop gives, whether its steps were chained (greedy and seeded sampling,
    finishing by length at different steps, EOS, a stop string) or not (penalties, min_tokens, logprobs)."""
    ps = prompts([3, 9, 20, 70, 5, 12, 7, 4], seed=21)
    ref_seq = engine.generate([ps[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop = ref_seq.output_text[len(ref_seq.output_text) // 2:][:2]
    params = [SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=1.2, top_k=20, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=18, ignore_eos=True, stop=(stop,) if stop.strip() else ()),
              SamplingParams(max_tokens=16),                                   # EOS below
              SamplingParams(max_tokens=9, repetition_penalty=1.3, min_tokens=3, ignore_eos=True),
              SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True)]
    plain = engine.generate([ps[5]], SamplingParams(max_tokens=16, ignore_eos=True))[0].output_ids
    saved, engine.eos_ids = engine.eos_ids, {plain[4]}          # the sixth request stops early
    over = _overlapped(engine)
    over.eos_ids = engine.eos_ids
    try:
        want = _outputs(engine.generate(ps, params))
        got = _outputs(over.generate(ps, params))
        # one at a time: every step of a lone greedy or seeded request chains to the one before
        alone = [_outputs(over.generate([p], sp)) for p, sp in zip(ps[:4], params[:4])]
    finally:
        engine.eos_ids = saved
    assert got == want
    assert [a[0] for a in alone] == want[:4]
    assert want[5][2] == "stop" and want[5][0] == plain[:plain.index(plain[4]) + 1]
    assert over.num_chained > 0 and not over.has_work
    assert over.scheduler.blocks.num_free == over.scheduler.blocks.num_blocks


def test_overlapped_scheduling_takes_arrivals_and_aborts_mid_chain(engine):
    """A request that arrives, or one aborted, while a chained step is in flight: the others' outputs are as the
    plain loop gives them, and every block comes back."""
    ps = prompts([6, 11, 4], seed=31)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [engine.generate([p], params)[0].output_ids for p in ps]
    over = _overlapped(engine)
    a, b = (over.add_request(p, params) for p in ps[:2])
    while over._inflight is None:
        over.step()
    c = over.add_request(ps[2], params)              # arrives mid-chain
    for _ in range(3):
        over.step()
    assert over._inflight is not None
    over.abort(b)                                    # aborted while its chained step is in flight
    while over.has_work:
        over.step()
    assert a.output_ids == want[0] and c.output_ids == want[2]
    assert b.finish_reason == "abort" and b.output_ids == want[1][:len(b.output_ids)]
    assert over.scheduler.blocks.num_free == over.scheduler.blocks.num_blocks


def test_a_failed_chained_step_fails_its_requests_and_the_loop_goes_on(engine, monkeypatch):
    """EngineLoop over an overlapped engine: tokens stream as the plain loop gives them; a step that raises while
    a chained step is in flight fails its requests (the chained step goes with it), frees their blocks, and the
    next request is served."""
    import asyncio
    from deepinfer.runtime.engine_loop import EngineLoop, TokenEvent
    over = _overlapped(engine)
    ps = prompts([5, 8, 6], seed=41)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [engine.generate([p], params)[0].output_ids for p in ps]
    run, calls = over.runner.run, []

    def failing(si):
        calls.append(si.fed_rows is not None)
        if failing.armed and calls[-1] and sum(calls) == 4:
            raise RuntimeError("injected chained-step failure")
        return run(si)
    monkeypatch.setattr(over.runner, "run", failing)
    loop = EngineLoop(over)
    loop.start()

    async def collect(stream):
        events = []
        while not events or (isinstance(events[-1], TokenEvent) and not events[-1].finished):
            events.append(await asyncio.wait_for(stream.events.get(), 60))
        return events

    async def main():
        failing.armed = False
        [a] = await loop.submit([(ps[0], params)])
        ok = await collect(a)
        failing.armed = True
        calls.clear()
        [b] = await loop.submit([(ps[1], params)])
        failed = await collect(b)
        [c] = await loop.submit([(ps[2], params)])
        after = await collect(c)
        return ok, failed, after
    try:
        ok, failed, after = asyncio.run(main())
    finally:
        loop.stop()
    assert [e.token_id for e in ok] == want[0] and [e.token_id for e in after] == want[2]
    assert isinstance(failed[-1], RuntimeError) and "injected" in str(failed[-1])
    assert not over.has_work and over.scheduler.blocks.num_used == 0


def test_overlap_turned_off_mid_chain_finishes_the_step_in_flight(engine, monkeypatch):
    """The chained step in flight when overlap is turned off still ends (its tokens are not lost); the switch's
    environment variable takes 1/0 words and names itself when it is neither."""
    from deepinfer.common.errors import OptionError
    p = prompts([7], seed=51)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = engine.generate([p], params)[0].output_ids
    over = _overlapped(engine)
    s = over.add_request(p, params)
    while over._inflight is None:
        over.step()
    over.overlap = False
    while over.has_work:
        over.step()
    assert s.output_ids == want and over._inflight is None
    for value, on in (("off", False), ("1", True), ("", False)):
        monkeypatch.setenv("DEEPINFER_OVERLAP", value)
        assert Engine(engine.manifest, engine.runner, engine.tokenizer).overlap is on
    monkeypatch.setenv("DEEPINFER_OVERLAP", "maybe")
    with pytest.raises(OptionError, match="DEEPINFER_OVERLAP='maybe'"):
        Engine(engine.manifest, engine.runner, engine.tokenizer)


def test_step_inputs_feed_writes_the_device_tokens_into_their_rows():
    """StepInputs.feed: token_ids[fed_rows] = fed_tokens[fed_from], the rows in order (a chained step's layout)
    or not; a step without fed rows is left as it is."""
    import numpy as np
    from deepinfer.runtime.model_runner import StepInputs
    z = np.zeros(4, np.int64)
    si = StepInputs("decode", 4, 64, z.copy(), z, z, np.zeros((4, 1), np.int64), z, 4, z)
    ids = torch.tensor([5, 6, 7, 8])
    si.feed(ids)
    assert ids.tolist() == [5, 6, 7, 8]
    si.fed_tokens = torch.tensor([40, 41, 42])
    for rows, src, want in (([0, 1, 2], [0, 1, 2], [40, 41, 42, 8]), ([3, 0], [2, 1], [41, 6, 7, 42])):
        si.fed_rows, si.fed_from = np.array(rows), np.array(src)
        ids = torch.tensor([5, 6, 7, 8])
        si.feed(ids)
        assert ids.tolist() == want


def test_stop_strings_see_the_text_the_detokenizer_held_back(engine):
    """Text held back as an incomplete UTF-8 character comes out at the last token; a stop string in it stops the
    sequence (it was output whole, finish_reason 'length'). And that held text counts with min_tokens' tokens:
    a stop string inside it does not cut the output short of them."""
    tok = engine.tokenizer
    # a token whose bytes end in an unfinished character, so every token leaves the text unfinished
    held = next(t for t in range(tok.vocab_size) if tok.decode([t]).endswith("\ufffd") and
                tok.decode([t]).strip() and tok.decode([t, t]).count("\ufffd") == 2)
    forced = dict(max_tokens=3, logit_bias=((held, 100.0),), ignore_eos=True)
    p = prompts([5], seed=71)[0]
    plain = engine.generate([p], SamplingParams(**forced))[0]
    assert plain.output_ids == [held] * 3 and plain.finish_reason == "length"
    text = plain.output_text
    assert text == tok.decode([held] * 3) and text.endswith("\ufffd")
    stop = text[-2:]
    s = engine.generate([p], SamplingParams(**forced, stop=(stop,)))[0]
    assert s.finish_reason == "stop" and s.output_text == text[:text.index(stop)]
    # min_tokens 2: the first two tokens' text (held until the third) is not searched, the third's is
    first2 = tok.decode([held] * 2)
    assert text.startswith(first2) and len(text) > len(first2), (text, first2)
    m = engine.generate([p], SamplingParams(**forced, min_tokens=2, stop=(text[len(first2) - 1:],)))[0]
    assert m.finish_reason == "length" and m.output_text == text
    m = engine.generate([p], SamplingParams(**forced, min_tokens=2, stop=(text[len(first2):],)))[0]
    assert m.finish_reason == "stop" and m.output_text == first2
