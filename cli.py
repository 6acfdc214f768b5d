"""Command-line entry points: parse and validate, print what was resolved, call a typed function.

This is the only module (with process start-up in runtime/) that reads environment variables.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import click

from .common.errors import OptionError, exit_on_error


class _Command(click.Command):
    """A command whose flag errors are one line and exit code 2, as its other errors are (click's own print the
    usage, a hint and a blank line first)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            click.echo(f"error: {e.format_message()}", err=True)
            sys.exit(2)


def _buckets(ctx, param, value):
    if value is None:
        return None
    try:
        return tuple(int(v) for v in str(value).split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers",
                                 param_hint=None if param is not None else "'--context-buckets'") from None


def _errors(fn):
    """Typed errors become one line on stderr and exit code 2; --debug shows the traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with exit_on_error(kwargs.pop("debug", False)):
            return fn(*args, **kwargs)
    return click.option("--debug", is_flag=True, help="Show tracebacks.")(wrapper)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        click.echo(f"error: environment variable {name}={v!r} is not an integer", err=True)
        sys.exit(2)


# -- deepinfer-compile ----------------------------------------------------------------------------------
@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="Hugging Face checkpoint directory (default: the embedded demo model). With --shape-only, a "
                   "config.json or a directory holding one.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True)
@click.option("--backend", type=click.Choice(["cpu", "eager", "cuda", "neuron"]), default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Activations, KV pool and math.")
@click.option("--weight-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="Storage of the weight matrices. cpu/eager with float32 math may keep them bfloat16: half the "
                   "memory and the bytes a decode step streams. auto: bfloat16 there when the checkpoint stores "
                   "its matrices in bf16 (served exactly), else --dtype.")
@click.option("--matmul-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="auto: --dtype. cpu/eager with float32 math: bfloat16 rounds the rows of every multi-row product (prefill chunks, decode "
                   "batches) to bf16 and sums in fp32, against bf16 weights: 2-3x the fp32 FLOP rate where the CPU "
                   "has bf16 dot products (AVX512-BF16, AMX), a little less exact (like transformers in bf16, "
                   "with fp32 norms, softmax, residuals and KV). One-row products stay exact.")
@click.option("--cp", type=int, default=1, show_default=True, help="Context-parallel ranks (KV sharded by block).")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel ranks.")
@click.option("--decode-buckets", callback=_buckets, default="1,8", show_default=True,
              help="Token counts of the prompt-as-decode graphs.")
@click.option("--prefill-buckets", callback=_buckets, default="128", show_default=True,
              help="Token counts of the prefill-chunk graphs ('' for none). With several, a lone long prompt "
                   "runs in the largest chunks, and prompts beside decoding sequences in the smallest.")
@click.option("--context-buckets", default="auto", show_default=True,
              help="Attention context lengths below the limit ('auto': 256, 1024, 4096, ... below it).")
@click.option("--context-limit", type=int, default=None, help="Longest sequence (default: min(model, 4096)).")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--num-kv-blocks", type=int, default=None,
              help="KV pool size in blocks, all CP ranks together (env DEEPINFER_NUM_KV_BLOCKS).")
@click.option("--moe-capacity", type=int, default=None,
              help="Static path: tokens one expert takes per prefill chunk.")
@click.option("--capacity-factor", type=float, default=2.0, show_default=True,
              help="Static path: capacity = factor * T * top_k / n_experts, when --moe-capacity is not given.")
@click.option("--moe-decode-path", type=click.Choice(["auto", "dense", "gather"]), default="auto", show_default=True,
              help="Decode MoE on the static path and on the CPU: every local expert (dense) or the chosen ones "
                   "(gather); auto: gather when T*top_k < local experts.")
@click.option("--moe-path", type=click.Choice(["auto", "grouped", "static"]), default="auto", show_default=True,
              help="grouped: exact grouped GEMMs (cpu, eager, cuda); static: capacity-grouped prefill with a dense "
                   "rerun on overflow, dense/gather decode (what Neuron takes). auto: static on neuron or with "
                   "--moe-capacity, else grouped.")
@click.option("--shared-experts", type=click.Choice(["auto", "grouped", "separate"]), default="auto",
              show_default=True,
              help="grouped: each rank's shared experts become more groups of the routed experts' grouped GEMMs "
                   "(needs --moe-path grouped and n_shared_experts divisible by --ep); separate: their own MLP. "
                   "auto: grouped wherever it can be.")
@click.option("--shape-only", is_flag=True, help="Compile from config.json alone (no weights, nothing to run).")
@click.option("--device-memory", type=float, default=None, help="GiB per rank; refuse layouts that do not fit.")
@click.option("--neuron-target", type=click.Choice(["trn1", "trn2", "inf2"]), default=None)
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Compile cache (env DEEPINFER_CACHE, default $XDG_CACHE_HOME/deepinfer where that is set, else "
                   "~/.cache/deepinfer).")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Graphs compiled in parallel (default: CPU count).")
@click.option("--keep-going", is_flag=True, help="Report every failing graph instead of stopping at the first.")
@click.option("--region-marks", is_flag=True,
              help="A profiling build: timing points between each layer's parts, so that DEEPINFER_REGION_TIMING "
                   "splits the layers into attention, MoE or MLP, and collectives. Each point costs a copy of "
                   "the hidden state and a host call; cpu, eager and cuda backends.")
@click.option("--check-lock", type=click.Path(path_type=Path), default=None,
              help="Compare the artifact's graph and weight hashes with this lock file; exit 1 on any difference.")
@click.option("--update-lock", type=click.Path(path_type=Path), default=None,
              help="Write this configuration's hashes into the lock file (a deliberate acceptance).")
@_errors
def compile_main(model, out, backend, dtype, weight_dtype, matmul_dtype, cp, ep, decode_buckets, prefill_buckets, context_buckets,
                 context_limit, block_size, num_kv_blocks, moe_capacity, capacity_factor, moe_decode_path,
                 moe_path, shared_experts, shape_only, device_memory, neuron_target, cache_dir, jobs, keep_going, region_marks, check_lock,
                 update_lock):
    """Trace and compile a DeepSeek-V3 checkpoint's graphs ahead of time into an artifact directory."""
    from .compile.driver import compile_artifact
    from .compile.options import DEMO_MODEL, CompileOptions
    if num_kv_blocks is None:
        num_kv_blocks = _env_int("DEEPINFER_NUM_KV_BLOCKS")
    if cache_dir is None and os.environ.get("DEEPINFER_CACHE"):
        cache_dir = Path(os.environ["DEEPINFER_CACHE"])
    opts = CompileOptions(
        model=model if model is not None else DEMO_MODEL, out=out, backend=backend, dtype=dtype, weight_dtype=weight_dtype,
        matmul_dtype=matmul_dtype,
        cp=cp, ep=ep, decode_buckets=decode_buckets, prefill_buckets=prefill_buckets,
        context_buckets="auto" if context_buckets == "auto" else _buckets(None, None, context_buckets),
        context_limit=context_limit, block_size=block_size, num_kv_blocks=num_kv_blocks, moe_capacity=moe_capacity,
        capacity_factor=capacity_factor, moe_decode_path=moe_decode_path, moe_path=moe_path,
        shared_experts=shared_experts, shape_only=shape_only,
        device_memory=None if device_memory is None else _gib(device_memory),
        neuron_target=neuron_target, cache_dir=cache_dir, keep_going=keep_going, jobs=jobs, region_marks=region_marks)
    from .compile.lock import read_lock
    for lock in (update_lock, check_lock):     # a bad lock file is said before the compile, not after it
        if lock is not None:
            read_lock(lock)
    if check_lock is not None and not check_lock.is_file():   # it could only end in "no lock entry"
        raise OptionError(f"--check-lock {check_lock}: no such lock file (--update-lock writes one)")
    report = compile_artifact(opts, log=lambda s: click.echo(s, err=True))
    if update_lock is not None:
        from .compile.lock import update_lock as write_lock
        key = write_lock(report.manifest, update_lock)
        click.echo(f"lock {update_lock}: wrote [{key}]", err=True)
    if check_lock is not None:
        from .compile.lock import check_lock as diff_lock
        from .compile.lock import lock_key
        diff = diff_lock(report.manifest, check_lock)
        if diff:
            click.echo(f"lock check FAILED against {check_lock} [{lock_key(report.manifest)}]:", err=True)
            for line in diff:
                click.echo(f"  {line}", err=True)
            sys.exit(1)
        click.echo(f"lock check ok: {len(report.manifest.graphs)} graphs and {len(report.manifest.weights)} "
                   f"weight shard(s) match {check_lock}", err=True)


# -- deepinfer-run --------------------------------------------------------------------------------------
@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifacts", type=click.Path(path_type=Path), default=Path("artifacts"))
@click.option("--prompt", "prompts", multiple=True,
              help="Prompt text (repeatable). Without --prompt, --prompt-ids or --verify-only: serve HTTP.")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Prompt as comma-separated token ids (repeatable).")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 or -1 (the server's and vLLM's): off.")
@click.option("--seed", type=int, default=None)
@click.option("--ignore-eos", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt: token_ids, text, ...")
@click.option("--verify-only", is_flag=True, help="Check every file and the toolchain against the manifest; exit.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1 (env DEEPINFER_API_KEY).")
@click.option("--max-waiting", type=click.IntRange(min=1), default=256, show_default=True, help="Waiting-queue bound (503 beyond).")
@click.option("--max-prefill-streak", type=click.IntRange(min=1), default=4, show_default=True,
              help="Prefill chunks first (they admit requests), but at most this many in a row while running "
                   "sequences wait for their next token: trades burst throughput/TTFT against TPOT stalls.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the graphs (default: OMP_NUM_THREADS where set, else all cores offline and one "
                   "fewer when serving, which leaves a core to the HTTP event loop instead of fighting "
                   "OpenMP's spinning threads for it).")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Reuse the KV of full blocks earlier requests left in the pool when a prompt starts with the "
                   "same tokens (shared system prompts, multi-turn chats, repeated prompts): those are not recomputed.")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="The model name(s) requests may ask for (repeatable; the first is the one responses and "
                   "/v1/models report); default: the artifact's name.")
@click.option("--num-speculative-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="Speculative decoding with n-gram drafts (prompt lookup, no draft model): up to this many "
                   "tokens a step, proposed from what followed the sequence's last tokens earlier in its prompt "
                   "and output, verified in the same decode step (outputs unchanged: greedy stays greedy, "
                   "sampling keeps its distribution); pays on text that repeats its context. 0 = off.")
@click.option("--prompt-lookup-min", type=click.IntRange(min=1), default=2, show_default=True,
              help="Shortest n-gram the drafts match.")
@click.option("--prompt-lookup-max", type=click.IntRange(min=1), default=4, show_default=True,
              help="Longest n-gram the drafts match (tried first).")
@click.option("--overlap/--no-overlap", default=None,
              help="Overlapped scheduling: launch the next decode step before this one's tokens reach the host "
                   "(they are fed to it on the device), so the accelerator does not wait while the host "
                   "detokenizes, checks stops and schedules (default: on for CUDA, off on the CPU, which runs the "
                   "step itself; env DEEPINFER_OVERLAP=1/0). Outputs are unchanged.")
@click.option("--warmup/--no-warmup", default=None,
              help="Before serving, run every compiled step shape once (default: on for GPU devices, where graphs "
                   "compile and decode steps are captured at first use; off on the CPU, whose graphs are built).")
@_errors
def run_main(artifacts, prompts, prompt_ids, max_tokens, temperature, top_p, top_k, seed, ignore_eos, as_json,
             verify_only, device, host, port, api_key, max_waiting, max_prefill_streak, prefix_caching, threads,
             served_model_names, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, overlap, warmup):
    """Load a compiled artifact and generate (--prompt) or serve OpenAI-compatible /v1/completions and
    /v1/chat/completions."""
    from .runtime.artifact import open_artifact
    from .runtime.engine import Engine
    from .runtime.sequence import SamplingParams
    from .runtime.model_runner import timing_requested
    timing = timing_requested()
    if any(not n.strip() for n in served_model_names):
        raise click.BadParameter("a model name must not be empty", param_hint="--served-model-name")
    if prompt_lookup_min > prompt_lookup_max:
        raise click.BadParameter(f"--prompt-lookup-min {prompt_lookup_min} is above --prompt-lookup-max "
                                 f"{prompt_lookup_max}", param_hint="--prompt-lookup-min")
    spec = dict(num_speculative_tokens=num_speculative_tokens, prompt_lookup_min=prompt_lookup_min,
                prompt_lookup_max=prompt_lookup_max, overlap=overlap)      # the engine's step options
    serving = not prompts and not prompt_ids and not verify_only
    _set_threads(threads, serving)
    if verify_only:
        art = open_artifact(artifacts, verify=True)
        m = art.manifest
        click.echo(f"ok: {artifacts}: {len(m.graphs)} graphs, {len(m.weights)} weight shard(s), "
                   f"{len(m.tokenizer)} tokenizer file(s) match the manifest (root hash {m.root_hash[:16]}); "
                   f"toolchain {m.toolchain.backend} torch {m.toolchain.torch} {m.toolchain.target}")
        return
    if not prompts and not prompt_ids:
        from .runtime.server import serve
        serve(artifacts, host=host, port=port, api_key=api_key or os.environ.get("DEEPINFER_API_KEY"),
              device=device, max_waiting=max_waiting, timing=timing, torchrun=_torchrun(),
              max_prefill_streak=max_prefill_streak, prefix_caching=prefix_caching, speculative=spec,
              served_model_names=list(served_model_names),
              warmup=device != "cpu" if warmup is None else warmup)
        return
    engine = Engine.from_artifact(artifacts, device=device, timing=timing, torchrun=_torchrun(),
                                  max_prefill_streak=max_prefill_streak, prefix_caching=prefix_caching, **spec)
    if engine is None:      # a torchrun follower rank: it served the leader until the end
        return
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=0 if top_k == -1 else top_k, seed=seed, ignore_eos=ignore_eos)
    inputs: list[tuple[str | None, list[int]]] = []
    for p in prompts:
        if engine.tokenizer is None:
            from .runtime.tokenizer import no_tokenizer
            raise no_tokenizer("--prompt")
        inputs.append((p, engine.tokenizer.encode(p)))
    for p in prompt_ids:
        try:
            inputs.append((None, [int(t) for t in p.split(",") if t.strip()]))
        except ValueError:
            raise click.BadParameter(f"{p!r} is not a comma-separated list of token ids",
                                     param_hint="--prompt-ids") from None
    try:
        seqs = engine.generate([ids for _, ids in inputs], params)
    finally:
        engine.close()
    for (text, ids), seq in zip(inputs, seqs):
        out = seq.output_text if engine.tokenizer is not None else None
        if as_json:
            click.echo(json.dumps({"prompt": text, "prompt_token_ids": ids, "token_ids": seq.output_ids,
                                   "text": out, "finish_reason": seq.finish_reason}))
        else:
            click.echo(f"{text if text is not None else ids}{out if out is not None else seq.output_ids}")
            click.echo(f"  [{len(ids)} prompt tokens, {len(seq.output_ids)} generated, finish: {seq.finish_reason}]",
                       err=True)
    if engine.runner.timer is not None:
        click.echo(engine.runner.timer.table(), err=True)
    if engine.torchrun:        # every output is written: end without tearing gloo down (see the function)
        from .runtime.distributed import exit_without_teardown
        exit_without_teardown(0)


def _gib(value: float) -> int:
    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"{value} must be a finite number of GiB > 0", param_hint="--device-memory")
    return int(value * (1 << 30))


def _set_threads(threads: int | None, serving: bool) -> None:
    import torch
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores - 1) if serving else cores
    torch.set_num_threads(threads)


def _torchrun() -> tuple[int, int] | None:
    """(rank, world) when started by torchrun (ranks on several hosts), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


# -- deepinfer-inspect ----------------------------------------------------------------------------------
@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifacts", type=click.Path(path_type=Path), default=Path("artifacts"))
@_errors
def inspect_main(artifacts):
    """Print an artifact's manifest as tables: layout, buckets, graphs with hashes, per-rank memory plan."""
    from .runtime.inspect import describe
    click.echo(describe(artifacts))


def bench_main():
    from .runtime.bench import main
    main()


@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifacts", type=click.Path(path_type=Path))
@click.option("--graph", "graphs", multiple=True, help="Finish only these graphs (repeatable).")
@_errors
def neuron_finish_main(artifacts, graphs):
    """Phase 2 of --backend neuron, on a Neuron host: trace every graph to a NEFF and update the manifest."""
    from .compile.neuron import finish
    m = finish(artifacts, only=list(graphs) or None, log=lambda s: click.echo(s, err=True))
    click.echo(f"{artifacts}: {sum(g.file.endswith('.neff.pt') for g in m.graphs)}/{len(m.graphs)} graphs "
               f"have NEFFs ({m.toolchain.compiler})", err=True)
