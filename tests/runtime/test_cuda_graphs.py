"""StepGraphs' bookkeeping, on the CPU: which steps it captures, the static input buffers each replay reads
(prefill chunks' context starts included), the output buffer it hands back. torch.cuda's graph API is
replaced by stand-ins whose replay reruns the captured forward on the captured (static) tensors and writes
into the captured output, as a CUDA graph's replay does; the kernels themselves need a GPU
(benchmarks/gpu_v2lite.py compares replays with launched steps there)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from deepinfer.common.manifest import DECODE, PREFILL
from deepinfer.runtime import cuda_graphs
from deepinfer.runtime.engine import Engine
from deepinfer.runtime.sequence import SamplingParams


class _Stream:
    def wait_stream(self, other) -> None:
        pass


class _Graph:
    def __init__(self):
        self.replay_fn = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.replay_fn()


@pytest.fixture
def cpu_graph_api(monkeypatch):
    """torch.cuda's capture API as CPU stand-ins; yields the runner hook that capture records through."""
    captured: list[_Graph] = []

    @contextlib.contextmanager
    def graph(g: _Graph, pool=None, capture_error_mode=None):
        runner = cpu_graph_api.runner
        forward = runner.forward

        def recording(*args):
            if cpu_graph_api.fail_capture:      # what CUDA reports for a host sync inside a capture
                raise torch.AcceleratorError("CUDA error: operation not permitted when stream is capturing")
            out = forward(*args)
            g.replay_fn = lambda: out.copy_(forward(*args))     # the same tensors: the static buffers
            return out
        runner.forward = recording
        try:
            yield
        finally:
            del runner.forward              # back to the class's method
        captured.append(g)

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    cpu_graph_api.captured = captured
    cpu_graph_api.fail_capture = False
    yield cpu_graph_api


def test_replayed_steps_match_launched_ones(checkpoints, compile_artifact, cpu_graph_api):
    """Prefill chunks of one prompt and of two packed ones (the second starts mid-chunk: its context start must
    reach the replay; a head row each: another shape), then decode steps; another round of two prompts replays
    the captured shapes with new inputs. Tokens and every replay's logits equal the launched steps'."""
    art = compile_artifact(checkpoints["base"])
    plain = Engine.from_artifact(art, prefix_caching=False)
    eng = Engine.from_artifact(art, prefix_caching=False)
    cpu_graph_api.runner = eng.runner
    sg = eng.runner.step_graphs = cuda_graphs.StepGraphs(eng.runner)
    assert sg.kinds == {DECODE, PREFILL}            # the grouped MoE path makes no host syncs
    sg.check = True
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    # one prompt first (a one-row head), then two packed in the same chunk bucket (a head row each): two shapes
    for prompts in ([list(range(80, 93))], [list(range(3, 13)), list(range(20, 32))],
                    [list(range(40, 51)), list(range(60, 73))]):
        want = [s.output_ids for s in plain.generate(prompts, params)]
        got = [s.output_ids for s in eng.generate(prompts, params)]
        assert got == want
    assert not sg.failed
    assert {k for k, _, _, _ in sg.graphs} == {DECODE, PREFILL}
    prefill_rows = sorted(rows for k, _, _, rows in sg.graphs if k == PREFILL)
    assert len(prefill_rows) == 2 and prefill_rows[0] == 1
    two = [g for (k, _, _, rows), (g, _, _) in sg.graphs.items() if k == PREFILL and rows > 1]
    assert two[0].replays == 2                      # captured in one round, replayed with new inputs in the next
    for key, (worst, agree, count) in sg.checks.items():
        assert worst == 0.0 and agree == 1.0 and count >= 1, key
    for _, staged, _ in sg.graphs.values():          # views of one buffer, each 16-byte aligned (Inductor's assumption)
        assert all(v.data_ptr() % 16 == 0 for v in staged.views)


def test_a_failed_capture_launches_that_shape_kernel_by_kernel(checkpoints, compile_artifact, cpu_graph_api):
    """An error inside the capture (CUDA raises a host sync there as torch.AcceleratorError, as it does a device
    fault) is the capture's: the shape is marked failed once and its steps launch one by one, with the plain
    loop's tokens; the same error in a warm-up run, outside the capture, is a device fault and propagates."""
    art = compile_artifact(checkpoints["base"])
    plain = Engine.from_artifact(art, prefix_caching=False)
    eng = Engine.from_artifact(art, prefix_caching=False)
    cpu_graph_api.runner = eng.runner
    sg = eng.runner.step_graphs = cuda_graphs.StepGraphs(eng.runner)
    cpu_graph_api.fail_capture = True
    prompts, params = [list(range(7, 19))], SamplingParams(max_tokens=5, ignore_eos=True)
    want = [s.output_ids for s in plain.generate(prompts, params)]
    assert [s.output_ids for s in eng.generate(prompts, params)] == want
    assert not sg.graphs and {k for k, _, _, _ in sg.failed} == {DECODE, PREFILL}
    assert all("not permitted when stream is capturing" in why for why in sg.failed.values())
    assert not cpu_graph_api.captured
    # a warm-up fault: not swallowed
    sg2 = eng.runner.step_graphs = cuda_graphs.StepGraphs(eng.runner)

    def faulting(*args):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    eng.runner.forward = faulting
    try:
        with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
            eng.generate([list(range(3, 9))], params)
    finally:
        del eng.runner.forward              # back to the class's method
    assert not sg2.failed


def test_static_moe_path_replays_decode_only(checkpoints, compile_artifact, cpu_graph_api):
    """On the static MoE path a prefill chunk reads its layers' overflow flags on the host: not capturable,
    so prefill chunks launch one by one and decode steps still replay."""
    art = compile_artifact(checkpoints["base"], moe_path="static")
    eng = Engine.from_artifact(art, prefix_caching=False)
    cpu_graph_api.runner = eng.runner
    sg = eng.runner.step_graphs = cuda_graphs.StepGraphs(eng.runner)
    assert sg.kinds == {DECODE}
    eng.generate([list(range(3, 20))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert {k for k, _, _, _ in sg.graphs} == {DECODE}


def test_chained_steps_replay_with_their_tokens_fed_on_the_device(checkpoints, compile_artifact, cpu_graph_api):
    """Overlapped scheduling over replayed graphs: a chained step's token ids are written into the graph's static
    input buffer after the host's copy (the host has only placeholders for them). Tokens equal the plain loop's,
    and every replay equals its step launched one by one (which feeds the same tokens)."""
    art = compile_artifact(checkpoints["base"])
    plain = Engine.from_artifact(art, prefix_caching=False)
    eng = Engine.from_artifact(art, prefix_caching=False, overlap=True)
    cpu_graph_api.runner = eng.runner
    sg = eng.runner.step_graphs = cuda_graphs.StepGraphs(eng.runner)
    sg.check = True
    prompts = [list(range(5, 14)), list(range(30, 35)), list(range(50, 53))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 14, 5)]
    want = [s.output_ids for s in plain.generate(prompts, params)]
    got = [s.output_ids for s in eng.generate(prompts, params)]
    assert got == want and eng.num_chained > 5
    for key, (worst, agree, count) in sg.checks.items():
        assert worst == 0.0 and agree == 1.0 and count >= 1, key
