"""The MoE experts' grouped GEMM at decode row counts on the GPU: the Triton kernel (runtime/cuda_kernels.py) over
a few tile configurations against torch._grouped_mm, on V2-Lite-size experts (64 experts, hidden 2048,
intermediate 1408, top-6), bf16. Prints one table: microseconds a call, the bandwidth over the weights of the
groups that have rows, and the largest difference from torch._grouped_mm.

    python benchmarks/gpu_moe_kernel.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_v2lite import import_deepinfer  # noqa: E402


def routed_rows(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """offs for `tokens` tokens each routed to top_k distinct random experts (rows sorted by expert)."""
    choice = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.flatten()
    return torch.cumsum(torch.bincount(choice, minlength=experts), 0).to(torch.int32)


def time_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()              # as the engine runs it: inside a captured step, no launch gaps
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the default tile configuration only")
    args = ap.parse_args()
    import_deepinfer()
    from deepinfer.runtime import cuda_kernels as ck

    dev, dt = torch.device("cuda"), torch.bfloat16
    E, D, I, K_TOP = 64, 2048, 1408, 6
    gen = torch.Generator().manual_seed(0)
    weights = {"gate_up": torch.randn(E, 2 * I, D, device=dev, dtype=dt).transpose(1, 2),   # [G, K, N] views
               "down": torch.randn(E, D, I, device=dev, dtype=dt).transpose(1, 2)}
    default = (ck.BLOCK_N, ck.BLOCK_K, ck.NUM_WARPS, ck.NUM_STAGES)
    configs = [default] if args.quick else [default] + [
        c for c in itertools.product((32, 64, 128), (64, 128, 256), (4,), (3, 5)) if c != default]
    print("| proj | tokens | rows | form | BLOCK_N BLOCK_K warps stages | us | GB/s | max abs diff |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: |")
    for tokens in (1, 8, 32):
        offs = routed_rows(tokens, E, K_TOP, gen).to(dev)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        for name, w in weights.items():
            x = torch.randn(tokens * K_TOP, w.shape[1], device=dev, dtype=dt)
            active = int((counts > 0).sum()) * w.shape[1] * w.shape[2] * 2
            ref = torch._grouped_mm(x, w, offs=offs)
            us = time_us(lambda: torch._grouped_mm(x, w, offs=offs))
            print(f"| {name} | {tokens} | {x.shape[0]} | torch._grouped_mm | | {us:.1f} | {active / us / 1e3:.0f} | |")
            rows = {}
            for bn, bk, nw, ns in configs:
                ck.BLOCK_N, ck.BLOCK_K, ck.NUM_WARPS, ck.NUM_STAGES = bn, bk, nw, ns
                try:
                    y = ck.grouped_rows_mm(x, w, offs)
                    diff = (y.float() - ref.float()).abs().max().item()
                    us = time_us(lambda: ck.grouped_rows_mm(x, w, offs))
                except Exception as e:  # a configuration that does not compile (shared memory) is reported
                    print(f"| {name} | {tokens} | {x.shape[0]} | triton | {bn} {bk} {nw} {ns} | failed: "
                          f"{str(e).splitlines()[0][:80]} | | |")
                    continue
                rows[(bn, bk, nw, ns)] = (us, f"| {name} | {tokens} | {x.shape[0]} | triton | {bn} {bk} {nw} {ns} | {us:.1f} | "
                                 f"{active / us / 1e3:.0f} | {diff:.3g} |")
            ck.BLOCK_N, ck.BLOCK_K, ck.NUM_WARPS, ck.NUM_STAGES = default
            for c, (_, line) in sorted(rows.items(), key=lambda r: (r[0] != default, r[1][0]))[:5]:
                print(line + (" (default)" if c == default else ""))      # the default, then the fastest others
            sys.stdout.flush()


if __name__ == "__main__":
    main()
