"""The OpenAI-style request bodies `kvmem serve` reads (pydantic), and its error type and body. Which OpenAI fields are
used, accepted or refused is validate.py's; the token fields (logprobs, penalties, ...) are read in tokens.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status, message, type, param, code, headers)


def fail(status: int, message: str, type: str = "invalid_request_error", **kw) -> None:
    """Refuse the request: an OpenAI-style error with this status (`param` names the field at fault)."""
    raise APIError(status, message, type, **kw)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- request bodies ----------------------------------------------------------------------------------------
class KVMemOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    keep_ratio: float | None = None
    quant: str | None = None
    query_aware: bool | None = None
    use_store: bool | None = None
    fill_store: bool | None = None
    reuse: str | None = None
    documents: list[str] | None = None
    recompute_ratio: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    timeout: float | None = Field(None, gt=0)
    layer: int | None = None


class Accepted(BaseModel):
    """OpenAI fields kvmem accepts and does not act on, as vLLM does (billing, storage and cache hints; `user` goes
    to the access log); their types and OpenAI's limits are still checked. See serve/validate.py for every field."""
    user: str | None = None
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = Field(None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: Annotated[str, StringConstraints(max_length=128)] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @field_validator("temperature", "top_p", "n", "stream", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value, info):  # OpenAI's nullable fields: null means the default
        return cls.model_fields[info.field_name].default if value is None else value


class Generation(Accepted):
    model_config = ConfigDict(extra="allow")  # OpenAI fields we do not use; the ones we cannot honour are refused
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    kvmem: KVMemOptions | None = None


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # "function": OpenAI's deprecated role


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(Generation):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(Generation):
    prompt: str | list[str] | list[int]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    kvmem: KVMemOptions | None = None
