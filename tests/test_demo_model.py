"""The embedded demo model: transformers agrees with us token for token, and it speaks corpus English."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from deepinfer.compile.options import DEMO_MODEL
from deepinfer.runtime.engine import Engine
from deepinfer.runtime.sequence import SamplingParams


@pytest.fixture(scope="module")
def engine(compile_artifact):
    e = Engine.from_artifact(compile_artifact(DEMO_MODEL, decode_buckets=(1, 4), prefill_buckets=(32,),
                                              context_limit=256, context_buckets=(128,)))
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return json.loads((DEMO_MODEL / "heldout_prompts.json").read_text())


def test_transformers_greedy_equals_ours(engine, prompts):
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    hf = DeepseekV3ForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    for text in prompts[:4]:
        ids = tok(text).input_ids
        assert engine.tokenizer.encode(text) == ids
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
        got = engine.generate([ids], SamplingParams(max_tokens=48))[0].output_ids
        assert got == want, text


def test_generated_words_are_corpus_words(engine, prompts):
    with gzip.open(DEMO_MODEL / "corpus_words.txt.gz", "rt") as f:
        vocab = set(f.read().split())
    seqs = engine.generate([engine.tokenizer.encode(p) for p in prompts[:10]], SamplingParams(max_tokens=64))
    words = [w for s in seqs for w in s.output_text.split()]
    known = sum(w in vocab for w in words)
    assert len(words) >= 100
    assert known / len(words) >= 0.9, f"{known}/{len(words)} generated words are corpus words"
