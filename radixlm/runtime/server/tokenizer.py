"""The server process's tokenizer: prompts to token ids, chat templates, token texts for logprobs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from radixlm.runtime.server.errors import ApiError

_TOKEN_TEXT_CACHE = 65536


class ServerTokenizer:
    """Wraps a transformers tokenizer with the checks the API boundary needs."""

    def __init__(self, tokenizer: Any, context_length: int, vocab_size: int) -> None:
        self.tok = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self._texts: dict[int, str] = {}
        self._markers: dict[str, Any] | None = None

    @classmethod
    def load(cls, info: Mapping[str, Any]) -> ServerTokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
        return cls(tok, int(info["context_length"]), int(info["vocab_size"]))

    # -- prompts ------------------------------------------------------------------------
    def encode_text(self, text: str, param: str) -> list[int]:
        ids = list(self.tok.encode(text))
        self.check_prompt(ids, param)
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], param: str = "messages") -> list[int]:
        """Apply the model's chat template with the assistant's turn opened, then tokenize."""
        if getattr(self.tok, "chat_template", None) is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions with a prompt", param=param)
        try:
            text = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja raises its own errors for messages a template rejects
            raise ApiError(400, f"the chat template rejected the messages: {e}", param=param) from None
        ids = list(self.tok.encode(text, add_special_tokens=False))
        self.check_prompt(ids, param)
        return ids

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

    # -- outputs ------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

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
    def encode_plain(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` with no prompt checks (/tokenize counts, it does not generate)."""
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode_plain(self, ids: Sequence[int], skip_special_tokens: bool, param: str) -> str:
        """Text of ``ids``; an id outside the vocabulary is a 400 naming ``param``."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{param} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                           param=param)
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
        ids = self.tok.encode("x")
        out["add_bos_token"] = bool(out["bos_token_id"] is not None and ids and ids[0] == out["bos_token_id"])
        out["all_special_tokens"] = list(getattr(self.tok, "all_special_tokens", []))
        return out

    def role_markers(self) -> dict[str, Any]:
        """The DSL's role markers (radixlm.lang.frontend.chat_template), probed from this tokenizer
        exactly as the in-process Engine backend does, so RuntimeEndpoint formats roles identically."""
        if self._markers is None:
            from radixlm.lang.frontend.chat_template import from_tokenizer

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
