"""SGLang signatures that ported programs use, and what radixlm leaves out saying so clearly."""

from __future__ import annotations

import pytest

import radixlm as rl
import radixlm.lang as sgl


def test_select_takes_sglang_positional_temperature_zero_only():
    expr = sgl.select("x", ["a", "b"], 0.0, "greedy")  # SGLang: select(name, choices, temperature, choices_method)
    assert expr.nodes[0].method == "greedy_token_selection"
    with pytest.raises(ValueError, match="only temperature=0 is taken"):
        sgl.select("x", ["a", "b"], 0.7)


def test_gen_arguments_after_min_tokens_are_keyword_only():
    assert sgl.gen("x", 16, 2).nodes[0].sampling.min_new_tokens == 2
    with pytest.raises(TypeError, match="positional"):
        sgl.gen("x", 16, None, 2)  # SGLang reads this 2 as n, older SGLang as stop


@pytest.mark.parametrize("name", ["image", "video"])
def test_image_and_video_say_they_are_not_supported(name):
    with pytest.raises(NotImplementedError, match=f"{name}\\(\\) is not supported: radixlm serves text-only"):
        getattr(rl, name)("cat.png")


@sgl.function
def word(s, topic):
    s += f"One word about {topic}:" + sgl.gen("w", max_tokens=2)


@pytest.mark.slow
def test_run_batch_takes_num_threads_auto(engine_backend):
    states = word.run_batch([{"topic": "sea"}, {"topic": "sky"}], num_threads="auto", backend=engine_backend,
                            temperature=0)
    assert [st.error() for st in states] == [None, None] and all(st["w"] for st in states)
