"""The `cpu` backend end to end: AOTInductor packages, the compile cache, and the same tokens as transformers."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import pytest
import torch

from checkpoints import hf_greedy, hf_logits, hf_model
from deepinfer.compile.driver import compile_artifact
from deepinfer.compile.options import CompileOptions
from deepinfer.compile.weights import shard_bytes, shard_specs
from deepinfer.runtime.engine import Engine
from deepinfer.runtime.sequence import SamplingParams


def test_aoti_artifact_matches_transformers_and_recompiles_from_cache(checkpoints, cache_dir, tmp_path,
                                                                      monkeypatch):
    ck = checkpoints["base"]
    opts = dict(model=ck, backend="cpu", decode_buckets=(2,), prefill_buckets=(16,), context_limit=64,
                cache_dir=cache_dir / "aoti", jobs=2)
    t = time.perf_counter()
    first = compile_artifact(CompileOptions(out=tmp_path / "a", **opts), log=lambda s: None)
    cold = time.perf_counter() - t
    # no moe_dense (grouped); three prefill heads: one logits row, one per packed prompt, one per row (prompt
    # logprobs)
    assert first.cache_misses == len(first.manifest.graphs) == 10 and first.cache_hits == 0
    assert all(g.file.endswith(".aoti.pt2") for g in first.manifest.graphs)

    t = time.perf_counter()
    second = compile_artifact(CompileOptions(out=tmp_path / "b", **opts), log=lambda s: None)
    warm = time.perf_counter() - t
    assert second.cache_hits == 10 and second.cache_misses == 0
    assert [g.graph_hash for g in second.manifest.graphs] == [g.graph_hash for g in first.manifest.graphs]
    assert warm < cold / 3, f"cached compile {warm:.1f}s vs cold {cold:.1f}s"

    # Loading leaves no package extraction in the temp dir (a killed rank would leak it otherwise).
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    engine = Engine.from_artifact(tmp_path / "b")
    assert os.listdir(tmp) == []
    hf = hf_model(ck)
    for prompt in ([7, 8, 9], list(range(5, 45))):
        got = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].output_ids
        assert got == hf_greedy(hf, prompt, 16)
    # prompt logprobs through the every-row prefill head
    prompt = list(range(5, 45))
    s = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    assert s.prompt_token_logprobs == pytest.approx([float(ref[i, prompt[i + 1]]) for i in range(39)], abs=1e-4)


def test_aoti_multi_rank_artifact_matches_single_rank(checkpoints, cache_dir, tmp_path):
    """Graphs with traced collectives compile with AOTInductor (against the fake group) and run on gloo."""
    ck = checkpoints["base"]
    opts = dict(model=ck, backend="cpu", decode_buckets=(2,), prefill_buckets=(16,), context_limit=64,
                cache_dir=cache_dir / "aoti", jobs=2)
    one = compile_artifact(CompileOptions(out=tmp_path / "one", **opts), log=lambda s: None)
    two = compile_artifact(CompileOptions(out=tmp_path / "two", cp=2, ep=2, **opts), log=lambda s: None)
    assert two.manifest.layout.world == 2
    prompts = [[7, 8, 9], list(range(5, 45))]
    want = [s.output_ids for s in Engine.from_artifact(tmp_path / "one").generate(
        prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    engine = Engine.from_artifact(tmp_path / "two")
    try:
        got = [s.output_ids for s in engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    finally:
        engine.close()
    assert got == want


def test_aoti_region_marks_time_the_parts_and_keep_the_tokens(checkpoints, cache_dir, tmp_path):
    """--region-marks with AOTInductor: the packages call the marks back (a Python op) between a layer's parts,
    the timer splits the layers, and the tokens are transformers' greedy ones."""
    from deepinfer.runtime.artifact import open_artifact
    from deepinfer.runtime.engine import make_runner
    ck = checkpoints["base"]
    opts = dict(model=ck, backend="cpu", decode_buckets=(2,), prefill_buckets=(16,), context_limit=64,
                cache_dir=cache_dir / "aoti", jobs=2, region_marks=True)
    compile_artifact(CompileOptions(out=tmp_path / "a", **opts), log=lambda s: None)
    art = open_artifact(tmp_path / "a")
    engine = Engine(art.manifest, make_runner(art, rank=0, timing=True), None)
    prompt = list(range(5, 45))
    got = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_ids
    assert got == hf_greedy(hf_model(ck), prompt, 8)
    parts = engine.runner.timer.parts
    for kind in ("prefill", "decode"):
        assert {p for (k, r, p) in parts if (k, r) == (kind, "moe_layer")} == {"attention", "moe"}
        assert {p for (k, r, p) in parts if (k, r) == (kind, "dense_layer")} == {"attention", "mlp"}


def test_aoti_bf16_weights_match_transformers(bf16_checkpoint, cache_dir, tmp_path):
    """A bf16 checkpoint (--weight-dtype auto): its weight matrices stay bf16 in the shard (half the bytes) and
    the compiled graphs widen them as they stream (Inductor's fused one-row reductions and gathered experts, the
    kernels' ops at 4 rows); greedy tokens equal transformers' float32 run on the same weights."""
    opts = dict(model=bf16_checkpoint, backend="cpu", decode_buckets=(1, 4), prefill_buckets=(16,), context_limit=64,
                cache_dir=cache_dir / "aoti", jobs=2)
    narrow = compile_artifact(CompileOptions(out=tmp_path / "a", **opts), log=lambda s: None)
    m, cc = narrow.manifest.model, narrow.manifest.compile
    assert cc.weights_dtype == "bfloat16"
    wide = shard_bytes(shard_specs(m, dataclasses.replace(cc, weight_dtype=None), narrow.manifest.layout.ranks[0]))
    ratio = narrow.manifest.memory[0].weights_bytes / wide
    assert 0.5 <= ratio < 0.55, ratio                 # the norms, router and rope frequencies stay float32
    engine = Engine.from_artifact(tmp_path / "a")
    hf = hf_model(bf16_checkpoint)
    prompts = [[7, 8, 9], list(range(5, 45)), [11] * 6, [3, 1, 4, 1, 5]]
    got = [s.output_ids for s in engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert got == [hf_greedy(hf, p, 12) for p in prompts]


def test_the_cpu_target_names_the_avx512_extensions_inductor_compiles_for(monkeypatch):
    """An AVX-512 host's target carries VNNI / AVX512-BF16 / AMX (Inductor builds with -mavx512bf16 and -mamx-*
    where the CPU has them): an artifact built on an AMX host is refused, not run into an illegal instruction, on
    an AVX-512 host without AMX."""
    from deepinfer.common.errors import ArtifactError
    from deepinfer.common.manifest import Toolchain
    from deepinfer.common.toolchain import cpu_isa
    from deepinfer.runtime.artifact import verify_toolchain
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for name in ("_is_avx512_vnni_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)
    plain = cpu_isa()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    amx = cpu_isa()
    assert plain.endswith("-AVX512") and amx.endswith("-AVX512+bf16+amx")
    tc = Toolchain(torch=torch.__version__, python="3.11", backend="cpu", target=amx, compiler="aotinductor")
    m = type("M", (), {"toolchain": tc})()
    verify_toolchain(m)              # the machine it was built on
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    with pytest.raises(ArtifactError, match="compiled for CPU .*AVX512\\+bf16\\+amx, this machine is .*AVX512\\+bf16;"):
        verify_toolchain(m)


def test_a_damaged_compile_cache_entry_is_a_miss(tmp_path):
    """The compile cache hands out an entry only if its content hash (written beside it) matches: a truncated
    or damaged file is dropped and compiled again, not copied into an artifact (whose hashes it would then pass)."""
    from deepinfer.compile.backends import CompileCache
    cache = CompileCache(tmp_path / "cache")
    src = tmp_path / "graph.aoti.pt2"
    src.write_bytes(os.urandom(4096))
    entry = cache.put("ab" * 32, ".aoti.pt2", src)
    assert cache.get("ab" * 32, ".aoti.pt2") == entry and entry.read_bytes() == src.read_bytes()
    entry.write_bytes(src.read_bytes()[:100])            # truncated
    assert cache.get("ab" * 32, ".aoti.pt2") is None and not entry.exists()
    cache.put("cd" * 32, ".aoti.pt2", src)
    cache.path("cd" * 32, ".aoti.pt2").with_suffix(".pt2.sha256").unlink()   # written before hashes were
    assert cache.get("cd" * 32, ".aoti.pt2") is None


@pytest.mark.parametrize("cp", [1, 2])
def test_bf16_activations_meet_no_bf16_gemm(cp):
    """--dtype bfloat16 CPU graphs: every product goes through an op that picks its form at run time (rows_linear,
    grouped_mm, bf16_einsum: torch's bf16 GEMM only where the CPU has bf16 dot products, else the fp32 GEMM of the
    widened operands, rounded once) or runs in fp32 (the attention's absorptions and kernels, the gathered experts):
    torch's bf16 GEMMs run 30-70x under the fp32 rate on CPUs without bf16 dot products (the demo model's 256-token
    prefill chunk took 123 ms in bf16 against 12 in fp32). So no aten GEMM in any graph reads a bf16 operand: on one
    rank a prefill chunk's attention is the kernel op (over a 512-key context on bf16 keys and values, which the
    latents expand to through bf16_einsum; over 64 keys in fp32), with CP the torch form with its products through
    bf16_einsum."""
    from pathlib import Path
    from checkpoints import TINY
    from deepinfer.common.model_config import ModelConfig
    from deepinfer.compile.graphs import export_graph, plan_graphs
    from deepinfer.compile.options import resolve
    # heads wide enough that a 512-key context reaches the kernel's bf16 GEMMs (ops.PREFILL_BF16_MIN_WORK)
    m = ModelConfig.from_hf_dict(dict(TINY, model_type="deepseek_v3", qk_nope_head_dim=64, qk_rope_head_dim=32,
                                      v_head_dim=64))
    cc = resolve(CompileOptions(model=Path("tiny"), out=Path("unused"), backend="cpu", dtype="bfloat16", cp=cp,
                                decode_buckets=(1, 4), prefill_buckets=(32,), context_limit=512, context_buckets=(64,)), m)
    gemms = ("aten.mm.", "aten.bmm.", "aten.addmm.", "aten.baddbmm.", "aten.linear.", "aten.matmul.", "aten.einsum.",
             "aten._grouped_mm.")
    seen, narrow = set(), []
    for plan in plan_graphs(m, cc):
        ep, _ = export_graph(plan)
        for n in ep.graph.nodes:
            if n.op != "call_function":
                continue
            seen.add(str(n.target).split(".")[1] if str(n.target).startswith("deepinfer.") else "")
            if str(n.target).startswith(gemms):
                flat = [a for x in n.args for a in (x if isinstance(x, (list, tuple)) else [x])]
                if any(isinstance(a, torch.fx.Node) and a.meta["val"].dtype == torch.bfloat16 for a in flat):
                    narrow.append(f"{plan.name}: {n.target}")
    assert not narrow, narrow
    assert {"rows_linear", "grouped_mm", "paged_mla_decode"} <= seen        # the ops that take them
    assert ("prefill_attention" in seen) == (cp == 1) and "bf16_einsum" in seen


def test_bf16_activations_expand_short_contexts_through_the_kernel(tmp_path, monkeypatch):
    """--dtype bfloat16, a prefill chunk over a context too short for the attention kernel's bf16 GEMMs: the keys and
    values expand from the bf16 latents through deepinfer::head_linear (kv_lora_rank >= EXPAND_DOT_MIN_RANK; the
    grouped kernel's bf16 dot products), the same fp32 sums as the fp32 einsum of the widened operands but for their
    order: the same tokens and logprobs either way (a wrong layout of W_UK or W_UV would change both)."""
    from checkpoints import make_checkpoint
    from deepinfer.compile import model as model_mod
    from deepinfer.compile.graphs import export_graph, plan_graphs
    ck = make_checkpoint(tmp_path / "ck", seed=3, dtype=torch.bfloat16, kv_lora_rank=128)
    runs = {}
    for name, rank in (("kernel", model_mod.EXPAND_DOT_MIN_RANK), ("einsum", 1 << 30)):
        monkeypatch.setattr(model_mod, "EXPAND_DOT_MIN_RANK", rank)
        art = compile_artifact(CompileOptions(model=ck, out=tmp_path / name, backend="eager", dtype="bfloat16",
                                              decode_buckets=(1, 4), prefill_buckets=(32,), context_limit=128,
                                              context_buckets=(64,), cache_dir=tmp_path / f"cache-{name}"),
                               log=lambda s: None)
        plan = next(p for p in plan_graphs(art.manifest.model, art.manifest.compile)
                    if p.name.startswith("moe_layer.prefill"))
        ops = {str(n.target) for n in export_graph(plan)[0].graph.nodes if n.op == "call_function"}
        assert ("deepinfer.head_linear.default" in ops) == (name == "kernel"), sorted(ops)
        engine = Engine.from_artifact(tmp_path / name, prefix_caching=False)
        prompts = [list(range(3, 40)), [5, 9, 2, 7] * 5]
        runs[name] = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0))
    for a, b in zip(runs["kernel"], runs["einsum"]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), rtol=0, atol=3e-2)
