"""Tiny DeepSeek-V3 checkpoints built with transformers' save_pretrained, and its reference logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, max_position_embeddings=512, n_shared_experts=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, rope_interleave=True, tie_word_embeddings=False,
)

VARIANTS = {
    "base": {},
    "no_q_lora": dict(q_lora_rank=None, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    "two_dense_yarn": dict(first_k_dense_replace=2, num_hidden_layers=4, n_group=1, topk_group=1,
                           rope_interleave=False, n_shared_experts=2,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 128, "beta_fast": 32,
                                            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def make_checkpoint(path: Path, seed: int = 0, tokenizer: bool = True, dtype: torch.dtype = torch.float32,
                    **overrides) -> Path:
    """Random weights (with a non-zero correction bias) saved as a Hugging Face checkpoint in `dtype`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = dict(TINY)
    cfg.update(overrides)
    torch.manual_seed(seed)
    config = DeepseekV3Config(**cfg)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.to(dtype).save_pretrained(path)
    if tokenizer:
        write_byte_tokenizer(path, cfg["vocab_size"])
    return path


# A DeepSeek-style chat template (system prompts first, then the turns; the assistant's turn ends in EOS; tools
# named after the system prompt (their schemas would not fit the tiny test context), an assistant's tool calls and the tools' results in DeepSeek-V3.1's markers),
# with the whitespace that trim_blocks / lstrip_blocks must remove, and an error for roles it does not know.
CHAT_TEMPLATE = """{% set ns = namespace(system='') %}
{%- for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] %}{% endif %}{% endfor %}
{{ bos_token }}{{ ns.system }}
{%- if tools %}{{ '<Tools>' }}{% for t in tools %}{{ t['function']['name'] + ';' }}{% endfor %}{% endif %}
{%- for m in messages %}
  {%- if m['role'] == 'user' %}{{ '<User>' + m['content'] }}
  {%- elif m['role'] == 'assistant' and m.get('tool_calls') %}{{ '<Assistant><｜tool▁calls▁begin｜>' }}
    {%- for c in m['tool_calls'] %}{{ '<｜tool▁call▁begin｜>' + c['function']['name'] + '<｜tool▁sep｜>' + c['function']['arguments'] + '<｜tool▁call▁end｜>' }}{% endfor %}
    {{- '<｜tool▁calls▁end｜>' + eos_token }}
  {%- elif m['role'] == 'assistant' %}{{ '<Assistant>' + m['content'] + eos_token }}
  {%- elif m['role'] == 'tool' %}{{ '<Tool>' + m['content'] }}
  {%- elif m['role'] != 'system' %}{{ raise_exception('unknown role ' + m['role']) }}
  {%- endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<Assistant>' }}{% endif %}"""

TOOL_MARKERS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                "<｜tool▁sep｜>"]


def write_byte_tokenizer(path: Path, vocab_size: int, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A byte-level BPE tokenizer (bytes only, no merges) so text prompts work on random models, with DeepSeek's
    tool-call markers as special tokens and a chat template in its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {"<|bos|>": 0, "<|eos|>": 1}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", *TOOL_MARKERS])     # ids 0, 1, then 258-262
    tok.save(str(path / "tokenizer.json"))
    config = {"add_bos_token": False, "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def hf_model(path: Path, dtype=torch.float32):
    from transformers import DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [len, V] in one forward pass."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()
