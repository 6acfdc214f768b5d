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

import contextlib
import functools

import torch

# At most this many rows (routed pairs) take the kernel: a batch-32 decode step's 192 pairs do (256 with V2-Lite's two
# shared experts as groups: --shared-experts), a prefill chunk's thousands keep torch._grouped_mm, whose tiles are
# made for them.
MAX_ROWS = 256
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128       # 16: tl.dot's smallest M tile; a group's rows loop over M tiles
NUM_WARPS, NUM_STAGES = 4, 4


class CaptureFailed(RuntimeError):
    """An error raised inside a CUDA-graph capture: what a capture cannot hold (a host sync, a copy to pageable
    memory) fails there as a CUDA error, which torch raises as AcceleratorError as it does a device fault."""


@contextlib.contextmanager
def capturing(g, **kw):
    """torch.cuda.graph(g) with what is raised inside it as CaptureFailed. thread_local: another thread's CUDA call
    (the server's tokenizer, metrics) does not break the capture."""
    try:
        with torch.cuda.graph(g, capture_error_mode="thread_local", **kw):
            yield
    except Exception as e:
        raise CaptureFailed(f"{type(e).__name__}: {e}") from e


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


# -- skinny linears ---------------------------------------------------------------------------------------------
# A decode step's dense projections (q, kv_a, o, the shared experts, the dense MLP, the head) are GEMMs of 1-64 rows
# against weights of 1-400 MB. cuBLAS ran those of the batch-1 V2-Lite step at ~1.8 TB/s on the H200 (1.2 ms of a
# 3.1 ms step's kernels), where a read of the same bytes runs at 4+: narrow outputs (kv_a's 576 columns, o's 2048)
# give it few tiles to spread over 132 SMs. `skinny_linear` splits K too: (column tile, K slice) programs, each
# streaming its slice of the weight once against all rows, and the last program of a column tile to finish (a
# counter a tile) sums the slices' fp32 partials in slice order (deterministic) and resets the counter, all in one
# kernel: no memset or reduction kernels around it (each would cost a graph node, ~1-2 us, per projection).
# Which of cuBLAS and the splits runs a shape is measured on the device the first time the shape is seen
# (`linear_for`), so a shape only takes the kernel where it is faster there.
SKINNY_MAX_ROWS = 64
SKINNY_BLOCK_N, SKINNY_BLOCK_K = 64, 128
MODE_ENV = "DEEPINFER_SKINNY_LINEAR"      # auto (measure, default) | 0 (cuBLAS) | <n>: the kernel with n K slices


def skinny_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= SKINNY_MAX_ROWS
            and x.shape[1] == w.shape[1] and _triton() is not None)


@functools.cache
def _skinny_kernel():
    triton, tl = _triton()

    @triton.jit
    def skinny_linear_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                             sxm, sxk, swn, swk, sym, syn, K_SLICE: tl.constexpr, SLICES: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (j, s): columns j * BLOCK_N ..., K from s * K_SLICE (a multiple of BLOCK_K) for K_SLICE. The
        # slicing is constexpr: a `for` over a runtime bound is what Triton's interpreter cannot run (and the
        # pipeliner wants a `for`).
        j = tl.program_id(0)
        s = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = j * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SLICE, BLOCK_K):
            kk = s * K_SLICE + k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            b = tl.load(w_ptr + kk[:, None] * swk + rn[None, :] * swn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                        other=0.0)
            acc += tl.dot(a, b)
        ymask = (rm[:, None] < M) & (rn[None, :] < N)
        y_at = y_ptr + rm[:, None] * sym + rn[None, :] * syn
        if SLICES == 1:
            tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=ymask)
        else:
            part_at = part_ptr + rm[:, None] * N + rn[None, :]
            tl.store(part_at + s * M * N, acc, mask=ymask)
            tl.debug_barrier()                      # every thread's partial is written before the count says so
            done = tl.atomic_add(count_ptr + j, 1, sem="acq_rel")
            if done == SLICES - 1:                  # the last slice of this column tile: sum all, in slice order
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for t in range(0, SLICES):
                    total += tl.load(part_at + t * M * N, mask=ymask, other=0.0, cache_modifier=".cg")
                tl.store(y_at, total.to(y_ptr.dtype.element_ty), mask=ymask)
                tl.atomic_xchg(count_ptr + j, 0)    # ready for the next call (and the next CUDA-graph replay)

    return skinny_linear_kernel


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, part_elements: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partials and zeroed tile counters, one pair per size, kept for the process's life: a captured CUDA
    graph holds their addresses (so they are made before any capture, by the first call of a shape)."""
    key = (device, part_elements, tiles)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: first call of a shape inside a CUDA-graph capture (run it once first)")
        ws = (torch.empty(part_elements, dtype=torch.float32, device=device),
              torch.zeros(tiles, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def skinny_linear(x: torch.Tensor, w: torch.Tensor, slices: int = 1) -> torch.Tensor:
    """F.linear(x, w) for x [M, K] (M <= SKINNY_MAX_ROWS), w [N, K], x's dtype, with K cut into up to `slices`
    slices (a multiple of BLOCK_K each); fp32 sums, rounded once."""
    triton, _ = _triton()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    k_slice = triton.cdiv(triton.cdiv(K, max(1, slices)), SKINNY_BLOCK_K) * SKINNY_BLOCK_K
    slices = triton.cdiv(K, k_slice)
    tiles = triton.cdiv(N, SKINNY_BLOCK_N)
    part, counts = _workspace(x.device, slices * M * N, tiles) if slices > 1 else (y, y)
    _skinny_kernel()[(tiles, slices)](
        x, w, y, part, counts, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        K_SLICE=k_slice, SLICES=slices, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=SKINNY_BLOCK_N,
        BLOCK_K=SKINNY_BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y


def slice_counts(n: int, k: int, sms: int) -> list[int]:
    """The K splits worth measuring for an [n, k] weight on `sms` SMs: none, and the power of two that first gives
    two programs an SM while a slice keeps at least two BLOCK_K steps (each is a kernel build at load)."""
    tiles = -(-n // SKINNY_BLOCK_N)
    most = max(1, k // (2 * SKINNY_BLOCK_K))
    s = 1
    while s < most and tiles * s < 2 * sms:
        s *= 2
    return sorted({1, min(s, most)})


# (device, M, N, K, dtype, strides) -> the chosen implementation's name, and what each candidate measured (us)
CHOSEN: dict[tuple, str] = {}
MEASURED: dict[tuple, dict[str, float]] = {}
# A choice decides the last bits of a result, so it is kept: measured once per GPU model, toolchain and shape, and
# read back by every later load (the same artifact gives the same outputs from run to run on a machine), in
# $DEEPINFER_CACHE/cuda_linear_choices.json. A kernel must win by this much to be chosen over cuBLAS.
CHOICES_FILE = "cuda_linear_choices.json"
MARGIN = 0.05


def candidates(x: torch.Tensor, w: torch.Tensor) -> dict[str, object]:
    out = {"cublas": _cublas}
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for s in slice_counts(w.shape[0], w.shape[1], sms):
        out[f"triton/{s}"] = functools.partial(skinny_linear, slices=s)
    return out


def choose(cands: dict[str, object], x: torch.Tensor, w: torch.Tensor, time_us) -> tuple[str, dict[str, float]]:
    """The fastest candidate (by `time_us(call, w)`, `call(w)` one call on weight w) of those whose result is
    F.linear's within bf16 rounding, if it beats cuBLAS by MARGIN; cuBLAS otherwise, and when a candidate fails to
    build or run."""
    ref = reference_linear(x, w)
    tol = 1e-2 * ref.abs().amax().item() + 1e-3
    times: dict[str, float] = {}
    for name, fn in cands.items():
        try:
            got = fn(x, w)
            if got.shape != ref.shape or not (got.float() - ref).abs().amax().item() <= tol:
                times[name] = float("nan")        # wrong: never chosen (and the table says so)
                continue
            times[name] = time_us(lambda wi, fn=fn: fn(x, wi), w)
        except Exception as e:  # Triton's build errors have no common base
            if isinstance(e, torch.AcceleratorError):
                raise
            times[name] = float("inf")
    ok = {n: t for n, t in times.items() if t == t and t != float("inf")}
    best = min(ok, key=ok.get) if ok else "cublas"
    if "cublas" in ok and ok[best] > ok["cublas"] * (1 - MARGIN):
        best = "cublas"
    return best, times


def reference_linear(x: torch.Tensor, w: torch.Tensor, columns: int = 4096) -> torch.Tensor:
    """F.linear in fp32, the weight widened a slice of columns at a time (a whole fp32 copy of a head is GBs)."""
    return torch.cat([torch.nn.functional.linear(x.float(), w[i:i + columns].float())
                      for i in range(0, w.shape[0], columns)], dim=1)


def _choice_key(key: tuple) -> str:
    triton, _ = _triton()
    device, rows, n, k, dtype, xs, ws = key
    return (f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|triton {triton.__version__}|"
            f"{rows}x{n}x{k}|{dtype}|x{list(xs)}|w{list(ws)}")


def _choices_path():
    from ..common.toolchain import default_cache_dir
    return default_cache_dir() / CHOICES_FILE


def _saved_choices() -> dict[str, str]:
    import json
    try:
        data = json.loads(_choices_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_choice(key: str, name: str) -> None:
    """Merged into the file (several processes may write it), replaced atomically; a cache that cannot be written
    only costs the next load a measurement."""
    import json
    import os
    import tempfile
    path = _choices_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_saved_choices(), key: name}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def graph_time_us(call, w: torch.Tensor, reps: int = 24, rounds: int = 3) -> float:
    """One call's device time, from `reps` calls replayed as one CUDA graph (launch costs out, as in the engine's
    replayed steps; timed eagerly, Triton's Python launches would lose every comparison), the best of `rounds`
    replays. The calls cycle through copies of the weight that together pass twice the L2 cache, so each reads
    its weight from memory as a decode step does (one weight called again and again would sit in L2)."""
    l2 = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 64 << 20)
    nbytes = w.numel() * w.element_size()
    copies = [w] + [w.clone() for _ in range(min(reps, -(-2 * l2 // nbytes)) - 1)]
    for wi in copies[:2]:
        call(wi)                                  # builds, and makes any workspace, outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capturing(g):                           # a CaptureFailed: choose() leaves that candidate out
        for i in range(reps):
            call(copies[i % len(copies)])
    g.replay()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    del g, copies
    return best


def linear_for(x: torch.Tensor, w: torch.Tensor):
    """The implementation of F.linear(x, w) for this shape on this device: the one measured on this GPU model before
    (CHOICES_FILE), else measured at this first call (outside a CUDA-graph capture; inside one, cuBLAS without
    recording a choice), or as DEEPINFER_SKINNY_LINEAR says."""
    mode = skinny_mode()
    if mode == "0":
        return _cublas
    if mode != "auto":
        return functools.partial(skinny_linear, slices=int(mode))
    key = (x.device, x.shape[0], w.shape[0], w.shape[1], x.dtype, x.stride(), w.stride())
    name = CHOSEN.get(key)
    if name is None:
        if _ranks() > 1:
            # Ranks that measured apart could choose apart, and the last bits of a replicated projection must be
            # the same on every rank (expert-parallel ranks route the same tokens): cuBLAS everywhere.
            name = "cublas"
        else:
            cands = candidates(x, w)
            saved = _saved_choices().get(_choice_key(key))
            if saved in cands:
                name = saved
            elif torch.cuda.is_current_stream_capturing():
                return _cublas
            else:
                name, MEASURED[key] = choose(cands, x, w, graph_time_us)
                _save_choice(_choice_key(key), name)
        CHOSEN[key] = name
    if name == "cublas":
        return _cublas
    return functools.partial(skinny_linear, slices=int(name.split("/")[1]))


def _cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def _ranks() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def skinny_mode() -> str:
    """DEEPINFER_SKINNY_LINEAR: auto (default), 0, or a positive number of K slices; anything else is refused."""
    import os
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode != "auto" and not (mode.isdigit() and (mode == "0" or int(mode) >= 1)):
        from ..common.errors import OptionError
        raise OptionError(f"{MODE_ENV}={os.environ.get(MODE_ENV)!r} must be auto, 0 (cuBLAS only) or a number of "
                          f"K slices for the Triton kernel")
    return mode
