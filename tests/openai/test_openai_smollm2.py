"""The frontend over the real SmolLM2 engine, through the official openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
from conftest import serve_app

from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.openai.app import build_app

MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"  # shared with tests/engine


@pytest.fixture(scope="module")
def smollm2_client() -> Iterator[openai.OpenAI]:
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE),
        dtype="float32",
        device="cpu",
        num_kv_blocks=200,
        max_model_len=1024,
        max_tokens_limit=128,
        num_threads=2,
        model_name="smollm2",
    )
    with (
        LLMEngine(config) as engine,
        serve_app(build_app({"smollm2": engine}, tool_call_parser="hermes")) as url,
    ):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_chat_with_smollm2_reuses_the_cached_prompt(smollm2_client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant who answers briefly and clearly."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ]
    first = smollm2_client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0
    )
    second = smollm2_client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0
    )
    assert "Paris" in first.choices[0].message.content
    assert second.choices[0].message.content == first.choices[0].message.content
    assert first.usage.prompt_tokens > 16
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


@pytest.mark.slow
def test_cache_salt_keeps_tenants_apart(smollm2_client: openai.OpenAI) -> None:
    prompt = "Tenant isolation: a prompt long enough to fill several blocks of the prefix cache. " * 4

    def cached(cache_salt: str | None) -> int:
        extra = {"cache_salt": cache_salt} if cache_salt else None
        reply = smollm2_client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") >= 16


@pytest.mark.slow
def test_streamed_completion_with_smollm2(smollm2_client: openai.OpenAI) -> None:
    stream = smollm2_client.completions.create(
        model="smollm2",
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.slow
def test_chat_logprobs_with_smollm2(smollm2_client: openai.OpenAI) -> None:
    reply = smollm2_client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:  # greedy: each token is its position's most likely
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.logprob <= 0 and [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


@pytest.mark.slow
def test_loglikelihood_as_lm_eval_asks_for_it(smollm2_client: openai.OpenAI) -> None:
    """The echoed prompt's logprob of " Paris" (a prefill row) equals the logprob the same token has when it is
    generated (the sampling row); the generated token stays the last entry even when it is EOS (id 2)."""
    context = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    generated = smollm2_client.completions.create(
        model="smollm2", prompt=[context], max_tokens=1, temperature=0, logprobs=1
    ).choices[0]
    assert generated.text == " Paris"
    paris = generated.logprobs.token_logprobs[0]
    echoed = smollm2_client.completions.create(
        model="smollm2", prompt=[[*context, 7042]], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1,
        logit_bias={"2": 100},  # force EOS as the generated token
    ).choices[0]  # fmt: skip
    logprobs = echoed.logprobs
    assert len(logprobs.tokens) == len(context) + 2 and logprobs.tokens[-1] == "<|im_end|>"
    assert abs(logprobs.token_logprobs[len(context)] - paris) < 1e-3
    assert echoed.text == "The capital of France is Paris"
    prompt_only = smollm2_client.completions.create(
        model="smollm2", prompt=[[*context, 7042]], echo=True, logprobs=0, max_tokens=0
    )
    assert len(prompt_only.choices[0].logprobs.tokens) == len(context) + 1
    assert prompt_only.usage.completion_tokens == 0


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float


@pytest.mark.slow
def test_structured_outputs_with_the_official_clients_parse(smollm2_client: openai.OpenAI) -> None:
    """`chat.completions.parse(response_format=PydanticModel)`: the schema the client derives (strict) is the
    grammar; sampled at temperature 1, every answer parses."""
    for seed in range(3):
        reply = smollm2_client.chat.completions.parse(
            model="smollm2",
            messages=[{"role": "user", "content": "Tell me about a large city."}],
            response_format=City,
            max_tokens=100,
            temperature=1.0,
            seed=seed,
        )
        assert isinstance(reply.choices[0].message.parsed, City), reply.choices[0].message.content
    choice = smollm2_client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as raised:
        smollm2_client.completions.create(
            model="smollm2", prompt="x", max_tokens=5, extra_body={"guided_regex": "a(b"}
        )
    assert raised.value.body["param"] == "guided_regex"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_are_valid_calls(smollm2_client: openai.OpenAI, tool_choice) -> None:
    """A 135M model calls tools validly only when decoding is constrained: required and named choices go through
    the grammar, sampled at temperature 1, streamed and not; the client assembles the streamed deltas."""
    parameters = WEATHER["function"]["parameters"]
    for seed in range(2):
        reply = smollm2_client.chat.completions.create(
            model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=80,
            temperature=1.0, seed=seed,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), parameters)
    with smollm2_client.beta.chat.completions.stream(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=80, temperature=1.0,
        seed=5, parallel_tool_calls=False,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters)


@pytest.mark.slow
def test_a_tool_turn_and_auto_choice(smollm2_client: openai.OpenAI) -> None:
    """The assistant's call and the tool's answer go back in the next turn: both are in the prompt the model sees
    (the rendered turn, read back through /tokenize and /detokenize); with auto, whatever the model says is either
    text or calls the hermes parser found, never a broken call."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]  # fmt: skip
    root = str(smollm2_client.base_url).removesuffix("/").removesuffix("/v1")
    rendered = httpx.post(f"{root}/tokenize", json={"model": "smollm2", "messages": history}).json()
    prompt = httpx.post(f"{root}/detokenize", json={"model": "smollm2", "tokens": rendered["tokens"]}).json()
    assert '{"temperature": 21, "sky": "clear"}' in prompt["prompt"]  # the tool's answer reaches the model
    assert (
        "get_weather" in prompt["prompt"] and "Paris" in prompt["prompt"]
    )  # and so does the call it answers
    reply = smollm2_client.chat.completions.create(
        model="smollm2", messages=history, tools=[WEATHER], max_tokens=40, temperature=0
    )
    message = reply.choices[0].message
    if message.tool_calls:
        assert reply.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert message.content and reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_logprobs_equal_transformers_and_min_p_one_is_greedy(smollm2_client: openai.OpenAI) -> None:
    """Over the official client: each greedy token's logprob and top-3 equal transformers' fp32 log-softmax of
    the same weights within 0.05; min_p 1 at temperature 1 answers what greedy does."""
    import torch
    from transformers import AutoModelForCausalLM

    from server.engine.config import DEFAULT_MODEL
    from server.engine.loader import prepare_model

    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    reply = smollm2_client.completions.create(
        model="smollm2", prompt=[prompt], max_tokens=6, temperature=0, logprobs=3
    ).choices[0]
    folder = prepare_model(DEFAULT_MODEL, MODEL_CACHE).folder
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generated: list[int] = []
    with torch.inference_mode():  # transformers' own greedy continuation, then its logprobs at every position
        for _ in range(6):
            generated.append(int(hf(torch.tensor([prompt + generated])).logits[0, -1].argmax()))
        reference = hf(torch.tensor([prompt + generated])).logits[0].float().log_softmax(dim=-1)
    assert [reply.logprobs.tokens[i] for i in range(6)] == [hf_token(folder, t) for t in generated]
    for i, logprob in enumerate(reply.logprobs.token_logprobs):
        row = reference[len(prompt) - 1 + i]
        assert abs(logprob - row[generated[i]].item()) < 0.05
        expected = sorted(row.topk(3).values.tolist(), reverse=True)
        got = sorted(reply.logprobs.top_logprobs[i].values(), reverse=True)[:3]
        assert all(abs(a - b) < 0.05 for a, b in zip(got, expected, strict=True))
    for seed in (1, 2):
        sampled = smollm2_client.completions.create(
            model="smollm2",
            prompt=[prompt],
            max_tokens=6,
            temperature=1.0,
            seed=seed,
            extra_body={"min_p": 1.0},
        )
        assert sampled.choices[0].text == reply.text


def hf_token(folder, token_id: int) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).decode([token_id], skip_special_tokens=False)


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


@pytest.mark.slow
def test_responses_with_tools_and_structured_output(smollm2_client: openai.OpenAI) -> None:
    """/v1/responses through the official client: a forced call (required) is a valid function_call item, streamed
    too; `auto` answers text or calls the parser found; responses.parse's json_schema parses. Greedy: the Responses
    API has no seed, and a sampled answer may run past max_output_tokens (chat's tests sample, with seeds)."""
    parameters = WEATHER["function"]["parameters"]
    ask = "What is the weather like in Paris today?"
    forced = smollm2_client.responses.create(
        model="smollm2", input=ask, tools=[RESPONSES_WEATHER], tool_choice="required", max_output_tokens=80,
        temperature=0,
    )  # fmt: skip
    calls = [item for item in forced.output if item.type == "function_call"]
    assert calls and forced.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), parameters)
    with smollm2_client.responses.stream(
        model="smollm2", input=ask, tools=[RESPONSES_WEATHER], max_output_tokens=80, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (call,) = final.output
    jsonschema.validate(json.loads(call.arguments), parameters)
    answered = smollm2_client.responses.create(  # the tool's answer goes back as a function_call_output item
        model="smollm2", previous_response_id=final.id, tools=[RESPONSES_WEATHER], max_output_tokens=30,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C, clear"}],
    )  # fmt: skip
    for item in answered.output:
        assert item.type == "message" or json.loads(item.arguments) is not None
    parsed = smollm2_client.responses.parse(
        model="smollm2", input="Tell me about a large city.", text_format=City, max_output_tokens=128,
        temperature=0,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, City), parsed.output_text
