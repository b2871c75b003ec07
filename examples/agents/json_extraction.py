"""Structured extraction over a batch of texts: each output is constrained by a Pydantic model's
JSON schema, so it always parses; run_batch shares the instruction prefix across programs.

    python examples/agents/json_extraction.py
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel

import radixlm as rl


class Contact(BaseModel):
    name: str
    city: str
    age: int


TEXTS = [
    "Maria Lopez, 34, moved to Madrid last spring to open a bakery.",
    "Our new intern is Tom Becker; he is 22 and lives in Berlin.",
    "Aiko Tanaka (41) runs a small design studio in Osaka.",
    "At 67, retired teacher John Smith still volunteers every week in Boston.",
]
INSTRUCTION = ("Extract the person's name, city and age from the text as a JSON object with the "
               "keys name, city and age.")


@rl.function
def extract(s, text: str):
    s += rl.system(INSTRUCTION)
    s += rl.user(text)
    s += rl.assistant(rl.gen("contact", json_schema=Contact, max_tokens=40))


def main(backend: Any = None, texts: list[str] = TEXTS) -> list[Contact]:
    states = extract.run_batch([{"text": t} for t in texts], backend=backend, temperature=0,
                               progress_bar=True)
    return [Contact.model_validate_json(s["contact"]) for s in states]


if __name__ == "__main__":
    for contact in main(backend=rl.Engine(*sys.argv[1:2])):
        print(contact)
