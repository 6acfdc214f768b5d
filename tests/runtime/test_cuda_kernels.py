"""The Triton grouped GEMM for few rows (runtime/cuda_kernels.py) against torch's grouped GEMM, run by Triton's
interpreter on the CPU: the same program the GPU compiles, so the group finding, tiling and masking are what is
tested here; its speed and bf16 results are checked on the GPU (benchmarks/gpu_moe_kernel.py, gpu_v2lite.py).
fp16 operands: the interpreter's tl.dot misreads bf16 ones (triton 3.6). The interpreter is chosen when triton
is imported, so the cases run in a child process started with TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.runtime import cuda_kernels as ck  # noqa: E402

CASES = [
    (6, [0, 1, 0, 2, 0, 0, 3], 96, 80),             # empty groups between, N and K not multiples of the tiles
    (40, [17, 0, 23], 64, 64),                      # one group over several M tiles (BLOCK_M = 16)
    (12, [2, 3, 0, 1], 32, 48),                     # rows past offs[-1] (another rank's pairs): unspecified
    (5, [0, 0, 0, 0, 0], 32, 32),                   # no rows in any group
    (3, [1] * 3 + [0] * 9, 160, 72),                # fewer rows than groups: the grid is one program per row
]


def _run_cases() -> list[dict]:
    from deepinfer.runtime.ops import grouped_mm_torch
    results = []
    for rows, counts, k, n in CASES:
        gen = torch.Generator().manual_seed(rows + k)
        x = torch.randn(rows, k, generator=gen).half()
        w = torch.randn(len(counts), n, k, generator=gen).half().transpose(1, 2)  # [G, K, N], as the graphs pass it
        offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        y = ck.grouped_rows_mm(x, w, offs)
        ref = grouped_mm_torch(x.float(), w.float(), offs)
        real = int(offs[-1])
        err = (y[:real].float() - ref[:real]).abs() - 2e-3 * ref[:real].abs()     # fp16 rounding of the result
        results.append({"shape": list(y.shape), "dtype": str(y.dtype),
                        "excess": float(err.max()) if real else 0.0, "scale": float(ref.abs().max()) if real else 0.0})
    return results


def test_grouped_rows_mm_matches_grouped_mm():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for (rows, counts, k, n), r in zip(CASES, results, strict=True):
        assert r["shape"] == [rows, n] and r["dtype"] == "torch.float16", (counts, r)
        assert r["excess"] <= 2e-2, (counts, r)           # within fp16 rounding of torch's fp32 sums


def test_kernel_is_taken_for_decode_rows_on_cuda_only():
    assert not ck.available(torch.zeros(ck.MAX_ROWS, 8, dtype=torch.bfloat16))   # CPU tensors: their own kernels
    assert not ck.available(torch.zeros(2, 8, dtype=torch.bfloat16, device="meta"))


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
