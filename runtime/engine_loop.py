"""The engine on its own thread, fed by the HTTP handlers: submit, stream events back, abort.

One thread owns the Engine (and so the scheduler, KV pool and graphs); handlers only exchange
messages with it. A request that fails validation is refused before it reaches the scheduler, and an
exception inside a step fails the requests of that step, never the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..common.errors import CapacityError, DeepinferError, RankFailure, RequestError
from .engine import Engine
from .sequence import SamplingParams, Sequence

log = logging.getLogger("deepinfer.engine")


@dataclass
class TokenEvent:
    token_id: int
    delta: str                 # the text this token added to the sequence's output text
    delta_at: int              # where in that text `delta` starts: its length before, or less when a stop string
                               # found in this token cut text an earlier event had added (text[:delta_at] + delta)
    logprob: float
    top_logprobs: dict[int, float]
    finished: bool
    finish_reason: str | None


class RequestAborted(Exception):
    """Pushed to a stream when its request is aborted (client gone, or a sibling choice failed)."""


@dataclass
class Stream:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def push(self, ev: TokenEvent | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, ev)


class EngineLoop:
    def __init__(self, engine: Engine, on_step=None, on_abort=None, on_fatal=None):
        self.engine = engine
        self.on_step = on_step            # metrics hooks, called on the engine thread
        self.on_abort = on_abort
        self.on_fatal = on_fatal          # the loop cannot go on (a rank died): stop the server
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self.error: BaseException | None = None
        self._pending_lock = threading.Lock()
        self.num_pending = 0              # submitted, not yet handed to the scheduler

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)

    # -- called from the event loop --------------------------------------------------------------
    async def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Stream]:
        """One HTTP request's sequences (its prompts x n choices): each validated here (RequestError -> 400), then
        queued for the engine thread all together or not at all (CapacityError -> 503: the waiting queue has no
        room for all of them now), so that a request never fills the queue in part, shutting others out, only to
        be rolled back. More sequences than the queue ever holds is the request's fault (400), not a busy server."""
        for prompt_ids, params in requests:
            self.engine.validate(prompt_ids, params)
        if not self.alive:
            raise CapacityError("the engine is not running")
        limit, k = self.engine.scheduler.cfg.max_waiting, len(requests)
        if k > limit:
            raise RequestError(f"the request asks for {k} sequences (prompts x n), more than this server queues at "
                               f"once ({limit}: deepinfer-run --max-waiting)")
        constraints = await self._constraints(requests)
        with self._pending_lock:
            if self.num_pending + len(self.engine.scheduler.waiting) + k > limit:
                raise CapacityError(f"the waiting queue is full ({limit} requests); retry later")
            self.num_pending += k
        loop = asyncio.get_running_loop()
        futs = []
        for (prompt_ids, params), constraint in zip(requests, constraints):
            futs.append(loop.create_future())
            self._inbox.put(("add", (prompt_ids, params, constraint, loop), futs[-1]))
        try:
            results = await asyncio.gather(*futs, return_exceptions=True)
        except asyncio.CancelledError:      # the client left while they were queued: whatever started stops
            for f in futs:
                if f.done() and not f.cancelled() and f.exception() is None:
                    self.abort(f.result())
            raise
        streams = [r for r in results if isinstance(r, Stream)]
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for stream in streams:
                self.abort(stream)
            raise failed
        return streams

    async def _constraints(self, requests: list[tuple[list[int], SamplingParams]]) -> list:
        """The structured outputs' grammar matchers, built in a worker thread (a large schema takes llguidance
        a while: on the engine thread every running sequence would wait for it), one per grammar and a copy for
        each further sequence (a request's n choices)."""
        built: dict[str, object] = {}
        out = []
        for _, params in requests:
            g = params.structure
            if g is None:
                out.append(None)
            elif g in built:
                out.append(built[g].copy())
            else:
                built[g] = await asyncio.to_thread(self.engine.grammars().constraint, g)
                out.append(built[g])
        return out

    def abort(self, stream: Stream) -> None:
        self._inbox.put(("abort", stream, None))

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            followers = getattr(self.engine, "followers", None)
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    self._step()
                elif followers is not None:
                    followers.check()   # a rank that died while idle stops the server now (/health), not at
                    # the next request
        except BaseException as e:  # the loop itself broke (a rank died): fail everyone, then report
            self.error = e
            log.error("engine loop stopped: %s", e)
            for s in list(self._streams.values()):
                s.push(e)
            self._streams.clear()
            if self.on_fatal is not None:
                self.on_fatal(e)
        finally:
            for s in list(self._streams.values()):
                self.engine.abort(s.seq)
                s.push(CapacityError("the server is shutting down"))
            self._streams.clear()
            while True:                   # requests still queued for the loop: answered, not left waiting
                try:
                    kind, arg, fut = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    with self._pending_lock:
                        self.num_pending -= 1
                    err = self.error or CapacityError("the server is shutting down")
                    arg[-1].call_soon_threadsafe(_resolve, fut, None, err)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, arg, fut = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                prompt_ids, params, constraint, loop = arg
                with self._pending_lock:
                    self.num_pending -= 1
                try:
                    seq = self.engine.add_request(prompt_ids, params, constraint)
                except Exception as e:  # refuse this request only; the loop and everyone else go on
                    if not isinstance(e, DeepinferError):
                        log.exception("adding a request failed")
                    loop.call_soon_threadsafe(_resolve, fut, None, e)
                    continue
                stream = Stream(seq, loop)
                self._streams[seq.seq_id] = stream
                loop.call_soon_threadsafe(self._resolve_stream, fut, stream)
            elif kind == "abort":
                stream = arg
                if self._streams.pop(stream.seq.seq_id, None) is not None:
                    self.engine.abort(stream.seq)
                    stream.push(RequestAborted("the request was aborted"))   # ends whoever still waits on it
                    if self.on_abort is not None:
                        self.on_abort(self.engine, stream.seq)

    def _step(self) -> None:
        t = time.perf_counter()
        try:
            outputs = self.engine.step()
        except (RankFailure, torch.AcceleratorError):
            # a dead rank, or a device error (an illegal address, a failed launch), which CUDA keeps for every
            # later call: the engine stops (and the server with it) instead of failing each new request in turn
            raise
        except Exception as e:  # a failed step fails the requests it held, not the server
            if getattr(self.engine, "followers", None) is not None:
                # the followers ran (or wait in) the step's collectives: the ranks are out of step
                raise RankFailure(f"a step failed on the leader while followers ran it ({type(e).__name__}: "
                                  f"{e}); the ranks are out of step") from e
            log.exception("engine step failed")
            step = getattr(self.engine, "current_step", None)
            held = {x.seq.seq_id for x in step.entries} if step is not None else None
            for s in list(self._streams.values()):
                seq = s.seq
                # the step's sequences (every running one if it failed while scheduling), and any it finished
                # before it raised (their last tokens went with it): the others go on, a failing prefill chunk
                # no concern of the sequences decoding beside it
                if seq.is_finished or (seq.seq_id in held if held is not None else
                                       seq in self.engine.scheduler.running):
                    self.engine.abort(seq)
                    s.push(e)
                    del self._streams[seq.seq_id]
            return
        for out in outputs:
            s = self._streams.get(out.seq.seq_id)
            if s is None:
                continue
            seq = out.seq
            if out.finished and seq.failure is not None:     # a broken grammar: an error instead of its output
                s.push(RequestError(seq.failure))
                del self._streams[seq.seq_id]
                continue
            # one event a token (a verified draft gives several a step), each with the text that token added
            s.push(TokenEvent(token_id=out.new_token_ids[-1], delta=out.new_text, delta_at=out.text_at,
                              logprob=seq.token_logprobs[out.index], top_logprobs=seq.output_logprobs[out.index],
                              finished=out.finished, finish_reason=seq.finish_reason if out.finished else None))
            if out.finished:
                del self._streams[seq.seq_id]
        if self.on_step is not None:
            self.on_step(self.engine, outputs, time.perf_counter() - t)

    def _resolve_stream(self, fut: asyncio.Future, stream: Stream) -> None:
        if fut.cancelled():         # its request is gone (the client left while it was queued)
            self.abort(stream)
        else:
            fut.set_result(stream)


def _resolve(fut: asyncio.Future, value, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
