"""Text <-> token ids with the artifact's tokenizer.json (the `tokenizers` library), incremental decoding."""

from __future__ import annotations

import json
from pathlib import Path

from ..common.errors import ArtifactError, RequestError


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
                add_bos = bool(json.loads(config_json.read_text()).get("add_bos_token", False))
            except ValueError:
                raise ArtifactError(f"{config_json}: not valid JSON") from None
        # The tokenizer's own post-processor may already add BOS (as transformers' tokenizers do by default);
        # tokenizer_config's add_bos_token covers tokenizers that rely on the config instead.
        self.bos_id = bos_token_id if add_bos else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:   # JSON allows lone surrogates ("\ud800"); UTF-8 text does not
            raise RequestError(f"the text is not valid Unicode ({e.reason} at position {e.start})") from None
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_str(self, tok: int) -> str:
        return self._tok.decode([tok], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Text of a growing token list, emitted only once complete (a partial UTF-8 sequence is held back)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        # Byte-level BPE text only grows at the end; if a merge ever rewrote earlier text, emit nothing new.
        new = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return new

    def flush(self) -> str:
        self.text = self.tok.decode(self.ids)
        return self.text


def no_tokenizer(what: str) -> RequestError:
    return RequestError(f"{what} needs a tokenizer, and this artifact has none (its checkpoint had no "
                        f"tokenizer.json); send token ids instead")


def load_tokenizer(root: Path, files: list[str], bos_token_id: int | None) -> Tokenizer | None:
    if "tokenizer/tokenizer.json" not in files:
        return None
    cfg = root / "tokenizer/tokenizer_config.json"
    return Tokenizer(root / "tokenizer/tokenizer.json", cfg if "tokenizer/tokenizer_config.json" in files else None,
                     bos_token_id)
