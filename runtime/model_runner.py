"""Run one scheduled step through the compiled region graphs: embed -> layers -> head.

The step's host metadata (`StepInputs`) is all a rank needs besides its own weights and KV shard, so the
same record drives the leader and, through shared memory, its followers.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..common.errors import ArtifactError
from ..common.manifest import (DECODE, DENSE_LAYER, EMBED, HEAD, MOE_DENSE, MOE_LAYER, PREFILL, CompileConfig,
                               Manifest, graph_name)
from .block_manager import blocks_for
from .ops import MARK_CONTINUE, MARK_PARTS, set_mark_sink
from .sampler import host_to_device
from .scheduler import ScheduledStep

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StepInputs:
    kind: str
    tokens: int
    context: int
    token_ids: np.ndarray       # [T] int64
    positions: np.ndarray       # [T] int64
    slot_mapping: np.ndarray    # [T] int64, -1 = padding
    block_tables: np.ndarray    # [R, B] int64, -1 = no block
    logit_indices: np.ndarray   # [L] int64
    num_logits: int             # real rows of the logits
    context_starts: np.ndarray  # [T] int64, prefill: the token's sequence's first slot in the packed context
    # A chained step (Scheduler.chain): token_ids[fed_rows] come from `fed_tokens[fed_from]`, the step before's
    # sampled tokens on the device, written into the device's copy of token_ids before the graphs run
    fed_rows: np.ndarray | None = None
    fed_from: np.ndarray | None = None
    fed_tokens: torch.Tensor | None = None

    def feed(self, token_ids: torch.Tensor) -> None:
        """Write the fed tokens into the step's token ids on the device (no host sync)."""
        if self.fed_rows is None:
            return
        n = len(self.fed_rows)
        if np.array_equal(self.fed_rows, np.arange(n)) and np.array_equal(self.fed_from, np.arange(n)):
            token_ids[:n].copy_(self.fed_tokens[:n])
        else:
            rows, src = (host_to_device(a, token_ids.device) for a in (self.fed_rows, self.fed_from))
            token_ids[rows] = self.fed_tokens[src]


def logit_rows(step: ScheduledStep) -> list[tuple[int, int]]:
    """Per entry, (its first row in the step's logits, how many): every position's with all_logits (prompt
    logprobs; the last one is the sampled row when it wants logits), else its last token's if it wants logits."""
    out, r = [], 0
    for e in step.entries:
        n = e.num_tokens if e.every_row else int(e.wants_logits)
        out.append((r, n))
        r += n
    return out


# An entry of this many tokens up fills the step's arrays with numpy slices; fewer (a decode step's one token a
# sequence, a draft's few) take the loop a token, whose scalar writes cost less than the slices' calls. One prompt's
# inputs: 125 -> 49 us for a 256-token chunk, 435 -> 50 us for a 1024-token one (a 16-sequence decode step's 30-60 us
# unchanged).
VECTOR_MIN_TOKENS = 8


def build_inputs(step: ScheduledStep, cc: CompileConfig) -> StepInputs:
    """The step's host tensors. Decode: one table row per token. Prefill: one row holding the packed sequences'
    block lists back to back (each up to the block holding its last token in this chunk), and logits rows for
    the one-row head or, when several packed prompts want logits, the packed head, or, when a prompt's logprobs
    are wanted, the head over every row of the chunk."""
    T, C, block_size = step.tokens, step.context, cc.block_size
    B = C // block_size
    rows = T if step.kind == DECODE else 1
    wanted = sum(e.wants_logits for e in step.entries)
    if step.kind == DECODE or any(e.all_logits for e in step.entries):
        L = T
    else:
        L = cc.prefill_seqs(T) if wanted > 1 else 1
    token_ids = np.zeros(T, np.int64)
    positions = np.zeros(T, np.int64)
    slots = np.full(T, -1, np.int64)
    tables = np.full((rows, B), -1, np.int64)
    logit_idx = np.zeros(L, np.int64)
    starts = np.zeros(T, np.int64)
    t = n_logits = packed = 0      # packed: blocks of the prefill row used so far
    decode = step.kind == DECODE
    fed_rows, fed_from = [], []
    for e in step.entries:
        seq, n = e.seq, e.num_tokens
        end = e.start + n
        # numpy takes the list itself (np.asarray first doubled the cost of a decode step's tables)
        if decode:
            table = seq.block_table[:B]
        else:
            table = seq.block_table[: blocks_for(end, block_size)]
            tables[0, packed: packed + len(table)] = table
            starts[t: t + n] = packed * block_size
            packed += len(table)
        every, last = e.every_row, end - 1 if e.wants_logits else -1
        if n >= VECTOR_MIN_TOKENS:   # a prompt's chunk: numpy over its positions, not a Python loop a token
            pos = np.arange(e.start, end)
            if e.fed < 0:
                token_ids[t: t + n] = seq.tokens(e.start, end)
            else:
                fed_rows += range(t, t + n)
                fed_from += [e.fed] * n
            positions[t: t + n] = pos
            first = e.start // block_size
            blocks = np.asarray(seq.block_table[first: (end - 1) // block_size + 1], np.int64)
            slots[t: t + n] = blocks[pos // block_size - first] * block_size + pos % block_size
            if decode:
                tables[t: t + n, : len(table)] = table
            if every:
                logit_idx[n_logits: n_logits + n] = np.arange(t, t + n)
                n_logits += n
            elif last >= 0:
                logit_idx[n_logits] = t + n - 1
                n_logits += 1
            t += n
            continue
        for pos in range(e.start, end):
            if e.fed < 0:
                token_ids[t] = seq.token_at(pos)
            else:                     # still on the device: StepInputs.feed
                fed_rows.append(t)
                fed_from.append(e.fed)
            positions[t] = pos
            slots[t] = seq.block_table[pos // block_size] * block_size + pos % block_size
            if decode:
                tables[t, : len(table)] = table
            if every or pos == last:
                logit_idx[n_logits] = t
                n_logits += 1
            t += 1
    si = StepInputs(step.kind, T, C, token_ids, positions, slots, tables, logit_idx, n_logits, starts)
    if fed_rows:
        si.fed_rows, si.fed_from = np.array(fed_rows, np.int64), np.array(fed_from, np.int64)
    return si


def timing_requested() -> bool:
    """DEEPINFER_REGION_TIMING set (to anything but 0)."""
    return os.environ.get("DEEPINFER_REGION_TIMING", "") not in ("", "0")


class RegionTimer:
    """Per-region wall time per step kind (DEEPINFER_REGION_TIMING=1); synchronises CUDA when timing.
    Regions: the graphs (embed, dense_layer and moe_layer, head, moe_dense reruns) and the host's share,
    `schedule` (scheduling, the step's inputs, the followers' record) and `sample` (sampling, detokenizing, stop
    checks). A layer graph holds its attention, MoE or MLP and traced collectives; in an artifact compiled with
    --region-marks, its marks (runtime/ops.py `region_mark`) split its time into those parts, listed under it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[tuple[str, str], float] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self.steps: dict[str, int] = {}
        self.parts: dict[tuple[str, str, str], float] = {}     # (kind, region, part) -> seconds
        self._marks: list[tuple[int, float]] = []
        torch.ops.deepinfer.region_mark(torch.zeros(1), 0)   # the op's first call sets it up (~1 s): not in a step

    def reset(self) -> None:
        """Forget what was timed so far (a benchmark's warm-up, its earlier rows)."""
        self.totals.clear()
        self.counts.clear()
        self.steps.clear()
        self.parts.clear()

    def add(self, kind: str, region: str, seconds: float) -> None:
        k = (kind, region)
        self.totals[k] = self.totals.get(k, 0.0) + seconds
        self.counts[k] = self.counts.get(k, 0) + 1

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_graph(self, kind: str, region: str, fn: Callable, *args):
        """fn(*args), its time added to the region and split among the parts its marks close."""
        self._marks = []
        set_mark_sink(self._mark)
        try:
            self.sync()
            t0 = time.perf_counter()
            out = fn(*args)
            self.sync()
            t1 = time.perf_counter()
        finally:
            set_mark_sink(None)
        self.add(kind, region, t1 - t0)
        split: dict[str, float] = {}
        prev, carry, last = t0, 0.0, None
        for code, t in self._marks:
            segment, prev = t - prev, t
            if code == MARK_CONTINUE:        # work before a collective: the enclosing part's, added when it closes
                carry += segment
            elif MARK_PARTS[code] == "collectives":
                split["collectives"] = split.get("collectives", 0.0) + segment
            else:
                last = MARK_PARTS[code]
                split[last] = split.get(last, 0.0) + carry + segment
                carry = 0.0
        if split:                            # after the last mark: the graph returning, with the last part
            last = last or next(iter(split))
            split[last] += carry + t1 - prev
        for part, seconds in split.items():
            self.parts[(kind, region, part)] = self.parts.get((kind, region, part), 0.0) + seconds
        return out

    def _mark(self, code: int) -> None:
        self.sync()
        self._marks.append((code, time.perf_counter()))

    def table(self) -> str:
        rows = ["step kind  region        calls   total ms   ms/step"]
        for kind in sorted({k for k, _ in self.totals}):
            steps = max(self.steps.get(kind, 1), 1)
            regions = sorted((r, tot) for (k, r), tot in self.totals.items() if k == kind)
            for region, tot in regions + [("(step)", sum(t for _, t in regions))]:
                calls = self.counts.get((kind, region), self.steps.get(kind, 0))
                rows.append(f"{kind:<10} {region:<12} {calls:>6} {tot * 1e3:>10.1f} {tot * 1e3 / steps:>9.3f}")
                for (k, r, part), ptot in sorted(self.parts.items()):
                    if (k, r) == (kind, region):
                        rows.append(f"{'':<10}   {part:<10} {calls:>6} {ptot * 1e3:>10.1f} {ptot * 1e3 / steps:>9.3f}")
        if not self.parts and any(r in (DENSE_LAYER, MOE_LAYER) for _, r in self.totals):
            rows.append("layer graphs timed whole: an artifact compiled with --region-marks splits them into attention, "
                        "moe or mlp, and collectives")
        return "\n".join(rows)


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that did not fit: torch's OutOfMemoryError, Python's MemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def _weight(weights: dict[str, torch.Tensor], w, layer: int, graph: str) -> torch.Tensor:
    """Layer `layer`'s tensor for a graph's weight argument `w` (a manifest WeightArg), as the manifest lists it: a
    shard whose tensors differ (its hash rewritten with it) fails here, not as a crash or wrong output."""
    name = w.source.format(layer=layer)
    t = weights.get(name)
    if t is None:
        raise ArtifactError(f"the weight shard has no tensor {name!r}, which graph {graph} takes as {w.key!r}; "
                            f"the artifact is damaged")
    dtype = str(t.dtype).removeprefix("torch.")
    if tuple(t.shape) != tuple(w.shape) or dtype != w.dtype:
        raise ArtifactError(f"weight {name!r} is {list(t.shape)} {dtype} in the shard, {list(w.shape)} {w.dtype} "
                            f"in the manifest; the artifact is damaged")
    return t


class ModelRunner:
    """One rank's graphs, weights and KV pool. `graphs` maps graph names to callables."""

    def __init__(self, manifest: Manifest, graphs: dict[str, Callable], weights: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu", timer: RegionTimer | None = None):
        self.manifest = manifest
        self.device = torch.device(device)
        self.graphs = graphs
        self.timer = timer
        m, cc = manifest.model, manifest.compile
        self.num_layers = m.num_hidden_layers
        dtype = DTYPES[cc.dtype]
        shape = (cc.kv_blocks_per_rank + 1, cc.block_size, m.kv_cache_dim)
        try:
            self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(m.num_hidden_layers)]
        except (RuntimeError, MemoryError) as e:
            if not _out_of_memory(e):     # a device fault (AcceleratorError is a RuntimeError too) goes up as it is
                raise
            gib = math.prod(shape) * dtype.itemsize * m.num_hidden_layers / 2**30
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ArtifactError(f"the KV pool ({cc.kv_blocks_per_rank} blocks a rank, {gib:.1f} GiB) does not fit "
                                f"on {self.device} ({why[:200]}); recompile with a smaller --num-kv-blocks") from None
        entries = {g.name: g for g in manifest.graphs}
        # Per region: the weight dict of each layer (or the single global one), built once.
        self.layer_weights: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        layers_of = {EMBED: [0], HEAD: [0],
                     DENSE_LAYER: [i for i in range(self.num_layers) if not m.is_moe_layer(i)],
                     MOE_LAYER: [i for i in range(self.num_layers) if m.is_moe_layer(i)]}
        layers_of[MOE_DENSE] = layers_of[MOE_LAYER]
        for region, layers in layers_of.items():
            g = next((e for e in entries.values() if e.region == region), None)
            if g is not None:
                self.layer_weights[region] = {
                    i: {w.key: _weight(weights, w, i, g.name) for w in g.weights} for i in layers}
        self.dense_layers = [i for i in range(self.num_layers) if not m.is_moe_layer(i)]
        self.step_graphs = None              # CUDA: whole steps replayed as CUDA graphs (cuda_graphs.py)
        for name, fn in graphs.items():      # backends whose graphs hold weights as device state (Neuron)
            if hasattr(fn, "bind"):
                region = entries[name].region
                for i, w in self.layer_weights[region].items():
                    fn.bind(w, self.kv_caches[i] if region in (DENSE_LAYER, MOE_LAYER) else None)
        self.overflow_reruns = 0
        self.static_moe = cc.moe_path == "static"     # prefill MoE layers flag overflows for a dense rerun

    def _call(self, kind: str, region: str, name: str, *args):
        fn = self.graphs[name]
        if self.timer is None:
            return fn(*args)
        return self.timer.time_graph(kind, region, fn, *args)

    @torch.inference_mode()
    def run(self, si: StepInputs) -> torch.Tensor:
        """Run the step; returns logits [num_logits, V]: fp32 on the CPU, or as the graph made them on an
        accelerator, where the sampler works on them before anything leaves the device (a 32 x 102400 fp32
        copy and host-side sampling are milliseconds a step). Read them before the next step: on
        CUDA they are the step graph's output buffer."""
        if self.timer is not None:
            self.timer.steps[si.kind] = self.timer.steps.get(si.kind, 0) + 1
        if self.step_graphs is not None:
            logits = self.step_graphs.run(si)
        else:
            logits = self.forward(si.kind, si.tokens, si.context, *self.to_device(si))
        logits = logits[: si.num_logits]
        return logits.float() if logits.device.type == "cpu" else logits

    def to_device(self, si: StepInputs) -> tuple[torch.Tensor, ...]:
        arrays = (si.token_ids, si.positions, si.slot_mapping, si.block_tables, si.logit_indices, si.context_starts)
        out = tuple(host_to_device(a, self.device) for a in arrays)
        si.feed(out[0])         # (on the CPU, into the host's array itself: it then holds the real tokens)
        return out

    def forward(self, kind: str, T: int, C: int, token_ids, positions, slots, tables, logit_idx,
                context_starts) -> torch.Tensor:
        """embed -> every layer -> head, on the device. Decode steps make no host syncs (CUDA-graph safe);
        on the static MoE path, prefill chunks read each MoE layer's overflow flag to decide on the dense rerun."""
        h = _first(self._call(kind, EMBED, graph_name(EMBED, kind, T), token_ids, self.layer_weights[EMBED][0]))
        extra = (context_starts,) if kind == PREFILL else ()
        for i in range(self.num_layers):
            region = DENSE_LAYER if i in self.dense_layers else MOE_LAYER
            name = graph_name(region, kind, T, C)
            w = self.layer_weights[region][i]
            out = self._call(kind, region, name, h, positions, slots, tables, self.kv_caches[i], *extra, w)
            if region == MOE_LAYER and kind == PREFILL and self.static_moe:
                h, h_mid, overflow = out
                if bool(overflow):
                    self.overflow_reruns += 1
                    h = _first(self._call(kind, MOE_DENSE, graph_name(MOE_DENSE, kind, T), h_mid,
                                          self.layer_weights[MOE_DENSE][i]))
            else:
                h = _first(out)
        head = graph_name(HEAD, kind, T, logit_rows=logit_idx.shape[0])
        return _first(self._call(kind, HEAD, head, h, logit_idx, self.layer_weights[HEAD][0]))


def _first(out):
    """Exported modules return a tensor, AOTInductor packages a list: take the single output."""
    return out[0] if isinstance(out, (tuple, list)) else out
