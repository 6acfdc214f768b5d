"""Kernels the compiled graphs call by name (`torch.ops.deepinfer.*`).

Importing this module registers them. The compiler traces them as opaque calls (their fake kernels give the
shapes), and AOTInductor packages call them back through the dispatcher, so every process that loads a graph
imports this module first (runtime/artifact.py does).
"""

import torch   # no `from __future__ import annotations`: custom_op reads the annotations as real types

_NATIVE_FAILED: set[tuple[str, torch.dtype]] = set()


@torch.library.custom_op("deepinfer::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM over rows sorted by group: x [M, K], w [G, K, N], offs [G] int32 cumulative row ends
    (group g owns rows offs[g-1] .. offs[g]) -> [M, N]. Rows at or past offs[-1] belong to no group: their
    values are unspecified, and callers mask them.

    Static shapes with a data-dependent split: each routed (token, expert) pair is computed exactly once, with
    no capacity to overflow. torch._grouped_mm does it natively (CPU in fp32 and bf16: checked on torch 2.13;
    CUDA in bf16 on sm90+); elsewhere a masked loop over the groups gives the same result (G full GEMMs, no host
    sync, so it stays CUDA-graph safe)."""
    key = (x.device.type, x.dtype)
    if key not in _NATIVE_FAILED and hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(x, w, offs=offs)
        except (RuntimeError, NotImplementedError):
            _NATIVE_FAILED.add(key)
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)                      # [M], G = past the last group
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for g in range(w.shape[0]):
        out = torch.where((group == g)[:, None], x @ w[g], out)
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 2 and w.dim() == 3 and offs.dim() == 1, lambda: "grouped_mm: x [M, K], w [G, K, N], offs [G]")
    torch._check(x.shape[1] == w.shape[1], lambda: f"grouped_mm: K mismatch {x.shape[1]} vs {w.shape[1]}")
    torch._check(offs.shape[0] == w.shape[0], lambda: "grouped_mm: one offset per group")
    return x.new_empty(x.shape[0], w.shape[-1])
