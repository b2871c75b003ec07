"""The Model Context Protocol's messages compile and are accepted token by token.

``data/mcp_2025_11_25.json`` holds the definitions of the MCP schema (revision 2025-11-25) that
CallToolResult, GetPromptResult, ReadResourceResult, ListResourceTemplatesResult and
ServerRequest reach, in the spec's own form: ``format: byte`` on base64 data, ``uri`` on URIs,
``uri-template`` on resource templates, content blocks as an ``anyOf`` of text, image, audio,
resource-link and embedded-resource objects. Instances are written with keys in the schema's
order, the order a grammar generates them in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from matcher_helpers import _feed, _ids

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
from radixlm.runtime.constrained.service import grammar_config

MCP = json.loads((Path(__file__).parent / "data" / "mcp_2025_11_25.json").read_text())


def message(name: str) -> dict[str, Any]:
    """The schema of one MCP message type: a $ref into the spec's definitions."""
    return {"$schema": MCP["$schema"], "$ref": f"#/$defs/{name}", "$defs": MCP["$defs"]}


ANNOTATIONS = {"audience": ["user", "assistant"], "lastModified": "2025-01-12T15:00:58Z", "priority": 0.8}
TEXT = {"_meta": {"source": "weather"}, "annotations": ANNOTATIONS,
        "text": 'Sunny, 21 °C.\nTomorrow: "rain" — 東京 too', "type": "text"}
IMAGE = {"annotations": {"priority": 0}, "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9aw"
         "AAAABJRU5ErkJggg==", "mimeType": "image/png", "type": "image"}
AUDIO = {"data": "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQAAAAA=", "mimeType": "audio/wav", "type": "audio"}
TEXT_RESOURCE = {"_meta": {}, "mimeType": "text/markdown", "text": "# Title\n\nBody",
                 "uri": "https://example.com/docs/readme.md?v=2#top"}
BLOB_RESOURCE = {"blob": "AAECAwQ=", "mimeType": "application/octet-stream", "uri": "file:///tmp/b.bin"}
EMBEDDED_TEXT = {"resource": TEXT_RESOURCE, "type": "resource"}
EMBEDDED_BLOB = {"annotations": ANNOTATIONS, "resource": BLOB_RESOURCE, "type": "resource"}
LINK = {"description": "The log", "icons": [{"mimeType": "image/svg+xml", "sizes": ["any"], "src": "https://example.com/i.svg",
                                             "theme": "dark"}],
        "mimeType": "text/plain", "name": "log", "size": 1024, "title": "Log file", "type": "resource_link",
        "uri": "file:///var/log/app.log"}
TOOL = {"annotations": {"readOnlyHint": True, "title": "Weather"}, "description": "Get the weather",
        "inputSchema": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"},
        "name": "get_weather"}

VALID: dict[str, list[Any]] = {
    "CallToolResult": [
        {"_meta": {"progressToken": "tok-1"}, "content": [TEXT, IMAGE, AUDIO, EMBEDDED_TEXT, EMBEDDED_BLOB, LINK],
         "isError": False, "structuredContent": {"temperature": 21.5, "unit": "C", "tags": ["sun"]}},
        {"content": [{"text": "done", "type": "text"}]},
    ],
    "GetPromptResult": [
        {"description": "Review code", "messages": [
            {"content": TEXT, "role": "user"}, {"content": IMAGE, "role": "assistant"},
            {"content": EMBEDDED_TEXT, "role": "user"}, {"content": LINK, "role": "user"},
            {"content": AUDIO, "role": "user"}]},
    ],
    "ReadResourceResult": [
        {"contents": [TEXT_RESOURCE, BLOB_RESOURCE, {"text": "plain", "uri": "file:///a"}]},
    ],
    "ListResourceTemplatesResult": [  # format: uri-template
        {"nextCursor": "c2", "resourceTemplates": [{"annotations": ANNOTATIONS, "description": "Files", "mimeType": "text/plain",
                                                    "name": "file", "title": "File", "uriTemplate": "file:///{path}{?query*}"}]},
    ],
    "ServerRequest": [
        {"id": 1, "jsonrpc": "2.0", "method": "ping", "params": {"_meta": {"progressToken": 7}}},
        {"id": "r2", "jsonrpc": "2.0", "method": "sampling/createMessage", "params": {
            "_meta": {"progressToken": "p"}, "includeContext": "thisServer", "maxTokens": 100, "messages": [
                {"content": TEXT, "role": "user"},
                {"content": [TEXT, IMAGE, AUDIO], "role": "user"},
                {"content": {"id": "call_1", "input": {"city": "Paris"}, "name": "get_weather", "type": "tool_use"},
                 "role": "assistant"},
                {"content": {"content": [TEXT, EMBEDDED_TEXT], "isError": False, "toolUseId": "call_1",
                             "type": "tool_result"}, "role": "user"}],
            "metadata": {"k": 1}, "modelPreferences": {"costPriority": 0.3, "hints": [{"name": "claude"}],
                                                       "intelligencePriority": 0.9},
            "stopSequences": ["\n\n"], "systemPrompt": "Be brief.", "temperature": 0.7, "toolChoice": {"mode": "auto"},
            "tools": [TOOL]}},
        {"id": 3, "jsonrpc": "2.0", "method": "roots/list"},
        {"id": 4, "jsonrpc": "2.0", "method": "tasks/get", "params": {"taskId": "t1"}},
        {"id": 5, "jsonrpc": "2.0", "method": "tasks/list", "params": {"cursor": "c"}},
        {"id": 6, "jsonrpc": "2.0", "method": "elicitation/create", "params": {
            "message": "Your name?", "mode": "form", "requestedSchema": {"properties": {
                "name": {"description": "Full name", "maxLength": 50, "minLength": 1, "title": "Name", "type": "string"},
                "email": {"format": "email", "type": "string"},
                "age": {"maximum": 150, "minimum": 0, "type": "integer"},
                "ok": {"default": True, "type": "boolean"},
                "size": {"oneOf": [{"const": "s", "title": "Small"}, {"const": "l", "title": "Large"}], "type": "string"},
                "tags": {"items": {"enum": ["a", "b"], "type": "string"}, "maxItems": 2, "type": "array"}},
                "required": ["name"], "type": "object"}}},
        {"id": 7, "jsonrpc": "2.0", "method": "elicitation/create", "params": {
            "elicitationId": "e1", "message": "Sign in", "mode": "url", "url": "https://auth.example.com/login?state=abc"}},
    ],
}

# (message type, an invalid instance): refused somewhere, token by token
INVALID = [
    ("CallToolResult", {"content": [{"text": "x", "type": "video"}]}),  # no content block of that type
    ("CallToolResult", {"content": [{"data": "AAEC", "type": "image"}]}),  # an image without its mimeType
    ("ServerRequest", {"id": 1, "jsonrpc": "2.0", "method": "tools/call"}),  # a client's request, not a server's
    ("GetPromptResult", {"messages": [{"content": TEXT, "role": "system"}]}),
]


@pytest.fixture(scope="module")
def llg(vocab) -> LLGuidanceBackend:
    return LLGuidanceBackend(vocab, grammar_config(ConstraintConfig()))  # the engine's defaults


def _text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("name", list(VALID))
def test_mcp_messages_compile_and_accept_valid_instances(llg, smol_tokenizer, name):
    grammar = llg.compile("json_schema", message(name))
    assert grammar.backend == "llguidance"
    for value in VALID[name]:
        jsonschema.Draft202012Validator(message(name)).validate(value)
        m = grammar.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, _text(value))) is None, _text(value)
        assert m.is_completed()


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_mcp_messages_refuse_invalid_instances(llg, smol_tokenizer, name, value):
    assert not jsonschema.Draft202012Validator(message(name)).is_valid(value)
    m = llg.compile("json_schema", message(name)).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, _text(value))) is not None or not m.is_completed()


def test_formats_llguidance_knows_stay_enforced(llg, smol_tokenizer):
    """``uri`` is enforced; ``byte`` and ``uri-template`` (unknown to llguidance) take any string."""
    m = llg.compile("json_schema", message("ReadResourceResult")).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, _text({"contents": [{"text": "hi", "uri": "not a uri"}]}))) is not None
    m = llg.compile("json_schema", message("ListResourceTemplatesResult")).new_matcher()
    anything = {"resourceTemplates": [{"name": "n", "uriTemplate": "no template at all"}]}
    assert _feed(m, _ids(smol_tokenizer, _text(anything))) is None and m.is_completed()


def test_the_content_union_lets_each_kind_of_block_start(llg, smol_tokenizer):
    """Inside ``content``, after ``[``, every block of the union can begin: its first key."""
    prefix = '{"content":['
    for block in (TEXT, IMAGE, AUDIO, EMBEDDED_TEXT, LINK, {"text": "t", "type": "text"}, {"resource": BLOB_RESOURCE}):
        m = llg.compile("json_schema", message("CallToolResult")).new_matcher()
        start = prefix + _text(block)[:12]
        assert _feed(m, _ids(smol_tokenizer, start)) is None, start
