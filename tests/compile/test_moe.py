"""The MoE paths: grouped == dense always (every rank's share, padding skipped); on the static path,
capacity-grouped == dense when nothing overflows, and an overflow is flagged and rerun densely."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import hf_greedy, hf_logits, hf_model
from deepinfer.common.model_config import ModelConfig
from deepinfer.compile.model import (SINGLE_RANK, RegionSpec, experts_capacity, experts_dense, experts_gather,
                                     experts_grouped, moe, route, shared_in_grouped)
from deepinfer.runtime import ops
from deepinfer.runtime.artifact import open_artifact
from deepinfer.runtime.engine import Engine, make_runner
from deepinfer.runtime.sequence import SamplingParams
from stepper import Stepper, rel_err


def _setup(checkpoints, T=24, seed=0):
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    g = torch.Generator().manual_seed(seed)
    E, D, I = m.n_routed_experts, m.hidden_size, m.moe_intermediate_size
    w = {"moe.router_weight": torch.randn(E, D, generator=g) * 0.3,
         "moe.router_bias": torch.randn(E, generator=g) * 0.05,
         "moe.experts_gate_up": torch.randn(E, 2 * I, D, generator=g) * 0.1,
         "moe.experts_down": torch.randn(E, D, I, generator=g) * 0.1,
         "rank.expert_ids": torch.arange(E)}
    x = torch.randn(T, D, generator=g)
    return m, w, x


def _spec(m, T, capacity):
    return RegionSpec(m, "moe_layer", "prefill", T, 0, 16, capacity=capacity)


def test_capacity_equals_dense_without_overflow(checkpoints):
    m, w, x = _setup(checkpoints)
    T, K = x.shape[0], m.num_experts_per_tok
    ids, weights = route(m, x, w)
    dense = experts_dense(_spec(m, T, 0), x, ids, weights, w)
    cap, overflow = experts_capacity(_spec(m, T, T * K), x, ids, weights, w)
    assert not bool(overflow)
    torch.testing.assert_close(cap, dense, rtol=1e-5, atol=1e-6)
    gathered = experts_gather(_spec(m, T, 0), x, ids, weights, w)
    torch.testing.assert_close(gathered, dense, rtol=1e-5, atol=1e-6)


def test_capacity_flags_overflow_exactly_when_an_expert_overflows(checkpoints):
    m, w, x = _setup(checkpoints, seed=1)
    T = x.shape[0]
    ids, weights = route(m, x, w)
    busiest = int(torch.bincount(ids.flatten(), minlength=m.n_routed_experts).max())
    _, at_max = experts_capacity(_spec(m, T, busiest), x, ids, weights, w)
    _, below = experts_capacity(_spec(m, T, busiest - 1), x, ids, weights, w)
    assert not bool(at_max) and bool(below)


def test_capacity_keeps_tokens_in_order_and_drops_the_rest(checkpoints):
    """With capacity C, an expert serves its first C tokens; the result equals the dense path
    with the dropped (token, expert) pairs given weight zero."""
    m, w, x = _setup(checkpoints, seed=2)
    T = x.shape[0]
    ids, weights = route(m, x, w)
    cap = 2
    out, overflow = experts_capacity(_spec(m, T, cap), x, ids, weights, w)
    assert bool(overflow)
    kept = weights.clone()
    seen = {}
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            seen[e] = seen.get(e, 0) + 1
            if seen[e] > cap:
                kept[t, k] = 0.0
    torch.testing.assert_close(out, experts_dense(_spec(m, T, 0), x, ids, kept, w), rtol=1e-5, atol=1e-6)


def test_forced_overflow_reruns_dense_and_still_matches(checkpoints, compile_artifact):
    ck = checkpoints["base"]
    art = open_artifact(compile_artifact(ck, moe_capacity=1))
    assert art.manifest.compile.moe_capacity == (1,)
    runner = make_runner(art, rank=0)
    hf = hf_model(ck)
    st = Stepper(runner)
    prompt = list(range(3, 3 + 60))
    seq = st.new(prompt)
    ref = hf_logits(hf, prompt)
    got = [st.run("prefill", 32, 64, [(seq, 32)])[0], st.run("prefill", 32, 64, [(seq, 28)])[0]]
    assert runner.overflow_reruns >= 2 * art.manifest.model.num_moe_layers
    assert rel_err(got[0], ref[31]) < 1e-4 and rel_err(got[1], ref[59]) < 1e-4

    engine = Engine.from_artifact(compile_artifact(ck, moe_capacity=1))
    out = engine.generate([prompt[:45]], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_ids
    assert out == hf_greedy(hf, prompt[:45], 8)


def test_padding_takes_no_capacity(checkpoints):
    """A prefill chunk padded to its bucket: the padding rows (all the same token) must not overflow."""
    m, w, x = _setup(checkpoints, T=8, seed=3)
    T = 24
    x = torch.cat([x, x[:1].expand(T - 8, -1)])          # 16 identical padding rows route identically
    real = torch.arange(T) < 8
    ids, weights = route(m, x, w)
    cap = int(torch.bincount(ids[:8].flatten(), minlength=m.n_routed_experts).max())
    out_pad, overflow = experts_capacity(_spec(m, T, cap), x, ids, weights, w, real)
    assert not bool(overflow)
    _, overflow_if_counted = experts_capacity(_spec(m, T, cap), x, ids, weights, w)
    assert bool(overflow_if_counted)
    dense = experts_dense(_spec(m, T, 0), x, ids, weights, w)
    torch.testing.assert_close(out_pad[:8], dense[:8], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 5, 24])
def test_grouped_equals_dense(checkpoints, T):
    m, w, x = _setup(checkpoints, T=T, seed=T)
    ids, weights = route(m, x, w)
    spec = RegionSpec(m, "moe_layer", "decode", T, 0, 16, moe_path="grouped")
    torch.testing.assert_close(experts_grouped(spec, x, ids, weights, w), experts_dense(spec, x, ids, weights, w),
                               rtol=1e-5, atol=1e-6)


def test_grouped_expert_parallel_shares_sum_to_dense(checkpoints):
    """Each EP rank computes only its own experts' pairs; the ranks' outputs sum to the single-rank result."""
    m, w, x = _setup(checkpoints, T=24, seed=4)
    ids, weights = route(m, x, w)
    E = m.n_routed_experts
    full = experts_dense(RegionSpec(m, "moe_layer", "decode", 24, 0, 16), x, ids, weights, w)
    total = torch.zeros_like(full)
    for r in range(2):
        lo, hi = r * E // 2, (r + 1) * E // 2
        wr = dict(w, **{"moe.experts_gate_up": w["moe.experts_gate_up"][lo:hi],
                        "moe.experts_down": w["moe.experts_down"][lo:hi], "rank.expert_ids": torch.arange(lo, hi)})
        total += experts_grouped(RegionSpec(m, "moe_layer", "decode", 24, 0, 16, ep=2, world=2,
                                            moe_path="grouped"), x, ids, weights, wr)
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


def _shared_weights(m, w, S, seed=7):
    """w with S shared experts as one MLP (moe.shared_*) and, separately, as S more expert groups (split as
    compile/weights.py splits a checkpoint's shared MLP)."""
    g = torch.Generator().manual_seed(seed)
    D, I = m.hidden_size, m.moe_intermediate_size
    gate, up, down = (torch.randn(S * I, D, generator=g) * 0.1, torch.randn(S * I, D, generator=g) * 0.1,
                      torch.randn(D, S * I, generator=g) * 0.1)
    separate = dict(w, **{"moe.shared_gate_up": torch.cat([gate, up]), "moe.shared_down": down})
    groups_gu = torch.cat([gate.view(S, I, D), up.view(S, I, D)], 1)
    groups_down = down.reshape(D, S, I).transpose(0, 1)
    grouped = dict(w, **{"moe.experts_gate_up": torch.cat([w["moe.experts_gate_up"], groups_gu]),
                         "moe.experts_down": torch.cat([w["moe.experts_down"], groups_down])})
    return separate, grouped


@pytest.mark.parametrize("path,T,cpu", [("dense", 3, False), ("gather", 1, True), ("grouped", 1, False),
                                        ("grouped", 5, False), ("grouped", 24, True), ("grouped", 240, True)])
@pytest.mark.parametrize("S", [1, 2])
def test_shared_experts_as_groups_equal_the_shared_mlp(checkpoints, path, T, cpu, S):
    """--shared-experts grouped: the shared experts as S more groups (every token's pair, weight 1, or apart on
    slices of the groups' weights where `shared_in_grouped` says so) give the layer's MoE output of the separate
    shared MLP, on every path; padding rows stay uncomputed."""
    m, w, x = _setup(checkpoints, T=T, seed=10 + T)
    m = dataclasses.replace(m, n_shared_experts=S)
    separate, grouped = _shared_weights(m, w, S)
    real = torch.arange(T) < max(1, T - 2) if path == "grouped" else None
    spec = RegionSpec(m, "moe_layer", "decode", T, 0, 16, moe_path=path, small_gemm_rows=64 if cpu else 0)
    # CPU graphs keep them in the grouped GEMM while it stays on the few-rows kernel (64 rows a group on average)
    in_grouped = shared_in_grouped(dataclasses.replace(spec, shared_groups=S))
    assert in_grouped == (not cpu or T * (2 + S) <= 64 * (8 + S))
    want, _ = moe(spec, x, separate, SINGLE_RANK, path, real)
    got, _ = moe(dataclasses.replace(spec, shared_groups=S), x, grouped, SINGLE_RANK, path, real)
    n = int(real.sum()) if real is not None else T
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-6)
    if real is not None and n < T and in_grouped:    # apart, the shared MLP runs on padding rows, which are dropped
        assert torch.count_nonzero(got[n:]) == 0


@pytest.mark.parametrize("T,cpu,expected", [(16, False, True), (32, False, False), (64, False, True),
                                             (64, True, True), (96, True, False)])
def test_shared_experts_stay_in_grouped_gemm_only_on_its_kernel(checkpoints, T, cpu, expected):
    """Top-8 routing and one shared expert (as DeepSeek-V3; 8 experts here): on the GPU the shared pairs join the
    grouped GEMM unless they push it past the Triton kernel's 256 rows (32 tokens: 256 routed pairs, 288 with
    them), and do when the routed pairs alone are past it; on the CPU while the rows stay within the few-rows
    kernel's 64 a group on average (9 groups: 576)."""
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    m = dataclasses.replace(m, num_experts_per_tok=8, n_shared_experts=1)
    spec = RegionSpec(m, "moe_layer", "decode", T, 0, 16, moe_path="grouped", shared_groups=1,
                      small_gemm_rows=64 if cpu else 0)
    assert shared_in_grouped(spec) == expected


def test_shared_expert_groups_split_over_expert_parallel_ranks(checkpoints):
    """Two shared experts over two EP ranks: each rank holds its routed half and one shared expert as a group; the
    ranks' outputs sum to the single rank's with the shared MLP."""
    m, w, x = _setup(checkpoints, T=12, seed=21)
    m = dataclasses.replace(m, n_shared_experts=2)
    separate, grouped = _shared_weights(m, w, 2)
    want, _ = moe(RegionSpec(m, "moe_layer", "decode", 12, 0, 16, moe_path="grouped"), x, separate, SINGLE_RANK,
                  "grouped")
    E, total = m.n_routed_experts, torch.zeros_like(want, dtype=torch.float32)
    for r in range(2):
        lo, hi = r * E // 2, (r + 1) * E // 2
        keep = list(range(lo, hi)) + [E + r]
        wr = dict(grouped, **{"moe.experts_gate_up": grouped["moe.experts_gate_up"][keep],
                              "moe.experts_down": grouped["moe.experts_down"][keep],
                              "rank.expert_ids": torch.arange(lo, hi)})
        spec = RegionSpec(m, "moe_layer", "decode", 12, 0, 16, ep=2, world=2, moe_path="grouped", shared_groups=1)
        total += moe(spec, x, wr, SINGLE_RANK, "grouped")[0].float()
    torch.testing.assert_close(total, want.float(), rtol=1e-5, atol=1e-5)


def test_grouped_skips_padding(checkpoints):
    """Padding rows are not computed: their outputs are exactly zero, the real rows match dense."""
    m, w, x = _setup(checkpoints, T=16, seed=5)
    ids, weights = route(m, x, w)
    real = torch.arange(16) < 9
    spec = RegionSpec(m, "moe_layer", "prefill", 16, 0, 16, moe_path="grouped")
    out = experts_grouped(spec, x, ids, weights, w, real)
    assert torch.count_nonzero(out[9:]) == 0
    torch.testing.assert_close(out[:9], experts_dense(spec, x, ids, weights, w)[:9], rtol=1e-5, atol=1e-6)


def test_grouped_mm_fallback_matches_native():
    """The masked-loop fallback (devices or dtypes without torch._grouped_mm) computes the same rows."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 8, generator=g), torch.randn(3, 8, 5, generator=g)
    offs = torch.tensor([2, 2, 9], dtype=torch.int32)               # an empty group; rows 9, 10 in none
    ref = torch.cat([x[:2] @ w[0], x[2:9] @ w[2]])
    torch.testing.assert_close(ops.grouped_mm_torch(x, w, offs)[:9], ref)
    torch.testing.assert_close(torch.ops.deepinfer.grouped_mm(x, w, offs)[:9], ref)
    key = (x.device.type, x.dtype)
    ops._NATIVE_FAILED.add(key)
    try:
        out = ops.grouped_mm_torch(x, w, offs)
    finally:
        ops._NATIVE_FAILED.discard(key)
    torch.testing.assert_close(out[:9], ref)
    assert torch.count_nonzero(out[9:]) == 0


def test_grouped_mm_native_failure_falls_back_once(monkeypatch, caplog):
    """torch._grouped_mm failing here (an unsupported dtype or device) marks it failed, warns once and takes the
    masked loop from then on; a device fault is not such a verdict: it goes up and marks nothing."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    ref = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    key = (x.device.type, x.dtype)
    calls = []

    def fails(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("grouped_mm: no kernel for Double\nsecond line")
    monkeypatch.setattr(torch, "_grouped_mm", fails)
    try:
        with caplog.at_level("WARNING", logger="deepinfer"):
            torch.testing.assert_close(ops.grouped_mm_torch(x, w, offs), ref)
            torch.testing.assert_close(ops.grouped_mm_torch(x, w, offs), ref)
        assert key in ops._NATIVE_FAILED and len(calls) == 1
        warnings = [r.getMessage() for r in caplog.records if "torch._grouped_mm does not run" in r.getMessage()]
        assert len(warnings) == 1 and "no kernel for Double" in warnings[0] and "second line" not in warnings[0]
    finally:
        ops._NATIVE_FAILED.discard(key)

    def faults(*args, **kwargs):
        raise torch.AcceleratorError("device-side assert")
    monkeypatch.setattr(torch, "_grouped_mm", faults)
    with pytest.raises(torch.AcceleratorError):
        ops.grouped_mm_torch(x, w, offs)
    assert key not in ops._NATIVE_FAILED


def test_grouped_mm_swapped_operands_match(monkeypatch):
    """Groups of a few rows of a big weight run with the operands swapped on the CPU; same rows either way."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(13, 64, generator=g), torch.randn(4, 64, 48, generator=g)
    offs = torch.tensor([3, 3, 8, 12], dtype=torch.int32)           # an empty group; row 12 in none
    monkeypatch.setattr(ops, "SWAP_MIN_WEIGHT", 64 * 48)
    assert ops._swap_operands(x, w)
    out = ops.grouped_mm_torch(x, w, offs)
    assert out.is_contiguous() and out.shape == (13, 48)
    ref = torch.cat([x[:3] @ w[0], x[3:8] @ w[2], x[8:12] @ w[3]])
    torch.testing.assert_close(out[:12], ref)
    monkeypatch.setattr(ops, "SWAP_MIN_WEIGHT", 64 * 48 + 1)
    assert not ops._swap_operands(x, w)
    torch.testing.assert_close(ops.grouped_mm_torch(x, w, offs)[:12], ref)


def _kernels_or_skip():
    from deepinfer.runtime import cpu_kernels
    reason = cpu_kernels.unavailable_reason()
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert reason is None, reason          # this machine can run them: a failed build is a failure
    elif reason is not None:
        pytest.skip(reason)


@pytest.fixture(params=["avx2", "avx512"])
def kernel_isa(request):
    """The fp32 kernel's two forms: AVX2 everywhere it runs, AVX-512 where the CPU has it (the default there)."""
    _kernels_or_skip()
    if not torch.ops.deepinfer_cpu.avx512_form(request.param == "avx512") and request.param == "avx512":
        torch.ops.deepinfer_cpu.avx512_form(True)
        pytest.skip("this CPU has no AVX-512: the fp32 kernel's AVX-512 form does not run here")
    yield request.param
    torch.ops.deepinfer_cpu.avx512_form(True)


@pytest.fixture(params=["xpanels", "panels", "tiles"])
def panel_form(request):
    """The AVX2 kernel's groups of 12+ rows: transposed panels of weights (the default), with groups of 14-16 rows
    transposed themselves instead (the default too: "xpanels"; in the AVX-512 form too, over fp32 weights), or the
    dot-product tiles for all."""
    _kernels_or_skip()
    torch.ops.deepinfer_cpu.panel_form(request.param != "tiles")
    torch.ops.deepinfer_cpu.xpanel_form(request.param == "xpanels")
    yield request.param
    torch.ops.deepinfer_cpu.panel_form(True)
    torch.ops.deepinfer_cpu.xpanel_form(True)


@pytest.mark.parametrize("K,N", [(64, 48), (67, 100), (5, 7), (1030, 9), (1024, 20), (4100, 30), (512, 100)])
@pytest.mark.parametrize("offs_dtype,wdtype", [(torch.int32, torch.float32), (torch.int64, torch.float32),
                                               (torch.int32, torch.bfloat16)])
def test_grouped_rows_kernel_matches(K, N, offs_dtype, wdtype, kernel_isa, panel_form):
    """The CPU few-rows kernel against per-group matmuls in float64, in all its forms: groups of 0-40 rows
    (register tiles of 4 rows x 3 weight rows (AVX2) and 6 rows x 4 weight rows (AVX-512), with every remainder;
    on AVX2 groups of 12+ rows with K a multiple of 8 in 16-weight-row panels, N = 20 and 100 leaving part-panels,
    and groups of 14-16 rows transposed (tiles of 6 and 4 weight rows, odd K leaving a bf16 pair's tail; in the
    AVX-512 form over fp32 weights, 4 weight rows a tile, N = 7, 9 and 30 leaving 1-3, the rows transposed 16
    units at a time and K % 16 one by one); at K = 4100 the AVX-512 form's L2 blocks: 12 weight rows a task, 18
    rows a block), K not a multiple of the vector width, rows 4 KB long (K = 1024: the AVX-512 form reads them
    from a copy with a longer stride), rows in no group; fp32 weights and bf16 ones (widened exactly: the
    reference is the same bf16 values in float64)."""
    g = torch.Generator().manual_seed(K * N)
    sizes = [0, 1, 2, 3, 4, 5, 6, 9, 0, 7, 11, 12, 13, 14, 16, 17, 40]
    M = sum(sizes) + 2
    x = torch.randn(K, M, generator=g).t()                      # not contiguous
    wt = torch.randn(len(sizes), N, K, generator=g).to(wdtype)
    offs = torch.tensor(sizes).cumsum(0).to(offs_dtype)
    out = torch.ops.deepinfer_cpu.grouped_rows_mm(x, wt, offs)
    ref = torch.zeros(M, N, dtype=torch.float64)
    start = 0
    for e, n in enumerate(sizes):
        ref[start:start + n] = x[start:start + n].double() @ wt[e].double().T
        start += n
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4 * max(1.0, K ** 0.5 / 8))
    assert torch.count_nonzero(out[start:]) == 0


def test_kernel_tasks_balance_uneven_groups(kernel_isa, panel_form):
    """The threads split the kernel's tasks by work, not by count: groups of very different sizes (one holding
    most rows, empty ones between) give the same sums with one thread and with several."""
    g = torch.Generator().manual_seed(11)
    sizes = [200, 0, 1, 0, 16, 3, 40, 0, 15]
    x = torch.randn(sum(sizes) + 5, 96, generator=g)
    wt = torch.randn(len(sizes), 200, 96, generator=g)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.deepinfer_cpu.grouped_rows_mm(x, wt, offs)
        torch.set_num_threads(max(2, threads))
        many = torch.ops.deepinfer_cpu.grouped_rows_mm(x, wt, offs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    ref = torch.zeros_like(one, dtype=torch.float64)
    start = 0
    for e, n in enumerate(sizes):
        ref[start:start + n] = x[start:start + n].double() @ wt[e].double().T
        start += n
    torch.testing.assert_close(one.double(), ref, rtol=1e-5, atol=1e-4)


def _cpu_has(*features: str) -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(f in flags for f in features)


def _has_bf16_dot() -> bool:
    return _cpu_has("avx512f", "avx512bw", "avx512dq", "avx512_bf16")


@pytest.mark.parametrize("K,N", [(64, 48), (67, 100), (5, 7), (1030, 9), (1024, 20), (4100, 30)])
def test_bf16_dot_kernel_matches(K, N):
    """The AVX512-BF16 kernel (bf16 rows and weights, fp32 sums) against float64 on the same bf16 values: groups of
    0-50 rows (tiles of 6 rows and 4 weight rows, every remainder; at K = 4100 its L2 blocks: 28 weight rows a
    task, 42 rows a block; groups of 14-16 rows transposed where K is even, N = 7, 9 and 30 leaving 1-3 weight rows
    at a task's end), K not a multiple of 32 (the masked tail), rows in no group zero."""
    _kernels_or_skip()
    if not _has_bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16: the dot-product kernel does not run here (the ops widen the rows "
                    "for the fp32 kernel instead: test_bf16_products_ops)")
    g = torch.Generator().manual_seed(K + N)
    sizes = [0, 1, 2, 3, 4, 5, 6, 9, 0, 7, 11, 12, 13, 14, 16, 15, 17, 50]
    M = sum(sizes) + 2
    x = torch.randn(K, M, generator=g).t().bfloat16()           # not contiguous
    wt = torch.randn(len(sizes), N, K, generator=g).bfloat16()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = torch.ops.deepinfer_cpu.grouped_rows_mm(x, wt, offs)
    assert out.dtype == torch.float32
    ref = torch.zeros(M, N, dtype=torch.float64)
    start = 0
    for e, n in enumerate(sizes):
        ref[start:start + n] = x[start:start + n].double() @ wt[e].double().T
        start += n
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4 * K ** 0.5 / 8)
    assert torch.count_nonzero(out[start:]) == 0


def _avx512_operands(form: str, seed: int, N: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and weights for one of the AVX-512 forms (fp32, bf16 weights, bf16 dot products), K = 1040 (65 vectors
    of 16 and a 16-lane tail of bf16); skips where this CPU does not run that form."""
    _kernels_or_skip()
    if form == "bf16 dot products":
        if not _has_bf16_dot():
            pytest.skip("this CPU has no AVX512-BF16: the dot-product kernel does not run here")
    elif not torch.ops.deepinfer_cpu.avx512_form():
        pytest.skip("this CPU has no AVX-512: the fp32 kernel's AVX-512 form does not run here")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), 1040, generator=g)
    wt = torch.randn(len(sizes), N, 1040, generator=g)
    if form != "fp32":
        wt = wt.bfloat16()
    if form == "bf16 dot products":
        x = x.bfloat16()
    return x, wt


@pytest.mark.parametrize("form", ["fp32", "bf16 weights", "bf16 dot products"])
def test_kernel_sums_do_not_depend_on_tiling(form):
    """The AVX-512 forms sum each output in one order whatever tile computes it: a row alone in its group gives
    bit for bit what it gives among 2-13 rows, whether its tile makes the pass from memory (3-5 rows read as the
    instructions' memory operands; the 5-row lead of 6-11-row groups) or a later one from cache. Groups of 14-16
    rows (fp32 weights, bf16 dot products) take the transposed-rows form, which sums in its own order: there a
    row's sums are the same bit for bit in a group of 14, 15 or 16 rows, and agree with the tiles' to rounding."""
    sizes = list(range(1, 14))
    x, wt = _avx512_operands(form, 3, 12, sizes)
    M = sum(sizes)
    grouped = torch.ops.deepinfer_cpu.grouped_rows_mm(x, wt, torch.tensor(sizes).cumsum(0))
    each = wt.repeat_interleave(torch.tensor(sizes), dim=0)      # every row its own group, of its group's weight
    alone = torch.ops.deepinfer_cpu.grouped_rows_mm(x, each, torch.arange(1, M + 1))
    assert torch.equal(grouped, alone)

    x, wt = _avx512_operands(form, 5, 12, [16])
    wide = {n: torch.ops.deepinfer_cpu.grouped_rows_mm(x[:n], wt, torch.tensor([n])) for n in (14, 15, 16)}
    assert torch.equal(wide[14], wide[16][:14]) and torch.equal(wide[15], wide[16][:15])
    one_by_one = torch.cat([torch.ops.deepinfer_cpu.grouped_rows_mm(x[i:i + 1], wt, torch.tensor([1]))
                            for i in range(16)])
    torch.testing.assert_close(wide[16], one_by_one, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("form", ["fp32", "bf16 weights", "bf16 dot products"])
def test_kernel_tunings_agree(form):
    """The AVX-512 forms' two per-microarchitecture tunings (where the weights' prefetches go; whether the bf16 dot
    products' 3-5-row tiles read their rows as memory operands, and whether 1-2-row passes prefetch) give the
    same sums bit for bit, groups of 0-17 rows; DEEPINFER_CPU_TUNING's op takes zen4, zen5 or auto and names what
    runs."""
    sizes = [0] + list(range(1, 18))
    x, wt = _avx512_operands(form, 4, 20, sizes)
    offs = torch.tensor(sizes).cumsum(0)
    default = torch.ops.deepinfer_cpu.tuning()
    try:
        out = {}
        for t in ("zen4", "zen5"):
            assert torch.ops.deepinfer_cpu.tuning(t) == t
            out[t] = torch.ops.deepinfer_cpu.grouped_rows_mm(x, wt, offs)
        assert torch.equal(out["zen4"], out["zen5"])
        with pytest.raises(RuntimeError, match="zen4, zen5 or auto"):
            torch.ops.deepinfer_cpu.tuning("zen3")
        assert torch.ops.deepinfer_cpu.tuning("auto") in ("zen4", "zen5")      # as the CPU
    finally:
        torch.ops.deepinfer_cpu.tuning(default)


def test_bad_tuning_variable_is_ignored_with_a_warning():
    """DEEPINFER_CPU_TUNING with a value other than zen4, zen5 or auto: the library still loads (it reads the
    variable as it loads, where an error would end the process), tunes for the CPU, and the log says so."""
    _kernels_or_skip()
    before = torch.ops.deepinfer_cpu.tuning()
    auto = torch.ops.deepinfer_cpu.tuning("auto")
    torch.ops.deepinfer_cpu.tuning(before)
    code = ("import logging, torch; logging.basicConfig(); from deepinfer.runtime import cpu_kernels; "
            "assert cpu_kernels.available(); print(torch.ops.deepinfer_cpu.tuning())")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DEEPINFER_CPU_TUNING": "zen9"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == auto
    assert "DEEPINFER_CPU_TUNING='zen9' is not zen4, zen5 or auto: ignored" in r.stderr


def test_build_killed_half_way_does_not_block_later_loads():
    """A process killed while it built the kernels leaves torch's `lock` file in the build folder, and torch's
    builder waits on that file forever: every later start hung. The next load removes it (no deepinfer build
    holds the folder then), says so, and loads."""
    _kernels_or_skip()
    from deepinfer.runtime import cpu_kernels
    stale = cpu_kernels.build_directory(cpu_kernels.library_name()) / "lock"
    stale.touch()
    try:
        code = ("import logging; logging.basicConfig(); from deepinfer.runtime import cpu_kernels; "
                "assert cpu_kernels.available(), cpu_kernels.unavailable_reason()")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        leftover = stale.exists()
        stale.unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr
    assert not leftover and "left by a CPU-kernel build that did not finish" in r.stderr


def test_bf16_products_ops():
    """--matmul-dtype bfloat16's operands: bf16 rows and weights through deepinfer::grouped_mm and rows_linear
    take the kernel for few rows (the dot-product kernel, or without AVX512-BF16 the fp32 kernel on the widened
    rows) and return the fp32 sums rounded to bf16 once; larger groups take one bf16 GEMM per group."""
    _kernels_or_skip()
    g = torch.Generator().manual_seed(6)
    w = torch.randn(4, 96, 40, generator=g).bfloat16()          # [G, K, N]
    for rows, expect in ((20, True), (300, False)):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        offs = torch.tensor([3, rows // 2, rows // 2, rows - 1], dtype=torch.int32)   # an empty group, a row in none
        out, took = _profiled_grouped_mm(x, w, offs)
        assert took == expect and out.dtype == torch.bfloat16
        ref = torch.zeros(rows, 40, dtype=torch.float64)
        for e, (a, b) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist())):
            ref[a:b] = x[a:b].double() @ w[e].double()
        # the fp32 sums rounded once: within one bf16 step of the float64 sums rounded (a sum within fp32
        # rounding of a bf16 tie may round the other way); one bf16 GEMM per group rounds the same way
        torch.testing.assert_close(out[:rows - 1].double(), ref[:rows - 1].to(torch.bfloat16).double(),
                                   rtol=2 ** -7, atol=1e-4)
        assert torch.count_nonzero(out[rows - 1:]) == 0
    x, w2 = torch.randn(6, 300, generator=g).bfloat16(), torch.randn(50, 300, generator=g).bfloat16()
    out = torch.ops.deepinfer.rows_linear(x, w2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), (x.double() @ w2.double().T).to(torch.bfloat16).double(),
                               rtol=2 ** -7, atol=1e-4)
    # the kernel's own fp32 sums, rounded as torch rounds them (to nearest even; where each of the kernel's tasks
    # rounds its block of the output), bit for bit, NaN, inf and ties included
    w3 = torch.cat([w2, torch.tensor([[float("nan")] + [0.0] * 299, [float("inf")] + [0.0] * 299,
                                      [1 + 2 ** -8] + [0.0] * 299, [1 + 3 * 2 ** -8] + [0.0] * 299]).bfloat16()])
    x3 = torch.cat([x, torch.tensor([[1.0] + [0.0] * 299]).bfloat16()])
    from deepinfer.runtime.ops import cpu_has_bf16_dot
    for xs, offs in ((x3, [7]), (x3[:1], [1]), (torch.randn(16, 300, generator=g).bfloat16(), [16])):
        # (without bf16 dot products the kernel takes no bf16 rows: rows_linear widens them, and so does this)
        sums = torch.ops.deepinfer_cpu.grouped_rows_mm(xs if cpu_has_bf16_dot() else xs.float(), w3[None],
                                                       torch.tensor(offs))
        assert torch.equal(torch.ops.deepinfer.rows_linear(xs, w3).view(torch.int16),
                           sums.to(torch.bfloat16).view(torch.int16))


def test_bf16_products_many_rows():
    """bf16 products past the kernel's 64 rows a group (prefill chunks) through rows_linear and grouped_mm: the
    fp32 sums of the bf16 operands rounded once; where the CPU has no bf16 dot products no bf16 GEMM runs (torch's
    runs 3-4x under the fp32 rate there): the fp32 path takes the widened rows. Where it has them, oneDNN's bf16
    GEMM does."""
    _kernels_or_skip()
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(100, 300, generator=g).bfloat16(), torch.randn(50, 300, generator=g).bfloat16()
    xs, ws = torch.randn(300, 96, generator=g).bfloat16(), torch.randn(3, 96, 40, generator=g).bfloat16()
    offs = torch.tensor([90, 180, 299], dtype=torch.int32)                      # 90-100 rows a group, one in none
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = torch.ops.deepinfer.rows_linear(x, w)
        outs = torch.ops.deepinfer.grouped_mm(xs, ws, offs)
    assert out.dtype == outs.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), (x.double() @ w.double().T).to(torch.bfloat16).double(),
                               rtol=2 ** -7, atol=1e-4)
    ref = torch.cat([xs[a:b].double() @ ws[e].double() for e, (a, b) in enumerate(zip([0, 90, 180], [90, 180, 299]))])
    torch.testing.assert_close(outs[:299].double(), ref.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-4)
    assert torch.count_nonzero(outs[299:]) == 0
    gemms = [e for e in prof.events() if e.name in ("aten::mm", "aten::linear", "aten::addmm")]
    if gemms and not hasattr(gemms[0], "input_dtypes"):
        pytest.skip("this torch's profiler records no input dtypes: which GEMM ran is not visible")
    bf16_gemms = [e.name for e in gemms if list(e.input_dtypes)[:1] == ["c10::BFloat16"]]
    assert bool(bf16_gemms) == _has_bf16_dot(), bf16_gemms


@pytest.mark.parametrize("equation,a_shape,b_shape", [
    ("cl,hdl->hcd", (40, 24), (3, 16, 24)),          # the prefill chunk's keys and values from the latents
    ("htd,hcd->htc", (3, 20, 16), (3, 40, 16)),      # its scores
    ("htc,hcv->htv", (3, 20, 40), (3, 40, 16)),      # its probabilities times the values
])
def test_bf16_einsum(equation, a_shape, b_shape):
    """deepinfer::bf16_einsum (--matmul-dtype bfloat16's prefill attention products): exact products of the bf16
    operands, fp32 sums, rounded to bf16 once; torch's bf16 GEMM runs only where the CPU has bf16 dot products (it
    runs 30-70x under the fp32 rate elsewhere), the fp32 GEMM on the widened operands everywhere else."""
    g = torch.Generator().manual_seed(len(equation))
    a, b = torch.randn(a_shape, generator=g).bfloat16(), torch.randn(b_shape, generator=g).bfloat16()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = torch.ops.deepinfer.bf16_einsum(equation, a, b)
    assert out.dtype == torch.bfloat16
    ref = torch.einsum(equation, a.double(), b.double())
    torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-4)
    gemms = [e for e in prof.events() if e.name in ("aten::bmm", "aten::mm")]
    assert gemms
    if not hasattr(gemms[0], "input_dtypes"):
        pytest.skip("this torch's profiler records no input dtypes: which GEMM ran is not visible")
    bf16_gemms = [e.name for e in gemms if list(e.input_dtypes)[:1] == ["c10::BFloat16"]]
    assert bool(bf16_gemms) == _has_bf16_dot(), bf16_gemms
    fp32 = torch.randn(a_shape, generator=g), torch.randn(b_shape, generator=g)    # other dtypes: torch.einsum
    torch.testing.assert_close(torch.ops.deepinfer.bf16_einsum(equation, *fp32), torch.einsum(equation, *fp32))


def _has_amx_bf16() -> bool:
    return _cpu_has("avx512f", "avx512bw", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16")


@pytest.mark.parametrize("amx", [True, False])
def test_bf16_products_amx_groups(amx):
    """On a CPU with AMX-BF16, bf16 products of groups of 16+ rows go to oneDNN (the tile units) and smaller groups
    of the same call to the dot-product kernel: groups of 0-40 rows, rows in no group zero, the fp32 sums rounded
    to bf16 once either way (within one bf16 step of the float64 sums rounded), and the same within rounding with
    the AMX path forbidden; rows_linear at 16 and 64 rows too. Where the CPU has no AMX, amx_form is False."""
    _kernels_or_skip()
    if not _has_amx_bf16():
        assert not torch.ops.deepinfer_cpu.amx_form()
        pytest.skip("this CPU has no AMX-BF16: bf16 products stay in the dot-product kernel (test_bf16_products_ops)")
    assert torch.ops.deepinfer_cpu.amx_form(amx) == amx
    try:
        g = torch.Generator().manual_seed(17)
        sizes = [0, 3, 16, 0, 40, 15, 17, 1]
        M, K, N = sum(sizes) + 3, 200, 72
        x = torch.randn(M, K, generator=g).bfloat16()
        w = torch.randn(len(sizes), K, N, generator=g).bfloat16()           # [G, K, N]
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = torch.ops.deepinfer.grouped_mm(x, w, offs)
        assert any(e.name == "deepinfer_cpu::amx_products" for e in prof.events()) == amx
        assert out.dtype == torch.bfloat16
        ref = torch.zeros(M, N, dtype=torch.float64)
        start = 0
        for e, n in enumerate(sizes):
            ref[start:start + n] = x[start:start + n].double() @ w[e].double()
            start += n
        torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-4)
        assert torch.count_nonzero(out[start:]) == 0
        for rows in (16, 64):
            xr, wr = torch.randn(rows, 300, generator=g).bfloat16(), torch.randn(50, 300, generator=g).bfloat16()
            torch.testing.assert_close(torch.ops.deepinfer.rows_linear(xr, wr).double(),
                                       (xr.double() @ wr.double().T).to(torch.bfloat16).double(),
                                       rtol=2 ** -7, atol=1e-4)
    finally:
        torch.ops.deepinfer_cpu.amx_form(True)


def test_grouped_mm_takes_the_kernel_for_few_rows(kernel_isa):
    """deepinfer::grouped_mm routes CPU fp32 groups of at most 64 rows on average to the kernel, larger ones to
    one GEMM per group (a group of a few rows of a big weight with the operands swapped) unless the kernel's
    AVX-512 form runs (then it takes every size); rows in no group are zero; bf16 rows past 64 a group take one
    bf16 GEMM per group."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 32, 40, generator=g)                     # [G, K, N]
    avx512 = kernel_isa == "avx512"
    for rows, expect in ((256, True), (257, avx512)):          # 64 rows a group on average: kernel; 64.25: torch
        x = torch.randn(rows, 32, generator=g)
        offs = torch.tensor([rows // 4, rows // 2, 3 * rows // 4, rows], dtype=torch.int32)
        out, took = _profiled_grouped_mm(x, w, offs)
        assert took == expect
        ref = torch.cat([x[int(a):int(b)] @ w[e] for e, (a, b) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))])
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    big = torch.randn(3, 512, 512, generator=g)                 # K * N = 2^18: a 2-row group swaps operands
    x = torch.randn(202, 512, generator=g)
    offs = torch.tensor([2, 2, 200], dtype=torch.int32)          # 66.7 rows a group; rows 200, 201 in none
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.5)):
        out, took = _profiled_grouped_mm(x.to(dtype), big.to(dtype), offs)
        assert took == (avx512 and dtype == torch.float32) and out.dtype == dtype
        ref = torch.cat([x[:2].double() @ big[0].double(), x[2:200].double() @ big[2].double()])
        torch.testing.assert_close(out[:200].double(), ref, rtol=2e-2, atol=tol)
        assert torch.count_nonzero(out[200:]) == 0


def test_bf16_weights_with_fp32_rows(kernel_isa):
    """bf16 weights (--weight-dtype bfloat16) meet fp32 rows in every path of both ops and give fp32 results
    equal to the fp32 math on the same (widened) weights: grouped_mm's kernel and per-group GEMMs, rows_linear's
    kernel and GEMM, and the torch paths the Python bodies take without the kernels."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 64, 520, generator=g).bfloat16()         # [G, K, N]
    for rows in (12, 400):                                       # 3 rows a group: kernel; 100: one GEMM a group
        x = torch.randn(rows, 64, generator=g)
        offs = torch.tensor([rows // 4, rows // 2, 3 * rows // 4, rows - 1], dtype=torch.int32)
        ref = torch.zeros(rows, 520, dtype=torch.float64)
        for e, (a, b) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist())):
            ref[a:b] = x[a:b].double() @ w[e].double()
        out, took = _profiled_grouped_mm(x, w, offs)
        assert took == (rows == 12 or kernel_isa == "avx512") and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ops.grouped_mm_torch(x, w, offs)[: rows - 1].double(), ref[: rows - 1],
                                   rtol=1e-5, atol=1e-4)
    lw = torch.randn(520, 509, generator=g).bfloat16()
    for M in (1, 2, 9, 100):                                     # the fallback widens lw in 5 slices
        x = torch.randn(M, 509, generator=g)
        ref = x.double() @ lw.double().T
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            op = torch.ops.deepinfer.rows_linear(x, lw)
        took = any(e.name == "deepinfer_cpu::grouped_rows_mm" for e in prof.events())
        assert took == (M <= 64 or kernel_isa == "avx512")          # the kernel ran, or (100 rows, AVX2) MKL
        for got in (op, ops.rows_linear_torch(x, lw)):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


def test_cpu_kernel_thresholds_match_the_python_ones():
    """Once the kernels load, the C++ CPU ops decide with their own copies of runtime/ops.py's thresholds (the
    Python bodies no longer run on the CPU): the two must agree."""
    import re
    from deepinfer.runtime import ops
    from deepinfer.runtime.cpu_kernels import CSRC
    src = (CSRC / "grouped_rows_mm.cpp").read_text()
    consts = {name: int(eval(expr, {})) for name, expr in re.findall(r"constexpr int64_t (k\w+) = ([0-9 <]+);", src)}
    assert consts["kMaxRowsPerGroup"] == ops.KERNEL_MAX_ROWS_PER_GROUP
    assert consts["kSwapMaxRows"] == ops.SWAP_MAX_ROWS_PER_GROUP
    assert consts["kSwapMinWeight"] == ops.SWAP_MIN_WEIGHT


def _profiled_grouped_mm(x, w, offs):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = torch.ops.deepinfer.grouped_mm(x, w, offs)
    return out, any(e.name == "deepinfer_cpu::grouped_rows_mm" for e in prof.events())


def test_moe_path_per_bucket(checkpoints):
    """The MoE form each graph bakes in: grouped prefill; on the CPU, decode gathers when fewer (token, choice)
    pairs than experts, else runs grouped; the static path's decode is dense or gathered; on CUDA every bucket
    is grouped."""
    import dataclasses
    from pathlib import Path
    from deepinfer.compile.graphs import moe_path
    from deepinfer.compile.options import CompileOptions, resolve
    small = ModelConfig.from_file(checkpoints["base"] / "config.json")          # 8 experts, top-2
    big = dataclasses.replace(small, hidden_size=1024, moe_intermediate_size=512)
    def cc(**kw):
        return resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128, **kw), small)
    cpu, cuda, static = cc(), cc(backend="cuda"), cc(moe_path="static")
    assert moe_path(small, cpu, "prefill", 32) == moe_path(big, cuda, "prefill", 32) == "grouped"
    assert moe_path(small, static, "prefill", 32) == "capacity"
    assert moe_path(small, cpu, "decode", 2) == moe_path(big, cpu, "decode", 2) == "gather"     # 4 pairs < 8
    assert moe_path(small, cpu, "decode", 4) == moe_path(big, cpu, "decode", 8) == "grouped"  # 8, 16 pairs
    assert moe_path(small, static, "decode", 8) == moe_path(big, static, "decode", 8) == "dense"
    assert moe_path(small, cuda, "decode", 1) == moe_path(small, cuda, "decode", 8) == "grouped"
    assert moe_path(big, cc(moe_decode_path="dense"), "decode", 8) == "dense"


def test_cpu_graphs_take_small_gemm_forms_only(checkpoints):
    """CPU graphs compute few-row linears in small-GEMM forms (same values); other backends do not."""
    from pathlib import Path
    from deepinfer.compile.graphs import plan_graphs
    from deepinfer.compile.model import linear
    from deepinfer.compile.options import CompileOptions, resolve
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    for backend, rows in (("cpu", 64), ("eager", 64), ("cuda", 0)):
        cc = resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128,
                                    backend=backend), m)
        assert {p.spec.small_gemm_rows for p in plan_graphs(m, cc)} == {rows}
    g = torch.Generator().manual_seed(2)
    swapped = RegionSpec(m, "head", "decode", 8, 0, 16, small_gemm_rows=64)
    for w in (torch.randn(40, 24, generator=g), torch.randn(520, 509, generator=g)):   # small; rows_linear
        for M in (1, 2, 8, 64, 65):
            x = torch.randn(M, w.shape[1], generator=g)
            torch.testing.assert_close(linear(swapped, x, w), x @ w.T, rtol=1e-5, atol=1e-4)


def test_rows_linear_with_and_without_the_kernel():
    """deepinfer::rows_linear is F.linear: the op (the CPU kernel where it runs; bf16 torch's path) and the
    torch path."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 70, generator=g), torch.randn(33, 70, generator=g)
    without = ops.rows_linear_torch(x, w)
    assert without.is_contiguous()
    torch.testing.assert_close(torch.ops.deepinfer.rows_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(without, x @ w.T, rtol=1e-5, atol=1e-5)
    half = torch.ops.deepinfer.rows_linear(x.bfloat16(), w.bfloat16())
    assert half.dtype == torch.bfloat16 and half.is_contiguous()
    torch.testing.assert_close(half.float(), x @ w.T, rtol=5e-2, atol=0.3)
    # A prefill chunk's rows (more than a group of the kernel's few-row form; K a multiple of 8: the AVX2 panel
    # form where it runs), fp32 and bf16 weights (read as they are, no widened copy).
    x, w = torch.randn(200, 72, generator=g), torch.randn(40, 72, generator=g)
    torch.testing.assert_close(torch.ops.deepinfer.rows_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
    wb = w.bfloat16()
    torch.testing.assert_close(torch.ops.deepinfer.rows_linear(x, wb), x @ wb.float().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("H,T,K,N", [(8, 16, 64, 256), (8, 1, 256, 64), (3, 5, 7, 9), (2, 16, 33, 17),
                                     (1, 200, 64, 96), (1, 100, 33, 40)])     # prefill's expansion: many rows
@pytest.mark.parametrize("xdtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                           (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_head_linear_is_per_head_linear_in_fp32(H, T, K, N, xdtype, wdtype, kernel_isa):
    """deepinfer::head_linear (the CPU decode attention's absorptions, the prefill's expansion of the latents to fp32
    keys and values): per head x[h] @ w[h].T, fp32 sums of the
    exact products of the operands as they are, from a head-major view of token-major rows (the graph's operand),
    on the op (the grouped kernel: bf16 dot products where the CPU has them) and its torch body alike."""
    g = torch.Generator().manual_seed(H * T + K)
    x = torch.randn(T, H, K, generator=g).to(xdtype).transpose(0, 1)        # [H, T, K], not contiguous
    w = torch.randn(H, N, K, generator=g).to(wdtype)
    ref = torch.bmm(x.double(), w.double().transpose(1, 2))
    for out in (torch.ops.deepinfer.head_linear(x, w), ops.head_linear_torch(x, w)):
        assert out.dtype == torch.float32 and out.shape == (H, T, N)
        # fp32 sums of exact products: within fp32 rounding of the float64 sums, not bf16's
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * K ** 0.5)


def _paged_reference(q, kv, tables, valid, L, scale):
    ctx = kv[tables].flatten(1, 2).double()
    s = (q.double() @ ctx.transpose(1, 2)) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ ctx[..., :L]), torch.logsumexp(s, -1)


@pytest.mark.parametrize("T,H,Dc,L,bs,B,scale", [(16, 8, 288, 256, 16, 8, 0.125), (5, 13, 83, 50, 4, 6, 0.125),
                                                  (3, 4, 80, 64, 16, 3, 0.125), (4, 6, 40, 24, 16, 2, 0.125),
                                                  (3, 8, 64, 48, 16, 4, 10.0), (1, 16, 72, 64, 16, 3, 0.125),
                                                  (2, 8, 288, 256, 16, 40, 2.0)])
def test_paged_mla_decode_matches(T, H, Dc, L, bs, B, scale):
    """Paged MLA decode attention against float64 over the gathered context: the op's torch path (any machine),
    then the CPU kernel, the op and the op's non-fp32 path where the kernels build. Head counts taking both
    score tiles (4 heads and 1 at a time, with key tails), widths no multiple of 8, scattered blocks, masked
    keys inside the valid span, a token with no valid key (zeros, lse -inf), score spreads far past the
    vectorised exp's clamp (scale 10), one token whose heads are split over threads, a long context (~450 valid
    keys: 14 of the kernel's key blocks, each rescaling the running softmax); and a bf16 pool."""
    g = torch.Generator().manual_seed(T * H + Dc)
    q, kv = torch.randn(T, H, Dc, generator=g), torch.randn(40, bs, Dc, generator=g)
    tables = torch.randint(0, 40, (T, B), generator=g)
    valid = torch.rand(T, B * bs, generator=g) < 0.7
    masked = T > 1                           # token 0 attends to nothing
    if masked:
        valid[0] = False
    o_ref, lse_ref = _paged_reference(q, kv, tables, valid, L, scale)

    def check(o, lse, tol=1e-5):
        assert o.dtype == lse.dtype == torch.float32 and o.shape == (T, H, L) and lse.shape == (T, H)
        torch.testing.assert_close(o.double(), o_ref, rtol=tol, atol=tol)
        if masked:
            assert torch.isneginf(lse[0]).all() and torch.count_nonzero(o[0]) == 0
        torch.testing.assert_close(lse[int(masked):].double(), lse_ref[int(masked):], rtol=tol, atol=tol)

    check(*ops.paged_mla_decode_torch(q, kv, tables, valid, L, scale))
    _kernels_or_skip()
    check(*torch.ops.deepinfer_cpu.paged_mla_decode(q, kv, tables, valid, L, scale))
    check(*torch.ops.deepinfer.paged_mla_decode(q, kv, tables, valid, L, scale))
    check(*torch.ops.deepinfer.paged_mla_decode(q.double(), kv.double(), tables, valid, L, scale))
    # a bf16 pool (--dtype bfloat16) under fp32 queries: the kernel widens the keys, exactly
    kb = kv.bfloat16()
    o_ref, lse_ref = _paged_reference(q, kb, tables, valid, L, scale)
    check(*ops.paged_mla_decode_torch(q, kb, tables, valid, L, scale), tol=3e-5)     # fp32 rounding at scale 10
    check(*torch.ops.deepinfer_cpu.paged_mla_decode(q, kb, tables, valid, L, scale))
    check(*torch.ops.deepinfer.paged_mla_decode(q, kb, tables, valid, L, scale))


@pytest.mark.parametrize("threads", [2, 3])
def test_paged_mla_decode_mixed_lengths(threads):
    """Sequences of very different lengths in one call (one long, a ramp, empty ones): the kernel cuts the threads'
    runs by valid keys and lets a thread that finishes take the others' unstarted tokens; every token still gets
    exactly its own attention."""
    _kernels_or_skip()
    g = torch.Generator().manual_seed(7)
    T, H, Dc, L, bs, B = 12, 8, 96, 64, 16, 32
    q, kv = torch.randn(T, H, Dc, generator=g), torch.randn(T * B, bs, Dc, generator=g)
    tables = torch.randperm(T * B, generator=g).view(T, B)
    lengths = [B * bs, 0, 3, 17, 40, 90, 130, 200, 1, 0, 64, 300]
    valid = torch.arange(B * bs)[None, :] < torch.tensor(lengths)[:, None]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pool in (kv, kv.bfloat16()):
            o_ref, lse_ref = _paged_reference(q, pool, tables, valid, L, 0.125)
            o, lse = torch.ops.deepinfer_cpu.paged_mla_decode(q, pool, tables, valid, L, 0.125)
            torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
            has = valid.any(1)
            torch.testing.assert_close(lse[has].double(), lse_ref[has], rtol=1e-5, atol=1e-5)
            assert torch.isneginf(lse[~has]).all() and torch.count_nonzero(o[~has]) == 0
    finally:
        torch.set_num_threads(before)


def test_paged_mla_decode_rejects_blocks_outside_the_pool():
    _kernels_or_skip()
    q, kv = torch.randn(2, 4, 16), torch.randn(3, 4, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.deepinfer.paged_mla_decode(q, kv, torch.tensor([[0], [3]]), torch.ones(2, 4, dtype=torch.bool), 8, 1.0)


def _prefill_reference(q, k, v, starts, positions, scale):
    rel = torch.arange(k.shape[0])[None, :] - starts[:, None]
    valid = (rel >= 0) & (rel <= positions[:, None])                                   # [T, C]
    s = torch.einsum("thd,chd->htc", q.double(), k.double()) * scale
    p = torch.softmax(s.masked_fill(~valid[None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("htc,chv->thv", p, v.double())


def _packed(lengths: list[int], pad: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """starts, positions of sequences packed back to back (the first continuing from `offset` keys of context
    before the chunk), then `pad` padding queries (position -1: no keys)."""
    starts, positions, at = [], [], 0
    for i, n in enumerate(lengths):
        first = offset if i == 0 else 0
        starts += [at] * n
        positions += list(range(first, first + n))
        at += first + n
    return torch.tensor(starts + [0] * pad), torch.tensor(positions + [-1] * pad)


@pytest.mark.parametrize("H,D,Dv,lengths,pad,offset,C,scale", [
    (4, 48, 32, [256], 0, 0, 256, 0.144),              # the demo model's chunk: one causal prompt
    (4, 48, 32, [256], 0, 256, 512, 0.144),            # the second chunk of a prompt: 256 keys before it
    (3, 19, 13, [100, 50, 70], 36, 0, 256, 0.2),       # three prompts packed, padding; widths no multiple of 8
    (5, 192, 128, [37], 0, 200, 300, 0.07),            # one query block, context past the last key
    (2, 8, 16, [1, 130, 3], 2, 5, 160, 10.0),          # spreads far past the vectorised exp's clamp
    (2, 16, 8, [10], 120, 0, 64, 0.25),                # whole query blocks of padding
])
def test_prefill_attention_matches(H, D, Dv, lengths, pad, offset, C, scale):
    """The CPU prefill attention op against float64: the torch form (any machine), then the kernel, the op, and
    the op's torch path for other dtypes where the kernels build. Each query sees keys starts .. starts + position
    only (its own sequence, causally); a padding query sees none and gets zeros."""
    g = torch.Generator().manual_seed(H * D + C)
    starts, positions = _packed(lengths, pad, offset)
    T = len(starts)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(C, H, D, generator=g), torch.randn(C, H, Dv, generator=g)
    ref = _prefill_reference(q, k, v, starts, positions, scale)

    def check(o):
        assert o.dtype == torch.float32 and o.shape == (T, H, Dv)
        torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)
        if pad:
            assert torch.count_nonzero(o[-pad:]) == 0

    check(ops.prefill_attention_torch(q, k, v, starts, positions, scale))
    _kernels_or_skip()
    check(torch.ops.deepinfer_cpu.prefill_attention(q, k, v, starts, positions, scale))
    check(torch.ops.deepinfer.prefill_attention(q, k, v, starts, positions, scale))
    check(torch.ops.deepinfer.prefill_attention(q.double(), k.double(), v.double(), starts, positions, scale).float())


@pytest.mark.parametrize("H,D,Dv,lengths,pad,offset,C,scale", [
    (2, 96, 64, [512], 0, 0, 512, 0.1),                # one causal prompt: blocks over 64-512 keys, both forms
    (2, 48, 32, [256], 0, 512, 1024, 0.144),           # a third chunk at the demo model's widths: both forms
    (3, 19, 13, [100, 50, 70], 36, 0, 256, 0.2),       # short spans only; odd widths
    (2, 96, 64, [300], 10, 400, 720, 0.1),             # one long prompt's continuation, padding
])
def test_prefill_attention_bf16_operands(H, D, Dv, lengths, pad, offset, C, scale):
    """bf16 q, k, v (--matmul-dtype bfloat16) against float64 on the same bf16 values. Where the CPU has bf16 dot
    products, a block of 64 queries whose keys x (D + Dv) reach ops.PREFILL_BF16_MIN_WORK takes bf16 GEMMs (its
    scores, probabilities and outputs rounded to bf16: within that rounding, and not exact), a block with less the
    fp32 form on the widened operands (to 1e-5); elsewhere every block takes the fp32 form. Padding queries get
    zeros."""
    _kernels_or_skip()
    g = torch.Generator().manual_seed(H * D + C)
    starts, positions = _packed(lengths, pad, offset)
    T = len(starts)
    q, k, v = (torch.randn(T, H, D, generator=g).bfloat16(), torch.randn(C, H, D, generator=g).bfloat16(),
               torch.randn(C, H, Dv, generator=g).bfloat16())
    ref = _prefill_reference(q, k, v, starts, positions, scale)
    o = torch.ops.deepinfer.prefill_attention(q, k, v, starts, positions, scale)
    assert o.dtype == torch.float32 and o.shape == (T, H, Dv)
    real = positions >= 0
    lo, hi = starts.clamp(min=0), torch.where(real, torch.clamp(starts + positions + 1, max=C), starts)
    long_rows = torch.zeros(T, dtype=torch.bool)
    for b in range(0, T, 64):
        rows = real[b:b + 64]
        span = hi[b:b + 64][rows].max() - lo[b:b + 64][rows].min() if rows.any() else 0
        if rows.any() and span * (D + Dv) >= ops.PREFILL_BF16_MIN_WORK:
            long_rows[b:b + 64] = ops.cpu_has_bf16_dot()
    err = (o.double() - ref).abs()
    if not long_rows.all():
        assert err[~long_rows].max() <= 1e-5
    if long_rows.any():
        assert 1e-6 < err[long_rows].max() <= 2e-2
    if pad:
        assert torch.count_nonzero(o[-pad:]) == 0
