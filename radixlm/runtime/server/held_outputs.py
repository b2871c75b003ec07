"""HeldOutputs: the engine process's outputs of requests whose caller does not stream them.

A request sent with ``Submission.stream`` False (a non-streamed /generate or OpenAI call, a gen
of a program the server runs) is read by the server only once it has finished: its text, ids
and final meta. The engine process then keeps such a request's outputs and sends one, merged,
when it finishes, so a request of n tokens costs the server's event loop one message instead of
n (under load that loop's time sets how soon a program's next request reaches the engine).
"""

from __future__ import annotations

from collections.abc import Iterable

from radixlm.runtime.output_processor import RequestOutput


class HeldOutputs:
    def __init__(self) -> None:
        self._held: dict[str, RequestOutput] = {}  # rid -> all it gained so far, as one output

    def hold(self, rid: str) -> None:
        """Keep rid's outputs until it finishes."""
        self._held[rid] = RequestOutput(rid, "", [])

    def drop(self, rid: str) -> None:
        """Forget rid (it failed, and its failure goes to the server on its own)."""
        self._held.pop(rid, None)

    def pass_on(self, outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
        """The outputs to send now: those of streamed requests as they are; a held request's
        nothing until it finishes, then one output with all its text and ids (its final meta
        has its totals and logprobs)."""
        out: list[RequestOutput] = []
        for o in outputs:
            if o.rid not in self._held:
                out.append(o)
                continue
            merged = self._held[o.rid]  # (its ids: all the request's, as the caller would hold them)
            merged.text_delta += o.text_delta
            o.apply_ids(merged.token_ids_delta)
            if o.finished:
                del self._held[o.rid]
                merged.finished, merged.meta, merged.error = True, o.meta, o.error
                out.append(merged)
        return out
