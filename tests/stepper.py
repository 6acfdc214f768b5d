"""Drive a ModelRunner with hand-made steps of a chosen kind and bucket, to reach every compiled graph."""

from __future__ import annotations

import torch

from deepinfer.runtime.block_manager import BlockManager
from deepinfer.runtime.model_runner import ModelRunner, build_inputs
from deepinfer.runtime.scheduler import ScheduledStep, StepEntry
from deepinfer.runtime.sequence import SamplingParams, Sequence


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


class Stepper:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        cc = runner.manifest.compile
        self.cc = cc
        self.blocks = BlockManager(cc.num_kv_blocks, cc.block_size)

    def new(self, prompt: list[int]) -> Sequence:
        return Sequence(list(prompt), SamplingParams(max_tokens=1))

    def run(self, kind: str, tokens: int, context: int, chunks: list[tuple[Sequence, int]],
            all_logits: bool = False) -> list[torch.Tensor]:
        """One step: each (seq, n) computes the seq's next n tokens. Returns logits per chunk: the last
        token's [V], or with all_logits (decode steps) every token's [n, V]."""
        entries = []
        for seq, n in chunks:
            self.blocks.allocate(seq, n)
            entries.append(StepEntry(seq, seq.num_computed, n, True))
        step = ScheduledStep(kind, tokens, context, tuple(entries))
        si = build_inputs(step, self.cc)
        if all_logits:
            assert kind == "decode"
            si.logit_indices[:] = range(tokens)
            si.num_logits = sum(n for _, n in chunks)
        logits = self.runner.run(si)
        for seq, n in chunks:
            seq.num_computed += n
        if not all_logits:
            return [logits[i] for i in range(len(chunks))]
        out, t = [], 0
        for _, n in chunks:
            out.append(logits[t:t + n])
            t += n
        return out
