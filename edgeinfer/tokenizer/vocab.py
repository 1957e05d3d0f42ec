"""The vocabulary as llama.cpp sees it: token texts, scores and attributes, special-token ids and
the BOS/EOS/space-prefix flags, with llama.cpp's load-time fix-ups applied (control-looking
tokens forced to control, end-of-generation tokens found by their text, ...). Tokenization
depends on these attributes (which tokens are split out of raw text, which render), so they
must follow llama.cpp's rules exactly, odd ones included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import GGUFError
from edgeinfer.tokenizer.pretokenize import PreType, pre_type

# Token attributes (llama.h LLAMA_TOKEN_ATTR_*), a bit set per token.
UNKNOWN = 1 << 0
UNUSED = 1 << 1
NORMAL = 1 << 2
CONTROL = 1 << 3
USER_DEFINED = 1 << 4
BYTE = 1 << 5
LSTRIP = 1 << 7
RSTRIP = 1 << 8

# GGUF tokenizer.ggml.token_type value (the index) -> attributes; anything else (0 included) is
# "undefined" (0).
_TYPE_TO_ATTR = np.array([0, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE])

SPM, BPE = "spm", "bpe"
_MODEL_TYPES = {"llama": SPM, "gpt2": BPE}

_P = "tokenizer.ggml."
# Special-token roles in the order llama.cpp reads them; (metadata key, role).
_ID_KEYS = (
    ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"),
    ("eom_token_id", "eom"), ("unknown_token_id", "unk"), ("seperator_token_id", "sep"),
    ("padding_token_id", "pad"), ("mask_token_id", "mask"),
    ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"),
    ("fim_mid_token_id", "fim_mid"), ("fim_pad_token_id", "fim_pad"),
    ("fim_rep_token_id", "fim_rep"), ("fim_sep_token_id", "fim_sep"),
    ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"),
    ("middle_token_id", "fim_mid"),
)  # fmt: skip
_DEFAULT_IDS = {SPM: {"bos": 1, "eos": 2, "unk": 0}, BPE: {"bos": 11, "eos": 11}}

# Roles llama.cpp fills by token text when the file leaves them unset; such a token also
# becomes a control token.
_ROLE_TEXTS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
# Tokens that end generation, by text (llama.cpp's list); also forced to control.
_EOG_TEXTS = frozenset(
    ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
     "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
     "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
     "<｜end▁of▁sentence｜>", "[e~[")
)  # fmt: skip
# gpt-oss's structural tokens always render, so llama.cpp makes them user-defined.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass
class Vocab:
    path: Path
    kind: str  # SPM or BPE
    pre: PreType | None  # the BPE word splitter (tokenizer.ggml.pre); None for SPM
    tokens: list[str]
    scores: list[float]
    attrs: list[int]
    token_to_id: dict[str, int]
    merges: list[str]
    ids: dict[str, int | None]  # special-token role -> id (None = the model has none)
    eog_ids: set[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    # Control, user-defined and unknown tokens, longest text (in UTF-8 bytes) first: the order
    # in which llama.cpp splits them out of raw text.
    special_ids: list[int] = field(default_factory=list)

    @property
    def bos_id(self) -> int | None:
        return self.ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.ids["eos"]

    @classmethod
    def from_metadata(cls, md: dict[str, Any], path: Path) -> Vocab:
        model = md.get(_P + "model")
        kind = _MODEL_TYPES.get(model)
        if kind is None:
            raise GGUFError(path, f"{_P}model: tokenizer {model!r} not supported (llama, gpt2 are)")
        # Per-token work is done by builtins and numpy, not Python loops: a 262k-token
        # vocabulary (Gemma 3's) is built at every start-up.
        tokens = list(_array(md, path, "tokens"))
        n = len(tokens)
        if "" in tokens:  # llama.cpp renames empty tokens so every text stays unique
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        token_to_id = dict(zip(tokens, range(n), strict=True))
        if len(token_to_id) != n:
            raise GGUFError(path, f"{_P}tokens: duplicate token texts")
        scores = _per_token(md, path, "scores", n, 0.0)
        types = np.asarray(_per_token(md, path, "token_type", n, 1), dtype=np.int64)
        known = (types >= 0) & (types < len(_TYPE_TO_ATTR))
        attrs = _TYPE_TO_ATTR[np.where(known, types, 0)].tolist()  # unknown types -> entry 0
        merges = list(_array(md, path, "merges")) if kind == BPE else []

        pre = pre_type(md.get(_P + "pre") or "") if kind == BPE else None
        add_bos, add_space_prefix = (True, True) if kind == SPM else (pre.add_bos, False)
        if kind == SPM:
            add_space_prefix = bool(md.get(_P + "add_space_prefix", add_space_prefix))

        ids = _special_ids(md, kind, n)
        add_bos = bool(md.get(_P + "add_bos_token", add_bos))
        add_eos = bool(md.get(_P + "add_eos_token", False))

        vocab = cls(path, kind, pre, tokens, list(map(float, scores)), attrs, token_to_id,
                    merges, ids, set(), add_bos, add_eos, add_space_prefix)  # fmt: skip
        vocab._apply_fixups(md)
        if vocab.add_bos and vocab.bos_id is None:
            raise GGUFError(path, f"{_P}add_bos_token is set but the model has no BOS token")
        return vocab

    def _apply_fixups(self, md: dict[str, Any]) -> None:
        attrs, t2i, ids = self.attrs, self.token_to_id, self.ids
        for role, texts in _ROLE_TEXTS.items():
            if ids[role] is None:
                found = [t2i[t] for t in texts if t in t2i]
                if found:
                    ids[role] = min(found)
                    for i in found:
                        attrs[i] |= CONTROL
        for i in np.flatnonzero(np.asarray(attrs) & CONTROL).tolist():
            if "unused" in self.tokens[i]:
                attrs[i] |= UNUSED
        eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if ids[r] is not None}
        for text in _EOG_TEXTS & t2i.keys():
            eog.add(t2i[text])
            attrs[t2i[text]] |= CONTROL
        for text in _ALWAYS_RENDERED:
            if text in t2i:
                attrs[t2i[text]] = USER_DEFINED
        eog |= {ids[r] for r in ("eos", "eot", "eom") if ids[r] is not None}
        texts = {self.tokens[i]: i for i in eog}
        end = texts.get("<|end|>")
        if end is not None and (
            ("<|return|>" in texts and "<|call|>" in texts)
            or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)
        ):
            eog.discard(end)
            attrs[end] = USER_DEFINED
        s = texts.get("</s>")
        if s is not None and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(s)
            attrs[s] = NORMAL
        self.eog_ids = eog

        special = np.flatnonzero(np.asarray(attrs) & (CONTROL | USER_DEFINED | UNKNOWN)).tolist()
        special.sort(key=lambda i: -len(self.tokens[i].encode()))
        self.special_ids = special
        # Phi-3's special tokens eat the whitespace after them (llama.cpp keys this on the name).
        name = str(md.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            for i in [*special, t2i.get("</s>")]:
                if i is not None:
                    attrs[i] |= RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in t2i:
                    attrs[t2i[text]] &= ~RSTRIP


def _array(md: dict[str, Any], path: Path, name: str) -> list[str]:
    value = md.get(_P + name)
    if not isinstance(value, list) or not set(map(type, value)) <= {str}:
        raise GGUFError(path, f"{_P}{name}: missing or not an array of strings")
    return value


def _per_token(md: dict[str, Any], path: Path, name: str, n: int, default):
    value = md.get(_P + name)
    if value is None:
        return [default] * n
    if len(value) < n:
        raise GGUFError(path, f"{_P}{name}: {len(value)} entries for {n} tokens")
    return value[:n].tolist() if hasattr(value, "tolist") else list(value[:n])


def bos_eos_ids(md: dict[str, Any]) -> tuple[int | None, int | None]:
    """The BOS and EOS ids llama.cpp uses, without building the vocabulary."""
    kind = _MODEL_TYPES.get(md.get(_P + "model"))
    tokens = md.get(_P + "tokens")
    if kind is None or not isinstance(tokens, list):
        return None, None
    ids = _special_ids(md, kind, len(tokens))
    return ids["bos"], ids["eos"]


def _special_ids(md: dict[str, Any], kind: str, n: int) -> dict[str, int | None]:
    ids: dict[str, int | None] = {role: None for _, role in _ID_KEYS}
    for role, default in _DEFAULT_IDS[kind].items():
        ids[role] = default if default < n else None
    for key, role in _ID_KEYS:
        value = md.get(_P + key)
        # llama.cpp ignores an out-of-range id (keeping the default) rather than failing.
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
            ids[role] = value
    return ids
