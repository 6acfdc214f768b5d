"""Config parsing, checkpoint validation and the errors that name what is wrong."""

from __future__ import annotations

import dataclasses

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.common.errors import CheckpointError, ConfigError, OptionError
from deepinfer.common.model_config import ModelConfig
from deepinfer.compile.checkpoint import Checkpoint
from deepinfer.compile.model import rope_inv_freq
from deepinfer.compile.options import CompileOptions, resolve
from deepinfer.compile.weights import check_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "data"
V3_671B = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "num_nextn_predict_layers": 1, "eos_token_id": 1, "bos_token_id": 0,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def test_deepseek_v3_671b_config_parses():
    m = ModelConfig.from_hf_dict(V3_671B)
    assert m.rope.rope_type == "yarn" and m.rope.factor == 40.0 and m.fp8_block_size == (128, 128)
    assert m.kv_cache_dim == 576 and m.num_moe_layers == 58
    active = m.param_counts()["active_per_token"]
    assert 36e9 < active < 39e9  # DeepSeek-V3: ~37B active parameters


def test_rope_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    # deep copy: transformers' config writes into the rope dict it is given (it adds rope_theta)
    small = dict(copy.deepcopy(V3_671B), hidden_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=1)
    small.pop("quantization_config")
    ours = ModelConfig.from_hf_dict(small)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in small.items() if k not in ("architectures", "model_type")})
    rot = DeepseekV3RotaryEmbedding(hf_cfg)
    assert torch.equal(rope_inv_freq(ours), rot.inv_freq)
    assert ours.rope_attention_factor == pytest.approx(rot.attention_scaling)
    assert ours.softmax_scale == pytest.approx(DeepseekV3Attention(hf_cfg, 0).scaling)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    """A config with both fields (transformers v5 writes rope_parameters; an older rope_scaling added to extend
    the context): transformers reads rope_scaling, and so must we, or the two would run different RoPE."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    small = dict(copy.deepcopy(V3_671B), hidden_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=1,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    small.pop("quantization_config")
    ours = ModelConfig.from_hf_dict(copy.deepcopy(small))
    hf_cfg = DeepseekV3Config(**{k: v for k, v in small.items() if k not in ("architectures", "model_type")})
    rot = DeepseekV3RotaryEmbedding(hf_cfg)
    assert ours.rope.rope_type == "yarn" and torch.equal(rope_inv_freq(ours), rot.inv_freq)
    assert ours.rope_attention_factor == pytest.approx(rot.attention_scaling)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "not a DeepSeek-V3-shaped model"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"n_routed_experts": 250}, "n_routed_experts=250 is not divisible by n_group=8"),
    ({"topk_group": 9}, "topk_group=9 exceeds n_group=8"),
    ({"kv_lora_rank": "512"}, "'kv_lora_rank'='512' must be int"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"rope_scaling": dict(V3_671B["rope_scaling"], mscale="x")}, "'mscale'='x' must be a finite number"),
    ({"rope_scaling": {k: v for k, v in V3_671B["rope_scaling"].items() if k != "original_max_position_embeddings"},
      "original_max_position_embeddings": "4k"}, "'original_max_position_embeddings'='4k'"),
    ({"rope_theta": "1e4"}, "'rope_theta'='1e4' must be a positive number"),
    ({"routed_scaling_factor": float("nan")}, "'routed_scaling_factor'=nan must be a finite number"),
    ({"rms_norm_eps": float("inf")}, "'rms_norm_eps'=inf must be a finite number"),
    ({"routed_scaling_factor": 10 ** 400}, "'routed_scaling_factor'=1000.* must be a finite number"),
    ({"rope_theta": 10 ** 400}, "'rope_theta'=1000.* must be a positive number"),
    ({"quantization_config": ["fp8"]}, "quantization_config=['fp8'] must be an object"),
    ({"bos_token_id": 129280}, "bos_token_id=129280 is outside the vocabulary"),
    ({"bos_token_id": "0"}, "'bos_token_id'='0' must be an int"),                 # was read as no BOS at all
    ({"max_position_embeddings": 0, "rope_scaling": None}, "max_position_embeddings=0 must be positive"),
    ({"model_type": "kimi_k2", "architectures": "DeepseekV3ForCausalLM"}, "must be a list of class names"),
    ({"rope_scaling": dict(V3_671B["rope_scaling"], beta_fast=-1)}, "'beta_fast'=-1 must be >= 0"),  # math error
    ({"rope_theta": 1}, "'rope_theta'=1 must be above 1 with yarn"),                  # was a ZeroDivisionError
])
def test_bad_config_names_the_field(change, message):
    cfg = copy.deepcopy(V3_671B)
    cfg.update(change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_hf_dict(cfg)


def test_absent_optional_fields_read_as_transformers_reads_them():
    """Routing fields cannot be recovered from tensor shapes: an absent one must mean what it means to
    transformers' DeepseekV3Config, or the two would route the same checkpoint differently."""
    from transformers import DeepseekV3Config
    optional = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace",
                "n_shared_experts", "q_lora_rank", "rms_norm_eps", "rope_interleave", "tie_word_embeddings",
                "num_nextn_predict_layers")
    cfg = {k: v for k, v in V3_671B.items() if k not in optional}
    ours, hf = ModelConfig.from_hf_dict(cfg), DeepseekV3Config()
    for k in optional:
        assert getattr(ours, k) == getattr(hf, k), k


def test_unreadable_config_file_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000)
    with pytest.raises(ConfigError, match="config.json: nested too deeply"):      # was a RecursionError
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(dict(V3_671B, vocab_size=10 ** 400)))
    with pytest.raises(ConfigError, match=r"'vocab_size'=10000000000000000000\.\.\.\(401 characters\) is out of range"):
        ModelConfig.from_file(tmp_path / "config.json")     # was an OverflowError in the memory plan
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": "\xd0\x00"}')
    with pytest.raises(ConfigError, match="config.json: not UTF-8 text"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json: cannot be read"):
        ModelConfig.from_file(tmp_path / "dir" / "config.json")


def test_transformers_alias_of_the_mtp_layer_count_is_read():
    cfg = {k: v for k, v in V3_671B.items() if k != "num_nextn_predict_layers"}
    assert ModelConfig.from_hf_dict(dict(cfg, num_mtp_layers=2)).num_nextn_predict_layers == 2
    assert ModelConfig.from_hf_dict(dict(cfg, num_mtp_layers=2, num_nextn_predict_layers=0)).num_nextn_predict_layers == 0


def test_missing_field_is_named():
    cfg = dict(V3_671B)
    del cfg["kv_lora_rank"]
    with pytest.raises(ConfigError, match="missing field 'kv_lora_rank'"):
        ModelConfig.from_hf_dict(cfg)


def _copy(ck: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(ck, dst)
    return dst


def _edit_tensors(path: Path, fn) -> None:
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    ck = _copy(checkpoints["base"], tmp_path)
    _edit_tensors(ck, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    c = Checkpoint(ck)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"):
        check_checkpoint(c.config, c)


def test_wrong_shape_is_named(checkpoints, tmp_path):
    ck = _copy(checkpoints["base"], tmp_path)
    _edit_tensors(ck, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 60)}))
    c = Checkpoint(ck)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.o_proj.weight' has shape \(64, 60\)"):
        c.get("model.layers.0.self_attn.o_proj.weight", (64, 64))


def test_unexpected_tensor_is_refused_but_mtp_layer_is_skipped(checkpoints, tmp_path):
    ck = _copy(checkpoints["base"], tmp_path)
    _edit_tensors(ck, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(4, 4)}))   # MTP layer
    c = Checkpoint(ck)
    check_checkpoint(c.config, c)
    assert c.skipped == ["model.layers.3.eh_proj.weight"] and "no MTP lookahead" in c.notes[0]
    _edit_tensors(ck, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    c = Checkpoint(ck)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        check_checkpoint(c.config, c)


def test_layers_past_the_config_are_refused_not_skipped(checkpoints, tmp_path):
    """Only the num_nextn_predict_layers layers after the model's are multi-token prediction: a config with fewer
    layers than its checkpoint must not run a truncated model."""
    ck = _copy(checkpoints["base"], tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    (ck / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers - 1, num_nextn_predict_layers=0)))
    with pytest.raises(CheckpointError, match=rf"belongs to layer {layers - 1}, past the model's {layers - 1} layers"):
        Checkpoint(ck)
    (ck / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers - 1, num_nextn_predict_layers=1)))
    assert Checkpoint(ck).skipped and all(n.startswith(f"model.layers.{layers - 1}.") for n in Checkpoint(ck).skipped)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_non_float_weight_is_refused(checkpoints, tmp_path, dtype):
    ck = _copy(checkpoints["base"], tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    _edit_tensors(ck, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(CheckpointError, match=rf"'{name}' is stored as {str(dtype).removeprefix('torch.')}"):
        Checkpoint(ck).get(name)


def test_fp8_block_dequantization(tmp_path):
    w = torch.randn(200, 300)
    scale = torch.rand(2, 3) + 0.5
    q = (w / scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]).to(torch.float8_e4m3fn)
    cfg = dict(V3_671B, num_hidden_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"x.weight": q, "x.weight_scale_inv": scale}, tmp_path / "model.safetensors")
    got = Checkpoint(tmp_path).get("x.weight")
    want = q.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert got.dtype == torch.float32 and torch.equal(got, want)
    save_file({"x.weight": q}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no 'x.weight_scale_inv' block scales"):
        Checkpoint(tmp_path).get("x.weight")
    save_file({"x.weight": q[0], "x.weight_scale_inv": scale[:1, :1]}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'x.weight' has shape \(300,\); block scales apply to 2-D"):
        Checkpoint(tmp_path).get("x.weight")


def test_sharded_checkpoint_index(checkpoints, tmp_path):
    ck = _copy(checkpoints["base"], tmp_path)
    tensors = load_file(ck / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, ck / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, ck / "model-00002-of-00002.safetensors")
    (ck / "model.safetensors").unlink()
    wm = {n: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, n in enumerate(names)}
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    c = Checkpoint(ck)
    check_checkpoint(c.config, c)
    assert torch.equal(c.get(names[-1]), tensors[names[-1]])
    index = ck / "model.safetensors.index.json"
    for bad, message in (({**wm, names[0]: "model-00002-of-00002.safetensors"},
                          f"'{names[0]}' is mapped to model-00002-of-00002.safetensors, which does not hold it"),
                         ({**wm, names[0]: None}, f"'{names[0]}' points to missing file None"),
                         (list(wm), "'weight_map' must map tensor names to file names")):
        index.write_text(json.dumps({"weight_map": bad}))
        with pytest.raises(CheckpointError, match=message):
            Checkpoint(ck)


def test_tokenizer_is_loaded_at_compile(checkpoints, tmp_path):
    """What the runtime could not load fails the compile; ids past the vocabulary are a note."""
    from deepinfer.compile.driver import load_model
    ck = _copy(checkpoints["base"], tmp_path)
    opts = CompileOptions(model=ck, out=tmp_path / "out", backend="eager")
    load_model(opts)
    good = (ck / "tokenizer.json").read_text()
    (ck / "tokenizer.json").write_text('{"version": 1.0,')
    with pytest.raises(CheckpointError, match="tokenizer.json: not a readable tokenizer"):
        load_model(opts)
    (ck / "tokenizer.json").write_text(good)
    (ck / "tokenizer_config.json").write_bytes(b"\xd0\x00")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not a valid JSON object"):
        load_model(opts)
    (ck / "tokenizer_config.json").unlink()
    (ck / "generation_config.json").write_text("garbage")      # read at every start of the artifact
    with pytest.raises(CheckpointError, match="generation_config.json: not a readable JSON file"):
        load_model(opts)
    (ck / "generation_config.json").unlink()
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(dict(cfg, vocab_size=200)))
    _edit_tensors(ck, lambda t: t.update({k: t[k][:200].clone() for k in ("model.embed_tokens.weight",
                                                                           "lm_head.weight")}))
    _, c = load_model(opts)          # refused in the prompts that hold them, as the runtime does, not at compile
    assert "tokenizer.json has 63 token id(s) past the model's vocabulary [0, 200) (200..262)" in c.notes[-1]


@pytest.mark.parametrize("kw,message", [
    (dict(decode_buckets=(1, 256)), "bucket 256 is larger than the context limit 128"),
    (dict(num_kv_blocks=4), "cannot hold one full-length sequence"),
    (dict(ep=3), "n_routed_experts=8 is not divisible by --ep=3"),
    (dict(cp=2, ep=3), "must both divide world"),
    (dict(context_limit=100), "not a multiple of --block-size=16"),
    (dict(context_limit=4096), "exceeds the model's max_position_embeddings=512"),
    (dict(context_buckets=(40,)), "40 is not a multiple of --block-size=16"),
    (dict(decode_buckets=()), "at least one bucket"),
    (dict(moe_capacity=0), "--moe-capacity=0"),
    (dict(moe_path="fast"), "--moe-path='fast' must be auto, grouped or static"),
    (dict(moe_path="grouped", moe_capacity=4), "--moe-capacity: only for --moe-path static"),
    (dict(moe_path="grouped", backend="neuron", neuron_target="trn2"), "the Neuron backend does not have"),
    (dict(neuron_target="trn2"), "--neuron-target=trn2 applies to --backend neuron only"),
    (dict(capacity_factor=float("nan")), "--capacity-factor=nan must be a finite number"),
    (dict(weight_dtype="float16"), "--weight-dtype='float16' is not one of auto, float32, bfloat16"),
    (dict(weight_dtype="bfloat16", backend="cuda"), "--weight-dtype=bfloat16 with --dtype=float32 --backend=cuda"),
    (dict(weight_dtype="float32", dtype="bfloat16"), "may differ from --dtype only as bfloat16 weights"),
    (dict(matmul_dtype="float16"), "--matmul-dtype='float16' is not one of auto, float32, bfloat16"),
    (dict(matmul_dtype="bfloat16", backend="cuda"), "--matmul-dtype=bfloat16 with --dtype=float32 --weight-dtype=auto --backend=cuda"),
    (dict(matmul_dtype="bfloat16", weight_dtype="float32"), "only as bfloat16 products under float32 math, with bfloat16 weights"),
    (dict(matmul_dtype="float32", dtype="bfloat16", backend="cuda"), "--matmul-dtype=float32 with --dtype=bfloat16"),
    (dict(region_marks=True, backend="neuron", neuron_target="trn2"), "--region-marks: a Neuron graph runs on the device"),
    (dict(shared_experts="fused"), "--shared-experts='fused' must be auto, grouped or separate"),
    (dict(shared_experts="grouped", moe_path="static"), "--shared-experts grouped: it needs the grouped MoE path"),
    (dict(shared_experts="grouped", ep=2), "--shared-experts grouped: n_shared_experts=1 is not divisible by --ep=2"),
])
def test_bad_options_are_refused(checkpoints, kw, message):
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    opts = dict(model=checkpoints["base"], out=Path("unused"), context_limit=128)
    opts.update(kw)
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace("+", r"\+")):
        resolve(CompileOptions(**opts), m)


def test_a_derived_context_limit_is_named_as_such(checkpoints):
    """No --context-limit: the limit comes from max_position_embeddings, and an error about it says so rather
    than naming a flag the user never passed."""
    m = dataclasses.replace(ModelConfig.from_file(checkpoints["base"] / "config.json"), max_position_embeddings=500)
    with pytest.raises(OptionError, match="max_position_embeddings: pass --context-limit.=500 is not a multiple"):
        resolve(CompileOptions(model=checkpoints["base"], out=Path("unused")), m)


@pytest.mark.parametrize("kw,path", [
    (dict(), "grouped"),
    (dict(backend="cuda"), "grouped"),
    (dict(backend="neuron", neuron_target="trn2"), "static"),
    (dict(moe_capacity=4), "static"),
    (dict(moe_decode_path="gather"), "grouped"),
    (dict(moe_path="static"), "static"),
])
def test_moe_path_auto_resolution(checkpoints, kw, path):
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    cc = resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128, **kw), m)
    assert cc.moe_path == path
    assert (cc.moe_capacity == ()) == (path == "grouped")


def test_weight_dtype_resolution(checkpoints):
    """--weight-dtype equal to --dtype is no separate storage; bfloat16 on the cpu backend is. auto: bfloat16
    where the checkpoint stores bf16 matrices and the math is float32 on cpu/eager, else --dtype."""
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    def cc(stored=None, **kw):
        return resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128, **kw), m,
                       stored)
    assert cc().weight_dtype is None and cc().weights_dtype == "float32"
    assert cc("bfloat16").weight_dtype == cc("bfloat16", backend="eager").weight_dtype == "bfloat16"
    assert cc("bfloat16", weight_dtype="float32").weight_dtype is None                  # explicit: upcast
    assert cc("bfloat16", backend="cuda").weight_dtype is None
    assert cc("bfloat16", dtype="bfloat16").weight_dtype is None
    assert cc(weight_dtype="float32").weight_dtype is None
    assert cc(backend="cuda", dtype="bfloat16", weight_dtype="bfloat16").weight_dtype is None
    assert cc(weight_dtype="bfloat16").weights_dtype == cc(backend="eager", weight_dtype="bfloat16").weights_dtype == "bfloat16"


def test_matmul_dtype_resolution(checkpoints):
    """--matmul-dtype bfloat16 on cpu/eager takes bf16 weights whatever the checkpoint stores, and is recorded in
    the manifest (absent when float32, like weight_dtype) and in the lock key; the graphs' specs carry it."""
    from deepinfer.common import serde
    from deepinfer.compile.graphs import plan_graphs
    from deepinfer.compile.lock import lock_key
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    def cc(stored=None, **kw):
        return resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128, **kw), m,
                       stored)
    plain, bf16 = cc(), cc(matmul_dtype="bfloat16")
    assert cc(matmul_dtype="float32") == plain and cc(backend="cuda", dtype="bfloat16").matmul_dtype is None
    assert plain.matmul_dtype is None and "matmul_dtype" not in serde.dumps(plain)
    assert bf16.matmul_dtype == "bfloat16" and bf16.weight_dtype == "bfloat16"
    assert cc("bfloat16", matmul_dtype="bfloat16", backend="eager") == dataclasses.replace(bf16, backend="eager")
    assert '"matmul_dtype": "bfloat16"' in serde.dumps(bf16)
    assert {p.spec.bf16_products for p in plan_graphs(m, bf16)} == {True}
    assert {p.spec.bf16_products for p in plan_graphs(m, plain)} == {False}
    from types import SimpleNamespace
    from deepinfer.common.manifest import Toolchain  # noqa: F401  (the key reads only name, model, compile)
    key = lambda c: lock_key(SimpleNamespace(name="x", model=m, compile=c))
    assert "/matmul=bfloat16" in key(bf16) and "matmul" not in key(plain)


def test_compile_hints_bf16_products_only_where_they_could_run(checkpoints, monkeypatch):
    """A bf16 checkpoint compiled with float32 products on a CPU with bf16 dot products gets a hint naming
    --matmul-dtype bfloat16 (the choice stays explicit: a CPU-dependent default would make the hashes depend on
    the compiling machine); not without those instructions, not when already chosen, not for float32 weights."""
    from deepinfer.compile import driver
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    o = lambda **kw: CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128, **kw)
    def said(has_dot, stored="bfloat16", **kw):
        monkeypatch.setattr(driver, "cpu_has_bf16_dot", lambda: has_dot)
        return "hint: this CPU has bf16 dot products; --matmul-dtype bfloat16" in driver._describe(
            o(**kw), m, resolve(o(**kw), m, stored), 1)
    assert said(True) and said(True, backend="eager")
    assert not said(False)
    assert not said(True, matmul_dtype="bfloat16")
    assert not said(True, stored=None)                                        # float32 checkpoint
    assert not said(True, dtype="bfloat16") and not said(True, backend="cuda", dtype="bfloat16")


def test_bf16_products_leave_no_bf16_gemm_in_the_graphs():
    """--matmul-dtype bfloat16 graphs hold no bf16 GEMM of their own: every bf16 product goes through an op that
    picks its form on the machine that runs it (rows_linear, grouped_mm, bf16_einsum): torch's bf16 GEMMs where
    the CPU has bf16 dot products, the fp32 GEMM on the widened operands elsewhere, where bf16 GEMMs run 30-70x
    slower (a prefill chunk's attention baked in as bf16 GEMMs made the demo model's 256-token chunk 65 ms against
    13 ms on an AVX2 CPU). The graphs are the same whichever CPU compiles them."""
    from checkpoints import TINY
    from deepinfer.compile.graphs import export_graph, plan_graphs
    m = ModelConfig.from_hf_dict(dict(TINY, model_type="deepseek_v3"))
    cc = resolve(CompileOptions(model=Path("tiny"), out=Path("unused"), matmul_dtype="bfloat16", decode_buckets=(2,),
                                prefill_buckets=(16,), context_limit=64, context_buckets=()), m)
    aten = torch.ops.aten
    gemms = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.matmul.default,
             aten.linear.default, aten.einsum.default}
    plans = [p for p in plan_graphs(m, cc) if p.spec.region in ("dense_layer", "moe_layer", "head")]
    assert {p.spec.kind for p in plans} == {"decode", "prefill"} and all(p.spec.bf16_products for p in plans)
    custom = set()
    for plan in plans:
        ep, _ = export_graph(plan)
        for node in ep.graph.nodes:
            if node.op != "call_function":
                continue
            if str(node.target).startswith("deepinfer."):
                custom.add(str(node.target).split(".")[1])
            if node.target in gemms:
                dtypes = [a.meta["val"].dtype for a in node.all_input_nodes]
                assert torch.bfloat16 not in dtypes, f"{plan.name}: {node.target} of {dtypes}"
    assert {"rows_linear", "grouped_mm", "bf16_einsum"} <= custom


def test_region_marks_in_manifest_lock_key_and_specs(checkpoints):
    """--region-marks is recorded in the manifest (absent when off: manifests and hashes as before it existed),
    in the lock key, and in every graph's spec (layer graphs trace the marks from it)."""
    from types import SimpleNamespace
    from deepinfer.common import serde
    from deepinfer.compile.graphs import plan_graphs
    from deepinfer.compile.lock import lock_key
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    plain = resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128), m)
    marked = resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128,
                                    region_marks=True), m)
    assert plain.region_marks is None and "region_marks" not in serde.dumps(plain)
    assert marked.region_marks is True and '"region_marks": true' in serde.dumps(marked)
    assert serde.loads(type(marked), serde.dumps(marked), "compile") == marked
    assert {p.spec.region_marks for p in plan_graphs(m, marked)} == {True}
    assert {p.spec.region_marks for p in plan_graphs(m, plain)} == {False}
    key = lambda c: lock_key(SimpleNamespace(name="x", model=m, compile=c))
    assert "/region-marks" in key(marked) and "region-marks" not in key(plain)


@pytest.mark.parametrize("kw,grouped", [
    (dict(), True),                                      # auto: grouped wherever it can be
    (dict(backend="cuda"), True),
    (dict(backend="cuda", ep=2), False),                 # one shared expert cannot split over two ranks
    (dict(moe_path="static"), False),
    (dict(backend="neuron", neuron_target="trn2"), False),
    (dict(shared_experts="separate"), False),
    (dict(shared_experts="grouped", backend="eager"), True),
])
def test_shared_experts_resolution_manifest_lock_key_and_shapes(checkpoints, kw, grouped):
    """--shared-experts: resolved as documented, recorded in the manifest only when grouped (manifests and hashes
    as before otherwise), in the lock key, and in the graphs' specs and weight shapes."""
    from types import SimpleNamespace
    from deepinfer.common import serde
    from deepinfer.compile.graphs import plan_graphs
    from deepinfer.compile.lock import lock_key
    m = ModelConfig.from_file(checkpoints["base"] / "config.json")
    cc = resolve(CompileOptions(model=checkpoints["base"], out=Path("unused"), context_limit=128, **kw), m)
    assert bool(cc.shared_experts_grouped) == grouped
    assert ("shared_experts_grouped" in serde.dumps(cc)) == grouped
    assert serde.loads(type(cc), serde.dumps(cc), "compile") == cc
    assert ("+shared" in lock_key(SimpleNamespace(name="x", model=m, compile=cc))) == grouped
    E = m.n_routed_experts // cc.ep
    for p in plan_graphs(m, cc):
        if p.spec.region != "moe_layer":
            continue
        assert p.spec.shared_groups == (1 if grouped else 0)
        shapes = {w.key: w.shape for w in p.weights}
        assert shapes["moe.experts_gate_up"][0] == E + p.spec.shared_groups
        assert ("moe.shared_gate_up" in shapes) != grouped


def test_stored_matrix_dtype(checkpoints, bf16_checkpoint):
    from deepinfer.compile.checkpoint import Checkpoint
    assert Checkpoint(bf16_checkpoint).stored_matrix_dtype() == "bfloat16"
    assert Checkpoint(checkpoints["base"]).stored_matrix_dtype() is None


def test_manifest_omits_an_unset_weight_dtype():
    """CompileConfig.weight_dtype is in the JSON only when set: manifests written before it existed read back to
    the same bytes (their root hash still verifies), and a set one round-trips."""
    from deepinfer.common import serde
    from deepinfer.common.manifest import CompileConfig
    base = dict(backend="cpu", dtype="float32", cp=1, ep=1, decode_buckets=(1,), prefill_buckets=(16,),
                context_buckets=(64,), context_limit=64, block_size=16, num_kv_blocks=4, moe_capacity=(),
                capacity_factor=None)
    plain = serde.dumps(CompileConfig(**base))
    assert "weight_dtype" not in plain
    assert serde.dumps(serde.loads(CompileConfig, plain, "compile")) == plain
    narrow = CompileConfig(**base, weight_dtype="bfloat16")
    assert '"weight_dtype": "bfloat16"' in serde.dumps(narrow)
    assert serde.loads(CompileConfig, serde.dumps(narrow), "compile") == narrow


def test_an_out_that_is_not_an_artifact_is_refused_before_any_work(checkpoints, tmp_path):
    """--out must never delete what is not an artifact's: the checkpoint's directory (or one around it), a file, or
    a directory without a manifest holding what an install replaces. Refused before anything is compiled."""
    import shutil
    from deepinfer.common.errors import OptionError
    from deepinfer.compile.driver import compile_artifact
    from deepinfer.compile.options import CompileOptions
    ck = tmp_path / "proj" / "weights"
    shutil.copytree(checkpoints["base"], ck)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "mine" / "weights").mkdir(parents=True)
    (tmp_path / "mine" / "weights" / "notes.txt").write_text("keep me")
    for out, message in ((ck, "checkpoint directory"), (ck.parent, "checkpoint directory"),
                         (ck / "sub", "checkpoint directory"), (tmp_path / "afile", "a file"),
                         (tmp_path / "mine", "not an artifact")):
        with pytest.raises(OptionError, match=message):
            compile_artifact(CompileOptions(model=ck, out=out, backend="eager", context_limit=128),
                             log=lambda s: None)
    assert sorted(p.name for p in ck.iterdir()) == sorted(p.name for p in checkpoints["base"].iterdir())
    assert (tmp_path / "mine" / "weights" / "notes.txt").read_text() == "keep me"


def test_inspect_describes_the_artifact(checkpoints, compile_artifact):
    """deepinfer-inspect: the resolved compile (the shared experts' form among it), one row per rank with its
    experts and shared slice, and every graph with its hash."""
    from deepinfer.common.manifest import Manifest
    from deepinfer.runtime.inspect import describe
    for kw, shared in ((dict(), True), (dict(cp=2, ep=2), False)):
        art = compile_artifact(checkpoints["base"], **kw)
        text, m = describe(art), Manifest.read(art)
        assert ("shared experts as groups" in text) == shared
        assert f"world {m.layout.world} = max(cp {m.layout.cp}, ep {m.layout.ep})" in text
        for r in m.layout.ranks:
            assert f"[{r.experts[0]:>4},{r.experts[1]:>4})  [{r.shared_slice[0]:>5},{r.shared_slice[1]:>5})" in text
        for g in m.graphs:
            assert f"{g.graph_hash[:16]}  {g.file}" in text


@pytest.mark.parametrize("main,args,message", [
    ("compile_main", ["--jobs", "0"], "error: Invalid value for '--jobs': 0 is not in the range x>=1."),
    ("compile_main", ["--decode-buckets", "1,abc"], "error: Invalid value for '--decode-buckets': '1,abc' is not"),
    ("compile_main", ["--check-lock", "no-such.lock"], "error: --check-lock no-such.lock: no such lock file"),
    ("run_main", ["no-artifact", "--threads", "0"], "error: Invalid value for '--threads': 0 is not in the range"),
    ("run_main", ["no-artifact", "--bogus"], "error: No such option '--bogus'"),
])
def test_flag_errors_are_one_line_and_exit_2(tmp_path, main, args, message):
    """Flag errors as every other error of the commands: one line, exit code 2 (click's own print the usage, a
    hint and a blank line first); a missing lock file before the compile it could only fail after."""
    r = subprocess.run([sys.executable, "-c", f"from deepinfer.cli import {main}; {main}()", *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith(message) and len(r.stderr.strip().splitlines()) == 1, \
        r.stderr
