"""Logprobs in OpenAI's shapes (chat, legacy completions, echo, vLLM's prompt_logprobs), streaming and not, and the
utility routes (/tokenize, /detokenize, /version, /v1/models/{id}), through the official client over the fake
engine (conftest.py: token i has logprob -0.5 (i + 1), prompt token j -0.25 j)."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import Served


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


CHAT = [{"role": "user", "content": "hi"}]


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, served: Served) -> None:
    reply = client.chat.completions.create(
        model="fake", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert [entry.token for entry in content] == [" t0", " t1", " t2"]
    assert [entry.logprob for entry in content] == [-0.5, -1.0, -1.5]
    assert content[0].bytes == list(b" t0")
    assert [(top.token, top.logprob) for top in content[1].top_logprobs] == [(" t1", -1.0), ("\x01", -2.0)]
    assert served.engine.submitted[-1].sampling.logprobs == 2
    plain = client.chat.completions.create(model="fake", messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None and served.engine.submitted[-1].sampling.logprobs is None


def test_chat_logprobs_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake", messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=0, stream=True
    )
    tokens = [e.token for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert tokens == [" t0", " t1", " t2", " t3"]


def test_completion_logprobs_in_the_legacy_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="fake", prompt="ab", max_tokens=3, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == " t0 t1 t2"
    assert choice.logprobs.tokens == [" t0", " t1", " t2"]
    assert choice.logprobs.token_logprobs == [-0.5, -1.0, -1.5]
    assert choice.logprobs.top_logprobs == [{" t0": -0.5}, {" t1": -1.0}, {" t2": -1.5}]
    assert choice.logprobs.text_offset == [0, 3, 6]


def test_echo_with_logprobs_is_what_lm_eval_reads(client: openai.OpenAI, served: Served) -> None:
    """lm-eval's loglikelihood: token-id prompts, echo, logprobs 1, max_tokens 1; it reads token_logprobs[ctxlen:-1]
    (the last entry is the generated token, which must be there)."""
    prompts = [[104, 105, 33], [97, 98]]
    reply = client.completions.create(
        model="fake", prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    for prompt, choice in zip(prompts, reply.choices, strict=True):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt) + 1
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1 : len(prompt)] == [-0.25 * j for j in range(1, len(prompt))]
        assert logprobs.tokens[: len(prompt)] == [chr(t) for t in prompt]
        assert choice.text.startswith(bytes(prompt).decode())
        assert logprobs.text_offset[-1] == len(prompt)  # the generated token starts after the echoed prompt
    assert served.engine.submitted[-1].sampling.prompt_logprobs == 1


def test_echo_with_max_tokens_zero_is_the_prompt_only(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="fake", prompt="hey", echo=True, logprobs=0, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == "hey"
    assert choice.logprobs.tokens == ["h", "e", "y"]
    assert choice.logprobs.token_logprobs == [None, -0.25, -0.5]
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == 3


def test_echo_streamed_sends_the_prompt_first(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="fake", prompt="hey", echo=True, logprobs=0, max_tokens=2, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert "".join(c.text for c in chunks) == "hey t0 t1"
    assert chunks[0].text == "hey" and chunks[0].logprobs.token_logprobs == [None, -0.25, -0.5]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == [0, 1, 2, 3, 6]


def test_vllm_prompt_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="fake", prompt="ab", max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    prompt_logprobs = reply.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    assert prompt_logprobs[1] == {"98": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}}


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, served: Served) -> None:
    client.completions.create(
        model="fake", prompt="ab", max_tokens=2, logit_bias={"7": 5.0},
        extra_body={"min_p": 0.1, "repetition_penalty": 1.2, "skip_special_tokens": False,
                    "include_stop_str_in_output": True},
    )  # fmt: skip
    sampling = served.engine.submitted[-1].sampling
    assert sampling.logit_bias == {7: 5.0} and sampling.min_p == 0.1 and sampling.repetition_penalty == 1.2
    assert sampling.skip_special_tokens is False and sampling.include_stop_str_in_output is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "fake", "prompt": "a", "suffix": "z"}, "suffix"),
        ({"model": "fake", "prompt": "a", "best_of": 3}, "best_of"),
        ({"model": "fake", "prompt": "a", "logprobs": 21}, "logprobs"),
        ({"model": "fake", "prompt": "a", "use_beam_search": True}, "use_beam_search"),
        ({"model": "fake", "prompt": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"model": "fake", "prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
        ({"model": "fake", "prompt": "a", "no_such_field": 1}, "no_such_field"),
    ],
)
def test_fields_strata_does_not_do_are_refused_by_name(served: Served, body, param) -> None:
    response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_fields_that_ask_for_nothing_are_accepted(served: Served) -> None:
    body = {
        "model": "fake", "prompt": "a", "max_tokens": 1, "best_of": 1, "suffix": None, "use_beam_search": False,
        "add_special_tokens": True, "priority": 0, "store": False, "user": "someone",
    }  # fmt: skip
    response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text


def test_tokenize_and_detokenize(served: Served) -> None:
    url = served.base_url
    tokens = httpx.post(
        f"{url}/tokenize", json={"prompt": "hi", "return_token_strs": True}, timeout=10
    ).json()
    assert tokens == {"count": 2, "max_model_len": 256, "tokens": [104, 105], "token_strs": ["h", "i"]}
    chat = httpx.post(f"{url}/tokenize", json={"model": "fake", "messages": CHAT}, timeout=10).json()
    assert bytes(chat["tokens"]).decode() == "<user>hi<assistant>"
    text = httpx.post(
        f"{url}/detokenize", json={"model": "fake", "tokens": [104, 105, 1000]}, timeout=10
    ).json()
    assert text == {"prompt": "hi t0"}
    missing = httpx.post(f"{url}/detokenize", json={"model": "other", "tokens": [1]}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_ids_no_tokenizer_holds_are_a_400_naming_the_field(client: openai.OpenAI, served: Served) -> None:
    """Found by the schema fuzzer: echo decoded a negative id before the engine checked it (a 500)."""
    for ids in ([104, -1], [104, 2**40]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="fake", prompt=ids, echo=True, max_tokens=1)
        assert err.value.body["param"] == "prompt" and "[0, 4294967296)" in err.value.body["message"]
        refused = httpx.post(
            f"{served.base_url}/detokenize", json={"model": "fake", "tokens": ids}, timeout=10
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_version_and_one_model(client: openai.OpenAI, served: Served) -> None:
    version = httpx.get(f"{served.base_url}/version", timeout=10).json()["version"]
    assert version and version[0].isdigit()
    model = client.models.retrieve("fake")
    assert model.id == "fake" and model.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other")
    assert err.value.body["code"] == "model_not_found"
