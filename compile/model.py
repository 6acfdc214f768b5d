"""DeepSeek-V3 as traceable, static-shape region functions over explicit weight tensors.

Legend: T tokens in the step, R block-table rows (T in decode steps, 1 in prefill chunks),
B blocks per row, bs block size, C = B*bs context, H heads, D hidden, E local experts,
K experts per token, I expert intermediate size, Dc = kv_lora_rank + qk_rope_head_dim.

Weights are inputs, never constants: one graph serves every layer and every rank. No host syncs,
no branches on data: everything a branch could depend on is static in `RegionSpec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from ..common.manifest import DECODE, DENSE_LAYER, EMBED, HEAD, MOE_DENSE, MOE_LAYER
from ..common.model_config import ModelConfig
from ..runtime import ops  # noqa: F401  (registers torch.ops.deepinfer.grouped_mm, rows_linear, paged_mla_decode)
from ..runtime.cuda_kernels import MAX_ROWS as GPU_KERNEL_MAX_ROWS
from ..runtime.ops import KERNEL_MAX_ROWS_PER_GROUP, MARK_CONTINUE, MARK_PARTS, PREFILL_BF16_MIN_WORK

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RegionSpec:
    """The static facts one compiled graph bakes in."""

    model: ModelConfig
    region: str
    kind: str                  # decode | prefill
    tokens: int                # T
    context: int               # C (attention regions only)
    block_size: int
    cp: int = 1
    ep: int = 1
    world: int = 1
    capacity: int = 0          # prefill MoE on the static path: tokens one local expert takes at most
    moe_path: str = "dense"    # grouped (exact, any T) | static paths: dense | gather (decode), capacity (prefill)
    logit_rows: int = 0        # head graphs: rows of logits (T in decode buckets; 1, or one per packed prompt)
    small_gemm_rows: int = 0   # CPU: linears over at most this many rows take a small-GEMM form (`linear`)
    dtype: str = "float32"     # activations (the weight matrices may be stored narrower: `as_compute`)
    bf16_products: bool = False  # CPU, --matmul-dtype bfloat16: multi-row products read bf16 operands (`linear`)
    fp32_result_bmm: bool = False  # cuda: decode scores from bf16 operands in one GEMM with fp32 results (`scores_bmm`)
    region_marks: bool = False   # --region-marks: timing points between a layer's parts (`mark`)
    shared_groups: int = 0     # --shared-experts grouped: this rank's shared experts, as groups after its routed ones

    @property
    def cpu_forms(self) -> bool:
        """CPU graphs (the cpu and eager backends): small-GEMM forms and the ops of the hand-written CPU kernels."""
        return self.small_gemm_rows > 0

    @property
    def local_experts(self) -> int:
        """Routed experts on this rank."""
        return self.model.n_routed_experts // self.ep

    @property
    def expert_groups(self) -> int:
        """Groups of the experts' weights on this rank: its routed experts, then any shared ones."""
        return self.local_experts + self.shared_groups

    @property
    def rows(self) -> int:
        return self.tokens if self.kind == DECODE else 1

    @property
    def shared_intermediate(self) -> int:
        return self.model.n_shared_experts * self.model.moe_intermediate_size // self.ep


class Comm:
    """Collectives between ranks inside a graph. The single-rank default does nothing."""

    def cp_all_gather(self, x: torch.Tensor) -> torch.Tensor:      # [..] -> [cp, ..]
        return x.unsqueeze(0)

    def ep_all_reduce_sum(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        return x

    def ep_all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x


SINGLE_RANK = Comm()


class WorldComm(Comm):
    """Functional collectives over the whole world, traced into the graph (the group is baked in by name:
    the default group, which every rank creates first, so one graph serves every rank).

    CP and EP groups smaller than the world are served by world collectives too: ranks r and r + cp hold the
    same KV shard, so the first cp gathered partials are a complete set; for EP only the first EP group's
    partial sums count (rank.ep_weight is 1 there, 0 elsewhere)."""

    def __init__(self, world: int, cp: int, ep: int, marks: bool = False):
        self.world, self.cp, self.ep, self.marks = world, cp, ep, marks

    def _timed(self, collective: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """--region-marks: a mark before the collective (the work so far belongs to the attention or MoE the
        collective sits in: the next mark of those closes it) and one after it (the collective, waiting for the
        other ranks included)."""
        if not self.marks:
            return collective(x)
        y = collective(torch.ops.deepinfer.region_mark(x, MARK_CONTINUE))
        return torch.ops.deepinfer.region_mark(y, MARK_PARTS.index("collectives"))

    def cp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol
        g = self._timed(lambda t: funcol.all_gather_tensor(t, 0, dist.group.WORLD), x.contiguous())
        return g.view(self.world, *x.shape)[: self.cp]

    def ep_all_reduce_sum(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol
        if self.ep < self.world:
            x = x * w["rank.ep_weight"]
        return self._timed(lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD), x)

    def ep_all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol
        return self._timed(lambda t: funcol.all_reduce(t, "max", dist.group.WORLD), x)


def comm_for(spec: "RegionSpec") -> Comm:
    return WorldComm(spec.world, spec.cp, spec.ep, spec.region_marks) if spec.world > 1 else SINGLE_RANK


def mark(spec: RegionSpec, x: torch.Tensor, part: str) -> torch.Tensor:
    """--region-marks: x, after a timing point that closes the layer's `part` (runtime/ops.py `region_mark`);
    without the option x itself, and the graph is as it always was."""
    return torch.ops.deepinfer.region_mark(x, MARK_PARTS.index(part)) if spec.region_marks else x


# -- basic ops ---------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, dr/2], as transformers computes them (fp32, scaled, then cast)."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    return (freqs.cos() * attention_factor).to(dtype), (freqs.sin() * attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim of x; cos/sin broadcast to x[..., :dr/2]."""
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# The CPU prefill's expansion of bf16 latents through the grouped kernel's bf16 dot products (`mla_attention`) from
# this kv_lora_rank (the kernel's K) on: at the demo model's 64 it ran 0.987x the fp32 GEMM of the widened operands
# (fp32 latents with bf16 weights through its fp32 form 0.97x there, 1.00x at `mid`'s 256: those keep the GEMM).
EXPAND_DOT_MIN_RANK = 128


def as_compute(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A weight in x's dtype: bfloat16 weights meet float32 activations this way (--weight-dtype bfloat16 on
    the CPU). Where the cast feeds a reduction (the one-row multiply-sum, gathered experts), Inductor fuses it
    into the loads, so the weight streams at half the bytes; the kernels' ops take bf16 weights as they are."""
    return w if w.dtype == x.dtype else w.to(x.dtype)


def bf16_on_cpu(spec: RegionSpec, x: torch.Tensor) -> bool:
    """A CPU graph with bf16 activations (--dtype bfloat16), whose products must not be torch's bf16 GEMMs: on CPUs
    without bf16 dot products those run 30-70x under the fp32 rate (the demo model's 256-token prefill chunk 123 ms
    against 12 in fp32). Its linears and experts go through the kernels' ops, which take torch's bf16 GEMM only
    where the CPU has bf16 dot products and elsewhere the fp32 path on the widened operands, rounded once (what
    bf16 hardware computes); its gathered experts and decode attention compute in fp32 on bf16 inputs, its prefill
    attention as with bf16 products (`mla_attention`)."""
    return spec.cpu_forms and x.dtype == torch.bfloat16


def linear(spec: RegionSpec, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for x [M, K], w [N, K], in the form the CPU runs fastest for few rows (M up to
    `spec.small_gemm_rows`; 0 elsewhere). MKL's sgemm with a small M and a transposed weight runs far below both
    its FLOP and its memory peak. One row: a multiply-sum that Inductor compiles into one vectorised reduction
    streaming the weight (weights 0.5-64 MB, out of cache: 19-25 GB/s where MKL reads 13-18), and from
    ROWS_LINEAR_MIN_WEIGHT elements up `deepinfer::rows_linear`, whose kernel prefetches the weight ahead of its
    reads (a 2-core AMX Xeon VM: the `mid` head in bf16 1.17-1.42 against 1.78 ms, 24-29 against 19 GB/s;
    fp32 2.27-2.46 against 2.61-3.01 ms, the AVX2 form included). 2..M rows, any weight: `rows_linear` too, the
    hand-written kernel where it runs: 1.3-1.9x MKL's (w @ x.T).T on the `mid` model's projections, head and
    MLP, and 1.2-2.9x at the demo model's small weights (2-32 rows; bf16 weights read as they are, where MKL
    needs them widened first by a copy kernel). Small weights took (w @ x.T).T here while the op's call cost
    tens of microseconds (its Python body); with its C++ implementation all of them through the op made the demo
    model's 16-sequence decode step 1.07-1.23x faster (8 interleaved rounds, one process). More rows (prefill
    chunks): F.linear, or from ROWS_LINEAR_MIN_WEIGHT up `rows_linear` too, which takes the kernel where its
    AVX-512 form runs (1.05-1.15x MKL at 256 rows, and bf16 weights widen in registers instead of in a copy) and
    MKL's F.linear elsewhere. On the `mid` benchmark model (2 threads): decode at batch 1 26-29 -> 18-19
    ms/token, at batch 16 the dense layer 11.3 -> 7.3 ms and the head 19.2 -> 11.4 ms (before rows_linear)."""
    if x.shape[0] == 1 and spec.small_gemm_rows:
        if w.numel() >= ROWS_LINEAR_MIN_WEIGHT:
            return torch.ops.deepinfer.rows_linear(x, w)
        return (as_compute(w, x) * x).sum(-1)[None]
    if spec.bf16_products and x.shape[0] > 1 and w.dtype == torch.bfloat16:
        return bf16_linear(spec, x, w)
    if bf16_on_cpu(spec, x):        # every product through the op, which picks the bf16 GEMM's form at run time
        return torch.ops.deepinfer.rows_linear(x, as_compute(w, x))
    if spec.small_gemm_rows and (x.shape[0] <= spec.small_gemm_rows or w.numel() >= ROWS_LINEAR_MIN_WEIGHT):
        return torch.ops.deepinfer.rows_linear(x, w)
    return F.linear(x, as_compute(w, x))


def bf16_linear(spec: RegionSpec, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """--matmul-dtype bfloat16 (CPU, bf16 weights): F.linear over 2+ rows with the rows rounded to bf16, the products
    summed in fp32 (what bf16 dot-product hardware does: AVX512-BF16, AMX), the result rounded to bf16 and widened
    back; norms, softmax, routing, the residual stream and the KV pool stay fp32. Where the CPU has bf16 dot
    products this runs 2-3x the fp32 FLOP rate (oneDNN for prefill chunks, the kernel for few rows); one-row
    products stay exact fp32 (memory-bound: bf16 operands would not make them faster). Every such product goes
    through `deepinfer::rows_linear`, whose CPU implementation picks the form at run time: the kernel for few
    rows, oneDNN's bf16 GEMM for more where the CPU has bf16 dot products, and without them the fp32 path on the
    widened rows (exact products of the same operands: torch's bf16 GEMM there runs 3-4x under the fp32 rate)."""
    xb = x.to(torch.bfloat16)
    if spec.small_gemm_rows:
        return torch.ops.deepinfer.rows_linear(xb, w).to(x.dtype)
    return F.linear(xb, w).to(x.dtype)


# From this many weight elements up, a CPU one-row linear, and a prefill chunk's, goes to `deepinfer::rows_linear`
# (the hand-written kernel, runtime/ops.py); below it a one-row product fused into Inductor's kernels (no call at
# all) is as fast, and a chunk's MKL GEMM is.
ROWS_LINEAR_MIN_WEIGHT = 1 << 18


def swiglu(spec: RegionSpec, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) with gate and up stacked as one [2I, D] weight."""
    g, u = linear(spec, x, gate_up).chunk(2, dim=-1)
    return linear(spec, F.silu(g) * u, down)


# -- MLA attention -----------------------------------------------------------------------------
def mla_attention(spec: RegionSpec, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, kv_cache: torch.Tensor, w: Weights, comm: Comm,
                  context_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed multi-head latent attention over the paged latent pool; writes this step's KV in place.

    x [T, D] (already normed) -> [T, D]. kv_cache [NB + 1, bs, Dc]; the last block is the trash block
    that padding tokens and KV this CP rank does not own are written to. A prefill chunk packs several
    sequences: its one table row is their block lists back to back, and a token attends to the keys from its
    own sequence's first slot (`context_starts` [T]) up to its own position.
    """
    m = spec.model
    T, H = x.shape[0], m.num_attention_heads
    dn, dr, kvr = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    bs = spec.block_size

    # q_proj (or q_a_proj) and kv_a_proj_with_mqa as one GEMM: one weight pass a layer over the same rows
    qkv = linear(spec, x, w["attn.q_kv_a_proj"])
    qa = m.q_a_rows
    if m.q_lora_rank is None:
        q = qkv[:, :qa]
    else:
        q = linear(spec, rms_norm(qkv[:, :qa], w["attn.q_a_layernorm"], 1e-6), w["attn.q_b_proj"])
    q = q.reshape(T, H, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]

    kv = qkv[:, qa:]                                                             # [T, kvr + dr]
    c_kv = rms_norm(kv[:, :kvr], w["attn.kv_a_layernorm"], 1e-6)
    cos, sin = rope_cos_sin(positions, w["rope.inv_freq"], m.rope_attention_factor, x.dtype)
    q_pe = apply_rope(q_pe, cos[:, None, :], sin[:, None, :], m.rope_interleave)
    k_pe = apply_rope(kv[:, kvr:], cos, sin, m.rope_interleave)

    # Write this step's latent KV first, so a token also attends to the tokens before it in this step.
    trash = kv_cache.shape[0] - 1
    cp_rank = w["rank.cp_rank"] if spec.cp > 1 else None
    block = torch.div(slot_mapping, bs, rounding_mode="floor")
    owned = _owned(block, slot_mapping >= 0, spec.cp, cp_rank)
    local_block = torch.where(owned, _local_block(block, spec.cp), trash)
    offset = torch.where(owned, slot_mapping % bs, 0)
    latent = torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype)              # [T, Dc]
    # Indexed by (block, offset), not through a flat view of the pool: torch 2.11's Inductor (the cuda backend's
    # torch.compile, and AOTInductor on the CPU alike) does not write through the view in place, but copies the
    # whole pool twice a layer (2 of the 6.5 ms of a V2-Lite-size decode step on the H200); torch 2.13 handles both.
    kv_cache.index_put_((local_block, offset), latent)

    # Each row's pool blocks, in key order (the trash block where this CP rank owns none): [R, B].
    tbl_owned = _owned(block_tables, block_tables >= 0, spec.cp, cp_rank)    # [R, B]
    tbl = torch.where(tbl_owned, _local_block(block_tables, spec.cp), trash)
    key_pos = torch.arange(spec.context, device=x.device)
    if context_starts is None:
        valid = key_pos[None, :] <= positions[:, None]                       # [T, C]
    else:
        rel = key_pos[None, :] - context_starts[:, None]                     # key position within the token's sequence
        valid = (rel >= 0) & (rel <= positions[:, None])
    if spec.cp > 1:
        valid = valid & tbl_owned.repeat_interleave(bs, dim=1)              # R broadcasts (1 or T)

    mask = ~valid[:, None, :]                                                 # [T, 1, C]
    if spec.kind == DECODE:
        # Absorbed: fold W_UK into q, score against the latent cache, apply W_UV after the softmax.
        # (`bf16_on_cpu`: the absorptions and the attention in fp32, as the other backends' scores are, below)
        wide = bf16_on_cpu(spec, x)
        if spec.cpu_forms:
            # One grouped product over the heads, fp32 sums of the operands as they are (bf16 dot products for bf16
            # queries and weights, no widened copy of the weight a step): `mid` widths, 16 rows, 19-40 us against
            # 61-77 for the fp32 bmm of widened operands (runtime/ops.py `head_linear`)
            q_lat = torch.ops.deepinfer.head_linear(q_nope.transpose(0, 1), w["attn.w_uk"]).transpose(0, 1)
        else:
            qn, wq = (q_nope.float(), w["attn.w_uk"].float()) if wide else (q_nope, as_compute(w["attn.w_uk"], x))
            q_lat = torch.einsum("thd,hcd->thc", qn, wq)
        q_abs = torch.cat([q_lat, q_pe.float() if wide else q_pe], dim=-1)                # [T, H, Dc]
        if spec.cpu_forms:
            # The paged decode attention op: the CPU kernel reads only each token's valid keys, where they lie in
            # the pool (no [T, C, Dc] gather of the whole bucket, no [T, H, C] scores round trip). `mid` model,
            # 16 tokens, C = 512 bucket, MoE layer: 60 keys valid 11.4-11.9 -> 8.6-9.1 ms, all 500 10.5-12.5 ->
            # 9.3-9.8 ms; demo model 1.0-1.2 -> 0.5-0.6 and 1.0-1.1 -> 0.6-0.8 ms.
            o_lat, lse = torch.ops.deepinfer.paged_mla_decode(q_abs, kv_cache, tbl, valid, kvr, m.softmax_scale)
            if spec.cp > 1:
                o_lat = _merge_partials(o_lat, lse[..., None], comm)
        else:
            ctx = kv_cache[tbl].flatten(1, 2)                                             # [T, C, Dc]
            # fp32 scores: each is a dot product over the whole latent (kv_lora_rank + rope dims) of large terms;
            # rounded to bf16 they moved first-token logprobs by up to 1.3 against transformers in fp32 (V2-Lite
            # widths, 3 layers, random weights: 3 of 8 prompts), in fp32 by at most 0.04 (transformers' bf16: 0.65)
            # On the GPU one GEMM reads the bf16 operands as they are and writes fp32 (the same sums): widened
            # operands took cuBLAS's fp32 FFMA kernel, 52 us a layer on the H200 (1.4 of a 5.7 ms batch-1 step).
            scores = (torch.ops.deepinfer.scores_bmm(q_abs, ctx.transpose(1, 2)) if spec.fp32_result_bmm
                      else torch.bmm(q_abs.float(), ctx.float().transpose(1, 2)))         # [T, H, C]
            scores = scores.mul(m.softmax_scale).masked_fill(mask, float("-inf"))
            c_ctx = ctx[..., :kvr]
            o_lat = _attend(spec, scores, lambda p: torch.bmm(p.to(c_ctx.dtype), c_ctx).float(), comm)
        if spec.cpu_forms:         # the fp32 latent output against the weights as stored, as the queries' product
            o = torch.ops.deepinfer.head_linear(o_lat.transpose(0, 1), w["attn.w_uv"]).transpose(0, 1).to(x.dtype)
        else:
            ol, wv = (o_lat.float(), w["attn.w_uv"].float()) if wide else (o_lat.to(x.dtype), as_compute(w["attn.w_uv"], x))
            o = torch.einsum("thc,hvc->thv", ol, wv)
            if wide:
                o = o.to(x.dtype)
    else:
        # Prefill chunk: expand the packed context's latents to per-head keys and values once (cheaper than
        # the absorbed form when many queries share one context, and transformers' own form). Head-major
        # [H, T, C] scores from one bmm over the whole qk head (the shared rope key broadcast to every head):
        # 1.5-1.6x faster than token-major scores from two einsums (compiled, 2 threads, T = 256).
        # --matmul-dtype bfloat16, here (context parallelism; one rank takes the kernel below): these four products
        # read bf16 operands too (the latents, the queries, the probabilities rounded once; fp32 sums rounded to
        # bf16, as transformers' bf16 attention): `mid` benchmark model, 256-token chunk, 2 threads on a Zen 5 VM:
        # these products 1.5 -> 0.5 ms a layer against this form in fp32 (14 ms of the chunk's 78 before).
        # They go through deepinfer::bf16_einsum, which takes torch's bf16 GEMM only where the CPU has bf16 dot
        # products and the fp32 GEMM of the widened operands elsewhere (the same sums): baked in as bf16 GEMMs they
        # ran 30-70x under the fp32 rate on an AVX2 CPU (the demo model's 256-token chunk 13 -> 65 ms).
        bf16 = spec.bf16_products and w["attn.w_uk"].dtype == torch.bfloat16
        # bf16 products, and `bf16_on_cpu` where the kernel path below does not run (context parallelism), through
        # the op that picks the bf16 GEMM's form at run time
        narrow = bf16 or bf16_on_cpu(spec, x)
        mm = (lambda eq, a, b: torch.ops.deepinfer.bf16_einsum(eq, a, b)) if narrow else torch.einsum
        ctx = kv_cache[tbl[0]].flatten(0, 1)                                             # [C, Dc]
        if spec.cpu_forms and spec.cp == 1:
            # The CPU prefill attention op: each block of queries scored against only the keys it sees (the
            # causal half of the bucket is never computed), token-major throughout. The demo model's 256-token
            # chunk: attention 0.68 -> 0.27 ms a layer (2 threads, Zen 3). With bf16 products or bf16 activations
            # (`bf16_on_cpu`) it takes bf16 queries, keys and values (the keys and values expanded by bf16 products;
            # bf16 GEMMs over long spans where the CPU has bf16 dot products, else its fp32 form on the widened
            # values: runtime/csrc/prefill_attention.cpp). Against the bf16 graph form below (scores and weighted
            # sums as bf16 GEMMs over the whole bucket, Inductor's softmax between), `mid` widths, compiled, 2
            # threads on a Zen 4 VM, the latents' expansion included, with the kernel's fp32 form alone: a
            # 256-token chunk 1.13x faster over 256 keys, 1.6x over 512, a 1024-token chunk over 2048 keys 2.1x
            # (its bf16 GEMMs 1.5x more there).
            # bf16 activations keep bf16 only where a block's keys can reach the kernel's bf16 GEMMs: over shorter
            # contexts the fp32 form on values widened here ran faster (the demo model's 256-token chunk 1.05x, a
            # 480-token prompt 1.05x).
            pooled = ctx                           # the latents as the pool holds them (bf16 with bf16 activations)
            if (x.dtype == torch.bfloat16 and not bf16
                    and ctx.shape[0] * (dn + dr + m.v_head_dim) < PREFILL_BF16_MIN_WORK):
                ctx, q_nope, q_pe = ctx.float(), q_nope.float(), q_pe.float()
            c_ctx, k_pe_ctx = ctx[:, :kvr], ctx[:, kvr:]
            q = torch.cat([q_nope, q_pe], dim=-1)                                            # [T, H, dn + dr]
            if bf16 or ctx.dtype == torch.bfloat16:
                c16, k_pe_ctx, q = c_ctx.to(torch.bfloat16), k_pe_ctx.to(torch.bfloat16), q.to(torch.bfloat16)
                k_nope = mm("cl,hld->chd", c16, w["attn.w_uk"])                            # [C, H, dn]
                v = mm("cl,hvl->chv", c16, w["attn.w_uv"])                                 # [C, H, dv]
            elif pooled.dtype == w["attn.w_uk"].dtype == torch.bfloat16 and kvr >= EXPAND_DOT_MIN_RANK:
                c_lat = pooled[:, :kvr]
                # bf16 activations over short contexts: fp32 keys and values from the bf16 latents and weights as
                # they are, one product each over all heads (the heads' weights stacked as one [H * d, kvr] linear)
                # through the grouped kernel: fp32 sums of the exact products, with bf16 dot products where the CPU
                # has them, instead of the fp32 GEMM of widened operands (the same sums). `mid` widths, 256 keys:
                # 225 us against 536; the `mid-bf16` 256-token chunk 1.027x, 16 prompts' first tokens 1.026x.
                uk = w["attn.w_uk"].transpose(1, 2).reshape(1, H * dn, kvr)
                k_nope = torch.ops.deepinfer.head_linear(c_lat[None], uk)[0].view(-1, H, dn)
                v = torch.ops.deepinfer.head_linear(c_lat[None], w["attn.w_uv"].reshape(1, H * m.v_head_dim, kvr))
                v = v[0].view(-1, H, m.v_head_dim)
            else:
                k_nope = torch.einsum("cl,hld->chd", c_ctx, as_compute(w["attn.w_uk"], c_ctx))
                v = torch.einsum("cl,hvl->chv", c_ctx, as_compute(w["attn.w_uv"], c_ctx))
            k = torch.cat([k_nope, k_pe_ctx[:, None, :].expand(-1, H, dr)], dim=-1)         # [C, H, dn + dr]
            starts = torch.zeros_like(positions) if context_starts is None else context_starts
            o = torch.ops.deepinfer.prefill_attention(q, k, v, starts, positions, m.softmax_scale).to(x.dtype)
            return linear(spec, o.reshape(T, -1), w["attn.o_proj"])
        if bf16:
            ctx = ctx.to(torch.bfloat16)
        c_ctx, k_pe_ctx = ctx[:, :kvr], ctx[:, kvr:]                                   # the pool is in x's dtype
        k_nope = mm("cl,hld->hcd", c_ctx, as_compute(w["attn.w_uk"], c_ctx))             # [H, C, dn]
        k = torch.cat([k_nope, k_pe_ctx[None].expand(H, -1, dr)], dim=-1)              # [H, C, dn + dr]
        v = mm("cl,hvl->hcv", c_ctx, as_compute(w["attn.w_uv"], c_ctx))                  # [H, C, dv]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)                             # [H, T, dn + dr]
        if narrow:
            q = q.to(torch.bfloat16)
            scores = mm("htd,hcd->htc", q, k)
            weighted = lambda p: mm("htc,hcv->htv", p.to(v.dtype), v).float()           # noqa: E731
        else:
            scores = torch.bmm(q, k.transpose(1, 2))                                     # [H, T, C]
            weighted = lambda p: torch.bmm(p.to(v.dtype), v).float()                     # noqa: E731
        scores = scores.float().mul(m.softmax_scale).masked_fill(mask.transpose(0, 1), float("-inf"))
        o = _attend(spec, scores, weighted, comm)                                        # [H, T, dv]
        o = o.transpose(0, 1).to(x.dtype)
    return linear(spec, o.reshape(T, -1), w["attn.o_proj"])


def _attend(spec: RegionSpec, scores: torch.Tensor, weighted_values, comm: Comm) -> torch.Tensor:
    """softmax(scores) applied to the values, [.., C] -> [.., X] fp32 (decode token-major [T, H, C], prefill
    head-major [H, T, C]). With CP: partial attention over this rank's keys, then one packed fp32 all-gather of
    (output, log-sum-exp) and an exact merge."""
    if spec.cp == 1:
        return weighted_values(torch.softmax(scores, dim=-1))
    return _merge_partials(*ops.partial_softmax(scores, weighted_values), comm)


def _merge_partials(o: torch.Tensor, lse: torch.Tensor, comm: Comm) -> torch.Tensor:
    """CP: each rank's attention over its own keys, o [.., X] with its log-sum-exp lse [.., 1] (-inf: no keys
    here) -> the exact attention over all keys, after one packed fp32 all-gather."""
    packed = comm.cp_all_gather(torch.cat([o, lse], dim=-1))                 # [cp, T, H, X + 1]
    o_all, lse_all = packed[..., :-1], packed[..., -1:]
    m_all = lse_all.amax(dim=0, keepdim=True)
    m_all = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    wgt = torch.exp(lse_all - m_all)
    return (o_all * wgt).sum(0) / wgt.sum(0).clamp_min(1e-30)


def _owned(block: torch.Tensor, real: torch.Tensor, cp: int, cp_rank: torch.Tensor | None) -> torch.Tensor:
    """KV ownership over CP ranks: global block b lives on CP rank b % cp, at local block b // cp."""
    if cp == 1:
        return real
    return real & (block % cp == cp_rank)


def _local_block(block: torch.Tensor, cp: int) -> torch.Tensor:
    return block if cp == 1 else torch.div(block, cp, rounding_mode="floor")


# -- MoE -----------------------------------------------------------------------------------------
def route(m: ModelConfig, x: torch.Tensor, w: Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores, correction bias for the choice only, group-limited top-k. -> ids [T, K], weights [T, K] fp32."""
    T = x.shape[0]
    scores = F.linear(x.float(), w["moe.router_weight"].float()).sigmoid()   # [T, E_all]
    choice = scores + w["moe.router_bias"].float()
    if m.topk_group < m.n_group:
        per_group = m.n_routed_experts // m.n_group
        group_scores = choice.view(T, m.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(T, m.n_group, per_group).reshape(T, -1)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=m.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * m.routed_scaling_factor


def experts_dense(spec: RegionSpec, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  w: Weights) -> torch.Tensor:
    """Every local expert on every token, weighted by the gate (zero for experts not chosen). -> [T, D] fp32."""
    local_ids = w["rank.expert_ids"]                                         # [E] global ids held here
    combine = ((ids[:, :, None] == local_ids[None, None, :]) * weights[:, :, None]).sum(1)   # [T, E]
    E, F2, D = w["moe.experts_gate_up"].shape
    gu = linear(spec, x, w["moe.experts_gate_up"].reshape(E * F2, D)).view(-1, E, F2).transpose(0, 1)  # [E, T, 2I]
    g, u = gu.chunk(2, dim=-1)
    y = torch.einsum("eti,edi->etd", F.silu(g) * u, as_compute(w["moe.experts_down"], x))  # [E, T, D]
    return torch.einsum("etd,te->td", y.float(), combine)


def experts_gather(spec: RegionSpec, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   w: Weights) -> torch.Tensor:
    """Only the chosen experts' weights are read: T*K gathered matvecs (best when T*K < E)."""
    T, K = ids.shape
    E = spec.local_experts
    local = ids - w["rank.expert_ids"][0]
    mine = (local >= 0) & (local < E)
    idx = torch.where(mine, local, torch.zeros_like(local)).reshape(-1)       # [T*K]
    xc = x.float() if bf16_on_cpu(spec, x) else x      # fp32 products
    xk = xc[:, None, :].expand(T, K, x.shape[-1]).reshape(T * K, -1, 1)
    gu = torch.bmm(as_compute(w["moe.experts_gate_up"][idx], xc), xk).squeeze(-1)   # [T*K, 2I]
    g, u = gu.chunk(2, dim=-1)
    y = torch.bmm(as_compute(w["moe.experts_down"][idx], xc), (F.silu(g) * u)[:, :, None]).squeeze(-1)   # [T*K, D]
    coef = torch.where(mine, weights, torch.zeros_like(weights)).reshape(-1, 1)
    return (y.float() * coef).view(T, K, -1).sum(1)


def experts_capacity(spec: RegionSpec, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     w: Weights, real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Capacity-grouped experts: each local expert takes at most `capacity` tokens, in token order.
    Padding tokens (real == False) take no capacity: their outputs are discarded anyway.

    -> (out [T, D] fp32, overflow [] bool). When any expert overflows, `out` is missing the dropped
    tokens' contributions and the caller must rerun the layer's MoE on the dense path.
    """
    T, K = ids.shape
    E, Cap, D = spec.local_experts, spec.capacity, x.shape[-1]
    local = (ids - w["rank.expert_ids"][0]).reshape(-1)                      # [T*K], token-major
    mine = (local >= 0) & (local < E)
    if real is not None:
        mine = mine & real[:, None].expand(T, K).reshape(-1)
    onehot = F.one_hot(torch.where(mine, local, torch.zeros_like(local)), E) * mine[:, None]   # [T*K, E]
    slot = ((torch.cumsum(onehot, dim=0) - 1) * onehot).sum(-1)              # place in its expert's queue
    overflow = (onehot.sum(0) > Cap).any()
    keep = mine & (slot < Cap)
    dest = torch.where(keep, local * Cap + slot, torch.full_like(local, E * Cap))   # E*Cap: the drop row
    token = torch.arange(T, device=x.device).repeat_interleave(K)
    table = torch.zeros(E * Cap + 1, dtype=torch.long, device=x.device).index_put((dest,), token)
    xd = x[table[: E * Cap]].view(E, Cap, D)
    g, u = torch.bmm(xd, as_compute(w["moe.experts_gate_up"], x).transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(g) * u, as_compute(w["moe.experts_down"], x).transpose(1, 2))      # [E, Cap, D]
    y = torch.cat([y.reshape(E * Cap, D).float(), torch.zeros(1, D, device=x.device)], dim=0)
    coef = torch.where(keep, weights.reshape(-1), torch.zeros_like(weights.reshape(-1)))
    out = (y[dest] * coef[:, None]).view(T, K, D).sum(1)
    return out, overflow


def experts_grouped(spec: RegionSpec, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w: Weights, real: torch.Tensor | None = None) -> torch.Tensor:
    """Exact grouped experts: the (token, choice) pairs routed to this rank's experts, sorted by expert, go
    through one grouped GEMM per projection; each pair is computed once and nothing can overflow. Pairs of other
    ranks' experts and of padding tokens sort last and are not computed. With the shared experts as groups
    (spec.shared_groups) every token also has a pair with each of this rank's. -> [T, D] fp32."""
    T, K = ids.shape
    E, D = spec.local_experts, x.shape[-1]
    local = (ids - w["rank.expert_ids"][0]).reshape(-1)                      # [T*K], token-major
    mine = (local >= 0) & (local < E)
    if spec.shared_groups:   # every token's pairs go on with one per local shared expert (groups E.., weight 1)
        S = spec.shared_groups
        local = torch.cat([local.view(T, K), torch.arange(E, E + S, device=x.device).expand(T, S)], 1).reshape(-1)
        mine = torch.cat([mine.view(T, K), torch.ones(T, S, dtype=torch.bool, device=x.device)], 1).reshape(-1)
        weights = torch.cat([weights, torch.ones(T, S, dtype=weights.dtype, device=x.device)], 1)
        K, E = K + S, E + S
    if real is not None:
        mine = mine & real[:, None].expand(T, K).reshape(-1)
    group = torch.where(mine, local, torch.full_like(local, E))              # E: not computed here
    order = torch.argsort(group, stable=True)                                # pairs sorted by expert
    counts = F.one_hot(group, E + 1).sum(0)[:E]
    offs = torch.cumsum(counts, 0).to(torch.int32)                           # [E] row ends
    xs = x[torch.div(order, K, rounding_mode="floor")]                       # [T*K, D] each pair's token
    wgu, wd = w["moe.experts_gate_up"], w["moe.experts_down"]
    bf16 = spec.bf16_products and wgu.dtype == torch.bfloat16 and x.dtype != torch.bfloat16
    if bf16:                  # --matmul-dtype bfloat16: bf16 operands, fp32 sums, bf16 results (`bf16_linear`)
        g, u = torch.ops.deepinfer.grouped_mm(xs.to(torch.bfloat16), wgu.transpose(1, 2), offs).float().chunk(2, dim=-1)
        y = torch.ops.deepinfer.grouped_mm((F.silu(g) * u).to(torch.bfloat16), wd.transpose(1, 2), offs)
    else:
        g, u = torch.ops.deepinfer.grouped_mm(xs, wgu.transpose(1, 2), offs).chunk(2, dim=-1)
        y = torch.ops.deepinfer.grouped_mm(F.silu(g) * u, wd.transpose(1, 2), offs)  # [T*K, D]
    # Back to token-major order by gathering each pair's row (the inverse permutation), so that the gather, the
    # routing weights and the sum over a token's choices fuse into one pass over y: one gather a choice, summed
    # as K terms. (A scatter into a [T*K, D] buffer and a second pass to sum it took 2-3 passes; one [T*K, D]
    # gather summed over a view's middle dimension Inductor writes out whole first, fp32, and reads back: 1.45x
    # slower at 256 tokens x 4 choices x 1024 wide, in cache.) Rows past the last group are masked, not
    # multiplied: their values are unspecified.
    inv = torch.empty_like(order).index_put((order,), torch.arange(T * K, device=x.device)).view(T, K)
    coef = torch.where(mine.view(T, K), weights, torch.zeros((), device=x.device))    # token-major
    out = None
    for k in range(K):
        yk = torch.where(mine.view(T, K)[:, k, None], y[inv[:, k]].float() * coef[:, k, None],
                         torch.zeros((), device=x.device))
        out = yk if out is None else out + yk
    return out


def shared_in_grouped(spec: RegionSpec) -> bool:
    """Whether a grouped-path graph runs its shared experts as pairs of its grouped GEMMs: unless they would tip the
    GEMM off the kernel its routed pairs take (the pairs counted on average over the EP ranks; fixed at compile
    time, so by the AVX2 kernel's bounds on every CPU).
    - CPU: the hand-written few-rows kernel takes up to KERNEL_MAX_ROWS_PER_GROUP rows a group on average
      (runtime/ops.py). A 256-token prefill chunk's shared experts, the whole chunk's rows each, tipped the demo
      model's routed experts onto MKL's GEMM per group (prefill 1.77x transformers' rate against 2.2-2.3x before).
    - GPU: the Triton kernel takes up to GPU_KERNEL_MAX_ROWS rows (runtime/cuda_kernels.py); past them
      torch._grouped_mm, which the routed pairs alone might not have needed (DeepSeek-V3, top-8 and one shared
      expert, at 32 tokens: 256 pairs, 288 with it)."""
    m = spec.model
    routed = spec.tokens * m.num_experts_per_tok // spec.ep
    pairs = routed + spec.tokens * spec.shared_groups
    if spec.cpu_forms:
        return pairs <= KERNEL_MAX_ROWS_PER_GROUP * spec.expert_groups
    return pairs <= GPU_KERNEL_MAX_ROWS or routed > GPU_KERNEL_MAX_ROWS


def moe(spec: RegionSpec, x: torch.Tensor, w: Weights, comm: Comm, path: str,
        real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed + shared experts of one layer, summed over EP ranks. x [T, D] normed -> ([T, D], overflow). Shared
    experts as groups of the experts' weights (`spec.shared_groups`) are more pairs of every token on the grouped
    path (`shared_in_grouped`), and elsewhere their own MLPs on slices of those weights."""
    m = spec.model
    ids, weights = route(m, x, w)
    overflow = torch.zeros((), dtype=torch.bool, device=x.device)
    shared = []              # (gate_up, down) of each shared MLP that is not pairs of the grouped GEMM
    if not spec.shared_groups:
        shared = [(w["moe.shared_gate_up"], w["moe.shared_down"])] if m.n_shared_experts else []
    elif not (path == "grouped" and shared_in_grouped(spec)):
        # apart, on slices of the groups' weights (on the CPU at batch 1 the gathered path with them as more pairs
        # ran 0.92-0.95x, demo model)
        E, gu, dn = spec.local_experts, w["moe.experts_gate_up"], w["moe.experts_down"]
        shared = [(gu[g], dn[g]) for g in range(E, spec.expert_groups)]
        w = dict(w, **{"moe.experts_gate_up": gu[:E], "moe.experts_down": dn[:E]})
        spec = replace(spec, shared_groups=0)
    if path == "grouped":
        routed = experts_grouped(spec, x, ids, weights, w, real)
    elif path == "capacity":
        routed, overflow = experts_capacity(spec, x, ids, weights, w, real)
    elif path == "gather":
        routed = experts_gather(spec, x, ids, weights, w)
    else:
        routed = experts_dense(spec, x, ids, weights, w)
    for gate_up, down in shared:
        routed = routed + swiglu(spec, x, gate_up, down).float()
    out = comm.ep_all_reduce_sum(routed, w) if spec.ep > 1 else routed
    if path == "capacity" and spec.ep > 1:
        overflow = comm.ep_all_reduce_max(overflow.to(torch.int32)) > 0
    return out.to(x.dtype), overflow


# -- regions -------------------------------------------------------------------------------------
def embed_region(spec: RegionSpec, token_ids: torch.Tensor, w: Weights) -> torch.Tensor:
    e = F.embedding(token_ids, w["embed"])
    dt = getattr(torch, spec.dtype)
    return e if e.dtype == dt else e.to(dt)


def layer_region(spec: RegionSpec, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, kv_cache: torch.Tensor, w: Weights, comm: Comm = SINGLE_RANK,
                 context_starts: torch.Tensor | None = None):
    """One decoder layer -> h. MoE layers on the static path in prefill chunks return (h, h_mid, overflow).
    `context_starts` (prefill chunks only): each token's sequence's first slot in the packed context."""
    m = spec.model
    h = hidden + mla_attention(spec, rms_norm(hidden, w["input_layernorm"], m.rms_norm_eps),
                               positions, slot_mapping, block_tables, kv_cache, w, comm, context_starts)
    h = mark(spec, h, "attention")
    x = rms_norm(h, w["post_attention_layernorm"], m.rms_norm_eps)
    if spec.region == DENSE_LAYER:
        return mark(spec, h + swiglu(spec, x, w["mlp.gate_up"], w["mlp.down"]), "mlp")
    # Grouped and capacity paths skip padding rows; dense and gather compute them and the step drops them.
    real = slot_mapping >= 0 if spec.moe_path in ("grouped", "capacity") else None
    out, overflow = moe(spec, x, w, comm, spec.moe_path, real)
    out = mark(spec, h + out, "moe")
    if spec.moe_path != "capacity":
        return out
    # The overflow flag's own mark: nothing else orders its all-reduce (EP) before the MoE's mark.
    return out, h, mark(spec, overflow, "moe")


def moe_dense_region(spec: RegionSpec, h_mid: torch.Tensor, w: Weights, comm: Comm = SINGLE_RANK) -> torch.Tensor:
    """The MoE half of a layer on the dense path: the rerun after a capacity overflow."""
    x = rms_norm(h_mid, w["post_attention_layernorm"], spec.model.rms_norm_eps)
    out, _ = moe(spec, x, w, comm, "dense")
    return mark(spec, h_mid + out, "moe")


def head_region(spec: RegionSpec, hidden: torch.Tensor, logit_indices: torch.Tensor, w: Weights) -> torch.Tensor:
    """Final norm and LM head, only for the tokens whose logits are wanted. -> [L, V] fp32."""
    if spec.small_gemm_rows and spec.tokens == 1:
        # One token, one row: nothing to pick. On the CPU a gather here would be inlined into the one-row
        # multiply-sum's inner loop, bounds check included (mid benchmark head: ~4.3-4.7 vs 3.2-3.6 ms, when its
        # head still took the multiply-sum; a big head now takes rows_linear, a small one still the multiply-sum).
        x = hidden
    else:
        x = hidden[logit_indices]
    return linear(spec, rms_norm(x, w["norm"], spec.model.rms_norm_eps), w["lm_head"]).float()


REGION_FUNCS: dict[str, Callable] = {
    EMBED: embed_region,
    DENSE_LAYER: layer_region,
    MOE_LAYER: layer_region,
    MOE_DENSE: moe_dense_region,
    HEAD: head_region,
}


# -- rope frequencies (computed at compile time, shipped as the weight 'rope.inv_freq') ----------------
def rope_inv_freq(m: ModelConfig) -> torch.Tensor:
    """transformers' default / YaRN inverse frequencies, bit for bit (fp32)."""
    r, dim = m.rope, m.qk_rope_head_dim
    pos_freqs = r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    if r.rope_type == "default":
        return 1.0 / pos_freqs
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (r.factor * pos_freqs)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return inv_inter * (1 - extra_factor) + inv_extra * extra_factor
