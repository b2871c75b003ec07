"""Fields of the processor's description in /proc/cpuinfo (its flags, its vendor)."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_field(names: tuple[str, ...], cpuinfo: Path = CPUINFO) -> str | None:
    """The value of the first line whose key is one of `names` (the first processor's), or None
    where the file is unreadable or has none."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return None
