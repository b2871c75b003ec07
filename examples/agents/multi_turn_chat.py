"""A multi-turn chat: each user turn and the assistant's reply go into one state, formatted by
the model's own chat template; the last reply is streamed.

    python examples/agents/multi_turn_chat.py
"""

from __future__ import annotations

import sys
from typing import Any

import radixlm as rl

TURNS = [
    "Hi! I'm planning a picnic. Suggest one food to bring.",
    "Nice. What drink goes well with it?",
    "Great. Give me one tip in case it rains.",
]


@rl.function
def chat(s, turns: list[str], max_tokens: int = 24):
    s += rl.system("You are a friendly, concise assistant.")
    for i, turn in enumerate(turns):
        s += rl.user(turn)
        s += rl.assistant(rl.gen(f"reply{i}", max_tokens=max_tokens))


def main(backend: Any = None, turns: list[str] = TURNS, echo: bool = False, max_tokens: int = 24) -> rl.ProgramState:
    state = chat.run(turns, max_tokens, backend=backend, temperature=0, stream=True)
    for piece in state.text_iter(f"reply{len(turns) - 1}"):  # the earlier turns run first
        if echo:
            print(piece, end="", flush=True)
    return state


if __name__ == "__main__":
    state = main(backend=rl.Engine(*sys.argv[1:2]), echo=True)
    print()
    for m in state.messages():
        print(f"[{m['role']}] {m['content']}")
