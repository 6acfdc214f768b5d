"""Our compiled graphs against transformers' DeepseekV3ForCausalLM on the same weights (float32)."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import VARIANTS, hf_greedy, hf_logits, hf_model
from deepinfer.runtime.artifact import open_artifact
from deepinfer.runtime.engine import Engine, make_runner
from deepinfer.runtime.sequence import SamplingParams
from stepper import Stepper, rel_err

TOL = 1e-4


def prompt_of(n: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


# --matmul-dtype bfloat16: the rows of multi-row products rounded to bf16 and the sums too, the prefill attention's
# expansion of the latents included (norms, softmax, routing, residuals and KV stay fp32, and so do the prefill
# attention kernel's scores and weighted sums). Measured: 2.05e-2 worst over every bucket of this checkpoint (2.16e-2
# with those scores and sums as bf16 GEMMs too, before the kernel took them); transformers itself in bf16 on the
# same weights is 0.8e-2 to 3.7e-1 off its float32 (five prompts of 4-125 tokens).
TOL_BF16_PRODUCTS = 3e-2
# --dtype bfloat16: activations, KV pool and math in bf16 (the CPU graphs' products widened to fp32 where the CPU has
# no bf16 dot products, rounded once, as bf16 hardware computes them), against transformers' float32. Ours and
# transformers' own bf16 alike are ~1e-2 off at the median and flip a near-tied routing choice now and then (0.37 at
# one position of this test's prompts); on this checkpoint, 720 decode positions: ours median 1.05e-2 with 11 over
# 5e-2, transformers' bf16 0.99e-2 with 17.
TOL_BF16_ACTIVATIONS = 2e-2


@pytest.mark.parametrize("variant", [*VARIANTS, "bf16_weights", "bf16_weights_static", "bf16_products",
                                     "bf16_activations", "shared_separate"])
def test_every_bucket_matches_logits(variant, checkpoints, bf16_checkpoint, compile_artifact):
    """Every graph kind against transformers in float32. bf16_weights: a bf16 checkpoint served with bf16
    weight matrices and float32 math, against transformers' float32 on the same (widened) weights: as exact;
    with a 128-token prefill bucket (GEMMs past the small-GEMM rows), and on the static MoE path with a capacity
    of 2 (every prefill chunk overflows: capacity, dense decode and the dense rerun all meet bf16 weights).
    bf16_products: --matmul-dtype bfloat16, within the bf16 rounding (TOL_BF16_PRODUCTS) and not exact.
    bf16_activations: --dtype bfloat16 (TOL_BF16_ACTIVATIONS).
    The other variants take --shared-experts auto: the shared experts as more groups of the experts' GEMMs on the
    grouped path (decode at T=4 and prefill; T=1 gathered runs them apart); shared_separate: their own MLP."""
    if variant == "bf16_products":
        ck = bf16_checkpoint
        art = open_artifact(compile_artifact(ck, matmul_dtype="bfloat16", prefill_buckets=(32, 128)))
        assert art.manifest.compile.matmul_dtype == "bfloat16"
    elif variant == "bf16_activations":
        ck = bf16_checkpoint
        art = open_artifact(compile_artifact(ck, dtype="bfloat16", prefill_buckets=(32, 128)))
    elif variant.startswith("bf16_weights"):
        ck = bf16_checkpoint
        static = dict(moe_path="static", moe_capacity=2) if variant.endswith("static") else {}
        art = open_artifact(compile_artifact(ck, weight_dtype="bfloat16", prefill_buckets=(32, 128), **static))
        dtypes = {w.key: w.dtype for g in art.manifest.graphs for w in g.weights}
        assert dtypes["moe.experts_down"] == dtypes["attn.o_proj"] == dtypes["embed"] == "bfloat16"
        assert dtypes["input_layernorm"] == dtypes["moe.router_weight"] == "float32"
    elif variant == "shared_separate":
        ck = checkpoints["two_dense_yarn"]                  # n_shared_experts=2
        art = open_artifact(compile_artifact(ck, shared_experts="separate"))
        shapes = {w.key: w.shape for g in art.manifest.graphs for w in g.weights}
        assert shapes["moe.experts_gate_up"][0] == 8 and "moe.shared_down" in shapes
    else:
        ck = checkpoints[variant]
        art = open_artifact(compile_artifact(ck))
        shapes = {w.key: w.shape for g in art.manifest.graphs for w in g.weights}
        assert shapes["moe.experts_gate_up"][0] == 8 + json.loads((ck / "config.json").read_text())["n_shared_experts"]
    cc = art.manifest.compile
    hf = hf_model(ck)
    runner = make_runner(art, rank=0)
    errs = []
    for C in cc.context_buckets:
        # Prompt-as-decode graphs: one sequence's prompt in T-token steps, logits of every token.
        for T in cc.decode_buckets:
            st = Stepper(runner)
            n = min(C, 3 * T + 1)
            prompt = prompt_of(n, seed=T * 1000 + C)
            ref = hf_logits(hf, prompt)
            seq = st.new(prompt)
            pos = 0
            while pos < n:
                k = min(T, n - pos)
                got = st.run("decode", T, C, [(seq, k)], all_logits=True)[0]
                errs.append(rel_err(got, ref[pos:pos + k]))
                pos += k
        # Several sequences in one decode step, each at its own position.
        T = max(cc.decode_buckets)
        st = Stepper(runner)
        prompts = [prompt_of(5 + 7 * i, seed=i) for i in range(T)]
        seqs = [st.new(p) for p in prompts]
        for s in seqs:
            while s.num_computed < len(s.prompt_ids) - 1:
                st.run("decode", T, C, [(s, min(T, len(s.prompt_ids) - 1 - s.num_computed))])
        got = st.run("decode", T, C, [(s, 1) for s in seqs])
        for s, g in zip(seqs, got):
            errs.append(rel_err(g, hf_logits(hf, s.prompt_ids)[-1]))
        # Prefill-chunk graphs: a prompt in T-token chunks, the last token's logits per chunk.
        for T in cc.prefill_buckets:
            if T > C:
                continue
            st = Stepper(runner)
            n = C - 3
            prompt = prompt_of(n, seed=T + C)
            ref = hf_logits(hf, prompt)
            seq = st.new(prompt)
            pos = 0
            while pos < n:
                k = min(T, n - pos)
                got = st.run("prefill", T, C, [(seq, k)])[0]
                errs.append(rel_err(got, ref[pos + k - 1]))
                pos += k
        # Several sequences packed into one prefill chunk: the second chunk of one prompt and two whole ones.
        T, bs = max(cc.prefill_buckets), cc.block_size
        if T <= C and 4 * bs <= C:
            st = Stepper(runner)
            long, short = st.new(prompt_of(bs + 4, seed=C + 1)), [st.new(prompt_of(n, seed=C + n)) for n in (6, 11)]
            st.run("prefill", T, C, [(long, 10)])
            got = st.run("prefill", T, C, [(long, bs - 6), *((s, len(s.prompt_ids)) for s in short)])
            for s, g in zip([long, *short], got):
                errs.append(rel_err(g, hf_logits(hf, s.prompt_ids)[-1]))
    worst = max(errs)
    if variant == "bf16_products":      # bf16 products really ran, and stay as close as the rounding allows
        assert 1e-5 < worst <= TOL_BF16_PRODUCTS, f"{variant}: worst relative logits error {worst:.2e}"
        return
    if variant == "bf16_activations":   # bf16 really ran; as close as bf16 gets, a routing flip here and there
        median, flips = sorted(errs)[len(errs) // 2], sum(e > 5e-2 for e in errs)
        assert 1e-3 < median <= TOL_BF16_ACTIVATIONS and flips <= max(1, len(errs) // 20), \
            f"{variant}: median relative logits error {median:.2e}, {flips} of {len(errs)} over 5e-2"
        return
    assert worst <= TOL, f"{variant}: worst relative logits error {worst:.2e} > {TOL}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match(variant, checkpoints, compile_artifact):
    ck = checkpoints[variant]
    engine = Engine.from_artifact(compile_artifact(ck))
    hf = hf_model(ck)
    for n_prompt in (5, 45):          # a prompt-as-decode prompt and a prefill-chunked one
        prompt = prompt_of(n_prompt, seed=n_prompt)
        want = hf_greedy(hf, prompt, 32)
        got = engine.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0].output_ids
        assert got == want, f"{variant}: prompt of {n_prompt} tokens"
