"""Chat templates: the prompt ids we render and tokenize are transformers' `apply_chat_template` ids."""

from __future__ import annotations

import json
import shutil

import pytest

from checkpoints import CHAT_TEMPLATE, write_byte_tokenizer
from deepinfer.common.errors import ArtifactError, RequestError
from deepinfer.runtime.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld ✓"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again\nand again"}],
    [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def artifact_tokenizer(tmp_path, config: dict | None = None, jinja: str | None = None):
    """A tokenizer directory laid out as in an artifact; returns (our Tokenizer, the checkpoint directory)."""
    ck = tmp_path / "ck"
    ck.mkdir(parents=True)
    write_byte_tokenizer(ck, 320)
    if config is not None:
        (ck / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (ck / "chat_template.jinja").write_text(jinja)
    art = tmp_path / "art"
    (art / "tokenizer").mkdir(parents=True)
    files = []
    for f in ck.iterdir():
        shutil.copy(f, art / "tokenizer" / f.name)
        files.append(f"tokenizer/{f.name}")
    return load_tokenizer(art, files, 0), ck


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_prompt_ids_equal_transformers_apply_chat_template(tmp_path, generation_prompt):
    from transformers import PreTrainedTokenizerFast
    ours, ck = artifact_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(ck)
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):      # tools reach the template as transformers passes them
            want = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                          tools=tools)
            want = list(want["input_ids"] if hasattr(want, "keys") else want)
            assert ours.encode_chat(messages, generation_prompt, tools) == want
    # the special tokens the template writes are single tokens, not their text
    ids = ours.encode_chat(CONVERSATIONS[1])
    assert ids[0] == 0 and ids.count(1) == 1


def test_template_sources_and_special_tokens(tmp_path):
    # chat_template.jinja wins over tokenizer_config.json's; AddedToken-style special tokens are read
    jinja = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    ours, _ = artifact_tokenizer(tmp_path, config={"chat_template": "unused", "bos_token": {
        "__type": "AddedToken", "content": "<|bos|>"}}, jinja=jinja)
    assert ours.chat_template.render([{"role": "user", "content": "x"}]) == "<|bos|>[user]x"
    # a list of named templates: the one named "default"
    ours, _ = artifact_tokenizer(tmp_path / "b", config={"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]})
    assert ours.chat_template.render([{"role": "user", "content": "x"}]) == "D1"
    # tools and documents are None, not undefined, as transformers renders without them
    ours, _ = artifact_tokenizer(tmp_path / "c", config={
        "chat_template": "{% if tools is not none %}TOOLS{% endif %}{% if documents is none %}x{% endif %}"})
    assert ours.chat_template.render([]) == "x"


def test_no_template_and_broken_templates_are_named(tmp_path):
    ours, _ = artifact_tokenizer(tmp_path, config={"add_bos_token": False})
    with pytest.raises(RequestError, match="no chat template"):
        ours.encode_chat([{"role": "user", "content": "x"}])
    # a template that does not parse: chat is off (completions still load), and chat requests say why
    ours, _ = artifact_tokenizer(tmp_path / "b", config={"chat_template": "{% for m in messages %}"})
    with pytest.raises(RequestError, match="chat is off.*does not parse"):
        ours.encode_chat([{"role": "user", "content": "x"}])
    assert ours.decode(ours.encode("ab", add_special_tokens=False)) == "ab"
    # the template's own refusal, and a message it cannot handle, are request errors
    ours, _ = artifact_tokenizer(tmp_path / "c")
    with pytest.raises(RequestError, match="unknown role robot"):
        ours.encode_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(RequestError, match="could not render"):
        ours.encode_chat([{"role": "user", "content": None}])
    ours, _ = artifact_tokenizer(tmp_path / "c2", config={"chat_template": "{{ 1 / (messages|length - 1) }}"})
    with pytest.raises(RequestError, match="ZeroDivisionError"):
        ours.encode_chat([{"role": "user", "content": "x"}])
    # named templates without a "default": chat is off, and says which names there are
    ours, _ = artifact_tokenizer(tmp_path / "c3", config={"chat_template": [{"name": "rag", "template": "R"}]})
    with pytest.raises(RequestError, match=r"chat is off.*\['rag'\]"):
        ours.encode_chat([{"role": "user", "content": "x"}])
    # a template cannot reach Python internals (sandboxed)
    ours, _ = artifact_tokenizer(tmp_path / "d", config={"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(RequestError):
        ours.encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(ArtifactError, match="must be a string"):
        from deepinfer.runtime.chat import load_chat_template
        (tmp_path / "e").mkdir()
        (tmp_path / "e" / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
        load_chat_template(tmp_path / "e", {"tokenizer_config.json"})
    assert CHAT_TEMPLATE.startswith("{% set ns")


def test_templates_that_never_show_tools_are_told_apart(tmp_path):
    """Tool calling needs a template that renders `tools` (DeepSeek-V3's own does not; vLLM ships one that does)."""
    ours, _ = artifact_tokenizer(tmp_path / "a")
    assert ours.chat_template_renders_tools()
    blind, _ = artifact_tokenizer(tmp_path / "b", config={
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    assert not blind.chat_template_renders_tools()


def test_deepseek_tool_call_layouts_parse(tmp_path):
    """Both of DeepSeek's layouts (V3: type, name and a fenced JSON block; V3.1: name and the arguments), several
    calls, the text before the markers as content; no markers: all content."""
    from deepinfer.runtime.tools import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, ToolParser, parse_calls
    v3 = (CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"city": "Oslo"}\n```' + CALL_END +
          CALL_BEGIN + "function" + SEP + "now\n```json\n{}\n```" + CALL_END + CALLS_END)
    v31 = (CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + '{"city": "Oslo"}' + CALL_END +
           CALL_BEGIN + "now" + SEP + "{}" + CALL_END + CALLS_END)
    # V3 as models write it too: no newline before the closing fence, CRLF, no language tag; and the two layouts
    # mixed in one section
    v3_loose = (CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'get_weather\r\n```json\r\n{"city": "Oslo"}```' +
                CALL_END + CALL_BEGIN + "function" + SEP + "now\n```\n{}\n```\n" + CALL_END + CALLS_END)
    mixed = (CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"city": "Oslo"}\n```' + CALL_END +
             CALL_BEGIN + "now" + SEP + "{}" + CALL_END + CALLS_END)
    for text in (v3, v31, v3_loose, mixed):
        calls = parse_calls(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Oslo"}'), ("now", "{}")], text
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # a call cut short (no end marker) is left out; the complete one before it stays
    assert [c["function"]["name"] for c in parse_calls(v31[:v31.rindex(CALL_END)])] == ["get_weather"]
    ours, _ = artifact_tokenizer(tmp_path)
    parser = ToolParser(ours)
    assert parser.available
    ids = ours.encode("Let me check." + v31, add_special_tokens=False)
    content, calls, marked = parser.split(ids)
    assert content == "Let me check." and marked and [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert parser.split(ours.encode("plain", add_special_tokens=False)) == ("plain", [], False)
    assert parser.split(ours.encode("So" + CALLS_BEGIN + CALL_BEGIN + "now", add_special_tokens=False)) == (
        "So", [], True)


def test_tool_calls_stream_as_they_are_generated(tmp_path):
    """partial_calls never takes back what it said (names fixed, arguments only growing) for every prefix of
    either layout, ending where parse_calls does; CallStream turns token-by-token output into OpenAI's deltas
    whose pieces add up to the parsed calls (one call with parallel_tool_calls false)."""
    from deepinfer.runtime.tools import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, CallStream, ToolParser,
                                         parse_calls, partial_calls)
    v31 = (CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + '{"city": "Oslo <3"}' + CALL_END +
           CALL_BEGIN + "now" + SEP + " {} " + CALL_END + CALLS_END)
    v3 = (CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"city": "Oslo"}\n```' + CALL_END +
          CALLS_END)
    for full in (v31, v3):
        prev: list = []
        for n in range(len(full) + 1):
            now = partial_calls(full[:n])
            assert len(now) >= len(prev)
            assert all(a == c and d.startswith(b) for (a, b), (c, d) in zip(prev, now)), full[:n]
            prev = now
        assert prev == [(c["function"]["name"], c["function"]["arguments"]) for c in parse_calls(full)]
    ours, _ = artifact_tokenizer(tmp_path)
    parser = ToolParser(ours)
    ids = ours.encode("Hi." + v31, add_special_tokens=False)
    for single in (False, True):
        stream, deltas = CallStream(parser, single), []
        for n in range(1, len(ids) + 1):
            deltas += stream.update(ids[:n], final=n == len(ids))
        calls = parse_calls(ours.decode_raw(ids))[:1 if single else None]
        assert [d["function"]["name"] for d in deltas if "id" in d] == [c["function"]["name"] for c in calls]
        assert ["".join(d["function"]["arguments"] for d in deltas if d["index"] == k) for k in range(len(calls))] \
            == [c["function"]["arguments"] for c in calls]
        assert len(deltas) > len(calls) + 2           # arguments in pieces, not whole


def test_generation_config_eos_token_ids_are_read(tmp_path):
    from deepinfer.runtime.tokenizer import generation_eos_ids
    f = tmp_path / "generation_config.json"
    for value, want in ((1, (1,)), ([1, 100001], (1, 100001)), (None, ())):
        f.write_text(json.dumps({"bos_token_id": 0, "eos_token_id": value}))
        assert generation_eos_ids(f) == want
    f.write_text(json.dumps({"do_sample": True}))
    assert generation_eos_ids(f) == ()
    for bad in ('{"eos_token_id": "1"}', '{"eos_token_id": [1, true]}', '{"eos_token_id": -1}', "[1]", "{"):
        f.write_text(bad)
        with pytest.raises(ArtifactError, match="generation_config.json"):
            generation_eos_ids(f)
