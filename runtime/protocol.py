"""OpenAI /v1/completions request and response shapes (strict: unknown or mistyped fields are 400s)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = Union[StrictStr, TokenIds, list[StrictStr], list[TokenIds]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    model: StrictStr | None = None
    max_tokens: StrictInt | None = 16
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Accepted only at their neutral values (what benchmark clients send); anything else is refused.
    repetition_penalty: Number = 1.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    best_of: StrictInt | None = None


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"object": "error", "error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
