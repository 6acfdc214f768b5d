"""deepinfer-compile as a function: checkpoint + options -> a verified, atomically installed artifact."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..common import serde
from ..common.errors import CheckpointError, DeepinferError, OptionError
from ..common.manifest import (DECODE, MANIFEST_FILE, SCHEMA_VERSION, FileEntry, GraphEntry, Manifest, RankMemory,
                               WeightShard, sha256_file)
from ..common.model_config import ModelConfig
from ..common.toolchain import default_cache_dir
from ..runtime.ops import cpu_has_bf16_dot
from . import backends
from .checkpoint import Checkpoint
from .graphs import GraphPlan, export_graph, plan_graphs, sha256_bytes, traced_world
from .options import CompileOptions, make_layout, resolve
from .weights import DTYPES, check_checkpoint, shard_bytes, shard_specs, write_shard

Log = Callable[[str], None]


@dataclass
class CompileReport:
    manifest: Manifest
    seconds: float
    cache_hits: int
    cache_misses: int
    failed: list[str] = field(default_factory=list)


def load_model(o: CompileOptions) -> tuple[ModelConfig, Checkpoint | None]:
    if o.shape_only:
        path = o.model / "config.json" if o.model.is_dir() else o.model
        return ModelConfig.from_file(path), None
    ck = Checkpoint(o.model)
    check_checkpoint(ck.config, ck)
    ck.notes += _check_tokenizer(ck)
    return ck.config, ck


def _check_tokenizer(ck: Checkpoint) -> list[str]:
    """Load the tokenizer as the runtime will: one it cannot read fails the compile instead of every start of the
    artifact. Returns notes: tokens past the model's vocabulary (fine-tunes that added tokens without growing
    the embedding) are only refused in the prompts that hold them, as the runtime does."""
    from ..runtime.tokenizer import Tokenizer, generation_eos_ids
    path, cfg = ck.path / "tokenizer.json", ck.path / "tokenizer_config.json"
    gen = ck.path / "generation_config.json"      # copied into the artifact too, and read at every start
    if gen.is_file():
        try:
            generation_eos_ids(gen)
        except DeepinferError as e:
            raise CheckpointError(str(e)) from None
    if not path.is_file():
        return []
    try:
        tok = Tokenizer(path, cfg if cfg.is_file() else None, ck.config.bos_token_id)
    except DeepinferError as e:
        raise CheckpointError(str(e)) from None
    past = tok.ids_from(ck.config.vocab_size)
    if not past:
        return []
    return [f"{path.name} has {len(past)} token id(s) past the model's vocabulary [0, "
            f"{ck.config.vocab_size}) ({past[0]}..{past[-1]}); a prompt holding one is refused"]


def _stored_dtype(o: CompileOptions, ck: Checkpoint | None) -> str | None:
    """The checkpoint's weight-matrix dtype for --weight-dtype auto; a shape-only compile reads it from the
    safetensors headers when the directory has them (else auto means --dtype)."""
    if ck is not None:
        return ck.stored_matrix_dtype()
    if o.model.is_dir() and (any(o.model.glob("*.safetensors")) or (o.model / "model.safetensors.index.json").is_file()):
        try:
            return Checkpoint(o.model, require_weights=False).stored_matrix_dtype()
        except CheckpointError:
            return None
    return None


def compile_artifact(o: CompileOptions, log: Log = print) -> CompileReport:
    t0 = time.perf_counter()
    _check_out(o)
    m, ck = load_model(o)
    cc = resolve(o, m, _stored_dtype(o, ck))
    layout = make_layout(m, cc)
    tc = backends.toolchain(cc.backend, cc.neuron_target)
    plans = plan_graphs(m, cc)

    log(_describe(o, m, cc, len(plans)))
    if ck is not None:
        for note in ck.notes:
            log(f"note: {note}")
        log(_chat_note(ck))

    memory = memory_plan(m, cc, layout, plans)
    for ranks, r in _group_ranks(memory):
        log(f"memory {ranks}: weights {_gib(r.weights_bytes)}, kv pool {_gib(r.kv_pool_bytes)}, "
            f"activations {_gib(r.activations_bytes)}, total {_gib(r.total)} per rank")
    if cc.backend == "neuron" and o.device_memory is None:
        from .neuron import TARGET_MEMORY_GIB
        cap = TARGET_MEMORY_GIB[cc.neuron_target] << 30
        worst = max(memory, key=lambda r: r.total)
        verdict = "fits" if worst.total <= cap else "DOES NOT FIT"
        log(f"memory plan vs {cc.neuron_target} ({_gib(cap)} per rank): {verdict} "
            f"(largest rank needs {_gib(worst.total)}); pass --device-memory to refuse layouts that do not fit")
    for r in memory:
        if o.device_memory is not None and r.total > o.device_memory:
            raise OptionError(f"rank {r.rank} needs {_gib(r.total)} (weights {_gib(r.weights_bytes)} + kv pool "
                              f"{_gib(r.kv_pool_bytes)} + activations {_gib(r.activations_bytes)}) but "
                              f"--device-memory is {_gib(o.device_memory)}")

    out = o.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        (tmp / "graphs").mkdir()
        shards = _write_weights(m, cc, layout, ck, tmp, log) if ck is not None else []
        tok = _copy_tokenizer(ck, tmp)
        cache = backends.CompileCache(o.cache_dir or default_cache_dir())
        graphs, failed = _build_graphs(plans, cc, tc, tmp, cache, o.keep_going, o.jobs or os.cpu_count() or 1, log)
        name = Path(os.path.abspath(o.model)).name      # `--model .` too; symlinks keep their own name
        manifest = Manifest(schema_version=SCHEMA_VERSION, name=name, model=m, compile=cc, layout=layout,
                            graphs=tuple(graphs), weights=tuple(shards), tokenizer=tuple(tok), toolchain=tc,
                            memory=tuple(memory))
        manifest = _with_root_hash(manifest)
        if failed:
            raise DeepinferError(f"{len(failed)} graph(s) failed to compile: {', '.join(failed)}; "
                                 f"no artifact was installed")
        (tmp / MANIFEST_FILE).write_text(manifest.dumps())
        if cc.backend == "neuron":
            from .neuron import write_plan
            write_plan(tmp, manifest, final_root=out)
        install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if cc.backend == "neuron":
        manifest = _neuron_phase_two(out, manifest, log)
    secs = time.perf_counter() - t0
    log(f"wrote {out} ({len(graphs)} graphs, root hash {manifest.root_hash[:16]}) in {secs:.1f}s; "
        f"compile cache {cache.hits} hit(s), {cache.misses} miss(es) at {cache.root}")
    return CompileReport(manifest, secs, cache.hits, cache.misses, failed)


def _neuron_phase_two(out: Path, manifest: Manifest, log: Log) -> Manifest:
    """Finish the NEFFs here when this host has the Neuron SDK; otherwise say exactly how to."""
    from ..common.errors import BackendUnavailable
    from .neuron import finish, require_sdk
    try:
        require_sdk()
    except BackendUnavailable as e:
        log(f"neuron: prepared {out} (layout, weights, memory plan, {len(manifest.graphs)} portable graphs); "
            f"the NEFF step needs a Neuron host: {e}.")
        log(f"neuron: finish it there with: deepinfer-neuron-finish {out}   "
            f"(per-graph commands: {out}/neuron/compile.sh)")
        return manifest
    return finish(out, log=log)


def _with_root_hash(m: Manifest) -> Manifest:
    import dataclasses
    return dataclasses.replace(m, root_hash=m.compute_root_hash())


ARTIFACT_ENTRIES = ("graphs", "weights", "tokenizer", "neuron")     # what install() replaces in --out


def _check_out(o: CompileOptions) -> None:
    """Refuse an --out whose install would delete what is not an artifact's, before any work: a file, the
    checkpoint's own directory (or one around or inside it), or a directory without a manifest that holds
    entries an artifact would replace (an artifact's are replaced whole)."""
    out = o.out.resolve()
    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {o.out}: a file, not a directory")
    if o.model is not None:
        model = Path(o.model).resolve()
        if out == model or model in out.parents or out in model.parents:
            raise OptionError(f"--out {o.out}: is, holds or lies inside the checkpoint directory {o.model}; "
                              f"choose another directory")
    if out.is_dir() and not (out / MANIFEST_FILE).is_file():
        clash = sorted(e for e in ARTIFACT_ENTRIES if (out / e).exists())
        if clash:
            raise OptionError(f"--out {o.out}: not an artifact (no {MANIFEST_FILE}), yet it holds "
                              f"{', '.join(clash)}, which compiling there would replace; choose another directory")


def install(tmp: Path, out: Path) -> None:
    """Make `out` hold the new artifact. The manifest goes first out and last in, so an interrupted
    install leaves a directory the runtime refuses (no manifest), never a mix it would accept."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    for item in sorted(tmp.iterdir()):
        if item.name == MANIFEST_FILE:
            continue
        dst = out / item.name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        elif dst.exists():
            dst.unlink()
        os.replace(item, dst)
    os.replace(tmp / MANIFEST_FILE, out / MANIFEST_FILE)


def _write_weights(m, cc, layout, ck, tmp: Path, log: Log) -> list[WeightShard]:
    (tmp / "weights").mkdir()
    shards = []
    for r in layout.ranks:
        specs = shard_specs(m, cc, r)
        rel = f"weights/rank{r.rank}.safetensors"
        t = time.perf_counter()
        n = write_shard(tmp / rel, specs, ck, metadata={"rank": str(r.rank), "format": "pt"})
        log(f"[weights {r.rank + 1}/{layout.world}] {rel}: {len(specs)} tensors, {_gib(n)} "
            f"({time.perf_counter() - t:.1f}s)")
        shards.append(WeightShard(rank=r.rank, path=rel, sha256=sha256_file(tmp / rel), bytes=n,
                                  num_tensors=len(specs)))
    return shards


def _chat_note(ck: Checkpoint) -> str:
    """What /v1/chat/completions will have: the checkpoint's chat template, none, or one that cannot be used."""
    from ..runtime.chat import load_chat_template
    try:
        t = load_chat_template(ck.path, {f.name for f in ck.tokenizer_files})
    except DeepinferError as e:
        return f"warning: chat will be off: {e}"
    return f"chat: template from {Path(t.origin).name}" if t else "chat: no chat template in the checkpoint"


def _copy_tokenizer(ck: Checkpoint | None, tmp: Path) -> list[FileEntry]:
    if ck is None:
        return []
    entries = []
    (tmp / "tokenizer").mkdir()
    for f in ck.tokenizer_files:
        rel = f"tokenizer/{f.name}"
        shutil.copyfile(f, tmp / rel)
        entries.append(FileEntry(path=rel, sha256=sha256_file(tmp / rel), bytes=(tmp / rel).stat().st_size))
    return entries


def _build_graphs(plans: list[GraphPlan], cc, tc, tmp: Path, cache, keep_going: bool, jobs: int, log: Log):
    """Export every graph here (fast, and the source of the hashes), then compile the cache misses,
    `jobs` at a time in worker processes. Entries come back in plan order whatever finishes first."""
    suffix = backends.SUFFIX[cc.backend]
    done: dict[str, GraphEntry] = {}
    failed: list[str] = []
    pending: list[tuple[GraphPlan, str, str, str]] = []   # plan, ir sha, graph hash, file
    t_all = time.perf_counter()

    def record(plan: GraphPlan, ir_sha: str, ghash: str, rel: str, status: str, secs: float) -> None:
        done[plan.name] = GraphEntry(
            name=plan.name, region=plan.spec.region, kind=plan.spec.kind, tokens=plan.spec.tokens,
            context=plan.spec.context, file=rel, ir_sha256=ir_sha, graph_hash=ghash,
            file_sha256=sha256_file(tmp / rel), inputs=plan.inputs, weights=plan.weights, outputs=plan.outputs)
        log(f"[graph {len(done)}/{len(plans)}] {plan.name}{status} {secs:.1f}s, "
            f"elapsed {time.perf_counter() - t_all:.0f}s")

    def fail(plan: GraphPlan, err: str) -> None:
        failed.append(plan.name)
        log(f"[graph {plan.name}] FAILED: {err}")
        if not keep_going:
            raise DeepinferError(f"graph {plan.name} failed to compile: {err} (use --keep-going to build the others)")

    for plan in plans:
        t = time.perf_counter()
        try:
            ep, ir = export_graph(plan)
        except Exception as e:  # a tracing failure: name the graph
            fail(plan, _one_line(e))
            continue
        ir_rel = f"graphs/{plan.name}.ep.pt2"
        (tmp / ir_rel).write_bytes(ir)
        ir_sha = sha256_bytes(ir)
        ghash = backends.graph_hash(ir_sha, tc, cc.dtype)
        if suffix is None:
            record(plan, ir_sha, ghash, ir_rel, "", time.perf_counter() - t)
            continue
        rel = f"graphs/{plan.name}{suffix}"
        if backends.fetch(cache, cc.backend, ghash, tmp / rel):
            record(plan, ir_sha, ghash, rel, " (cached)", time.perf_counter() - t)
        else:
            pending.append((plan, ir_sha, ghash, rel))

    if pending:
        log(f"compiling {len(pending)} graph(s) with {cc.backend}, {min(jobs, len(pending))} at a time")
    for plan, ir_sha, ghash, rel, err, secs in _compile_pending(pending, cc.backend, tmp, cache.root, jobs):
        if err is not None:
            fail(plan, err)
            continue
        cache.misses += 1
        cache.put(ghash, suffix, tmp / rel)
        record(plan, ir_sha, ghash, rel, " (compiled)", secs)
    return [done[p.name] for p in plans if p.name in done], failed


def _compile_pending(pending, backend: str, tmp: Path, cache_root: Path, jobs: int):
    """Compile in worker processes (fresh interpreters started by path, so callers' scripts need no
    `if __name__ == "__main__"` guard), `jobs` at a time; yields results as they finish."""
    if not pending:
        return
    if jobs <= 1 or len(pending) == 1:
        for plan, ir_sha, ghash, rel in pending:
            yield (plan, ir_sha, ghash, rel, *_compile_worker(plan, backend, str(tmp / rel), str(cache_root), ir_sha))
        return
    work = tmp / ".work"
    work.mkdir(exist_ok=True)

    def run(i: int, item):
        plan, ir_sha, ghash, rel = item
        job = work / f"job{i}.pkl"
        job.write_bytes(pickle.dumps((plan, backend, str(tmp / rel), str(cache_root), ir_sha)))
        proc = subprocess.run([sys.executable, "-c", "from deepinfer.compile.driver import worker_main; "
                               f"worker_main({str(job)!r})"], capture_output=True, text=True)
        result = job.with_suffix(".json")
        if proc.returncode != 0 or not result.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return (*item, f"compiler worker exited with code {proc.returncode}: {tail[0][:300]}", 0.0)
        err, secs = json.loads(result.read_text())
        return (*item, err, secs)

    with ThreadPoolExecutor(max_workers=min(jobs, len(pending))) as pool:
        futs = [pool.submit(run, i, item) for i, item in enumerate(pending)]
        for fut in as_completed(futs):
            yield fut.result()


def worker_main(job: str) -> None:
    """Entry point of a compile worker process."""
    args = pickle.loads(Path(job).read_bytes())
    err, secs = _compile_worker(*args)
    Path(job).with_suffix(".json").write_text(json.dumps([err, secs]))


def _compile_worker(plan: GraphPlan, backend: str, dest: str, cache_root: str, ir_sha: str):
    """Re-export (deterministic: the IR hash must match the parent's) and compile one graph."""
    t = time.perf_counter()
    try:
        with traced_world(plan.spec.world):      # the compiler resolves the collectives' group too
            ep, ir = export_graph(plan)
            if sha256_bytes(ir) != ir_sha:
                return f"non-deterministic export: IR hash {sha256_bytes(ir)[:12]} != {ir_sha[:12]}", 0.0
            backends.compile_file(backend, ep, Path(dest), Path(cache_root))
    except Exception as e:  # compiler failures come back as text, with the graph named by the caller
        return _one_line(e), time.perf_counter() - t
    return None, time.perf_counter() - t


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


# -- memory plan -----------------------------------------------------------------------------------
def memory_plan(m: ModelConfig, cc, layout, plans: list[GraphPlan]) -> list[RankMemory]:
    elt = torch.tensor([], dtype=DTYPES[cc.dtype]).element_size()
    kv = m.num_hidden_layers * (cc.kv_blocks_per_rank + 1) * cc.block_size * m.kv_cache_dim * elt
    act = max(_activation_bytes(m, p, elt) + _widened_bytes(m, cc, p) for p in plans)
    return [RankMemory(rank=r.rank, weights_bytes=shard_bytes(shard_specs(m, cc, r)), kv_pool_bytes=kv,
                       activations_bytes=act) for r in layout.ranks]


def _activation_bytes(m: ModelConfig, p: GraphPlan, elt: int) -> int:
    """A generous estimate of one graph's live intermediates (the largest few tensors at once)."""
    s = p.spec
    T, D, H = s.tokens, m.hidden_size, m.num_attention_heads
    if s.region in ("embed", "head"):
        return T * D * elt + (s.logit_rows * m.vocab_size * 4 if s.region == "head" else 0)
    attn = 0
    if s.context:
        rows = s.rows
        attn = rows * s.context * m.kv_cache_dim * elt + 2 * T * H * s.context * 4 + T * H * m.kv_cache_dim * 4
    E, I = s.expert_groups, m.moe_intermediate_size
    if s.moe_path == "grouped":
        experts = T * (m.num_experts_per_tok + s.shared_groups) * (3 * I + 2 * D) * 4   # sorted pairs: x, gate/up, down
    elif s.kind == DECODE:
        experts = (E * T if s.moe_path == "dense" else T * (m.num_experts_per_tok + s.shared_groups)) * (3 * I + D) * 4
    else:
        experts = E * max(s.capacity, 1) * (3 * I + D) * 4 + E * T * (3 * I + D) * 4  # capacity + dense rerun
    dense = 3 * T * m.intermediate_size * elt
    return 6 * T * D * 4 + max(attn, experts, dense)


def _widened_bytes(m: ModelConfig, cc, p: GraphPlan) -> int:
    """bf16 weights under float32 math: the float32 copy a graph makes of a weight its loops cannot widen as
    they read (GEMMs over more than the small-GEMM rows: one projection; the static path's batched experts: all
    of a layer's local experts at once)."""
    if not cc.weight_dtype:
        return 0
    s = p.spec
    big = 0 if s.bf16_products else max(   # bf16 products read the bf16 weights as they are
        (math.prod(w.shape) for w in p.weight_specs if len(w.shape) >= 2 and "experts_" not in w.name), default=0)
    if s.moe_path in ("capacity", "dense") and s.region in ("moe_layer", "moe_dense"):
        big = max(big, 3 * s.local_experts * m.moe_intermediate_size * m.hidden_size)
    return 4 * big


def _group_ranks(memory: list[RankMemory]) -> list[tuple[str, RankMemory]]:
    """Runs of ranks with the same plan, e.g. ('ranks 0-63', plan)."""
    groups: list[tuple[int, int, RankMemory]] = []
    for r in memory:
        key = (r.weights_bytes, r.kv_pool_bytes, r.activations_bytes)
        if groups and (groups[-1][2].weights_bytes, groups[-1][2].kv_pool_bytes,
                       groups[-1][2].activations_bytes) == key:
            groups[-1] = (groups[-1][0], r.rank, groups[-1][2])
        else:
            groups.append((r.rank, r.rank, r))
    return [(f"rank {a}" if a == b else f"ranks {a}-{b}", r) for a, b, r in groups]


def _gib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _bf16_products_would_help(cc) -> bool:
    """bf16 weight matrices multiplied in float32 on a CPU whose bf16 dot products could take them: the default
    for a bf16 checkpoint (the choice stays explicit: it changes the numbers, and a CPU-dependent default would make
    the artifact's hashes depend on the compiling machine)."""
    return (cc.backend in ("cpu", "eager") and cc.weight_dtype == "bfloat16" and cc.dtype == "float32"
            and cc.matmul_dtype is None and cpu_has_bf16_dot())


def _describe(o: CompileOptions, m: ModelConfig, cc, n_graphs: int) -> str:
    lines = ["deepinfer-compile, resolved options:",
             f"  model            {o.model}{' (shape only: config.json, no weights)' if o.shape_only else ''}",
             f"  out              {o.out}",
             f"  backend          {cc.backend}{' target ' + cc.neuron_target if cc.neuron_target else ''}",
             f"  dtype            {cc.dtype}"
             + (f" (weight matrices stored {cc.weight_dtype})" if cc.weight_dtype else "")
             + (f", {cc.matmul_dtype} products (multi-row)" if cc.matmul_dtype else "")
             + ("; this CPU has no bf16 dot products (AVX512-BF16/AMX): they run as float32 FMAs of the rounded "
                "operands, no faster than float32 math" if cc.matmul_dtype == "bfloat16" and not cpu_has_bf16_dot()
                else "")
             + ("\n                   hint: this CPU has bf16 dot products; --matmul-dtype bfloat16 would put the "
                "multi-row\n                   products on them, a little less exact (the `mid-bf16` benchmark model: "
                "prefill 1.7x,\n                   16-sequence decode 1.2x; the small demo model: prefill 1.08x, "
                "16 sequences 0.88x;\n                   README: Performance)" if _bf16_products_would_help(cc) else ""),
             f"  layout           cp={cc.cp} ep={cc.ep} world={cc.world}",
             f"  decode buckets   {', '.join(map(str, cc.decode_buckets))}",
             f"  prefill buckets  {', '.join(map(str, cc.prefill_buckets)) or '(none)'}",
             f"  moe path         {cc.moe_path}"
             + ("" if cc.moe_path == "grouped" else
                f" (capacity {', '.join(map(str, cc.moe_capacity)) or '-'}"
                f"{f', factor {cc.capacity_factor}' if cc.capacity_factor else ''}; decode {cc.moe_decode_path})")
             + (f"; shared experts as {cc.shared_groups(m)} more group(s) of each rank's grouped GEMMs"
                if cc.shared_experts_grouped else ""),
             f"  context buckets  {', '.join(map(str, cc.context_buckets))} (limit {cc.context_limit})",
             f"  kv pool          {cc.num_kv_blocks} blocks x {cc.block_size} tokens "
             f"({cc.kv_blocks_per_rank} per rank)",
             f"  model            {m.num_hidden_layers} layers ({m.num_hidden_layers - m.num_moe_layers} dense), hidden "
             f"{m.hidden_size}, {m.n_routed_experts} experts top-{m.num_experts_per_tok}, vocab {m.vocab_size}",
             f"  graphs           {n_graphs}"
             + (" (profiling build: region marks in the layer graphs)" if cc.region_marks else "")]
    return "\n".join(lines)


def dumps_options(o: CompileOptions) -> str:
    return serde.dumps(o)
