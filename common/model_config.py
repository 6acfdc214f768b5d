"""The DeepSeek-V3 model configuration, parsed and validated from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, shown


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: 'default' or 'yarn' (DeepSeek-V3's own), in transformers' semantics."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything the graphs need to know about the model. DeepSeek's names are kept."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_nextn_predict_layers: int = 1          # transformers' default too
    checkpoint_dtype: str = "bfloat16"
    fp8_block_size: tuple[int, ...] | None = None

    # -- derived -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_a_rows(self) -> int:
        """Rows of the query's projection of the layer input: q_proj's (every head's qk dims), or q_a_proj's (the
        q LoRA rank); the first rows of the stacked `attn.q_kv_a_proj` weight."""
        return self.num_attention_heads * self.qk_head_dim if self.q_lora_rank is None else self.q_lora_rank

    @property
    def kv_cache_dim(self) -> int:
        """Width of one latent KV cache row: the compressed KV plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """transformers' DeepseekV3Attention.scaling, YaRN's mscale_all_dim correction included."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """The factor transformers multiplies into cos/sin (YaRN's attention_factor; 1.0 otherwise)."""
        r = self.rope
        if r.rope_type != "yarn":
            return 1.0
        if r.attention_factor is not None:
            return r.attention_factor
        if r.mscale and r.mscale_all_dim:
            return float(yarn_get_mscale(r.factor, r.mscale) / yarn_get_mscale(r.factor, r.mscale_all_dim))
        return yarn_get_mscale(r.factor)

    def param_counts(self) -> dict[str, int]:
        """Parameter counts per part, for memory plans and roofline numbers."""
        D, H = self.hidden_size, self.num_attention_heads
        if self.q_lora_rank is None:
            q = D * H * self.qk_head_dim
        else:
            q = D * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * self.qk_head_dim
        attn = (q + D * self.kv_cache_dim + self.kv_lora_rank
                + self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim) + H * self.v_head_dim * D)
        norms = 2 * D
        dense_mlp = 3 * D * self.intermediate_size
        expert = 3 * D * self.moe_intermediate_size
        shared = self.n_shared_experts * expert
        router = self.n_routed_experts * D + self.n_routed_experts
        embed = self.vocab_size * D
        head = 0 if self.tie_word_embeddings else self.vocab_size * D
        L, Lm = self.num_hidden_layers, self.num_moe_layers
        Ld = L - Lm
        return {
            "attention": L * (attn + norms),
            "dense_mlp": Ld * dense_mlp,
            "routed_experts": Lm * self.n_routed_experts * expert,
            "shared_experts": Lm * shared,
            "router": Lm * router,
            "embed": embed,
            "head": head + D,
            "active_per_token": L * (attn + norms) + Ld * dense_mlp
            + Lm * (self.num_experts_per_tok * expert + shared + router) + head + D + D,
        }

    # -- parsing -------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        return _parse(cfg, source)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file (a checkpoint directory needs config.json)") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except ValueError as e:        # (a JSONDecodeError, or an integer past int()'s 4300 digits)
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a config") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return _parse(cfg, str(path))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _finite(v: int | float) -> bool:
    """A number float() keeps finite: json reads NaN and Infinity, and a 400-digit integer overflows float()."""
    return abs(v) <= 1e300 if isinstance(v, int) else math.isfinite(v)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# -----------------------------------------------------------------------------
_ARCHITECTURES = {"DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"}


def _parse(cfg: dict[str, Any], source: str) -> ModelConfig:
    def need(name: str, kind: type = int) -> Any:
        if name not in cfg:
            raise ConfigError(f"{source}: missing field '{name}' (required for a DeepSeek-V3 model)")
        return _typed(name, cfg[name], kind)

    def opt(name: str, default: Any, kind: type = int) -> Any:
        v = cfg.get(name, default)
        return default if v is None and default is not None else _typed(name, v, kind) if v is not None else None

    def _typed(name: str, v: Any, kind: type) -> Any:
        if kind is float and isinstance(v, (int, float)) and not isinstance(v, bool):
            if not _finite(v):
                raise ConfigError(f"{source}: field '{name}'={v!r} must be a finite number")
            return float(v)
        if kind is int and isinstance(v, bool) or not isinstance(v, kind):
            raise ConfigError(f"{source}: field '{name}'={shown(repr(v))} must be {kind.__name__}")
        if kind is int and not -2 ** 53 <= v <= 2 ** 53:      # every size is multiplied into float byte counts
            raise ConfigError(f"{source}: field '{name}'={shown(v)} is out of range")
        return v

    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError(f"{source}: field 'architectures'={archs!r} must be a list of class names")
    if model_type not in ("deepseek_v3", None) and not (set(archs) & _ARCHITECTURES):
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not a DeepSeek-V3-shaped model "
            f"(expected model_type 'deepseek_v3' or architectures in {sorted(_ARCHITECTURES)})")

    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{source}: hidden_act={hidden_act!r} is not supported (only 'silu')")
    if cfg.get("attention_bias", False):
        raise ConfigError(f"{source}: attention_bias=true is not supported (DeepSeek-V3 has no attention bias)")
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{source}: scoring_func={scoring!r} is not supported (DeepSeek-V3 routes with 'sigmoid')")
    topk_method = cfg.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"{source}: topk_method={topk_method!r} is not supported (only 'noaux_tc')")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{source}: moe_layer_freq={cfg['moe_layer_freq']!r} is not supported (only 1)")

    H = need("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads")
    # transformers writes num_key_value_heads=128 by default; MLA ignores it. Only refuse a real GQA config.
    del kv_heads

    rope = _parse_rope(cfg, source)
    eos = cfg.get("eos_token_id", None)
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        eos_ids = tuple(eos)
    else:
        raise ConfigError(f"{source}: field 'eos_token_id'={eos!r} must be an int or a list of ints")
    bos = cfg.get("bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):     # was read as "no BOS"
        raise ConfigError(f"{source}: field 'bos_token_id'={bos!r} must be an int")

    fp8_block = None
    ckpt_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    q = cfg.get("quantization_config")
    if q:
        if not isinstance(q, dict):
            raise ConfigError(f"{source}: quantization_config={q!r} must be an object")
        if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{source}: quantization_config={q!r} is not supported (only fp8 e4m3 block scales)")
        bs = q.get("weight_block_size")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise ConfigError(f"{source}: quantization_config.weight_block_size={bs!r} must be two positive ints")
        fp8_block = tuple(bs)
        ckpt_dtype = "float8_e4m3fn"

    # Absent fields take transformers' DeepseekV3Config defaults, so both read the same config.json the same way
    # (the routing fields below cannot be recovered from tensor shapes).
    q_lora = cfg.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = _typed("q_lora_rank", q_lora, int)

    mc = ModelConfig(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"),
        moe_intermediate_size=need("moe_intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=H,
        q_lora_rank=q_lora,
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        n_routed_experts=need("n_routed_experts"),
        num_experts_per_tok=need("num_experts_per_tok"),
        n_shared_experts=opt("n_shared_experts", 1),
        n_group=opt("n_group", 8),
        topk_group=opt("topk_group", 4),
        norm_topk_prob=opt("norm_topk_prob", True, bool),
        routed_scaling_factor=opt("routed_scaling_factor", 2.5, float),
        first_k_dense_replace=opt("first_k_dense_replace", 3),
        rms_norm_eps=opt("rms_norm_eps", 1e-6, float),
        rope=rope,
        rope_interleave=opt("rope_interleave", True, bool),
        tie_word_embeddings=opt("tie_word_embeddings", False, bool),
        max_position_embeddings=opt("max_position_embeddings", 4096),
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        num_nextn_predict_layers=opt("num_nextn_predict_layers", opt("num_mtp_layers", 1)),   # transformers' alias
        checkpoint_dtype=str(ckpt_dtype),
        fp8_block_size=fp8_block,
    )
    validate(mc, source)
    return mc


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    # rope_scaling (the older field) first, as transformers reads a config that has both
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters/rope_scaling={params!r} must be an object")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{source}: per-layer-type rope_parameters are not supported by DeepSeek-V3")
    def number(name: str, v: Any, positive: bool) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or (positive and v <= 0):
            raise ConfigError(f"{source}: field '{name}'={v!r} must be a {'positive' if positive else 'finite'} "
                              f"number")
        return v

    rope_type = params.get("rope_type", params.get("type", "default"))
    # the chosen field's theta, else rope_parameters' (transformers v5 keeps it there), else the top level's
    theta = next((d["rope_theta"] for d in (params, cfg.get("rope_parameters"))
                  if isinstance(d, dict) and d.get("rope_theta") is not None), cfg.get("rope_theta", 10000.0))
    theta = number("rope_theta", theta, positive=True)
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=float(theta))
    if rope_type != "yarn":
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (only 'default' and 'yarn')")
    max_pos = number("max_position_embeddings", cfg.get("max_position_embeddings", 4096), positive=True)
    orig = number("original_max_position_embeddings", params.get(
        "original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos)), positive=True)
    factor = params.get("factor")
    factor = number("factor", max_pos / orig if factor is None else factor, positive=True)
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if params.get(name) is not None:
            number(name, params[name], positive=False)
    for name in ("beta_fast", "beta_slow"):      # (0 or absent: the defaults, 32 and 1)
        if params.get(name) is not None and params[name] < 0:
            raise ConfigError(f"{source}: field '{name}'={params[name]!r} must be >= 0")
    if theta <= 1:      # YaRN's correction range divides by log(rope_theta)
        raise ConfigError(f"{source}: field 'rope_theta'={theta!r} must be above 1 with yarn")
    af = params.get("attention_factor")
    return RopeConfig(
        rope_type="yarn",
        theta=float(theta),
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if af is None else float(af),
        truncate=bool(params.get("truncate", True)),
    )


def validate(mc: ModelConfig, source: str = "config") -> None:
    positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"]
    for name in positive:
        v = getattr(mc, name)
        if v <= 0:
            raise ConfigError(f"{source}: {name}={v} must be positive")
    if mc.q_lora_rank is not None and mc.q_lora_rank <= 0:
        raise ConfigError(f"{source}: q_lora_rank={mc.q_lora_rank} must be positive or null")
    if mc.qk_rope_head_dim % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim={mc.qk_rope_head_dim} must be even")
    if mc.n_routed_experts % mc.n_group:
        raise ConfigError(f"{source}: n_routed_experts={mc.n_routed_experts} is not divisible by n_group={mc.n_group}")
    if mc.topk_group > mc.n_group:
        raise ConfigError(f"{source}: topk_group={mc.topk_group} exceeds n_group={mc.n_group}")
    per_group = mc.n_routed_experts // mc.n_group
    if mc.num_experts_per_tok > mc.topk_group * per_group:
        raise ConfigError(
            f"{source}: num_experts_per_tok={mc.num_experts_per_tok} exceeds the experts in topk_group={mc.topk_group} "
            f"groups of {per_group}")
    if mc.topk_group < mc.n_group and per_group < 2:
        raise ConfigError(f"{source}: group-limited routing needs at least 2 experts per group "
                          f"(n_routed_experts={mc.n_routed_experts}, n_group={mc.n_group})")
    if mc.first_k_dense_replace < 0:
        raise ConfigError(f"{source}: first_k_dense_replace={mc.first_k_dense_replace} must be >= 0")
    if mc.n_shared_experts < 0:
        raise ConfigError(f"{source}: n_shared_experts={mc.n_shared_experts} must be >= 0")
    if mc.rms_norm_eps <= 0:
        raise ConfigError(f"{source}: rms_norm_eps={mc.rms_norm_eps} must be positive")
    for e in mc.eos_token_ids:
        if not 0 <= e < mc.vocab_size:
            raise ConfigError(f"{source}: eos_token_id={e} is outside the vocabulary [0, {mc.vocab_size})")
    if mc.bos_token_id is not None and not 0 <= mc.bos_token_id < mc.vocab_size:
        raise ConfigError(f"{source}: bos_token_id={mc.bos_token_id} is outside the vocabulary [0, {mc.vocab_size})")
    if mc.max_position_embeddings <= 0:
        raise ConfigError(f"{source}: max_position_embeddings={mc.max_position_embeddings} must be positive")
    if mc.num_nextn_predict_layers < 0:
        raise ConfigError(f"{source}: num_nextn_predict_layers={mc.num_nextn_predict_layers} must be >= 0")
