"""The server process's tokenizer: prompts to token ids, chat templates, token texts for logprobs."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from radixlm.runtime.chat_template import check_plain_spans, encode_with_plain_spans, from_tokenizer
from radixlm.runtime.constrained.pre_tokens import split_rule
from radixlm.runtime.constrained.service import text_encoder
from radixlm.runtime.constrained.tokenizer_info import byte_level_decoder
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.prefix_tokenizer import PrefixTokenizer
from radixlm.runtime.tokenizer_loader import import_tokenizer_code, load_tokenizer
from radixlm.runtime.tokenizer_lock import encoding_lock

_TOKEN_TEXT_CACHE = 65536
# Stands in for a message's content while the chat template renders (then split out again).
_MARK_PREFIX = "\x00radixlm-content-"
_MARK = _MARK_PREFIX + "{}\x00"
_MARK_SPLIT = re.compile("\x00radixlm-content-(\\d+)\x00")
# Texts a PrefixTokenizer must tokenize as the tokenizer does whole, grown a piece at a time,
# before programs get one (the special tokens' texts are added to them).
_GROWING_PROBES = ('{"name":"Alice Martin","age":34} It\'s 12:30 -- they\'ll see\tyou. ',
                   "na\u00efve caf\u00e9, \u6771\u4eac x2 \U0001F600! don't 'quote' O'Neil's\n\n  a {b} ")


class ServerTokenizer:
    """Wraps a transformers tokenizer with the checks the API boundary needs."""

    def __init__(self, tokenizer: Any, context_length: int, vocab_size: int) -> None:
        self.tok = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self._texts: dict[int, str] = {}
        self._markers: dict[str, Any] | None = None
        # calls from the event loop and from worker threads (long bodies) take turns (tokenizer_lock)
        self._encoding = encoding_lock(tokenizer)
        # Text longer than this cannot fit the context (no token spells more characters than the
        # longest vocabulary entry): refused before it is tokenized.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if hasattr(tokenizer, "get_vocab") else 64
        self.max_text_chars = context_length * max(longest, 1)
        self.special_in_content = False  # --special-tokens-in-content: the old behaviour (role injection)
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_texts = tuple(sorted({t.content for t in decoder.values() if getattr(t, "special", False)}
                                          | set(getattr(tokenizer, "all_special_tokens", []) or [])))

    @staticmethod
    def import_code() -> None:
        """Import what ``load`` needs, ahead of knowing the tokenizer's directory."""
        import_tokenizer_code()

    @classmethod
    def load(cls, info: Mapping[str, Any]) -> ServerTokenizer:
        tok = load_tokenizer(info["tokenizer_path"])
        return cls(tok, int(info["context_length"]), int(info["vocab_size"]))

    # -- prompts ------------------------------------------------------------------------
    def check_text_size(self, text: str, param: str) -> None:
        """A text too long to fit the context whatever its tokens: 400 before tokenizing it."""
        if len(text) > self.max_text_chars:
            raise ApiError(400, f"{param} has {len(text):,} characters, more than any prompt of "
                                f"{self.context_length} tokens can hold ({self.max_text_chars:,}); shorten it",
                           param=param)

    def encode_text(self, text: str, param: str, plain_spans: Any = None,
                    prefix: PrefixTokenizer | None = None) -> list[int]:
        """Tokenize a prompt; ``plain_spans`` ([[start, end], ...] character ranges, radixlm's
        extension the DSL sends for message contents) are plain text, never control tokens,
        unless the server keeps special tokens in content (--special-tokens-in-content).
        ``prefix``: a program's PrefixTokenizer (the same ids, from its texts tokenized before)."""
        self.check_text_size(text, param)
        if plain_spans is None or self.special_in_content:
            if prefix is not None:
                ids = prefix.encode(text)
            else:
                with self._encoding:
                    ids = list(self.tok.encode(text))
        else:
            try:
                spans = check_plain_spans(plain_spans, len(text))
            except ValueError as e:
                raise ApiError(400, str(e), param="plain_text_spans") from None
            ids = encode_with_plain_spans(self.tok, text, spans)  # (under the tokenizer's lock)
        self.check_prompt(ids, param)
        return ids

    def prefix_tokenizer(self) -> PrefixTokenizer | None:
        """A fresh PrefixTokenizer for a server-run program, or None where this tokenizer has no
        split rule or fails the checks (every text is then tokenized whole)."""
        parts = self._prefix_parts
        return None if parts is None else PrefixTokenizer(*parts)

    @functools.cached_property
    def _prefix_parts(self) -> tuple[Any, list[int], Any, list[bytes]] | None:
        """What a PrefixTokenizer is made of, for a byte-level BPE tokenizer whose split rule holds
        and whose ids it reproduces on growing probe texts; else None. (Worked out once, ~0.2 s.)"""
        rust = getattr(self.tok, "_tokenizer", None)
        if rust is None or not hasattr(rust, "to_str"):
            return None
        added = getattr(self.tok, "added_tokens_decoder", {}) or {}
        if any(getattr(t, a, False) for t in added.values() for a in ("lstrip", "rstrip", "normalized", "single_word")):
            return None  # an added token that takes in the text around it

        # A Rust tokenizer of its own (the one jump-forward uses): the transformers wrapper sets its
        # shared one's encode_special_tokens for each call (split_special_tokens=True for plain-text
        # spans) and leaves it so, which would turn the role markers of the next texts into characters.
        encode = text_encoder(self.tok, rust.to_str())
        # (the rule reads these two parts only: the whole tokenizer's JSON takes ~0.15 s to parse)
        parts_json = [f'"{name}": {part.__getstate__().decode() if part is not None else "null"}'
                      for name, part in (("normalizer", rust.normalizer), ("pre_tokenizer", rust.pre_tokenizer))]
        split = split_rule("{" + ", ".join(parts_json) + "}", encode)
        if split is None:
            return None
        alphabet = frozenset(byte_level_decoder())
        vocab = rust.get_vocab(with_added_tokens=True)
        size = max(self.vocab_size, max(vocab.values(), default=0) + 1)
        token_bytes = [0] * size
        for piece, i in vocab.items():
            if i in added:
                token_bytes[i] = len(added[i].content.encode("utf-8"))
            elif alphabet.issuperset(piece):
                token_bytes[i] = len(piece)  # (one byte a character of the byte-level alphabet)
            else:
                return None  # not a byte-level vocabulary
        specials = [t.content.encode("utf-8") for t in added.values()]
        parts = (encode, token_bytes, split, specials)
        marks = [t.content for t in list(added.values())[:4]]
        probes = [p + "".join(f"a{m} b{m}\n" for m in marks) + p for p in _GROWING_PROBES]
        for probe in probes:
            with self._encoding:
                whole = list(self.tok.encode(probe))
            if whole != encode(probe):
                return None  # the tokenizer adds ids of its own
            growing = PrefixTokenizer(*parts)
            if any(growing.encode(probe[:n]) != encode(probe[:n]) for n in range(1, len(probe) + 1, 3)):
                return None
        return parts

    def encode_content(self, text: str) -> list[int]:
        """Message content as plain text: special-token text in it is characters, never a control token."""
        with self._encoding:
            return list(self.tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], param: str = "messages",
                    special_in_content: bool | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Apply the model's chat template with the assistant's turn opened, then tokenize;
        ``tools`` (OpenAI's function declarations) go to templates that render them.

        Message content is text: special-token text in it (``<|im_end|>``) is tokenized as plain
        characters, never as the control token (role injection), unless ``special_in_content``."""
        if getattr(self.tok, "chat_template", None) is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions with a prompt", param=param)
        self.check_text_size("".join(str(m.get("content") or "") for m in messages), param)
        if special_in_content is None:
            special_in_content = self.special_in_content
        marked = {} if special_in_content else self._content_with_special_text(messages)
        rendered = [dict(m, content=_MARK.format(i)) if i in marked else dict(m) for i, m in enumerate(messages)]
        try:
            extra = {"tools": tools} if tools else {}
            text = self.tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as e:  # noqa: BLE001 - jinja raises its own errors for messages a template rejects
            raise ApiError(400, f"the chat template rejected the messages: {e}", param=param) from None
        ids: list[int] = []
        with self._encoding:
            for j, piece in enumerate(_MARK_SPLIT.split(text)):
                if j % 2 == 0:  # the template's own text: its special tokens are control tokens
                    ids += self.tok.encode(piece, add_special_tokens=False) if piece else []
                else:  # a message's content, as plain text
                    ids += self.encode_content(marked[int(piece)])  # (the lock is re-entrant)
        self.check_prompt(ids, param)
        return ids

    def _content_with_special_text(self, messages: Sequence[Mapping[str, Any]]) -> dict[int, str]:
        """Index -> content of the messages whose content holds a special token's text."""
        out: dict[int, str] = {}
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, str) and (_MARK_PREFIX in content or any(s in content for s in self.special_texts)):
                out[i] = content
        return out

    def check_prompt(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param} is empty; give at least one token", param=param)
        if len(ids) >= self.context_length:
            raise ApiError(
                400,
                f"{param} has {len(ids)} tokens, more than fits the context length of {self.context_length} "
                "tokens (the output needs at least one); shorten it",
                param=param,
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{param} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                           param=param)

    def check_token_params(self, params: SamplingParams, prefix: str = "") -> None:
        """The token ids of stop_token_ids and logit_bias inside the vocabulary: else a 400 whose
        ``param`` is ``prefix`` + the field (``sampling_params.logit_bias`` on /generate)."""
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"{prefix}{name} holds token id {bad}, outside the vocabulary [0, "
                                    f"{self.vocab_size})", param=prefix + name)

    # -- outputs ------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """One token on its own, as text (a partial UTF-8 character decodes to U+FFFD)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self._texts) >= _TOKEN_TEXT_CACHE:
                self._texts.clear()
            self._texts[token_id] = text
        return text

    # -- tokenizer facts (/get_model_info, /tokenize, /detokenize) --------------------------
    def encode_plain(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of ``text`` with no prompt checks but its size (/tokenize counts, it does not generate)."""
        self.check_text_size(text, param)
        with self._encoding:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode_plain(self, ids: Sequence[int], skip_special_tokens: bool, param: str) -> str:
        """Text of ``ids``; an id outside the vocabulary is a 400 naming ``param``."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{param} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                           param=param)
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def chat_template_text(self) -> str | None:
        """The model's own Jinja chat template (None when the tokenizer has none)."""
        template = getattr(self.tok, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def special_tokens(self) -> dict[str, Any]:
        """bos/eos/pad/unk token texts and ids, and whether encoding a text adds BOS by itself."""
        out: dict[str, Any] = {}
        for kind in ("bos", "eos", "pad", "unk"):
            out[f"{kind}_token"] = getattr(self.tok, f"{kind}_token", None)
            out[f"{kind}_token_id"] = getattr(self.tok, f"{kind}_token_id", None)
        with self._encoding:
            ids = self.tok.encode("x")
        out["add_bos_token"] = bool(out["bos_token_id"] is not None and ids and ids[0] == out["bos_token_id"])
        out["all_special_tokens"] = list(getattr(self.tok, "all_special_tokens", []))
        return out

    def role_markers(self) -> dict[str, Any]:
        """The DSL's role markers (radixlm.runtime.chat_template), probed from this tokenizer
        exactly as the in-process Engine backend does, so RuntimeEndpoint formats roles identically."""
        if self._markers is None:
            with self._encoding:
                self._markers = from_tokenizer(self.tok).to_dict()
        return self._markers

    @property
    def chat_template_name(self) -> str | None:
        """A family name for the chat template (what SGLang's get_model_info reports)."""
        template = getattr(self.tok, "chat_template", None)
        if not template:
            return None
        if not isinstance(template, str):
            return "custom"
        for marker, name in (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama-3"),
                             ("[INST]", "llama-2"), ("<start_of_turn>", "gemma")):
            if marker in template:
                return name
        return "custom"
