"""Tool calling for /v1/chat/completions: DeepSeek-V3's tool-call format in the model's output, and the schemas that
force a call (tool_choice "required" or a named function), as vLLM serves them.

DeepSeek-V3 writes its calls after a special token, in one of two layouts (V3 and V3-0324; V3.1 and later):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

Text before the first marker is the message's content. With tool_choice "required" or a named function the output
is constrained instead (structured outputs) to JSON that is the call(s) themselves, whatever the model's layout.
"""

from __future__ import annotations

import json
import re
import uuid

from ..common.errors import RequestError

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?P<body>.*?)" + re.escape(CALL_END), re.S)
_FENCED = re.compile(r"(?P<name>[^\n`]*?)\s*```[a-zA-Z]*\s*\n?(?P<args>.*?)\s*```\s*$", re.S)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_calls(section: str) -> list[dict]:
    """The calls in the text after <｜tool▁calls▁begin｜> (special tokens kept), each in either layout: V3's
    `function<sep>NAME` and a fenced block, or V3.1's `NAME<sep>ARGS`. A call cut short (no end marker) is left out."""
    calls = [_one_call(m.group("body")) for m in _CALL.finditer(section)]
    return [tool_call(*c) for c in calls if c is not None]


def _one_call(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a complete call's text between its begin and end markers."""
    head, sep, tail = body.partition(SEP)
    if not sep:
        return None
    fenced = _FENCED.match(tail.strip())
    if head.strip() == "function" and fenced:           # V3
        return fenced.group("name").strip(), fenced.group("args").strip()
    return head.strip(), tail.strip()                   # V3.1


# a V3 call under way: its name line and the fence open, the arguments so far
_FENCE_OPEN = re.compile(r"(?P<name>[^\n`]*?)\s*```[a-zA-Z]*[ \t]*\r?\n(?P<args>.*)", re.S)


def partial_calls(section: str) -> list[tuple[str, str]]:
    """The calls of a section still being generated, as far as they are certain: complete calls as parse_calls
    reads them, then the one under way once its name is complete, with a prefix of its final arguments (what
    could still be trailing whitespace, a closing fence or an incomplete UTF-8 character held back)."""
    out = []
    pos = 0
    while (b := section.find(CALL_BEGIN, pos)) >= 0:
        start = b + len(CALL_BEGIN)
        e = section.find(CALL_END, start)
        if e >= 0:
            call = _one_call(section[start:e])
            if call is not None:
                out.append(call)
            pos = e + len(CALL_END)
            continue
        head, sep, tail = section[start:].partition(SEP)
        if sep:
            if head.strip() != "function":                  # V3.1: NAME<sep>ARGS
                out.append((head.strip(), _settled(tail)))
            elif m := _FENCE_OPEN.match(tail):              # V3: a fenced block (or, unfenced, a tool named
                out.append((m.group("name").strip(), _settled(m.group("args"), "`")))          # 'function')
        break
    return out


def _settled(args: str, also: str = "") -> str:
    """The part of a call's arguments under way that the rest cannot change: without leading whitespace, and
    without what may still turn out to be trailing whitespace, the start of a marker, an incomplete UTF-8
    character or (V3) the closing fence."""
    args = args.lstrip()
    while True:
        cut = args.rstrip().rstrip("\ufffd" + also)
        for m in MARKERS:
            cut = next((cut[:-n] for n in range(len(m) - 1, 0, -1) if cut.endswith(m[:n])), cut)
        if cut == args:
            return args
        args = cut


class CallStream:
    """One streamed choice's tool calls in OpenAI's streaming shape, as they are generated (tool_choice auto):
    a call's first delta carries its id, type and name, later ones pieces of its arguments."""

    def __init__(self, parser: "ToolParser", single: bool = False):
        self.parser, self.single = parser, single
        self.sent: list[list[str]] = []        # per call begun: [name, arguments sent so far]
        self.ids: list[str] = []

    def update(self, output_ids: list[int], final: bool = False) -> list[dict]:
        """The deltas the output so far adds (final: the finished output, as the non-streamed response has it)."""
        if self.parser.calls_begin not in output_ids:
            return []
        k = output_ids.index(self.parser.calls_begin)
        section = self.parser.tokenizer.decode_raw(output_ids[k:])
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parse_calls(section)] if final \
            else partial_calls(section)
        out: list[dict] = []
        for i, (name, args) in enumerate(calls[:1] if self.single else calls):
            if i == len(self.sent):
                self.sent.append([name, ""])
                self.ids.append(call_id())
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            done = self.sent[i][1]
            if self.sent[i][0] != name or not args.startswith(done) or len(args) == len(done):
                continue        # nothing new (or, never seen so far, a different reading: left as sent)
            self.sent[i][1] = args
            if out and out[-1]["index"] == i:
                out[-1]["function"]["arguments"] += args[len(done):]
            else:
                out.append({"index": i, "function": {"arguments": args[len(done):]}})
        return out


def check_tools(tools: list) -> list[dict]:
    """OpenAI's `tools`: [{"type": "function", "function": {"name": ..., "parameters": {...}}}, ...]."""
    if not isinstance(tools, list):
        raise RequestError("field 'tools' must be a list of {'type': 'function', 'function': {...}}")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(f, dict) and
                isinstance(f.get("name"), str) and f["name"]):
            raise RequestError(f"field 'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if f.get("parameters") is None:          # null: a function without parameters, as absent
            f.pop("parameters", None)
        if not isinstance(f.get("parameters", {}), dict):
            raise RequestError(f"field 'tools[{i}].function.parameters' must be a JSON schema object")
    return tools


def forced_schema(tools: list[dict], choice, single: bool = False) -> tuple[dict, str | None]:
    """tool_choice "required" or {"type": "function", "function": {"name": N}}: the JSON schema the output is held
    to, and the named function (None for "required", whose output is a list of {"name", "parameters"})."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in params.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if single:                  # parallel_tool_calls false
            schema["maxItems"] = 1
        return schema, None
    name = choice["function"]["name"]
    if name not in params:
        raise RequestError(f"field 'tool_choice': no tool named {name!r} in 'tools'")
    return params[name], name


def forced_calls(text: str, named: str | None) -> list[dict]:
    """The tool calls of a forced output (the JSON forced_schema held it to)."""
    if named is not None:
        return [tool_call(named, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return []        # cut short (max_tokens): no complete call
    return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


class ToolParser:
    """Finds DeepSeek-V3's tool calls in a sequence's output token ids (the markers are special tokens, which the
    output text leaves out)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        ids = [tokenizer.token_id(m) for m in MARKERS]
        self.calls_begin = ids[0]
        self.available = all(i is not None for i in ids)

    def split(self, output_ids: list[int]) -> tuple[str, list[dict], bool]:
        """(content, calls, marked): the text before the first <｜tool▁calls▁begin｜>, the calls after it, and
        whether the marker was there at all."""
        if self.calls_begin not in output_ids:
            return self.tokenizer.decode(output_ids), [], False
        k = output_ids.index(self.calls_begin)
        section = self.tokenizer.decode_raw(output_ids[k:])
        return self.tokenizer.decode(output_ids[:k]), parse_calls(section), True
