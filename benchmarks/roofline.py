"""Roofline floors for the benchmark tables: what a step must read and compute, over what this device sustains.

A decode step reads every weight its tokens use once (the distinct routed experts a batch touches, expected
under uniform routing) and is floored by memory bandwidth; a prefill chunk is floored by GEMM throughput
(or by reading its weights, whichever is slower). Both device figures are measured in the same run.
"""

from __future__ import annotations

import time

import torch


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best_time(dev: torch.device, fn, repeat: int) -> float:
    """The shortest of `repeat` synchronised runs of fn(), after one untimed run."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth(dev: torch.device, nbytes: int = 1 << 28, repeat: int = 5) -> float:
    """Bytes moved per second (read + write) by a large copy, best of `repeat`. The source is written first: an
    untouched CPU allocation reads as the kernel's shared zero page, which stays in cache: a copy from it measured
    0.9-1.6x the real figure at the same moments on the 2-core Zen 4 VM (43-54 against 31-49 GB/s)."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * nbytes / best_time(dev, lambda: b.copy_(a), repeat)


def read_bandwidth(dev: torch.device, nbytes: int = 1 << 28, repeat: int = 5) -> float:
    """Bytes read per second by a sum over a large written buffer, best of `repeat`: what a decode step does with
    its weights. On the 2-core Zen 4 VM both figures move between ~31 and ~60 GB/s from minute to minute, the two
    not always together."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    return nbytes / best_time(dev, a.sum, repeat)


def gemm_flops(dev: torch.device, dtype: torch.dtype, n: int = 2048, repeat: int = 3) -> float:
    """Sustained FLOP/s of one large square matmul, best of `repeat`."""
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    return 2 * n ** 3 / best_time(dev, lambda: a @ b, repeat)


def _expert(m) -> int:
    return 3 * m.hidden_size * m.moe_intermediate_size


def _touched(m, tokens: int) -> float:
    """Distinct routed experts `tokens` tokens touch in one layer (expected, uniform routing)."""
    E, K = m.n_routed_experts, m.num_experts_per_tok
    return E * (1 - (1 - K / E) ** tokens) if E else 0.0


def decode_step_params(m, batch: int) -> float:
    """Weights a decode step over `batch` sequences reads: everything a token uses except its routed experts,
    the LM head, and the distinct routed experts the batch touches (expected, uniform routing)."""
    fixed = m.param_counts()["active_per_token"] - m.num_moe_layers * m.num_experts_per_tok * _expert(m)
    if m.tie_word_embeddings:                      # the head reads the embedding matrix
        fixed += m.vocab_size * m.hidden_size
    return fixed + m.num_moe_layers * _touched(m, batch) * _expert(m)


def step_floor_s(m, tokens: int, context: float, logit_rows: int, bytes_per_param: int, bandwidth: float,
                 flops: float, kv_rows: float = 0.0) -> float:
    """Least time for one step over `tokens` new tokens (attention over `context` keys per token on average,
    logits for `logit_rows`; the experts the tokens touch, expected under uniform routing): the routed experts
    and the rest of the weights each take the longer of reading them once and computing with them (a few rows
    per expert read at memory speed; a weight every token uses is compute-bound once the rows outnumber the
    machine's FLOP-per-byte balance). `kv_rows`: the latent KV rows (kv_lora_rank + rope dims, bytes_per_param
    each, every layer) the step reads beside the weights: a decode token's whole context."""
    K, expert, L = m.num_experts_per_tok, _expert(m), m.num_moe_layers
    head = m.vocab_size * m.hidden_size
    other = m.param_counts()["active_per_token"] - L * K * expert - (0 if m.tie_word_embeddings else head)
    attn = 2 * context * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim) * m.num_hidden_layers
    routed = max(bytes_per_param * L * _touched(m, tokens) * expert / bandwidth, 2 * L * K * expert * tokens / flops)
    kv = kv_rows * (m.kv_lora_rank + m.qk_rope_head_dim) * m.num_hidden_layers
    rest = max(bytes_per_param * (other + head + kv) / bandwidth,
               (2 * other * tokens + attn * tokens + 2 * head * logit_rows) / flops)
    return routed + rest
