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


SKINNY_CASES = [       # rows, N, K, K slices asked for
    (1, 100, 300, 1),     # N and K not multiples of the tiles, one slice
    (1, 100, 300, 3),     # three slices, the last one short
    (5, 64, 512, 4),
    (16, 130, 256, 8),    # more slices asked than K has BLOCK_K steps: two
    (40, 72, 384, 2),     # BLOCK_M 64
]


def _run_skinny_cases() -> list[dict]:
    results = []
    for rows, n, k, slices in SKINNY_CASES:
        gen = torch.Generator().manual_seed(rows * n + k)
        x = torch.randn(rows, k, generator=gen).half()
        w = torch.randn(n, k, generator=gen).half()
        y = ck.skinny_linear(x, w, slices)
        again = ck.skinny_linear(x, w, slices)          # the tile counters were reset by the call before
        ref = torch.nn.functional.linear(x.float(), w.float())
        err = (y.float() - ref).abs() - 2e-3 * ref.abs()
        counters = [int(c.abs().sum()) for _, c in ck._WORKSPACES.values()]
        results.append({"shape": list(y.shape), "excess": float(err.max()), "same_again": bool(torch.equal(y, again)),
                        "counters": counters})
    return results


def test_skinny_linear_matches_linear_over_its_k_slices():
    """Column tiles x K slices, the last slice of a tile summing all partials in order and resetting its counter:
    the result is F.linear's within fp16 rounding, bitwise the same on a second call, and the counters are zero."""
    for (rows, n, k, slices), r in zip(SKINNY_CASES, _interpreted()["skinny"], strict=True):
        assert r["shape"] == [rows, n], r
        assert r["excess"] <= 2e-2 and r["same_again"] and not any(r["counters"]), (rows, n, k, slices, r)


def test_slice_counts_fill_the_device():
    assert ck.slice_counts(102400, 2048, 132) == [1]            # the head: 1600 column tiles already
    assert ck.slice_counts(576, 2048, 132) == [1, 8]            # kv_a: 9 tiles; a slice keeps two BLOCK_K steps
    assert ck.slice_counts(2048, 1024, 132) == [1, 4]           # 32 tiles; K 1024 holds 4 slices of two steps
    assert ck.slice_counts(2048, 1024, 16) == [1]
    assert ck.slice_counts(64, 128, 132) == [1]


def test_choice_is_the_fastest_correct_candidate():
    x, w = torch.randn(3, 32), torch.randn(8, 32)
    cands = {"cublas": lambda a, b: torch.nn.functional.linear(a, b), "wrong": lambda a, b: torch.zeros(3, 8),
             "fast": lambda a, b: torch.nn.functional.linear(a, b), "broken": lambda a, b: 1 / 0}
    timed = iter([5.0, 2.0])          # only the correct ones are timed, in order: cublas, fast
    name, times = ck.choose(cands, x, w, lambda call, w: next(timed))
    assert name == "fast" and times["cublas"] == 5.0 and times["fast"] == 2.0
    assert times["wrong"] != times["wrong"] and times["broken"] == float("inf")      # nan: wrong, inf: failed
    name, _ = ck.choose({"cublas": cands["cublas"], "wrong": cands["wrong"]}, x, w, lambda call, w: 1.0)
    assert name == "cublas"
    close = iter([5.0, 4.9])          # within the margin: cuBLAS stays
    assert ck.choose({"cublas": cands["cublas"], "fast": cands["fast"]}, x, w, lambda call, w: next(close))[0] == "cublas"

    def timing(*outcomes):            # time_us's results in order; an exception is raised
        it = iter(outcomes)

        def time_us(call, w):
            t = next(it)
            if isinstance(t, Exception):
                raise t
            return t
        return time_us
    pair = {"cublas": cands["cublas"], "fast": cands["fast"]}
    # the candidate's timing graph failed to capture (graph_time_us raises CaptureFailed): it is out, not the step
    failed = ck.CaptureFailed("AcceleratorError: operation not permitted when stream is capturing")
    name, times = ck.choose(pair, x, w, timing(5.0, failed))
    assert name == "cublas" and times["fast"] == float("inf")
    with pytest.raises(torch.AcceleratorError):  # a device fault is not a candidate's failure: it propagates
        ck.choose(pair, x, w, timing(5.0, torch.AcceleratorError("an illegal memory access was encountered")))


def test_reference_is_linear_in_fp32_a_slice_at_a_time():
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(10, 40).bfloat16()
    got = ck.reference_linear(x, w, columns=3)
    assert got.dtype == torch.float32 and got.shape == (3, 10)
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w.float()), rtol=1e-6, atol=1e-6)


def test_mode_variable_is_checked(monkeypatch):
    from deepinfer.common.errors import OptionError
    for ok in ("auto", "0", "8", ""):
        monkeypatch.setenv(ck.MODE_ENV, ok)
        assert ck.skinny_mode() == (ok or "auto")
    monkeypatch.setenv(ck.MODE_ENV, "off")
    with pytest.raises(OptionError, match="DEEPINFER_SKINNY_LINEAR='off' must be auto, 0"):
        ck.skinny_mode()


def test_choices_are_kept_across_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    assert ck._saved_choices() == {}
    ck._save_choice("H200|1x576x2048", "triton/8")
    ck._save_choice("H200|1x2048x2048", "cublas")
    assert ck._saved_choices() == {"H200|1x576x2048": "triton/8", "H200|1x2048x2048": "cublas"}
    (tmp_path / "cache" / ck.CHOICES_FILE).write_text("{broken")
    assert ck._saved_choices() == {}          # a damaged cache is measured again, not an error


_RESULTS: dict = {}


def _interpreted() -> dict:
    if not _RESULTS:
        env = dict(os.environ, TRITON_INTERPRET="1")
        out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        _RESULTS.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return _RESULTS


def test_grouped_rows_mm_matches_grouped_mm():
    results = _interpreted()["grouped"]
    for (rows, counts, k, n), r in zip(CASES, results, strict=True):
        assert r["shape"] == [rows, n] and r["dtype"] == "torch.float16", (counts, r)
        assert r["excess"] <= 2e-2, (counts, r)           # within fp16 rounding of torch's fp32 sums


def test_kernel_is_taken_for_decode_rows_on_cuda_only():
    assert not ck.available(torch.zeros(ck.MAX_ROWS, 8, dtype=torch.bfloat16))   # CPU tensors: their own kernels
    assert not ck.available(torch.zeros(2, 8, dtype=torch.bfloat16, device="meta"))


if __name__ == "__main__":
    print(json.dumps({"grouped": _run_cases(), "skinny": _run_skinny_cases()}))
