"""OpenAI's response shapes, as plain dicts: `chat.completion`, `chat.completion.chunk`,
`text_completion` (whole and streamed), and their logprobs."""

from __future__ import annotations

from edgeinfer.engine.outputs import TokenLogprob


class Shapes:
    """Builds one request's bodies; `chat` picks the chat or the completions shapes."""

    def __init__(self, request_id: str, model: str, created: int, chat: bool, tokenizer):
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = created
        self.chat = chat
        self._tok = tokenizer

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses ---------------------------------------------------------------------

    def response(self, choices: list[dict], usage: dict) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": usage}

    def choice(
        self,
        index: int,
        text: str | None,
        logprobs: list[TokenLogprob] | None,
        finish: str,
        tool_calls: list[dict] | None = None,
    ):
        lp = None if logprobs is None else self.logprobs(logprobs, 0)
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    # -- stream chunks -----------------------------------------------------------------------

    def chunk(
        self,
        index: int,
        text: str | None,
        logprobs: list[TokenLogprob] | None = None,
        finish: str | None = None,
        role: bool = False,
        text_offset: int = 0,
        usage: bool = False,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """One choice's delta. role: the first chunk of a chat choice; usage: add
        "usage": null, as OpenAI does on every chunk when the usage chunk is asked for;
        tool_calls: whole calls, each with its index in the delta as OpenAI streams them."""
        lp = None if logprobs is None else self.logprobs(logprobs, text_offset)
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
            c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            body = {**self._head("chat.completion.chunk"), "choices": [c]}
        else:
            c = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            body = {**self._head("text_completion"), "choices": [c]}
        if usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    # -- logprobs ----------------------------------------------------------------------------

    def logprobs(self, items: list[TokenLogprob], text_offset: int) -> dict:
        tok = self._tok
        if self.chat:
            return {
                "content": [
                    {
                        **self._token(t.token_id, t.logprob),
                        "top_logprobs": [self._token(i, lp) for i, lp in t.top],
                    }
                    for t in items
                ],
                "refusal": None,
            }
        tokens, offsets = [], []
        for t in items:
            piece = tok.token_to_piece(t.token_id, special=True)
            offsets.append(text_offset)
            tokens.append(piece)
            text_offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [
                {tok.token_to_piece(i, special=True): lp for i, lp in t.top} for t in items
            ],
            "text_offset": offsets,
        }

    def _token(self, token_id: int, logprob: float) -> dict:
        raw = self._tok.token_bytes(token_id, special=True)
        return {
            "token": raw.decode("utf-8", "replace"),
            "logprob": logprob,
            "bytes": list(raw),
        }
