"""The real server on a free local port, driven over HTTP: the openai client, raw SSE, errors, load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ports import free_port

API_KEY = "test-key"


def start_server(art, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`deepinfer-run ART` on a free port; returns once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from deepinfer.cli import run_main; run_main()", str(art),
                             "--port", str(port), *args], env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def server(checkpoints, compile_artifact):
    art = compile_artifact(checkpoints["base"])
    proc, base = start_server(art, "--max-waiting", "64", env={"DEEPINFER_API_KEY": API_KEY})
    yield {"base": base, "art": art, "proc": proc}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def post(server, body, path="/v1/completions", key=API_KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["base"] + path, json=body, headers=headers, timeout=120, **kw)


def counts(usage: dict) -> dict:
    """A usage block's token counts (cached_tokens depends on what earlier requests left in the prefix cache)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def offline_ids(art, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    # --top-k -1: the server's and vLLM's "off", taken offline too
    args = [sys.executable, "-c", "from deepinfer.cli import run_main; run_main()", str(art), "--json",
            "--max-tokens", str(max_tokens), "--ignore-eos", "--top-k", "-1"]
    for p in prompt_ids:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [json.loads(line)["token_ids"] for line in out.splitlines()]


def test_openai_client_non_streaming_and_streaming(server):
    from openai import OpenAI
    client = OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert text == r.choices[0].text


def test_streamed_text_with_stop_strings_is_the_whole_responses(server):
    """Stop strings that begin in one token's text and end in a later one: the stream (whose events carry each
    token's text and where it starts, the holdback keeping what a stop may still cut) gives the text the whole
    response does, cut before the first stop; a stop never written holds back nothing at the end."""
    base, headers = server["base"] + "/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Once upon", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    full = httpx.post(base, json={**body, "logprobs": 0}, headers=headers, timeout=60).json()["choices"][0]
    text, offs = full["text"], full["logprobs"]["text_offset"]
    # 3 characters that cross a token boundary (the random model's are often one byte)
    at = next((k for k in range(1, len(text) - 3) if "\ufffd" not in text[k - 1:k + 3] and
              any(k < o < k + 3 for o in offs)), None)
    assert at is not None, (text, offs)
    cases = [[text[at:at + 3]], ["never-written-" * 3, text[at - 1:at + 2]], ["never-written"]]
    for stop in cases:
        whole = httpx.post(base, json={**body, "stop": stop}, headers=headers, timeout=60).json()["choices"][0]
        hits = [text.find(x) for x in stop if x in text]
        assert whole["text"] == (text[:min(hits)] if hits else text), stop
        assert whole["finish_reason"] == ("stop" if hits else "length")
        chunks = []
        with httpx.stream("POST", base, json={**body, "stop": stop, "stream": True}, headers=headers,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0])
        assert "".join(c["text"] for c in chunks) == whole["text"], stop
        assert chunks[-1]["finish_reason"] == whole["finish_reason"]


def test_sse_framing_and_usage_chunk(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    assert len(token_chunks) == 6                      # one chunk per generated token
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 5 + ["length"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 6,
                                                         "total_tokens": 9,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}


def test_served_greedy_equals_offline_run_also_under_32_concurrent(server):
    prompts = [[(7 * i + j) % 300 + 2 for j in range(3 + i % 40)] for i in range(32)]
    want = offline_ids(server["art"], prompts, 10)

    def one(p):
        r = post(server, {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"]

    with ThreadPoolExecutor(32) as pool:
        served = list(pool.map(one, prompts))
    for ids, (text, tokens) in zip(want, served):
        assert len(tokens) == len(ids) == 10
        assert text == post(server, {"tokens": ids}, path="/detokenize").json()["prompt"]


@pytest.mark.parametrize("body,fragment", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ({"prompt": [1] * 120, "max_tokens": 20}, "context limit"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 0}, "'n'"),
    ({"prompt": "x", "model": "other"}, "not served"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed"),                  # beyond int64: torch's generator would raise
    ({"prompt": "x", "seed": 2 ** 63 - 1, "n": 2}, "seed"),      # seed + 1 for the second choice overflows
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "n": 2, "temperature": 0}, "identical choices"),
    ({"prompt": "x", "n": 2, "temperature": 1e-6}, "identical choices"),   # greedy too
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": "1.2"}, "repetition_penalty"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"5": -101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"400": 1}}, "logit_bias token id 400"),
    ({"prompt": "x", "logit_bias": {"x5": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias"),        # a digit to isdigit(), not to int()
    ({"prompt": "x", "logit_bias": {"5": 10 ** 400}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1" * 5000: 1}}, "not a token id"),   # int() refuses 4300+ digits
    ({"prompt": "x", "temperature": "hot"}, "'temperature': Input should be a number"),
    ({"prompt": [[5, 6]] * 65, "max_tokens": 2}, "--max-waiting"),       # more than the queue ever holds
    ({"prompt": ["x"] * 5, "n": 13, "temperature": 1, "max_tokens": 2}, "--max-waiting"),   # 65 sequences
    ({"prompt": "x", "temperature": 10 ** 400}, "temperature"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [320]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
    ({"prompt": "x", "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"yaml": "a"}}, "unknown key"),
    ({"prompt": "x", "structured_outputs": {"choice": []}}, "choice"),
    ({"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, "more than one"),
    ({"prompt": "x", "guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": "x", "guided_json": "[" * 100000}, "nested too deeply"),    # was a RecursionError: a 500
    ({"prompt": "x", "logit_bias": {"5": 100, "05": 100}}, "name the same token"),   # summed past +100
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "at most 1024"),
    ({"prompt": "x", "stop": ["a"] * 65}, "at most 64"),
    ({"prompt": "x", "repetition_penalty": 1e-50}, "repetition_penalty"),   # 0 in float32: inf logits
    ({"prompt": "x", "temperature": 1e39}, "temperature"),                  # inf in float32
    ({"prompt": "x", "stop": 5}, "field 'stop': Input should be a valid string, or a valid list"),  # was 'stop.str'
    ({"prompt": [1, "a"]}, "field 'prompt': Input should be one of: str, list[int]"),
    ({"prompt": "x", "n": 2, "temperature": -1}, "temperature=-1.0 must be between 0"),
    ({"prompt": "x", "n": 10 ** 300}, "field 'n'=10000000000000000000...(301 characters)"),   # not 301 digits
    ({"prompt": "x", "guided_grammar": "start: a\na: a"}, "admits no text at all"),     # no token can begin it
    ({"prompt": "x", "guided_json": {"$ref": "#"}}, "admits no text at all"),
    ({"prompt": [5] * 129, "max_tokens": 0, "echo": True, "logprobs": 0}, "the prompt (129 tokens) exceeds"),
    # refused from its length in bytes, before a tokenizer spends seconds and gigabytes on it
    ({"prompt": "h\u00e9llo w\u00f6rld " * 100_000}, "far more than the compiled context limit of 128 tokens"),
])
def test_bad_requests_get_openai_errors(server, body, fragment):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"


def test_nulls_are_unset_fields_and_streamed_offsets_match(server):
    """openai-python sends null for arguments passed as None: a null field is a field not sent (max_tokens' null
    is 'as many as the context leaves'). Streamed logprobs' text offsets are the non-streamed ones."""
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(server, body)
    nulls = post(server, {**body, **dict.fromkeys(("top_p", "n", "stream", "echo", "frequency_penalty", "seed",
                                                   "logprobs", "stop", "suffix", "user"))})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    nested = post(server, {**body, "structured_outputs": {"json_object": None, "regex": None, "backend": None}})
    assert nested.status_code == 200 and nested.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    r = post(server, {"prompt": [5] * 100, "max_tokens": None, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 28   # the context limit is 128
    body = {"prompt": "Hi", "max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": True, "stop": ["zzzz"]}
    whole = post(server, body).json()["choices"][0]["logprobs"]
    with httpx.stream("POST", server["base"] + "/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        chunks = [json.loads(e[6:]) for e in "".join(r.iter_text()).split("\n\n") if e and e != "data: [DONE]"]
    streamed = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == whole["text_offset"] and len(streamed) == 8


def test_a_request_bigger_than_the_room_left_is_refused_whole(server):
    """A request's sequences are queued all together or not at all: one that does not fit the waiting queue now
    gets a 503 without having taken any place in it (nothing started, nothing counted as aborted)."""
    import asyncio
    from deepinfer.runtime.engine_loop import EngineLoop
    from deepinfer.runtime.sequence import SamplingParams

    from deepinfer.common.errors import CapacityError, RequestError

    class QueueOnly:                     # what the queue's bookkeeping reads: a queue of 4 with 2 waiting, no steps
        class scheduler:
            class cfg:
                max_waiting = 4
            waiting = [object()] * 2
        has_work = False

        def validate(self, ids, params):
            pass
    loop = EngineLoop(QueueOnly())
    loop.start()
    try:
        sp = SamplingParams()
        with pytest.raises(CapacityError, match="full"):
            asyncio.run(loop.submit([([1], sp)] * 3))
        assert loop.num_pending == 0 and loop._inbox.empty()
        with pytest.raises(RequestError, match="more than this server queues"):
            asyncio.run(loop.submit([([1], sp)] * 5))
    finally:
        loop.stop()


def test_chat_completions_are_completions_of_the_chat_templates_prompt(server):
    """The chat endpoint = transformers' apply_chat_template ids through /v1/completions, in chat's shapes."""
    from openai import OpenAI
    from transformers import PreTrainedTokenizerFast
    client = OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = PreTrainedTokenizerFast.from_pretrained(server["art"] / "tokenizer").apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = post(server, {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                         "logprobs": 1}).json()["choices"][0]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=1, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want["text"] and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    assert post(server, {"messages": messages}, path="/tokenize").json()["tokens"] == ids      # vLLM's chat form
    assert post(server, {"messages": messages, "stream": True}, path="/tokenize").status_code == 400
    assert [e.token for e in c.logprobs.content] == want["logprobs"]["tokens"]
    assert [e.logprob for e in c.logprobs.content] == pytest.approx(want["logprobs"]["token_logprobs"])
    assert all(len(e.top_logprobs) == 1 for e in c.logprobs.content)
    # each token's own bytes (a piece of a UTF-8 character too): together they are the text
    assert b"".join(bytes(e.bytes) for e in c.logprobs.content).decode("utf-8", "replace") == c.message.content
    r = post(server, {"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
                      "structured_outputs": {"choice": ["é😀日"]}}, path="/v1/chat/completions").json()["choices"][0]
    pieces = [bytes(e["bytes"]) for e in r["logprobs"]["content"]]
    assert b"".join(pieces) == "é😀日".encode() and len(pieces) > 3 and r["message"]["content"] == "é😀日"
    # streamed: the role first, then the same text, then the usage
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=8,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # content as text parts is joined with newlines (as vLLM does)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    joined = [{"role": "user", "content": "Hel\nlo"}]
    a, b = (post(server, {"messages": m, "max_tokens": 4, "temperature": 0}, path="/v1/chat/completions").json()
            for m in (parts, joined))
    assert counts(a["usage"]) == counts(b["usage"]) and a["choices"][0]["message"] == b["choices"][0]["message"]
    # what clients send by default changes nothing: nulls, neutral tool and format fields, 'developer' = 'system'
    plain = {"messages": messages, "max_tokens": 4, "temperature": 0}
    extras = {"messages": [{"role": "developer", "content": "Be brief.", "name": None}, messages[1]],
              "max_tokens": 4, "temperature": 0, "stop": None, "n": None, "top_p": None, "tools": [],
              "tool_choice": "none", "parallel_tool_calls": False, "response_format": {"type": "text"},
              "logit_bias": {}, "store": False, "metadata": {"k": "v"}}
    a, b = (post(server, body, path="/v1/chat/completions").json() for body in (plain, extras))
    assert counts(a["usage"]) == counts(b["usage"]) and a["choices"][0]["message"] == b["choices"][0]["message"], b


@pytest.mark.parametrize("body,fragment", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role robot"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "only text parts"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs 'logprobs'"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}, "disagree"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "needs 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "no tool named 'g'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, "structured output already"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"five": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, "not served"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, "context limit"),
])
def test_bad_chat_requests_get_openai_errors(server, body, fragment):
    r = post(server, body, path="/v1/chat/completions")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_auth_and_models(server):
    r = httpx.post(server["base"] + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert post(server, {"prompt": "x"}, key=None).status_code == 401
    assert post(server, {"prompt": "x"}, key="wrong").status_code == 401
    assert httpx.get(server["base"] + "/health").status_code == 200          # not under /v1: no key
    models = httpx.get(server["base"] + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert models["data"][0]["id"] == models["data"][0]["root"]
    t = post(server, {"prompt": "Hello"}, path="/tokenize").json()
    assert t["count"] == len(t["tokens"]) and post(server, {"tokens": t["tokens"]}, path="/detokenize").json()[
        "prompt"] == "Hello"
    bare = post(server, {"prompt": "Hello", "add_special_tokens": False}, path="/tokenize").json()["tokens"]
    assert bare == t["tokens"][len(t["tokens"]) - len(bare):] and len(bare) <= len(t["tokens"])
    assert post(server, {"prompt": "Hello", "add_special_tokens": "no"}, path="/tokenize").status_code == 400


def test_repeated_prompts_report_cached_tokens_and_the_metrics_count_hits(server):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field): the prompt tokens whose KV the prefix cache
    held, whole blocks of 16 leaving the last token to compute; the text is the same as without the cache."""
    prompt = [(11 * j) % 300 + 2 for j in range(50)]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first, again = post(server, body).json(), post(server, body).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    other = post(server, dict(body, prompt=prompt[:20] + [7] * 30)).json()
    assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    metrics = httpx.get(server["base"] + "/metrics").text
    hits = next(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("deepinfer_prefix_cache_hits_"))
    assert hits >= 48 + 16 and "deepinfer_kv_blocks_cached" in metrics


def test_without_the_prefix_cache_usage_still_reports_cached_tokens(server):
    """--no-prefix-caching: a repeated prompt is computed again, and usage keeps OpenAI's shape with
    cached_tokens 0 (the key was missing, which broke clients reading it); the text is the cached server's."""
    proc, base = start_server(server["art"], "--no-prefix-caching")
    try:
        prompt = [(11 * j) % 300 + 2 for j in range(50)]
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        replies = [httpx.post(base + "/v1/completions", json=body, timeout=60).json() for _ in range(2)]
        assert [r["usage"]["prompt_tokens_details"] for r in replies] == [{"cached_tokens": 0}] * 2
        assert replies[1]["choices"][0]["text"] == post(server, body).json()["choices"][0]["text"]
        chat = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}})
        usage = [json.loads(ln[6:]) for ln in chat.text.splitlines() if ln.startswith("data: {")][-1]["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(server, checkpoints):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1; and the older max_tokens 0,
    which scores the prompt without generating): the prompt's tokens with their logprobs (None for the first),
    transformers' log-softmax at every position, then the generated token's; streamed, the prompt's chunk
    carries them."""
    from checkpoints import hf_logits, hf_model
    prompt = [(13 * j) % 300 + 2 for j in range(45)]
    ref = torch.log_softmax(hf_logits(hf_model(checkpoints["base"]), prompt), dim=-1)
    want = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = post(server, body).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)
    # each position's top logprobs hold the best token and the position's own (OpenAI's "logprobs + 1")
    for i, top in enumerate(lp["top_logprobs"][1:], 1):
        assert 1 <= len(top) <= 2 and top[lp["tokens"][i]] >= lp["token_logprobs"][i] - 1e-6
    assert lp["text_offset"] == sorted(lp["text_offset"])      # monotonic from the prompt into the output
    assert r["usage"]["completion_tokens"] == 1
    scored = post(server, dict(body, max_tokens=0)).json()
    c = scored["choices"][0]
    assert c["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1] and c["finish_reason"] == "length"
    assert c["text"] == post(server, {"tokens": prompt}, path="/detokenize").json()["prompt"]
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(prompt)
    with httpx.stream("POST", server["base"] + "/v1/completions", json=dict(body, stream=True, max_tokens=3),
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as resp:
        chunks = [json.loads(e[6:]) for e in "".join(resp.iter_text()).split("\n\n") if e.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == c["text"] and first["logprobs"]["token_logprobs"] == c["logprobs"]["token_logprobs"]
    head = first["logprobs"]
    assert len(chunks) == 4 and chunks[1]["choices"][0]["logprobs"]["text_offset"] == [
        head["text_offset"][-1] + len(head["tokens"][-1])]      # offsets go on from the prompt's tokens
    assert post(server, {"prompt": "x", "max_tokens": 0}).status_code == 400       # 0 only with echo


def test_scoring_a_prompt_that_fills_the_context_and_logprobs_0_give_the_chosen_token(server):
    """echo with max_tokens 0 scores a prompt of the whole compiled context (its one internal token needs no KV
    slot); logprobs 0 gives each token's own logprob and nothing else, as OpenAI's legacy shape."""
    prompt = [(7 * j) % 300 + 2 for j in range(128)]
    r = post(server, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 128 and all(x is not None for x in lp["token_logprobs"][1:])
    assert post(server, dict(prompt=prompt[:100], max_tokens=0, echo=True, logprobs=0)).json()["choices"][0][
        "logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][:100], abs=1e-4)
    gen = post(server, {"prompt": "Hello", "max_tokens": 4, "temperature": 1, "seed": 5, "logprobs": 0}).json()
    g = gen["choices"][0]["logprobs"]
    assert g["top_logprobs"] == [{t: v} for t, v in zip(g["tokens"], g["token_logprobs"])]


def test_a_grammar_that_breaks_mid_generation_is_an_error_not_a_stop(server):
    """A grammar past llguidance's parser limits (2000 items in a row) after its first token: the request gets a
    400 naming the failure (streamed: an error event), not finish_reason 'stop' with text that breaks it; a choice
    of 2500 strings (one lexer terminal) works."""
    rule = " | ".join(f'"w{i}"' for i in range(2500))
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "guided_grammar": f'start: "x" c\nc: {rule}'}
    r = post(server, body)
    assert r.status_code == 400 and "structured output failed after 1 tokens" in r.json()["error"]["message"], r.text
    with httpx.stream("POST", server["base"] + "/v1/completions", json=dict(body, stream=True),
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as resp:
        events = [e for e in "".join(resp.iter_text()).split("\n\n") if e]
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == 400 and "failed after" in err["message"] and events[-1] == "data: [DONE]"
    choices = [f"w{i}" for i in range(2500)]
    c = post(server, {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "guided_choice": choices}).json()
    assert c["choices"][0]["text"] in choices and c["choices"][0]["finish_reason"] == "stop"
    assert post(server, {"prompt": "Hello", "max_tokens": 4}).status_code == 200


def test_structured_outputs_follow_their_schema_over_both_endpoints(server):
    """OpenAI's response_format (json_schema through the openai client's chat, json_object) and vLLM's
    structured_outputs / guided_* (regex, choice) constrain what is generated: the text parses and matches."""
    import re
    from openai import OpenAI
    client = OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "kind": {"enum": ["a", "b"]}},
              "required": ["name", "n", "kind"], "additionalProperties": False}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give JSON"}],
                                       max_tokens=80, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "thing", "schema": schema}})
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"name", "n", "kind"} and isinstance(out["name"], str) and len(out["name"]) <= 8
    assert 0 <= out["n"] <= 99 and out["kind"] in ("a", "b") and r.choices[0].finish_reason == "stop"
    body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0.8, "seed": 3}
    c = post(server, dict(body, structured_outputs={"regex": "[0-9]{3}-[a-z]{2,4}"})).json()["choices"][0]
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", c["text"]) and c["finish_reason"] == "stop"
    c = post(server, dict(body, guided_choice=["left", "right", "up \"quoted\""])).json()["choices"][0]
    assert c["text"] in ("left", "right", 'up "quoted"')
    anything = post(server, dict(body, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "any", "schema": True}})).json()["choices"][0]
    if anything["finish_reason"] == "stop":
        json.loads(anything["text"])
    off = post(server, dict(body, max_tokens=5, structured_outputs={"json_object": False}))
    assert off.status_code == 200 and off.json()["usage"]["completion_tokens"] == 5 or \
        off.json()["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="Hello", max_tokens=40, temperature=0, stream=True,
        extra_body={"response_format": {"type": "json_object"}}) if ch.choices)
    assert streamed.startswith("{")


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
                   "additionalProperties": False}}}]


def test_tool_calls_parsed_from_deepseek_markers_and_forced_by_tool_choice(server):
    """tool_choice auto: DeepSeek-V3's markers in the output (here forced by a grammar, as a trained model would
    write them) come back as tool_calls with the text before them as content, non-streamed and streamed;
    'required' and a named function hold the output to the tools' schemas; 'none' leaves text as text."""
    from openai import OpenAI
    client = OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Oslo?"}]
    marked = ('start: "Sure." <[258]> call call <[259]>\n'
              'call: <[260]> "get_weather" <[262]> args <[261]>\n'
              'args: %json{"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, '
              '"required": ["city"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}')
    force = {"structured_outputs": {"grammar": marked}}
    r = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=75, temperature=0,
                                       extra_body=force)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure." and len(c.message.tool_calls) == 2
    for call in c.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
    chunks = list(client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=75,
                                                 temperature=0, stream=True, extra_body=force))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Sure."
    # streamed as generated (OpenAI's shape): a call's id, type and name first, then its arguments in pieces
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    firsts = [d for d in deltas if d.id]
    assert [d.index for d in firsts] == [0, 1] and all(d.type == "function" and d.function.name == "get_weather"
                                                       and d.function.arguments == "" for d in firsts)
    assert len(deltas) > 4 and all(d.id is None and d.function.name is None for d in deltas if d not in firsts)
    args = ["".join(d.function.arguments or "" for d in deltas if d.index == k) for k in (0, 1)]
    assert args == [t.function.arguments for t in c.message.tool_calls]
    # a stop string holds back the stream's tail; the markers release it whole
    chunks = list(client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=75,
                                                 temperature=0, stream=True, stop=["never-written"], extra_body=force))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Sure."
    # parallel_tool_calls false: one call
    one = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=75, temperature=0,
                                         parallel_tool_calls=False, extra_body=force)
    assert len(one.choices[0].message.tool_calls) == 1
    one = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"
    # the calls and their results go back to the model as clients send them: content null, arguments a JSON string
    # (or an object, which some clients send); without the tools this time, to fit the test model's context
    call = c.message.tool_calls[0]
    turn = [*messages, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "12 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "15 C"}]
    r = post(server, {"messages": turn, "max_tokens": 3, "temperature": 0}, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    ids = post(server, {"messages": turn}, path="/tokenize").json()["tokens"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    text = post(server, {"tokens": ids}, path="/detokenize").json()["prompt"]
    assert '{"city": "Paris"}' in text and "15 C" in text and "None" not in text
    # forced: a list of calls ('required'), the named function's arguments
    close = post(server, {"prompt": "]", "add_special_tokens": False}, path="/tokenize").json()["tokens"][0]
    r = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, tool_choice="required",
                                       max_tokens=80, temperature=0,   # one call: "]" as soon as the list may end
                                       logit_bias={str(close): 30})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and all(
        t.function.name == "get_weather" and json.loads(t.function.arguments)["city"] in ("Oslo", "Paris")
        for t in calls)
    r = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Paris") and r.choices[0].message.content is None
    cut = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=3, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls[0].function.arguments
    # a stop string inside the forced JSON: no call (was one with the arguments cut short, as "tool_calls")
    for stream in (False, True):
        r = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=60,
                                           temperature=0, stop=["city"], stream=stream,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if stream:
            chunks = list(r)
            assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        else:
            assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    # 'required' cut short before a whole call: no call, and the JSON so far is not content either
    cut = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, max_tokens=3, temperature=0,
                                         tool_choice="required")
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content == ""
    # a function without parameters may say so with null (OpenAI's schema: optional)
    r = post(server, {"messages": messages, "max_tokens": 40, "temperature": 0, "tool_choice": "required",
                      "tools": [{"type": "function", "function": {"name": "now", "parameters": None}}]},
             path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    r = client.chat.completions.create(model=model, messages=messages, tools=WEATHER, tool_choice="none",
                                       max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_a_drafting_server_streams_what_the_plain_one_returns(server):
    """--num-speculative-tokens: a step may output several tokens of a choice; the stream still sends each token
    with its own text and logprobs, and the whole equals the plain server's greedy output; /metrics counts the
    drafts. The same server answers to the names --served-model-name gives it (the first one reported)."""
    proc, base = start_server(server["art"], "--num-speculative-tokens", "3", "--served-model-name",
                              "deepseek-ai/DeepSeek-V3", "--served-model-name", "ds")
    try:
        models = httpx.get(base + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["deepseek-ai/DeepSeek-V3", "ds"]
        r = httpx.post(base + "/v1/completions", json={"model": "ds", "prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "deepseek-ai/DeepSeek-V3"
        r = httpx.post(base + "/v1/completions", json={"model": models[0]["root"], "prompt": [5], "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 400 and "'deepseek-ai/DeepSeek-V3', 'ds'" in r.json()["error"]["message"]
        unit = [11, 57, 203, 9, 88, 140]
        body = {"prompt": unit * 4, "max_tokens": 30, "temperature": 0, "logprobs": 1, "ignore_eos": True}
        want = post(server, body).json()["choices"][0]
        got = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
        chunks, usage = [], []
        stream = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with httpx.stream("POST", base + "/v1/completions", json=stream, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    if data["choices"]:
                        chunks.append(data["choices"][0])
                        usage.append(data["usage"]["completion_tokens"])
        assert "".join(c["text"] for c in chunks) == want["text"]
        assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == want["logprobs"]["tokens"]
        assert usage == list(range(1, 31))        # tokens streamed so far, not what the step already made
        metrics = httpx.get(base + "/metrics").text
        drafted = float(next(l.split()[-1] for l in metrics.splitlines()
                             if l.startswith("deepinfer_spec_decode_num_draft_tokens_total")))
        assert drafted > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_oversized_bodies_are_413s_and_the_server_keeps_serving(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    r = httpx.post(server["base"] + "/v1/completions", content=big, headers=headers, timeout=60)
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]

    def chunks():           # no Content-Length: the cap holds while reading
        for _ in range(17):
            yield b" " * (1 << 20)
    r = httpx.post(server["base"] + "/v1/chat/completions", content=chunks(), headers=headers, timeout=60)
    assert r.status_code == 413
    assert post(server, {"prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_a_taken_port_fails_at_once_naming_it(server):
    """Bound before the engine loads: a port in use is one line and exit code 2 at once (uvicorn's own failure came
    after loading, after a "serving on" line, as three lines and exit code 3)."""
    port = server["base"].rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-c", "from deepinfer.cli import run_main; run_main()", str(server["art"]),
                        "--port", port], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        f"error: --host 127.0.0.1 --port {port}: cannot listen there"), r.stderr
    assert "serving" not in r.stderr


def test_tiny_temperature_is_greedy_not_a_failed_step(server):
    """1e-40 overflows logits / temperature to inf; it must behave as greedy (as vLLM), not fail the batch."""
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True}
    greedy = post(server, dict(body, temperature=0)).json()["choices"][0]["text"]
    tiny = post(server, dict(body, temperature=1e-40, seed=3))
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy


def test_load_then_no_leaked_blocks(server):
    def one(i):
        r = post(server, {"prompt": [2 + i % 50, 3, 4], "max_tokens": 4 + i % 5, "temperature": 0.7, "seed": i})
        return r.status_code

    with ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(one, range(200)))
    assert codes.count(200) + codes.count(503) == 200 and codes.count(200) > 0
    metrics = httpx.get(server["base"] + "/metrics").text
    assert "deepinfer_kv_blocks_used 0.0" in metrics
    assert "deepinfer_requests_running 0.0" in metrics


def test_disconnect_aborts_and_frees_blocks(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        for _ in r.iter_lines():
            break
    time.sleep(1.5)
    assert post(server, {"prompt": [3], "max_tokens": 2}).status_code == 200
    metrics = httpx.get(server["base"] + "/metrics").text
    assert "deepinfer_kv_blocks_used 0.0" in metrics
    assert 'deepinfer_requests_finished_total{reason="abort"} 1.0' in metrics


def _aborted(server) -> float:
    for line in httpx.get(server["base"] + "/metrics").text.splitlines():
        if line.startswith('deepinfer_requests_finished_total{reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_non_streaming_disconnect_aborts_too(server):
    """A client that gives up on a non-streaming request: its sequences stop and free their blocks."""
    import socket
    before = _aborted(server)
    host, port = server["base"].removeprefix("http://").split(":")
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "n": 2, "temperature": 1})
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        time.sleep(0.05)
    time.sleep(2.0)
    assert _aborted(server) == before + 2
    metrics = httpx.get(server["base"] + "/metrics").text
    assert "deepinfer_kv_blocks_used 0.0" in metrics and "deepinfer_requests_running 0.0" in metrics
    assert 'deepinfer_requests_rejected_total{status="503"}' not in metrics    # a client gone is not overload


@pytest.mark.parametrize("raw,fragment", [
    ('{"prompt": "x", "temperature": NaN}', "NaN"),
    ('{"prompt": "x", "top_p": Infinity}', "Infinity"),
    ('{"prompt": "x", "temperature": 1e309}', "temperature"),   # valid JSON that overflows to inf
    ('{"prompt": "x", "top_p": 1e309}', "top_p"),
    ('{"prompt": "x",', "not valid JSON"),
    ('{"prompt": "ab\\ud800c"}', "not valid Unicode"),          # a lone surrogate: valid JSON, invalid text
    # in any field or key (a message quoting one could not be encoded: a 500; llguidance raised on a regex's)
    ('{"prompt": "x", "model": "\\ud800"}', "field 'model': the text is not valid Unicode"),
    ('{"prompt": "x", "guided_regex": "a\\uDBFF"}', "field 'guided_regex': the text is not valid Unicode"),
    ('{"prompt": "x", "structured_outputs": {"\\ud800": 1}}', "field 'structured_outputs' (a key)"),
    ('{"prompt": "x", "stop": ["ok", "\\udc00"]}', "field 'stop[1]'"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_non_finite_numbers_and_broken_json_are_400s(server, raw, fragment):
    r = httpx.post(server["base"] + "/v1/completions", content=raw,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_fuzzed_requests_get_4xx_and_the_server_keeps_serving(server):
    """Random malformed bodies (hypothesis): each gets a 4xx with an OpenAI error body; a normal request after
    all of them still succeeds."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(),
                        st.text(max_size=20))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=10)
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream", "logprobs", "echo",
              "seed", "stream_options", "ignore_eos", "model"]
    bad_body = st.one_of(
        st.dictionaries(st.sampled_from(fields), values, min_size=1, max_size=5).filter(
            lambda d: not _is_valid(d)),
        st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in fields), values, min_size=1),
        st.lists(values, max_size=3))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bad_body)
    def check(body):
        # json.dumps writes NaN/Infinity as bare constants, which are not JSON: those must be 400s too
        r = httpx.post(server["base"] + "/v1/completions", content=json.dumps(body),
                       headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
                       timeout=60)
        # The filter above cannot rule out every valid request (e.g. {"prompt": "a", "top_k": 3}); those may
        # succeed. What must never happen is a 5xx or a dropped connection.
        assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text[:300])
        if r.status_code != 200:
            assert "error" in r.json()

    check()
    r = post(server, {"prompt": [5, 6], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _is_valid(d: dict) -> bool:
    """Bodies the server should accept (the fuzzer looks for the others)."""
    p = d.get("prompt")
    ok_prompt = (isinstance(p, str) and p) or (isinstance(p, list) and p and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 320 for t in p))
    if not ok_prompt:
        return False
    mt = d.get("max_tokens", 16)
    return isinstance(mt, int) and not isinstance(mt, bool) and 1 <= mt <= 64 and set(d) <= {"prompt", "max_tokens"}


def test_sigterm_shuts_down_gracefully(checkpoints, compile_artifact):
    """Also the start-up warm-up (--warmup; on by default on GPUs) with followers: every step shape runs on all
    ranks before the port opens."""
    art = compile_artifact(checkpoints["base"], cp=2, ep=2)
    proc, base = start_server(art, "--warmup")
    r = httpx.post(base + "/v1/completions", json={"prompt": [4, 5], "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    children = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "follower_main"], capture_output=True,
                              text=True).stdout.split()
    assert children, "the multi-rank server should have spawned a follower"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    log = proc.stdout.read()
    assert "warm-up 1/" in log and "step shapes in" in log, log[-2000:]
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, "follower left running"
