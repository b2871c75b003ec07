"""Role markers for system/user/assistant, derived from the model's own chat template.

The tokenizer's Jinja template is rendered on probe conversations and the text around a marker
gives each role's prefix and suffix, plus any default system message the template inserts when
a conversation starts without one (SmolLM2 does). A leading BOS token is left out when the
tokenizer adds one itself as it encodes the prompt. Without a usable template the fallback is
``FALLBACK`` ("SYSTEM: ...", "USER: ...", "ASSISTANT: ...", one message per line).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.tokenizer_lock import encoding_lock

_MARK = "\x00{}\x00"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """Prefix and suffix per role, and the text a conversation gets before a first non-system role."""

    name: str
    prefix: dict[str, str]
    suffix: dict[str, str]
    default_system: str = ""
    special_texts: tuple[str, ...] = ()  # the tokenizer's special-token texts ("<|im_end|>", ...)

    def holds_special(self, text: str) -> bool:
        """Whether ``text`` contains a special token's text (it would tokenize to a control token)."""
        return any(s in text for s in self.special_texts)

    def begin(self, role: str, at_start: bool) -> str:
        """Text that opens a ``role`` message; ``at_start``: nothing precedes it in the state."""
        lead = self.default_system if at_start and role != "system" else ""
        return lead + self.prefix[role]

    def end(self, role: str) -> str:
        return self.suffix[role]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (a server's ``/get_model_info`` ``role_markers``)."""
        return {"name": self.name, "prefix": dict(self.prefix), "suffix": dict(self.suffix),
                "default_system": self.default_system, "special_texts": list(self.special_texts)}

    @classmethod
    def from_dict(cls, data: Any) -> ChatTemplate:
        """Inverse of to_dict; ValueError naming what is wrong when ``data`` is malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"role markers must be an object, got {type(data).__name__}")
        problems = []
        for key in ("prefix", "suffix"):
            part = data.get(key)
            if not isinstance(part, dict) or not all(isinstance(part.get(r), str) for r in ROLES):
                problems.append(f"{key} must map each of {', '.join(ROLES)} to a string")
        if not isinstance(data.get("default_system", ""), str):
            problems.append("default_system must be a string")
        specials = data.get("special_texts", [])
        if not isinstance(specials, list) or not all(isinstance(t, str) and t for t in specials):
            problems.append("special_texts must be a list of non-empty strings")
        if problems:
            raise ValueError("invalid role markers: " + "; ".join(problems))
        return cls(name=str(data.get("name") or "server"),
                   prefix={r: data["prefix"][r] for r in ROLES}, suffix={r: data["suffix"][r] for r in ROLES},
                   default_system=data.get("default_system", ""), special_texts=tuple(specials))


FALLBACK = ChatTemplate(
    name="fallback",
    prefix={"system": "SYSTEM: ", "user": "USER: ", "assistant": "ASSISTANT: "},
    suffix={"system": "\n", "user": "\n", "assistant": "\n"},
)


def from_tokenizer(tokenizer: Any) -> ChatTemplate:
    """The template of a Hugging Face tokenizer, or FALLBACK when it has none or it cannot be probed."""
    specials = special_texts(tokenizer)
    fallback = dataclasses.replace(FALLBACK, special_texts=specials) if specials else FALLBACK
    if not getattr(tokenizer, "chat_template", None):
        return fallback
    try:
        return _probe(tokenizer)
    except Exception:  # noqa: BLE001 - templates that reject the probe conversations fall back
        return fallback


def _probe(tokenizer: Any) -> ChatTemplate:
    bos = tokenizer.bos_token or ""
    ids = tokenizer.encode("x")
    if not (bos and ids and ids[0] == tokenizer.bos_token_id):
        bos = ""  # the tokenizer does not add it, so the template's own BOS text stays

    def render(messages: list[dict[str, str]]) -> str:
        text: str = tokenizer.apply_chat_template(messages, tokenize=False)
        return text[len(bos):] if bos and text.startswith(bos) else text

    sys_msg = {"role": "system", "content": _MARK.format("s")}
    usr_msg = {"role": "user", "content": _MARK.format("u")}
    asst_msg = {"role": "assistant", "content": _MARK.format("a")}
    one = render([sys_msg])
    two = render([sys_msg, usr_msg])
    three = render([sys_msg, usr_msg, asst_msg])
    if not (two.startswith(one) and three.startswith(two)):
        raise ValueError("the template does not render conversations incrementally")
    prefix, suffix = {}, {}
    for role, text in (("system", one), ("user", two[len(one):]), ("assistant", three[len(two):])):
        before, _, after = text.partition(_MARK.format(role[0]))
        if not after and not text.endswith(_MARK.format(role[0])):
            raise ValueError(f"the {role} marker is missing from the rendered template")
        prefix[role], suffix[role] = before, after
    user_only = render([usr_msg])
    marker_at = user_only.index(prefix["user"] + _MARK.format("u"))
    return ChatTemplate(name=getattr(tokenizer, "name_or_path", "") or "tokenizer",
                        prefix=prefix, suffix=suffix, default_system=user_only[:marker_at],
                        special_texts=special_texts(tokenizer))


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts that a tokenizer turns into special (control) tokens."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts.update(t.content for t in decoder.values() if getattr(t, "special", False))
    return tuple(sorted(t for t in texts if t))


def encode_with_plain_spans(tokenizer: Any, text: str, plain_spans: Sequence[tuple[int, int]]) -> list[int]:
    """Token ids of ``text`` where the characters in ``plain_spans`` (sorted, disjoint
    [start, end) ranges: message contents) are plain text, never control tokens, while the
    rest (role markers) keeps its special tokens. With no spans this is ``tokenizer.encode``."""
    with encoding_lock(tokenizer):  # (the plain spans' encodes set a flag other encodes read)
        if not plain_spans:
            return list(tokenizer.encode(text))
        ids: list[int] = list(tokenizer.encode(""))  # BOS where the tokenizer adds one by itself
        at = 0
        for start, end in plain_spans:
            if start > at:
                ids += tokenizer.encode(text[at:start], add_special_tokens=False)
            ids += tokenizer.encode(text[start:end], add_special_tokens=False, split_special_tokens=True)
            at = end
        if at < len(text):
            ids += tokenizer.encode(text[at:], add_special_tokens=False)
        return ids


def check_plain_spans(spans: Any, text_len: int) -> list[tuple[int, int]]:
    """Validate [[start, end], ...] character ranges of a text: sorted, disjoint, inside it.
    ValueError saying what is wrong otherwise."""
    if not isinstance(spans, list):
        raise ValueError("plain_text_spans must be a list of [start, end] character ranges")
    out: list[tuple[int, int]] = []
    at = 0
    for i, span in enumerate(spans):
        ok = (isinstance(span, list) and len(span) == 2
              and all(type(v) is int for v in span))  # noqa: E721 - bool is not a position
        if not ok:
            raise ValueError(f"plain_text_spans[{i}] must be [start, end], two integers")
        start, end = span
        if not at <= start <= end <= text_len:
            raise ValueError(f"plain_text_spans[{i}] = {span} must be sorted, disjoint ranges within the text "
                             f"(0..{text_len})")
        out.append((start, end))
        at = end
    return out
