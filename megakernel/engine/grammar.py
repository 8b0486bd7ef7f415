"""Structured outputs: a grammar per constrained sequence, turned into a token mask before sampling.

The grammar engine is llguidance (the `server` extra): JSON schemas and Lark grammars (which may embed JSON
schemas with `%json` and special tokens such as `<|END_TEXT|>`) compile to a matcher that, given the tokens so far,
says which tokens may come next. Only sequences whose SamplingParams carry `structured_outputs` get a matcher;
every other row is sampled exactly as before.

A mask can only be computed once the matcher has consumed the sequence's previous token, and with pipelined steps
that token is read back one step late. The scheduler therefore does not schedule a constrained sequence while a
token of it is still in flight (see Scheduler.schedule): it decodes every other step, while unconstrained
sequences keep the pipeline full.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from megakernel.errors import RequestError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a constrained sequence must produce: exactly one of a JSON schema, any JSON object, or a Lark grammar
    (llguidance's dialect: `%json {...}` embeds a schema, `<|TOKEN|>` names a special token)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    grammar: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None and x is not False for x in (self.json, self.grammar, self.json_object or None)) != 1:
            raise RequestError("structured_outputs needs exactly one of json, json_object or grammar")

    def to_grammar(self) -> str:
        import llguidance

        if self.grammar is not None:
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        schema = {"type": "object"} if self.json_object else self.json
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        except ValueError as e:
            raise RequestError(f"invalid JSON schema: {e}") from None


# The separators json.dumps (and the chat template's tojson) writes, and no free whitespace: the model sees the
# style it was trained on, and cannot run away emitting blank space inside an object.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_style_schema(schema: dict[str, Any]) -> str:
    """`schema` as text for a Lark `%json` block, with JSON_STYLE attached (a `%json` block takes no options)."""
    return json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})


class GrammarMatcher:
    """One sequence's grammar state: the allowed next tokens as a bitmask, and the tokens it has accepted."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def bitmask(self) -> np.ndarray:
        """Allowed next tokens: int32 words, bit i of word j allowing token 32*j + i."""
        return np.frombuffer(self._m.compute_bitmask(), dtype=np.int32)

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence ends here)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Builds matchers for one tokenizer and logits width (tokens past the tokenizer's vocabulary are never
    allowed). Building the llguidance tokenizer takes a moment, so it is made on first use and kept."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok = None

    @property
    def lltokenizer(self):
        if self._lltok is None:
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer, so outputs cannot be constrained")
            try:
                import llguidance.hf
            except ImportError:
                raise RequestError("structured outputs need llguidance: pip install 'megakernel[server]'") from None
            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._lltok

    def check(self, spec: StructuredOutputsParams) -> str:
        """The compiled grammar of `spec`; RequestError with llguidance's reason if it cannot be compiled."""
        import llguidance

        grammar = spec.to_grammar()
        err = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if err:
            raise RequestError(f"the grammar cannot be compiled: {err.splitlines()[0]}")
        return grammar

    def matcher(self, spec: StructuredOutputsParams, grammar: str | None = None) -> GrammarMatcher:
        import llguidance

        m = llguidance.LLMatcher(self.lltokenizer, grammar or self.check(spec), log_level=0)
        if m.is_error():
            raise RequestError(f"the grammar cannot be compiled: {m.get_error().splitlines()[0]}")
        return GrammarMatcher(m)
