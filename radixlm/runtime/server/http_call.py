"""One blocking HTTP call to a radixlm server that never raises on an HTTP error status: for
scripts that check the server (benchmarks, tests), where a 4xx/5xx is an answer to look at."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http_call(url: str, method: str, body: Any = None, raw: bytes | None = None,
              headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    """(status, the JSON body parsed, or its text when it is not JSON) of `method url`; `body`
    is sent as JSON, `raw` as given bytes."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text
