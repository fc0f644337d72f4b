"""The boundary between an LLM engine and everything that calls it (Triton backend, OpenAI frontend, router, workers).

Callers tokenize, build a `GenerationRequest`, and `submit` it with a sink; the engine calls the sink from its own
thread with one `GenerationOutput` per step that produced something, the last one with `finished=True`. A sink must
not block: it hands the output to a queue or an event loop (see `server.engine.stream`).

The request, its sampling fields and the outputs are msgspec Structs (mutable, like slots dataclasses), so a worker
link (`server.workers.protocol`) encodes them as they are, by field position: one encode per output message.
`max_output_tokens` is the one limit on max_tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NewType, Protocol

import msgspec

RequestId = NewType("RequestId", str)
FinishReason = Literal["stop", "length", "abort", "error"]


class RequestError(ValueError):
    """A request the engine refuses; `field` names the offending input so the client can fix it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (e.g. every worker process is gone); clients get 503."""


class EngineOverloaded(RuntimeError):
    """The engine's wait queue is full (`max_queued_requests`): the request was not queued and may be retried
    after `retry_after_s` seconds; clients get 429 (OpenAI) or UNAVAILABLE (Triton)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


SAMPLING_FIELDS = (  # the client-settable fields of SamplingParams (vLLM / OpenAI names)
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "min_tokens",
    "min_p",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
)

MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's bound for top_logprobs and logprobs


class StructuredOutput(msgspec.Struct, array_like=True, frozen=True):
    """A grammar the output must follow (server/engine/structured.py): `kind` json (`spec` a JSON schema's text),
    json_object (any JSON object), regex, choice (`spec` a JSON list of strings) or grammar (Lark, or GBNF as
    vLLM's EBNF). `field`: the request field it came from, named in errors. `num_generated`: how many of the
    prompt's last tokens were already generated under it (a migrated or resumed request: they are replayed into
    the grammar first)."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str
    field: str = "structured_outputs"
    num_generated: int = 0


def structured_outputs(field: str, value: Any) -> StructuredOutput | None:
    """vLLM's `structured_outputs` ({"json": schema, "regex": ..., "choice": [...], "grammar": ..., or
    "json_object": true}: exactly one) as a StructuredOutput; None for null; RequestError naming `field`."""
    if value is None:
        return None
    if isinstance(value, StructuredOutput):
        return value
    if not isinstance(value, Mapping):
        raise RequestError(field, "must be an object with one of json, regex, choice, grammar, json_object")
    given = {k: v for k, v in value.items() if v not in (None, False)}
    unknown = sorted(set(given) - {"json", "regex", "choice", "grammar", "json_object"})
    if unknown:
        raise RequestError(
            f"{field}.{unknown[0]}", "not supported (json, regex, choice, grammar, json_object)"
        )
    if len(given) != 1:
        raise RequestError(field, "exactly one of json, regex, choice, grammar, json_object")
    ((kind, spec),) = given.items()
    return structured_spec(f"{field}.{kind}", kind, spec)


def structured_spec(field: str, kind: str, spec: Any) -> StructuredOutput:
    """One grammar of a request; `field` names it in errors (`response_format`, `guided_regex`, ...)."""
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise RequestError(field, f"not valid JSON: {exc}") from None
        if not isinstance(spec, (dict, bool)):
            raise RequestError(field, "must be a JSON schema (an object)")
        return StructuredOutput("json", json.dumps(spec), field)  # property order is generation order
    if kind == "json_object":
        return StructuredOutput("json_object", "", field)
    if kind == "choice":
        if not (isinstance(spec, list) and spec and all(isinstance(c, str) and c for c in spec)):
            raise RequestError(field, "must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(spec), field)
    if not (isinstance(spec, str) and spec):
        raise RequestError(field, "must be a non-empty string")
    return StructuredOutput(kind, spec, field)  # type: ignore[arg-type]


class SamplingParams(msgspec.Struct, array_like=True):
    """How to pick tokens and when to stop. temperature 0 is greedy; top_k 0 means no top-k cut."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = (
        0.0  # drop tokens whose probability is below min_p x the most likely one's (after temperature)
    )
    repetition_penalty: float = (
        1.0  # vLLM's (CTRL's): logits of prompt and output tokens divided (>0) or multiplied
    )
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # per output token: its logprob and this many alternatives (0..MAX_LOGPROBS)
    prompt_logprobs: int | None = None  # per prompt token after the first, the same
    skip_special_tokens: bool = True  # special tokens (EOS, chat markers) add no text
    include_stop_str_in_output: bool = False  # the stop string that ended the text is part of it
    structured_outputs: StructuredOutput | None = None  # the grammar the output follows (None: free text)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], max_tokens_limit: int) -> SamplingParams:
        """Validate a client's sampling fields (vLLM / OpenAI names); raise RequestError naming the field."""
        unknown = sorted(set(raw) - set(SAMPLING_FIELDS))
        if unknown:
            raise RequestError(
                unknown[0], f"unknown sampling field; allowed: {', '.join(sorted(SAMPLING_FIELDS))}"
            )
        params = cls()
        for name, value in raw.items():
            if value is not None:
                setattr(params, name, value)
        if isinstance(params.logit_bias, dict):  # JSON's keys are strings: "50256" is token 50256
            params.logit_bias = {_token_key(k): v for k, v in params.logit_bias.items()}
        params.structured_outputs = structured_outputs("structured_outputs", params.structured_outputs)
        params.validate(max_tokens_limit)
        return params

    def validate(self, max_tokens_limit: int) -> None:
        _check_int("max_tokens", self.max_tokens, 1, max_tokens_limit)
        _check_float("temperature", self.temperature, 0.0, _FLOAT32_MAX)  # logits / temperature stays finite
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0  # greedy, as vLLM: a tinier one is 0 in float32 and the logits become NaN
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, 1 << 30)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.seed is not None:
            _check_int("seed", self.seed, -(1 << 63), (1 << 64) - 1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise RequestError("stop_token_ids", "must be a list of integers")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, "must be a boolean")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > 1024:
            raise RequestError("logit_bias", "must be an object of at most 1024 token ids to biases")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, 0, 1 << 31)
            _check_float("logit_bias", bias, -100.0, 100.0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)


def _token_key(key: Any) -> Any:
    """A logit_bias key as a token id: an int, or a string of decimal digits (left as it is otherwise, for
    `validate` to refuse by name)."""
    if isinstance(key, str) and key.isdecimal() and len(key) < 12:
        return int(key)
    return key


GREEDY_TEMPERATURE = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)
_FLOAT32_MAX = 3.4e38  # the sampler divides float32 logits by the temperature


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(name, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RequestError(name, f"must be in [{low}, {high}], got {value}")


def _check_float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not _finite(value):
        raise RequestError(name, f"must be a finite number, got {value!r:.40}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(name, f"must be in {bracket}{low}, {high}], got {value}")


def _finite(value: int | float) -> bool:
    """A float that is not inf or NaN, or an int that a float can hold (JSON's 1e400 is inf, 10**400 an int)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


MAX_CACHE_SALT_CHARS = 256


def validate_cache_salt(cache_salt: Any) -> None:
    """A request's `cache_salt` (vLLM's field) is None or a string of 1..MAX_CACHE_SALT_CHARS characters; raises
    RequestError naming it. Frontends check it before submitting, engines and routers before hashing."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise RequestError("cache_salt", f"must be a string, got {type(cache_salt).__name__}")
    if not 1 <= len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise RequestError(
            "cache_salt", f"must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(cache_salt)}"
        )
    try:
        cache_salt.encode()
    except UnicodeEncodeError:
        raise RequestError("cache_salt", "must be valid Unicode (no lone surrogates)") from None


# A first bound on prompt text, before tokenizing: a text averaging more characters per token than this is no
# language a tokenizer was trained on (SmolLM2's longest token is 81 characters, a run of spaces).
MAX_CHARS_PER_TOKEN = 128


def check_prompt_chars(field: str, num_chars: int, max_model_len: int) -> None:
    """Raise RequestError(field) for a prompt of `num_chars` characters that cannot fit a context of
    `max_model_len` tokens (more than MAX_CHARS_PER_TOKEN per token). Frontends call it before tokenizing, so an
    absurd text is refused without the tokenizer's work."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise RequestError(
            field,
            f"{num_chars} characters cannot fit this model's context of {max_model_len} tokens "
            f"(at most {limit} characters)",
        )


class ToolCallTurn(msgspec.Struct, array_like=True, frozen=True):
    """An earlier tool call of an assistant turn, as a worker link carries it."""

    id: str
    name: str
    arguments: str  # JSON text


class ChatTurn(msgspec.Struct, array_like=True, frozen=True):
    """One chat message as a worker link carries it (`chat_turns` / `turn_dicts` convert from and to the dicts
    engines take)."""

    role: str
    content: str = ""
    name: str | None = None
    tool_calls: list[ToolCallTurn] = msgspec.field(default_factory=list)
    tool_call_id: str | None = None


def chat_turns(messages: Sequence[Mapping[str, Any]]) -> list[ChatTurn]:
    """Chat dicts as typed turns; RequestError("messages") for one that is not such a dict."""
    try:
        return [
            ChatTurn(
                str(m["role"]),
                m.get("content") or "",
                m.get("name"),
                [
                    ToolCallTurn(c["id"], c["function"]["name"], c["function"]["arguments"])
                    for c in m.get("tool_calls") or ()
                ],
                m.get("tool_call_id"),
            )  # fmt: skip
            for m in messages
        ]
    except (KeyError, TypeError) as exc:
        raise RequestError("messages", f"not a chat message: {exc!r}") from None


def turn_dicts(turns: Sequence[ChatTurn]) -> list[dict[str, Any]]:
    """Typed turns as the chat dicts engines take (the inverse of `chat_turns`)."""
    out = []
    for t in turns:
        turn: dict[str, Any] = {"role": t.role, "content": t.content}
        if t.name is not None:
            turn["name"] = t.name
        if t.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in t.tool_calls
            ]
        if t.tool_call_id is not None:
            turn["tool_call_id"] = t.tool_call_id
        out.append(turn)
    return out


class GenerationRequest(msgspec.Struct, array_like=True):
    """One prompt to continue. The prompt is already tokenized (the caller applied any chat template).

    `cache_salt`: requests share prefix-cache blocks (any tier) only when their salts are equal, None included
    (`kvbm.block_hash.request_salt`); a tenant's salt keeps others from probing its prompts through cached tokens.
    `kv_transfer_params`: set by the router in disaggregated serving, never by clients; opaque here, read only by
    the engine's KV transfer connector (`kvbm.transfer_params`: what to hand off, or what to continue from).
    `priority`: vLLM's meaning, lower runs first; an engine whose scheduling policy is fcfs takes only 0.
    `trace_context`: the W3C `traceparent` of the span this request's spans continue (server/tracing.py), set only
    when the request is traced; each process that places or runs it passes on its own span's.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: bytes | None = None
    priority: int = 0
    trace_context: str | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One token's log-probability and the most likely alternatives at its position, as the engine computed them:
    log-softmax of the model's raw logits in fp32 (before temperature, penalties and any mask: vLLM's default
    `logprobs_mode`). `token` and `top_tokens` are each token decoded on its own (a token that is part of a
    multi-byte character reads as U+FFFD, as vLLM's)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]  # most likely first; as many as the request asked for
    top_logprobs: list[float]
    token: str = ""
    top_tokens: list[str] = msgspec.field(default_factory=list)


class GenerationOutput(msgspec.Struct, array_like=True):
    """What one engine step added to one request. Counts are totals so far, in tokens."""

    request_id: RequestId
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from cache (any tier) instead of prefill
    num_output_tokens: int = 0
    error: str | None = None  # set with finish_reason "error": an internal failure, already logged
    retryable: bool = False  # with "error": the request did not fail, its worker died; a router may resume it
    # disaggregated serving: opaque to all but the KV transfer connector's halves (see `kvbm.transfer_params`): a
    # prefill engine's last output (finished, no finish_reason) says where the prompt's KV went, a decode engine's
    # first output after reading it reports the read
    kv_transfer_params: bytes | None = None
    logprobs: list[TokenLogprobs] | None = None  # with SamplingParams.logprobs: one per new_token_ids
    # with SamplingParams.prompt_logprobs, in the request's first output: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None


OutputSink = Callable[[GenerationOutput], None]


@dataclass(slots=True)
class RankStats:
    """One rank of a sharded engine (of worker `worker`): whether it serves (`up`), its process, resident memory
    (bytes) and seconds spent computing steps so far."""

    worker: str
    rank: int
    pid: int
    up: bool
    rss_bytes: int
    busy_s: float


@dataclass(slots=True)
class PoolStats:
    """An engine's KV pool occupancy in blocks, its queues in sequences, and its preemptions so far. A sharded
    engine adds its ranks (the driver first) and how many times its group restarted, by reason."""

    num_blocks: int
    num_free_blocks: int  # not referenced by a request (cached ones included)
    num_cached_blocks: int  # findable by prefix hash
    num_running: int
    num_waiting: int
    num_preemptions: int
    ranks: list[RankStats] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVBlockLayout:
    """How an engine keys its paged KV cache: block hashes (`kvbm.block_hash`) chain from `salt` over full blocks
    of `block_size` tokens, so engines share cached blocks, and a router's index, only when both are equal."""

    block_size: int  # tokens per block
    salt: int  # a kvbm.block_hash.BlockHash (a plain int here: the engine API imports nothing of kvbm)


@dataclass(frozen=True, slots=True)
class EngineResources:
    """What an engine in this process runs on, and how much work it takes at once."""

    device: str  # cpu | cuda | cuda:N
    num_threads: int  # torch intra-op threads
    max_concurrent_requests: int  # sequences running at once; the rest wait in a queue
    kv_capacity_blocks: int  # the KV pool (G1)
    kv_capacity_bytes: int


class Engine(Protocol):
    """What the server needs from an engine: in-process (`LLMEngine`), a worker process (`RemoteEngine`), or N
    workers behind a router (`RoutedEngine`)."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int:
        """Tokens: prompt + output."""
        ...

    @property
    def max_tokens_limit(self) -> int:
        """The largest max_tokens the engine accepts, in tokens (at most max_model_len); see `max_output_tokens`."""
        ...

    @property
    def block_layout(self) -> KVBlockLayout | None:
        """None until the engine knows it (a routed model served by remote workers, before the first joins)."""
        ...

    @property
    def healthy(self) -> bool:
        """The engine can take requests now (for a routed engine: at least one worker is alive)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included (an echoed prompt, /detokenize)."""
        ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of `messages` (OpenAI's turns as dicts: {"role", "content"[, "name"]}, an assistant's
        "tool_calls", a tool turn's "tool_call_id") and `tools` (OpenAI's tool objects) rendered with the model's
        chat template (server/engine/chat.py), ending with the assistant's turn."""
        ...

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        """Queue a request; raises RequestError at once for a request that can never run."""
        ...

    def abort(self, request_id: RequestId) -> None:
        """Stop a request and free its blocks now; its sink gets a final output with finish_reason "abort"."""
        ...

    def stats(self) -> PoolStats:
        """A snapshot of the KV pool and the queues (a worker's last report; summed over a routed engine's live
        workers)."""
        ...

    def close(self) -> None:
        """Stop serving; unfinished requests get their final output. Idempotent."""
        ...


class LocalEngine(Engine, Protocol):
    """An engine running in this process on this machine (`LLMEngine`, or a test's fake): what a worker process
    serves, calibrates, and describes in its hello. Engines that front other processes have no resources here."""

    @property
    def resources(self) -> EngineResources: ...

    @property
    def shard_layout(self) -> str:
        """ "tp<T>pp<P>" when its model is split over ranks (workers of one model must agree), "" otherwise."""
        ...


def shard_layout(tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """An engine's `shard_layout`: "tp<T>pp<P>" when split over ranks, "" for one."""
    if tensor_parallel_size * pipeline_parallel_size == 1:
        return ""
    return f"tp{tensor_parallel_size}pp{pipeline_parallel_size}"


def validate_request(engine: Engine, request: GenerationRequest, vocab_size: int) -> None:
    """What every engine checks at submit, in this order: a non-empty prompt of ids in the vocabulary, room for
    output (`max_output_tokens`), the sampling fields, stop_token_ids and logit_bias in the vocabulary (out of range, one would
    fail inside a batched step and take every request in it), and the cache salt. Raises RequestError."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise RequestError("prompt", "must contain at least one token")
    limit = max_output_tokens(engine, len(prompt))
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        raise RequestError("prompt", f"token ids must be integers in [0, {vocab_size})")
    request.sampling.validate(limit)
    if not all(0 <= t < vocab_size for t in request.sampling.stop_token_ids):
        raise RequestError("stop_token_ids", f"token ids must be in [0, {vocab_size})")
    if not all(0 <= t < vocab_size for t in request.sampling.logit_bias):
        raise RequestError("logit_bias", f"token ids must be in [0, {vocab_size})")
    structured = request.sampling.structured_outputs
    if structured is not None and not 0 <= structured.num_generated <= len(prompt):
        raise RequestError(structured.field, "num_generated must be in [0, the prompt's length]")
    validate_cache_salt(request.cache_salt)
    if not isinstance(request.priority, int) or not -(2**31) <= request.priority < 2**31:
        raise RequestError("priority", "must be an integer in [-2**31, 2**31)")


def max_output_tokens(engine: Engine, num_prompt_tokens: int) -> int:
    """The largest max_tokens a request may ask for: the room the context leaves after its prompt, capped by the
    engine's max_tokens_limit (tokens). The one place this limit is decided: engines check requests against it at
    submit, frontends validate sampling fields with it. Raises RequestError("prompt") if no room is left."""
    room = engine.max_model_len - num_prompt_tokens
    if room < 1:
        raise RequestError(
            "prompt",
            f"{num_prompt_tokens} tokens; this model's context is {engine.max_model_len} "
            "tokens (prompt + output)",
        )
    return min(room, engine.max_tokens_limit)


def continuation(request: GenerationRequest, generated_token_ids: Sequence[int]) -> GenerationRequest:
    """The request that generates the rest of `request`'s answer once `generated_token_ids` are out: its prompt is
    the prompt followed by those tokens, its max_tokens what is left of them and its min_tokens too (never below
    0), and no prompt logprobs once tokens are out (the request's first output had them); its grammar, if any, counts those tokens as
    generated under it (they are replayed into it); the id, cache salt, seed, stop strings and every other sampling
    field are the request's. Its
    `kv_transfer_params` are dropped: the continuation runs whole on whichever engine takes it.

    Invariant (tokens): len(generated_token_ids) + continuation.sampling.max_tokens == request.sampling.max_tokens,
    and the continuation's prompt ends with generated_token_ids. A greedy continuation's tokens are the ones the
    request would have gone on with; a sampled one continues from the tokens, not as its seed would have gone.
    The one place this arithmetic is done (router migration, a decode engine resuming a prefill's handoff).
    Raises ValueError when nothing is left to generate (as many tokens as max_tokens, or more)."""
    done = len(generated_token_ids)
    sampling = request.sampling
    if done >= sampling.max_tokens:
        raise ValueError(
            f"continuation after {done} tokens of max_tokens {sampling.max_tokens}: none is left"
        )
    rest = msgspec.structs.replace(
        sampling,
        max_tokens=sampling.max_tokens - done,
        min_tokens=max(0, sampling.min_tokens - done),
        prompt_logprobs=sampling.prompt_logprobs if done == 0 else None,
        structured_outputs=None
        if sampling.structured_outputs is None
        else msgspec.structs.replace(
            sampling.structured_outputs, num_generated=sampling.structured_outputs.num_generated + done
        ),
    )
    return msgspec.structs.replace(
        request,
        prompt_token_ids=[*request.prompt_token_ids, *generated_token_ids],
        sampling=rest,
        kv_transfer_params=None,
    )
