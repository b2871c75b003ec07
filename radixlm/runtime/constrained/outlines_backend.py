r"""The outlines-core grammar backend: a constraint becomes one regex, then a token-level index.

- json_schema → outlines-core's schema-to-regex; regex → as given; choices → an alternation of
  escaped strings; ebnf is not a regular language, so it needs the xgrammar backend.
- The token index (outlines-core's ``Index``, a DFA over token ids) is built against our own
  :class:`TokenizerVocab`: special and added tokens (``b""``) are left out of the vocabulary, so
  they are never allowed; every stop id is allowed exactly where the regex may end.
- outlines-core builds its DFA with leftmost-first match semantics: once an earlier alternative
  has matched at the end of the text, later ones are cut (``blue|bluebird`` refuses
  ``bluebird``, ``\d+|\d+\.\d+`` refuses ``1.5``). So the index is built for ``(?:R)`` followed
  by an end character (U+10FFFF) that no text token contains, and the stop ids are given that
  character's bytes: nothing matches before the end character, so no alternative is cut, and a
  stop token is allowed exactly where the text so far matches all of ``R``. Tokens holding the
  byte 0xF4 (the lead byte of U+100000..U+10FFFF, SmolLM2: one token) are left out so that no
  text token can start the end character: such characters cannot be generated.
- Jump-forward: outlines-core has no notion of forced text, so each grammar also holds a
  character-level FSM of the same regex (built with interegular). A matcher feeds the decoded
  characters of its accepted tokens through it; the forced text is the run of characters from
  the current state on where each state has exactly one live outgoing character and is not final.

outlines-core and interegular are imported lazily (when ``OutlinesBackend`` is built).
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.constrained.grammar import (
    CachedGrammarBackend,
    GrammarConfig,
    bitmask_width,
    mask_pointer,
)
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab

__all__ = [
    "CHAR_FSM_MAX_REGEX_LEN",
    "CharFSM",
    "OutlinesBackend",
    "OutlinesGrammar",
    "OutlinesMatcher",
    "choices_to_regex",
    "regex_unsupported_feature",
]

# interegular is pure Python and its FSM build grows fast with the regex (measured on
# JSONSchemaBench: docs/machines.md); past this length a grammar gets no character FSM, i.e. no
# forced text (masks are unaffected).
CHAR_FSM_MAX_REGEX_LEN = 6000
# Guide keeps one int per accepted token for rollback; no practical cap (like xgrammar's -1).
_MAX_ROLLBACK = 2**31 - 1
_END = "\U0010ffff"  # the end character the stop ids stand for in the index
_META = set("\\.+*?()|[]{}^$")


def choices_to_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of ``choices``, in a syntax both outlines-core and
    interegular read the same way (metacharacters escaped, control characters as ``\\xHH``)."""
    parts = []
    for c in choices:
        out = []
        for ch in c:
            if ch in _META:
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        parts.append("".join(out))
    return "(" + "|".join(parts) + ")"


def _strip_outer_anchors(regex: str) -> str:
    """Drop a leading ``^`` and an unescaped trailing ``$``: the whole text is matched anyway."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex[:-1]) - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            regex = regex[:-1]
    return regex


_GROUP_FEATURES = (
    ("(?<=", "lookbehind assertions (?<=...)"),
    ("(?<!", "lookbehind assertions (?<!...)"),
    ("(?=", "lookahead assertions (?=...)"),
    ("(?!", "lookahead assertions (?!...)"),
    ("(?P=", "backreferences (?P=name)"),
    ("(?>", "atomic groups (?>...)"),
    ("(?(", "conditional groups (?(...)...)"),
)
_ESCAPE_FEATURES = {
    "b": "word boundaries \\b",
    "B": "word boundaries \\B",
    "A": "anchors \\A",
    "z": "anchors \\z",
    "Z": "anchors \\Z",
    "G": "anchors \\G",
    "k": "backreferences \\k<name>",
    **{str(d): f"backreferences \\{d}" for d in range(1, 10)},
}


def regex_unsupported_feature(regex: str) -> str | None:
    """Name the first construct of ``regex`` that a DFA cannot express, or None.

    Outside character classes: lookaround, backreferences, atomic and conditional groups,
    possessive quantifiers, word boundaries and anchors other than a leading ``^`` / trailing
    ``$``."""
    i, n, in_class, after_quantifier = 0, len(regex), False, False
    while i < n:
        ch = regex[i]
        if ch == "\\":
            if not in_class and i + 1 < n and regex[i + 1] in _ESCAPE_FEATURES:
                return _ESCAPE_FEATURES[regex[i + 1]]
            i += 2
            after_quantifier = False
            continue
        if not in_class and ch == "+" and after_quantifier:
            return "possessive quantifiers (*+, ++, ?+, {n}+)"
        after_quantifier = not in_class and ch in "*+?}"
        if in_class:
            if ch == "]":
                in_class = False
        elif ch == "[":
            in_class = True
            # A "]" right after "[" or "[^" is a literal member, not the end of the class.
            j = i + 1 + (regex[i + 1 : i + 2] == "^")
            if regex[j : j + 1] == "]":
                i = j
        elif ch == "(":
            for prefix, feature in _GROUP_FEATURES:
                if regex.startswith(prefix, i):
                    return feature
        elif ch in "^$":
            if not ((ch == "^" and i == 0) or (ch == "$" and i == n - 1)):
                return f"anchors {ch} inside the pattern"
        i += 1
    return None


def _whitespace_pattern(config: GrammarConfig) -> str:
    """The whitespace regex outlines-core puts around JSON punctuation for this config."""
    if config.json_any_whitespace:
        return r"[ \n\t]*"
    if config.json_separators == (",", ":"):
        return ""
    if all(s.strip() in (",", ":") and set(s) <= set(", :") for s in config.json_separators):
        # outlines-core puts one pattern on both sides of every ",", ":" and bracket, so
        # spaced separators can only be allowed, not required.
        return "[ ]?"
    raise ValueError(
        f"the outlines backend supports compact, single-space or any-whitespace JSON, "
        f"not separators {config.json_separators!r}"
    )


def _first_line(err: BaseException, limit: int = 300) -> str:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return msg if len(msg) <= limit else msg[:limit] + "..."


class CharFSM:
    """A character-level DFA of a regex (from interegular) that reports forced text."""

    def __init__(self, fsm: Any) -> None:
        from interegular.fsm import anything_else

        self.initial: int = fsm.initial
        self._symbol_of: dict[str, int] = {ch: sym for ch, sym in fsm.alphabet.items() if ch is not anything_else}
        self._other: int | None = fsm.alphabet[anything_else]
        self._map: dict[int, dict[int, int]] = fsm.map
        self._finals = frozenset(fsm.finals)
        # Symbols that stand for exactly one character (anything_else stands for many).
        self._single: dict[int, str] = {
            sym: chars[0]
            for sym, chars in fsm.alphabet.by_transition.items()
            if len(chars) == 1 and chars[0] is not anything_else
        }
        self._live = self._live_states()
        self._forced: dict[int, str] = {}

    @classmethod
    def from_regex(cls, regex: str) -> CharFSM:
        """Parse ``regex`` with interegular; raises whatever interegular raises."""
        import interegular

        return cls(interegular.parse_pattern(regex).to_fsm())

    def _live_states(self) -> frozenset[int]:
        back: dict[int, list[int]] = {}
        for src, edges in self._map.items():
            for dst in edges.values():
                back.setdefault(dst, []).append(src)
        live, todo = set(self._finals), list(self._finals)
        while todo:
            for src in back.get(todo.pop(), ()):
                if src not in live:
                    live.add(src)
                    todo.append(src)
        return frozenset(live)

    def step(self, state: int | None, text: str) -> int | None:
        """The state after ``text``; None once the text left the regex (a dead state)."""
        for ch in text:
            if state is None:
                return None
            sym = self._symbol_of.get(ch, self._other)
            state = self._map.get(state, {}).get(sym) if sym is not None else None
            if state is not None and state not in self._live:
                state = None
        return state

    def forced(self, state: int | None) -> str:
        """The longest text every match must continue with from ``state``."""
        if state is None:
            return ""
        hit = self._forced.get(state)
        if hit is not None:
            return hit
        out: list[str] = []
        s = state
        # Terminates: a cycle of forced steps never reaches a final state, so it is not live.
        while s not in self._finals:
            edges = [(sym, dst) for sym, dst in self._map.get(s, {}).items() if dst in self._live]
            if len(edges) != 1 or edges[0][0] not in self._single:
                break
            out.append(self._single[edges[0][0]])
            s = edges[0][1]
        text = "".join(out)
        self._forced[state] = text  # a benign race: every thread computes the same value
        return text


def _set_bit(row: Any, token: int, on: bool) -> None:
    word, bit = divmod(token, 32)
    value = -(1 << 31) if bit == 31 else 1 << bit  # int32 two's complement for bit 31
    row[word] = int(row[word]) | value if on else int(row[word]) & ~value


class OutlinesGrammar:
    """A compiled constraint: the token index, plus a character FSM for forced text."""

    __slots__ = ("kind", "vocab_size", "regex", "index", "char_fsm", "char_fsm_error", "_vocab", "_oc")
    backend = "outlines"

    def __init__(self, kind: str, regex: str, index: Any, char_fsm: CharFSM | None,
                 char_fsm_error: str, vocab: TokenizerVocab, oc: Any) -> None:
        self.kind = kind
        self.vocab_size = vocab.vocab_size
        self.regex = regex
        self.index = index
        self.char_fsm = char_fsm
        self.char_fsm_error = char_fsm_error  # why char_fsm is None ("" when it is built)
        self._vocab = vocab
        self._oc = oc

    def new_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self, self._vocab, self._oc.Guide(self.index, max_rollback=_MAX_ROLLBACK))


class OutlinesMatcher:
    """One request's state: the token-index state (in a Guide), the character-FSM state and
    the bytes of a UTF-8 character split across tokens, with a history for rollback."""

    __slots__ = ("_g", "_vocab", "_guide", "_stops", "_char", "_pending", "_history", "_terminated")

    def __init__(self, grammar: OutlinesGrammar, vocab: TokenizerVocab, guide: Any) -> None:
        self._g = grammar
        self._vocab = vocab
        self._guide = guide
        self._stops = frozenset(vocab.stop_ids)
        self._char: int | None = grammar.char_fsm.initial if grammar.char_fsm else None
        self._pending = b""
        # Per accepted token: (was a stop token, char state before it, pending bytes before it).
        self._history: list[tuple[bool, int | None, bytes]] = []
        self._terminated = False

    @property
    def vocab_size(self) -> int:
        return self._vocab.vocab_size

    def fill_mask(self, bitmask_row: Any) -> bool:
        """Write the allowed next tokens into ``bitmask_row`` (1-D int32, CPU).

        Returns False when every token is allowed (the row need not be applied)."""
        width = bitmask_width(self.vocab_size)
        ptr = mask_pointer(bitmask_row, width)
        if self._terminated:
            bitmask_row[:] = 0
            for s in self._stops:
                _set_bit(bitmask_row, s, True)
            return True
        self._guide.write_mask_into(ptr, width, 4)
        if not self.is_completed():
            # A regex that allows U+10FFFF as text lets the end character through mid-text.
            for s in self._stops:
                _set_bit(bitmask_row, s, False)
        return not bool((bitmask_row == -1).all())

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        token = int(token)
        if self._terminated or not 0 <= token < self.vocab_size:
            return False
        if token in self._stops:
            if not self.is_completed():
                return False
            self._history.append((True, self._char, self._pending))
            self._terminated = True
            return True
        if self._g.index.get_next_state(self._guide.get_state(), token) is None:
            return False
        self._guide.advance(token, return_tokens=False)
        self._history.append((False, self._char, self._pending))
        self._advance_chars(self._vocab.decoded[token])
        return True

    def _advance_chars(self, data: bytes) -> None:
        fsm = self._g.char_fsm
        if fsm is None or self._char is None:
            return
        buf = self._pending + data
        # Keep a UTF-8 character whose bytes continue in the next token for later.
        cut = len(buf)
        for back in range(1, min(4, len(buf)) + 1):
            b = buf[-back]
            if b & 0xC0 != 0x80:  # the lead byte of the last character
                need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
                if need > back:
                    cut = len(buf) - back
                break
        self._pending = buf[cut:]
        self._char = fsm.step(self._char, buf[:cut].decode("utf-8", errors="replace"))

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n < 0:
            raise ValueError(f"rollback count must be >= 0, got {n}")
        if n > len(self._history):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self._history)} accepted")
        if n == 0:
            return
        undone = self._history[-n:]
        del self._history[-n:]
        tokens = sum(1 for was_stop, _, _ in undone if not was_stop)
        if tokens:
            self._guide.rollback_state(tokens)
        self._terminated = False
        _, self._char, self._pending = undone[0]

    def forced_text(self, max_chars: int | None = None) -> str:
        """The text the grammar forces next ('' when the next character is a choice, inside a
        split UTF-8 character, or when this grammar has no character FSM), at most ``max_chars``."""
        fsm = self._g.char_fsm
        if fsm is None or self._terminated or self._pending:
            return ""
        text = fsm.forced(self._char)
        return text if max_chars is None else text[:max_chars]

    def is_completed(self) -> bool:
        """True once the text so far is a complete match (a stop token may follow)."""
        if self._terminated:
            return True
        index = self._g.index
        end = index.get_next_state(self._guide.get_state(), self._vocab.stop_ids[0])
        return end is not None and bool(index.is_final_state(end))

    def is_terminated(self) -> bool:
        """True once a stop token was accepted at a point where the grammar may end."""
        return self._terminated


class OutlinesBackend(CachedGrammarBackend):
    """Compiles constraints with outlines-core against a :class:`TokenizerVocab`. Thread-safe:
    the vocabulary and compiled indexes are read-only; each matcher owns its Guide."""

    name = "outlines"

    def __init__(self, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> None:
        import outlines_core  # lazy: only when this backend is picked

        super().__init__(vocab, config)
        self._oc = outlines_core
        self._whitespace = _whitespace_pattern(self.config)
        stops = set(vocab.stop_ids)
        end = _END.encode()
        by_bytes: dict[bytes, list[int]] = {end: sorted(stops)}
        for i, b in enumerate(vocab.decoded):
            if b and i not in stops and end[:1] not in b:
                by_bytes.setdefault(b, []).append(i)
        # outlines-core wants an EOS id outside the map; it is only allowed after the end
        # character, where a matcher never goes, so any never-allowed special id will do.
        spare = sorted(vocab.special_ids - stops)
        if not spare:
            raise ValueError("the outlines backend needs one special token id that is not a stop id")
        self._vocabulary = outlines_core.Vocabulary(spare[0], by_bytes)

    def to_regex(self, kind: str, norm: Any) -> str:
        """The regex a normalized spec compiles to (ValueError when there is none)."""
        if kind == "ebnf":
            raise ValueError("cannot compile ebnf: ebnf needs the xgrammar backend")
        if kind == "structural_tag":
            raise ValueError("cannot compile structural_tag: the outlines grammar backend cannot enforce it "
                             "(free text around tagged JSON); serve with --grammar-backend llguidance or xgrammar")
        if kind == "choices":
            return choices_to_regex(norm)
        if kind == "regex":
            return _strip_outer_anchors(norm)
        try:
            regex: str = self._oc.json_schema.build_regex_from_schema(norm, self._whitespace)
            return regex
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"cannot compile json_schema: {_first_line(e)}") from None

    def _compile_uncached(self, kind: str, norm: Any) -> OutlinesGrammar:
        regex = self.to_regex(kind, norm)
        feature = regex_unsupported_feature(regex)
        if feature:
            raise ValueError(f"cannot compile {kind}: {feature} are not supported by the outlines backend")
        try:
            index = self._oc.Index(f"(?:{regex})\\x{{10FFFF}}", self._vocabulary)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"cannot compile {kind}: {_first_line(e)}") from None
        char_fsm, error = None, ""
        if len(regex) > CHAR_FSM_MAX_REGEX_LEN:
            error = f"regex longer than {CHAR_FSM_MAX_REGEX_LEN} characters"
        else:
            try:
                char_fsm = CharFSM.from_regex(regex)
            except Exception as e:  # any interegular failure only turns forced text off
                error = f"interegular: {type(e).__name__}: {_first_line(e)}"
        return OutlinesGrammar(kind, regex, index, char_fsm, error, self.vocab, self._oc)
