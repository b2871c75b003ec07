"""IncrementalDetokenizer on the default byte-level BPE tokenizer and a sentencepiece-style one."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? Grüße, naïve façade",
    "你好世界，今天天气很好。",
    "日本語のテキストと한국어 텍스트",
    "family 👩‍👩‍👧 and flags 🇫🇷🇯🇵 and 👍🏽 thumbs",
    "🇫🇷",
    "👩‍👩‍👧",
    "def f(x):\n    if x:\n\t\treturn    x  \n\n\n    # trailing   \n",
    "   leading spaces and trailing   ",
    "mixed: a😀b你c\u00e9d\u200de",
    "Ω≈ç√∫˜µ≤≥÷ ∑∏π 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, sizes=(1,), **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Push ids in chunks of the given sizes (cycled); return every push's text plus flush's."""
    d = IncrementalDetokenizer(tok, **kwargs)
    chunks = []
    i = k = 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        chunks.append(d.push(ids[i : i + n]))
        i += n
        k += 1
    chunks.append(d.flush())
    return chunks, d


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("sizes", [(1,), (2,), (3, 1, 2), (1000,)])
def test_round_trip(smol_tokenizer, text, sizes):
    ids = encode(smol_tokenizer, text)
    chunks, d = stream(smol_tokenizer, ids, sizes)
    assert "".join(chunks) == smol_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT not in c for c in chunks)
    assert d.text == text
    assert d.output_ids == ids


def test_multibyte_character_is_held_until_its_last_byte(smol_tokenizer):
    ids = encode(smol_tokenizer, "🇫🇷!")
    assert len(ids) > 3  # each flag letter spans several byte tokens
    d = IncrementalDetokenizer(smol_tokenizer)
    emitted = [d.push([t]) for t in ids]
    # Chunks hold whole characters only, in order, each as soon as its last byte arrives.
    assert [c for c in emitted if c] == ["🇫", "🇷", "!"]
    assert emitted[-1] == "!"
    assert d.flush() == ""


def test_flush_emits_an_incomplete_character_as_decode_does(smol_tokenizer):
    ids = encode(smol_tokenizer, "ok 你")[:-1]  # drop the last byte of 你
    d = IncrementalDetokenizer(smol_tokenizer)
    pushed = "".join(d.push([t]) for t in ids)
    assert REPLACEMENT not in pushed
    tail = d.flush()
    assert pushed + tail == smol_tokenizer.decode(ids)
    assert tail.endswith(REPLACEMENT)


def test_invalid_bytes_match_decode_and_keep_the_window_small(smol_tokenizer):
    lone = encode(smol_tokenizer, "你")[-1]  # a continuation byte on its own: invalid UTF-8
    assert smol_tokenizer.decode([lone]) == REPLACEMENT
    text_ids = encode(smol_tokenizer, "fine 😀 text")
    ids = [lone] * 40 + text_ids + [lone] * 25 + text_ids
    counter = CountingTokenizer(smol_tokenizer)
    chunks, _ = stream(counter, ids)
    assert "".join(chunks) == smol_tokenizer.decode(ids)
    # Replacement characters are emitted once they are final, not held to the end.
    assert REPLACEMENT in "".join(chunks[:20])
    assert counter.max_len <= 16


class CountingTokenizer:
    """Wraps a tokenizer's decode to measure how many ids each push decodes."""

    def __init__(self, tok):
        self.tok = tok
        self.total = 0
        self.max_len = 0

    def decode(self, ids, **kwargs):
        self.total += len(ids)
        self.max_len = max(self.max_len, len(ids))
        return self.tok.decode(ids, **kwargs)


def test_cost_per_token_does_not_grow_with_length(smol_tokenizer):
    text = " ".join(TEXTS) * 20
    ids = encode(smol_tokenizer, text)
    counter = CountingTokenizer(smol_tokenizer)
    chunks, _ = stream(counter, ids)
    assert "".join(chunks) == text
    assert len(ids) > 2000
    assert counter.max_len <= 8
    assert counter.total <= 8 * len(ids)


CHATML = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>"


@pytest.mark.parametrize("sizes", [(1,), (2, 3)])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_skipped_or_kept(smol_tokenizer, sizes, spaces):
    ids = encode(smol_tokenizer, CHATML)
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in ids

    skipped, _ = stream(smol_tokenizer, ids, sizes, spaces_between_special_tokens=spaces)
    assert "".join(skipped) == "user\nHi there\nassistant\nHello!"
    assert "".join(skipped) == smol_tokenizer.decode(ids, skip_special_tokens=True)
    # A special token alone produces no text.
    d = IncrementalDetokenizer(smol_tokenizer)
    assert d.push([im_end]) == "" and d.flush() == ""

    kept, _ = stream(smol_tokenizer, ids, sizes, skip_special_tokens=False)
    assert "".join(kept) == CHATML == smol_tokenizer.decode(ids, skip_special_tokens=False)
    d = IncrementalDetokenizer(smol_tokenizer, skip_special_tokens=False)
    assert d.push([im_end]) == "<|im_end|>"


def test_prompt_tail_is_context_only_for_byte_level(smol_tokenizer):
    prompt = encode(smol_tokenizer, "<|im_start|>assistant\nSure, here")
    out = encode(smol_tokenizer, " is 你好 and 🇫🇷.<|im_end|>")
    for tail in (prompt[-5:], prompt[-1:], ()):
        chunks, d = stream(smol_tokenizer, out, prompt_tail=tail)
        assert "".join(chunks) == smol_tokenizer.decode(out, skip_special_tokens=True)
        assert d.output_ids == out


def test_prompt_tail_ending_inside_a_character_is_ignored(smol_tokenizer):
    ids = encode(smol_tokenizer, "你好")
    tail, out = ids[:1], ids[1:]  # the prompt ends after the first byte of 你
    chunks, _ = stream(smol_tokenizer, out, prompt_tail=tail)
    assert "".join(chunks) == smol_tokenizer.decode(out)


_ALPHABET = list(" \n\tab.,éüß你好界😀👩👧🇫🇷\u200d\U0001f3fd")


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(st.sampled_from(_ALPHABET), max_size=40),
    seed=st.integers(0, 2**16),
)
def test_round_trip_random_text(smol_tokenizer, text, seed):
    ids = encode(smol_tokenizer, text)
    sizes = tuple(random.Random(seed).choice([1, 1, 2, 3, 5]) for _ in range(8))
    chunks, _ = stream(smol_tokenizer, ids, sizes)
    assert "".join(chunks) == smol_tokenizer.decode(ids) == text
    assert all(REPLACEMENT not in c for c in chunks)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=30))
def test_round_trip_any_unicode(smol_tokenizer, text):
    ids = encode(smol_tokenizer, text)
    chunks, _ = stream(smol_tokenizer, ids)
    decoded = smol_tokenizer.decode(ids)
    assert "".join(chunks) == decoded
    # (Not always == text: the converted vocab lacks some byte tokens, e.g. 0xF1.)
    if REPLACEMENT not in decoded:
        assert all(REPLACEMENT not in c for c in chunks)


def byte_token_ids(tok) -> list[int]:
    """Ids of the byte-level BPE tokens that stand for one byte each (GPT-2's byte-to-char map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = tok.get_vocab()
    return [vocab[c] for c in chars.values() if c in vocab]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_round_trip_random_token_ids(smol_tokenizer, data):
    # Random ids, mostly single bytes: invalid and incomplete UTF-8, specials, long runs of U+FFFD.
    byte_ids = byte_token_ids(smol_tokenizer)
    assert len(byte_ids) > 200
    token = st.one_of(
        st.sampled_from(byte_ids),
        st.integers(0, len(smol_tokenizer) - 1),
        st.sampled_from(byte_ids[128:]),  # bytes >= 0x80: UTF-8 lead and continuation bytes
    )
    ids = data.draw(st.lists(token, max_size=60))
    sizes = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5)))
    skip = data.draw(st.booleans())
    chunks, _ = stream(smol_tokenizer, ids, sizes, skip_special_tokens=skip)
    assert "".join(chunks) == smol_tokenizer.decode(ids, skip_special_tokens=skip)


# A sentencepiece-style tokenizer (Llama 2 / Mistral decoder: "▁" for spaces, byte fallback,
# strip the first leading space) built in memory.


@pytest.fixture(scope="module")
def sp_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁": 6}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.byte_ids = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    return tok


def test_sentencepiece_leading_space_needs_the_prompt_tail(sp_tokenizer):
    hello, world, bang = 3, 4, 5
    # Alone, the first output token's leading space is stripped, as decode(output) does.
    chunks, _ = stream(sp_tokenizer, [world, bang])
    assert "".join(chunks) == "world!" == sp_tokenizer.decode([world, bang])
    # With the prompt's last token as context it is kept, and is right after every push.
    for sizes in [(1,), (2,)]:
        chunks, _ = stream(sp_tokenizer, [world, bang, world], sizes, prompt_tail=[1, hello])
        assert "".join(chunks) == " world! world"
    # Later tokens keep their spaces however the output is split into pushes.
    chunks, _ = stream(sp_tokenizer, [hello, world, world, bang, hello])
    assert chunks[:5] == ["Hello", " world", " world", "!", " Hello"]


def test_sentencepiece_byte_fallback(sp_tokenizer):
    hello, world = 3, 4
    ids = [hello] + [sp_tokenizer.byte_ids[b] for b in "你😀".encode()] + [world]
    chunks, _ = stream(sp_tokenizer, ids)
    assert "".join(chunks) == sp_tokenizer.decode(ids) == "Hello你😀 world"
    assert all(REPLACEMENT not in c for c in chunks)
    assert "你" in chunks and "😀" in chunks
    # An incomplete character at the end decodes (on flush) to one U+FFFD per byte, like decode.
    ids = [hello] + [sp_tokenizer.byte_ids[b] for b in "😀".encode()[:3]]
    chunks, _ = stream(sp_tokenizer, ids)
    assert chunks[:-1] == ["Hello", "", "", ""]
    assert "".join(chunks) == sp_tokenizer.decode(ids) == "Hello" + REPLACEMENT * 3


def test_sentencepiece_invalid_byte_run_is_released(sp_tokenizer):
    ff = sp_tokenizer.byte_ids[0xFF]
    ids = [3] + [ff] * 30 + [4]
    counter = CountingTokenizer(sp_tokenizer)
    chunks, _ = stream(counter, ids)
    assert "".join(chunks) == sp_tokenizer.decode(ids) == "Hello" + REPLACEMENT * 30 + " world"
    assert REPLACEMENT in "".join(chunks[:20])
    assert counter.max_len <= 16
