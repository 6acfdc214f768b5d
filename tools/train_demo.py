#!/usr/bin/env python3
"""Train deepinfer's embedded demo model: a tiny DeepSeek-V3-architecture MoE LM.

The model is transformers' ``DeepseekV3ForCausalLM`` (so the checkpoint is in exactly
Hugging Face's format, written by ``save_pretrained``) shrunk to ~5.6M parameters:

* MLA attention with a low-rank query (q_lora_rank) and a compressed KV latent
  (kv_lora_rank + a shared rotary key, interleaved RoPE),
* one dense first layer (first_k_dense_replace=1), then MoE layers with 8 routed
  experts in 2 groups (group-limited routing: topk_group=1 of n_group=2, top-2
  experts per token, sigmoid scores, normalised top-k weights) plus a shared expert,
* DeepSeek-V3's auxiliary-loss-free load balancing: transformers keeps
  ``mlp.gate.e_score_correction_bias`` as an untrained buffer; after every optimizer
  step this script updates it as ``bias += gamma * sign(mean_load - load_e)``, with
  the per-expert loads counted by a forward hook on every ``DeepseekV3TopkRouter``.

Corpus (offline, shipped with CPython, PSF license): the Python language reference
topics of ``pydoc_data.topics`` split into sections at their reST headings, plus the
docstrings of the standard-library modules (extracted with ``ast``).  Exact duplicates
are dropped, so a section that appears in several topics is counted once.  5% of the
documents of each source are held out for evaluation.

Tokenizer: a byte-level BPE trained with the ``tokenizers`` library on the training
split (vocab 4096, ``<|bos|>`` = 0, ``<|eos|>`` = 1).  Every document is encoded as
``<|bos|> text <|eos|>`` so the model learns where text starts and stops.

Everything is deterministic: fixed seeds, sorted inputs and single-threaded CPU
training; the same corpus (i.e. the same CPython version) and toolchain reproduce the
same tokenizer and checkpoint.  The output directory receives::

    config.json, generation_config.json, model.safetensors (bfloat16),
    tokenizer.json, tokenizer_config.json,
    TRAINING.md                  corpus, settings, loss curve, evaluation
    heldout_prompts.json         held-out prompts (list of strings) for tests
    reference_generations.json   greedy continuations by transformers (float32)
    corpus_words.txt[.gz]        sorted set of whitespace-separated training words

Usage::

    python tools/train_demo.py --out compile/demo_model

(about 30-35 minutes on one CPU core).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import math
import os
import platform
import random
import re
import sys
import sysconfig
import time
from collections import Counter

import torch
import torch.nn.functional as F

BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 0, 1

# Model shape (DeepSeek-V3 architecture, miniature).
MODEL_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,  # dense MLP of the first layer
    moe_intermediate_size=128,  # each routed expert and the shared expert
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    hidden_act="silu",
    max_position_embeddings=1024,
    rope_interleave=True,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=False,
    attention_bias=False,
    num_nextn_predict_layers=0,  # no multi-token-prediction module
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    use_cache=True,
)

# Standard-library directories whose docstrings are not used (tests, the IDLE and
# 2to3 applications, vendored/installed packages, demos).
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
             "ensurepip", "__pycache__"}
HEADING_UNDERLINE = re.compile(r'([*=\-~^"#+])\1*')


# --------------------------------------------------------------------------- corpus


def topic_sections(text: str) -> list[str]:
    """Split a pydoc topic into sections at reST headings (a line underlined by a
    same-length run of one punctuation character).  The underline itself is dropped,
    so a section reads the same whichever topic it was taken from."""
    lines = text.split("\n")
    sections, cur, i = [], [], 0
    while i < len(lines):
        if (i + 1 < len(lines) and lines[i].strip() and HEADING_UNDERLINE.fullmatch(lines[i + 1])
                and len(lines[i + 1]) == len(lines[i])):
            if cur:
                sections.append(cur)
            cur, i = [lines[i], ""], i + 2
            continue
        cur.append(lines[i])
        i += 1
    if cur:
        sections.append(cur)
    out = []
    for sec in sections:
        s = re.sub(r"\n{3,}", "\n\n", "\n".join(sec).strip())
        if s:
            out.append(s)
    return out


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(relative path, docstring) for every module/class/function docstring of the
    standard library, in sorted file order and ast.walk order."""
    lib = sysconfig.get_paths()["stdlib"]
    out = []
    for root, dirs, files in os.walk(lib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                try:
                    tree = ast.parse(f.read())
                except (SyntaxError, ValueError):
                    continue
            rel = os.path.relpath(path, lib).replace(os.sep, "/")
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)  # cleandoc()-ed: common indentation removed
                    if doc:
                        out.append((rel, doc.strip()))
    return out


def build_corpus(min_words: int) -> tuple[list[dict], dict]:
    """Return the documents ({source, name, text}) and a description of the corpus."""
    import pydoc_data.topics

    raw = {"pydoc_topics": [], "stdlib_docstrings": []}
    for key in sorted(pydoc_data.topics.topics):
        for sec in topic_sections(pydoc_data.topics.topics[key]):
            raw["pydoc_topics"].append((key, sec))
    raw["stdlib_docstrings"] = stdlib_docstrings()

    seen, docs, info = set(), [], {}
    for source in ("pydoc_topics", "stdlib_docstrings"):
        kept = 0
        for name, text in raw[source]:
            if text in seen or len(text.split()) < min_words:
                continue
            seen.add(text)
            docs.append({"source": source, "name": name, "text": text})
            kept += 1
        info[source] = {
            "raw_items": len(raw[source]),
            "raw_chars": sum(len(t) for _, t in raw[source]),
            "documents": kept,
            "chars": sum(len(d["text"]) for d in docs if d["source"] == source),
        }
    info["pydoc_topics"]["topics"] = len(pydoc_data.topics.topics)
    info["pydoc_topics"]["topics_chars"] = sum(len(v) for v in pydoc_data.topics.topics.values())
    info["corpus_sha256"] = sha256_texts([d["text"] for d in docs])
    return docs, info


def sha256_texts(texts: list[str]) -> str:
    """sha256 of the corpus text: the documents, UTF-8, each followed by a NUL byte."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8") + b"\0")
    return h.hexdigest()


def split_heldout(docs: list[dict], frac: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Hold out `frac` of the documents of each source (seeded shuffle)."""
    rng = random.Random(seed)
    train, held = [], []
    for source in ("pydoc_topics", "stdlib_docstrings"):
        part = [d for d in docs if d["source"] == source]
        order = list(range(len(part)))
        rng.shuffle(order)
        n_held = max(1, round(frac * len(part)))
        held_idx = set(order[:n_held])
        held += [part[i] for i in sorted(held_idx)]
        train += [part[i] for i in order[n_held:]]  # shuffled document order
    rng.shuffle(train)
    return train, held


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    # encode(text) (add_special_tokens=True, the default) prepends <|bos|>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }


def encode_docs(tok, docs: list[dict]) -> list[list[int]]:
    encs = tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    return [[BOS_ID] + e.ids + [EOS_ID] for e in encs]


# ---------------------------------------------------------------------------- model


def make_model(seed: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**MODEL_CONFIG)
    return DeepseekV3ForCausalLM(config)


class LoadBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, sec. 2.1.2).

    A forward hook on each DeepseekV3TopkRouter counts how many tokens every expert
    receives while training; `step()` (after each optimizer step) nudges each
    expert's selection bias towards balance: bias += gamma * sign(mean_load - load).
    The bias only affects which experts are chosen, not the combination weights."""

    def __init__(self, model, gamma: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.gamma = gamma
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = [torch.zeros(r.num_experts, dtype=torch.long) for r in self.routers]
        self.max_violation = [0.0] * len(self.routers)  # running sum of max(load)/mean(load) - 1
        self.n_steps = 0
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, output):
            if module.training:
                _, _, topk_indices = output
                self.counts[i] += torch.bincount(topk_indices.flatten(), minlength=module.num_experts)
        return hook

    @torch.no_grad()
    def step(self):
        for i, r in enumerate(self.routers):
            load = self.counts[i].float()
            mean = load.mean()
            r.e_score_correction_bias += self.gamma * torch.sign(mean - load)
            self.max_violation[i] += (load.max() / mean - 1).item()
            self.counts[i].zero_()
        self.n_steps += 1

    def pop_max_violation(self) -> list[float]:
        out = [v / max(self.n_steps, 1) for v in self.max_violation]
        self.max_violation, self.n_steps = [0.0] * len(self.routers), 0
        return out


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_nll(model, stream: torch.Tensor, seq_len: int, batch_size: int) -> tuple[float, int]:
    """Total NLL (nats) and token count over the held-out token stream, cut into
    consecutive windows of seq_len predictions; <|bos|> targets are not scored."""
    was_training = model.training
    model.eval()
    xs, ys = [], []
    for i in range(0, len(stream) - 1, seq_len):
        chunk = stream[i:i + seq_len + 1]
        xs.append(chunk[:-1])
        ys.append(chunk[1:])
    total, count = 0.0, 0
    for b in range(0, len(xs), batch_size):
        # Pad the (only) short last window on the right; padded targets are ignored.
        n = max(len(x) for x in xs[b:b + batch_size])
        x = torch.stack([F.pad(t, (0, n - len(t)), value=EOS_ID) for t in xs[b:b + batch_size]])
        y = torch.stack([F.pad(t, (0, n - len(t)), value=-100) for t in ys[b:b + batch_size]])
        y = y.masked_fill(y == BOS_ID, -100)
        logits = model(input_ids=x).logits.float()
        total += F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1),
                                 ignore_index=-100, reduction="sum").item()
        count += (y != -100).sum().item()
    model.train(was_training)
    return total, count


# ----------------------------------------------------------------------- evaluation


def pick_prompts(heldout: list[dict], train_text: str, n: int, seed: int) -> list[str]:
    """Beginnings (5-12 words, within the first line) of prose paragraphs of held-out
    documents, reference-manual sections first, at most one per document; a prompt
    that also occurs verbatim in the training text is skipped."""
    rng = random.Random(seed)
    prose = re.compile(r"[A-Za-z][A-Za-z0-9 ,;:'()\-.]*")
    prompts = []
    for source in ("pydoc_topics", "stdlib_docstrings"):
        for d in heldout:
            if d["source"] != source or len(prompts) >= n:
                continue
            for para in d["text"].split("\n\n")[1 if source == "pydoc_topics" else 0:]:
                line = para.split("\n")[0]
                words = line.split()
                if (len(words) >= 7 and not line.startswith(" ") and prose.fullmatch(line)
                        and sum(w.isalpha() for w in words) >= 0.8 * len(words)):
                    k = min(len(words) - 1, rng.randint(5, 12))
                    prompt = " ".join(words[:k]).rstrip(",;:(")
                    if len(prompt.split()) >= 5 and prompt not in train_text:
                        prompts.append(prompt)
                        break
    return prompts


@torch.no_grad()
def greedy(model, tok, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int], str]:
    ids = tok.encode(prompt).ids  # <|bos|> + prompt
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=EOS_ID)
    new = out[0, len(ids):].tolist()
    return ids, new, tok.decode(new, skip_special_tokens=True)


def write_words(out_dir: str, words: list[str]) -> str:
    data = ("\n".join(words) + "\n").encode("utf-8")
    for name in ("corpus_words.txt", "corpus_words.txt.gz"):
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    if len(data) <= 256 * 1024:
        name = "corpus_words.txt"
    else:  # reproducible gzip: no file name, mtime 0
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as g:
            g.write(data)
        data, name = buf.getvalue(), "corpus_words.txt.gz"
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(data)
    return name


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="compile/demo_model", help="output directory")
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--final-lr-frac", type=float, default=0.1, help="cosine decays to lr*this")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="load-balancing bias update speed")
    ap.add_argument("--heldout-frac", type=float, default=0.05)
    ap.add_argument("--min-words", type=int, default=3, help="drop documents with fewer words")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--gen-tokens", type=int, default=64)
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    import tokenizers
    import transformers
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # ---- corpus, split, tokenizer
    docs, corpus_info = build_corpus(args.min_words)
    train_docs, held_docs = split_heldout(docs, args.heldout_frac, args.seed)
    log(f"corpus: {len(docs)} documents, {sum(len(d['text']) for d in docs)} chars, "
        f"sha256 {corpus_info['corpus_sha256']}; train {len(train_docs)} / held-out {len(held_docs)}")
    tok = train_tokenizer([d["text"] for d in train_docs], MODEL_CONFIG["vocab_size"])
    train_ids = encode_docs(tok, train_docs)
    held_ids = encode_docs(tok, held_docs)
    for d, ids in zip(train_docs[:200] + held_docs, train_ids[:200] + held_ids):
        assert tok.decode(ids[1:-1]) == d["text"], "byte-level BPE must round-trip"
    train_stream = torch.tensor([t for ids in train_ids for t in ids], dtype=torch.long)
    held_stream = torch.tensor([t for ids in held_ids for t in ids], dtype=torch.long)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, train tokens {len(train_stream)}, "
        f"held-out tokens {len(held_stream)}, {sum(len(d['text']) for d in train_docs) / len(train_stream):.2f} chars/token")

    # ---- model
    model = make_model(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    n_active = n_params - sum(
        m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()
        for m in (layer.mlp for layer in model.model.layers) if hasattr(m, "experts")
    ) * (1 - MODEL_CONFIG["num_experts_per_tok"] / MODEL_CONFIG["n_routed_experts"])
    log(f"model: {n_params} parameters ({n_params - n_embed} without embeddings/lm_head, "
        f"{int(n_active)} active per token)")
    balancer = LoadBalancer(model, args.bias_gamma)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    # ---- train
    gen = torch.Generator().manual_seed(args.seed)
    T, B = args.seq_len, args.batch_size
    offsets = torch.arange(T + 1)
    curve, evals, window = [], [], []
    model.train()
    t_train = time.time()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.final_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_stream) - T - 1, (B,), generator=gen)
        batch = train_stream[starts[:, None] + offsets]
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        opt.step()
        balancer.step()
        window.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            vio = balancer.pop_max_violation()
            rec = {"step": step + 1, "train_loss": sum(window) / len(window), "lr": lr, "grad_norm": gnorm,
                   "max_violation": vio, "elapsed_s": time.time() - t_train}
            curve.append(rec)
            window = []
            eta = (time.time() - t_train) / (step + 1) * (args.steps - step - 1)
            log(f"step {step + 1:5d}/{args.steps}  loss {rec['train_loss']:.4f}  lr {lr:.2e}  "
                f"|g| {gnorm:.2f}  maxvio {' '.join(f'{v:.2f}' for v in vio)}  eta {eta / 60:.1f} min")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            nll, cnt = heldout_nll(model, held_stream, T, B)
            evals.append({"step": step + 1, "heldout_loss": nll / cnt, "heldout_ppl": math.exp(nll / cnt)})
            log(f"step {step + 1:5d}  held-out loss {nll / cnt:.4f}  ppl {math.exp(nll / cnt):.2f}")
    train_seconds = time.time() - t_train
    biases = [r.e_score_correction_bias.tolist() for r in balancer.routers]

    # ---- save (bfloat16) + tokenizer
    model.to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    os.chmod(os.path.join(args.out, "model.safetensors"), 0o644)  # safetensors writes it 0600
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    log(f"saved checkpoint to {args.out}")

    # ---- evaluate the saved checkpoint (bf16 weights, computed in float32)
    model = DeepseekV3ForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    model.eval()
    hf_tok = AutoTokenizer.from_pretrained(args.out)
    probe = "The \"assert\" statement\n\nAssert statements are a convenient way."
    assert hf_tok.decode(hf_tok(probe)["input_ids"], skip_special_tokens=True) == probe
    assert hf_tok(probe)["input_ids"] == tok.encode(probe).ids

    nll, cnt = heldout_nll(model, held_stream, T, B)
    model_ppl = math.exp(nll / cnt)
    V = MODEL_CONFIG["vocab_size"]
    counts = Counter(t for t in train_stream.tolist() if t != BOS_ID)  # same targets as scored
    n_train = sum(counts.values())
    held_targets = [t for t in held_stream[1:].tolist() if t != BOS_ID]
    uni_nll = -sum(math.log((counts[t] + 1) / (n_train + V)) for t in held_targets)
    assert len(held_targets) == cnt
    unigram_ppl = math.exp(uni_nll / cnt)
    log(f"held-out perplexity: model {model_ppl:.2f}, unigram {unigram_ppl:.2f}, uniform {V}")

    train_words = sorted({w for d in train_docs for w in d["text"].split()})
    word_set = set(train_words)
    words_file = write_words(args.out, train_words)
    prompts = pick_prompts(held_docs, "\n".join(d["text"] for d in train_docs), args.num_prompts, args.seed)
    with open(os.path.join(args.out, "heldout_prompts.json"), "w") as f:
        json.dump(prompts, f, indent=2, ensure_ascii=False)
        f.write("\n")
    generations, n_words, n_in = [], 0, 0
    for p in prompts:
        ids, new, text = greedy(model, tok, p, args.gen_tokens)
        words = text.split()
        hits = sum(w in word_set for w in words)
        if len(generations) < 10:
            n_words, n_in = n_words + len(words), n_in + hits
        generations.append({"prompt": p, "prompt_ids": ids, "generated_ids": new, "text": text,
                            "words": len(words), "corpus_words": hits,
                            "non_corpus_words": [w for w in words if w not in word_set]})
        log(f"{p!r} -> {text!r}")
    word_frac = n_in / max(n_words, 1)
    log(f"corpus-word fraction over {min(10, len(prompts))} prompts: {n_in}/{n_words} = {word_frac:.3f}")
    with open(os.path.join(args.out, "reference_generations.json"), "w") as f:
        json.dump({"note": "transformers generate(do_sample=False) on the bf16 checkpoint loaded in "
                           "float32; prompt_ids = <|bos|> + tokens of the prompt",
                   "max_new_tokens": args.gen_tokens, "generations": generations}, f, indent=1, ensure_ascii=False)
        f.write("\n")

    # ---- TRAINING.md
    files = {n: os.path.getsize(os.path.join(args.out, n)) for n in sorted(os.listdir(args.out))}
    total_seconds = time.time() - t_start
    md = render_report(args, corpus_info, docs, train_docs, held_docs, train_stream, held_stream, n_params,
                       n_embed, int(n_active), curve, evals, biases, train_seconds, total_seconds,
                       model_ppl, unigram_ppl, cnt, generations, word_frac, n_in, n_words, words_file, files,
                       versions={"python": platform.python_version(), "torch": torch.__version__,
                                 "transformers": transformers.__version__, "tokenizers": tokenizers.__version__})
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(md)
    log(f"done in {total_seconds / 60:.1f} min; wrote {', '.join(sorted(os.listdir(args.out)))}")
    if word_frac < 0.9:
        print("WARNING: corpus-word fraction below 0.90", file=sys.stderr)


def render_report(args, corpus_info, docs, train_docs, held_docs, train_stream, held_stream, n_params, n_embed,
                  n_active, curve, evals, biases, train_seconds, total_seconds, model_ppl, unigram_ppl, n_scored,
                  generations, word_frac, n_in, n_words, words_file, files, versions) -> str:
    pt, sd = corpus_info["pydoc_topics"], corpus_info["stdlib_docstrings"]
    tokens_seen = args.steps * args.batch_size * args.seq_len
    L = []
    L.append("# deepinfer demo model\n")
    L.append("A miniature DeepSeek-V3-architecture MoE language model (transformers `DeepseekV3ForCausalLM`, "
             "Hugging Face checkpoint format, bfloat16) trained from scratch on CPython's bundled documentation "
             "by `tools/train_demo.py`. It is a demo: it writes English-like Python-documentation prose, "
             "not correct facts.\n")
    L.append("Reproduce: `python tools/train_demo.py --out compile/demo_model` "
             f"(defaults = the settings below; seed {args.seed}, {args.threads} CPU thread).\n")
    L.append("## Corpus\n")
    L.append(f"English text shipped with CPython {versions['python']} (PSF license), all offline:\n")
    L.append(f"* `pydoc_data.topics.topics`: the Python language reference as used by `help()`: "
             f"{pt['topics']} topics, {pt['topics_chars']} characters, split at reST headings into "
             f"{pt['raw_items']} sections (heading underlines dropped); {pt['documents']} unique sections "
             f"({pt['chars']} chars) kept.")
    L.append(f"* docstrings of the standard library (`ast.get_docstring` of every module, class and function in "
             f"`sysconfig.get_paths()['stdlib']`, sorted file order, directories {sorted(SKIP_DIRS)} skipped): "
             f"{sd['raw_items']} docstrings ({sd['raw_chars']} chars); {sd['documents']} unique docstrings "
             f"({sd['chars']} chars) kept.")
    L.append(f"* Exact duplicates and documents with fewer than {args.min_words} words dropped. "
             f"Total: {len(docs)} documents, {sum(len(d['text']) for d in docs)} characters.")
    L.append(f"* sha256 of the corpus text (documents in order, UTF-8, each followed by a NUL byte): "
             f"`{corpus_info['corpus_sha256']}`")
    L.append(f"* Held-out split: {args.heldout_frac:.0%} of the documents of each source (seeded shuffle): "
             f"{len(held_docs)} documents ({sum(len(d['text']) for d in held_docs)} chars, "
             f"{len(held_stream)} tokens); training split {len(train_docs)} documents "
             f"({sum(len(d['text']) for d in train_docs)} chars, {len(train_stream)} tokens). "
             f"sha256 training split `{sha256_texts([d['text'] for d in train_docs])}`, held-out "
             f"`{sha256_texts([d['text'] for d in held_docs])}`.")
    L.append(f"* Each document is encoded as `<|bos|> text <|eos|>`; the documents are concatenated into one "
             f"token stream and training windows of {args.seq_len + 1} tokens start at uniformly random "
             f"offsets.\n")
    L.append("## Tokenizer\n")
    L.append(f"Byte-level BPE (`tokenizers`: ByteLevel pre-tokenizer without prefix space, ByteLevel decoder, "
             f"all 256 byte symbols in the base alphabet, min_frequency 2) trained on the training split; "
             f"vocab {MODEL_CONFIG['vocab_size']}, `<|bos|>` = 0, `<|eos|>` = 1. "
             f"`decode(encode(x)) == x` for all text. `encode()` with special tokens (the default) prepends "
             f"`<|bos|>` (TemplateProcessing post-processor); prompts are given to the model as "
             f"`[0] + tokens`, and generation should stop at `<|eos|>` (id 1). "
             f"{sum(len(d['text']) for d in train_docs) / len(train_stream):.2f} characters per token on the "
             f"training split.\n")
    L.append("## Model\n")
    L.append(f"{n_params} parameters ({n_params - n_embed} without embedding and lm_head; about {n_active} "
             f"active per token). config.json settings:\n")
    L.append("```json\n" + json.dumps(MODEL_CONFIG, indent=2) + "\n```\n")
    L.append("Checkpoint tensors follow transformers' save format: per-expert "
             "`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, `mlp.gate.weight` [8, hidden], "
             "`mlp.gate.e_score_correction_bias` [8], `mlp.shared_experts.*`, MLA projections `q_a_proj`, "
             "`q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`; all "
             "bfloat16.\n")
    L.append("## Training\n")
    L.append("| setting | value |\n|---|---|")
    rows = [("seed", args.seed), ("optimizer", "AdamW, betas (0.9, 0.95), eps 1e-8"),
            ("peak learning rate", args.lr), ("schedule", f"linear warmup {args.warmup} steps, cosine to "
                                                          f"{args.final_lr_frac} x peak"),
            ("weight decay", f"{args.weight_decay} (matrices/embeddings only)"), ("gradient clipping", args.grad_clip),
            ("steps", args.steps), ("batch", f"{args.batch_size} x {args.seq_len} tokens"),
            ("tokens seen", f"{tokens_seen} ({tokens_seen / len(train_stream):.1f} passes over the training split)"),
            ("loss", "next-token cross-entropy only (no auxiliary balance loss)"),
            ("load balancing", f"auxiliary-loss-free: after each step bias_e += {args.bias_gamma} * "
                               f"sign(mean_load - load_e) per MoE layer"),
            ("precision", "float32 training, saved as bfloat16"), ("threads", args.threads),
            ("training wall time", f"{train_seconds / 60:.1f} min ({train_seconds / args.steps:.2f} s/step)"),
            ("total wall time (corpus, tokenizer, training, evaluation)", f"{total_seconds / 60:.1f} min"),
            ("versions", ", ".join(f"{k} {v}" for k, v in versions.items()) + f", {platform.machine()}")]
    L += [f"| {k} | {v} |" for k, v in rows]
    L.append("\n### Loss curve\n")
    L.append("Training loss is the mean over the preceding logging interval; maxvio = max expert load / "
             "mean load - 1 per MoE layer (layers 1..3), averaged over the interval.\n")
    L.append("| step | train loss | lr | maxvio (layers 1-3) | held-out loss (ppl) |\n|---|---|---|---|---|")
    ev = {e["step"]: e for e in evals}
    for r in curve:
        if (r["step"] % (4 * args.log_every) == 0 or r["step"] in ev or r["step"] == args.log_every
                or r["step"] == args.steps):
            e = ev.get(r["step"])
            held = "" if e is None else f"{e['heldout_loss']:.3f} ({e['heldout_ppl']:.1f})"
            vio = " ".join(f"{v:.2f}" for v in r["max_violation"])
            L.append(f"| {r['step']} | {r['train_loss']:.3f} | {r['lr']:.2e} | {vio} | {held} |")
    L.append("\nFinal expert-selection biases (`e_score_correction_bias`, float32 before the bf16 cast):\n")
    for i, b in enumerate(biases):
        L.append(f"* layer {i + 1}: " + ", ".join(f"{v:+.3f}" for v in b))
    L.append("\n## Evaluation (saved bf16 checkpoint, loaded in float32)\n")
    L.append(f"Held-out perplexity per token over {n_scored} scored tokens (every held-out token and `<|eos|>` "
             f"is predicted once, `<|bos|>` targets excluded, windows of {args.seq_len}):\n")
    L.append("| model | perplexity |\n|---|---|")
    L.append(f"| uniform (vocab size) | {MODEL_CONFIG['vocab_size']} |")
    L.append(f"| unigram (training-split frequencies, add-one) | {unigram_ppl:.2f} |")
    L.append(f"| this model | {model_ppl:.2f} |\n")
    L.append(f"Greedy continuations (`generate(do_sample=False, max_new_tokens={args.gen_tokens})`, stops at "
             f"`<|eos|>`) of held-out prompts:\n")
    for g in generations[:3]:
        L.append(f"Prompt `{g['prompt']}` ({len(g['generated_ids'])} new tokens; prompt + continuation):\n")
        L.append("```text\n" + g["prompt"] + g["text"] + "\n```\n")
    L.append(f"\nCorpus-word fraction: over the first {min(10, len(generations))} prompts of "
             f"`heldout_prompts.json`, {n_in} of {n_words} whitespace-separated generated words "
             f"(= {word_frac:.1%}) are in `{words_file}` (the sorted set of whitespace-separated words of the "
             f"training split, punctuation attached as in the text). Words not found: "
             f"{sorted({w for g in generations[:10] for w in g['non_corpus_words']})}. "
             f"All continuations (with token ids) are in `reference_generations.json`. Note: generation must "
             f"stop at `<|eos|>`; a decoder that runs on past it and drops special tokens glues the next "
             f"document onto the last word (e.g. `node.Return`), which costs a few percent.\n")
    L.append("## Files\n")
    L += [f"* `{n}`: {s} bytes" for n, s in files.items() if n != "TRAINING.md"]
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    main()
