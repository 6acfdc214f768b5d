"""OpenAI /v1/completions and /v1/chat/completions request shapes (strict: unknown or mistyped fields are 400s)."""

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


class SamplingFields(BaseModel):
    """The fields both endpoints take as they are (a chat request becomes a completion request with these)."""
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    repetition_penalty: Number = 1.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[StrictStr, Number] | None = None     # token id (as a string, as OpenAI's) -> bias
    min_tokens: StrictInt = 0                            # vLLM's extension
    stop_token_ids: list[StrictInt] | None = None        # vLLM's extension
    # Structured outputs: OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs
    # ({json | regex | choice | grammar | json_object}) and its older guided_* fields; at most one of them.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None     # accepted and ignored: one grammar engine here


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None


class ContentPart(BaseModel):
    """A part of a message's content; only {"type": "text", "text": ...} is served (the server says so)."""
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    """A message as the chat template sees it. Fields besides role and content (name, tool_calls, tool_call_id,
    ...) pass through to the template untouched; content given as text parts is joined into one string."""
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True       # vLLM's extension: end the prompt with the assistant's turn
    # Tools are accepted at their neutral values only (what clients send by default); store and metadata are ignored.
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    metadata: dict | None = None


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"object": "error", "error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
