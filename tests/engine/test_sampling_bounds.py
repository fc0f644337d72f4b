"""Sampling values found by fuzzing: numbers a float cannot hold, and temperatures float32 logits cannot take."""

from __future__ import annotations

import pytest

from server.engine.api import RequestError, SamplingParams, check_prompt_chars


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"temperature": 10**400}, "temperature"),  # an int no float holds (was an OverflowError: a 500)
        ({"top_p": -(10**400)}, "top_p"),
        ({"presence_penalty": 10**309}, "presence_penalty"),
        ({"temperature": 1e39}, "temperature"),  # inf once in float32: -inf logits / inf = NaN
    ],
)
def test_out_of_range_numbers_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(RequestError) as refused:
        SamplingParams.from_dict(raw, max_tokens_limit=16)
    assert refused.value.field == field


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 0])
def test_a_temperature_below_1e_5_is_greedy(temperature: float) -> None:
    """A tinier one is 0 in float32: the sampler would divide by zero and draw from NaN probabilities."""
    assert SamplingParams.from_dict({"temperature": temperature}, max_tokens_limit=16).temperature == 0


def test_prompt_characters_are_bounded_by_the_context() -> None:
    check_prompt_chars("prompt", 128 * 100, max_model_len=100)
    with pytest.raises(RequestError, match="cannot fit this model's context of 100 tokens") as refused:
        check_prompt_chars("prompt", 128 * 100 + 1, max_model_len=100)
    assert refused.value.field == "prompt"
