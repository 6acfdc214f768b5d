"""OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions (streaming or not), /v1/models,
/health, /metrics, /tokenize, /detokenize. Bad requests get OpenAI-shaped 4xx bodies and never disturb other requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import signal
import socket
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from ..common.errors import CapacityError, OptionError, RankFailure, RequestError, shown
from .engine import Engine, freeze_loaded_objects
from .engine_loop import EngineLoop, RequestAborted, Stream, TokenEvent
from .metrics import Metrics
from .protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields, error_body, new_id,
                       now)
from .sequence import GREEDY_BELOW, SamplingParams
from .tokenizer import Tokenizer, no_tokenizer
from .tools import CallStream, ToolParser, check_tools, forced_calls, forced_schema

log = logging.getLogger("deepinfer.server")
MAX_N = 16
MAX_LOGPROBS = 20
INT64 = (-(2 ** 63), 2 ** 63 - 1)


MAX_BODY_BYTES = 16 << 20     # a request body (the longest prompt the context allows is far smaller)


class Unauthorized(Exception):
    pass


class BodyTooLarge(Exception):
    pass


def _err(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    # a message quoting what a client sent may hold a lone surrogate, which UTF-8 cannot encode: escaped, so that
    # the 4xx goes out instead of a 500 from the response's encoding
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(error_body(message, type_, status, param), status_code=status)


def build_app(loop: EngineLoop, model_name: str | list[str], metrics: Metrics, api_key: str | None = None
              ) -> FastAPI:
    """The HTTP app. `model_name`: the name(s) requests may ask for (vLLM's --served-model-name); the first is
    the one responses report."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    model_name = names[0]
    root = loop.engine.manifest.name
    engine: Engine = loop.engine
    tok: Tokenizer | None = engine.tokenizer
    limit = engine.manifest.compile.context_limit
    vocab = engine.manifest.model.vocab_size
    app = FastAPI(title="deepinfer", version="0.1.0")
    parser = ToolParser(tok) if tok is not None else None

    # A dependency of the /v1 routes rather than an HTTP middleware: Starlette's BaseHTTPMiddleware hides client
    # disconnects from request.is_disconnected(), so aborted non-streaming requests would keep generating.
    async def auth(request: Request) -> None:
        if api_key:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
                raise Unauthorized()

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request, exc: Unauthorized):
        metrics.rejected.labels("401").inc()
        return _err(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "authentication_error")

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request, exc: BodyTooLarge):
        metrics.rejected.labels("413").inc()
        return _err(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")

    @app.exception_handler(RequestError)
    async def _bad(request, exc: RequestError):
        metrics.rejected.labels("400").inc()
        return _err(400, str(exc))

    @app.exception_handler(CapacityError)
    async def _busy(request, exc: CapacityError):
        metrics.rejected.labels("503").inc()
        return _err(503, str(exc), "server_overloaded")

    @app.exception_handler(GenerationFailed)
    async def _failed(request, exc: GenerationFailed):
        # the step that held the request failed (logged with its traceback): a server error, not a busy server
        # that a client should retry
        metrics.rejected.labels("500").inc()
        return _err(500, str(exc), "server_error")

    @app.exception_handler(RequestAborted)
    async def _aborted(request, exc: RequestAborted):
        # the client left (nobody reads this) or the server aborted it: not a rejection
        return _err(499, str(exc), "request_aborted")

    @app.get("/health")
    async def health():
        if not loop.alive:
            return _err(503, f"engine stopped: {loop.error!r}", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": now(), "owned_by": "deepinfer",
                                            "root": root, "parent": None, "max_model_len": limit} for n in names]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        if "messages" in body:     # vLLM's chat form: the prompt ids a chat request with these messages would get
            extra = set(body) - {"messages", "model", "add_generation_prompt", "tools"}
            if extra:
                raise RequestError(f"/tokenize with 'messages' takes 'add_generation_prompt' and 'tools' too, not "
                                   f"{sorted(extra)}")
            creq = _parse(ChatCompletionRequest, body)
            if tok is None:
                raise no_tokenizer("/tokenize")
            messages = [_message(i, m) for i, m in enumerate(creq.messages)]
            tools = check_tools(creq.tools) if creq.tools else None
            ids = await asyncio.to_thread(tok.encode_chat, messages, creq.add_generation_prompt, tools)
            return {"tokens": ids, "count": len(ids), "max_model_len": limit}
        prompt = body.get("prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool) or \
                set(body) - {"prompt", "model", "add_special_tokens"}:
            raise RequestError("/tokenize takes {'prompt': <string>} (optionally 'model', 'add_special_tokens': "
                               "<bool>) or {'messages': [...]} (optionally 'add_generation_prompt', 'tools')")
        if tok is None:
            raise no_tokenizer("/tokenize")
        ids = await asyncio.to_thread(tok.encode, prompt, add_special_tokens=special)
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)) or \
                set(body) - {"tokens", "model"}:
            raise RequestError("/detokenize takes {'tokens': [<int>, ...]} (optionally 'model')")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if tok is None:
            raise no_tokenizer("/detokenize")
        return {"prompt": tok.decode(ids)}

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(request: Request):
        req = _parse(CompletionRequest, await _json(request))
        # off the event loop (as the chat template's rendering): a long text prompt takes a while to tokenize,
        # and every other request's stream would wait for it
        prompts, texts = await asyncio.to_thread(_prompts, req, tok)
        return await _generate(request, req, prompts, texts, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(request: Request):
        body = await _json(request)
        creq = _parse(ChatCompletionRequest, body)
        if tok is None:
            raise no_tokenizer("a chat request")
        messages = [_message(i, m) for i, m in enumerate(creq.messages)]
        tools, mode = _tool_mode(creq)
        # a template is a program: rendering runs off the event loop, as tokenizing does
        ids = await asyncio.to_thread(tok.encode_chat, messages, creq.add_generation_prompt, tools)
        if not ids:
            raise RequestError("the chat template rendered these messages as an empty prompt")
        if creq.max_tokens is not None and creq.max_completion_tokens is not None and \
                creq.max_tokens != creq.max_completion_tokens:
            raise RequestError(f"fields 'max_tokens'={creq.max_tokens} and 'max_completion_tokens'="
                               f"{creq.max_completion_tokens} disagree (send one)")
        if creq.top_logprobs is not None:
            if not creq.logprobs:
                raise RequestError("field 'top_logprobs' needs 'logprobs': true")
            if not 0 <= creq.top_logprobs <= MAX_LOGPROBS:
                raise RequestError(f"field 'top_logprobs'={creq.top_logprobs} must be between 0 and {MAX_LOGPROBS}")
        # the rest is a completion request for the rendered prompt
        fields = {k: getattr(creq, k) for k in SamplingFields.model_fields}
        if mode is not None and mode.schema is not None:     # a forced call: its JSON is the output
            fields["structured_outputs"] = {"json": mode.schema}
        req = CompletionRequest(**fields, prompt=ids, max_tokens=creq.max_tokens if creq.max_completion_tokens is None
                                else creq.max_completion_tokens,
                                logprobs=(creq.top_logprobs or 0) if creq.logprobs else None)
        return await _generate(request, req, [ids], [None], chat=True, tools=mode)

    def _tool_mode(creq: ChatCompletionRequest) -> tuple[list[dict] | None, "ToolMode | None"]:
        """The tools the template sees, and how calls come out: parsed from DeepSeek's markers ("auto"), forced
        as JSON ("required", a named function), or not at all ("none", no tools)."""
        tools = check_tools(creq.tools) if creq.tools else None
        choice = creq.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        named = isinstance(choice, dict)
        if named and not (choice.get("type") == "function" and isinstance(choice.get("function"), dict) and
                          isinstance(choice["function"].get("name"), str)):
            raise RequestError("field 'tool_choice' must be 'none', 'auto', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}")
        if not named and choice not in ("none", "auto", "required"):
            raise RequestError(f"field 'tool_choice'={choice!r} is not one of 'none', 'auto', 'required' or a "
                               f"named function")
        if choice == "none":
            return tools, None
        if not tools:
            raise RequestError(f"field 'tool_choice'={json.dumps(choice)} needs 'tools'")
        if not tok.chat_template_renders_tools():
            raise RequestError("this model's chat template does not show 'tools' to the model (it never renders "
                               "them); serve it with a template that does, e.g. vLLM's tool_chat_template_deepseekv3"
                               ".jinja as the checkpoint's chat_template.jinja")
        single = creq.parallel_tool_calls is False
        if choice == "auto":
            if not parser.available:
                raise RequestError("tool calls with tool_choice 'auto' need DeepSeek's tool-call tokens "
                                   "(<｜tool▁calls▁begin｜>, ...) in the tokenizer, which this model's lacks; use "
                                   "tool_choice 'required' or a named function")
            return tools, ToolMode(None, None, single)
        if any(getattr(creq, f) not in (None, {"type": "text"}) for f in STRUCTURED_FIELDS):
            raise RequestError("a forced tool call (tool_choice 'required' or a named function) is structured "
                               "output already: drop the other structured-output field")
        schema, name = forced_schema(tools, choice, single)
        return tools, ToolMode(schema, name, single)

    async def _generate(request: Request, req: CompletionRequest, prompts: list[list[int]], texts: list[str | None],
                        chat: bool, tools: "ToolMode | None" = None):
        structured = any(getattr(req, f) is not None for f in STRUCTURED_FIELDS)
        # building and checking a grammar against the vocabulary can take a while: not on the event loop
        params = await asyncio.to_thread(_sampling, req, prompts, limit) if structured else \
            _sampling(req, prompts, limit)
        streams = await loop.submit([(ids, params if req.seed is None or req.n == 1 else
                                      _with_seed(params, req.seed + j)) for ids in prompts for j in range(req.n)])
        for ids in prompts:
            metrics.prompt_tokens.inc(len(ids))
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            return StreamingResponse(_sse(rid, req, streams, prompts, texts, chat, tools),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(request, rid, req, streams, prompts, texts, chat, tools)

    # -- helpers --------------------------------------------------------------------------------
    async def _json(request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise BodyTooLarge()
        parts, size = [], 0
        async for part in request.stream():      # read up to the cap, not whatever a client sends
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise BodyTooLarge()
            parts.append(part)
        raw = b"".join(parts)
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})") from None
        except RecursionError:
            raise RequestError("the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if SURROGATE_ESCAPE.search(raw):     # only an escape can put a UTF-16 surrogate in a parsed string
            _refuse_lone_surrogates(body)
        return body

    def _no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    def _prompts(req: CompletionRequest, tok) -> tuple[list[list[int]], list[str | None]]:
        p = req.prompt
        items = [p] if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)) else p
        if not items:
            raise RequestError("field 'prompt': the prompt list is empty")
        ids, texts = [], []
        for it in items:
            if isinstance(it, str):
                if not it:
                    raise RequestError("field 'prompt': the prompt is empty")
                if tok is None:
                    raise no_tokenizer("a text prompt")
                ids.append(tok.encode(it))
                texts.append(it)
            else:
                ids.append(list(it))
                texts.append(None)
        return ids, texts

    def _sampling(req: CompletionRequest, prompts: list[list[int]], limit: int) -> SamplingParams:
        if req.model is not None and req.model not in names:
            raise RequestError(f"model '{req.model}' is not served here (this server serves "
                               f"{', '.join(repr(n) for n in names)})")
        if not 1 <= req.n <= MAX_N:
            raise RequestError(f"field 'n'={shown(req.n)} must be between 1 and {MAX_N}")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError(f"field 'best_of'={shown(req.best_of)} is not supported (only equal to n)")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"field 'logprobs'={shown(req.logprobs)} must be between 0 and {MAX_LOGPROBS}")
        if req.top_k < -1:
            raise RequestError(f"field 'top_k'={shown(req.top_k)} must be -1 (off) or positive")
        if req.seed is not None and not (INT64[0] <= req.seed and req.seed + req.n - 1 <= INT64[1]):
            raise RequestError(f"field 'seed'={shown(req.seed)} must be a 64-bit signed integer (seed + n - 1 "
                               f"included)")
        if req.stream_options is not None and not req.stream:
            raise RequestError("field 'stream_options' is only allowed with 'stream': true")
        if req.stop and tok is None:
            raise no_tokenizer("stop strings")
        if req.n > 1 and 0 <= req.temperature < GREEDY_BELOW:     # (a negative one: validate says so)
            raise RequestError(f"n > 1 with temperature {req.temperature} (greedy below {GREEDY_BELOW}) would return "
                               f"identical choices; use a higher temperature")
        max_tokens = req.max_tokens
        if max_tokens is None:       # as many as the context leaves
            longest = max(len(p) for p in prompts)
            if longest >= limit:
                raise RequestError(f"the prompt is {longest} tokens: the compiled context limit {limit} leaves no "
                                   f"room for output")
            max_tokens = limit - longest
        if max_tokens == 0 and _scoring(req):
            max_tokens = 1       # the prompt's logits are all computed anyway; the one token is not returned
        if max_tokens < 1:
            raise RequestError(f"field 'max_tokens'={shown(max_tokens)} must be at least 1 (0 only with 'echo': the "
                               f"prompt scored, nothing generated)")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())   # empty ones: Engine.validate
        bias, keys = [], {}
        for key, value in (req.logit_bias or {}).items():
            if not key.strip().isdecimal() or len(key.strip()) > 18:    # (and int() refuses 4300+ digits)
                raise RequestError(f"field 'logit_bias': key {key[:40]!r} is not a token id")
            if (other := keys.setdefault(int(key), key)) is not key:     # "1" and "01": summed past +-100
                raise RequestError(f"field 'logit_bias': keys {other!r} and {key!r} name the same token")
            bias.append((int(key), _number(f"logit_bias[{key!r}]", value)))
        return SamplingParams(max_tokens=max_tokens, temperature=_number("temperature", req.temperature),
                              top_p=_number("top_p", req.top_p), top_k=max(0, req.top_k), seed=req.seed, stop=stop,
                              ignore_eos=req.ignore_eos, logprobs=req.logprobs, min_tokens=req.min_tokens,
                              prompt_logprobs=req.logprobs if req.echo else None,
                              logit_bias=tuple(sorted(bias)),
                              repetition_penalty=_number("repetition_penalty", req.repetition_penalty),
                              presence_penalty=_number("presence_penalty", req.presence_penalty),
                              frequency_penalty=_number("frequency_penalty", req.frequency_penalty),
                              stop_token_ids=tuple(req.stop_token_ids or ()), structure=_structure(req, engine))

    def _message(i: int, m: ChatMessage) -> dict:
        # fields sent as null are left out, as transformers' apply_chat_template does (templates test `is defined`)
        msg = {k: v for k, v in m.model_dump().items() if v is not None}
        if m.role == "developer":      # OpenAI's newer name for the system role, which templates know
            msg["role"] = "system"
        if isinstance(m.content, list):
            bad = next((p.type for p in m.content if p.type != "text" or p.text is None), None)
            if bad is not None:
                raise RequestError(f"field 'messages[{i}].content': only text parts are served (got a '{bad}' part)")
            msg["content"] = "\n".join(p.text for p in m.content)
        if isinstance(msg.get("tool_calls"), list):
            # an assistant turn that called tools: clients send content null, and DeepSeek's templates test
            # `content is none`; arguments are a JSON string (OpenAI's shape) even where a client sent an object
            msg.setdefault("content", None)
            for c in msg["tool_calls"]:
                f = c.get("function") if isinstance(c, dict) else None
                if isinstance(f, dict) and isinstance(f.get("arguments"), (dict, list)):
                    f["arguments"] = json.dumps(f["arguments"], ensure_ascii=False)
        return msg

    def _chat_logprobs(events: list[TokenEvent]) -> dict:
        def entry(t: int, lp: float) -> dict:
            s = tok.token_str(t) if tok is not None else str(t)
            return {"token": s, "logprob": lp, "bytes": list(tok.token_bytes(t) if tok is not None else s.encode())}
        return {"content": [{**entry(ev.token_id, ev.logprob),
                             "top_logprobs": [entry(t, v) for t, v in ev.top_logprobs.items()]} for ev in events]}

    def _logprobs_block(events: list[TokenEvent], offset0: int) -> dict:
        tokens, lps, tops, offs = [], [], [], []
        off = offset0
        for ev in events:
            s = tok.token_str(ev.token_id) if tok is not None else str(ev.token_id)
            tokens.append(s)
            lps.append(ev.logprob)
            tops.append(_by_string(_with_chosen(ev.top_logprobs, ev.token_id, ev.logprob), tok))
            offs.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def _usage(req, prompts, streams, sent_tokens: list[int] | None = None) -> dict:
        """Usage of a request; mid-stream, `sent_tokens` counts the tokens each choice has streamed so far (a
        step may have produced more: speculative drafts)."""
        n = req.n
        p = sum(len(x) for x in prompts)
        c = 0 if _scoring(req) else sum(sent_tokens) if sent_tokens is not None else \
            sum(len(s.seq.output_ids) for s in streams)
        # as OpenAI's, always there: the prompt tokens served from the prefix cache (0 with it off), each prompt
        # counted once, as prompt_tokens counts it (by its first choice)
        cached = sum(s.seq.num_cached_tokens for s in streams[::n])
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _calls(mode: "ToolMode", seq, text: str) -> tuple[str | None, list[dict]]:
        """A finished choice's (content, tool calls) in a tool mode."""
        if mode.schema is not None:        # the output is the call's JSON: never content
            # a stop string or stop token that cut the call's JSON short leaves no call (finish_reason stays
            # "stop", not "tool_calls"); max_tokens leaves a named call's arguments so far, as OpenAI's "length"
            c = seq.constraint
            cut = seq.finish_reason == "stop" and not (c is not None and c.done)
            return None, [] if cut else forced_calls(text, mode.name)
        content, calls, marked = parser.split(seq.output_ids)
        if calls:
            return content or None, calls[:1] if mode.single else calls
        return (content if marked else text), []       # markers without a complete call: the text before them

    async def _complete(request, rid, req, streams, prompts, texts, chat, tools=None):
        watcher = asyncio.create_task(_watch_disconnect(request, streams))
        try:
            results = await asyncio.gather(*(_collect(s) for s in streams))
        except BaseException:        # one choice failed (or the client left): stop the others too
            for s in streams:
                loop.abort(s)
            raise
        finally:
            watcher.cancel()
        choices = []
        scoring = _scoring(req)
        for idx, (s, events) in enumerate(zip(streams, results)):
            last = events[-1] if events else None
            text = s.seq.output_text if last and not scoring else ""
            if chat:
                message, finish = {"role": "assistant", "content": text}, last.finish_reason if last else "abort"
                if tools is not None and last is not None:
                    content, calls = _calls(tools, s.seq, text)
                    if calls:       # a call cut short by max_tokens keeps finish_reason "length", as OpenAI's
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        finish = "tool_calls" if finish == "stop" else finish
                    elif tools.schema is not None:   # a forced call's JSON cut short: no call, and never content
                        message = {"role": "assistant", "content": ""}
                choices.append({"index": idx, "message": message,
                                "logprobs": _chat_logprobs(events) if req.logprobs is not None else None,
                                "finish_reason": finish})
                continue
            prefix = (texts[idx // req.n] or (tok.decode(prompts[idx // req.n]) if tok else "")) if req.echo else ""
            lp = None
            if req.logprobs is not None:
                head = _prompt_logprobs_block(s.seq) if req.echo else None
                lp = _logprobs_block([] if scoring else events, _offset_after(head) if head else len(prefix))
                if head is not None:
                    lp = _join_blocks(head, lp)
            choices.append({"index": idx, "text": prefix + text, "logprobs": lp,
                            "finish_reason": last.finish_reason if last and not scoring else
                            "length" if last else "abort"})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": model_name, "choices": choices, "usage": _usage(req, prompts, streams)}

    async def _collect(s: Stream) -> list[TokenEvent]:
        events = []
        while True:
            ev = await s.events.get()
            if isinstance(ev, BaseException):
                raise ev if isinstance(ev, (RequestError, CapacityError, RequestAborted)) else \
                    GenerationFailed(f"generation failed: {ev}")
            events.append(ev)
            if ev.finished:
                return events

    async def _watch_disconnect(request: Request, streams: list[Stream]):
        while True:
            await asyncio.sleep(0.1)
            if await request.is_disconnected():
                for s in streams:
                    loop.abort(s)
                return

    async def _sse(rid, req, streams, prompts, texts, chat, tools=None):
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(i: int, s: Stream):
            while True:
                ev = await s.events.get()
                await merged.put((i, ev))
                if isinstance(ev, BaseException) or ev.finished:
                    return

        tasks = [asyncio.create_task(forward(i, s)) for i, s in enumerate(streams)]
        holdback = max((len(x) for x in (_stops(req))), default=1) - 1
        sent = [0] * len(streams)      # characters of each choice's text streamed as content
        unsent = [""] * len(streams)   # its text after those (what the stop-string holdback keeps)
        ntok = [0] * len(streams)      # tokens streamed per choice
        emitted = [0] * len(streams)
        created = now()
        remaining = len(streams)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        obj = "chat.completion.chunk" if chat else "text_completion"

        named = [False] * len(streams)

        held = [tools is not None and tools.schema is not None] * len(streams)   # tool-call text: not content
        # tool_choice auto: the calls stream as they are generated (a forced call's JSON comes whole at the end)
        calls_out = [CallStream(parser, tools.single) for _ in streams] \
            if tools is not None and tools.schema is None else None

        def chunk(i: int, text: str, finish: str | None, lp: dict | None, calls: list[dict] | None = None) -> str:
            if chat:    # a choice's first chunk, which carries its first token (clients time TTFT by it), names the role
                delta = {"content": text} if named[i] else {"role": "assistant", "content": text}
                if calls:       # tool-call deltas, each with its call's index
                    delta = {**({} if named[i] else {"role": "assistant"}), "tool_calls": calls}
                named[i] = True
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if continuous_usage:        # vLLM's extension: the running usage on every chunk
                body["usage"] = _usage(req, prompts, streams, ntok)
            return "data: " + json.dumps(body) + "\n\n"
        scoring = _scoring(req)
        # echo with logprobs: the prompt's chunk waits for the choice's first event (its prompt logprobs are in)
        echo_waits = req.echo and req.logprobs is not None
        echoed = [not req.echo] * len(streams)

        def echo(i: int) -> str:
            echoed[i] = True
            text = texts[i // req.n] or (tok.decode(prompts[i // req.n]) if tok else "")
            head = _prompt_logprobs_block(streams[i].seq) if echo_waits else None
            emitted[i] = _offset_after(head) if head else len(text)
            return chunk(i, text, None, head)
        try:
            if req.echo and not echo_waits:
                for i in range(len(streams)):
                    yield echo(i)
            while remaining:
                i, ev = await merged.get()
                if isinstance(ev, BaseException):
                    err = error_body(str(ev), "invalid_request_error", 400) if isinstance(ev, RequestError) else \
                        error_body(f"generation failed: {ev}", "server_error", 500)
                    yield "data: " + json.dumps(err) + "\n\n"
                    remaining -= 1
                    continue
                ntok[i] += 1
                if not echoed[i]:
                    yield echo(i)
                if scoring:
                    yield chunk(i, "", "length", None)
                    remaining -= 1
                    continue
                if not held[i]:     # the choice's text is text[:sent] + unsent; the event cuts it at delta_at
                    unsent[i] = unsent[i][:max(0, ev.delta_at - sent[i])] + ev.delta
                if tools is not None and tools.schema is None and ev.token_id == parser.calls_begin and \
                        not held[i]:
                    # DeepSeek's calls begin: the content so far goes out whole (what the stop-string holdback
                    # kept too), the rest is tool calls
                    delta, unsent[i], held[i] = unsent[i], "", True
                    sent[i] += len(delta)
                elif held[i]:
                    delta = ""
                else:
                    keep = 0 if ev.finished else min(holdback, len(unsent[i]))
                    delta, unsent[i] = unsent[i][:len(unsent[i]) - keep], unsent[i][len(unsent[i]) - keep:]
                    sent[i] += len(delta)
                lp = None if req.logprobs is None else _chat_logprobs([ev]) if chat else _logprobs_block([ev], emitted[i])
                # text offsets count the tokens' strings, as the whole response's do (not the text released)
                emitted[i] += len(lp["tokens"][0]) if lp is not None and not chat else len(delta)
                calls, deltas = None, None
                if ev.finished and tools is not None:
                    _, calls = _calls(tools, streams[i].seq, streams[i].seq.output_text)
                    deltas = [{"index": k, **c} for k, c in enumerate(calls)]
                if calls_out is not None:
                    deltas = calls_out[i].update(streams[i].seq.output_ids, final=ev.finished) if held[i] else None
                finish = ("tool_calls" if calls and ev.finish_reason == "stop" else ev.finish_reason) \
                    if ev.finished else None
                if not held[i] or delta or deltas or lp is not None or finish or not named[i]:
                    yield chunk(i, delta, finish, lp, deltas)
                if ev.finished:
                    remaining -= 1
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                             "model": model_name, "choices": [],
                                             "usage": _usage(req, prompts, streams)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:   # also on client disconnect (the generator is closed): free the sequences' KV blocks
            for t in tasks:
                t.cancel()
            for s in streams:
                loop.abort(s)

    def _prompt_logprobs_block(seq) -> dict:
        """The legacy logprobs shape for an echoed prompt: its first token has no logprob (None, as OpenAI's)."""
        name = (lambda t: tok.token_str(t)) if tok is not None else str
        tokens = [name(t) for t in seq.prompt_ids]
        offs, off = [], 0
        for t in tokens:
            offs.append(off)
            off += len(t)
        tops = [None] + [_by_string(_with_chosen(top, t, lp), tok) for top, t, lp in
                         zip(seq.prompt_top_logprobs, seq.prompt_ids[1:], seq.prompt_token_logprobs)]
        return {"tokens": tokens, "token_logprobs": [None] + list(seq.prompt_token_logprobs), "top_logprobs": tops,
                "text_offset": offs}

    def _offset_after(block: dict) -> int:
        """Where the tokens after a logprobs block start: offsets stay monotonic over the prompt's token strings
        (a BOS or a byte-fallback piece is not the echoed text's length)."""
        return block["text_offset"][-1] + len(block["tokens"][-1]) if block["tokens"] else 0

    def _stops(req) -> list[str]:
        return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

    return app


class GenerationFailed(Exception):
    """A request's generation failed inside the engine (HTTP 500)."""


def _parse(model, body: dict):
    """A request body as `model`. A field sent as null is a field not sent (the openai client sends nulls for unset
    arguments), except max_tokens, whose null is a value ("as many as the context leaves")."""
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None or k == "max_tokens"})
    except ValidationError as e:
        raise _invalid(e) from None


def _invalid(e: ValidationError) -> RequestError:
    """The first thing wrong with a request body, by its field."""
    errors = e.errors()
    first = errors[0]
    loc, msg = first["loc"], first["msg"]
    if len(loc) > 1 and loc[-1] in ("int", "float"):     # a number: pydantic reports each member of the union
        return RequestError(f"field '{_field(loc[:-1])}': Input should be a number")
    # a union reports each member it tried (loc "stop", "str" / "stop", "list[str]"): one message for them all,
    # or, when a member failed inside (a list's item), the forms the field takes
    where = _members_out(loc)
    if where != loc:
        field = where[:loc.index(next(x for x in loc if x not in where))]
        same = [x for x in errors if tuple(x["loc"][:len(field)]) == field]
        members = list(dict.fromkeys(x["loc"][len(field)] for x in same if len(x["loc"]) > len(field)))
        if any(len(x["loc"]) > len(field) + 1 for x in same):
            return RequestError(f"field '{_field(field)}': Input should be one of: {', '.join(members)}")
        tried = list(dict.fromkeys(x["msg"] for x in same))
        msg = tried[0] + "".join(f", or {m.removeprefix('Input should be ')}" for m in tried[1:])
        where = field
    return RequestError(f"field '{_field(where)}': {msg}")


def _members_out(loc: tuple) -> tuple:
    """A validation error's place without pydantic's union member names ('str', 'list[int]', 'dict[any,any]')."""
    return tuple(x for x in loc if not (isinstance(x, str) and (x in ("str", "int", "float", "bool", "none")
                                                                 or "[" in x)))


def _field(loc: tuple) -> str:
    """A validation error's place in a chat request: 'messages[0].role' (union member names left out)."""
    out = ""
    for x in loc[:3]:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or "body"


def _structure(req, engine) -> str | None:
    """The request's structured-output constraint as an llguidance grammar (None: free text), checked against the
    model's tokenizer (errors name the field)."""
    from .structured import grammar_of
    specs = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            specs.append(("response_format", "json_object", None))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise RequestError("field 'response_format': a json_schema response format needs "
                                   "'json_schema': {'name': ..., 'schema': {...}}")
            specs.append(("response_format", "json", js["schema"]))
        elif kind != "text":
            raise RequestError(f"field 'response_format': type {kind!r} is not one of 'text', 'json_object', "
                               f"'json_schema'")
    so = dict(req.structured_outputs or {})
    # vLLM's options that only tune its own backends' JSON whitespace (ours has none) or name a backend
    for key in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "backend"):
        so.pop(key, None)
    unknown = set(so) - {"json", "regex", "choice", "grammar", "json_object"}
    if unknown:
        raise RequestError(f"field 'structured_outputs': unknown key(s) {', '.join(sorted(unknown))} (one of json, "
                           f"regex, choice, grammar, json_object)")
    for key, value in so.items():
        if value is None:             # what clients send for an option left unset
            continue
        if key == "json_object":
            if not isinstance(value, bool):
                raise RequestError("field 'structured_outputs': 'json_object' takes true or false")
            if value:
                specs.append(("structured_outputs", "json_object", None))
        else:
            specs.append(("structured_outputs", key, value))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(req, "guided_" + key)
        if value is not None:
            specs.append(("guided_" + key, key, value))
    if len(specs) > 1:
        raise RequestError(f"more than one structured output asked for ({', '.join(s[0] for s in specs)}): "
                           f"send one")
    if not specs:
        return None
    field, kind, spec = specs[0]
    try:
        grammar = grammar_of(kind, spec)
        engine.grammars().check(grammar)
        return grammar
    except RequestError as e:
        raise RequestError(f"field '{field}': {e}") from None


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


@dataclasses.dataclass(frozen=True)
class ToolMode:
    """How a chat request's tool calls come out: parsed from the model's markers (schema None), or forced as JSON
    of `schema` (tool_choice "required": a list of calls; a named function: its arguments)."""
    schema: dict | None
    name: str | None
    single: bool = False       # parallel_tool_calls false: at most one call


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(body: dict) -> None:
    """A 400 naming the first string (or key) of the body that holds a lone UTF-16 surrogate: JSON's escapes allow
    one ("\\ud800"), UTF-8 text does not, and every string here ends up encoded (tokenized, compiled into a grammar,
    quoted in a message)."""
    stack: list[tuple[tuple, object]] = [((), body)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, loc, " (a key)")
                stack.append((loc + (k,), v))
        elif isinstance(value, list):
            stack.extend((loc + (i,), v) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))
        elif isinstance(value, str):
            _check_text(value, loc, "")


def _check_text(text: str, loc: tuple, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"field '{_field(loc)}'{what}: the text is not valid Unicode ({e.reason} at position "
                           f"{e.start})") from None


def _scoring(req) -> bool:
    """echo with max_tokens 0: the prompt comes back (with its logprobs), nothing is generated."""
    return bool(getattr(req, "echo", False)) and req.max_tokens == 0


def _by_string(top: dict[int, float], tok) -> dict[str, float]:
    """Top logprobs keyed by token text, as OpenAI's legacy shape; tokens that print alike (byte pieces as U+FFFD)
    keep the highest value (the dict comes best first)."""
    out: dict[str, float] = {}
    for t, v in top.items():
        out.setdefault(tok.token_str(t) if tok is not None else str(t), v)
    return out


def _with_chosen(top: dict[int, float], token: int, logprob: float) -> dict[int, float]:
    """A position's top logprobs with its own token's among them, as OpenAI's legacy shape always has it ("up to
    logprobs + 1 elements") and vLLM's completions give it: after the top ones where it is not one of them."""
    return top if token in top else {**top, token: logprob}


def _join_blocks(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _number(name: str, value) -> float:
    """A JSON number as a float; an integer too large for one is a 400, not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        raise RequestError(f"field '{name}'={shown(value)} is out of range") from None


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(p, seed=seed)


def _listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound to --host and --port (OptionError naming them if it cannot be)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise OptionError(f"--host {host!r}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds: a restart reuses the port
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OptionError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def serve(artifacts: str | Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          device: str = "cpu", max_waiting: int = 256, timing: bool = False,
          torchrun: tuple[int, int] | None = None, max_prefill_streak: int = 4, warmup: bool = False,
          prefix_caching: bool = True, speculative: dict | None = None,
          served_model_names: list[str] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (graceful: stop accepting, let in-flight requests finish for up to 30 s,
    abort the rest, stop the followers) or until a rank fails (then raise, naming it)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):     # a graceful stop is a normal exit, not a re-raised signal
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    # the port first: a taken port or an unknown host fails at once, naming the flag, not after minutes of loading
    # (and uvicorn's own failure to bind was three lines and exit code 3 after "serving ... on")
    sock = _listen_socket(host, port) if torchrun is None or torchrun[0] == 0 else None
    engine = Engine.from_artifact(artifacts, device=device, timing=timing, max_waiting=max_waiting,
                                  max_prefill_streak=max_prefill_streak, torchrun=torchrun,
                                  prefix_caching=prefix_caching, **(speculative or {}))
    if engine is None:      # a torchrun follower rank
        if sock is not None:
            sock.close()
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if warmup:              # before the port opens: /health answers once every shape has run
        t = time.perf_counter()
        try:
            n = engine.warmup(log.info)
        except BaseException:
            engine.close()
            raise
        log.info("warm-up: %d step shapes in %.1f s", n, time.perf_counter() - t)
    freeze_loaded_objects()
    metrics = Metrics(engine.manifest.compile.num_kv_blocks)
    server: Server | None = None

    def fatal(err: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    loop = EngineLoop(engine, on_step=metrics.on_step, on_abort=metrics.on_abort, on_fatal=fatal)
    loop.start()
    app = build_app(loop, list(served_model_names or []) or engine.manifest.name, metrics, api_key)
    log.info("serving %s (%s) on http://%s:%d%s", engine.manifest.name, artifacts, host, port,
             " (API key required on /v1)" if api_key else "")
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30))
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
        engine.close()
        if engine.runner.timer is not None:
            print(engine.runner.timer.table())
    if loop.error is not None:
        raise loop.error if isinstance(loop.error, RankFailure) else RankFailure(f"engine failed: {loop.error!r}")
    log.info("stopped")
    if engine.torchrun:        # end without tearing gloo down (distributed.exit_without_teardown)
        from .distributed import exit_without_teardown
        exit_without_teardown(0)
