"""The engine loop: schedule -> build step inputs -> run the graphs -> sample -> finish or continue."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import numbers
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from ..common.errors import ArtifactError, RequestError, shown
from ..common.manifest import Manifest
from .artifact import Artifact, check_device, load_graph, load_weights, open_artifact, verify_files
from .model_runner import ModelRunner, RegionTimer, build_inputs, logit_rows
from .sampler import sample, sample_on_device
from .speculative import verify as verify_draft
from .scheduler import ScheduledStep, Scheduler, SchedulerConfig
from .sequence import SamplingParams, Sequence
from .tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

log = logging.getLogger("deepinfer.engine")


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool
    index: int = -1          # the token's place in seq.output_ids (a step may output several: speculative drafts)
    text_at: int = 0         # where new_text starts in seq.output_text: its length before, unless a stop string
                             # cut text already output (then less)


class Engine:
    def __init__(self, manifest: Manifest, runner: ModelRunner, tokenizer: Tokenizer | None,
                 followers=None, max_waiting: int = 1024, max_prefill_streak: int = 4, prefix_caching: bool = True,
                 num_speculative_tokens: int = 0, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
                 overlap: bool | None = None):
        self.manifest = manifest
        self.runner = runner
        self.tokenizer = tokenizer
        if tokenizer is not None:     # texts far past what the context holds are refused before tokenizing
            tokenizer.context_limit = manifest.compile.context_limit
        self.followers = followers        # multi-rank: publish(StepInputs | None), check(), close()
        # torchrun ranks (a BroadcastChannel): the process group stays up until the process ends, and the
        # callers end the process without teardown once the outputs are out (`distributed.exit_without_teardown`)
        from .distributed import BroadcastChannel
        self.torchrun = isinstance(followers, BroadcastChannel)
        cc = manifest.compile
        self.scheduler = Scheduler(SchedulerConfig(
            decode_buckets=cc.decode_buckets, prefill_buckets=cc.prefill_buckets,
            context_buckets=cc.context_buckets, context_limit=cc.context_limit, block_size=cc.block_size,
            num_blocks=cc.num_kv_blocks, max_waiting=max_waiting, max_prefill_streak=max_prefill_streak,
            prefix_caching=prefix_caching, num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max))
        # config.json's end-of-sequence ids and generation_config.json's (what transformers' generate stops at)
        self.eos_ids = set(manifest.model.eos_token_ids) | set(tokenizer.generation_eos_ids if tokenizer else ())
        outside = sorted(i for i in self.eos_ids if i >= manifest.model.vocab_size)
        if outside:
            raise ArtifactError(f"end-of-sequence ids {outside} are outside the model's vocabulary "
                                f"[0, {manifest.model.vocab_size}) (the artifact's generation_config.json?)")
        from ..common.manifest import HEAD, PREFILL, graph_name
        names = {g.name for g in manifest.graphs}
        # artifacts compiled before prompt logprobs lack the heads over every row of a prefill chunk
        self.has_prompt_logprobs = all(graph_name(HEAD, PREFILL, T, logit_rows=T) in names
                                       for T in cc.prefill_buckets if T > 1)
        self._grammars = None             # structured outputs' grammar engine, built at its first request
        self.num_steps = 0
        self.current_step: ScheduledStep | None = None     # the step being run (None between steps)
        self.num_generated = 0
        self.num_draft_tokens = 0         # speculative draft tokens verified, and those accepted
        self.num_accepted_tokens = 0
        self.host_seconds = 0.0
        self.sampler_seconds = 0.0
        # Overlapped scheduling: the next decode step is built and launched before this one's tokens reach the
        # host (`_step_overlapped`). Where it pays: an accelerator that runs a step while the host waits (on by
        # default for CUDA; the CPU runs the step itself). Not with followers (they would need the tokens), the
        # region timing (it synchronises) or speculative decoding (drafts need the tokens).
        asked = overlap if overlap is not None else _env_switch(OVERLAP_ENV)
        why_not = ("several ranks" if followers is not None else "region timing" if runner.timer is not None
                   else "speculative decoding" if num_speculative_tokens else None)
        if asked and why_not:
            log.warning("overlapped scheduling is off with %s", why_not)
        self.overlap = (asked if asked is not None else runner.device.type == "cuda") and why_not is None
        self._inflight: _Launched | None = None    # a chained step launched and not yet read
        self.num_chained = 0              # steps launched before the tokens of the step before reached the host

    @classmethod
    def from_artifact(cls, path: str | Path, device: str = "cpu", verify: bool = True, timing: bool = False,
                      collective_timeout: float | None = None, torchrun: tuple[int, int] | None = None,
                      **kw) -> "Engine":
        """world == 1: this process. Otherwise this process is rank 0 and spawns the followers on this host,
        or, with `torchrun=(rank, world)` (set by torchrun), rank 0 leads ranks started elsewhere and
        every other rank serves as a follower until the leader stops (then this returns None).
        `collective_timeout` (spawned followers): seconds the rendezvous and every collective may wait; default
        DEEPINFER_COLLECTIVE_TIMEOUT, else 60."""
        art = open_artifact(path, verify=False)
        # before hashing every file (hundreds of GB for a 671B artifact); spawned followers share this host,
        # torchrun's ranks are spread over hosts as its LOCAL_WORLD_SIZE says
        check_device(art.manifest, device, art.manifest.layout.world if torchrun is None else _torchrun_local()[1])
        if verify:
            verify_files(art)
        tok = load_tokenizer(art.root, [t.path for t in art.manifest.tokenizer], art.manifest.model.bos_token_id)
        world = art.manifest.layout.world
        if world == 1:
            return cls(art.manifest, make_runner(art, rank=0, device=device, timing=timing), tok, **kw)
        if torchrun is not None:
            return cls._torchrun_leader(art, tok, device, timing, torchrun, **kw)
        from .distributed import Followers, claim_device, collective_timeout_env, join_process_group
        if collective_timeout is None:
            collective_timeout = collective_timeout_env(60.0)
        followers = Followers(art.root, art.manifest, device, collective_timeout=collective_timeout)
        try:
            device = claim_device(0, world, device)
            join_process_group(followers, device, collective_timeout)
            runner = make_runner(art, rank=0, device=device, timing=timing)
            followers.wait_ready()
        except BaseException:
            followers.close()
            raise
        return cls(art.manifest, runner, tok, followers=followers, **kw)

    @classmethod
    def _torchrun_leader(cls, art, tok, device, timing, torchrun, **kw) -> "Engine | None":
        import torch.distributed as dist
        from ..common.errors import OptionError
        from .distributed import BroadcastChannel, claim_device, exit_without_teardown, run_follower
        rank, world = torchrun
        if world != art.manifest.layout.world:
            raise OptionError(f"torchrun started {world} ranks, the artifact's layout needs "
                              f"{art.manifest.layout.world}")
        # this host's GPU of this rank: torchrun's LOCAL_RANK (the global rank modulo the GPU count only where
        # every host runs as many ranks as it has GPUs)
        device = claim_device(_torchrun_local()[0], 1, device) if device.startswith("cuda") else device
        from .distributed import collective_timeout_env, process_group_backend
        # the graphs' collectives: torch's default timeout unless DEEPINFER_COLLECTIVE_TIMEOUT says (the step
        # records go over a group of their own that waits through idle time: BroadcastChannel)
        limit = collective_timeout_env(None)
        dist.init_process_group(process_group_backend(device),
                                **({"timeout": timedelta(seconds=limit)} if limit else {}))
        channel = BroadcastChannel(art.manifest)
        if rank != 0:
            run_follower(art.root, rank, world, device, channel.receive)
            exit_without_teardown(0)      # the leader said stop: this rank is done (never returns)
            return None
        return cls(art.manifest, make_runner(art, rank=0, device=device, timing=timing), tok, followers=channel,
                   **kw)

    def close(self) -> None:
        """Stop the followers (multi-rank) and leave the process group (under torchrun: the process's end does)."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None
            import torch.distributed as dist
            if dist.is_initialized() and not self.torchrun:
                dist.destroy_process_group()

    def warmup(self, log=None) -> int:
        """Run every compiled step shape once on padding (its writes go to the KV pool's trash block), so that
        what the first use of a shape costs is paid before serving: the cuda backend compiles its graphs at first
        use and captures each decode bucket as a CUDA graph (minutes on a GPU, which would otherwise fall on the
        first requests of each bucket). Prefill shapes run with the one-row head, and each chunk size once with the
        packed head and the every-row head (prompt logprobs). Returns the steps run."""
        from ..common.manifest import DENSE_LAYER, HEAD, MOE_LAYER, PREFILL, graph_name
        cc = self.manifest.compile
        shapes = sorted({(g.kind, g.tokens, g.context) for g in self.manifest.graphs
                         if g.region in (DENSE_LAYER, MOE_LAYER)})
        runs, heads = [], set()
        for kind, T, C in shapes:
            runs.append((kind, T, C, 1))
            for rows in (cc.prefill_seqs(T), T) if kind == PREFILL else ():    # packed and prompt-logprobs heads
                if rows > 1 and (T, rows) not in heads and \
                        graph_name(HEAD, kind, T, logit_rows=rows) in self.runner.graphs:
                    heads.add((T, rows))
                    runs.append((kind, T, C, rows))
        for i, (kind, T, C, rows) in enumerate(runs):
            t = time.perf_counter()
            si = build_inputs(ScheduledStep(kind, T, C, ()), cc)
            if rows > 1:
                si.logit_indices = np.zeros(rows, np.int64)
            if self.followers is not None:
                self.followers.publish(si)
            self.runner.run(si)
            if log is not None:
                log(f"warm-up {i + 1}/{len(runs)}: {kind} {T} tokens, context {C}"
                    + (f", {rows} logit rows" if rows > 1 else "") + f" ({time.perf_counter() - t:.1f} s)")
        return len(runs)

    # -- requests ---------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        limit = self.manifest.compile.context_limit
        vocab = self.manifest.model.vocab_size
        _check_types(params)
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if params.max_tokens < 1:
            raise RequestError(f"max_tokens={shown(params.max_tokens)} must be at least 1")
        # Every token but the last takes a KV slot, so a request for one token may fill the context with its prompt
        # (the server scores a prompt, echo with max_tokens 0, as one token it does not return).
        if params.max_tokens == 1 and len(prompt_ids) > limit:     # before the id scan: a huge prompt costs nothing
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) exceeds the compiled context limit {limit}")
        if params.max_tokens > 1 and len(prompt_ids) + params.max_tokens > limit:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({shown(params.max_tokens)}) = "
                               f"{shown(len(prompt_ids) + params.max_tokens)} exceeds the compiled context limit "
                               f"{limit}")
        bad = next((t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if params.seed is not None and not -(2 ** 63) <= params.seed < 2 ** 63:
            raise RequestError(f"seed={shown(params.seed)} must be a 64-bit signed integer")
        if not (math.isfinite(params.temperature) and 0 <= params.temperature <= MAX_TEMPERATURE):
            raise RequestError(f"temperature={params.temperature} must be between 0 and {MAX_TEMPERATURE:g} (the "
                               f"sampler divides float32 logits by it)")
        if not 0 < params.top_p <= 1:
            raise RequestError(f"top_p={params.top_p} must be in (0, 1]")
        if params.top_k < 0:
            raise RequestError(f"top_k={shown(params.top_k)} must be >= 0 (0 = off)")
        if params.logprobs is not None and not 0 <= params.logprobs <= vocab:
            raise RequestError(f"logprobs={shown(params.logprobs)} must be between 0 and the vocabulary size {vocab}")
        if params.prompt_logprobs is not None:
            if not 0 <= params.prompt_logprobs <= vocab:
                raise RequestError(f"prompt_logprobs={shown(params.prompt_logprobs)} must be between 0 and the "
                                   f"vocabulary size {vocab}")
            if not self.has_prompt_logprobs:
                raise RequestError("prompt logprobs (echo with logprobs): this artifact was compiled without the "
                                   "prefill heads they need; compile it again with this deepinfer")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(params, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise RequestError(f"{name}={v} must be between -2 and 2")
        lo, hi = REPETITION_PENALTY_RANGE
        if not (math.isfinite(params.repetition_penalty) and lo <= params.repetition_penalty <= hi):
            # (a float32 logit divided by a penalty that rounds to 0 in float32 is inf: garbage, not an error)
            raise RequestError(f"repetition_penalty={params.repetition_penalty} must be between {lo:g} and {hi:g}")
        for name, n, most in (("stop", len(params.stop), MAX_STOP_STRINGS),
                              ("logit_bias", len(params.logit_bias), MAX_LIST_ENTRIES),
                              ("stop_token_ids", len(params.stop_token_ids), MAX_LIST_ENTRIES)):
            if n > most:     # each is looked at for every token the request generates
                raise RequestError(f"{name} has {n} entries: at most {most}")
        if len({t for t, _ in params.logit_bias}) < len(params.logit_bias):
            raise RequestError("logit_bias names a token id more than once")
        if not 0 <= params.min_tokens <= params.max_tokens:
            raise RequestError(f"min_tokens={shown(params.min_tokens)} must be between 0 and max_tokens "
                               f"({shown(params.max_tokens)})")
        for t, b in params.logit_bias:
            if not (isinstance(t, int) and 0 <= t < vocab):
                raise RequestError(f"logit_bias token id {t!r} is outside the vocabulary [0, {vocab})")
            if not (math.isfinite(b) and -100 <= b <= 100):
                raise RequestError(f"logit_bias of token {t} is {b}: must be between -100 and 100")
        bad = next((t for t in params.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestError(f"stop_token_ids: {bad!r} is outside the vocabulary [0, {vocab})")
        if params.structure is not None:
            self.grammars().check(params.structure)

    def grammars(self):
        """The structured-output grammar engine for this model's tokenizer (llguidance), built once."""
        if self._grammars is None:
            if self.tokenizer is None:
                from .tokenizer import no_tokenizer
                raise no_tokenizer("structured outputs")
            from .structured import Grammars
            try:
                self._grammars = Grammars(self.tokenizer.to_json(), self.manifest.model.vocab_size,
                                          sorted(self.eos_ids))
            except Exception as e:       # e.g. a tokenizer with more tokens than the model's vocabulary
                self._grammars = RequestError(f"structured outputs are unavailable with this artifact's tokenizer "
                                              f"({type(e).__name__}: {e})")
        if isinstance(self._grammars, RequestError):
            raise self._grammars
        return self._grammars

    def add_request(self, prompt_ids: list[int], params: SamplingParams, constraint=None) -> Sequence:
        """Queue a request. `constraint`: its structured output's matcher, when the caller built it already
        (EngineLoop builds them off the engine thread); else built here."""
        self.validate(prompt_ids, params)
        seq = Sequence(list(prompt_ids), params)
        if params.structure is not None:
            seq.constraint = constraint if constraint is not None else self.grammars().constraint(params.structure)
        self.scheduler.add(seq)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        if seq.detokenizer is not None:
            seq.output_text = seq.detokenizer.text        # what it had: the detokenizer is let go

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run a step and return its outputs. Overlapped: return the outputs of one step after launching the
        next, where it can be chained to it."""
        if self.overlap or self._inflight is not None:      # (overlap turned off with a step in flight: it ends)
            return self._step_overlapped()
        t0 = time.perf_counter()
        self.current_step = None
        step = self.scheduler.schedule()
        if step is None:
            return []
        self.current_step = step    # what a step that raises held (EngineLoop fails those requests, no others)
        inputs = build_inputs(step, self.manifest.compile)
        if self.followers is not None:
            self.followers.publish(inputs)
        t1 = time.perf_counter()
        try:
            logits = self.runner.run(inputs)
        except Exception:
            if self.followers is not None:   # a collective failed: name the rank that caused it, if any
                time.sleep(0.5)
                self.followers.check()
            raise
        t2 = time.perf_counter()
        outputs = self._postprocess(step, logits)
        t3 = time.perf_counter()
        self.scheduler.observe(step, t3 - t0)
        self.current_step = None
        self.num_steps += 1
        self.host_seconds += (t1 - t0) + (t3 - t2)
        self.sampler_seconds += t3 - t2
        if self.runner.timer is not None:
            self.runner.timer.add(step.kind, "schedule", t1 - t0)      # scheduling, step inputs, followers' record
            self.runner.timer.add(step.kind, "sample", t3 - t2)        # sampling, detokenizing, stop checks
        return outputs

    # -- overlapped scheduling ------------------------------------------------------------------------
    def _step_overlapped(self) -> list[StepOutput]:
        """One step's outputs, the step after it launched first where Scheduler.chain allows: its inputs go to the
        device and it starts there while this one's tokens come back and are detokenized and checked, so the
        device does not wait for the host between the two (on the CPU both run in turn: the same tokens)."""
        t0 = time.perf_counter()
        self.current_step = None
        cur, self._inflight = self._inflight, None
        try:
            if cur is None:
                step = self.scheduler.schedule()
                if step is None:
                    return []
                self.current_step = step
                cur = self._launch(step)
            self.current_step = cur.step
            if cur.tokens is not None and self.overlap:
                nxt = self.scheduler.chain(cur.step)
                if nxt is not None:
                    self._inflight = self._launch(nxt, cur.tokens)
                    self.num_chained += 1
            t2 = time.perf_counter()
            sampled = cur.host_tokens()
            # chained: the next replay of the same graph writes its logits where this step's were; none of a chained
            # step's rows reads them (Scheduler.chain), and None makes a row that would fail loudly
            outputs = self._postprocess(cur.step, None if self._inflight is not None else cur.logits, sampled)
        except BaseException:
            self._inflight = None          # what was chained to a failed step fails with it (EngineLoop)
            raise
        t3 = time.perf_counter()
        self.current_step = None
        self.num_steps += 1
        self.host_seconds += t3 - t0        # the device's part too where it runs the step itself (the CPU)
        self.sampler_seconds += t3 - t2
        return outputs

    def _launch(self, step: ScheduledStep, fed: torch.Tensor | None = None) -> "_Launched":
        """Build the step's inputs and run it (on an accelerator: queue it); where its tokens can feed a chained
        step, sample them on the device too and start their copy to the host."""
        inputs = build_inputs(step, self.manifest.compile)
        if fed is not None:
            inputs.fed_tokens = fed
        logits = self.runner.run(inputs)
        # a chained step qualifies by construction (Scheduler.chain: its sequences' output lacks the pending token
        # still, which min_tokens would count)
        if fed is None and (step.kind != "decode" or not all(
                e.wants_logits and not e.every_row and e.seq.params.logprobs is None and not e.seq.processes_logits
                for e in step.entries)):
            return _Launched(step, logits)
        tokens = sample_on_device(logits, [e.seq for e in step.entries])
        return _Launched(step, logits, tokens)

    def _postprocess(self, step: ScheduledStep, logits: torch.Tensor | None, sampled: list[int] | None = None
                     ) -> list[StepOutput]:
        """`sampled`: the tokens of a step whose rows were sampled already (overlapped: one a logits row)."""
        self.scheduler.advance(step)
        rows = logit_rows(step)
        for e, (r, n) in zip(step.entries, rows):
            if e.all_logits and not e.seq.is_finished:
                _collect_prompt_logprobs(e, logits[r:r + n])
        picks = [(e.seq, r + n - 1) for e, (r, n) in zip(step.entries, rows) if e.wants_logits and not e.num_draft]
        chosen: dict[int, tuple[list[int], list[float], list[dict[int, float]]]] = {}
        if sampled is not None:
            for (seq, _), tok in zip(picks, sampled):
                chosen[seq.seq_id] = [tok], [0.0], [{}]
        elif picks:
            sampled = [seq for seq, _ in picks]
            at = [r for _, r in picks]
            tokens, lps, tops = sample(logits if at == list(range(len(at))) else logits[at], sampled, self.eos_ids)
            for seq, tok, lp, top in zip(sampled, tokens, lps, tops):
                chosen[seq.seq_id] = [tok], [lp], [top]
        for e, (r, n) in zip(step.entries, rows):
            if e.num_draft and not e.seq.is_finished:
                chosen[e.seq.seq_id] = self._verified(e.seq, logits[r:r + n])
        now = time.monotonic()
        outs = []
        limit = self.manifest.compile.context_limit
        for e in step.entries:
            seq = e.seq
            draft, seq.draft_ids = seq.draft_ids, []
            if not e.wants_logits or seq.is_finished:     # a prompt chunk short of its end; aborted while it ran
                continue
            tokens, lps, tops = chosen[seq.seq_id]
            reason = None
            emitted = 0
            for tok, lp, top in zip(tokens, lps, tops):
                out, reason = self._emit(seq, tok, lp, top, now, limit)
                outs.append(out)
                emitted += 1
                if reason is not None:
                    break
            if e.num_draft:
                # the draft tokens verify() kept and were output (EOS or a stop string may cut them); the last
                # token has no KV yet
                accepted = min(emitted, len(tokens) - 1)
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += accepted
                self.scheduler.record_draft(seq, len(draft), accepted)
                seq.num_computed = e.start + 1 + accepted
                self.scheduler.blocks.register(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
        return outs

    def _verified(self, seq: Sequence, rows: torch.Tensor) -> tuple[list[int], list[float], list[dict[int, float]]]:
        """A drafted sequence's tokens for this step (runtime/speculative.py) with their logprobs where asked."""
        tokens = verify_draft(rows, seq, seq.draft_ids)
        n = seq.params.logprobs
        if n is None:
            return tokens, [0.0] * len(tokens), [{} for _ in tokens]
        # on the rows' device, as the plain path computes them (a GPU's rows do not come to the host whole)
        lp = torch.log_softmax(rows[:len(tokens)].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        if not n:
            return tokens, chosen, [{} for _ in tokens]
        v, ix = lp.topk(n, dim=-1)
        return tokens, chosen, [{int(t): float(x) for t, x in zip(i, vv)} for i, vv in zip(ix.tolist(), v.tolist())]

    def _emit(self, seq: Sequence, tok: int, lp: float, top: dict[int, float], now: float, limit: int
              ) -> tuple[StepOutput, str | None]:
        """One new token of `seq`: appended, detokenized, checked for EOS, stop tokens, stop strings, max_tokens
        and the context limit; returns its output and the finish reason, if any (the caller finishes it)."""
        seq.output_ids.append(tok)
        seq.token_logprobs.append(lp)
        seq.output_logprobs.append(top)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.num_generated += 1
        reason = None
        # EOS (unless ignored) and stop_token_ids finish the sequence; as in vLLM, their text is not output
        stop_token = (tok in self.eos_ids and not seq.params.ignore_eos) or tok in seq.params.stop_token_ids
        text = ""
        det = seq.detokenizer
        if det is not None and not stop_token:
            text = det.add([tok])
        early = len(seq.output_ids) <= seq.params.min_tokens       # stop strings count after min_tokens
        if det is not None and early:
            seq.stop_from = det.length
        elif det is not None and len(seq.output_ids) == seq.params.min_tokens + 1 and det.held:
            # past the first min_tokens tokens' text, including what the detokenizer still holds of it (an
            # incomplete UTF-8 character, counted as U+FFFD), which later tokens bring out
            seq.stop_from = max(seq.stop_from, len(self.tokenizer.decode(seq.output_ids[:seq.params.min_tokens])))
        cut = False
        if seq.constraint is not None:
            seq.constraint.consume(tok)
            if seq.constraint.error:       # the output so far may break the constraint: it fails, not stops
                seq.failure = (f"the structured output failed after {len(seq.output_ids)} tokens: "
                               f"{seq.constraint.error}")
                log.warning("request %d: %s", seq.seq_id, seq.failure)
        by_token = stop_token or (seq.constraint is not None and seq.constraint.done)
        at_limit = len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= limit
        if det is not None and (by_token or at_limit):
            # its last token: what the detokenizer held back (an incomplete UTF-8 tail, as U+FFFD) comes out now,
            # before the stop strings are searched, so that text can hold a stop too
            before = det.length
            text += det.flush()[before:]
        if by_token:
            reason = "stop"
        elif seq.params.stop and det is not None and not early:
            # a hit ends in the new text (one ending before it was found earlier): search the tail only
            longest = max(len(x) for x in seq.params.stop)
            emitted_before = det.length - len(text)
            tail = max(seq.stop_from, emitted_before - longest + 1)
            window = det.text_from(tail)
            hit = _first_stop(window, seq.params.stop)
            if hit is not None:
                hit += tail
                text = window[emitted_before - tail:hit - tail] if hit > emitted_before else ""
                seq.output_text = det.text[:hit]
                reason, cut = "stop", True
        if reason is None and at_limit:
            reason = "length"
        if reason is not None and det is not None and not cut:
            seq.output_text = det.text
        length = det.length if seq.detokenizer is not None else len(seq.output_text)
        return StepOutput(seq, [tok], text, reason is not None, len(seq.output_ids) - 1, length - len(text)), reason

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            self.step()
        return seqs


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


_INT_FIELDS = ("max_tokens", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs", "prompt_logprobs")
_REAL_FIELDS = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _check_types(params: SamplingParams) -> None:
    """Each field of the type it is used as: a request built in Python (not through the server's schema) with, say,
    top_k 5.0 or a stop string as a number was accepted, then raised inside a step and failed every request of
    that step. Named, as the server's 400s name theirs."""
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        v = getattr(params, name)
        if not (_is_int(v) or (v is None and name in _OPTIONAL_INT_FIELDS)):
            raise RequestError(f"{name}={shown(v)} must be an integer")
    for name in _REAL_FIELDS:
        v = getattr(params, name)
        if not _is_real(v):
            raise RequestError(f"{name}={shown(v)} must be a number")
    if not isinstance(params.ignore_eos, bool):
        raise RequestError(f"ignore_eos={shown(params.ignore_eos)} must be true or false")
    if isinstance(params.stop, str) or not all(isinstance(x, str) for x in params.stop):
        raise RequestError(f"stop={shown(params.stop)} must be a sequence of strings")
    if any(x == "" for x in params.stop):
        raise RequestError("stop strings must not be empty")
    if not all(isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and _is_real(p[1]) for p in params.logit_bias):
        raise RequestError(f"logit_bias={shown(params.logit_bias)} must be (token id, bias) pairs")
    if params.structure is not None and not isinstance(params.structure, str):
        raise RequestError(f"structure={shown(params.structure)} must be a grammar's text")


class _Launched:
    """A step run (on an accelerator: queued), its logits not read yet. `tokens`: its rows' tokens sampled on the
    device, their copy to the host started (pinned memory, an event), where a chained step may read them there."""

    def __init__(self, step: ScheduledStep, logits: torch.Tensor, tokens: torch.Tensor | None = None):
        self.step, self.logits, self.tokens = step, logits, tokens
        self._host = self._copied = None
        if tokens is not None and tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def host_tokens(self) -> list[int] | None:
        """The sampled tokens on the host; waits for their copy only (not for a chained step queued since)."""
        if self.tokens is None:
            return None
        if self._copied is None:
            return self.tokens.tolist()
        self._copied.synchronize()
        return self._host.tolist()


def _collect_prompt_logprobs(e, logits: torch.Tensor) -> None:
    """Prompt logprobs from an entry's rows: row j (position e.start + j) scores prompt token e.start + j + 1.
    Only the tokens not collected yet (a preempted sequence recomputes its prompt), and none past the prompt."""
    seq = e.seq
    done = len(seq.prompt_token_logprobs)               # tokens 1..done are scored
    lo = done - e.start                                 # the row that scores token done + 1
    hi = min(e.num_tokens, len(seq.prompt_ids) - 1 - e.start)
    if lo < 0 or hi <= lo:
        return
    k = seq.params.prompt_logprobs or 0
    for a in range(lo, hi, 256):        # where the logits are (an accelerator too), a few rows of [V] at a time;
        b = min(a + 256, hi)            # only the [n] and [n, k] results come to the host
        x = torch.log_softmax(logits[a:b].float(), dim=-1)
        targets = torch.tensor(seq.prompt_ids[e.start + a + 1: e.start + b + 1], device=x.device)
        seq.prompt_token_logprobs.extend(x.gather(1, targets[:, None])[:, 0].tolist())
        if k:
            v, ix = x.topk(k, dim=-1)
            seq.prompt_top_logprobs.extend({int(t): float(p) for t, p in zip(i, vv)}
                                           for i, vv in zip(ix.tolist(), v.tolist()))
        else:
            seq.prompt_top_logprobs.extend({} for _ in range(b - a))


# Bounds on what a request may ask for that every one of its steps pays for (validate)
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
MAX_STOP_STRINGS = 64
MAX_LIST_ENTRIES = 1024       # logit_bias and stop_token_ids entries


def _first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _torchrun_local() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them: this rank's index on its host and the ranks there."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic collector off for a block that allocates many long-lived objects and no garbage cycles worth
    collecting (loading graphs and weights): its full collections there walk everything loaded so far. Loading the
    `mid` benchmark artifact ran three, 320-330 ms of its 4.4-5.4 s (2-core VM); with this around make_runner, one
    (76 ms, importing jinja2 for the chat template). Restores the collector's state as it was, and then collects
    once: what loading allocated (~300k objects) would otherwise sit in the youngest generation, and the first
    requests' young collections would walk it all, then again one generation up (a `mid-bf16` 16-sequence run
    right after loading: one 69 ms pause in its decode steps, tripling their host time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
            gc.collect()


def make_runner(art: Artifact, rank: int, device: str = "cpu", timing: bool = False) -> ModelRunner:
    dev = torch.device(device)
    if dev.type == "cpu":
        keep_freed_memory()
    with collector_paused():
        graphs = {g.name: load_graph(art, g, dev, rank) for g in art.manifest.graphs}
        weights = load_weights(art, rank, dev)
        runner = ModelRunner(art.manifest, graphs, weights, dev, RegionTimer(dev) if timing else None)
    if dev.type == "cuda" and not timing:      # region timing needs the launches one by one
        from .cuda_graphs import StepGraphs
        runner.step_graphs = StepGraphs(runner)
    return runner


OVERLAP_ENV = "DEEPINFER_OVERLAP"        # 1 / 0: overlapped scheduling on / off (default: on for CUDA)


def _env_switch(name: str) -> bool | None:
    """An on/off environment variable: None where it is unset or empty."""
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return None
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    from ..common.errors import OptionError
    raise OptionError(f"{name}={os.environ[name]!r}: expected 1/0 (true/false, on/off, yes/no)")


def freeze_loaded_objects() -> None:
    """A serving process, once loaded: collect what loading left, then exempt every object alive (modules, graphs,
    the tokenizer, torch's and the server's own: ~310k of them with the demo artifact loaded) from Python's cyclic
    collector, as vLLM does after start-up. A full collection otherwise walks them all with every stream stalled
    (137 ms on the 2-core VM) whenever enough objects have outlived two younger collections, as requests' objects
    do while they run: the demo server under `deepinfer-bench online`, 1500 requests, made one, 164 ms, and 2.6 ms
    with them frozen. For whole processes (the server, a follower), not an engine among others (tests,
    benchmarks): a frozen object's cycles are never collected."""
    gc.collect()
    gc.freeze()


MALLOC_ENV = "DEEPINFER_MALLOC_KEEP"    # 0: leave glibc's allocator as it is


def keep_freed_memory() -> bool:
    """CPU, glibc: keep freed activation buffers in the process instead of handing them back to the kernel.

    A step allocates its activations afresh (AOTInductor graphs, the kernels' outputs: up to a few MB each) and
    frees them at the end; glibc serves such sizes from mmap or trims them off its heap, so later steps page-
    fault them in again: 2.6-7k minor faults a 17-step 16-sequence `mid` run and up to 3k a 256-token prefill
    chunk, at ~0.9 us each on the 2-core VM (measured by forcing glibc's initial 128 KB thresholds: 170k faults
    cost ~150 ms). An mmap threshold of 32 MB (glibc's maximum) and no trimming make later steps reuse the same
    pages: 0-500 faults a run. The price is that the process keeps its peak activation memory (tens of MB).
    What the PyTorch CPU tuning guide gets by preloading jemalloc or tcmalloc, from inside the process.
    Returns whether it applied (glibc only: elsewhere mallopt is missing or refuses)."""
    if os.environ.get(MALLOC_ENV, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)                             # the process's own C library: no lookup
        m_trim_threshold, m_mmap_threshold = -1, -3          # <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False
