"""A human-readable view of an artifact's manifest (deepinfer-inspect)."""

from __future__ import annotations

from pathlib import Path

from .artifact import open_artifact


def _size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def describe(root: str | Path) -> str:
    # the root hash too (not the files, nor the toolchain: inspecting another machine's artifact is fine): an
    # edited manifest is said to be one, not described, or half described before a crash on what the edit broke
    m = open_artifact(root, verify=False, check_toolchain=False).manifest
    cc, mc, tc = m.compile, m.model, m.toolchain
    out = [f"artifact   {root}  (schema {m.schema_version}, root hash {m.root_hash})",
           f"model      {m.name}: {mc.num_hidden_layers} layers ({mc.num_hidden_layers - mc.num_moe_layers} dense), hidden "
           f"{mc.hidden_size}, heads {mc.num_attention_heads}, experts {mc.n_routed_experts} top-"
           f"{mc.num_experts_per_tok} (groups {mc.n_group}/{mc.topk_group}), shared {mc.n_shared_experts}, "
           f"vocab {mc.vocab_size}, rope {mc.rope.rope_type}",
           f"toolchain  {tc.backend} / torch {tc.torch} / python {tc.python} / {tc.target} / {tc.compiler}",
           f"compile    dtype {cc.dtype}{f' (weight matrices {cc.weight_dtype})' if cc.weight_dtype else ''}"
           f"{f', {cc.matmul_dtype} products (multi-row)' if cc.matmul_dtype else ''}, decode buckets {list(cc.decode_buckets)}, prefill buckets "
           f"{list(cc.prefill_buckets)}, moe {cc.moe_path}"
           f"{'' if cc.moe_path == 'grouped' else f' (capacity {list(cc.moe_capacity)})'}"
           f"{', shared experts as groups' if cc.shared_experts_grouped else ''}, context buckets "
           f"{list(cc.context_buckets)}, limit {cc.context_limit}{', region marks' if cc.region_marks else ''}",
           f"kv pool    {cc.num_kv_blocks} blocks x {cc.block_size} tokens x {mc.kv_cache_dim} "
           f"(latent {mc.kv_lora_rank} + rope {mc.qk_rope_head_dim}) x {mc.num_hidden_layers} layers",
           f"layout     world {m.layout.world} = max(cp {m.layout.cp}, ep {m.layout.ep}); {m.layout.kv_ownership}",
           "",
           "rank  cp  ep  experts        shared slice   kv blocks   weights      kv pool      activations  total"]
    mem = {r.rank: r for r in m.memory}
    for r in m.layout.ranks:
        rm = mem.get(r.rank)
        out.append(f"{r.rank:>4} {r.cp_rank:>3} {r.ep_rank:>3}  [{r.experts[0]:>4},{r.experts[1]:>4})  "
                   f"[{r.shared_slice[0]:>5},{r.shared_slice[1]:>5})  {r.kv_blocks:>9}   "
                   + (f"{_size(rm.weights_bytes):>11}  {_size(rm.kv_pool_bytes):>11}  "
                      f"{_size(rm.activations_bytes):>11}  {_size(rm.total):>11}" if rm else ""))
    out += ["", f"graphs ({len(m.graphs)})",
            "name                                   region       kind     T      C      graph hash        file"]
    for g in m.graphs:
        out.append(f"{g.name:<38} {g.region:<12} {g.kind:<8} {g.tokens:<6} {g.context or '-':<6} "
                   f"{g.graph_hash[:16]}  {g.file}")
    if m.weights:
        out += ["", "weights"] + [f"  rank {w.rank}: {w.path} {_size(w.bytes)} {w.num_tensors} tensors "
                                  f"sha256 {w.sha256[:16]}" for w in m.weights]
    else:
        out += ["", "weights    none (shape-only compile: this artifact describes a layout, it cannot run)"]
    if m.tokenizer:
        out += ["tokenizer  " + ", ".join(t.path for t in m.tokenizer)]
    return "\n".join(out)
