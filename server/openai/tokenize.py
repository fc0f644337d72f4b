"""POST /tokenize and POST /detokenize (vLLM's shapes): the token ids of a prompt or of chat messages as chat
completions renders them, and the text of token ids. `model` may be left out when one model is served."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from server.engine.api import Engine
from server.openai.errors import ERROR_BODY, OpenAIError, unknown_model
from server.openai.protocol import ChatMessage, StrictRequest
from server.openai.served import ServedModels


class TokenizeCompletion(StrictRequest):
    """POST /tokenize with a prompt (vLLM's shape); `model` may be left out when one model is served."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(StrictRequest):
    """POST /tokenize with chat messages: the tokens of the rendered template, ending with the assistant's turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def router(served: ServedModels) -> APIRouter:
    routes = APIRouter()

    @routes.post("/tokenize", response_model=TokenizeResponse, responses={400: ERROR_BODY, 404: ERROR_BODY})
    async def tokenize(body: TokenizeChat | TokenizeCompletion) -> TokenizeResponse:
        return await tokenized(served, body)

    @routes.post(
        "/detokenize", response_model=DetokenizeResponse, responses={400: ERROR_BODY, 404: ERROR_BODY}
    )
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenized(served, body)

    return routes


async def tokenized(served: ServedModels, request: TokenizeCompletion | TokenizeChat) -> TokenizeResponse:
    model, engine = _named(served, request.model)
    if isinstance(request, TokenizeChat):
        if not request.add_generation_prompt:
            raise OpenAIError(
                400, "add_generation_prompt: only true is supported", param="add_generation_prompt"
            )
        messages = [m.turn() for m in request.messages]  # as chat completions renders them
        ids = await asyncio.to_thread(
            served.tokenize, model, "messages", engine.apply_chat_template, messages
        )
    else:
        if not request.add_special_tokens:
            raise OpenAIError(400, "add_special_tokens: only true is supported", param="add_special_tokens")
        ids = await asyncio.to_thread(served.tokenize, model, "prompt", engine.encode, request.prompt)
    strs = None
    if request.return_token_strs:
        strs = [await asyncio.to_thread(served.decode, model, engine, [t]) for t in ids]
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


async def detokenized(served: ServedModels, request: DetokenizeRequest) -> DetokenizeResponse:
    model, engine = _named(served, request.model)
    return DetokenizeResponse(
        prompt=await asyncio.to_thread(served.decode, model, engine, request.tokens, "tokens")
    )


def _named(served: ServedModels, model: str | None) -> tuple[str, Engine]:
    """The engine a tokenizer route names; with one model served, `model` may be left out (vLLM's)."""
    if model is None:
        if len(served.models) != 1:
            raise OpenAIError(400, "model: required when more than one model is served", param="model")
        model = next(iter(served.models))
    engine = served.models.get(model)
    if engine is None:
        raise unknown_model(model)
    return model, engine
