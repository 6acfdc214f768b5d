"""Our sampler against transformers' sampling step on the same logits, this device.

    python benchmarks/sampling.py [--device cpu|cuda] [--vocab 4096,16384,102400] [--batch 1,16,32]

One table: milliseconds a decode step spends choosing its tokens, for a batch of rows of logits and each common
parameter set (temperature alone, top-p, top-k, both), ours (runtime/sampler.py: `sample`, every row with its
own seeded generator) beside transformers' (its generate's sampling step: TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, softmax and one torch.multinomial for the batch, which has one set of parameters and one RNG).
Two kinds of rows: "peaked" (a Zipf-like distribution, as a trained model's: a top-p nucleus of a few hundred
tokens) and "flat" (random logits, as a random-weight model's: the nucleus spans most of the vocabulary, where
our top-p sorts the whole row). Best of several runs each.
"""

from __future__ import annotations

import argparse
import time

import torch

PARAMS = [dict(temperature=0.7), dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=50),
          dict(temperature=0.7, top_k=50, top_p=0.9)]


def rows(kind: str, n: int, vocab: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "flat":
        x = torch.randn(n, vocab, generator=g) * 3
    else:
        ranks = torch.arange(1, vocab + 1).float()
        x = torch.stack([(-2.0 * ranks.log() + 0.5 * torch.randn(vocab, generator=g))[torch.randperm(vocab, generator=g)]
                         for _ in range(n)])
    return x.to(device)


def best_ms(fn, device: str, repeat: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def ours(logits: torch.Tensor, p: dict):
    from deepinfer.runtime.sampler import sample
    from deepinfer.runtime.sequence import SamplingParams, Sequence
    seqs = [Sequence([1], SamplingParams(max_tokens=2, seed=i, **p)) for i in range(logits.shape[0])]
    return lambda: sample(logits, seqs)


def transformers_step(logits: torch.Tensor, p: dict):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(p["temperature"])])
    if p.get("top_k"):
        warpers.append(TopKLogitsWarper(p["top_k"]))
    if p.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(p["top_p"]))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)

    def step():
        scores = warpers(ids, logits.clone())
        return torch.multinomial(scores.softmax(-1), 1)[:, 0].tolist()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", default="4096,16384,102400")
    ap.add_argument("--batch", default="1,16,32")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    print("| vocab | rows | logits | parameters | deepinfer ms | transformers ms | x |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: |")
    for vocab in map(int, args.vocab.split(",")):
        for n in map(int, args.batch.split(",")):
            for kind in ("peaked", "flat"):
                logits = rows(kind, n, vocab, args.device)
                for p in PARAMS:
                    a = best_ms(ours(logits, p), args.device)
                    b = best_ms(transformers_step(logits, p), args.device)
                    name = ", ".join(f"{k}={v}" for k, v in p.items())
                    print(f"| {vocab} | {n} | {kind} | {name} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
