"""Our weight names and shapes per rank, their conversion from Hugging Face tensors, and streaming shards.

Names without a prefix are global ('embed', 'rope.inv_freq', 'rank.expert_ids'); per-layer names are
'layers.{i}.<key>', and a region graph takes them by <key>. Rank tensors ('rank.*') carry the facts that
differ between ranks, so that one graph serves them all.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..common.errors import CheckpointError
from ..common.manifest import DENSE_LAYER, EMBED, HEAD, MOE_DENSE, MOE_LAYER, CompileConfig, RankLayout
from ..common.model_config import ModelConfig
from .checkpoint import Checkpoint
from .model import rope_inv_freq

LAYER_PREFIX = "layers.{layer}."
GLOBAL_KEYS = ("embed", "norm", "lm_head", "rope.inv_freq", "rank.expert_ids", "rank.cp_rank", "rank.ep_weight")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32"}


def attn_keys(m: ModelConfig, cp: int) -> list[str]:
    q_lora = [] if m.q_lora_rank is None else ["attn.q_a_layernorm", "attn.q_b_proj"]
    keys = ["input_layernorm", "attn.q_kv_a_proj", *q_lora, "attn.kv_a_layernorm", "attn.w_uk", "attn.w_uv",
            "attn.o_proj", "post_attention_layernorm", "rope.inv_freq"]
    return keys + (["rank.cp_rank"] if cp > 1 else [])


def moe_keys(m: ModelConfig, ep: int, world: int, shared_grouped: bool = False) -> list[str]:
    keys = ["moe.router_weight", "moe.router_bias", "moe.experts_gate_up", "moe.experts_down", "rank.expert_ids"]
    keys += ["moe.shared_gate_up", "moe.shared_down"] if m.n_shared_experts and not shared_grouped else []
    return keys + (["rank.ep_weight"] if 1 < ep < world else [])


def region_weight_keys(m: ModelConfig, region: str, cp: int, ep: int = 1, world: int = 1,
                       shared_grouped: bool = False) -> list[str]:
    if region == EMBED:
        return ["embed"]
    if region == HEAD:
        return ["norm", "lm_head"]
    if region == DENSE_LAYER:
        return attn_keys(m, cp) + ["mlp.gate_up", "mlp.down"]
    if region == MOE_LAYER:
        return attn_keys(m, cp) + moe_keys(m, ep, world, shared_grouped)
    if region == MOE_DENSE:
        return ["post_attention_layernorm"] + moe_keys(m, ep, world, shared_grouped)
    raise ValueError(region)


def weight_source(m: ModelConfig, key: str) -> str:
    """Where a region's weight key lives in a shard ('{layer}' is filled in by the runtime)."""
    if key == "lm_head" and m.tie_word_embeddings:
        return "embed"
    return key if key in GLOBAL_KEYS else LAYER_PREFIX + key


# -- specs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[Checkpoint | None], torch.Tensor]


def shard_specs(m: ModelConfig, cc: CompileConfig, rank: RankLayout) -> list[WeightSpec]:
    """Every tensor of one rank's shard, in file order, each with the function that builds it."""
    dt, wdt = DTYPES[cc.dtype], DTYPES[cc.weights_dtype]     # norms in dt, the weight matrices in wdt
    f32 = torch.float32
    D, H = m.hidden_size, m.num_attention_heads
    dn, dr, dv, kvr = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    I, E_first, E_last = m.moe_intermediate_size, rank.experts[0], rank.experts[1]
    E = E_last - E_first
    s0, s1 = rank.shared_slice
    S = cc.shared_groups(m)
    specs: list[WeightSpec] = []

    def add(name: str, shape: tuple[int, ...], dtype: torch.dtype, fn: Callable[[Checkpoint], torch.Tensor]):
        specs.append(WeightSpec(name, tuple(shape), dtype, fn))

    def hf(name: str, shape: tuple[int, ...]) -> Callable[[Checkpoint], torch.Tensor]:
        return lambda ck: ck.get(name, shape)

    add("embed", (m.vocab_size, D), wdt, hf("model.embed_tokens.weight", (m.vocab_size, D)))
    add("norm", (D,), dt, hf("model.norm.weight", (D,)))
    if not m.tie_word_embeddings:
        add("lm_head", (m.vocab_size, D), wdt, hf("lm_head.weight", (m.vocab_size, D)))
    add("rope.inv_freq", (dr // 2,), f32, lambda ck: rope_inv_freq(m))
    add("rank.expert_ids", (E,), torch.int64, lambda ck: torch.arange(E_first, E_last, dtype=torch.int64))
    if cc.cp > 1:
        add("rank.cp_rank", (), torch.int64, lambda ck: torch.tensor(rank.cp_rank, dtype=torch.int64))
    if 1 < cc.ep < cc.world:   # only the first EP group's partial sums count in the world all-reduce
        add("rank.ep_weight", (), f32, lambda ck: torch.tensor(1.0 if rank.rank < cc.ep else 0.0))

    for i in range(m.num_hidden_layers):
        p, L = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        add(L + "input_layernorm", (D,), dt, hf(p + "input_layernorm.weight", (D,)))
        add(L + "post_attention_layernorm", (D,), dt, hf(p + "post_attention_layernorm.weight", (D,)))
        # The projections of the layer's input, stacked as one weight (one GEMM a layer instead of two): the query's
        # (q_proj, or q_a_proj with a q LoRA) rows, then kv_a_proj_with_mqa's
        q_name, q_rows = (a + "q_proj.weight", H * (dn + dr)) if m.q_lora_rank is None else \
            (a + "q_a_proj.weight", m.q_lora_rank)
        add(L + "attn.q_kv_a_proj", (q_rows + kvr + dr, D), wdt, lambda ck, q_name=q_name, q_rows=q_rows, a=a: torch.cat(
            [ck.get(q_name, (q_rows, D)), ck.get(a + "kv_a_proj_with_mqa.weight", (kvr + dr, D))]))
        if m.q_lora_rank is not None:
            qr = m.q_lora_rank
            add(L + "attn.q_a_layernorm", (qr,), dt, hf(a + "q_a_layernorm.weight", (qr,)))
            add(L + "attn.q_b_proj", (H * (dn + dr), qr), wdt, hf(a + "q_b_proj.weight", (H * (dn + dr), qr)))
        add(L + "attn.kv_a_layernorm", (kvr,), dt, hf(a + "kv_a_layernorm.weight", (kvr,)))
        kv_b = (a + "kv_b_proj.weight", (H * (dn + dv), kvr))
        # W_UK per head as the absorption's weight [kvr, dn] (q_nope -> latent: F.linear's layout for the decode's
        # grouped kernel); W_UV as kv_b_proj stores it, [dv, kvr] (latent -> value)
        add(L + "attn.w_uk", (H, kvr, dn), wdt,
            lambda ck, kv_b=kv_b: ck.get(*kv_b).view(H, dn + dv, kvr)[:, :dn].transpose(1, 2))
        add(L + "attn.w_uv", (H, dv, kvr), wdt, lambda ck, kv_b=kv_b: ck.get(*kv_b).view(H, dn + dv, kvr)[:, dn:])
        add(L + "attn.o_proj", (D, H * dv), wdt, hf(a + "o_proj.weight", (D, H * dv)))
        if not m.is_moe_layer(i):
            Id = m.intermediate_size
            add(L + "mlp.gate_up", (2 * Id, D), wdt, lambda ck, p=p, Id=Id: torch.cat(
                [ck.get(p + "mlp.gate_proj.weight", (Id, D)), ck.get(p + "mlp.up_proj.weight", (Id, D))]))
            add(L + "mlp.down", (D, Id), wdt, hf(p + "mlp.down_proj.weight", (D, Id)))
            continue
        add(L + "moe.router_weight", (m.n_routed_experts, D), f32, hf(p + "mlp.gate.weight", (m.n_routed_experts, D)))
        add(L + "moe.router_bias", (m.n_routed_experts,), f32,
            hf(p + "mlp.gate.e_score_correction_bias", (m.n_routed_experts,)))
        if S:      # --shared-experts grouped: this rank's shared experts as more groups, after its routed ones
            add(L + "moe.experts_gate_up", (E + S, 2 * I, D), wdt, lambda ck, p=p: torch.cat(
                [_experts_gate_up(ck, p, m, E_first, E_last), _shared_gate_up(ck, p, m, s0, s1)]))
            add(L + "moe.experts_down", (E + S, D, I), wdt, lambda ck, p=p: torch.cat(
                [_experts_down(ck, p, m, E_first, E_last), _shared_down(ck, p, m, s0, s1)]))
            continue
        add(L + "moe.experts_gate_up", (E, 2 * I, D), wdt, lambda ck, p=p: _experts_gate_up(ck, p, m, E_first, E_last))
        add(L + "moe.experts_down", (E, D, I), wdt, lambda ck, p=p: _experts_down(ck, p, m, E_first, E_last))
        if m.n_shared_experts:
            Is = m.n_shared_experts * I
            sh = p + "mlp.shared_experts."
            add(L + "moe.shared_gate_up", (2 * (s1 - s0), D), wdt, lambda ck, sh=sh, Is=Is: torch.cat(
                [ck.get(sh + "gate_proj.weight", (Is, D))[s0:s1], ck.get(sh + "up_proj.weight", (Is, D))[s0:s1]]))
            add(L + "moe.shared_down", (D, s1 - s0), wdt,
                lambda ck, sh=sh, Is=Is: ck.get(sh + "down_proj.weight", (D, Is))[:, s0:s1])
    return specs


def _experts_gate_up(ck: Checkpoint, p: str, m: ModelConfig, e0: int, e1: int) -> torch.Tensor:
    D, I = m.hidden_size, m.moe_intermediate_size
    fused = p + "mlp.experts.gate_up_proj"
    if ck.has(fused):       # transformers' in-memory layout, if a checkpoint was saved that way
        return ck.get(fused, (m.n_routed_experts, 2 * I, D))[e0:e1]
    return torch.stack([torch.cat([ck.get(f"{p}mlp.experts.{e}.gate_proj.weight", (I, D)),
                                   ck.get(f"{p}mlp.experts.{e}.up_proj.weight", (I, D))]) for e in range(e0, e1)])


def _shared_gate_up(ck: Checkpoint, p: str, m: ModelConfig, s0: int, s1: int) -> torch.Tensor:
    """The shared MLP's intermediate slice [s0, s1) as (s1 - s0) / I experts' gate/up weights [S, 2I, D]: the
    shared MLP is the sum of such slices' MLPs, each of a routed expert's shape."""
    D, I, Is = m.hidden_size, m.moe_intermediate_size, m.n_shared_experts * m.moe_intermediate_size
    sh = p + "mlp.shared_experts."
    g, u = (ck.get(sh + name, (Is, D))[s0:s1].view(-1, I, D) for name in ("gate_proj.weight", "up_proj.weight"))
    return torch.cat([g, u], 1)


def _shared_down(ck: Checkpoint, p: str, m: ModelConfig, s0: int, s1: int) -> torch.Tensor:
    """The shared MLP's down projection's columns [s0, s1) as (s1 - s0) / I experts' [S, D, I]."""
    D, I, Is = m.hidden_size, m.moe_intermediate_size, m.n_shared_experts * m.moe_intermediate_size
    down = ck.get(p + "mlp.shared_experts.down_proj.weight", (D, Is))[:, s0:s1]
    return down.reshape(D, -1, I).transpose(0, 1).contiguous()


def _experts_down(ck: Checkpoint, p: str, m: ModelConfig, e0: int, e1: int) -> torch.Tensor:
    D, I = m.hidden_size, m.moe_intermediate_size
    fused = p + "mlp.experts.down_proj"
    if ck.has(fused):
        return ck.get(fused, (m.n_routed_experts, D, I))[e0:e1]
    return torch.stack([ck.get(f"{p}mlp.experts.{e}.down_proj.weight", (D, I)) for e in range(e0, e1)])


def expected_checkpoint_names(m: ModelConfig, ck: Checkpoint) -> set[str]:
    """The tensor names a checkpoint of this config holds; anything else is refused (it would be ignored)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if m.tie_word_embeddings else {"lm_head.weight"})
    for i in range(m.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight",
                  a + "o_proj.weight"}
        names |= {a + "q_proj.weight"} if m.q_lora_rank is None else {
            a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"}
        if not m.is_moe_layer(i):
            names |= {p + f"mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
            continue
        names |= {p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"}
        if ck.has(p + "mlp.experts.gate_up_proj"):
            names |= {p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"}
        else:
            names |= {f"{p}mlp.experts.{e}.{w}.weight" for e in range(m.n_routed_experts)
                      for w in ("gate_proj", "up_proj", "down_proj")}
        if m.n_shared_experts:
            names |= {p + f"mlp.shared_experts.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
    return names


def check_checkpoint(m: ModelConfig, ck: Checkpoint) -> None:
    """Refuse missing and unexpected tensors before any work, naming them."""
    want = expected_checkpoint_names(m, ck)
    have = {n for n in ck.names() if not n.endswith(".weight_scale_inv") and not n.endswith("rotary_emb.inv_freq")}
    missing = sorted(want - have)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{ck.path}: missing tensor '{missing[0]}'{more}, required by its config.json")
    unexpected = sorted(have - want)
    if unexpected:
        raise CheckpointError(f"{ck.path}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all) that this "
                              f"config does not use; refusing rather than ignoring weights")
    for name in sorted(want):
        if ck.shape(name) == ():
            raise CheckpointError(f"{ck.path}: tensor '{name}' is a scalar")


# -- streaming safetensors writer -----------------------------------------------------------------
def write_shard(path: Path, specs: Iterable[WeightSpec], ck: Checkpoint | None,
                metadata: dict[str, str] | None = None, progress: Callable[[str], None] | None = None) -> int:
    """Write a safetensors file one tensor at a time (peak memory: the largest tensor). Returns bytes written."""
    specs = list(specs)
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for s in specs:
        n = _numel(s.shape) * torch.tensor([], dtype=s.dtype).element_size()
        header[s.name] = {"dtype": _ST_DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for s in specs:
            if progress:
                progress(s.name)
            t = s.produce(ck)
            if tuple(t.shape) != s.shape:
                raise CheckpointError(f"weight '{s.name}': built shape {tuple(t.shape)}, expected {s.shape}")
            t = t.to(s.dtype).contiguous().reshape(-1)
            f.write(t.view(torch.uint8).numpy().tobytes())
    return 8 + len(hb) + offset


def shard_bytes(specs: Iterable[WeightSpec]) -> int:
    return sum(_numel(s.shape) * torch.tensor([], dtype=s.dtype).element_size() for s in specs)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
