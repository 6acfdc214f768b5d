"""N-gram speculative decoding, side by side: our engine without and with drafts, transformers' greedy `generate`
and transformers' own prompt lookup decoding (`prompt_lookup_num_tokens`), on the same checkpoint, this CPU.

    python benchmarks/speculative.py [--configs demo,mid] [--k 3] [--tokens 64] [--out FILE.md]

The trained demo model (its held-out prompts) and `mid` (benchmarks/cpu_vs_transformers.py's random-weight
model, hidden 1024, 16 experts: random 16-token prompts), compiled with decode buckets 1, 4 and 16, greedy. Two workloads:
`natural` continues the prompts as they are; `copy` gives each prompt its own continuation and the prompt again
(the model's next tokens repeat what the context holds: the case drafts are for: editing, summarising, code,
multi-turn chats quoting earlier turns). Figures: decode ms/token at batch 1 (the generation's wall time after
its first token over the tokens after it), decode tokens/s of all prompts at once, the share of draft tokens
accepted, tokens per decode step, and whether every output equals the plain engine's (it must: verification
keeps greedy outputs exactly). Each figure is the best of 3 rounds in which the engines take turns. Ratios are
against our plain engine in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

ROUNDS = 3


def compile_for(ck: Path, out: Path, cache: Path) -> Path:
    from deepinfer.compile.driver import compile_artifact
    from deepinfer.compile.options import CompileOptions
    compile_artifact(CompileOptions(model=ck, out=out, backend="cpu", decode_buckets=(1, 4, 16),
                                    prefill_buckets=(128,), context_buckets=(128, 256), context_limit=256,
                                    cache_dir=cache), log=lambda s: None)
    return out


def timed_generate(engine, prompts: list[list[int]], n: int):
    """Greedy generation of all prompts together; returns (outputs, decode seconds after the first tokens, decode
    steps, draft tokens, accepted)."""
    from deepinfer.runtime.sequence import SamplingParams
    d0, a0 = engine.num_draft_tokens, engine.num_accepted_tokens
    seqs = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    first = None
    steps = 0
    while engine.has_work:
        engine.step()
        if first is None and all(s.output_ids for s in seqs):
            first = time.perf_counter()
        elif first is not None:
            steps += 1
    dt = time.perf_counter() - first
    return ([s.output_ids for s in seqs], dt, steps, engine.num_draft_tokens - d0, engine.num_accepted_tokens - a0)


def hf_decode_seconds(hf, prompt: list[int], n: int, lookup: int | None) -> tuple[list[int], float]:
    """transformers' greedy generate at batch 1: seconds for n tokens minus seconds for 1 (its prefill)."""
    x = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode():
        t = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        tn = time.perf_counter() - t
    return out[0, len(prompt):].tolist(), tn - t1


def run_config(config: str, a, work: Path) -> tuple[list[list], str]:
    from deepinfer.compile.options import DEMO_MODEL
    from deepinfer.runtime.engine import Engine
    if config == "demo":
        ck = DEMO_MODEL
    else:
        from checkpoints import make_checkpoint
        from cpu_vs_transformers import CONFIGS
        ck = work / f"ck-{config}"
        if not (ck / "config.json").exists():
            make_checkpoint(ck, seed=0, dtype=torch.float32, **CONFIGS[config])
    art = compile_for(ck, work / f"art-{config}", work / "cache")
    plain = Engine.from_artifact(art, prefix_caching=False)
    spec = Engine.from_artifact(art, prefix_caching=False, num_speculative_tokens=a.k)
    if config == "demo":
        texts = json.loads((DEMO_MODEL / "heldout_prompts.json").read_text())[:a.prompts]
        natural = [plain.tokenizer.encode(t) for t in texts]
    else:
        g = torch.Generator().manual_seed(0)
        natural = [torch.randint(2, plain.manifest.model.vocab_size, (16,), generator=g).tolist()
                   for _ in range(a.prompts)]
    # copy: prompt + its own greedy continuation + the prompt again (without BOS): what follows is a repeat
    cont, *_ = timed_generate(plain, natural, a.tokens)
    copy = [p + c + p[1:] for p, c in zip(natural, cont)]
    hf = None
    if a.hf:
        from checkpoints import hf_model
        hf = hf_model(ck, torch.float32)
        try:
            hf.set_experts_implementation("grouped_mm")
        except Exception:
            pass
    for eng in (plain, spec):
        timed_generate(eng, natural[:2], 8)                # warm: every bucket once, and drafts' step costs
    rows = []
    for name, prompts in (("natural", natural), ("copy", copy)):
        best: dict[str, float] = {}
        stats: dict[str, list] = {}
        outs: dict[str, list] = {}
        for _ in range(ROUNDS):
            for eng_name, eng in (("plain", plain), ("spec", spec)):
                t1 = 0.0
                o1, d1, s1, dr1, ac1 = [], 0.0, 0, 0, 0
                for p in prompts:           # batch 1: one prompt at a time
                    o, dt, st, dr, ac = timed_generate(eng, [p], a.tokens)
                    o1 += o
                    t1 += dt
                    s1 += st
                    dr1 += dr
                    ac1 += ac
                ob, tb, sb, drb, acb = timed_generate(eng, prompts, a.tokens)
                best[f"{eng_name}1"] = min(best.get(f"{eng_name}1", 1e9), t1)
                best[f"{eng_name}b"] = min(best.get(f"{eng_name}b", 1e9), tb)
                stats[eng_name] = [s1, dr1, ac1, sb, drb, acb]
                outs[eng_name] = [o1, ob]
            if hf is not None:
                for hname, lookup in (("hf", None), ("hf_lookup", a.k)):
                    t = 0.0
                    for p in prompts:
                        _, dt = hf_decode_seconds(hf, p, a.tokens, lookup)
                        t += dt
                    best[hname] = min(best.get(hname, 1e9), t)
        n1 = len(prompts) * (a.tokens - 1)
        same = outs["spec"] == outs["plain"]
        for eng_name, label in (("plain", "deepinfer compiled (cpu)"), ("spec", f"deepinfer + n-gram drafts (k={a.k})")):
            s1, dr1, ac1, sb, drb, acb = stats[eng_name]
            rows.append([config, name, label, 1e3 * best[f"{eng_name}1"] / n1, best["plain1"] / best[f"{eng_name}1"],
                         n1 / best[f"{eng_name}b"], best["plainb"] / best[f"{eng_name}b"],
                         f"{100 * ac1 / dr1:.0f}%" if dr1 else "-", n1 / max(s1, 1),
                         "yes" if eng_name == "plain" or same else "NO"])
        if hf is not None:
            for hname, label in (("hf", "transformers generate"), ("hf_lookup", f"transformers prompt lookup "
                                                                                f"(k={a.k})")):
                rows.append([config, name, label, 1e3 * best[hname] / n1, best["plain1"] / best[hname], None, None, "-",
                             None, "-"])
    costs = ", ".join(f"{t}x{c}: {1e3 * v:.2f}" for (t, c), v in sorted(spec.scheduler._step_cost.items()))
    plain.close()
    spec.close()
    return rows, f"{config}: decode step ms by (tokens x context) bucket, as the drafting engine measured them: {costs}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="demo,mid")
    ap.add_argument("--k", type=int, default=3, help="draft tokens a step (--num-speculative-tokens)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts used (batch size of the batch figure)")
    ap.add_argument("--no-transformers", dest="hf", action="store_false")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="deepinfer-spec-"))
    rows, notes = [], []
    for config in a.configs.split(","):
        r, note = run_config(config, a, work)
        rows += r
        notes.append(note)
    head = ["config", "workload", "engine", "decode ms/tok (b=1)", "x plain", f"decode tok/s (b={a.prompts})", "x plain",
            "accepted", "tok/step (b=1)", "= plain"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + " |"]
    for r in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else "" if v is None else str(v) for v in r]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines + [""] + notes)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
