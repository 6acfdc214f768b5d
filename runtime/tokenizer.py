"""Text <-> token ids with the artifact's tokenizer.json (the `tokenizers` library), incremental decoding."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..common.errors import ArtifactError, RequestError

log = logging.getLogger("deepinfer")


LONG_TEXT = 1 << 14     # characters: a text this long or longer is tokenized without holding the GIL


class Tokenizer:
    def __init__(self, tokenizer_json: Path, config_json: Path | None, bos_token_id: int | None):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self._tok = HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:
            raise ArtifactError(f"{tokenizer_json}: not a readable tokenizer ({e})") from None
        add_bos = False
        if config_json is not None and config_json.is_file():
            try:
                add_bos = bool(json.loads(config_json.read_text(encoding="utf-8")).get("add_bos_token", False))
            except (ValueError, AttributeError):      # UnicodeDecodeError is a ValueError
                raise ArtifactError(f"{config_json}: not a valid JSON object") from None
        # The tokenizer's own post-processor may already add BOS (as transformers' tokenizers do by default);
        # tokenizer_config's add_bos_token covers tokenizers that rely on the config instead.
        self.bos_id = bos_token_id if add_bos else None
        self.chat_template = None        # runtime.chat.ChatTemplate, set by load_tokenizer where the artifact has one
        self.chat_error: str | None = None    # why the artifact's chat template cannot be used
        self.generation_eos_ids: tuple[int, ...] = ()   # generation_config.json's eos_token_id (load_tokenizer)
        self._renders_tools: bool | None = None
        self._decoders: set[str] | None = None     # the decoder's types (token_bytes), read at first use
        self.context_limit: int | None = None     # set by the engine: texts far longer are refused (encode)
        self._token_bytes_max: int | None = None
        self._special_ids: set[int] | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def ids_from(self, first: int) -> list[int]:
        """The tokenizer's ids at or past `first`, sorted."""
        return sorted(i for i in self._tok.get_vocab(with_added_tokens=True).values() if i >= first)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:   # JSON allows lone surrogates ("\ud800"); UTF-8 text does not
            raise RequestError(f"the text is not valid Unicode ({e.reason} at position {e.start})") from None
        self._refuse_far_too_long(text, size)
        if len(text) < LONG_TEXT:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        else:   # `encode` holds the GIL for all of it (the server's event loop with it); `encode_batch` does not
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def _refuse_far_too_long(self, text: str, size: int) -> None:
        """A text whose UTF-8 bytes could not fit in the context even at four times the longest token's bytes a
        token is refused before it is tokenized: 15 MB of text took the server's tokenizer 20 s and 3 GB to find
        11.8M tokens for a 1024-token context. (The factor leaves room for normalizers that shrink a text.)"""
        if self.context_limit is None or len(text) < LONG_TEXT:
            return
        if self._token_bytes_max is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._token_bytes_max = max((len(t.encode("utf-8")) for t in vocab), default=1)
        if size > 4 * self._token_bytes_max * self.context_limit:
            raise RequestError(f"the text is {size} bytes: far more than the compiled context limit of "
                               f"{self.context_limit} tokens holds (no token of this tokenizer spells more than "
                               f"{self._token_bytes_max} bytes)")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Chat messages -> prompt ids with the artifact's chat template (its special tokens written by it)."""
        if self.chat_error is not None:
            raise RequestError(f"chat is off for this artifact: {self.chat_error}")
        if self.chat_template is None:
            raise RequestError("this artifact has no chat template (its checkpoint has neither chat_template.jinja "
                               "nor a 'chat_template' in tokenizer_config.json); use /v1/completions")
        return self.encode(self.chat_template.render(messages, add_generation_prompt, tools),
                           add_special_tokens=False)

    def chat_template_renders_tools(self) -> bool:
        """Whether the chat template shows `tools` to the model at all (DeepSeek-V3's own template does not): a
        probe renders one user message with and without a tool whose name appears nowhere else."""
        if self._renders_tools is None:
            if self.chat_template is None or self.chat_error is not None:
                return True                 # encode_chat raises the clearer error
            probe = [{"role": "user", "content": "hi"}]
            tool = [{"type": "function", "function": {"name": "deepinfer_probe_tool_7f3a", "parameters": {}}}]
            try:
                plain = self.chat_template.render(probe, True, None)
                with_tool = self.chat_template.render(probe, True, tool)
                self._renders_tools = with_tool != plain
            except RequestError:            # a template that refuses the probe: let the real request tell
                self._renders_tools = True
        return self._renders_tools

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_raw(self, ids: list[int]) -> str:
        """Text with the special tokens written out (tool-call markers)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_stream(self):
        """A one-token-at-a-time decoder, `step(token_id) -> new text or None` (tokenizers' DecodeStream), or None
        with a tokenizers older than 0.21, which has none."""
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:
            return None
        stream, tok = DecodeStream(skip_special_tokens=True), self._tok
        return lambda token_id: stream.step(tok, token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (OpenAI's logprobs `bytes`), so that a token holding part of a UTF-8 character gives
        that part rather than U+FFFD: byte-level BPE's piece mapped back through GPT-2's byte alphabet, a
        sentencepiece byte-fallback piece ("<0xE2>") its byte; else, and for added tokens, its decoded text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._decoders is None:
            self._decoders = _decoder_types(json.loads(self._tok.to_str()).get("decoder"))
        if "ByteLevel" in self._decoders:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:                # an added token, stored as its text
                return piece.encode("utf-8")
        if "ByteFallback" in self._decoders and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if "Metaspace" in self._decoders or "Replace" in self._decoders:
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.token_str(token_id).encode("utf-8")

    def decoded_bytes(self, token_id: int) -> int:
        """How many bytes a token adds to `decode`'s output: its own bytes, none for a special token (skipped)."""
        if self._special_ids is None:
            self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return 0 if token_id in self._special_ids else len(self.token_bytes(token_id))

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance builds its token tries from)."""
        return self._tok.to_str()

    def token_str(self, tok: int) -> str:
        return self._tok.decode([tok], skip_special_tokens=False)


def _decoder_types(decoder: dict | None) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    return {decoder.get("type")} | set().union(*(_decoder_types(d) for d in decoder.get("decoders") or ()))


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters for the 256 bytes (GPT-2's bytes_to_unicode): printable bytes stand for
    themselves, the others for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_alphabet()


class IncrementalDetokenizer:
    """Text of a growing token list, emitted only once complete (a partial UTF-8 sequence is held back).

    Each step decodes a short window, not the whole output (which would make a long generation quadratic):
    the tokens since `prefix` give the context for the newest ones, and the text the window decoded up to
    `read` is what was already emitted from it (the scheme text-generation-inference and vLLM use). Where the
    tokenizers library has it (0.21+), its `DecodeStream` keeps that window in Rust: one call a token instead of
    two decodes and the list slicing around them (~1 us a token against 4-20 on the 2-core VM). A window the
    stream refuses (a decoder that rewrote text it had already given) goes on here, from the same place.

    The text is kept as pieces, not one string grown by `+=`: a string held elsewhere too (the sequence's) is
    copied whole by each `+=`, which made a long output quadratic (11 us a token over a 32k-token output, 24 at
    128k). The newest pieces are joined every PIECES of them, so the list stays short; `text_from` reads a tail
    without joining the rest, and `text` joins everything (at the end of a sequence, or when asked).

    A window that stays incomplete for HOLD tokens (an output of bytes that never finish a character: a random
    model's) does not grow on: the stream re-decoded all it held at each token (285 / 910 us a token at 250 / 1000
    held), and nothing was streamed until the end. From there the sequence goes through the window here, which
    releases the text no later token can change (`_release`)."""

    PIECES = 64
    HOLD = 16

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self._pieces: list[str] = []
        self._joined = 0         # leading pieces that are already joins of PIECES newer ones
        self.length = 0          # len(self.text)
        self.prefix = 0          # window start: a few tokens of context before the unread ones
        self.read = 0            # tokens whose text is already in self.text
        self._step = tok.decode_stream()

    @property
    def text(self) -> str:
        """All the text so far. Does not change the pieces: a reader on another thread sees a whole text."""
        return "".join(self._pieces)

    @property
    def held(self) -> bool:
        """Whether some tokens' text is held back (an incomplete UTF-8 character so far)."""
        return self.read < len(self.ids)

    def text_from(self, start: int) -> str:
        """text[start:], joining only the pieces it spans (the stop-string search reads a short tail each token)."""
        need = self.length - max(start, 0)
        if need <= 0:
            return ""
        parts, got = [], 0
        for piece in reversed(self._pieces):
            parts.append(piece)
            got += len(piece)
            if got >= need:
                break
        parts.reverse()
        tail = "".join(parts)
        return tail[len(tail) - need:]

    def add(self, token_ids: list[int]) -> str:
        pieces = []
        for i, t in enumerate(token_ids):
            if self._step is None:
                self.ids.extend(token_ids[i:])
                pieces.append(self._window())
                break
            try:
                piece = self._step(t)
            except Exception:    # tokenizers' DecodeStreamError: this token goes through the window instead
                self._step = None
                self.ids.extend(token_ids[i:])
                pieces.append(self._window())
                break
            self.ids.append(t)
            if piece:
                pieces.append(piece)
                self.prefix, self.read = self.read, len(self.ids)
            elif len(self.ids) - self.read >= self.HOLD:     # held long: on through the window, which releases
                self._step = None
                pieces.append(self._window())
        new = "".join(pieces)
        if new:
            self._pieces.append(new)
            self.length += len(new)
            if len(self._pieces) - self._joined > self.PIECES:
                self._pieces[self._joined:] = ["".join(self._pieces[self._joined:])]
                self._joined += 1
        return new

    def _window(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        window = self.tok.decode(self.ids[self.prefix:])
        incomplete = window.endswith("\ufffd")
        if incomplete and len(self.ids) - self.read >= self.HOLD:
            return self._release(before, window)
        if incomplete or len(window) <= len(before) or not window.startswith(before):
            return ""            # an incomplete UTF-8 sequence, nothing new yet, or a merge rewrote the window
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(before):]

    def _release(self, before: str, window: str) -> str:
        """Of a window held for HOLD tokens, the text up to the newest tokens that add 3 bytes or more: a UTF-8
        character is at most 4 bytes, so 3 more complete or break any begun before them, and that text can no
        longer change (checked: the whole window's decode starts with it; where a character spans the cut, an earlier
        cut). The rest stays held."""
        cut, tail = len(self.ids), 0
        while cut > self.read and tail < 3:
            cut -= 1
            tail += self.tok.decoded_bytes(self.ids[cut])
        if tail < 3:
            return ""
        for at in range(cut, max(cut - 4, self.read), -1):     # a cut inside a character: a token or three before
            head = self.tok.decode(self.ids[self.prefix:at])
            if len(head) > len(before) and head.startswith(before) and window.startswith(head):
                self.prefix, self.read = self.read, at
                return head[len(before):]
        return ""

    def flush(self) -> str:
        """The whole output decoded at once (with what an incomplete UTF-8 tail held back, as U+FFFD)."""
        text = self.tok.decode(self.ids)
        self._pieces, self._joined, self.length = [text], 1, len(text)
        return text


def no_tokenizer(what: str) -> RequestError:
    return RequestError(f"{what} needs a tokenizer, and this artifact has none (its checkpoint had no "
                        f"tokenizer.json); send token ids instead")


def load_tokenizer(root: Path, files: list[str], bos_token_id: int | None) -> Tokenizer | None:
    if "tokenizer/tokenizer.json" not in files:
        return None
    cfg = root / "tokenizer/tokenizer_config.json"
    tok = Tokenizer(root / "tokenizer/tokenizer.json", cfg if "tokenizer/tokenizer_config.json" in files else None,
                    bos_token_id)
    if "tokenizer/generation_config.json" in files:
        tok.generation_eos_ids = generation_eos_ids(root / "tokenizer/generation_config.json")
    from .chat import load_chat_template
    try:
        tok.chat_template = load_chat_template(root / "tokenizer", {f.removeprefix("tokenizer/") for f in files})
    except ArtifactError as e:       # completions still work; chat requests are told why not
        log.warning("chat is off: %s", e)
        tok.chat_error = str(e)
    return tok


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int, a list of ints, or absent): what transformers' generate stops
    at. A chat model's often differs from config.json's (DeepSeek-V2-Lite-Chat: 100001, the end of a turn)."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise ArtifactError(f"{path}: not a JSON object")
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ArtifactError(f"{path}: eos_token_id={eos!r} must be a token id or a list of them")
    return tuple(ids)
