"""Compiled native kernels kept on disk, so that a process whose kernels another has compiled (a test
worker, a tensor-parallel rank, a restarted engine) loads the object instead of compiling it.

An entry is `<cache dir>/kernels/<isa>-<key>.o`: a header line, the SHA-256 of the object, then the
object. The key hashes everything the object depends on (native.py says what); the checksum
catches a damaged file. A missing, unreadable or damaged entry reads as absent, and an entry that
cannot be written is skipped: the caller compiles either way. Entries are written to a temporary
file and renamed into place, so a concurrent reader sees a whole entry or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"radixlm native kernels object\n"
DIGEST = hashlib.sha256().digest_size
SUBDIR = "kernels"


def key(*parts: str) -> str:
    """A hex SHA-256 of `parts` (each length-prefixed, so no two lists of parts run together)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def entry(cache_dir: Path, isa: str, digest: str) -> Path:
    """Where the object of `isa` under key `digest` is kept in `cache_dir`."""
    return cache_dir / SUBDIR / f"{isa}-{digest}.o"


def read(path: Path) -> bytes | None:
    """The object kept at `path`; None where there is none, it cannot be read, or it is damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, body = data[: len(MAGIC) + DIGEST], data[len(MAGIC) + DIGEST :]
    if head[: len(MAGIC)] != MAGIC or head[len(MAGIC) :] != hashlib.sha256(body).digest():
        logger.warning("ignoring the damaged compiled kernels %s: compiling them again", path)
        return None
    return body


def write(path: Path, obj: bytes) -> bool:
    """Keep `obj` at `path` (a temporary file renamed into place); False, with a warning, where
    the directory cannot be written."""
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(obj).digest() + obj)
        os.replace(temp, path)
    except OSError as e:
        logger.warning("could not keep the compiled kernels at %s (%s): each process compiles them", path, e)
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        return False
    return True
