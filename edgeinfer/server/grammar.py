"""Structured output: every sampled token masked by a grammar compiled from a JSON schema.

llguidance (the library llama.cpp and vLLM use) compiles the schema and, at each step,
computes the set of tokens that keep the output a valid prefix of the grammar; the rest get
-inf before sampling. It sees the model's vocabulary as bytes, bridged from our tokenizer;
control tokens carry llguidance's 0xff marker so that they never match grammar text.

JSON is emitted compact (", " and ": " separators, no free whitespace): a small model given
free whitespace can fill its whole budget with newlines.
"""

from __future__ import annotations

import json

import numpy as np

from edgeinfer.server.errors import bad_request

_OPTIONS = {"whitespace_flexible": False}
JSON_OBJECT = {"type": "object"}


class _VocabView:
    """What llguidance's TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer):
        from edgeinfer.tokenizer.vocab import CONTROL, UNKNOWN

        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        attrs = tokenizer.vocab.attrs
        self.tokens = [
            b"\xff" + tokenizer.token_bytes(i, special=True)
            if attrs[i] & (CONTROL | UNKNOWN)
            else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        self.special_token_ids = [i for i, a in enumerate(attrs) if a & (CONTROL | UNKNOWN)]

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_bos=False)


class GrammarCompiler:
    """One per model: the llguidance view of the vocabulary (built on first use, ~0.1 s)."""

    def __init__(self, tokenizer):
        import llguidance

        view = _VocabView(tokenizer)
        self.vocab_size = vocab_size = tokenizer.vocab_size
        self.eos_ids = sorted(tokenizer.eos_ids) or [tokenizer.eos_id]
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(view), n_vocab=vocab_size, eos_token=self.eos_ids
        )

    def compile(self, schema: dict) -> Grammar:
        from llguidance import LLMatcher

        return self._checked(
            lambda: LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_OPTIONS),
            "response_format",
        )

    def compile_lark(self, lark: str, param: str) -> Grammar:
        """A grammar in llguidance's Lark syntax (JSON schemas embedded with %json)."""
        from llguidance import LLMatcher

        return self._checked(lambda: LLMatcher.grammar_from_lark(lark), param)

    def _checked(self, build, param: str) -> Grammar:
        from llguidance import LLMatcher

        try:
            grammar = build()
        except (ValueError, TypeError) as e:
            raise bad_request(f"invalid JSON schema: {e}", param) from None
        error = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error and not error.startswith("WARNING"):
            raise bad_request(f"unsupported JSON schema: {error}", param)
        return Grammar(self._tokenizer, grammar, self.vocab_size, self.eos_ids)


class Grammar:
    """A compiled grammar; each choice of a request takes its own processor (parse state)."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int, eos_ids: list[int]):
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids

    def processor(self) -> GrammarProcessor:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, self._grammar, log_level=0)
        return GrammarProcessor(matcher, self._vocab_size, self._eos_ids)


class GrammarProcessor:
    """A logits processor (engine hook: fn(output_ids, logits) -> logits) for one sequence.

    It runs on the engine thread, where an exception would fail every request in the batch:
    a matcher error (it has none for tokens it allowed) instead lets only EOS through and is
    kept in `.error`.
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int]):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._consumed = 0
        self.error: str | None = None

    def __call__(self, output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        # logits: [vocab] float32, edited in place
        m = self._matcher
        try:
            if len(output_ids) > self._consumed:
                m.consume_tokens(list(output_ids[self._consumed :]))
                self._consumed = len(output_ids)
            if m.is_error():
                raise RuntimeError(m.get_error())
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            # rows past the tokenizer's vocabulary (padding some models have) stay masked
            allowed = np.zeros(logits.shape[0], dtype=bool)
            n = min(logits.shape[0], self._vocab_size)
            allowed[:n] = np.unpackbits(bits, bitorder="little")[:n]
            if not allowed.any():
                raise RuntimeError("the grammar allows no token")
        except Exception as e:  # see the class docstring
            self.error = self.error or str(e)
            allowed = np.zeros(logits.shape[0], dtype=bool)
            allowed[self._eos_ids] = True
        logits[~allowed] = -np.inf
        return logits
