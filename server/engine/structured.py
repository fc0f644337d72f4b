"""Structured outputs: a grammar (JSON schema, regex, choice, Lark) as a token bitmask in the sampler, through
llguidance (one of vLLM's two backends: Rust, no torch.compile, grammars built lazily, so a new schema costs about
a millisecond and needs no compile step ahead of time).

At submit, on the caller's thread (never the engine thread): `GrammarCompiler.matcher(spec)` turns the request's
`StructuredOutput` into a grammar (cached by spec, so a schema is converted once), checks it (a bad schema or regex
is a RequestError naming the client's field) and makes the request's matcher; the tokens the request already
generated under it (`num_generated`, a migrated or resumed request) are replayed into the matcher there. Each step,
on the engine thread, `GrammarMask` fills the bitmask rows of the batch's constrained sequences in one parallel
call and masks their logits; after the draw the matcher consumes the token, and a matcher that accepts nothing
more ends the sequence ("stop").
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from server.engine.api import RequestError, StructuredOutput
from server.engine.sequence import Sequence

_CACHE_SIZE = 256  # grammars kept, by spec


class GrammarCompiler:
    """The engine's grammar side: its tokenizer as llguidance sees it (built on first use: about 0.6 s for
    SmolLM2's 49k tokens, so engines that never see a grammar never pay it) and the grammar cache."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._path = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._lock = threading.Lock()
        self._tokenizer = None
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()

    def _ll_tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    str(self._path), n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def matcher(self, spec: StructuredOutput, generated: list[int]):
        """A new matcher for `spec` that has consumed `generated`; RequestError(spec.field) for a grammar that
        does not compile or tokens it does not accept."""
        import llguidance

        tokenizer = self._ll_tokenizer()
        grammar = self._grammar(spec, tokenizer)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(spec.field, _first_line(matcher.get_error()))
        if generated and not matcher.consume_tokens(generated):
            raise RequestError(
                spec.field, "the tokens generated so far do not match it: " + matcher.get_error()
            )
        return matcher

    def _grammar(self, spec: StructuredOutput, tokenizer) -> str:
        from llguidance import LLMatcher

        key = (spec.kind, spec.spec)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        grammar = _to_grammar(spec)
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise RequestError(spec.field, _first_line(error))
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar


def _to_grammar(spec: StructuredOutput) -> str:
    from llguidance import LLMatcher, gbnf_to_lark

    try:
        if spec.kind == "json":
            return LLMatcher.grammar_from_json_schema(spec.spec, defaults=_JSON_LAYOUT)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_LAYOUT)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        # grammar: Lark (llguidance's), or GBNF/EBNF as vLLM's xgrammar backend takes it
        lark = spec.spec if LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(spec.spec)) == "" else None
        return LLMatcher.grammar_from_lark(lark if lark is not None else gbnf_to_lark(spec.spec))
    except (ValueError, TypeError) as exc:
        raise RequestError(spec.field, _first_line(str(exc))) from None
    except Exception as exc:  # llguidance's converters raise their own types for a text they cannot read
        raise RequestError(spec.field, _first_line(f"{type(exc).__name__}: {exc}")) from None


# JSON laid out as Python's json.dumps does ('{"a": 1, "b": [2, 3]}'), no other whitespace: with any whitespace
# allowed (llguidance's default, as vLLM's `disable_any_whitespace: false`), a small model sampled at temperature 1
# spends its tokens on newlines and indentation; a schema's own "x-guidance" options still win
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "invalid"


class GrammarMask:
    """The sampler stage: rows whose sequence has a matcher may draw only the tokens its grammar allows next."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)
        self._executor = None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return
        import llguidance  # not llguidance.torch: it torch.compiles a kernel at import

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)  # torch holds the cores
        mask = torch.empty(len(rows), self._words, dtype=torch.int32)
        matchers = [(seqs[row].grammar, i) for i, row in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(matchers, mask.data_ptr(), self._words * 4, len(rows))
        allowed = ((mask.unsqueeze(-1) >> self._bits) & 1).view(len(rows), -1)[:, : logits.shape[1]].bool()
        allowed = allowed.to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


def consume(seq: Sequence, token_id: int) -> bool:
    """Feed the drawn token to the sequence's matcher; True when the grammar accepts nothing more (the output is
    complete). A token the grammar refused (only possible if the mask was bypassed) also ends it."""
    matcher = seq.grammar
    if matcher is None:
        return False
    if not matcher.consume_token(token_id):
        return True
    return matcher.is_stopped()
