"""Whole steps replayed as CUDA graphs: one graph per (kind, tokens, context, logit rows) shape.

A step is every region graph of every layer, launched back to back; captured once, it replays as one launch,
so the host's per-kernel launch gaps disappear. Inputs go through static buffers (copied in before each
replay); the KV pools and weights are already static device tensors. The grouped MoE path makes no host syncs
(the grouped GEMM reads its offsets on the device), so decode steps and prefill chunks both capture. On the
static MoE path prefill chunks read each layer's overflow flag on the host, so there only decode steps do.

Why prefill too: a 512-token chunk of the V2-Lite-size model ran 17 ms of kernels on the H200 but took
30-52 ms launched one by one (host-bound: ~1000 kernel launches through Python), against transformers'
46-67 ms; a 2048-token chunk (45 ms) is kernel-bound either way.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..common.manifest import DECODE, PREFILL
from .cuda_kernels import CaptureFailed, capturing
from .model_runner import ModelRunner, StepInputs

log = logging.getLogger("deepinfer")

Key = tuple[str, int, int, int]     # (step kind, token bucket, context bucket, logit rows)
# Logit rows are part of the shape: a prefill chunk's head takes 1 row, one per packed prompt, or every row
# (prompt logprobs), each its own head graph (model_runner.build_inputs)


class StepGraphs:
    def __init__(self, runner: ModelRunner, warmup: int = 2):
        self.runner = runner
        self.warmup = warmup
        self.kinds = {DECODE} if runner.static_moe else {DECODE, PREFILL}
        self.graphs: dict[Key, tuple[torch.cuda.CUDAGraph, _Staged, torch.Tensor]] = {}
        self.failed: dict[Key, str] = {}     # buckets whose capture failed: launched one by one
        self.pool = torch.cuda.graph_pool_handle()   # one pool: the graphs replay one at a time
        # check=True: every replay is compared with the same step launched one by one (the KV writes repeat the
        # same values); per bucket, the worst |logit difference| and the share of rows whose argmax agrees
        self.check = False
        self.checks: dict[Key, tuple[float, float, int]] = {}

    def _capture(self, si: StepInputs):
        r = self.runner
        staged = _Staged(_host_inputs(si), r.device)
        static = staged.views
        static[2].fill_(-1)                         # slot_mapping: warm-up and capture write only the trash block
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):           # compile and autotune outside the capture
                r.forward(si.kind, si.tokens, si.context, *static)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with capturing(g, pool=self.pool):   # an error here is the capture's: the same forward ran in the warm-up
            out = r.forward(si.kind, si.tokens, si.context, *static)
        return g, staged, out

    def _launched(self, si: StepInputs) -> torch.Tensor:
        """The step without a graph: its kernels launched one by one."""
        r = self.runner
        return r.forward(si.kind, si.tokens, si.context, *r.to_device(si))

    def run(self, si: StepInputs) -> torch.Tensor:
        key = (si.kind, si.tokens, si.context, len(si.logit_indices))
        if si.kind not in self.kinds or key in self.failed:
            return self._launched(si)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(si)
            except Exception as e:
                if isinstance(e, torch.AcceleratorError):
                    raise                # in the warm-up: a device fault (the capture's own come as CaptureFailed)
                # once per shape, not at every step: that shape runs without a graph
                self.failed[key] = str(e) if isinstance(e, CaptureFailed) else f"{type(e).__name__}: {e}"
                log.warning("%s step T=%d C=%d with %d logit rows: CUDA-graph capture failed (%s); such steps "
                            "launch kernel by kernel", *key, self.failed[key][:300])
                return self._launched(si)
        g, staged, out = self.graphs[key]
        staged.load(_host_inputs(si))
        si.feed(staged.views[0])
        g.replay()
        if self.check:
            n = si.num_logits
            ref = self._launched(si)[:n].float()
            got = out[:n].float()
            diff = float((got - ref).abs().max())
            agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
            worst, low, count = self.checks.get(key, (0.0, 1.0, 0))
            self.checks[key] = (max(worst, diff), min(low, agree), count + 1)
        return out


def _host_inputs(si: StepInputs) -> tuple[np.ndarray, ...]:
    """The step's inputs in forward()'s order. context_starts is a prefill-only input: decode graphs carry its
    buffer for forward()'s signature only."""
    return si.token_ids, si.positions, si.slot_mapping, si.block_tables, si.logit_indices, si.context_starts


class _Staged:
    """A graph's static inputs as views of one device buffer, filled from one pinned host buffer by one copy: a
    replay's inputs cost one host-to-device transfer, not six (each from pageable memory a staged, synchronous
    cudaMemcpy of its own on the host's side of the step)."""

    def __init__(self, arrays: tuple[np.ndarray, ...], device: torch.device):
        # each part starts 16-byte aligned, as Inductor assumes its inputs are (a misaligned one is copied first)
        spans = [-(-a.size // 2) * 2 for a in arrays]
        self.offsets = np.cumsum([0] + spans[:-1]).tolist()
        cuda = device.type == "cuda"
        self.host = torch.zeros(sum(spans), dtype=torch.int64, pin_memory=cuda)
        self.device = torch.empty(sum(spans), dtype=torch.int64, device=device)
        self.views = tuple(part[:a.size].view(a.shape) for part, a in zip(self.device.split(spans), arrays))
        self.copied = torch.cuda.Event() if cuda else None    # the last copy out of `host` has finished
        self.load(arrays)

    def load(self, arrays: tuple[np.ndarray, ...]) -> None:
        if self.copied is not None:
            self.copied.synchronize()        # the previous step's copy (long done: its logits were read since)
        host = self.host.numpy()
        for at, a in zip(self.offsets, arrays):
            host[at:at + a.size] = a.reshape(-1)
        self.device.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
