"""GPU benchmark at DeepSeek-V2-Lite size: our cuda backend vs transformers on the same random bf16 weights.

    python benchmarks/gpu_v2lite.py --budget-s 420 --out $OUT/gpu_table.md   # on the H200 (one device call)
    python benchmarks/gpu_v2lite.py --tiny --device cpu                       # the same code path at toy size

Builds the V2-Lite-size config (configs/v2lite-size/config.json) with random bf16 weights directly on the
device (no checkpoint on disk: 31 GB would not fit the call), converts transformers' tensors to our per-rank
layout in memory with the compiler's own weight plan, exports our region graphs, compiles them at load
(torch.compile of the exported programs: the path that works with torch 2.11 + CUDA 13, where loading
AOTInductor packages segfaults), replays steps as CUDA graphs, and prints TTFT (512 and 2048-token prompts)
and TPOT (batch 1, 8, 32; last, batch 32 sampled with temperature 0.7 and top-p 0.9) for both engines, with the
bandwidth roofline beside each TPOT. After the first row it
checks what it times (`check`); `--profile DIR` writes per-kernel tables; runs so far: GPU_RESULTS.md.

Rows come in priority order (batch-1 TPOT, short TTFT, batch-32 TPOT, long TTFT, the rest) and the table is
rewritten after each one, so a device call cut short by its time limit still returns what it measured;
`--budget-s` stops starting new rows once spent (first compiles dominate: every graph compiles at first use).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from roofline import copy_bandwidth, decode_step_params, sync

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, vocab_size=4096)


def import_deepinfer() -> None:
    """The repository root is the `deepinfer` package (pyproject's package-dir): on a machine where it is not
    installed (the device call gets a copy of the working tree and no network), import it from here."""
    try:
        import deepinfer  # noqa: F401
    except ImportError:
        import importlib.util
        spec = importlib.util.spec_from_file_location("deepinfer", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["deepinfer"] = mod
        spec.loader.exec_module(mod)


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


def build(cfg_dict: dict, dev: torch.device, decode: tuple[int, ...], prefill: tuple[int, ...],
          context: tuple[int, ...], limit: int, region_marks: bool = False, shared_experts: str = "auto"):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from deepinfer.common.manifest import SCHEMA_VERSION, GraphEntry, Manifest, Toolchain
    from deepinfer.common.model_config import ModelConfig
    from deepinfer.compile.graphs import export_graph, plan_graphs
    from deepinfer.compile.options import CompileOptions, make_layout, resolve
    from deepinfer.compile.weights import shard_specs
    from deepinfer.runtime.artifact import compile_exported
    from deepinfer.runtime.engine import Engine
    from deepinfer.runtime.model_runner import ModelRunner

    m = ModelConfig.from_hf_dict(cfg_dict)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    t = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)        # built in bf16: an fp32 model first would need 63 GB more
    try:
        with torch.device(dev):
            hf = DeepseekV3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    # from_pretrained keeps the rope frequencies (a non-persistent fp32 buffer) in fp32 whatever the dtype, as ours
    # are; the .to(bfloat16) above had rounded them (a position's angle off by up to 2^-9 of itself)
    with torch.device(dev):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg)
    print(f"random bf16 model on {dev}: {sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B params "
          f"({time.perf_counter() - t:.0f}s)", flush=True)
    opts = CompileOptions(model=Path("v2lite"), out=Path("unused"), backend="cuda", dtype="bfloat16",
                          # a 128-key decode bucket for the TPOT rows (32-token prompts + 33 tokens): with the
                          # limit's bucket only, every decode step would read 2112 keys' latents a layer; a prefill
                          # bucket and a context bucket for each TTFT prompt, so each is one chunk over its own keys
                          decode_buckets=decode, prefill_buckets=prefill, context_buckets=context, context_limit=limit,
                          num_kv_blocks=(limit // 16) * max(decode), region_marks=region_marks,
                          shared_experts=shared_experts)
    cc = resolve(opts, m)
    layout = make_layout(m, cc)
    ck = StateDictCheckpoint(dict(hf.state_dict()))
    weights = {s.name: s.produce(ck).to(device=dev, dtype=s.dtype).contiguous() for s in shard_specs(m, cc, layout.ranks[0])}
    graphs, entries = {}, []
    for plan in plan_graphs(m, cc):
        graphs[plan.name] = FirstUse(plan, dev, export_graph, compile_exported)
        entries.append(GraphEntry(name=plan.name, region=plan.spec.region, kind=plan.spec.kind,
                                  tokens=plan.spec.tokens, context=plan.spec.context, file="", ir_sha256="",
                                  graph_hash="", file_sha256="", inputs=plan.inputs, weights=plan.weights,
                                  outputs=plan.outputs))
    print(f"{len(graphs)} graphs planned; each is exported and compiled at first use", flush=True)
    manifest = Manifest(schema_version=SCHEMA_VERSION, name="v2lite-random", model=m, compile=cc, layout=layout,
                        graphs=tuple(entries), weights=(), tokenizer=(),
                        toolchain=Toolchain(torch.__version__, "", "cuda", str(dev), "inductor"), memory=())
    runner = ModelRunner(manifest, graphs, weights, dev)
    if dev.type == "cuda":
        from deepinfer.runtime.cuda_graphs import StepGraphs
        runner.step_graphs = StepGraphs(runner)
    return hf, Engine(manifest, runner, None, prefix_caching=False), m


class FirstUse:
    """A graph exported and compiled at its first call: the rows use 16 of the ~23 planned graphs, and
    exporting the others up front cost 10-20 s of the call's budget."""

    def __init__(self, plan, dev: torch.device, export_graph, compile_exported):
        self.plan, self.dev, self.fn = plan, dev, None
        self._export, self._compile = export_graph, compile_exported

    def __call__(self, *args):
        if self.fn is None:
            with torch.inference_mode(False):      # export traces its own fake inputs, outside the step's mode
                ep, _ = self._export(self.plan)
            self.fn = self._compile(ep, self.dev)
        return self.fn(*args)


def sync_quietly(dev: torch.device) -> None:
    """After a failed measurement: let the device finish (a CUDA error that is sticky shows here, once)."""
    try:
        sync(dev)
    except Exception as e:
        print(f"device sync after the error: {e}", flush=True)


def random_prompts(g: torch.Generator, b: int, length: int, vocab: int) -> list[list[int]]:
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(b)]


def timed(dev: torch.device, fn) -> float:
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t


class Ours:
    """Our engine: TTFT is a one-token generate; TPOT a decode step's time once every sequence of the batch has
    its first token (a sequence gains one token a step)."""

    def __init__(self, engine, dev: torch.device, vocab: int, n: int):
        self.engine, self.dev, self.vocab, self.n = engine, dev, vocab, n
        self.g = torch.Generator().manual_seed(1)

    def _gen(self, ps, k: int) -> float:
        from deepinfer.runtime.sequence import SamplingParams
        return timed(self.dev, lambda: self.engine.generate(ps, SamplingParams(max_tokens=k, ignore_eos=True)))

    def ttft(self, length: int) -> float:
        self._gen(random_prompts(self.g, 1, length, self.vocab), 1)          # compile + warm
        return min(self._gen(random_prompts(self.g, 1, length, self.vocab), 1) for _ in range(2))

    def tpot_sampled(self, b: int) -> float:
        return self.tpot(b, SAMPLED)

    def tpot(self, b: int, sampling: dict | None = None) -> float:
        """Steady-state decode: b prompts are added at once and stepped until every sequence has its first token
        (prompt-as-decode steps carry 32 tokens; with b sequences running, later prompts share steps with earlier
        ones' decode tokens), then the n steps that give each sequence n more tokens are timed. Differencing two
        whole generates, as transformers' row does, would count those mixed prompt steps too: with 32 prompts of
        32 tokens and a 32-token step, they are most of the extra steps."""
        from deepinfer.runtime.sequence import SamplingParams
        eng = self.engine
        self._gen(random_prompts(self.g, b, 32, self.vocab), 4)             # compile, capture the CUDA graphs
        best = float("inf")
        for _ in range(2):
            seqs = [eng.add_request(p, SamplingParams(max_tokens=self.n + 1, ignore_eos=True, seed=i,
                                                      **(sampling or {})))
                    for i, p in enumerate(random_prompts(self.g, b, 32, self.vocab))]
            while eng.has_work and not all(s.output_ids for s in seqs):
                eng.step()
            sync(self.dev)
            t, steps = time.perf_counter(), 0
            while eng.has_work:
                eng.step()
                steps += 1
            sync(self.dev)
            assert all(len(s.output_ids) == self.n + 1 for s in seqs), [len(s.output_ids) for s in seqs]
            best = min(best, (time.perf_counter() - t) / steps)
        print(f"  ours, batch {b}: {steps} decode steps for {self.n} more tokens a sequence", flush=True)
        return best


class Transformers:
    """transformers on the same weights: TTFT is one forward over the prompt, TPOT from `generate`."""

    def __init__(self, hf, dev: torch.device, vocab: int, n: int):
        self.hf, self.dev, self.vocab, self.n = hf, dev, vocab, n
        try:
            hf.set_experts_implementation("grouped_mm")
            self.note = "grouped_mm experts"
        except Exception as e:
            print(f"transformers: grouped_mm experts unavailable ({e}); default experts", flush=True)
            self.note = "default experts"

    @torch.inference_mode()
    def ttft(self, length: int) -> float:
        x = torch.randint(2, self.vocab, (1, length), device=self.dev)
        # the last position's logits only, as generate's prefill (and ours) computes them
        timed(self.dev, lambda: self.hf(x, logits_to_keep=1))
        return min(timed(self.dev, lambda: self.hf(x, logits_to_keep=1)) for _ in range(2))

    def tpot_sampled(self, b: int) -> float:
        return self.tpot(b, SAMPLED)

    @torch.inference_mode()
    def tpot(self, b: int, sampling: dict | None = None) -> float:
        x = torch.randint(2, self.vocab, (b, 32), device=self.dev)
        how = dict(do_sample=True, top_k=0, **sampling) if sampling else dict(do_sample=False)

        def gen(k):
            return self.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                                    **how)
        timed(self.dev, lambda: gen(2))
        t1 = timed(self.dev, lambda: gen(1))
        tn = timed(self.dev, lambda: gen(self.n + 1))
        return (tn - t1) / self.n


SAMPLED = dict(temperature=0.7, top_p=0.9)     # the sampled TPOT row's parameters, ours and transformers' alike


def check(engine, hf, dev: torch.device, vocab: int, prompt: int, n: int = 8, k: int = 8) -> str:
    """Are the timed numbers the right computation? n prompts of 32 tokens, k greedy tokens each, and two prompts of
    `prompt` tokens (prefill chunks): every step's CUDA-graph replay against the same step launched kernel by
    kernel; our first-token logprobs against transformers in fp32; our tokens against transformers' greedy
    `generate` on the same weights (bf16 both: near-ties may differ, so the common prefix is reported, not
    asserted)."""
    from deepinfer.runtime.sequence import SamplingParams
    g = torch.Generator().manual_seed(5)
    ps = random_prompts(g, n, 32, vocab)
    sg = engine.runner.step_graphs
    if sg is not None:
        sg.check, sg.checks = True, {}
    try:
        ours = [s.output_ids for s in engine.generate(ps, SamplingParams(max_tokens=k, ignore_eos=True))]
        for _ in range(2):          # the second replays the captured prefill bucket with other inputs
            engine.generate(random_prompts(g, 1, prompt, vocab), SamplingParams(max_tokens=2, ignore_eos=True))
    finally:
        if sg is not None:
            sg.check = False
    parts = []
    if sg is None:
        parts.append("no CUDA graphs on this device")
    else:
        parts += [f"CUDA-graph replay vs launches one by one, {kind} T={t} C={c} ({r} logit rows): max |dlogit| "
                  f"{w:.3g}, argmax agrees {a:.0%} ({cnt} steps)"
                  for (kind, t, c, r), (w, a, cnt) in sorted(sg.checks.items())]
        parts += [f"capture failed for {kind} T={t} C={c} ({r} logit rows; ran without a graph): {why[:160]}"
                  for (kind, t, c, r), why in sorted(sg.failed.items())]
    if hf is None:
        return "check: " + "; ".join(parts)
    against = []     # each comparison on its own: one failing (memory, a transformers API) keeps the others' lines
    try:
        against.append(first_logprobs(engine, hf, dev, random_prompts(g, 32, 32, vocab)))
    except Exception as e:
        against.append(f"first-token logprobs against transformers failed: {type(e).__name__}: {str(e)[:200]}")
    try:
        with torch.inference_mode():
            x = torch.tensor(ps, device=dev)
            theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                                 do_sample=False)[:, 32:].tolist()

        def common(a, b) -> int:
            return next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
        prefixes = [common(a, b) for a, b in zip(ours, theirs)]
        against.append(f"first tokens equal transformers' for {sum(p > 0 for p in prefixes)}/{n} prompts, common "
                       f"greedy prefix {sum(prefixes) / n:.1f}/{k} tokens")
    except Exception as e:
        against.append(f"greedy tokens against transformers failed: {type(e).__name__}: {str(e)[:200]}")
    return "check: " + "; ".join(against + parts)


def first_logprobs(engine, hf, dev: torch.device, ps: list[list[int]], top: int = 50) -> str:
    """Two bf16 engines part wherever a rounding flips a routing choice or a near-tie (random weights make flat
    router scores and logits), so the judge is transformers in fp32 on the same weights: our top-`top` first-token
    logprobs and transformers' bf16 ones, each against fp32's at the same token ids (per prompt, the largest
    |difference|: the median prompt's, the worst, and how many prompts are off by more than 0.05, mostly a flipped
    choice), and whose argmax is fp32's. 32 prompts: at 8 the two bf16 engines' flips are too few to compare (on
    the CPU at --tiny size, 256 prompts: ours 13 off by more than 0.05, transformers' bf16 12)."""
    from deepinfer.runtime.sequence import SamplingParams
    seqs = engine.generate(ps, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=top))
    x = torch.tensor(ps, device=dev)
    with torch.inference_mode():
        bf = torch.log_softmax(hf(x, logits_to_keep=1).logits[:, -1].float(), dim=-1).cpu()     # [n, V]
        f32 = torch.log_softmax(fp32_logits(hf, x), dim=-1).cpu()
    ours_d, theirs_d, ours_top, theirs_top = [], [], 0, 0
    for s, b, f in zip(seqs, bf, f32):
        lp = s.output_logprobs[0]
        ids, vals = torch.tensor(list(lp)), torch.tensor(list(lp.values()))
        ours_d.append(float((vals - f[ids]).abs().max()))
        theirs_d.append(float((b[ids] - f[ids]).abs().max()))
        ours_top += max(lp, key=lp.get) == int(f.argmax())
        theirs_top += int(b.argmax()) == int(f.argmax())

    def med(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]
    n = len(ps)
    return (f"first-token logprobs against transformers in fp32 ({n} prompts, our top {top} token ids): ours (bf16) "
            f"|d| median {med(ours_d):.3f}, worst {max(ours_d):.3f}, over 0.05 {sum(d > 0.05 for d in ours_d)}/{n}, "
            f"argmax is fp32's {ours_top}/{n}; transformers bf16 |d| median {med(theirs_d):.3f}, worst "
            f"{max(theirs_d):.3f}, over 0.05 {sum(d > 0.05 for d in theirs_d)}/{n}, argmax {theirs_top}/{n}")


def fp32_logits(hf, x: torch.Tensor) -> torch.Tensor:
    """transformers' last-position logits in fp32 on its bf16 weights: the embedding, final norm and head in fp32
    for the pass and each decoder layer in fp32 only while it runs (hooks), so the pass needs one layer's fp32 copy
    beside the bf16 weights, not the whole model's (63 GB more at V2-Lite size: past an H100's 80 GB with both
    engines' weights there); its eager experts (the grouped_mm path is meant for bf16). Each module gets its own
    bf16 tensors back afterwards (the same storage: ours, some shared with them, are untouched, and no copy stays)."""
    saved: dict[torch.nn.Module, list[tuple[dict, str, torch.Tensor]]] = {}

    def widen(mod: torch.nn.Module, *_) -> None:
        kept = saved.setdefault(mod, [])
        for sub in mod.modules():
            for store in (sub._parameters, sub._buffers):
                for name, t in store.items():
                    if t is not None and t.dtype == torch.bfloat16:
                        kept.append((store, name, t))
                        store[name] = (torch.nn.Parameter(t.float(), requires_grad=False)
                                       if isinstance(t, torch.nn.Parameter) else t.float())

    def restore(mod: torch.nn.Module, *_) -> None:
        for store, name, t in saved.pop(mod, []):
            store[name] = t
    # transformers' grouped_mm experts (what its timed rows run) are bf16 kernels: the fp32 pass takes the eager
    # ones, then gets back what it had (the getter is newer than some 5.x releases: then grouped_mm, which
    # Transformers() sets)
    experts = hf.get_experts_implementation() if hasattr(hf, "get_experts_implementation") else "grouped_mm"
    switched = False
    outer = (hf.model.embed_tokens, hf.model.norm, hf.lm_head)
    hooks = []
    try:
        for mod in outer:
            widen(mod)
        for layer in hf.model.layers:       # the hooks return None: the layer's inputs and outputs pass unchanged
            hooks += [layer.register_forward_pre_hook(widen), layer.register_forward_hook(restore)]
        try:
            hf.set_experts_implementation("eager")
            switched = True
        except Exception:       # no such switch: its default experts, whatever it runs them with
            pass
        return hf(x, logits_to_keep=1).logits[:, -1].float()
    finally:
        for h in hooks:
            h.remove()
        for mod in list(saved):             # the outer modules, and a layer an error left widened
            restore(mod)
        if switched:
            hf.set_experts_implementation(experts)


def overlap_ab(ours: "Ours", b: int) -> str:
    """Batch-b TPOT with overlapped scheduling (the engine's default on CUDA: the next decode step launched
    before this one's tokens reach the host) and without, in turn on the same engine."""
    eng = ours.engine
    if not eng.overlap:
        return "overlapped scheduling: off (DEEPINFER_OVERLAP=0)"
    chained = eng.num_chained
    on = ours.tpot(b)
    chained = eng.num_chained - chained
    eng.overlap = False
    try:
        off = ours.tpot(b)
    finally:
        eng.overlap = True
    return (f"overlapped scheduling, batch-{b} TPOT: {on * 1e3:.2f} ms with it ({chained} steps chained), "
            f"{off * 1e3:.2f} ms without: {off / on:.2f}x")


def kernel_profiles(engine, dev: torch.device, vocab: int, prompt: int, out: Path | None) -> str:
    """torch.profiler's per-kernel device times for a batch-1 and a batch-32 decode step (replayed as CUDA graphs:
    what the TPOT rows run) and one prompt's prefill chunk, written to `out` (one file each); returns a summary."""
    from torch.profiler import ProfilerActivity, profile
    from deepinfer.runtime.sequence import SamplingParams
    g = torch.Generator().manual_seed(13)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    summary = []
    for label, b, length, k in (("decode_b1", 1, 1, 4), ("decode_b32", 32, 1, 4), (f"prefill_{prompt}", 1, prompt, 1)):
        engine.generate(random_prompts(g, b, length, vocab), SamplingParams(max_tokens=k, ignore_eos=True))   # warm
        sync(dev)
        with profile(activities=acts) as prof:
            engine.generate(random_prompts(g, b, length, vocab), SamplingParams(max_tokens=k, ignore_eos=True))
            sync(dev)
        ka = prof.key_averages()
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        table = ka.table(sort_by=key, row_limit=60, max_name_column_width=90)
        total = sum(getattr(e, key) for e in ka) / 1e3
        summary.append(f"{label}: {total:.1f} ms of {'device' if dev.type == 'cuda' else 'cpu'} time over "
                       f"{k} steps")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"profile_{label}.txt").write_text(table)
    return "kernel profiles: " + "; ".join(summary)


def region_tables(engine, dev: torch.device, vocab: int, prompt: int) -> str:
    """Where a step's time goes (the runtime's DEEPINFER_REGION_TIMING table, synchronised around every graph):
    batch-1 decode steps launched graph by graph (the CUDA-graph replay is off for these, so the table shows the
    regions and the host's share that the replay hides), then one prompt of `prompt` tokens."""
    from deepinfer.runtime.model_runner import RegionTimer
    from deepinfer.runtime.sequence import SamplingParams
    r = engine.runner
    saved, r.step_graphs = r.step_graphs, None
    overlap, engine.overlap = engine.overlap, False      # the timing synchronises: steps in turn, host rows kept
    g = torch.Generator().manual_seed(9)
    tables = []
    try:
        for length, k in ((1, 9), (prompt, 1)):       # 1-token prompts: every step is a one-token decode step
            r.timer = RegionTimer(dev)
            engine.generate(random_prompts(g, 1, length, vocab), SamplingParams(max_tokens=k, ignore_eos=True))
            tables.append(r.timer.table())
    finally:
        r.timer, r.step_graphs, engine.overlap = None, saved, overlap
    return (f"region timing (batch 1: decode steps without the CUDA graph, then one {prompt}-token prompt):\n"
            + "\n".join(tables))


def skinny_table(measured: dict, chosen: dict) -> str:
    """What the load-time choice measured for each decode-sized linear (runtime/cuda_kernels.py `linear_for`):
    a call's device time per candidate (nan: a wrong result, inf: failed to build or run) and the chosen one's
    weight-read rate."""
    rows = ["decode-sized linears, device time a call in us (the chosen one *, its weight read in TB/s):"]
    for key in sorted(measured, key=lambda k: (k[1], k[2], k[3])):
        _, rows_, n, k, dtype = key[:5]
        best = chosen[key]
        rate = n * k * dtype.itemsize / (measured[key][best] * 1e-6) / 1e12
        rows.append(f"  {rows_:>2} rows  {n:>6} x {k:<5}  " + "  ".join(
            f"{name}{'*' if name == best else ''} {t:.1f}" for name, t in measured[key].items()) + f"  ({rate:.2f} TB/s)")
    return "```\n" + "\n".join(rows) + "\n```"


def roofline(m, dev, batches) -> tuple[float, dict]:
    """Bytes a decode step must read (active weights, with the distinct experts a batch touches) over the
    measured device copy bandwidth."""
    bw = copy_bandwidth(dev)
    return bw, {bsz: 2 * decode_step_params(m, bsz) / bw for bsz in batches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/v2lite-size/config.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="shrink the config (a CPU check of the code path)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (a full-width CPU check)")
    ap.add_argument("--check-only", action="store_true", help="build, run the correctness check, print it, stop")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per TPOT")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="stop starting new measurements after this many seconds (0: no limit); the rows not "
                         "measured are listed as skipped")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the table, write torch.profiler's per-kernel tables (decode batch 1 and 32, a prompt) "
                         "to DIR")
    ap.add_argument("--out", default=None, help="write the table (markdown) here, rewritten after every row")
    ap.add_argument("--region-marks", action="store_true",
                    help="a profiling build (compile --region-marks): the region timing splits each layer into "
                         "attention, MoE or MLP; the table's rows then carry the marks' copies (a small kernel each)")
    ap.add_argument("--shared-experts", default="auto", choices=("auto", "grouped", "separate"),
                    help="compile --shared-experts: auto groups V2-Lite's two shared experts with the routed ones; "
                         "separate keeps their MLP (an A/B in a second run)")
    args = ap.parse_args()
    faulthandler.enable()            # a crash in native code still prints where it was
    import_deepinfer()
    t0 = time.monotonic()

    notes: list[str] = []          # printed under the table

    def write(lines: list[str]) -> None:
        if args.out:
            Path(args.out).write_text("\n".join(lines + ([""] + notes if notes else [])) + "\n")

    dev = torch.device(args.device)
    cfg = json.loads(Path(args.config).read_text())
    ttft_lens, batches = (512, 2048), (1, 8, 32)
    if args.tiny:
        cfg |= TINY
        ttft_lens, batches = (64, 256), (1, 4)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    try:
        hf, engine, m = build(cfg, dev, decode=tuple(batches), prefill=ttft_lens,
                              context=tuple(sorted({128, *ttft_lens[:-1]})), limit=max(ttft_lens) + 64,
                              region_marks=args.region_marks, shared_experts=args.shared_experts)
        bw, roof = roofline(m, dev, batches)
    except BaseException as e:
        write([f"build failed after {time.monotonic() - t0:.0f} s: {type(e).__name__}: {e}"])
        raise
    if args.check_only:
        print(check(engine, hf, dev, m.vocab_size, ttft_lens[0]), flush=True)
        return
    ours = Ours(engine, dev, m.vocab_size, args.tokens)
    ref = None if args.skip_hf else Transformers(hf, dev, m.vocab_size, args.tokens)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    lines = [f"{name}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s, {m.num_hidden_layers} layers, "
             f"{m.n_routed_experts} experts top-{m.num_experts_per_tok}, "
             f"{'shared experts as groups' if engine.manifest.compile.shared_experts_grouped else 'shared MLP apart'}, "
             "bf16 random weights"
             + (f", transformers with {ref.note}" if ref else ""), "",
             "| metric | deepinfer (cuda) | transformers | speedup | roofline |", "| --- | ---: | ---: | ---: | ---: |"]

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        write(lines)

    def measure(engine_rows, what: str, x: int) -> float | str:
        """One engine's figure, or the error's first line (the other engine and the later rows still run)."""
        try:
            return getattr(engine_rows, what)(x)
        except Exception as e:
            traceback.print_exc()
            sync_quietly(dev)
            return f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"

    print("\n".join(lines), flush=True)
    write(lines)
    # The headline numbers first, so that a call cut short by its time limit still has them.
    plan = [("tpot", batches[0]), ("ttft", ttft_lens[0]), ("tpot", batches[-1]), ("ttft", ttft_lens[-1])]
    plan += [("tpot", b) for b in batches[1:-1]] + [("tpot_sampled", batches[-1])]
    for what, x in plan:
        label = {"tpot": f"TPOT batch {x}", "ttft": f"TTFT {x} tokens",
                 "tpot_sampled": f"TPOT batch {x}, temperature 0.7 top-p 0.9"}[what]
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            emit(f"| {label} | skipped (budget {args.budget_s:.0f} s spent) | | | |")
            continue
        t = time.monotonic()
        mine = measure(ours, what, x)
        theirs = measure(ref, what, x) if ref else None
        roof_s = f"{roof[x] * 1e3:.2f} ms" if what != "ttft" else ""
        digits = 2 if what != "ttft" else 1

        def fmt(v) -> str:
            return "-" if v is None else v if isinstance(v, str) else f"{v * 1e3:.{digits}f} ms"
        both = isinstance(mine, float) and isinstance(theirs, float)
        emit(f"| {label} | {fmt(mine)} | {fmt(theirs)} | {f'{theirs / mine:.2f}x' if both else '-'} | {roof_s} |")
        print(f"  ({label}: {time.monotonic() - t:.0f} s, compiles included; {time.monotonic() - t0:.0f} s so far)",
              flush=True)
        if (what, x) == plan[0] and not (args.budget_s and time.monotonic() - t0 > args.budget_s):
            try:        # right after the first row: its graphs are compiled and captured
                notes.append(check(engine, None if args.skip_hf else hf, dev, m.vocab_size, ttft_lens[0]))
            except Exception as e:
                traceback.print_exc()
                notes.append(f"check failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
            print(notes[-1], flush=True)
            write(lines)
            try:
                notes.append(overlap_ab(ours, x))
            except Exception as e:
                traceback.print_exc()
                notes.append(f"overlap A/B failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
            print(notes[-1], flush=True)
            write(lines)
    if not (args.budget_s and time.monotonic() - t0 > args.budget_s):
        try:
            notes.append("```\n" + region_tables(engine, dev, m.vocab_size, ttft_lens[0]) + "\n```")
        except Exception as e:
            traceback.print_exc()
            notes.append(f"region timing failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        print(notes[-1], flush=True)
        write(lines)
    if args.profile and not (args.budget_s and time.monotonic() - t0 > args.budget_s):
        try:
            notes.append(kernel_profiles(engine, dev, m.vocab_size, ttft_lens[0], Path(args.profile)))
        except Exception as e:
            traceback.print_exc()
            notes.append(f"kernel profiles failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        print(notes[-1], flush=True)
        write(lines)
    from torch._dynamo.utils import counters
    notes.append(f"torch.compile: {counters['stats'].get('unique_graphs', 0)} graphs compiled, "
                 f"{sum(counters['recompiles'].values())} recompiles; {time.monotonic() - t0:.0f} s in all")
    print(notes[-1], flush=True)
    write(lines)
    from deepinfer.runtime import cuda_kernels
    if cuda_kernels.MEASURED:
        notes.append(skinny_table(cuda_kernels.MEASURED, cuda_kernels.CHOSEN))
        print(notes[-1], flush=True)
        write(lines)
    from deepinfer.runtime import ops
    if ops._NATIVE_FAILED:
        notes.append(f"note: torch._grouped_mm did not run for {sorted(f'{d} {t}' for d, t in ops._NATIVE_FAILED)}: "
                     f"our MoE experts took the masked loop (a full GEMM per expert), so these are not the grouped "
                     f"path's numbers")
        print(notes[-1], flush=True)
        write(lines)


if __name__ == "__main__":
    main()
