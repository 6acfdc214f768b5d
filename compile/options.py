"""Compile options: one frozen dataclass, resolved and validated before any work."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import OptionError
from ..common.manifest import CompileConfig, Layout, RankLayout
from ..common.model_config import ModelConfig

BACKENDS = ("cpu", "eager", "cuda", "neuron")
DTYPE_NAMES = ("float32", "bfloat16")
NEURON_TARGETS = ("trn1", "trn2", "inf2")
DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"


@dataclass(frozen=True)
class CompileOptions:
    model: Path
    out: Path
    backend: str = "cpu"
    dtype: str = "float32"
    weight_dtype: str = "auto"           # storage of the weight matrices: auto (below), float32, bfloat16
    matmul_dtype: str = "auto"           # operands of multi-row products: auto (--dtype) or bfloat16 (cpu/eager)
    cp: int = 1
    ep: int = 1
    decode_buckets: tuple[int, ...] = (1, 8)
    prefill_buckets: tuple[int, ...] = (128,)
    context_buckets: tuple[int, ...] | str = "auto"
    context_limit: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    moe_capacity: int | None = None
    capacity_factor: float = 2.0
    moe_decode_path: str = "auto"
    moe_path: str = "auto"               # grouped | static | auto (static on neuron or with --moe-capacity)
    shared_experts: str = "auto"         # grouped | separate | auto (`shared_experts_grouped`)
    shape_only: bool = False
    device_memory: int | None = None     # bytes per rank; refuse layouts that do not fit
    neuron_target: str | None = None
    cache_dir: Path | None = None
    keep_going: bool = False
    jobs: int | None = None              # parallel graph compiles (default: CPU count)
    region_marks: bool = False           # timing points between each layer's parts (DEEPINFER_REGION_TIMING)


def resolve(o: CompileOptions, m: ModelConfig, stored_dtype: str | None = None) -> CompileConfig:
    """Fill defaults from the model and check every rule; raises OptionError naming the flag. `stored_dtype`:
    the checkpoint's weight matrices' dtype where it is not float32 (`Checkpoint.stored_matrix_dtype`)."""
    if o.backend not in BACKENDS:
        raise OptionError(f"--backend={o.backend!r} is not one of {', '.join(BACKENDS)}")
    if o.dtype not in DTYPE_NAMES:
        raise OptionError(f"--dtype={o.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    if o.matmul_dtype not in ("auto", *DTYPE_NAMES):
        raise OptionError(f"--matmul-dtype={o.matmul_dtype!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
    matmul_dtype = None if o.matmul_dtype in ("auto", o.dtype) else o.matmul_dtype
    if matmul_dtype is not None and (o.backend not in ("cpu", "eager") or o.dtype != "float32"
                                     or o.weight_dtype == "float32"):
        raise OptionError(f"--matmul-dtype={o.matmul_dtype} with --dtype={o.dtype} --weight-dtype={o.weight_dtype} "
                          f"--backend={o.backend}: products may differ from --dtype only as bfloat16 products under "
                          f"float32 math, with bfloat16 weights, on the cpu and eager backends")
    weight_dtype = o.weight_dtype
    if weight_dtype == "auto":
        # A bf16 checkpoint on the CPU: keep its matrices bf16 under float32 math (exact, half the memory and
        # the bytes a decode step streams); everything else stores them in --dtype. bf16 products read bf16
        # weights whatever the checkpoint stores.
        bf16_cpu = o.backend in ("cpu", "eager") and o.dtype == "float32" and stored_dtype == "bfloat16"
        weight_dtype = "bfloat16" if bf16_cpu or matmul_dtype else o.dtype
    weight_dtype = None if weight_dtype == o.dtype else weight_dtype
    if weight_dtype is not None:
        if weight_dtype not in DTYPE_NAMES:
            raise OptionError(f"--weight-dtype={o.weight_dtype!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
        if o.backend not in ("cpu", "eager") or (o.dtype, weight_dtype) != ("float32", "bfloat16"):
            raise OptionError(f"--weight-dtype={weight_dtype} with --dtype={o.dtype} --backend={o.backend}: weights "
                              f"may differ from --dtype only as bfloat16 weights with float32 math on the cpu and "
                              f"eager backends (elsewhere pass --dtype alone)")
    if o.backend == "neuron" and o.neuron_target not in NEURON_TARGETS:
        raise OptionError(f"--neuron-target={o.neuron_target!r} must be one of {', '.join(NEURON_TARGETS)} "
                          f"with --backend neuron")
    if o.region_marks and o.backend == "neuron":
        raise OptionError("--region-marks: a Neuron graph runs on the device as one program, with no point where "
                          "the host could take the time; leave it out with --backend neuron")
    if o.backend != "neuron" and o.neuron_target is not None:
        raise OptionError(f"--neuron-target={o.neuron_target} applies to --backend neuron only "
                          f"(this compile's backend is {o.backend})")
    for flag, v in (("--cp", o.cp), ("--ep", o.ep), ("--block-size", o.block_size)):
        if v < 1:
            raise OptionError(f"{flag}={v} must be >= 1")
    world = max(o.cp, o.ep)
    if world % o.cp or world % o.ep:
        raise OptionError(f"--cp={o.cp} and --ep={o.ep} must both divide world=max(cp, ep)={world}")
    if m.n_routed_experts % o.ep:
        raise OptionError(f"n_routed_experts={m.n_routed_experts} is not divisible by --ep={o.ep}")
    shared = m.n_shared_experts * m.moe_intermediate_size
    if shared % o.ep:
        raise OptionError(f"the shared experts' intermediate size {shared} is not divisible by --ep={o.ep}")

    limit = o.context_limit if o.context_limit is not None else min(m.max_position_embeddings, 4096)
    if limit < 1:
        raise OptionError(f"--context-limit={limit} must be >= 1")
    if limit > m.max_position_embeddings:
        raise OptionError(f"--context-limit={limit} exceeds the model's max_position_embeddings="
                          f"{m.max_position_embeddings}")
    if limit % o.block_size:
        given = "--context-limit" if o.context_limit is not None else \
            "the context limit (the model's max_position_embeddings: pass --context-limit)"
        raise OptionError(f"{given}={limit} is not a multiple of --block-size={o.block_size}")

    decode = _buckets("--decode-buckets", o.decode_buckets, limit)
    if not decode:
        raise OptionError("--decode-buckets must name at least one bucket")
    prefill = _buckets("--prefill-buckets", o.prefill_buckets, limit)
    if o.context_buckets == "auto":
        # 256, 1024, 4096, ... below the limit: attention cost follows the sequence, not the limit
        auto, c = [], 256
        while c < limit:
            auto.append(c - c % o.block_size or o.block_size)
            c *= 4
        ctx = tuple(auto)
    else:
        ctx = _buckets("--context-buckets", o.context_buckets, limit)
    for c in ctx:
        if c % o.block_size:
            raise OptionError(f"--context-buckets: {c} is not a multiple of --block-size={o.block_size}")
    ctx = tuple(sorted(set(ctx) | {limit}))

    blocks_per_seq = limit // o.block_size
    nkv = o.num_kv_blocks
    if nkv is None:
        nkv = blocks_per_seq * max(decode)
        nkv = -(-nkv // o.cp) * o.cp
    if nkv < blocks_per_seq:
        raise OptionError(f"--num-kv-blocks={nkv} cannot hold one full-length sequence: context limit {limit} "
                          f"needs {blocks_per_seq} blocks of {o.block_size}")
    if nkv % o.cp:
        raise OptionError(f"--num-kv-blocks={nkv} is not divisible by --cp={o.cp}")

    if not (math.isfinite(o.capacity_factor) and o.capacity_factor > 0):
        raise OptionError(f"--capacity-factor={o.capacity_factor} must be a finite number > 0")
    moe_path = o.moe_path
    if moe_path not in ("auto", "grouped", "static"):
        raise OptionError(f"--moe-path={o.moe_path!r} must be auto, grouped or static")
    path = o.moe_decode_path
    if path not in ("auto", "dense", "gather"):
        raise OptionError(f"--moe-decode-path={o.moe_decode_path!r} must be auto, dense or gather")
    if moe_path == "auto":
        # Neuron has no grouped GEMM: its graphs take the static path (capacity-grouped prefill with a dense
        # rerun on overflow, dense or gathered decode). Elsewhere the exact grouped path, unless a capacity is set.
        moe_path = "static" if o.backend == "neuron" or o.moe_capacity is not None else "grouped"
    elif moe_path == "grouped":
        if o.backend == "neuron":
            raise OptionError("--moe-path grouped needs a grouped GEMM, which the Neuron backend does not have: "
                              "use --moe-path static (or auto)")
        if o.moe_capacity is not None:
            raise OptionError("--moe-capacity: only for --moe-path static (this is --moe-path grouped)")

    shared_grouped = _shared_experts_grouped(o, m, moe_path)

    K, E = m.num_experts_per_tok, m.n_routed_experts
    caps, factor = (), None                      # the grouped path has no capacity
    if moe_path == "static" and o.moe_capacity is not None:
        if o.moe_capacity < 1:
            raise OptionError(f"--moe-capacity={o.moe_capacity} must be >= 1")
        caps = tuple(min(o.moe_capacity, T) for T in prefill)
    elif moe_path == "static":
        caps = tuple(min(T, max(1, math.ceil(o.capacity_factor * T * K / E))) for T in prefill)
        factor = o.capacity_factor

    return CompileConfig(backend=o.backend, dtype=o.dtype, cp=o.cp, ep=o.ep, decode_buckets=decode,
                         prefill_buckets=prefill, context_buckets=ctx, context_limit=limit,
                         block_size=o.block_size, num_kv_blocks=nkv, moe_capacity=caps, capacity_factor=factor,
                         moe_decode_path=path, moe_path=moe_path, neuron_target=o.neuron_target,
                         weight_dtype=weight_dtype, matmul_dtype=matmul_dtype, region_marks=o.region_marks or None,
                         shared_experts_grouped=shared_grouped or None)


def _shared_experts_grouped(o: CompileOptions, m: ModelConfig, moe_path: str) -> bool:
    """Whether the shared experts become groups of the routed experts' grouped GEMMs (--shared-experts).

    Each shared expert is an MLP of the routed experts' shape (moe_intermediate_size), and the shared MLP is their
    sum: its gate/up rows and down columns split into n_shared_experts slices of that size. Grouped, every token's
    pairs include one per shared expert (weight 1), so a MoE layer runs one grouped GEMM a projection where it ran
    that and one GEMM a projection of the shared MLP: on the GPU at batch 1 the shared MLP's were two more M=1
    GEMMs a layer (its weights a third of the layer's bytes). It needs the grouped path (a capacity would have to
    hold every token) and whole shared experts on every EP rank (n_shared_experts divisible by --ep). Graphs on
    other paths (the CPU's gathered decode at batch 1), and grouped graphs whose GEMM they would tip off the
    kernel the routed pairs take (`model.shared_in_grouped`), run them apart, on slices of the same weights. On the CPU
    (demo model, 2 AVX2 cores, the two forms' artifacts taking turns in one process) a 16-sequence decode step ran
    1.04-1.08x faster grouped over three runs of 10-20 rounds; batch 1 the same (1.035x, within noise).
    auto: grouped wherever it can be."""
    if o.shared_experts not in ("auto", "grouped", "separate"):
        raise OptionError(f"--shared-experts={o.shared_experts!r} must be auto, grouped or separate")
    if o.shared_experts == "separate" or not m.n_shared_experts:
        return False
    why = None
    if moe_path != "grouped":
        why = f"it needs the grouped MoE path (this compile's is {moe_path})"
    elif m.n_shared_experts % o.ep:
        why = f"n_shared_experts={m.n_shared_experts} is not divisible by --ep={o.ep} (each rank holds whole ones)"
    if o.shared_experts == "grouped" and why:
        raise OptionError(f"--shared-experts grouped: {why}")
    return why is None


def _buckets(flag: str, values: tuple[int, ...], limit: int) -> tuple[int, ...]:
    for v in values:
        if not isinstance(v, int) or v < 1:
            raise OptionError(f"{flag}: {v!r} is not a positive integer")
        if v > limit:
            raise OptionError(f"{flag}: bucket {v} is larger than the context limit {limit}")
    return tuple(sorted(set(values)))


def make_layout(m: ModelConfig, cc: CompileConfig) -> Layout:
    """Rank r: CP rank r % cp, EP rank r % ep; experts and the shared-expert slice by EP rank."""
    E = m.n_routed_experts // cc.ep
    Is = m.n_shared_experts * m.moe_intermediate_size // cc.ep
    ranks = tuple(RankLayout(rank=r, cp_rank=r % cc.cp, ep_rank=r % cc.ep,
                             experts=((r % cc.ep) * E, (r % cc.ep + 1) * E),
                             shared_slice=((r % cc.ep) * Is, (r % cc.ep + 1) * Is),
                             kv_blocks=cc.kv_blocks_per_rank)
                  for r in range(cc.world))
    return Layout(world=cc.world, cp=cc.cp, ep=cc.ep,
                  kv_ownership="global block b -> cp_rank b % cp, local block b // cp; "
                               "the local pool's last block is the trash block", ranks=ranks)
