"""Sessions in the DSL: program runs that continue one conversation, its KV pinned in the runtime.

``sess = radixlm.session(capacity=..., ttl=...)`` opens a runtime session; ``func.run(...,
session=sess)`` starts the program's state from the text and messages the session's earlier
runs left, and every gen of the run's own state is a turn of the runtime session. A turn sends
the state's whole text and replaces the session's history with it (``replace`` without
``rid``, as the OpenAI chat route does), so a gen sees exactly the tokens it would see without
a session, while the session's pin keeps the KV of the earlier runs in the radix cache. At the
end of a run, text added after its last gen (a role's end marker, a select) is cached and
pinned by one prefill-only turn. docs/sessions.md ("The DSL") says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.lang.backends.base import Backend, Connection
from radixlm.lang.context import DEFAULT_CONTEXT
from radixlm.runtime.programs.executor import SessionTurns
from radixlm.runtime.programs.state import StateCore


class Session:
    """An open session: what its runs have said so far, and the runtime session holding its KV.

    ``text`` and ``messages`` are the conversation after the last finished run (a failed run
    leaves them as they were). Runs of one session go one after another. Close it (or use it as
    a context manager) to unpin its KV; the runtime also closes it after ``ttl`` idle seconds.
    """

    def __init__(self, backend: Backend, session_id: str) -> None:
        self.backend = backend
        self.id = session_id
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.open_role: tuple[str, int] | None = None
        self.plain_spans: list[tuple[int, int]] = []
        self.closed = False
        self._running = False

    def check_usable(self) -> None:
        """Raise a clear error when a run cannot use this session now."""
        if self.closed:
            raise ValueError(f"session {self.id!r} is closed; open a new one with radixlm.session(...)")
        if self._running:
            raise RuntimeError(f"session {self.id!r} is in use by another run; runs of one session go one "
                               "after another")

    def close(self) -> None:
        """Close the runtime session and unpin its KV (again: nothing happens)."""
        if not self.closed:
            self.closed = True
            self.backend.close_session(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.id!r}, {'closed' if self.closed else 'open'}, {len(self.messages)} messages)"


def session(backend: Any = None, *, capacity: int | None = None, ttl: float | None = None,
            session_id: str | None = None) -> Session:
    """Open a session on ``backend`` (default: the default backend): ``capacity`` in tokens,
    ``ttl`` in idle seconds (the runtime's default when None), ``session_id`` to pick its id."""
    be = DEFAULT_CONTEXT.backend(backend)
    return Session(be, be.open_session(capacity, ttl, session_id))


@dataclass
class SessionRun(SessionTurns):
    """One run's link to its session: the gens of ``root`` (the run's own state, not its fork
    branches) are the session's turns (radixlm.runtime.programs.executor.SessionTurns)."""

    session: Session = field(kw_only=True)

    @classmethod
    def begin(cls, sess: Session, root: StateCore) -> SessionRun:
        """Claim the session for this run and start ``root`` where the last run ended."""
        sess.check_usable()
        sess._running = True
        root.text, root.messages, root.open_role = sess.text, list(sess.messages), sess.open_role
        root.plain_spans = list(sess.plain_spans)
        return cls(sess.id, root, sess.text, session=sess)

    async def finish(self, conn: Connection) -> None:
        """Pin the run's whole text, then let the session continue from it."""
        await self.pin(conn)
        root, sess = self.root, self.session
        sess.text, sess.messages, sess.open_role = root.text, list(root.messages), root.open_role
        sess.plain_spans = list(root.plain_spans)

    def release(self) -> None:
        self.session._running = False
