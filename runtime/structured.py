"""Structured outputs: a JSON schema, any JSON object, a regular expression, a choice of strings or a Lark grammar
constrains what a request may generate, through llguidance (the grammar engine vLLM's `guidance` backend uses).

Before each of a constrained sequence's tokens is sampled, its matcher computes the set of tokens the grammar
allows next (a bitmask over the vocabulary; EOS only once the grammar is complete) and every other logit becomes
-inf; the sampled token is then consumed, and a grammar that admits nothing more ends the sequence ("stop").
JSON comes out in one fixed layout, as `json.dumps` writes it (", " and ": ", no other whitespace): free
whitespace lets a model pad forever, and a fixed layout costs the fewest tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict

import numpy as np

from ..common.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def grammar_of(kind: str, spec) -> str:
    """The llguidance grammar for a constraint: `json` (a schema: dict or JSON text), `json_object`, `regex`,
    `choice` (a list of strings) or `grammar` (Lark). Raises RequestError for a malformed spec."""
    import llguidance
    M = llguidance.LLMatcher
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise RequestError(f"the JSON schema is not valid JSON ({e})") from None
            except RecursionError:
                raise RequestError("the JSON schema is nested too deeply to parse") from None
        if spec is True:             # JSON Schema's "anything"
            spec = {}
        if not isinstance(spec, dict):
            raise RequestError("a JSON schema must be an object (or true)")
        try:
            return M.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise RequestError(f"the JSON schema: {e}") from None
        except RecursionError:
            raise RequestError("the JSON schema is nested too deeply") from None
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise RequestError("a regex constraint must be a non-empty string")
        return M.grammar_from_regex(spec)
    if kind == "choice":
        if not (isinstance(spec, list) and spec and all(isinstance(c, str) and c for c in spec)):
            raise RequestError("a choice constraint must be a non-empty list of non-empty strings")
        # one lexer terminal of the alternatives (a DFA), not one parser rule: as a rule, the parser's row holds an
        # item per choice, and past llguidance's 2000 the matcher failed mid-generation (2500 choices)
        return M.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in spec))
    if kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise RequestError("a grammar constraint must be a non-empty Lark grammar")
        return M.grammar_from_lark(spec)
    raise RequestError(f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")


class Grammars:
    """Matchers for one tokenizer and vocabulary (the logits' width; ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        import llguidance
        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self._checked: OrderedDict[bytes, str] = OrderedDict()   # grammar digest -> llguidance's verdict

    def check(self, grammar: str) -> None:
        """Refuse a grammar llguidance cannot build (RequestError with its message); verdicts of the last 256
        grammars are kept (by digest: a schema can be megabytes)."""
        key = hashlib.sha256(grammar.encode()).digest()
        err = self._checked.get(key)
        if err is None:
            err = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
            self._checked[key] = err
            if len(self._checked) > 256:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(key)
        if err and not err.startswith("WARNING"):
            raise RequestError(f"structured output: {_one_line(err)}")

    def constraint(self, grammar: str) -> "Constraint":
        self.check(grammar)
        m = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RequestError(f"structured output: {_one_line(m.get_error())}")
        # The first token's mask, now: a grammar that fails at its first step (one past llguidance's limits, such
        # as 2000 items in a parser row: a choice of thousands of strings) or admits no text at all (a rule that
        # only refers to itself) is refused with the request, instead of ending its generation with nothing
        first = np.frombuffer(m.compute_bitmask(), dtype=np.uint8).any()
        if m.is_error() or not first:
            err = m.get_error() if m.is_error() else ""
            # (llguidance's error for a grammar no token can begin, "NoExtensionBias", dumps its parser's state)
            why = _one_line(err) if err and not err.startswith("NoExtensionBias") else \
                "the constraint admits no text at all"
            raise RequestError(f"structured output: {why}")
        return Constraint(m, self.vocab_size, self.tokenizer.eos_tokens)


def _one_line(message: str, limit: int = 400) -> str:
    """llguidance's multi-line messages (a caret under the offending place) as one line."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Constraint:
    """One sequence's grammar state (used on the engine thread only)."""

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, a bool [vocab_size] array (EOS alone if it allows none: the
        sequence then ends instead of sampling from nothing)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        ok = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if not ok.any():
            ok[self.eos_ids] = True
        return ok

    def copy(self) -> "Constraint":
        """A matcher in the same state, for another sequence (cheaper than building it again)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self.eos_ids)

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        """Why the matcher failed ("" if it has not): it then admits nothing, and the sequence fails (Engine)."""
        return self.matcher.get_error() if self.matcher.is_error() else ""

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (or the matcher failed): the sequence stops."""
        return self.matcher.is_stopped()
