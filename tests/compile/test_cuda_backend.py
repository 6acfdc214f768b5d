"""The cuda backend's CPU-testable part: exported graphs compiled at load with torch.compile (on the CPU
here; CUDA-graph replay of decode steps needs a GPU and is exercised by benchmarks/gpu_v2lite.py)."""

from __future__ import annotations

import pytest

from checkpoints import hf_greedy, hf_model
from deepinfer.common.manifest import Manifest
from deepinfer.runtime.engine import Engine
from deepinfer.runtime.sequence import SamplingParams


@pytest.mark.slow
def test_cuda_artifact_compiled_at_load_matches_transformers(checkpoints, compile_artifact):
    art = compile_artifact(checkpoints["base"], backend="cuda", decode_buckets=(2,), prefill_buckets=(16,),
                           context_limit=64, context_buckets=())
    m = Manifest.read(art)
    assert m.toolchain.backend == "cuda" and all(g.file.endswith(".ep.pt2") for g in m.graphs)
    engine = Engine.from_artifact(art, device="cpu")
    hf = hf_model(checkpoints["base"])
    for prompt in ([7, 8, 9], list(range(5, 40))):
        got = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids
        assert got == hf_greedy(hf, prompt, 12)
