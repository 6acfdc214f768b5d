"""Hand-written GPU kernels (Triton), called from the ops in runtime/ops.py.

`grouped_rows_mm`: the MoE experts' grouped GEMM for decode-sized row counts. torch._grouped_mm (CUTLASS) is made
for groups of many rows; with a few rows a group (a decode step's (token, expert) pairs: 6 at batch 1 over 64
experts) its V2-Lite-size experts ran at 29 us a projection on the H200, about half the copy bandwidth for
the chosen experts' weights, 1.5 ms of a 3.9 ms batch-1 step. This kernel streams each non-empty group's weight
once against all of its rows: one program per (non-empty group, column tile), so the grid spends nothing on the
empty groups, and no host sync (the groups are found on the device), so it is CUDA-graph safe.

Triton compiles it for the GPU; with TRITON_INTERPRET=1 it runs on CPU tensors too, which is how the tests check
it (in fp16: the interpreter's tl.dot misreads bf16 operands, triton 3.6).
"""

from __future__ import annotations

import functools

import torch

# At most this many rows (routed pairs) take the kernel: a batch-32 decode step's 192 pairs do, a prefill
# chunk's thousands keep torch._grouped_mm, whose tiles are made for them.
MAX_ROWS = 256
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128       # 16: tl.dot's smallest M tile; a group's rows loop over M tiles
NUM_WARPS, NUM_STAGES = 4, 4


@functools.cache
def _triton():
    """The triton module, or None where it cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def available(x: torch.Tensor) -> bool:
    """The kernel is made for these rows: CUDA, bf16 or fp16, at most MAX_ROWS, Triton importable."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= MAX_ROWS and _triton() is not None


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def grouped_rows_kernel(x_ptr, w_ptr, offs_ptr, y_ptr,
                            sxm, sxk, swg, swk, swn, sym, syn,
                            N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (i, j): the i-th non-empty group (in group order), columns j * BLOCK_N ...
        i = tl.program_id(0)
        j = tl.program_id(1)
        gi = tl.arange(0, G_PAD)
        ends = tl.load(offs_ptr + gi, mask=gi < G, other=0)
        starts = tl.load(offs_ptr + gi - 1, mask=(gi > 0) & (gi < G), other=0)
        nonempty = ends > starts
        rank = tl.cumsum(nonempty.to(tl.int32), 0) - 1
        mine = nonempty & (rank == i)
        has = i < tl.sum(nonempty.to(tl.int32))
        g = tl.sum(tl.where(mine, gi, 0))
        end = tl.load(offs_ptr + g, mask=has, other=0)                  # no rows when fewer than i + 1 groups have
        start = tl.load(offs_ptr + g - 1, mask=has & (g > 0), other=0)
        g = g.to(tl.int64)
        rn = j * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + g * swg
        m0 = start
        while m0 < end:      # not `range(start, end, BLOCK_M)`: Triton's interpreter cannot take tensor bounds
            rm = m0 + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                            mask=(rm[:, None] < end) & (kk[None, :] < K), other=0.0)
                b = tl.load(w_base + kk[:, None] * swk + rn[None, :] * swn,
                            mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
                acc += tl.dot(a, b)
            tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                     mask=(rm[:, None] < end) & (rn[None, :] < N))
            m0 += BLOCK_M

    return grouped_rows_kernel


def grouped_rows_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """deepinfer::grouped_mm's contract (x [M, K], w [G, K, N], offs [G] int32 cumulative row ends -> [M, N]; rows
    at or past offs[-1] unspecified) for up to MAX_ROWS rows, summed in fp32 and rounded once to x's dtype."""
    triton, _ = _triton()
    M, K = x.shape
    G, _, N = w.shape
    w = w.to(x.dtype)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    grid = (min(M, G), triton.cdiv(N, BLOCK_N))
    _kernel()[grid](x, w, offs, y, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                    y.stride(0), y.stride(1), N=N, K=K, G=G, G_PAD=triton.next_power_of_2(G),
                    BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
