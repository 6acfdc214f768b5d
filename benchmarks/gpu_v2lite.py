"""GPU benchmark at DeepSeek-V2-Lite size: our cuda backend vs transformers on the same random bf16 weights.

    python benchmarks/gpu_v2lite.py --out $OUT/gpu_table.md            # on the H200 (one device call)
    python benchmarks/gpu_v2lite.py --tiny --device cpu                 # the same code path at toy size

Builds the V2-Lite-size config (configs/v2lite-size/config.json) with random bf16 weights directly on the
device (no checkpoint on disk: 31 GB would not fit the call), converts transformers' tensors to our per-rank
layout in memory with the compiler's own weight plan, exports our region graphs, compiles them at load
(torch.compile of the exported programs: the path that works with torch 2.11 + CUDA 13, where loading
AOTInductor packages segfaults), replays decode steps as CUDA graphs, and prints TTFT (512 and 2048-token
prompts) and TPOT (batch 1, 8, 32) for both engines, with the bandwidth roofline beside each TPOT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, vocab_size=4096)


class StateDictCheckpoint:
    """The compiler's checkpoint interface (has/get) over an in-memory transformers state dict."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd = sd

    def has(self, name: str) -> bool:
        return name in self.sd

    def get(self, name: str, shape=None) -> torch.Tensor:
        t = self.sd[name]
        assert shape is None or tuple(t.shape) == tuple(shape), (name, t.shape, shape)
        return t


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(cfg_dict: dict, dev: torch.device, decode: tuple[int, ...], prefill: tuple[int, ...], limit: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from deepinfer.common.manifest import SCHEMA_VERSION, GraphEntry, Manifest, Toolchain
    from deepinfer.common.model_config import ModelConfig
    from deepinfer.compile.graphs import export_graph, plan_graphs
    from deepinfer.compile.options import CompileOptions, make_layout, resolve
    from deepinfer.compile.weights import shard_specs
    from deepinfer.runtime.engine import Engine
    from deepinfer.runtime.model_runner import ModelRunner

    m = ModelConfig.from_hf_dict(cfg_dict)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):
        hf = DeepseekV3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    print(f"random bf16 model on {dev}: {sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B params "
          f"({time.perf_counter() - t:.0f}s)", flush=True)
    opts = CompileOptions(model=Path("v2lite"), out=Path("unused"), backend="cuda", dtype="bfloat16",
                          decode_buckets=decode, prefill_buckets=prefill, context_buckets=(), context_limit=limit,
                          num_kv_blocks=(limit // 16) * max(decode))
    cc = resolve(opts, m)
    layout = make_layout(m, cc)
    ck = StateDictCheckpoint(dict(hf.state_dict()))
    weights = {s.name: s.produce(ck).to(device=dev, dtype=s.dtype).contiguous() for s in shard_specs(m, cc, layout.ranks[0])}
    t = time.perf_counter()
    graphs, entries = {}, []
    for plan in plan_graphs(m, cc):
        ep, _ = export_graph(plan)
        graphs[plan.name] = torch.compile(ep.module(), fullgraph=True, dynamic=False)
        entries.append(GraphEntry(name=plan.name, region=plan.spec.region, kind=plan.spec.kind,
                                  tokens=plan.spec.tokens, context=plan.spec.context, file="", ir_sha256="",
                                  graph_hash="", file_sha256="", inputs=plan.inputs, weights=plan.weights,
                                  outputs=plan.outputs))
    print(f"exported {len(graphs)} graphs ({time.perf_counter() - t:.0f}s); compiling at first use", flush=True)
    manifest = Manifest(schema_version=SCHEMA_VERSION, name="v2lite-random", model=m, compile=cc, layout=layout,
                        graphs=tuple(entries), weights=(), tokenizer=(),
                        toolchain=Toolchain(torch.__version__, "", "cuda", str(dev), "inductor"), memory=())
    runner = ModelRunner(manifest, graphs, weights, dev)
    if dev.type == "cuda":
        from deepinfer.runtime.cuda_graphs import StepGraphs
        runner.step_graphs = StepGraphs(runner)
    return hf, Engine(manifest, runner, None), m


def bench_ours(engine, dev, vocab: int, ttft_lens, batches, n: int) -> dict:
    from deepinfer.runtime.sequence import SamplingParams
    g = torch.Generator().manual_seed(1)

    def prompts(b, length):
        return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(b)]

    def timed(ps, k):
        sync(dev)
        t = time.perf_counter()
        engine.generate(ps, SamplingParams(max_tokens=k, ignore_eos=True))
        sync(dev)
        return time.perf_counter() - t

    out = {}
    for length in ttft_lens:
        timed(prompts(1, length), 1)                     # compile + warm
        out[f"ttft_{length}"] = min(timed(prompts(1, length), 1) for _ in range(2))
    for b in batches:
        timed(prompts(b, 32), 4)                         # compile, capture the CUDA graphs
        t1 = min(timed(prompts(b, 32), 1) for _ in range(2))
        tn = min(timed(prompts(b, 32), n + 1) for _ in range(2))
        out[f"tpot_{b}"] = (tn - t1) / n
    return out


@torch.inference_mode()
def bench_hf(hf, dev, vocab: int, ttft_lens, batches, n: int) -> dict:
    try:
        hf.set_experts_implementation("grouped_mm")
    except Exception as e:
        print(f"transformers: grouped_mm experts unavailable ({e}); default experts", flush=True)
    out = {}

    def timed(fn):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - t

    for length in ttft_lens:
        x = torch.randint(2, vocab, (1, length), device=dev)
        timed(lambda: hf(x))
        out[f"ttft_{length}"] = min(timed(lambda: hf(x)) for _ in range(2))
    for b in batches:
        x = torch.randint(2, vocab, (b, 32), device=dev)

        def gen(k):
            return hf.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        timed(lambda: gen(2))
        t1 = timed(lambda: gen(1))
        tn = timed(lambda: gen(n + 1))
        out[f"tpot_{b}"] = (tn - t1) / n
    return out


def roofline(m, dev, batches) -> tuple[float, dict]:
    """Bytes a decode step must read (active weights, with the distinct experts a batch touches) over the
    measured device copy bandwidth."""
    n = 1 << 28
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(dev)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(dev)
    bw = 2 * n * 5 / (time.perf_counter() - t)
    pc = m.param_counts()
    expert = 3 * m.hidden_size * m.moe_intermediate_size
    fixed = pc["active_per_token"] - m.num_moe_layers * m.num_experts_per_tok * expert - m.vocab_size * m.hidden_size
    fixed += m.vocab_size * m.hidden_size if not m.tie_word_embeddings else 0      # the LM head is read
    out = {}
    for bsz in batches:
        E, K = m.n_routed_experts, m.num_experts_per_tok
        touched = E * (1 - (1 - K / E) ** bsz)
        out[bsz] = 2 * (fixed + m.num_moe_layers * touched * expert) / bw
    return bw, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/v2lite-size/config.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="shrink the config (a CPU check of the code path)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per TPOT")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    dev = torch.device(args.device)
    cfg = json.loads(Path(args.config).read_text())
    ttft_lens, batches = (512, 2048), (1, 8, 32)
    if args.tiny:
        cfg |= TINY
        ttft_lens, batches = (64, 256), (1, 4)
    hf, engine, m = build(cfg, dev, decode=tuple(batches), prefill=(min(512, ttft_lens[-1]),),
                          limit=max(ttft_lens) + 64 if not args.tiny else 512)
    ours = bench_ours(engine, dev, m.vocab_size, ttft_lens, batches, args.tokens)
    ref = {} if args.skip_hf else bench_hf(hf, dev, m.vocab_size, ttft_lens, batches, args.tokens)
    bw, roof = roofline(m, dev, batches)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    lines = [f"{name}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s, {m.num_hidden_layers} layers, "
             f"{m.n_routed_experts} experts top-{m.num_experts_per_tok}, bf16 random weights", "",
             "| metric | deepinfer (cuda) | transformers | speedup | roofline |", "| --- | ---: | ---: | ---: | ---: |"]
    for length in ttft_lens:
        k = f"ttft_{length}"
        r = ref.get(k)
        lines.append(f"| TTFT {length} tokens | {ours[k] * 1e3:.1f} ms | {r * 1e3:.1f} ms | {r / ours[k]:.2f}x | |"
                     if r else f"| TTFT {length} tokens | {ours[k] * 1e3:.1f} ms | - | - | |")
    for b in batches:
        k = f"tpot_{b}"
        r = ref.get(k)
        thr = f"{r / ours[k]:.2f}x" if r else "-"
        lines.append(f"| TPOT batch {b} | {ours[k] * 1e3:.2f} ms | {r * 1e3:.2f} ms | {thr} | {roof[b] * 1e3:.2f} ms |"
                     if r else f"| TPOT batch {b} | {ours[k] * 1e3:.2f} ms | - | - | {roof[b] * 1e3:.2f} ms |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
