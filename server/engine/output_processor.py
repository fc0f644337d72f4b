"""What a sampled token means to the client: stop rules, incremental text, and one `GenerationOutput` per step.

The engine core calls `check_stop` for each sampled token and `emit` for each sequence that has something to say;
this is the only place that builds outputs and calls sinks. Stop rules, in order: a stop token or EOS (once
`min_tokens` are out; EOS unless `ignore_eos`), a stop string in the text, then `max_tokens` or the context length.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from server.engine.api import FinishReason, GenerationOutput
from server.engine.kv_transfer import KVTransferConnector
from server.engine.sequence import Sequence
from server.engine.structured import consume

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(
        self,
        eos_token_ids: list[int],
        max_model_len: int,
        token_texts: Callable[[], list[str]] = lambda: [],
    ) -> None:
        """`max_model_len`: tokens, prompt + output; `token_texts()`: each vocabulary id's text on its own (asked
        for once, when the first logprobs go out)."""
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._token_texts = token_texts
        self._texts: list[str] | None = None

    def token_texts(self) -> list[str]:
        """Each vocabulary id's text, built on first use (a batched decode of the whole vocabulary: the engine's
        submit calls this for a request that asks for logprobs, so the engine thread never builds it)."""
        if self._texts is None:
            self._texts = self._token_texts()
        return self._texts

    def _named(self, entries: list) -> list:
        """`entries` (TokenLogprobs or None) with their tokens' texts filled in."""
        texts = self.token_texts()
        for entry in entries:
            if entry is not None:
                entry.token = texts[entry.token_id]
                entry.top_tokens = [texts[t] for t in entry.top_token_ids]
        return entries

    def check_stop(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Why `seq` ends with `token_id` (already appended), or None. Feeds the token to its grammar and its
        detokenizer; a grammar that accepts nothing more ends the sequence once the token's text is in."""
        params = seq.sampling
        complete = consume(seq, token_id)
        if seq.num_output_tokens > params.min_tokens - 1 and (
            token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
        ):
            return "stop"
        if seq.detokenizer.add_token(token_id) or complete:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def emit_retryable(self, seq: Sequence, error: str) -> None:
        """`seq`'s final output as a retryable error: no tokens or text beyond those already sent (a router
        resumes it from those), the error for the log."""
        output = GenerationOutput(
            request_id=seq.request_id, new_token_ids=[], new_text="", finished=True, finish_reason="error",
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_reported_tokens, error=error, retryable=True,
        )  # fmt: skip
        try:
            seq.sink(output)
        except Exception:
            log.exception("sink of request %s failed", seq.request_id)

    def emit(
        self,
        seq: Sequence,
        finished: bool,
        reason: FinishReason | None = None,
        error: str | None = None,
        kv_transfer_params: bytes | None = None,
    ) -> bool:
        """Send what `seq` added since its last output (nothing if it added nothing and is not finished). An
        output finished without a reason is a handoff (`kv_transfer_params` say where the KV went): its text is
        what an unfinished output would carry (the decode engine holds back the rest). A read handoff's report
        goes with the next output. A detokenizer failure raises unless `finished` (then the text is ""); returns
        False if the sink of an unfinished request failed (logged: the caller aborts the request)."""
        try:
            text = seq.detokenizer.take_text(finished and reason is not None)
        except Exception:
            if not finished:
                raise
            log.exception("detokenizing request %s failed", seq.request_id)
            text = ""
        new_ids = seq.output_token_ids[seq.num_reported_tokens :]
        if not (new_ids or text or finished):
            return True
        if kv_transfer_params is None:
            kv_transfer_params = KVTransferConnector.take_received(seq)
        seq.num_reported_tokens = seq.num_output_tokens
        output = GenerationOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=text, finished=finished,
            finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens, error=error, kv_transfer_params=kv_transfer_params,
        )  # fmt: skip
        if seq.sampling.logprobs is not None:
            output.logprobs, seq.logprobs = self._named(seq.logprobs), []
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            if len(seq.prompt_logprobs) == seq.num_prompt_tokens:
                output.prompt_logprobs = self._named(seq.prompt_logprobs)
                seq.prompt_logprobs_sent = True
        try:
            seq.sink(output)
        except Exception:
            log.exception("sink of request %s failed", seq.request_id)
            return finished
        return True
