"""A request as the scheduler sees it: token ids, sampling params and KV bookkeeping.

The engine's request (radixlm.runtime.request.EngineRequest) is this object with its output
state added; the scheduler only ever reads and writes the fields declared here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixlm.runtime.batch import UNSEEN
from radixlm.runtime.sampling_params import SamplingParams

# Longest program id and fork-group name a request may carry.
MAX_PROGRAM_ID = 256
MAX_PROGRAM_GROUP = 1024
MAX_PROGRAM_HOLD = 4096


@dataclass(frozen=True)
class ProgramTag:
    """Where a request sits in a program (a /run_program graph, or a client that names its program).

    ``group`` names a fork: each branch's first request carries it, so siblings are admitted
    together. The fork's prefix prefill carries ``hold`` = its number of branches: its KV stays
    locked in the cache until that many branch requests were admitted (or the program ended).
    ``managed``: the server runs the program (/run_program) and says when it ends, so between two
    of its requests it stays under way however long the next one takes; a client's program (never
    managed: nothing tells the server it ended) stays under way for ``program_gap_steps`` steps."""

    id: str
    group: str | None = None
    hold: int = 0
    managed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not 0 < len(self.id) <= MAX_PROGRAM_ID:
            raise ValueError(f"program id must be a string of 1 to {MAX_PROGRAM_ID} characters")
        if self.group is not None and (not isinstance(self.group, str) or len(self.group) > MAX_PROGRAM_GROUP):
            raise ValueError(f"program group must be a string of at most {MAX_PROGRAM_GROUP} characters")
        if isinstance(self.hold, bool) or not isinstance(self.hold, int) or not 0 <= self.hold <= MAX_PROGRAM_HOLD:
            raise ValueError(f"program hold must be an integer in [0, {MAX_PROGRAM_HOLD}]")
        if self.hold and self.group is None:
            raise ValueError("program hold needs a group: the fork whose branches it waits for")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence to complete. `slots[i]` holds the KV of token `fill_ids[i]`; the first
    `tree_len` of them belong to the prefix cache (kept alive by locking `node`)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    logprob_start_len: int = -1  # >= 0: return logprobs of prompt tokens from this position
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    matched_stop: str | int | None = None  # the stop string or token that ended the output
    arrival: int = -1  # its place in line: the order requests reached the scheduler (-1: not yet)
    # KV bookkeeping, owned by the scheduler
    row: int = -1
    slots: list[int] = field(default_factory=list)
    tree_len: int = 0
    node: object | None = None
    rewrite_row: bool = True
    prefix_hint: int = 0
    retractions: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    program: ProgramTag | None = None
    passed_over: int = 0  # admissions that overtook it (in the policy's order) while it waited
    # tokens sampled for it on the device whose values the host has not read yet (0 in the plain
    # step order; with the overlap schedule 1 while a step's tokens are in flight, and 2 for a
    # moment, while the next step is drawn before the host reads the one before)
    unseen: int = 0
    # tokens guessed to follow the newest (speculative decoding): its next decode checks them too
    draft: list[int] = field(default_factory=list)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids + [UNSEEN] * self.unseen

    @property
    def known_len(self) -> int:
        """Tokens the host has: the prompt and the output read so far (``fill_len`` less the unseen)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def fill_len(self) -> int:
        return self.known_len + self.unseen

    @property
    def generated(self) -> int:
        """Output tokens drawn so far, the unseen ones included."""
        return len(self.output_ids) + self.unseen

    @property
    def is_decoding(self) -> bool:
        """Past its prompt, all tokens but the newest have KV: the next step feeds one token.

        A prompt cut by the chunk budget one token short is still prefilling: it has no
        output yet, so it must neither be retracted as a decoder nor skip end_step's
        prompt bookkeeping (caching it, or finishing a max_new_tokens=0 request)."""
        return self.status is Status.RUNNING and self.generated > 0 and len(self.slots) == self.fill_len - 1

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob_start_len >= 0 and not self.generated

    def first_logit_pos(self) -> int:
        """Earliest position whose logits this request still needs."""
        if self.wants_input_logprobs:
            return max(min(self.logprob_start_len - 1, self.fill_len - 1), 0)
        return self.fill_len - 1

    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - self.generated, 0)
