"""Fixtures of the grammar backend tests: the default model's logits width and vocabulary."""

from __future__ import annotations

import pytest

from radixlm.runtime.constrained import TokenizerVocab, build_tokenizer_vocab


@pytest.fixture(scope="session")
def width(default_source) -> int:
    return default_source.arch.vocab_size


@pytest.fixture(scope="session")
def vocab(smol_tokenizer, width) -> TokenizerVocab:
    return build_tokenizer_vocab(smol_tokenizer, width)
