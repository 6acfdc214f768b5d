"""Regions x buckets: which graphs an artifact holds, their example inputs, and their export to canonical IR."""

from __future__ import annotations

import contextlib
import hashlib
import io
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..common.manifest import (DECODE, DENSE_LAYER, EMBED, HEAD, MOE_DENSE, MOE_LAYER, PREFILL, CompileConfig,
                               TensorSpec, WeightArg, graph_name)
from ..common.model_config import ModelConfig
from .model import REGION_FUNCS, RegionSpec, comm_for
from .weights import DTYPES, region_weight_keys, weight_source


@dataclass(frozen=True)
class GraphPlan:
    name: str
    spec: RegionSpec
    inputs: tuple[TensorSpec, ...]
    weights: tuple[WeightArg, ...]
    weight_specs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]


def plan_graphs(m: ModelConfig, cc: CompileConfig) -> list[GraphPlan]:
    """Every graph the runtime can need for this model and these buckets, each exactly once."""
    specs: dict[str, RegionSpec] = {}

    def add(region: str, kind: str, tokens: int, context: int = 0, capacity: int = 0, logit_rows: int = 0):
        name = graph_name(region, kind, tokens, context, logit_rows)
        specs.setdefault(name, RegionSpec(m, region, kind, tokens, context, cc.block_size, cc.cp, cc.ep,
                                          cc.world, capacity, moe_path(m, cc, kind, tokens), logit_rows,
                                          small_gemm_rows(cc), cc.dtype, cc.matmul_dtype == "bfloat16",
                                          ir_family(cc.backend) == "cuda", bool(cc.region_marks),
                                          cc.shared_groups(m)))

    layers = ([DENSE_LAYER] if m.num_moe_layers < m.num_hidden_layers else []) + ([MOE_LAYER] if m.num_moe_layers else [])
    for T in cc.decode_buckets:
        add(EMBED, DECODE, T)
        for C in cc.context_buckets:
            for region in layers:
                add(region, DECODE, T, C)
        add(HEAD, DECODE, T, logit_rows=T)
    grouped = cc.moe_path == "grouped"
    for T, cap in zip(cc.prefill_buckets, cc.moe_capacity or (0,) * len(cc.prefill_buckets)):
        add(EMBED, PREFILL, T)
        for C in cc.context_buckets:
            if C >= T:
                for region in layers:
                    add(region, PREFILL, T, C, cap)
        if m.num_moe_layers and not grouped:
            add(MOE_DENSE, PREFILL, T)
        add(HEAD, PREFILL, T, logit_rows=1)
        if cc.prefill_seqs(T) > 1:       # a chunk that packs several prompts samples each one's last token
            add(HEAD, PREFILL, T, logit_rows=cc.prefill_seqs(T))
        if T > 1:                        # prompt logprobs (echo + logprobs): logits of every row of the chunk
            add(HEAD, PREFILL, T, logit_rows=T)
    return [_plan(name, spec, cc) for name, spec in specs.items()]


# CPU linears over at most this many rows take a small-GEMM form (`compile.model.linear`).
CPU_SMALL_GEMM_ROWS = 64


def ir_family(backend: str) -> str:
    """Backends that trace the same graphs: `eager` runs exactly what `cpu` compiles; cuda and neuron make their
    own choices (the decode MoE form, GEMM operand order)."""
    return "cpu" if backend in ("cpu", "eager") else backend


def small_gemm_rows(cc: CompileConfig) -> int:
    return CPU_SMALL_GEMM_ROWS if ir_family(cc.backend) == "cpu" else 0


def moe_path(m: ModelConfig, cc: CompileConfig, kind: str, tokens: int) -> str:
    """Which MoE form a graph bakes in.

    Static path: prefill chunks capacity-grouped; a decode bucket dense (every local expert read once) or
    gathered (one expert per (token, choice)), whichever reads fewer weights. Grouped path: every bucket grouped,
    except CPU decode buckets with fewer (token, choice) pairs than local experts, which are gathered: there the
    gathered form compiles to one fused gather-matvec that reads each chosen expert once, faster than grouped at
    T=1 (demo model 1.2-1.7 vs 1.8-2.1 ms/token; `mid` benchmark model 2.5 vs 3.4 ms per MoE layer). From as
    many pairs as experts up, grouped beats dense on the CPU since its op runs without Python: at T=16 one MoE
    layer of the demo model (0.2 MFLOP a row) 0.49-0.59 -> 0.30-0.37 ms, of `mid` (3.1 MFLOP a row) 79-88 vs
    61-69 tok/s at 16 sequences (when dense was still chosen for small experts: the op's Python body cost
    20-65 us a call). Where the hand-written kernels cannot load (not x86-64 AVX2, no compiler), the op's Python
    body runs and small experts would be faster dense; the graph's form is fixed at compile time."""
    if cc.moe_path == "grouped" and (kind == PREFILL or ir_family(cc.backend) != "cpu"):
        return "grouped"
    if kind == PREFILL:
        return "capacity"
    if cc.moe_decode_path != "auto":
        return cc.moe_decode_path
    if tokens * m.num_experts_per_tok < m.n_routed_experts // cc.ep:
        return "gather"
    return "grouped" if cc.moe_path == "grouped" else "dense"


def _plan(name: str, spec: RegionSpec, cc: CompileConfig) -> GraphPlan:
    m, T = spec.model, spec.tokens
    dt = cc.dtype
    D = m.hidden_size
    i64 = "int64"
    if spec.region == EMBED:
        inputs = [TensorSpec("token_ids", (T,), i64)]
        outputs = ("hidden",)
    elif spec.region == HEAD:
        L = spec.logit_rows
        inputs = [TensorSpec("hidden", (T, D), dt), TensorSpec("logit_indices", (L,), i64)]
        outputs = ("logits",)
    elif spec.region == MOE_DENSE:
        inputs = [TensorSpec("h_mid", (T, D), dt)]
        outputs = ("hidden",)
    else:
        B = spec.context // spec.block_size
        inputs = [TensorSpec("hidden", (T, D), dt), TensorSpec("positions", (T,), i64),
                  TensorSpec("slot_mapping", (T,), i64), TensorSpec("block_tables", (spec.rows, B), i64),
                  TensorSpec("kv_cache", (cc.kv_blocks_per_rank + 1, cc.block_size, m.kv_cache_dim), dt)]
        if spec.kind == PREFILL:       # packed sequences: each token's sequence's first slot in the chunk's context
            inputs.append(TensorSpec("context_starts", (T,), i64))
        outputs = (("hidden", "h_mid", "overflow") if spec.region == MOE_LAYER and spec.moe_path == "capacity"
                   else ("hidden",))
    keys = region_weight_keys(m, spec.region, cc.cp, cc.ep, cc.world, bool(cc.shared_experts_grouped))
    shapes = _weight_shapes(m, cc)
    return GraphPlan(
        name=name, spec=spec, inputs=tuple(inputs),
        weights=tuple(WeightArg(k, weight_source(m, k), *shapes[k]) for k in keys),
        weight_specs=tuple(TensorSpec(k, *shapes[k]) for k in keys),
        outputs=outputs)


def _weight_shapes(m: ModelConfig, cc: CompileConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shapes of a region's weight keys (one rank's view: local experts, shared-expert slice)."""
    dt, wt = cc.dtype, cc.weights_dtype          # norms in dt, the weight matrices in wt
    D, H = m.hidden_size, m.num_attention_heads
    dn, dr, dv, kvr = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    E, I = m.n_routed_experts // cc.ep, m.moe_intermediate_size
    Is = m.n_shared_experts * I // cc.ep
    G = E + cc.shared_groups(m)                  # the experts' weights: routed, then shared ones grouped
    s = {
        "embed": ((m.vocab_size, D), wt), "norm": ((D,), dt), "lm_head": ((m.vocab_size, D), wt),
        "rope.inv_freq": ((dr // 2,), "float32"), "rank.expert_ids": ((E,), "int64"), "rank.cp_rank": ((), "int64"),
        "rank.ep_weight": ((), "float32"),
        "input_layernorm": ((D,), dt), "post_attention_layernorm": ((D,), dt),
        "attn.q_kv_a_proj": ((m.q_a_rows + kvr + dr, D), wt), "attn.kv_a_layernorm": ((kvr,), dt),
        "attn.w_uk": ((H, kvr, dn), wt), "attn.w_uv": ((H, dv, kvr), wt), "attn.o_proj": ((D, H * dv), wt),
        "mlp.gate_up": ((2 * m.intermediate_size, D), wt), "mlp.down": ((D, m.intermediate_size), wt),
        "moe.router_weight": ((m.n_routed_experts, D), "float32"), "moe.router_bias": ((m.n_routed_experts,), "float32"),
        "moe.experts_gate_up": ((G, 2 * I, D), wt), "moe.experts_down": ((G, D, I), wt),
        "moe.shared_gate_up": ((2 * Is, D), wt), "moe.shared_down": ((D, Is), wt),
    }
    if m.q_lora_rank is not None:
        qr = m.q_lora_rank
        s |= {"attn.q_a_layernorm": ((qr,), dt),
              "attn.q_b_proj": ((H * (dn + dr), qr), wt)}
    return s


class RegionModule(torch.nn.Module):
    """A region as an nn.Module for torch.export: step tensors positionally, weights as one dict."""

    def __init__(self, spec: RegionSpec):
        super().__init__()
        self.spec = spec
        self.comm = comm_for(spec)
        self.fn = REGION_FUNCS[spec.region]

    def forward(self, *args):
        *step, weights = args
        if self.spec.region in (EMBED, HEAD):
            return self.fn(self.spec, *step, weights)
        # layers: hidden, positions, slot_mapping, block_tables, kv_cache [, context_starts (prefill)]
        return self.fn(self.spec, *step[:5], weights, self.comm, *step[5:])


def example_inputs(plan: GraphPlan, device: str = "cpu") -> tuple:
    """Example tensors for tracing (call under FakeTensorMode for shape-only compiles)."""
    def make(t: TensorSpec) -> torch.Tensor:
        dtype = DTYPES[t.dtype]
        if dtype.is_floating_point:
            return torch.zeros(t.shape, dtype=dtype, device=device)
        return torch.zeros(t.shape, dtype=dtype, device=device)
    step = tuple(make(t) for t in plan.inputs)
    weights = {w.name: make(w) for w in plan.weight_specs}
    return (*step, weights)


@contextlib.contextmanager
def traced_world(world: int):
    """Collectives are traced against a fake process group of the layout's world size (no peers needed).
    The default group is named '0' here and in every real run, which is the name the graphs bake in."""
    import torch.distributed as dist
    if world == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        if dist.get_world_size() == world and dist.get_backend() == "fake":
            yield
            return
        raise RuntimeError("a real process group is initialized in the compiling process")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def export_graph(plan: GraphPlan) -> tuple[torch.export.ExportedProgram, bytes]:
    """Trace one region at one bucket with fake tensors. -> (program, canonical serialized bytes)."""
    with traced_world(plan.spec.world), FakeTensorMode(allow_non_fake_inputs=False):
        args = example_inputs(plan)
        ep = torch.export.export(RegionModule(plan.spec), args, strict=False)
    # Fake example inputs do not serialize portably (the manifest records the shapes instead); AOTInductor
    # still needs them, so they are put back after saving.
    example, ep._example_inputs = ep._example_inputs, None
    for node in ep.graph.nodes:      # source locations are machine paths: not part of a graph's identity
        node.meta.pop("stack_trace", None)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    ep._example_inputs = example
    return ep, buf.getvalue()


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()
