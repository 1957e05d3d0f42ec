"""The adapter between the chat app and the runtime: one conversation on one loaded `LLM`.

The app never touches the runtime except through this module. A `Reply` runs in a worker
thread and writes only what the plain generation loop writes anyway (the request's `Sequence`
counters and timestamps) plus one list append per text delta; the UI reads those from its own
timer, so showing live stats costs the generation thread nothing.

Where the public `LLM` API has no accessor yet, `_runtime_*` helpers below read the runtime's
internals; they are the only such reads, so wiring a public API in is a change in one place.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.eval.weights import bits_per_weight, type_counts

# A chat reply with no cap could run until a 4k context fills; Esc stops one earlier.
DEFAULT_MAX_TOKENS = 1024
# /set NAME VALUE: the parameter's type (the dataclass validates the range).
SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "min_p": float}


class ContextFullError(EdgeInferError):
    """The conversation no longer fits the context; /clear starts a new one, /shift drops its
    oldest turns."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    arch: str
    quant: str  # e.g. "Q4_1", "Q4_K_M"
    path: Path
    threads: int
    max_context: int
    chat: bool  # False: a base model without a chat template, run as plain completion
    bits_per_weight: float | None = None  # tensor data bits over weights, the whole file
    tensor_types: str = ""  # e.g. "Q4_1 x 181, F32 x 61, Q8_0 x 31", most tensors first
    placement: str = ""  # which layers run where (LLM.placement)


@dataclass(frozen=True)
class Progress:
    """A reply's counters at one instant (read from the generation thread's Sequence)."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache, not computed
    generated: int
    t_arrival: float
    t_first: float | None
    t_last: float | None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_arrival

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (decode only)."""
        if self.t_first is None or self.t_last is None or self.generated < 2:
            return None
        return (self.t_last - self.t_first) / (self.generated - 1)


class Reply:
    """One assistant reply being generated. `run()` belongs to the worker thread; everything
    else is for the UI thread."""

    def __init__(self, llm, prompt_ids: list[int], params: SamplingParams):
        self.prompt_tokens = len(prompt_ids)
        self._stream = llm.stream(prompt_ids, params)
        self._seq = self._stream.sequence
        self._chunks: list[str] = []
        self._taken = 0
        self.finish_reason: str | None = None  # 'stop' | 'length' | 'abort' (Esc) | 'error'
        self.error: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        """Generate to the end (worker thread). Never raises: failures land in `.error`."""
        try:
            for delta in self._stream:
                self._chunks.append(delta)
            # the Sequence's reason, not the Completion's: a reply stopped during its prefill
            # has no token, so no timings for a Completion
            self.finish_reason = self._seq.finish_reason
        except EdgeInferError as e:
            self.error, self.finish_reason = str(e), "error"
        except Exception as e:  # a bug must not take the whole terminal down with a traceback
            self.error, self.finish_reason = f"internal error: {type(e).__name__}: {e}", "error"
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Stop after the forward step being computed now (the loop frees the KV blocks)."""
        self._stream.cancel()

    def take_text(self) -> str:
        """Text produced since the last call."""
        n = len(self._chunks)
        new = "".join(self._chunks[self._taken : n])
        self._taken = n
        return new

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def progress(self) -> Progress:
        seq = self._seq
        return Progress(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            generated=seq.num_output_tokens,
            t_arrival=seq.t_arrival,
            t_first=seq.t_first_token,
            t_last=seq.t_last_token,
        )


class ChatSession:
    """A conversation: system prompt, turns, sampling parameters, and the reply in flight."""

    def __init__(self, llm, info: ModelInfo, system: str | None, params: SamplingParams):
        self.llm = llm
        self.info = info
        self.system = system or None
        self.params = params
        self.turns: list[dict] = []
        self.reply: Reply | None = None
        self.last: Progress | None = None  # the last finished reply's counters

    @property
    def busy(self) -> bool:
        return self.reply is not None and not self.reply.done.is_set()

    def messages(self, turns: list[dict] | None = None) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + (self.turns if turns is None else turns)

    def clear(self) -> None:
        self.turns = []
        self.last = None

    def set_param(self, name: str, value: str) -> SamplingParams:
        """/set NAME VALUE -> the new params; bad names or values raise EdgeInferError."""
        if name not in SETTABLE:
            raise EdgeInferError(f"/set knows {', '.join(SETTABLE)}; not {name!r}")
        try:
            parsed = SETTABLE[name](value)
        except ValueError:
            raise EdgeInferError(
                f"{name} needs a {SETTABLE[name].__name__}, got {value!r}"
            ) from None
        if name == "max_tokens" and parsed == -1:
            parsed = None  # no limit, as `-n -1` on the command line
        self.params = dataclasses.replace(self.params, **{name: parsed})
        return self.params

    def start(self, user_text: str) -> Reply:
        """Add the user's turn and start a reply (run it with `reply.run()` in a thread).

        A conversation that no longer fits raises ContextFullError and is left unchanged.
        """
        turns = [*self.turns, {"role": "user", "content": user_text}]
        ids = self.llm.chat_token_ids(self.messages(turns))
        ctx = self.info.max_context
        if len(ids) >= ctx:
            raise ContextFullError(
                f"the conversation is {len(ids)} tokens and the context holds {ctx}"
            )
        self.turns = turns
        self.reply = Reply(self.llm, ids, self.params)
        return self.reply

    def finish(self) -> Reply:
        """Record the finished reply's text as the assistant's turn (a stopped one too)."""
        reply = self.reply
        self.last = reply.progress()
        if reply.text:
            self.turns.append({"role": "assistant", "content": reply.text})
        return reply

    def shift(self) -> int:
        """Drop the oldest exchanges (a user turn and its reply; the system prompt stays) until
        the conversation takes at most half the context, as llama.cpp's context shift frees
        half -> the number of turns dropped."""
        half = self.info.max_context // 2
        dropped = 0
        while self.turns and len(self.llm.chat_token_ids(self.messages())) > half:
            n = 2 if len(self.turns) > 1 and self.turns[1]["role"] == "assistant" else 1
            del self.turns[:n]
            dropped += n
        return dropped

    def context_full(self) -> bool:
        """Whether the last reply ended because the context ran out."""
        last = self.last
        return last is not None and last.prompt_tokens + last.generated >= self.info.max_context

    def kv_blocks(self) -> tuple[int, int, int]:
        """(used, total, cached) KV-cache blocks; cached: free blocks that keep earlier turns
        for reuse."""
        return _counts(self.llm.engine.blocks)

    def window_blocks(self) -> tuple[int, int, int] | None:
        """The same for a sliding-window model's second pool (its local layers keep only their
        window there); None for a model without one."""
        blocks = self.llm.engine.window_blocks
        return _counts(blocks) if blocks else None

    def drafts(self) -> tuple[int, int, int] | None:
        """Speculative decoding's (drafts, proposed, accepted) tokens so far; None when off."""
        s = self.llm.engine.speculator
        return None if s is None else (s.num_drafts, s.num_proposed, s.num_accepted)


def load(
    model: str, threads: int | None, ctx: int | None, progress, **knobs
) -> tuple[object, ModelInfo]:
    """Resolve (pulling on first use), load and warm up a model. `progress(message, fraction)`
    is called from this (worker) thread; knobs: more EngineConfig knobs (speculative)."""
    from edgeinfer.gguf import hub
    from edgeinfer.llm import LLM

    path = hub.resolve_model(model, progress=lambda msg, fraction=None: progress(msg, fraction))
    progress("loading weights", None)
    # one conversation: one context's worth of KV blocks (earlier turns stay in it, cached)
    llm = LLM(str(path), threads=threads, ctx=ctx, parallel=1, **knobs)
    progress("warming up kernels", None)
    # A few prompt tokens and one decode step compile (or load from Numba's cache) the prefill
    # and decode kernels, so the first real reply starts without a stall.
    llm.chat_token_ids([{"role": "user", "content": "Hi"}])
    warm = llm.tokenizer.encode("Hello, world")
    llm.generate(warm, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    # a short name the user typed reads better than general.name ("Smollm2 135M 8k Lc100K ...")
    return llm, describe(llm, path, model if model in hub.MODELS else None)


def describe(llm, path: Path, name: str | None = None) -> ModelInfo:
    # llm.gguf is the file the runner already parsed: re-reading it would parse the whole
    # vocabulary again (262k tokens for Gemma)
    return ModelInfo(
        name=name or llm.config.name,
        arch=llm.config.arch,
        quant=quant_label(llm.gguf),
        path=Path(path),
        threads=llm.threads,
        max_context=llm.max_context,
        chat=llm.chat_template is not None,
        bits_per_weight=bits_per_weight(llm.gguf),
        tensor_types=", ".join(f"{t} x {n}" for t, n in type_counts(llm.gguf).items()),
        placement=llm.placement(),
    )


def quant_label(g) -> str:
    """The file's quantization as llama.cpp names it (general.file_type), else the type
    holding the most bytes."""
    from gguf import LlamaFileType

    ftype = g.get("general.file_type")
    try:
        return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        sizes: dict[str, int] = {}
        for t in g.tensors.values():
            sizes[t.qtype.name] = sizes.get(t.qtype.name, 0) + t.nbytes
        return max(sizes, key=sizes.get) if sizes else "?"


def _counts(blocks) -> tuple[int, int, int]:
    return blocks.num_used_blocks, blocks.num_blocks, blocks.num_cached_blocks
