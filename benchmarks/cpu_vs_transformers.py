"""Our compiled engine vs transformers vs our own model in eager PyTorch, on the same checkpoint, this CPU.

    python benchmarks/cpu_vs_transformers.py [--configs small,mid,mid-bf16] [--layouts 1x1,2x2,4x4] [--out FILE.md]
                                             [--prompt-len 32]

Builds random-weight DeepSeek-V3 checkpoints with transformers' save_pretrained, compiles them with the
`cpu` backend (AOTInductor; cached by graph hash), and prints one table: prefill tokens/s, decode
ms/token at batch 1, decode tokens/s at 16 concurrent sequences, and the time to the first tokens of 16
concurrent 32-token prompts, each with the ratio to transformers (its batched `generate`). --prompt-len N
makes the decode prompts (and the first tokens' prompts) N tokens long: decode over a longer context, where
attention's share of a step grows.
A config named NAME-bf16 is NAME's model saved as a bf16 checkpoint (as real ones ship; the demo model is one
too), which we compile as stored (--weight-dtype auto: bf16 weight matrices, float32 math) and transformers
runs in float32 (the same math on the same weights: the logits agree to float32 rounding; tests/compile/test_matches_transformers.py) and in
bfloat16 (its own math; faster at batch 1 on this CPU, slower in batches); each "x HF" there is against the
faster transformers of the two, column by column; a second row of ours compiles them with --matmul-dtype
bfloat16 (bf16 products, fp32 sums: transformers' bf16 rounding of the operands, fp32 everything else), and
where the CPU has bf16 dot products (or with --bf16-activations) a third with --dtype bfloat16 (bf16 activations
throughout, as transformers' bf16 run).
With --layouts, decode ms/token per cp x ep layout and the collectives' share of a decode step.
With --long-prompts 512,1024,2000, a second table: the time to the first token of one prompt of each length
(prefill tokens/s), transformers against ours in 256-token chunks and with 256- and 1024-token buckets (the
scheduler then takes 1024-token chunks for a lone long prompt; for a bf16 checkpoint with --matmul-dtype
bfloat16 too), the artifacts' context limit the next power of two above the longest prompt.
Our engines run without the prefix cache (the rounds repeat their prompts, which it would serve without
computing them: transformers has no such cache). Same threads for everyone (torch.get_num_threads()); each figure is the best of 4-10 rounds in which the engines
take turns (this machine's speed drifts over minutes; turns expose all engines to the same drift). Ratios matter
more than absolute numbers here.
The roofline row is the best any engine could do on this machine (benchmarks/roofline.py): decode floored by
reading the step's fp32 weights at the memory bandwidth (the better of a large copy and a large read), prefill
by its FLOPs at the GEMM rate (or its weights, whichever is slower), both the best measured in the run (before and after each config); its "x HF" is the
largest ratio to transformers physically possible.
With either row, a second roofline takes bf16 weights and the measured bf16 GEMM rate (or the fp32 rate
where that is faster: on CPUs without bf16 dot products).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

CONFIGS = {
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                  topk_group=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=128, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32, n_shared_experts=1, max_position_embeddings=2048),
    "mid": dict(vocab_size=16384, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                num_hidden_layers=8, num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=64,
                qk_rope_head_dim=32, v_head_dim=64, n_shared_experts=1, max_position_embeddings=2048),
}
PREFILL_LEN = 256
DECODE_TOKENS = 32
BATCH = 16
PROMPT_LEN = 32     # the decode measurements' prompts (--prompt-len)


# Rounds per measurement. Every engine runs each measurement once a round, the engines taking turns: this
# machine's speed drifts by tens of percent over minutes, and taking turns exposes all of them to the same drift
# (measuring one engine after the other moved the ratios by up to 1.5x between runs). The one-prompt prefill takes
# milliseconds: 3 rounds of it gave the demo model's ratio anywhere in 1.89-2.28x (best of each 3 of 60 alternated
# rounds on one VM, the best of all 60 2.12x); 10 rounds cost under a second.
ROUNDS = {"prefill": 10, "t1": 6, "tn": 4, "b1": 4, "bn": 4}


def interleaved(runs: dict[str, dict[str, Callable[[], object]]], rounds: dict[str, int] | None = None
                ) -> dict[str, dict[str, float]]:
    """Best wall time of each measurement per engine, the engines taking turns round by round."""
    rounds = ROUNDS if rounds is None else rounds
    best: dict[str, dict[str, float]] = {name: {} for name in runs}
    for r in range(max(rounds.values())):
        for key, n in rounds.items():
            if r >= n:
                continue
            for name, fns in runs.items():
                t = time.perf_counter()
                fns[key]()
                dt = time.perf_counter() - t
                best[name][key] = min(best[name].get(key, float("inf")), dt)
    return best


def figures(t: dict[str, float]) -> dict:
    """The table's four figures from one engine's best times."""
    return {"prefill_tok_s": PREFILL_LEN / t["prefill"], "decode_ms": 1e3 * (t["tn"] - t["t1"]) / DECODE_TOKENS,
            "batch_tok_s": BATCH * DECODE_TOKENS / (t["bn"] - t["b1"]), "batch_ttft_ms": 1e3 * t["b1"]}


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


# -- transformers ---------------------------------------------------------------------------------------
def transformers_model(ck: Path, dtype: torch.dtype):
    """transformers' DeepseekV3ForCausalLM on the checkpoint, with its fastest experts implementation (and its name)."""
    from checkpoints import hf_model
    hf = hf_model(ck, dtype)
    try:
        hf.set_experts_implementation("grouped_mm")
        return hf, "grouped_mm"
    except Exception:
        return hf, "default"


def transformers_runs(ck: Path, vocab: int, dtype: torch.dtype = torch.float32
                      ) -> tuple[dict[str, Callable[[], object]], str]:
    """The measurements on transformers' DeepseekV3ForCausalLM (its batched `generate`, greedy)."""
    hf, impl = transformers_model(ck, dtype)
    p = torch.tensor(prompts(1, PREFILL_LEN, vocab))
    short = torch.tensor(prompts(1, PROMPT_LEN, vocab))
    batch = torch.tensor(prompts(BATCH, PROMPT_LEN, vocab, seed=1))

    @torch.inference_mode()
    def gen(x, n):
        return hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    @torch.inference_mode()
    def prefill():
        # The last position's logits only, as generate's prefill computes them (and our prefill does): logits for
        # every position cost transformers 16-19% more on `mid` and made the ratio look that much better.
        return hf(p, logits_to_keep=1)
    gen(short, 2)                                     # warm
    return {"prefill": prefill, "t1": lambda: gen(short, 1), "tn": lambda: gen(short, DECODE_TOKENS + 1),
            "b1": lambda: gen(batch, 1), "bn": lambda: gen(batch, DECODE_TOKENS + 1)}, impl


# -- ours -----------------------------------------------------------------------------------------------
def engine_runs(engine, vocab: int) -> dict[str, Callable[[], object]]:
    from deepinfer.runtime.sequence import SamplingParams

    def gen(ps, n):
        return engine.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True))
    gen(prompts(2, 40, vocab), 4)                     # warm every graph kind once
    p, short = prompts(1, PREFILL_LEN, vocab), prompts(1, PROMPT_LEN, vocab)
    batch = prompts(BATCH, PROMPT_LEN, vocab, seed=1)
    return {"prefill": lambda: gen(p, 1), "t1": lambda: gen(short, 1), "tn": lambda: gen(short, DECODE_TOKENS + 1),
            "b1": lambda: gen(batch, 1), "bn": lambda: gen(batch, DECODE_TOKENS + 1)}


def bench_engine(engine, vocab: int) -> dict:
    """One engine on its own (the layout table)."""
    return figures(interleaved({"engine": engine_runs(engine, vocab)})["engine"])


def eager_engine(art: Path):
    """Our model as plain PyTorch: the same region functions, called directly (no export, no compiler)."""
    from deepinfer.compile.graphs import RegionModule, plan_graphs
    from deepinfer.runtime.artifact import load_weights, open_artifact
    from deepinfer.runtime.engine import Engine
    from deepinfer.runtime.model_runner import ModelRunner
    from deepinfer.runtime.tokenizer import load_tokenizer
    a = open_artifact(art)
    m = a.manifest
    # plain F.linear everywhere: the CPU small-GEMM forms are for the compiler (a multiply-sum is a fused
    # reduction there, a full temporary here)
    graphs = {p.name: RegionModule(dataclasses.replace(p.spec, small_gemm_rows=0))
              for p in plan_graphs(m.model, m.compile)}
    runner = ModelRunner(m, graphs, load_weights(a, 0, torch.device("cpu")))
    return Engine(m, runner, load_tokenizer(a.root, [t.path for t in m.tokenizer], None), prefix_caching=False)


def compile_for(ck: Path, out: Path, cache: Path, cp: int = 1, ep: int = 1, backend: str = "cpu",
                matmul_dtype: str = "auto", dtype: str = "float32", prefill_buckets: tuple[int, ...] = (256,),
                limit: int | None = None) -> Path:
    """The benchmark's artifact. Without `limit`: one that holds the decode measurements (context buckets 128, 256,
    ... below it); with it (the long-prompt table): that context limit, the compiler's own context buckets."""
    from deepinfer.compile.driver import compile_artifact
    from deepinfer.compile.options import CompileOptions
    if limit is None:
        limit = 512                  # past the prompts, the decoded tokens and a chunk's padding
        while limit < PROMPT_LEN + DECODE_TOKENS + 1:
            limit *= 2
        buckets = tuple(b for b in (128, 256, 512, 1024, 2048, 4096) if b < limit)
    else:
        buckets = "auto"
    compile_artifact(CompileOptions(model=ck, out=out, backend=backend, cp=cp, ep=ep, decode_buckets=(1, 16),
                                    prefill_buckets=prefill_buckets, context_buckets=buckets, context_limit=limit,
                                    cache_dir=cache, matmul_dtype=matmul_dtype, dtype=dtype), log=lambda s: None)
    return out


# the long-prompt table's artifacts: prefill buckets and --matmul-dtype (the last for bf16 checkpoints only)
LONG_CHUNKS = {"long256": ((256,), "auto"), "long1024": ((256, 1024), "auto"), "long1024mm16": ((256, 1024), "bfloat16")}


def long_prompt_runs(ck: Path, work: Path, name: str, cache: Path, lengths: list[int], vocab: int, limit: int,
                     bf16: bool) -> dict[str, dict[str, Callable[[], object]]]:
    """One-prompt prefills (one token generated) of each length, on transformers (in fp32, and in bf16 too for a
    bf16 checkpoint) and our LONG_CHUNKS artifacts."""
    from deepinfer.runtime.engine import Engine
    from deepinfer.runtime.sequence import SamplingParams
    ps = {n: prompts(1, n, vocab, seed=n) for n in lengths}
    runs = {}
    for key, dtype in (("hf", torch.float32), ("hf16", torch.bfloat16))[:2 if bf16 else 1]:
        hf = transformers_model(ck, dtype)[0]

        @torch.inference_mode()
        def hf_prefill(p, hf=hf):
            return hf(torch.tensor(p), logits_to_keep=1)
        runs[key] = {str(n): (lambda p=p, f=hf_prefill: f(p)) for n, p in ps.items()}
    for key, (buckets, matmul) in LONG_CHUNKS.items():
        if matmul == "bfloat16" and not bf16:
            continue
        out = compile_for(ck, work / f"art-{name}-{key}", cache, matmul_dtype=matmul,
                          prefill_buckets=tuple(sorted({min(b, limit) for b in buckets})), limit=limit)
        eng = Engine.from_artifact(out, prefix_caching=False)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        eng.generate(prompts(2, 40, vocab), one)
        runs[key] = {str(n): (lambda p=p, eng=eng: eng.generate(p, one)) for n, p in ps.items()}
    return runs


def collective_share(engine, vocab: int) -> float:
    """Fraction of a decode step's leader wall time spent inside collectives (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    from deepinfer.runtime.sequence import SamplingParams
    ps = prompts(1, PROMPT_LEN, vocab)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        engine.generate(ps, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True))
        wall = time.perf_counter() - t
    # gloo:/nccl: events span each collective on its backend thread, waiting for the peers included
    # (the c10d:: and _c10d_functional:: events nest inside or only enqueue: counting them too double counts).
    coll = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith(("gloo:", "nccl:")))
    return coll / 1e6 / wall


def bench_roofline(m, bw: float, flops: float, weight_bytes: int = 4) -> dict:
    """Floors for the same four measurements (fp32 weights, 4 bytes a parameter; bf16 weights 2)."""
    from roofline import step_floor_s

    def step_s(tokens: int, context: float, logit_rows: int, kv_rows: float) -> float:
        return step_floor_s(m, tokens, context, logit_rows, weight_bytes, bw, flops, kv_rows)
    ctx = PROMPT_LEN + DECODE_TOKENS / 2                      # decode: keys per token, on average
    # the latent KV a step reads: each decode token its own context; a prefill its sequence's keys once
    return {"prefill_tok_s": PREFILL_LEN / step_s(PREFILL_LEN, (PREFILL_LEN + 1) / 2, 1, PREFILL_LEN),
            "decode_ms": 1e3 * step_s(1, ctx, 1, ctx),
            "batch_tok_s": BATCH / step_s(BATCH, ctx, BATCH, BATCH * ctx),
            "batch_ttft_ms": 1e3 * step_s(BATCH * PROMPT_LEN, (PROMPT_LEN + 1) / 2, BATCH, BATCH * PROMPT_LEN)}


def main() -> None:
    global PROMPT_LEN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="demo,mid,mid-bf16",
                    help="demo (the trained demo model), small, mid, and any of them + -bf16 (a bf16 checkpoint)")
    ap.add_argument("--layouts", default="", help="e.g. 1x1,2x2,4x4 (cp x ep) for the small config")
    ap.add_argument("--no-bf16-products", dest="bf16_products", action="store_false",
                    help="skip the --matmul-dtype bfloat16 row of bf16 checkpoints")
    ap.add_argument("--bf16-activations", action=argparse.BooleanOptionalAction, default=None,
                    help="a --dtype bfloat16 row (bf16 activations) for bf16 checkpoints; default: where the CPU has "
                         "bf16 dot products (elsewhere its products run as fp32 FMAs of widened operands: slower "
                         "than float32 math)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN,
                    help="tokens in each decode measurement's prompt (decode over a longer context)")
    ap.add_argument("--long-prompts", default="",
                    help="e.g. 512,1024,2000: the first token of one prompt of each length, a second table")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="also write the tables (markdown) to this file")
    args = ap.parse_args()
    if args.prompt_len < 1:
        ap.error(f"--prompt-len must be at least 1, got {args.prompt_len}")
    PROMPT_LEN = args.prompt_len
    try:
        long_lens = sorted({int(x) for x in args.long_prompts.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--long-prompts takes comma-separated token counts, got {args.long_prompts!r}")
    if long_lens and long_lens[0] < 1:
        ap.error(f"--long-prompts: a prompt needs at least 1 token, got {long_lens[0]}")
    from checkpoints import make_checkpoint
    from deepinfer.runtime.engine import Engine
    work = Path(args.workdir or tempfile.mkdtemp(prefix="deepinfer-bench-"))
    cache = work / "cache"
    from roofline import copy_bandwidth, gemm_flops, read_bandwidth
    from deepinfer.common.model_config import ModelConfig
    cpu = torch.device("cpu")
    # The machine's peaks, measured before and after each config's runs; the rooflines take the best seen in the
    # whole run (this machine's speed drifts by tens of percent: one measurement at the start once put the
    # "roofline" below what the engines had just done).
    peaks = {"bw": 0.0, "bw_low": float("inf"), "flops": 0.0, "flops16": 0.0}
    from deepinfer.compile.driver import cpu_has_bf16_dot
    bf16_dot = cpu_has_bf16_dot()
    bf16_activations = bf16_dot if args.bf16_activations is None else args.bf16_activations

    def measure_peaks() -> None:
        bw = max(copy_bandwidth(cpu), read_bandwidth(cpu))
        peaks["bw"], peaks["bw_low"] = max(peaks["bw"], bw), min(peaks["bw_low"], bw)
        peaks["flops"] = max(peaks["flops"], gemm_flops(cpu, torch.float32, repeat=5))
        if bf16_dot:                 # oneDNN's bf16 GEMM (without the instructions: under 1 GFLOP/s, minutes a round)
            peaks["flops16"] = max(peaks["flops16"], gemm_flops(cpu, torch.bfloat16, repeat=5))
    measure_peaks()
    table = []          # per config: (name, its engines' rows, the faster transformers' figures, its rooflines)
    long_table = []     # per config: (name, prompt lengths, best times per engine and length, its config, bf16)
    for name in filter(None, args.configs.split(",")):
        if name == "demo":           # the trained demo model: realistic, balanced routing
            from deepinfer.compile.options import DEMO_MODEL
            ck, cfg = DEMO_MODEL, {"vocab_size": 4096}
        else:
            cfg = CONFIGS[name.removesuffix("-bf16")]
            ck = work / f"ck-{name}"
            if not (ck / "config.json").exists():
                make_checkpoint(ck, seed=0, dtype=torch.bfloat16 if name.endswith("-bf16") else torch.float32, **cfg)
        from deepinfer.compile.checkpoint import Checkpoint
        bf16 = Checkpoint(ck).stored_matrix_dtype() == "bfloat16"     # the demo model too; compiled as stored
        art = compile_for(ck, work / f"art-{name}", cache)
        hf_fns, impl = transformers_runs(ck, cfg["vocab_size"])
        eng = Engine.from_artifact(art, prefix_caching=False)
        runs = {"hf": hf_fns, "ours": engine_runs(eng, cfg["vocab_size"]),
                "eager": engine_runs(eager_engine(art), cfg["vocab_size"])}
        if bf16:
            runs["hf16"] = transformers_runs(ck, cfg["vocab_size"], torch.bfloat16)[0]
            if args.bf16_products:
                art16 = compile_for(ck, work / f"art-{name}-mm16", cache, matmul_dtype="bfloat16")
                runs["ours16"] = engine_runs(Engine.from_artifact(art16, prefix_caching=False), cfg["vocab_size"])
            if bf16_activations:
                arta = compile_for(ck, work / f"art-{name}-bf16", cache, dtype="bfloat16")
                runs["oursa16"] = engine_runs(Engine.from_artifact(arta, prefix_caching=False), cfg["vocab_size"])
        best = interleaved(runs)
        hf, ours, eager = (figures(best[k]) for k in ("hf", "ours", "eager"))
        rows = [("transformers experts=" + impl + (" (fp32)" if bf16 else ""), hf)]
        if bf16:
            hf16 = figures(best["hf16"])
            rows.append(("transformers experts=" + impl + " (bf16)", hf16))
            hf = {k: (min if k in ("decode_ms", "batch_ttft_ms") else max)(hf[k], hf16[k]) for k in hf}
        mc = ModelConfig.from_file(Path(ck) / "config.json")
        extra = [(label, figures(best[k])) for k, label in (
            ("ours16", "deepinfer compiled (cpu, --matmul-dtype bfloat16)"),
            ("oursa16", "deepinfer compiled (cpu, --dtype bfloat16)")) if k in best]

        def roofs(mc=mc, bf16=bf16, extra=extra) -> list[tuple[str, dict]]:
            out = [("roofline (this machine)", bench_roofline(mc, peaks["bw"], peaks["flops"], 2 if bf16 else 4))]
            if extra:
                # bf16 products are exact in fp32: the fp32 FMA rate is a floor for them where it is the faster
                out.append(("roofline (bf16 products)",
                            bench_roofline(mc, peaks["bw"], max(peaks["flops16"], peaks["flops"]), 2)))
            return out
        table.append((name, [*rows, ("deepinfer eager PyTorch", eager), ("deepinfer compiled (cpu)", ours), *extra],
                      hf, roofs))
        if long_lens:
            fits = [n for n in long_lens if n < mc.max_position_embeddings]
            limit = 512
            while fits and limit <= max(fits):
                limit *= 2
            limit = min(limit, mc.max_position_embeddings)
            if fits:
                del runs, eng            # the engines above: their pools and weights
                long_runs = long_prompt_runs(ck, work, name, cache, fits, cfg["vocab_size"], limit, bf16)
                long_best = interleaved(long_runs, {str(n): 2 for n in fits})
                del long_runs
                long_table.append((name, fits, long_best, mc, bf16))
            skipped = [n for n in long_lens if n not in fits]
            if skipped:
                print(f"{name}: --long-prompts {skipped} skipped: not below its max_position_embeddings "
                      f"{mc.max_position_embeddings}", flush=True)
        measure_peaks()
        print(f"{name}: measured", flush=True)
    lines = [f"threads {torch.get_num_threads()}, torch {torch.__version__}, prefill {PREFILL_LEN} tokens, decode "
             f"{DECODE_TOKENS} tokens after a {PROMPT_LEN}-token prompt, batch {BATCH}; machine peaks (best seen in this run): "
             f"memory bandwidth {peaks['bw'] / 1e9:.1f} GB/s (a large copy or read; "
             f"the lowest measured {peaks['bw_low'] / 1e9:.1f}), fp32 GEMM {peaks['flops'] / 1e9:.0f} GFLOP/s, "
             + (f"bf16 GEMM {peaks['flops16'] / 1e9:.0f} GFLOP/s" if bf16_dot else
                "no bf16 dot products on this CPU (bf16 products run as fp32 FMAs)"), "",
             "| config | engine | prefill tok/s | x HF | decode ms/tok (b=1) | x HF | decode tok/s (b=16) | x HF "
             "| first tokens of 16 (ms) | x HF |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, engines, hf, roofs in table:
        for label, r in (*engines, *roofs()):
            lines.append(f"| {name} | {label} | {r['prefill_tok_s']:.0f} | {r['prefill_tok_s'] / hf['prefill_tok_s']:.2f} "
                         f"| {r['decode_ms']:.2f} | {hf['decode_ms'] / r['decode_ms']:.2f} | {r['batch_tok_s']:.0f} "
                         f"| {r['batch_tok_s'] / hf['batch_tok_s']:.2f} | {r['batch_ttft_ms']:.0f} "
                         f"| {hf['batch_ttft_ms'] / r['batch_ttft_ms']:.2f} |")
    if long_table:
        from roofline import step_floor_s
        lines += ["", "One prompt's first token (prefill tok/s; transformers experts=grouped_mm, for a bf16 checkpoint the "
                  "faster of fp32 and bf16; ours in fp32 math, and for a bf16 checkpoint with --matmul-dtype bfloat16 "
                  "too; the rooflines at the fp32 GEMM rate and at the bf16 one)", "",
                  "| config | prompt tokens | transformers | ours, 256-token chunks | x HF | ours, 256 + 1024 buckets "
                  "| x HF | the same, bf16 products | x HF | roofline | x HF | roofline (bf16 products) | x HF |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, fits, best, mc, bf16 in long_table:
            for n in fits:
                hf_r = max(n / best[k][str(n)] for k in ("hf", "hf16") if k in best)     # the faster
                cells = []
                for k in ("long256", "long1024", "long1024mm16"):
                    r = n / best[k][str(n)] if k in best else None
                    cells.append(f"{r:.0f} | {r / hf_r:.2f}" if r else "- | -")
                for fl in (peaks["flops"], max(peaks["flops16"], peaks["flops"]) if bf16 else None):
                    roof = fl and n / step_floor_s(mc, n, (n + 1) / 2, 1, 2 if bf16 else 4, peaks["bw"], fl, n)
                    cells.append(f"{roof:.0f} | {roof / hf_r:.2f}" if roof else "- | -")
                lines.append(f"| {name} | {n} | {hf_r:.0f} | " + " | ".join(cells) + " |")
    if args.layouts:
        from deepinfer.compile.options import DEMO_MODEL
        lines += ["", "| layout (demo model) | world | decode ms/tok (b=1) | decode tok/s (b=16) | collectives share of a decode step |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        cfg, ck = {"vocab_size": 4096}, DEMO_MODEL
        for lay in args.layouts.split(","):
            cp, ep = (int(x) for x in lay.split("x"))
            art = compile_for(ck, work / f"art-demo-{cp}x{ep}", cache, cp, ep, backend="cpu")
            eng = Engine.from_artifact(art, prefix_caching=False)
            try:
                r = bench_engine(eng, cfg["vocab_size"])
                share = collective_share(eng, cfg["vocab_size"]) if max(cp, ep) > 1 else 0.0
            finally:
                eng.close()
            lines.append(f"| cp={cp} ep={ep} | {max(cp, ep)} | {r['decode_ms']:.2f} | "
                         f"{r['batch_tok_s']:.0f} | {100 * share:.0f}% |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
