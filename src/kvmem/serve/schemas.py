"""The OpenAI-style request bodies `kvmem serve` reads (pydantic), its error type and body, and the OpenAI fields it
does not implement (refused with a 400 naming the field, never silently ignored)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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


class Generation(BaseModel):
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


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
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
    dimensions: int | None = None
    kvmem: KVMemOptions | None = None


# what the OpenAI API has and kvmem does not do: refused when set to anything but the neutral value (the token
# fields kvmem does, and those it refuses with a reason, are read in serve/tokens.py)
_UNSUPPORTED: dict[str, tuple] = {}


def refuse_unsupported(body: BaseModel) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
            raise APIError(400, f"{name}={value!r} is not supported by kvmem serve", param=name,
                           code="unsupported_parameter")
