"""Load a model directory's Hugging Face tokenizer, the one ``AutoTokenizer`` would pick, fast.

``AutoTokenizer.from_pretrained`` reads the model's config to choose a tokenizer class, and
reading it imports the model's configuration module; for Llama-family models that chain imports
``torch.distributed.tensor`` and sympy: ~1.2 s of every process that loads a tokenizer (the
server's two processes, each in-process engine's first, each client that renders a template).
Where the directory's ``tokenizer_config.json`` names ``TokenizersBackend`` (what our GGUF
conversion writes, and what transformers 5 saves) and the model type is one for which
``AutoTokenizer`` keeps the declared class (``PLAIN_MODEL_TYPES``), the class is known without
that config and is loaded directly. Every other directory goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_BACKEND = "TokenizersBackend"
# Model types for which transformers registers no tokenizer class that overrides a declared
# TokenizersBackend (its tokenization_auto tables; tests/runtime/test_tokenizer_loader.py checks
# them against the installed transformers, whose import costs ~0.4 s, too much to do it here).
PLAIN_MODEL_TYPES = frozenset({"llama"})


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def direct_class_applies(model_dir: str | Path) -> bool:
    """Whether AutoTokenizer would load ``model_dir``'s tokenizer as ``TokenizersBackend``
    without looking further than what this reads (see the module docstring)."""
    d = Path(model_dir)
    tok_config = _read_json(d / "tokenizer_config.json")
    if tok_config.get("tokenizer_class") != _BACKEND or "auto_map" in tok_config:
        return False
    config = _read_json(d / "config.json")
    return config.get("model_type") in PLAIN_MODEL_TYPES and "model_name" not in config


def import_tokenizer_code() -> None:
    """Import the code ``load_tokenizer`` runs (transformers), so a later load is ~0.3 s."""
    try:
        from transformers import TokenizersBackend  # noqa: F401
    except ImportError:
        from transformers import AutoTokenizer  # noqa: F401


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer in ``model_dir`` (a local directory), as ``AutoTokenizer`` loads it."""
    if direct_class_applies(model_dir):
        try:
            from transformers import TokenizersBackend
        except ImportError:  # transformers 4: no such class, AutoTokenizer decides
            pass
        else:
            return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
