"""The cuda backend's CPU-testable part: exported graphs compiled at load with torch.compile (on the CPU
here; CUDA-graph replay of decode steps needs a GPU and is exercised by benchmarks/gpu_v2lite.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import TINY, hf_greedy, hf_model
from deepinfer.common.manifest import Manifest
from deepinfer.common.model_config import ModelConfig
from deepinfer.compile.graphs import example_inputs, export_graph, plan_graphs
from deepinfer.compile.options import CompileOptions, resolve
from deepinfer.runtime.artifact import exported_on
from deepinfer.runtime.engine import Engine
from deepinfer.runtime.sequence import SamplingParams


def test_graphs_move_to_the_device_before_compiling():
    """Export traces on the CPU and bakes device=cpu into the nodes that make or check tensors; compiled as is,
    a graph refuses inputs on another device. The meta device stands in for cuda:0 here (Dynamo's device check
    is the same): unmoved, the first call fails; moved, it runs and its outputs are on the device."""
    m = ModelConfig.from_hf_dict(dict(TINY, model_type="deepseek_v3"))
    cc = resolve(CompileOptions(model=Path("tiny"), out=Path("unused"), backend="cuda", decode_buckets=(2,),
                                prefill_buckets=(16,), context_limit=64, context_buckets=()), m)
    plan = next(p for p in plan_graphs(m, cc) if p.spec.region == "moe_layer" and p.spec.kind == "decode")
    ep, _ = export_graph(plan)

    def cpu_nodes(program):
        return [n for n in program.graph.nodes if n.op == "call_function" and any(
            isinstance(v, torch.device) and v.type == "cpu" for v in n.kwargs.values())]
    assert cpu_nodes(ep)                     # what the move is for
    args = example_inputs(plan, device="meta")
    with pytest.raises(Exception, match="(?i)device"):
        torch.compile(ep.module(), backend="eager", fullgraph=True, dynamic=False)(*args)
    moved = exported_on(ep, torch.device("meta"))
    assert not cpu_nodes(moved)
    out = torch.compile(moved.module(), backend="eager", fullgraph=True, dynamic=False)(*args)
    outs = out if isinstance(out, (list, tuple)) else [out]
    assert outs and all(o.device.type == "meta" for o in outs)
    assert exported_on(ep, torch.device("cpu")) is ep


def test_decode_linears_are_rewritten_to_the_measured_kernel_choice():
    """On CUDA, bf16 linears of at most SKINNY_MAX_ROWS rows go through deepinfer::rows_linear (cuBLAS or the Triton
    skinny GEMM, measured per shape on the device); the rewritten program computes the same (on the CPU here, where
    the op is torch's own linear), and wider row counts (prefill chunks) and fp32 linears (the router) stay."""
    from deepinfer.runtime.artifact import skinny_linears
    from deepinfer.runtime.cuda_kernels import SKINNY_MAX_ROWS
    m = ModelConfig.from_hf_dict(dict(TINY, model_type="deepseek_v3"))
    cc = resolve(CompileOptions(model=Path("tiny"), out=Path("unused"), backend="cuda", dtype="bfloat16",
                                decode_buckets=(2,), prefill_buckets=(80,), context_limit=128, context_buckets=()), m)
    plans = [p for p in plan_graphs(m, cc) if p.spec.region == "moe_layer"]
    for plan in plans:
        ep, _ = export_graph(plan)
        args = example_inputs(plan, device="cpu")
        want = ep.module()(*args)

        def linears(program):
            return [(n.args[0].meta["val"].shape[0], n.args[0].meta["val"].dtype) for n in program.graph.nodes
                    if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
        before = linears(ep)
        skinny = [(r, dt) for r, dt in before if r <= SKINNY_MAX_ROWS and dt == torch.bfloat16]
        assert skinny_linears(ep) == len(skinny)
        assert linears(ep) == [(r, dt) for r, dt in before if (r, dt) not in skinny]
        if plan.spec.kind == "decode":
            assert skinny and any(dt == torch.float32 for _, dt in linears(ep))     # the router stays fp32
        else:
            assert not skinny
        got = ep.module()(*args)
        for a, b in zip(want if isinstance(want, (list, tuple)) else [want],
                        got if isinstance(got, (list, tuple)) else [got], strict=True):
            if a.is_floating_point():
                torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_cuda_artifact_compiled_at_load_matches_transformers(checkpoints, compile_artifact):
    art = compile_artifact(checkpoints["base"], backend="cuda", decode_buckets=(2,), prefill_buckets=(16,),
                           context_limit=64, context_buckets=())
    m = Manifest.read(art)
    assert m.toolchain.backend == "cuda" and all(g.file.endswith(".ep.pt2") for g in m.graphs)
    assert m.compile.shared_experts_grouped          # auto: the shared expert is a group of the experts
    engine = Engine.from_artifact(art, device="cpu")
    hf = hf_model(checkpoints["base"])
    for prompt in ([7, 8, 9], list(range(5, 40))):
        got = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids
        assert got == hf_greedy(hf, prompt, 12)


def test_the_gpu_benchmark_runs_whole_on_the_cpu(tmp_path):
    """benchmarks/gpu_v2lite.py is all a lent GPU's few minutes run, so its code path is kept working here: at
    --tiny size on the CPU it builds the model, runs every row for both engines, the correctness check (its fp32
    reference one layer at a time) and the region timing, and writes the table."""
    out = tmp_path / "table.md"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_v2lite.py"
    r = subprocess.run([sys.executable, str(script), "--tiny", "--device", "cpu", "--tokens", "4", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith(("| TPOT", "| TTFT"))]
    assert [row.split(" | ")[0] for row in rows] == [
        "| TPOT batch 1", "| TTFT 64 tokens", "| TPOT batch 4", "| TTFT 256 tokens",
        "| TPOT batch 4, temperature 0.7 top-p 0.9"]
    for row in rows:                        # ours, transformers', the ratio: all measured
        ours, theirs, ratio = row.split(" | ")[1:4]
        assert ours.endswith(" ms") and theirs.endswith(" ms") and ratio.endswith("x"), row
    check = re.search(r"ours \(bf16\) \|d\| median ([0-9.]+), worst [0-9.]+, over 0.05 (\d+)/32", table)
    assert check, table
    assert float(check.group(1)) < 0.05 and int(check.group(2)) <= 16, check.group(0)
    assert "step kind  region" in table
