"""Every field of OpenAI's and vLLM's chat and completion request bodies, and what Strata does with it: none is
silently ignored. A field is honored (a declared field of the request models in protocol.py), or refused with a
400 naming it whenever it asks for something (a value other than the one that asks for nothing), or unknown (a
400 too: a misspelt field would otherwise be ignored). docs/openai.md's field table lists the same names
(tests/openai/test_fields.py checks both ways).
"""

from __future__ import annotations

from typing import Any

# field -> the values that ask for nothing (a request may send them); any other value is refused by name.
# None stands for an absent or null field.
_NOTHING: dict[str, tuple[Any, ...]] = {
    # OpenAI: the deprecated forms of tools (`tools`, `tool_choice` are honored: protocol.py)
    "functions": (None, []),
    "function_call": (None, "none"),
    # OpenAI: what a hosted service does beside generating
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "suffix": (None, ""),
    # vLLM: sampling and output options Strata does not implement
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "prompt_embeds": (None,),
    "request_id": (None,),
    "vllm_xargs": (None,),
    "kv_transfer_params": (None,),  # set by Strata's router between its own workers, never by clients
    # vLLM: structured outputs' knobs (the grammars themselves are honored: protocol.py)
    "guided_decoding_backend": (None, "auto", "guidance", "llguidance"),  # Strata's backend is llguidance
    "guided_whitespace_pattern": (None,),
    # vLLM: chat template options
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None,),  # the endpoint's own default is accepted (ENDPOINT_DEFAULTS)
    "echo": (None, False),  # chat's (vLLM: repeat the last message); completions declare their own
    "best_of": (None, 1),  # chat's; completions declare their own
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
}

# the Responses API's fields that ask for what Strata does not do (responses.py declares the honored ones)
_RESPONSES_NOTHING: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),  # the Conversations API; previous_response_id chains responses instead
    "include": (None, []),
    "max_tool_calls": (None,),
    "prompt": (None,),  # a stored prompt template of OpenAI's dashboard
    "prompt_cache_key": (None,),
    "prompt_cache_retention": (None,),
    "reasoning": (None,),
    "safety_identifier": (None,),
    "service_tier": (None, "auto", "default"),
    "stream_options": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
}

REFUSED = frozenset(_NOTHING)
RESPONSES_REFUSED = frozenset(_RESPONSES_NOTHING)
_TABLES = {"chat": _NOTHING, "completions": _NOTHING, "responses": _RESPONSES_NOTHING}

# what each endpoint does anyway, so a request may say it: chat renders the template and tokenizes without adding
# special tokens again, completions tokenize with them (vLLM's defaults)
ENDPOINT_DEFAULTS: dict[str, dict[str, tuple[Any, ...]]] = {
    "chat": {"add_special_tokens": (False,)},
    "completions": {"add_special_tokens": (True,)},
    "responses": {},
}


def refused_field(extra: dict[str, Any] | None, endpoint: str) -> tuple[str, str] | None:
    """(field, reason) for the first field of a request's undeclared ones (`extra`) that asks for something
    Strata does not do, or that neither OpenAI nor vLLM defines; None if there is none."""
    defaults, table = ENDPOINT_DEFAULTS[endpoint], _TABLES[endpoint]
    for name, value in (extra or {}).items():
        nothing = table.get(name)
        if nothing is None:
            return name, f"`{name}` is not a field of this endpoint"
        allowed = nothing + defaults.get(name, ())
        if value is not None and not any(
            value == a and type(value) is type(a) for a in allowed if a is not None
        ):
            return name, f"`{name}` is not supported by this server"
    return None
