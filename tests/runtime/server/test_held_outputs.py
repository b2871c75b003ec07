"""HeldOutputs: a request nobody streams gets one output, its text and ids whole."""

from radixlm.runtime.output_processor import RequestOutput
from radixlm.runtime.server.held_outputs import HeldOutputs


def _replay(outputs: list[RequestOutput]) -> tuple[str, list[int]]:
    """What a caller that reads every output ends with."""
    text, ids = "", []
    for o in outputs:
        text += o.text_delta
        o.apply_ids(ids)
    return text, ids


def _stream() -> list[RequestOutput]:
    """A request's outputs as the engine makes them: tokens, then a jump that re-tokenizes the
    last two (replace_from), more tokens, and the finished output with its meta."""
    return [
        RequestOutput("a", '{"', [90, 1]),
        RequestOutput("a", "na", [7]),
        RequestOutput("a", 'me": "', [91, 5, 6], replace_from=1),
        RequestOutput("a", "Bo", [8]),
        RequestOutput("a", 'b"}', [9, 2], finished=True, meta={"completion_tokens": 6}),
    ]


def test_a_held_request_gets_one_output_with_what_every_output_would_have_given():
    held = HeldOutputs()
    held.hold("a")
    sent = [o for step in _stream() for o in held.pass_on([step])]
    assert len(sent) == 1 and sent[0].finished and sent[0].replace_from is None
    assert _replay(sent) == _replay(_stream()) == ('{"name": "Bob"}', [90, 91, 5, 6, 8, 9, 2])
    assert sent[0].meta == {"completion_tokens": 6}
    assert held.pass_on([RequestOutput("a", "x", [3])]) == [RequestOutput("a", "x", [3])]  # forgotten once sent


def test_streamed_requests_pass_as_they_are_beside_held_ones():
    held = HeldOutputs()
    held.hold("a")
    b = [RequestOutput("b", "hi", [4]), RequestOutput("b", "!", [5], finished=True)]
    a = _stream()
    sent = held.pass_on([a[0], b[0]]) + held.pass_on(a[1:4]) + held.pass_on([a[4], b[1]])
    assert [o.rid for o in sent] == ["b", "a", "b"]
    assert sent[0] is b[0] and sent[2] is b[1]


def test_a_failed_request_ends_with_its_error_and_a_dropped_one_is_forgotten():
    held = HeldOutputs()
    held.hold("a")
    held.hold("c")
    held.pass_on([RequestOutput("a", "ab", [1, 2])])
    sent = held.pass_on([RequestOutput("a", "", [], finished=True, error="grammar failed")])
    assert sent[0].error == "grammar failed" and _replay(sent) == ("ab", [1, 2])
    held.drop("c")
    late = RequestOutput("c", "z", [3], finished=True)
    assert held.pass_on([late]) == [late]
