"""A multi-turn chat in a session: one program run per user turn, each continuing the
conversation the earlier runs left, with its KV pinned in the runtime between turns (so a
later turn reads the whole history from the cache); every reply is streamed.

    python examples/agents/multi_turn_chat.py
"""

from __future__ import annotations

import sys
from typing import Any

import radixlm as rl

SYSTEM = "You are a friendly, concise assistant."
TURNS = [
    "Hi! I'm planning a picnic. Suggest one food to bring.",
    "Nice. What drink goes well with it?",
    "Great. Give me one tip in case it rains.",
]


@rl.function
def chat_turn(s, message: str, max_tokens: int = 24, system: str | None = None):
    if system is not None:  # the first turn opens the conversation
        s += rl.system(system)
    s += rl.user(message)
    s += rl.assistant(rl.gen("reply", max_tokens=max_tokens))


def main(backend: Any = None, turns: list[str] = TURNS, echo: bool = False,
         max_tokens: int = 24) -> list[rl.ProgramState]:
    """Run the chat; returns each turn's state (the last one holds the whole conversation)."""
    states = []
    with rl.session(backend) as sess:
        for i, message in enumerate(turns):
            state = chat_turn.run(message, max_tokens, SYSTEM if i == 0 else None, session=sess,
                                  temperature=0, stream=True)
            if echo:
                print(f"[user] {message}\n[assistant] ", end="", flush=True)
            for piece in state.text_iter("reply"):
                if echo:
                    print(piece, end="", flush=True)
            meta = state.get_meta_info("reply")
            if echo:
                print(f"\n  ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens read from the cache)")
            states.append(state)
    return states


if __name__ == "__main__":
    main(backend=rl.Engine(*sys.argv[1:2]), echo=True)
