"""Kernels the compiled graphs call by name (`torch.ops.deepinfer.*`).

Importing this module registers them. The compiler traces them as opaque calls (their fake kernels give the
shapes), and AOTInductor packages call them back through the dispatcher, so every process that loads a graph
imports this module first (runtime/artifact.py does).

The Python bodies below are the portable implementations. On CPU, once the hand-written kernels are loaded
(runtime/cpu_kernels.py), runtime/csrc registers C++ implementations for the CPU dispatch key that take their
place: the same choices (kernel or torch's path), without a trip through Python on every call from a compiled
graph (20-60 us a call measured here, tens of calls a decode step). The `*_torch` functions are the paths that
do not need the kernels, callable directly.
"""

import logging

import torch   # no `from __future__ import annotations`: custom_op reads the annotations as real types

log = logging.getLogger("deepinfer")

_NATIVE_FAILED: set[tuple[str, torch.dtype]] = set()


@torch.library.custom_op("deepinfer::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM over rows sorted by group: x [M, K], w [G, K, N], offs [G] int32 cumulative row ends
    (group g owns rows offs[g-1] .. offs[g]) -> [M, N]. Rows at or past offs[-1] belong to no group: their
    values are unspecified, and callers mask them.

    Static shapes with a data-dependent split: each routed (token, expert) pair is computed exactly once, with
    no capacity to overflow. torch._grouped_mm does it natively (CPU in fp32 and bf16: checked on torch 2.13;
    CUDA in bf16 on sm90+); elsewhere a masked loop over the groups gives the same result (G full GEMMs, no host
    sync, so it stays CUDA-graph safe). On CUDA, decode-sized row counts take a Triton kernel instead
    (runtime/cuda_kernels.py: 1.6-3.2x torch._grouped_mm's speed for V2-Lite experts on the H200, same results);
    on the CPU, few rows a group take the hand-written kernel (`_few_rows_kernel`)."""
    if _widen_bf16(x, w):
        return grouped_mm(x.float(), w, offs).to(torch.bfloat16)
    if _few_rows_kernel(x, w, offs):
        return torch.ops.deepinfer_cpu.grouped_rows_mm(x, w.transpose(1, 2), offs)
    from . import cuda_kernels
    if cuda_kernels.available(x):
        out = _native(("triton_grouped_rows_mm", x.dtype), x, lambda: cuda_kernels.grouped_rows_mm(x, w, offs),
                      Exception,  # Triton's compile errors have no common base class
                      "the Triton grouped GEMM for few rows does not run here (%s); torch._grouped_mm takes them")
        if out is not None:
            return out
    return grouped_mm_torch(x, w, offs)


def _native(key: tuple[str, torch.dtype], x: torch.Tensor, run, errors, warning: str, *args) -> torch.Tensor | None:
    """run() unless it failed here before; None when it fails or failed. The first failure marks `key`, so later
    calls go straight to the caller's portable path, and logs `warning` % (*args, the error's first line). A device
    fault (AcceleratorError) or a failure inside a CUDA-graph capture says nothing about whether the op runs
    here: those go up as they are."""
    if key in _NATIVE_FAILED:
        return None
    try:
        return run()
    except errors as e:
        if isinstance(e, torch.AcceleratorError) or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            raise
        _NATIVE_FAILED.add(key)
        log.warning(warning, *args, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        return None


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """deepinfer::grouped_mm with torch's ops only: torch._grouped_mm where it runs, else a masked loop.
    Weights stored narrower than x (bf16 weights, fp32 math) are widened first."""
    w = w.to(x.dtype)
    if hasattr(torch, "_grouped_mm"):
        def native():
            if _swap_operands(x, w):
                return torch._grouped_mm(w.transpose(1, 2), x.t(), offs=offs).t().contiguous()
            return torch._grouped_mm(x, w, offs=offs)
        out = _native((x.device.type, x.dtype), x, native, (RuntimeError, NotImplementedError),
                      "torch._grouped_mm does not run for %s %s here (%s); the MoE experts take a masked loop "
                      "(a full GEMM per expert: correct, much slower)", x.device.type, x.dtype)
        if out is not None:
            return out
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)                      # [M], G = past the last group
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for g in range(w.shape[0]):
        out = torch.where((group == g)[:, None], x @ w[g], out)
    return out


@torch.library.custom_op("deepinfer::scores_bmm", mutates_args=())
def scores_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) summed and returned in fp32: bf16 operands' products are exact in fp32, so this is
    torch.bmm(a.float(), b.float()). On CUDA one GEMM reads the narrow operands as they are (torch.bmm's out_dtype,
    tensor cores, fp32 accumulator and result); widening them first takes cuBLAS's fp32 FFMA kernel instead, with
    twice the operand bytes (52 us against a few for a V2-Lite decode layer's scores on the H200)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        out = _native(("scores_bmm", a.dtype), a, lambda: torch.bmm(a, b, out_dtype=torch.float32),
                      (RuntimeError, TypeError, NotImplementedError),
                      "torch.bmm with out_dtype does not run for %s here (%s); the decode scores widen their "
                      "operands first (same sums, slower)", a.dtype)
        if out is not None:
            return out
    return torch.bmm(a.float(), b.float())


@scores_bmm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    torch._check(a.dim() == 3 and b.dim() == 3, lambda: "scores_bmm: a [B, M, K], b [B, K, N]")
    torch._check(a.shape[2] == b.shape[1], lambda: f"scores_bmm: K mismatch {a.shape[2]} vs {b.shape[1]}")
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)


def _widen_bf16(x: torch.Tensor, w: torch.Tensor) -> bool:
    """bf16 operands on a CPU without bf16 dot products: the ops' Python bodies then compute as the C++ ones do,
    on the widened rows (exact products, fp32 sums), rounded to bf16 once; torch's bf16 GEMMs there run 30-70x
    under the fp32 rate."""
    return x.device.type == "cpu" and x.dtype == w.dtype == torch.bfloat16 and not cpu_has_bf16_dot()


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX), where torch's bf16 GEMMs are fast."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@torch.library.custom_op("deepinfer::bf16_einsum", mutates_args=())
def bf16_einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum(equation, a, b) of bf16 operands as bf16 hardware computes it: exact products, fp32 sums, the
    result rounded to bf16 once. The CPU graphs' --matmul-dtype bfloat16 prefill attention products go through
    this op, which picks the form at run time, as rows_linear does for the linears: torch's bf16 GEMM (oneDNN)
    where the CPU has bf16 dot products, else the fp32 GEMM on the widened operands, rounded once (the same sums).
    Baked into a graph as bf16 GEMMs, they ran 30-70x slower than fp32 on a CPU without bf16 dot products (a
    2-core AVX2 Zen 3 VM: the demo model's 256-token prefill chunk 65 ms against 13 ms through this op, fp32 math
    11 ms; benchmark prefill 0.38x transformers' against 1.58x)."""
    if a.dtype == b.dtype == torch.bfloat16 and a.device.type == "cpu" and not cpu_has_bf16_dot():
        return torch.einsum(equation, a.float(), b.float()).to(torch.bfloat16)
    return torch.einsum(equation, a, b)


@bf16_einsum.register_fake
def _(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.einsum(equation, a, b)


@torch.library.custom_op("deepinfer::rows_linear", mutates_args=())
def rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for rows x [M, K] and a weight w [N, K]: what CPU graphs call for 2..64 rows of any weight, for
    any rows of a weight of at least ROWS_LINEAR_MIN_WEIGHT elements (`compile.model.linear`), and for every bf16
    product of --matmul-dtype bfloat16 (bf16 x and w: the C++ implementation picks the kernel, oneDNN's bf16 GEMM,
    or the fp32 path on the widened rows where the CPU has no bf16 dot products). The CPU kernel as one group for up
    to KERNEL_MAX_ROWS_PER_GROUP rows (1.3-1.9x faster than MKL's (w @ x.T).T at 4-16 rows on the `mid` model's
    projections, head and MLP; 1.25x on the demo model's head at 16 rows), and for more where its AVX-512 form runs
    (1.05-1.15x MKL at 256 rows) or its AVX2 panel form does (K a multiple of 8; 1.0-1.5x MKL at 65-512 rows, bf16
    weights read as they are instead of widened first); (w @ x.T).T for a few rows and F.linear for more elsewhere.
    On CUDA (the cuda backend's decode-sized bf16 linears, rewritten to this op at load): cuBLAS or the Triton
    skinny GEMM, whichever measured faster for the shape (runtime/cuda_kernels.py `linear_for`)."""
    if x.is_cuda:     # the cuda backend's decode-sized linears (runtime/artifact.py `skinny_linears`)
        from . import cuda_kernels
        if cuda_kernels.skinny_available(x, w):
            return cuda_kernels.linear_for(x, w)(x, w)
        return torch.nn.functional.linear(x, w.to(x.dtype))
    if _widen_bf16(x, w):
        return rows_linear(x.float(), w).to(torch.bfloat16)
    few = x.shape[0] <= KERNEL_MAX_ROWS_PER_GROUP
    if _kernel_runs(x, w) and (few or torch.ops.deepinfer_cpu.avx512_form()
                               or (x.shape[1] % 8 == 0 and torch.ops.deepinfer_cpu.panel_form())):
        offs = torch.full((1,), x.shape[0], dtype=torch.int32)
        return torch.ops.deepinfer_cpu.grouped_rows_mm(x, w[None], offs)
    return rows_linear_torch(x, w)


WIDEN_SLICE_ELEMENTS = 1 << 16          # rows_linear_torch's widening slice: 256 KB of fp32, within L2


def rows_linear_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > KERNEL_MAX_ROWS_PER_GROUP:
        return torch.nn.functional.linear(x, w.to(x.dtype))
    if w.dtype == x.dtype:
        return (w @ x.t()).t().contiguous()
    # A narrower weight (bf16 weights, fp32 rows) widened a slice at a time, each slice still in cache when it is
    # read: one widened copy of the whole weight would write and read it again at twice the bytes.
    step = max(1, WIDEN_SLICE_ELEMENTS // w.shape[1])
    return torch.cat([(w[i:i + step].to(x.dtype) @ x.t()).t() for i in range(0, w.shape[0], step)], dim=1)


@rows_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 2 and w.dim() == 2, lambda: "rows_linear: x [M, K], w [N, K]")
    torch._check(x.shape[1] == w.shape[1], lambda: f"rows_linear: K mismatch {x.shape[1]} vs {w.shape[1]}")
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("deepinfer::head_linear", mutates_args=())
def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head h, F.linear(x[h], w[h]) in fp32: x [H, T, K], w [H, N, K] -> fp32 [H, T, N], the fp32 sums of the
    exact products of the operands as they are (bf16 or fp32). The CPU decode attention's two absorptions (the
    queries into the latent space, the latent output back out of it: compile/model.py `mla_attention`). Here torch's
    fp32 bmm on the widened operands; runtime/csrc/grouped_rows_mm.cpp's CPU implementation runs the heads as the
    grouped kernel's groups, with bf16 dot products where both operands are bf16 and the CPU has them (2-4x torch's
    bmm at `mid` widths, with no widened copy of the weight a step)."""
    return head_linear_torch(x, w)


def head_linear_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.float(), w.float().transpose(1, 2))


@head_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 3 and w.dim() == 3, lambda: "head_linear: x [H, T, K], w [H, N, K]")
    torch._check(x.shape[0] == w.shape[0] and x.shape[2] == w.shape[2],
                 lambda: f"head_linear: x {tuple(x.shape)} against w {tuple(w.shape)}")
    return x.new_empty(x.shape[0], x.shape[1], w.shape[1], dtype=torch.float32)


# Parts of a layer graph that `deepinfer::region_mark` closes (compile --region-marks): the index is the op's `part`
# argument; MARK_CONTINUE closes a segment that belongs to the part that encloses it, the next attention, mlp or
# moe mark's (the work before a collective inside the attention or the MoE).
MARK_PARTS = ("attention", "mlp", "moe", "collectives")
MARK_CONTINUE = -1
_mark_sink = None        # set by the runtime's region timer (`set_mark_sink`) while it times a graph


def set_mark_sink(sink) -> None:
    """sink(part) is called at every region mark a graph passes (None: marks only pass their tensor on)."""
    global _mark_sink
    _mark_sink = sink


@torch.library.custom_op("deepinfer::region_mark", mutates_args=())
def region_mark(x: torch.Tensor, part: int) -> torch.Tensor:
    """A timing point inside a layer graph of an artifact compiled with --region-marks: the graph's work since
    the previous mark (or its start) was `MARK_PARTS[part]`. Returns a copy of x that everything after the mark
    reads, which orders the mark between the two parts in any compiled form. With DEEPINFER_REGION_TIMING the
    runtime's timer receives the point (after synchronising the device); otherwise the mark is the copy alone."""
    if _mark_sink is not None:
        _mark_sink(part)
    return x.clone()


@region_mark.register_fake
def _(x: torch.Tensor, part: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("deepinfer::paged_mla_decode", mutates_args=())
def paged_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, valid: torch.Tensor,
                     kv_lora_rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode attention over the paged latent pool: q [T, H, Dc] (absorbed nope part, then rope
    part), kv_cache [NB, bs, Dc], block_tables [T, B] (pool blocks, key order), valid [T, B * bs] bool ->
    (o [T, H, kv_lora_rank] fp32: softmax(scale * q . k) over the valid keys applied to their c_kv, zero where
    no key is valid; lse [T, H] fp32: the scores' log-sum-exp, -inf where no key is valid, for the CP merge).

    What CPU decode graphs call (`compile.model.mla_attention`): the hand-written kernel
    (runtime/csrc/paged_mla_decode.cpp) reads each token's keys where they lie in the pool; without it, the
    gather + two batched GEMMs below, the form the other backends' graphs inline."""
    if kv_cache.dtype in (torch.float32, torch.bfloat16) and _kernel_runs(q, kv_cache):
        return torch.ops.deepinfer_cpu.paged_mla_decode(q, kv_cache, block_tables, valid, kv_lora_rank, scale)
    return paged_mla_decode_torch(q, kv_cache, block_tables, valid, kv_lora_rank, scale)


def paged_mla_decode_torch(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, valid: torch.Tensor,
                           kv_lora_rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(bool((block_tables >= 0).all()), lambda: "paged_mla_decode: negative block id")
    ctx = kv_cache[block_tables].flatten(1, 2).to(q.dtype)                   # [T, C, Dc]
    scores = torch.bmm(q, ctx.transpose(1, 2)).float() * scale                # [T, H, C]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    c_ctx = ctx[..., :kv_lora_rank]
    o, lse = partial_softmax(scores, lambda e: torch.bmm(e.to(c_ctx.dtype), c_ctx).float())
    return o, lse.squeeze(-1)


def partial_softmax(scores: torch.Tensor, weighted_values) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the last dim of scores applied by weighted_values, with its log-sum-exp: -> (o [.., X] fp32,
    lse [.., 1]; zeros and -inf where every score is -inf). What a CP rank computes over its own keys before
    the merge (`compile.model._merge_partials`), and the torch form of paged_mla_decode."""
    mx = scores.amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(scores - mx)                                                # masked keys -> 0
    denom = e.sum(dim=-1, keepdim=True)
    o = weighted_values(e) / denom.clamp_min(1e-30)
    lse = torch.where(denom > 0, mx + torch.log(denom.clamp_min(1e-30)), torch.full_like(mx, float("-inf")))
    return o, lse


@paged_mla_decode.register_fake
def _(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, valid: torch.Tensor,
      kv_lora_rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, Dc = q.shape
    torch._check(kv_cache.dim() == 3 and kv_cache.shape[2] == Dc, lambda: "paged_mla_decode: kv_cache [NB, bs, Dc]")
    torch._check(block_tables.dim() == 2 and block_tables.shape[0] == T, lambda: "paged_mla_decode: tables [T, B]")
    torch._check(valid.shape == (T, block_tables.shape[1] * kv_cache.shape[1]), lambda: "paged_mla_decode: valid [T, C]")
    return q.new_empty(T, H, kv_lora_rank, dtype=torch.float32), q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("deepinfer::prefill_attention", mutates_args=())
def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """A prefill chunk's attention over its packed context: q [T, H, D], k [C, H, D], v [C, H, Dv], starts [T] (where
    each query's sequence begins in the context), positions [T] (its position in that sequence) -> o [T, H, Dv] fp32:
    softmax(scale * q . k) . v over keys starts .. starts + position (zero for a query with none).

    What CPU prefill graphs call without context parallelism (`compile.model.mla_attention`): the kernel
    (runtime/csrc/prefill_attention.cpp) scores each block of queries only against the keys they see, where the
    torch form below scores the whole bucket and masks half of it away; with the kernels built, their CPU
    implementation replaces this body for every dtype (bf16 q, k, v: bf16 GEMMs over long spans where the CPU has
    bf16 dot products)."""
    if q.dtype == k.dtype == v.dtype == torch.float32 and _kernel_runs(q, k):
        return torch.ops.deepinfer_cpu.prefill_attention(q, k, v, starts, positions, scale)
    return prefill_attention_torch(q, k, v, starts, positions, scale)


def prefill_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                            positions: torch.Tensor, scale: float) -> torch.Tensor:
    rel = torch.arange(k.shape[0], device=q.device)[None, :] - starts[:, None]
    valid = (rel >= 0) & (rel <= positions[:, None])                          # [T, C]
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).float() * scale     # [H, T, C]
    scores = scores.masked_fill(~valid[None], float("-inf"))
    o = partial_softmax(scores, lambda e: torch.matmul(e.to(v.dtype), v.transpose(0, 1)).float())[0]
    return o.transpose(0, 1)                                                  # [T, H, Dv]


@prefill_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor,
      scale: float) -> torch.Tensor:
    T, H, D = q.shape
    torch._check(k.dim() == 3 and k.shape[1] == H and k.shape[2] == D, lambda: "prefill_attention: k [C, H, D]")
    torch._check(v.dim() == 3 and v.shape[:2] == k.shape[:2], lambda: "prefill_attention: v [C, H, Dv]")
    torch._check(starts.shape == (T,) and positions.shape == (T,), lambda: "prefill_attention: starts, positions [T]")
    return q.new_empty(T, H, v.shape[2], dtype=torch.float32)


def _few_rows_kernel(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> bool:
    """CPU fp32, at most KERNEL_MAX_ROWS_PER_GROUP rows a group on average (counting the rows in groups only, not
    the padding and other ranks' pairs past offs[-1]): runtime/csrc/grouped_rows_mm.cpp, which
    streams each group's weight once against all its rows in registers. Against torch._grouped_mm (operands
    swapped where that is faster), two runs on 2 AVX2 cores: `mid` benchmark experts' gate-up (16 x 1024 x 1024)
    at 1, 4 and 16 rows a group 1.7-1.9x, 2.0x and 1.9-2.0x faster, their down projection (K = 512) at 4 rows
    1.2-1.6x; V2-Lite-size experts at 48 rows over 64 experts 2.3-2.6x; demo-model experts at 4 rows 3.3-3.9x.
    Against one MKL GEMM per group (interleaved, two runs, since the kernel sums eight accumulators at once and
    prefetches): `mid` gate-up / down at 32 rows a group 1.6-1.9x / 1.4-1.8x, at 64 rows 1.4-1.5x / 1.2-1.5x,
    at 128 rows 0.99x; the demo model's at 64 rows 1.1-1.2x, at 128 0.8-1.1x; V2-Lite-size experts (K = 2048,
    1408) and K = 4096 at 64 rows 1.1-1.2x, at 96 rows 1.02-1.04x. So a 256-token prefill chunk's
    experts (64 rows a group on `mid`) take it too; bigger groups keep MKL's blocking, except where the kernel's
    AVX-512 form runs (L2-blocked: on a Zen 4 VM `mid` experts at 128 and 256 rows a group 1.16-1.36x MKL)."""
    if not _kernel_runs(x, w):
        return False
    few = w.shape[0] == 0 or int(offs[-1]) <= KERNEL_MAX_ROWS_PER_GROUP * w.shape[0]
    return few or torch.ops.deepinfer_cpu.avx512_form()


def _kernel_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The hand-written kernels take fp32 CPU activations and fp32 or bf16 weights, where they were built
    (runtime/cpu_kernels.py). The paged attention kernel's pool, fp32 or bf16: its caller checks that too."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype not in (torch.float32, torch.bfloat16):
        return False
    from . import cpu_kernels
    return cpu_kernels.available()


# These thresholds decide the Python body only; runtime/csrc/grouped_rows_mm.cpp holds the same values for the
# C++ CPU implementation that replaces it once the kernels are loaded.
KERNEL_MAX_ROWS_PER_GROUP = 64
# runtime/csrc/prefill_attention.cpp kBf16MinWork: a block of queries whose keys x (D + Dv) reach this runs the
# prefill attention's products as bf16 GEMMs (bf16 operands, a CPU with bf16 dot products); below, its fp32 form.
PREFILL_BF16_MIN_WORK = 51200


def _swap_operands(x: torch.Tensor, w: torch.Tensor) -> bool:
    """CPU: compute out.T = w.T @ x.T per group when groups are a few rows of a big weight. MKL's sgemm with few
    rows (M) and a transposed weight runs far below both its FLOP and its memory peak; with the operands swapped
    the few rows become the narrow N side and the weight streams 1.5-3x faster. Measured on 2 AVX2 cores:
    mid benchmark experts (1024 x 1024 gate-up, 1024 x 512 down) at 64 rows over 16 experts 10.1 -> 6.4 ms and
    5.9 -> 2.2 ms; V2-Lite-size experts at 96 and 384 rows over 64 experts 1.3-1.6x faster; with under one row
    or over ~8 rows a group, or small weights (demo model), the plain form is as fast or faster."""
    G, K, N = w.shape
    rows_per_group = x.shape[0] / G
    return x.device.type == "cpu" and 1 <= rows_per_group <= SWAP_MAX_ROWS_PER_GROUP and K * N >= SWAP_MIN_WEIGHT


SWAP_MAX_ROWS_PER_GROUP = 8
SWAP_MIN_WEIGHT = 1 << 18          # elements of one group's weight


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 2 and w.dim() == 3 and offs.dim() == 1, lambda: "grouped_mm: x [M, K], w [G, K, N], offs [G]")
    torch._check(x.shape[1] == w.shape[1], lambda: f"grouped_mm: K mismatch {x.shape[1]} vs {w.shape[1]}")
    torch._check(offs.shape[0] == w.shape[0], lambda: "grouped_mm: one offset per group")
    return x.new_empty(x.shape[0], w.shape[-1])
