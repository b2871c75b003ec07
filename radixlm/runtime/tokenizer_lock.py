"""The lock a Hugging Face tokenizer's encodes take turns under.

The transformers wrapper (``TokenizersBackend``) sets its Rust tokenizer's
``encode_special_tokens`` at the start of each call (``split_special_tokens=True`` for message
content that must stay plain text) and leaves it set. Two threads encoding through one wrapper can
interleave a setting and an encode: measured with two threads taking turns as often as they can,
4-9 of 3,000 prompts lost their role markers to plain characters. Every encode that may run beside
another thread (the server's event loop and the threads that parse long bodies; the in-process
Engine called from a DSL batch's threads) holds this lock, one per tokenizer object.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["encoding_lock"]

_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def encoding_lock(tokenizer: Any) -> threading.RLock:
    """The re-entrant lock of ``tokenizer`` (made on first use, dropped with the tokenizer)."""
    with _GUARD:
        lock = _LOCKS.get(tokenizer)
        if lock is None:
            lock = _LOCKS[tokenizer] = threading.RLock()
        return lock
