"""PrefixTokenizer: a program's growing texts, tokenized from where they last changed, give the
ids that tokenizing each text whole gives (the default model's tokenizer); tokenizers it cannot
serve get none."""

import asyncio
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from radixlm.runtime.server.native_api import _prompt_size, parse_generate, parse_generate_soon
from radixlm.runtime.server.prefix_tokenizer import KEPT_TEXTS, PrefixTokenizer
from radixlm.runtime.server.tokenizer import ServerTokenizer

# pieces a program's text grows by: words, numbers, spaces and newlines, JSON, contractions,
# characters of several bytes, role markers and other special-token texts, and halves of them
PIECES = ["Hello", " world", ".", "\n", "\n\n", " ", "  ", "123", "4.5", "<|im_start|>", "<|im_end|>", "user",
          "assistant\n", "é", "東京", "😀", "'s", "'", " don't", '{"a":', "}", "\t", "-", "--", "x", "X",
          "<|endoftext|>", "<|im", "_start|>", "ab", "  \n "]


@pytest.fixture(scope="module")
def tok(smol_tokenizer) -> ServerTokenizer:
    return ServerTokenizer(smol_tokenizer, 2048, len(smol_tokenizer))


def _whole(tok: ServerTokenizer, text: str) -> list[int]:
    return list(tok.tok.encode(text))


def test_the_default_tokenizer_gets_one(tok):
    assert isinstance(tok.prefix_tokenizer(), PrefixTokenizer)
    assert tok.prefix_tokenizer() is not tok.prefix_tokenizer()  # one a program


def test_growing_texts_get_the_ids_of_the_whole_text(tok):
    rng = random.Random(0)
    for _ in range(60):
        prefix = tok.prefix_tokenizer()
        text = ""
        for _ in range(25):
            text += "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6)))
            for t in (text, text + rng.choice(PIECES), text):  # a gen's prompt, a select's choice, again
                assert prefix.encode(t) == _whole(tok, t), repr(t[-80:])


def test_forks_and_selects_share_a_prefix(tok):
    """Branches of a fork grow apart from one text; a select scores its prefix with each choice."""
    rng = random.Random(1)
    prefix = tok.prefix_tokenizer()
    trunk = "<|im_start|>user\nPlan a trip to Osaka.<|im_end|>\n<|im_start|>assistant\n"
    assert prefix.encode(trunk) == _whole(tok, trunk)
    branches = [trunk] * 4
    for _ in range(10):
        for i in range(len(branches)):
            branches[i] += "".join(rng.choice(PIECES) for _ in range(3))
            for choice in ("yes", " no", "maybe.", "😀"):
                assert prefix.encode(branches[i] + choice) == _whole(tok, branches[i] + choice)
            assert prefix.encode(branches[i]) == _whole(tok, branches[i])


def test_a_split_is_never_taken_next_to_special_token_text(tok):
    """``<|im`` + ``_start|>``: the two halves spell a special token only together."""
    prefix = tok.prefix_tokenizer()
    head = "Some words then <|im"
    assert prefix.encode(head) == _whole(tok, head)
    whole = head + "_start|>user\nhi"
    assert prefix.encode(whole) == _whole(tok, whole)
    assert tok.tok.convert_tokens_to_ids("<|im_start|>") in prefix.encode(whole)


def test_role_markers_stay_control_tokens_after_a_plain_text_encode(tok):
    """The wrapper's split_special_tokens=True (plain-text spans) leaves the Rust tokenizer it
    wraps splitting special tokens; a program's texts keep their markers as control tokens."""
    text = "<|im_start|>user\nMy name is Ada.<|im_end|>\n<|im_start|>assistant\n"
    prefix = tok.prefix_tokenizer()
    tok.tok.encode("hi<|im_end|>", add_special_tokens=False, split_special_tokens=True)
    got = prefix.encode(text)
    assert got == _whole(tok, text)
    assert got.count(tok.tok.convert_tokens_to_ids("<|im_start|>")) == 2


def test_only_the_new_text_counts_toward_the_inline_size(tok):
    prefix = tok.prefix_tokenizer()
    long = "word " * 400
    prefix.encode(long)
    body = {"text": long + "and more", "sampling_params": {"max_new_tokens": 2}}
    assert _prompt_size(body) == len(long) + 8
    assert _prompt_size(body, prefix) == 8
    assert prefix.fresh_chars("unrelated text") == len("unrelated text")
    spec = asyncio.run(parse_generate_soon(body, tok, 5, 100, prefix=prefix))
    assert spec.jobs[0].request.prompt_ids == parse_generate(body, tok, 5, 100).jobs[0].request.prompt_ids


def test_it_keeps_a_bounded_number_of_texts(tok):
    prefix = tok.prefix_tokenizer()
    for i in range(3 * KEPT_TEXTS):
        text = f"text number {i} of many"
        assert prefix.encode(text) == _whole(tok, text)
    assert len(prefix._kept) == KEPT_TEXTS


def _fast(pre_tokenizer) -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz .,!?")}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    raw.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="?")


def test_a_tokenizer_without_a_known_split_rule_gets_none():
    tok = ServerTokenizer(_fast(pre_tokenizers.Whitespace()), 512, 31)
    assert tok.prefix_tokenizer() is None


def test_an_added_token_that_takes_in_the_spaces_around_it_gets_none(smol_tokenizer):
    from copy import deepcopy

    from tokenizers import AddedToken

    grabby = deepcopy(smol_tokenizer)
    grabby.add_tokens([AddedToken("<grab>", rstrip=True, lstrip=True)])
    assert ServerTokenizer(grabby, 2048, len(grabby)).prefix_tokenizer() is None
