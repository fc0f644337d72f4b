"""POST /v1/chat/completions: the route. Its wire models and the generation it runs are in chat_core.py (shared with
/v1/responses); the answer is one response or a stream of chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.openai.chat_core import ChatCompletionRequest, ChatCompletionResponse, start
from server.openai.choices import collect
from server.openai.generation import WaitForDisconnect
from server.openai.limits import RequestLimits
from server.openai.served import ServedModels
from server.openai.streaming import GENERATE_RESPONSES, client_gone, respond, stream
from server.openai.tools import PARSERS


def router(served: ServedModels, limits: RequestLimits, tool_call_parser: str | None) -> APIRouter:
    """`tool_call_parser`: the parser of tool_choice auto's answers (vLLM's --tool-call-parser, given with
    --enable-auto-tool-choice); None refuses auto."""
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r}: known parsers are {sorted(PARSERS)}")
    routes = APIRouter()

    @routes.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATE_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        served.check_limits(body, limits)
        return await respond(answer(served, tool_call_parser, body, lambda: client_gone(request)))

    return routes


async def answer(
    served: ServedModels,
    tool_call_parser: str | None,
    request: ChatCompletionRequest,
    client_gone: WaitForDisconnect,
) -> ChatCompletionResponse | AsyncIterator[str]:
    started = await start(served, tool_call_parser, request, client_gone)
    if request.stream:
        return stream(served, request, started.generation, request.n, started.chunks())
    choices = await collect(served, request, started.generation, request.n)
    return started.response(choices)
