"""Whole decode steps replayed as CUDA graphs: one graph per (tokens, context) decode bucket.

A decode step is every region graph of every layer, launched back to back; captured once, it replays
as one launch, so the host's per-kernel launch gaps disappear. Inputs go through static buffers
(copied in before each replay); the KV pools and weights are already static device tensors. The grouped
MoE path makes no host syncs (the grouped GEMM reads its offsets on the device), so it captures too. Prefill
chunks are not captured: each is one long step where launch gaps matter little, and on the static MoE path
they read each layer's overflow flag on the host.
"""

from __future__ import annotations

import logging

import torch

from ..common.manifest import DECODE
from .model_runner import ModelRunner, StepInputs

log = logging.getLogger("deepinfer")


class StepGraphs:
    def __init__(self, runner: ModelRunner, warmup: int = 2):
        self.runner = runner
        self.warmup = warmup
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self.failed: dict[tuple[int, int], str] = {}     # buckets whose capture failed: launched one by one
        self.pool = torch.cuda.graph_pool_handle()
        # check=True: every replay is compared with the same step launched one by one (the KV writes repeat the
        # same values); per bucket, the worst |logit difference| and the share of rows whose argmax agrees
        self.check = False
        self.checks: dict[tuple[int, int], tuple[float, float, int]] = {}

    def _capture(self, si: StepInputs):
        r = self.runner
        static = tuple(t.clone() for t in r.to_device(si))
        static[2].fill_(-1)                         # slot_mapping: warm-up and capture write only the trash block
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):           # compile and autotune outside the capture
                r.forward(DECODE, si.tokens, si.context, *static)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may touch CUDA (a tokenizer, metrics) while this one captures
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            out = r.forward(DECODE, si.tokens, si.context, *static)
        return g, static, out

    def _launched(self, si: StepInputs) -> torch.Tensor:
        """The step without a graph: its kernels launched one by one."""
        r = self.runner
        return r.forward(DECODE, si.tokens, si.context, *r.to_device(si))

    def run(self, si: StepInputs) -> torch.Tensor:
        key = (si.tokens, si.context)
        if key in self.failed:
            return self._launched(si)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(si)
            except torch.AcceleratorError:
                raise                    # a device fault is not a capture problem
            except Exception as e:      # once per bucket, not at every step: that bucket runs without a graph
                self.failed[key] = f"{type(e).__name__}: {e}"
                log.warning("decode bucket %s: CUDA-graph capture failed (%s); its steps launch kernel by kernel",
                            key, self.failed[key][:300])
                return self._launched(si)
        g, static, out = self.graphs[key]
        # context_starts is a prefill-only input: its static buffer exists for forward()'s signature only
        for buf, src in zip(static, (si.token_ids, si.positions, si.slot_mapping, si.block_tables,
                                     si.logit_indices)):
            buf.copy_(torch.from_numpy(src), non_blocking=True)
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
