"""Chat messages -> prompt text with the checkpoint's own chat template (Jinja), rendered as transformers'
`apply_chat_template` renders it: a sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and the tokenizer's special tokens
(bos_token, eos_token, ...) as variables. The text is then tokenized without adding special tokens (the
template writes them), again as transformers does.

Where the template comes from: `chat_template.jinja` beside the tokenizer (transformers' current format), else
tokenizer_config.json's `chat_template` (a string, or a list of named templates: the one named "default").
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..common.errors import ArtifactError, RequestError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(jinja2.ext.Extension):
            """{% generation %}...{% endgeneration %} (transformers marks assistant text with it): the body as is."""
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.origin = origin
        self.special_tokens = special_tokens
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ArtifactError(f"{origin}: the chat template does not parse (line {e.lineno}: {e.message})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        import jinja2
        try:
            # tools and documents as transformers passes them: None, not undefined, when there are none
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, documents=None, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:     # raise_exception(...) in the template, or a bad message
            raise RequestError(f"the chat template refused the messages: {e}") from None
        except Exception as e:           # the template's own arithmetic or lookups on what the client sent
            raise RequestError(f"the chat template could not render the messages ({type(e).__name__}: {e})") from None


def _token_text(v) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict with `content`."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ArtifactError(f"{path}: not valid UTF-8 JSON") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: not a JSON object")
    return data


def load_chat_template(tokenizer_dir: Path, files: set[str]) -> ChatTemplate | None:
    """The artifact's chat template (None: it has none). `files`: the artifact's tokenizer file names."""
    config: dict = {}
    if "tokenizer_config.json" in files:
        config = _json_file(tokenizer_dir / "tokenizer_config.json")
    if "chat_template.jinja" in files:
        origin = tokenizer_dir / "chat_template.jinja"
        try:
            source = origin.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{origin}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        origin = tokenizer_dir / "tokenizer_config.json"
        source = config.get("chat_template")
        if isinstance(source, list):           # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ArtifactError(f"{origin}: named chat templates {sorted(map(str, named))}, none named 'default'")
            source = named["default"]
        if source is None:
            return None
        if not isinstance(source, str):
            raise ArtifactError(f"{origin}: 'chat_template' must be a string or a list of named templates")
    # tokenizer_config.json's special tokens, special_tokens_map.json's where it has them (transformers' order)
    special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    if "special_tokens_map.json" in files:
        special_map = _json_file(tokenizer_dir / "special_tokens_map.json")
        special.update({k: t for k in SPECIAL_TOKENS if (t := _token_text(special_map.get(k))) is not None})
    return ChatTemplate(source, special, str(origin))
