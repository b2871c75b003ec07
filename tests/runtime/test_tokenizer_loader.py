"""load_tokenizer takes a shortcut past AutoTokenizer's config import: it must give the same tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from radixlm.runtime.tokenizer_loader import PLAIN_MODEL_TYPES, direct_class_applies, load_tokenizer

PROBES = ["Hello, world!", "  leading spaces\tand tabs\n", "<|im_start|>user\nhi<|im_end|>", "naïve café 日本語 🙂",
          '{"name":"Ada","age":36}', "x" * 300]


def test_transformers_keeps_a_declared_tokenizers_backend_for_the_plain_model_types():
    auto = pytest.importorskip("transformers.models.auto.tokenization_auto")
    for model_type in PLAIN_MODEL_TYPES:
        assert model_type not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert (auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "").removesuffix("Fast") != "MistralCommonBackend"


def test_the_default_model_loads_as_autotokenizer_does(default_source):
    from transformers import AutoTokenizer

    path = default_source.tokenizer_dir
    assert direct_class_applies(path)  # the shortcut is taken here: this is what it is compared on
    fast, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(fast) is type(auto)
    assert fast.get_vocab() == auto.get_vocab()
    assert fast.all_special_tokens == auto.all_special_tokens
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                        auto.pad_token_id)
    assert fast.chat_template == auto.chat_template
    for text in PROBES:
        assert fast.encode(text) == auto.encode(text)
        assert fast.decode(fast.encode(text)) == auto.decode(auto.encode(text))
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert (fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("change", ["another model type", "a remote class", "another class", "no config"])
def test_other_directories_go_through_autotokenizer(default_source, tmp_path, change):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(default_source.tokenizer_dir / name, tmp_path / name)
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    if change == "another model type":
        config["model_type"] = "qwen2"  # transformers picks Qwen2Tokenizer for it, whatever is declared
    elif change == "a remote class":
        tok_config["auto_map"] = {"AutoTokenizer": [None, "custom.Tokenizer"]}
    elif change == "another class":
        tok_config["tokenizer_class"] = "GPT2Tokenizer"
    else:
        (tmp_path / "config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if change != "no config":
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert direct_class_applies(default_source.tokenizer_dir)
    assert not direct_class_applies(tmp_path)
