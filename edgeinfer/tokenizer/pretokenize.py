"""Word splitting before byte-level BPE, chosen by `tokenizer.ggml.pre`.

llama.cpp splits in stages: each stage is a regex applied inside the pieces the previous stage
produced, its matches and the gaps between them both becoming pieces. Most stages run through
hand-written matchers there (GPT-2, Llama 3, Qwen2), the rest through std::regex; both
classify characters with llama.cpp's Unicode 15.1 table. Here, as in llama.cpp's std::regex
path, every non-ASCII character is first replaced by one stand-in character per class (letter,
number, mark, punctuation, whitespace, other), so the patterns only need small ASCII classes:
Python's `re` is several times slower on classes that reach past the BMP. The stand-ins keep
string lengths, so word boundaries carry back to the original text.
"""

from __future__ import annotations

import bisect
import re
import warnings
from dataclasses import dataclass
from itertools import accumulate

from edgeinfer.tokenizer import unicode_data

# Stand-ins for non-ASCII characters (C1 controls; any non-ASCII input is replaced first).
_LETTER, _NUMBER, _MARK, _PUNCT, _SPACE, _OTHER = "\x80", "\x81", "\x82", "\x83", "\x84", "\x85"
# Classes over the collapsed text (ASCII members spelled out, as Unicode classes them).
L = "A-Za-z\x80"
N = "0-9\x81"
M = "\x82"
P = "!-#%-*,-/:;?@\\[-\\]_{}\x83"
WS = "\t-\r \x84"

_SPACE_RUNS = f"[{WS}]+(?![^{WS}])|[{WS}]+"
_CONTRACTIONS_CI = "'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"

GPT2 = rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{WS}{L}{N}]+|{_SPACE_RUNS}"
# StarCoder / SmolLM: every digit alone, then GPT-2's split inside the runs between digits.
# As one pattern: digits first, and a space run may also end where a digit follows (the end of
# its piece there); GPT-2's " ?digits" alternative can never match inside such a piece.
STARCODER = (
    rf"[{N}]|'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[^{WS}{L}{N}]+"
    rf"|[{WS}]+(?![^{WS}{N}])|[{WS}]+"
)
# Llama 3 and Qwen2 differ only in how many digits stay together.
_LLAMA3_LIKE = (
    rf"{_CONTRACTIONS_CI}|[^\r\n{L}{N}]?[{L}]+|[{N}]DIGITS"
    rf"| ?[^{WS}{L}{N}]+[\r\n]*|[{WS}]*[\r\n]+|{_SPACE_RUNS}"
)
LLAMA3 = _LLAMA3_LIKE.replace("DIGITS", "{1,3}")
QWEN2 = _LLAMA3_LIKE.replace("DIGITS", "")
# Qwen3.5: letter runs also take combining marks.
QWEN35 = (
    rf"{_CONTRACTIONS_CI}|[^\r\n{L}{N}]?[{L}{M}]+|[{N}]"
    rf"| ?[^{WS}{L}{M}{N}]+[\r\n]*|[{WS}]*[\r\n]+|{_SPACE_RUNS}"
)
_DEFAULT = (rf"[{P}$+<=>^~|]+", GPT2, rf"[{N}]+", "[0-9][0-9][0-9]")


def _class_table() -> tuple[list[int], list[tuple[int, str]]]:
    ranges = sorted(
        (first, last, stand_in)
        for table, stand_in in (
            (unicode_data.L, _LETTER), (unicode_data.N, _NUMBER), (unicode_data.M, _MARK),
            (unicode_data.P, _PUNCT), (unicode_data.WS, _SPACE),
        )
        for first, last in table
    )  # fmt: skip
    return [r[0] for r in ranges], [(r[1], r[2]) for r in ranges]


class _Collapse(dict):
    """str.translate table: code point -> itself if ASCII, else its class's stand-in;
    filled on first use of each code point."""

    def __init__(self):
        super().__init__()
        self._starts, self._ends = _class_table()

    def __missing__(self, cpt: int) -> str:
        if len(self) > 1 << 16:  # bound the memo on text with very many distinct characters
            self.clear()
        if cpt < 128:
            value = chr(cpt)
        else:
            i = bisect.bisect_right(self._starts, cpt) - 1
            last, stand_in = self._ends[i] if i >= 0 else (-1, _OTHER)
            value = stand_in if cpt <= last else _OTHER
        self[cpt] = value
        return value


_COLLAPSE = _Collapse()


@dataclass(frozen=True)
class PreType:
    name: str
    stages: tuple[re.Pattern, ...]
    ignore_merges: bool = False  # a word that is itself a token skips the merges
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token

    def split(self, text: str) -> list[str]:
        collapsed = text if text.isascii() else text.translate(_COLLAPSE)
        if len(self.stages) == 1:
            # A single stage's pattern matches every character, so there are no gaps.
            pieces = self.stages[0].findall(collapsed)
        else:
            pieces = [collapsed]
            for stage in self.stages:
                pieces = _split_stage(stage, pieces)
        if collapsed is text:
            return pieces
        ends = list(accumulate(map(len, pieces)))
        return [text[a:b] for a, b in zip([0, *ends], ends, strict=False)]


def _split_stage(pattern: re.Pattern, pieces: list[str]) -> list[str]:
    out = []
    append = out.append
    for piece in pieces:
        pos = 0
        for m in pattern.finditer(piece):
            start, end = m.span()
            if start > pos:
                append(piece[pos:start])
            append(piece[start:end])
            pos = end
        if pos < len(piece):
            append(piece[pos:])
    return out


def _make(name, patterns, **flags) -> PreType:
    return PreType(name, tuple(re.compile(p) for p in patterns), **flags)


_GROUPS = (
    (("default",), _DEFAULT, {}),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), (LLAMA3,), {"ignore_merges": True, "add_bos": True}),
    (("dbrx", "smaug-bpe"), (LLAMA3,), {}),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
     (GPT2,), {}),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
      "mellum2"), (STARCODER,), {}),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
      "solar-open"), (QWEN2,), {}),
    (("qwen35",), (QWEN35,), {}),
)  # fmt: skip
_NAMES = {name: (group, patterns, flags) for group, patterns, flags in _GROUPS for name in group}
_CACHE: dict[str, PreType] = {}
SUPPORTED_PRE = tuple(sorted(_NAMES))


def pre_type(name: str) -> PreType:
    """The pre-tokenizer for `tokenizer.ggml.pre`; an absent or unknown one falls back to
    llama.cpp's 'default' split (what llama.cpp does for an absent one) with a warning."""
    if name not in _NAMES:
        what = "missing" if not name else f"unknown ({name!r})"
        warnings.warn(
            f"tokenizer.ggml.pre is {what}: using the 'default' pre-tokenizer, "
            "tokenization may differ from the model's own",
            stacklevel=2,
        )
        name = "default"
    if name not in _CACHE:
        group, patterns, flags = _NAMES[name]
        shared = next((_CACHE[n] for n in group if n in _CACHE), None)
        _CACHE[name] = shared or _make(group[0], patterns, **flags)
    return _CACHE[name]
