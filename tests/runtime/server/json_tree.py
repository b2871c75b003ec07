"""Walking a parsed JSON document (the OpenAPI spec in the server tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def json_objects(tree: Any) -> Iterator[dict[str, Any]]:
    """Every object (dict) in `tree`, each before the objects inside it. A caller may change an
    object's descendants while walking, not the object whose turn it is."""
    if isinstance(tree, dict):
        yield tree
        for value in tree.values():
            yield from json_objects(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from json_objects(value)
