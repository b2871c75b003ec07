"""Tool calling: tool declarations, the text formats models write calls in, and the grammar a
call is generated under (pure Python; the server and the DSL both use it).

A call is never parsed hopefully out of free text: the calls of one assistant turn are
``opener + VALUE + closer`` where VALUE is one JSON value (an array of calls, or one call) and is
generated under a JSON-schema constraint built from the tools' ``parameters`` (``calls_schema``).
The opener (``<tool_call>``, ``[TOOL_CALLS]``) is put at the end of the prompt, so it may be the
tokenizer's own added token; the closer is implied once VALUE is complete (docs/tools.md).
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128


class ToolInputError(ValueError):
    """Bad tool input; ``param`` names the field (``tools[1].function.parameters``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI (and Hugging Face chat-template) form: {"type": "function", "function": {...}}."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``none`` | ``auto`` | ``required`` | ``named`` (then ``name`` is the one tool to call)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One generated (or sent back in the history) call: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# -- parsing OpenAI's fields ----------------------------------------------------------------------
def _kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def parse_tools(raw: Any, param: str = "tools") -> list[Tool]:
    """OpenAI's ``tools`` list, checked: type ``function``, a name of [A-Za-z0-9_-]{1,64} used once,
    a string description, ``parameters`` an object schema (default: no arguments), a boolean strict."""
    if not isinstance(raw, list):
        raise ToolInputError(f"{param} must be a list of tools, got {_kind(raw)}", param)
    if len(raw) > MAX_TOOLS:
        raise ToolInputError(f"{param} holds {len(raw)} tools, more than {MAX_TOOLS}", param)
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(t, dict):
            raise ToolInputError(f"{where} must be an object {{type: function, function: {{...}}}}", where)
        unknown = set(t) - {"type", "function"}
        if unknown:
            raise ToolInputError(f"{where} has unknown field {sorted(unknown)[0]!r}", where)
        if t.get("type") != "function":
            raise ToolInputError(f"{where}.type must be 'function', got {t.get('type')!r}", f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolInputError(f"{where}.function must be an object with name and parameters", f"{where}.function")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolInputError(f"{where}.function has unknown field {sorted(unknown)[0]!r}", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolInputError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                                 f"{where}.function.name")
        if name in seen:
            raise ToolInputError(f"{where}.function.name {name!r} is also the name of {param}[{seen[name]}]; "
                                 "tool names must be unique", f"{where}.function.name")
        seen[name] = i
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolInputError(f"{where}.function.description must be a string", f"{where}.function.description")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolInputError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        params = fn.get("parameters")
        pwhere = f"{where}.function.parameters"
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolInputError(f"{pwhere} must be a JSON schema object, got {_kind(params)}", pwhere)
        kind = params.get("type", "object")
        if kind != "object":
            raise ToolInputError(f"{pwhere} must describe an object (type 'object'), got type {kind!r}", pwhere)
        tools.append(Tool(name, description or "", params, strict))
    return tools


def parse_tool_choice(raw: Any, tools: Sequence[Tool], param: str = "tool_choice") -> ToolChoice:
    """``none`` / ``auto`` / ``required`` / ``{"type": "function", "function": {"name": ...}}``;
    the default is ``auto`` with tools and ``none`` without."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise ToolInputError(f"{param} {raw!r} needs tools; give tools or drop {param}", param)
        return ToolChoice(raw)
    if isinstance(raw, dict):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if raw.get("type") != "function" or not isinstance(name, str) or set(raw) - {"type", "function"}:
            raise ToolInputError(f'{param} must be none, auto, required or {{"type": "function", "function": '
                                 '{"name": ...}}', param)
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "no tools were given"
            raise ToolInputError(f"{param}.function.name {name!r} names no tool in tools ({known})",
                                 f"{param}.function.name")
        return ToolChoice("named", name)
    raise ToolInputError(f"{param} must be none, auto, required or an object naming a function, got {raw!r}", param)


def parse_history_calls(raw: Any, where: str) -> list[ToolCall]:
    """An assistant message's ``tool_calls`` (OpenAI's shape): id, type function, name, arguments (JSON text)."""
    if not isinstance(raw, list):
        raise ToolInputError(f"{where} must be a list of tool calls", where)
    calls = []
    for j, c in enumerate(raw):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise ToolInputError(f"{at} must be an object {{id, type: function, function: {{name, arguments}}}}", at)
        if c.get("type", "function") != "function":
            raise ToolInputError(f"{at}.type must be 'function'", f"{at}.type")
        cid = c.get("id")
        if not isinstance(cid, str) or not cid:
            raise ToolInputError(f"{at}.id must be a non-empty string", f"{at}.id")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolInputError(f"{at}.function.name must be a non-empty string", f"{at}.function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise ToolInputError(f"{at}.function.arguments must be a JSON string", f"{at}.function.arguments")
        try:
            json.loads(args)
        except ValueError:
            raise ToolInputError(f"{at}.function.arguments is not valid JSON", f"{at}.function.arguments") from None
        calls.append(ToolCall(cid, name, args))
    return calls


# -- formats ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """How a model writes the calls of one turn: ``opener + VALUE + closer``.

    ``array``: VALUE is a JSON list of calls (several calls in one turn), else one call object.
    ``args_key``: the key of the arguments in a call object. ``trigger``: the text that starts
    calls when the model may also answer in text (tool_choice auto). ``native``: the chat template
    renders ``tools`` and ``tool_calls`` itself; otherwise the generic rendering below is used."""

    name: str
    opener: str
    closer: str
    trigger: str
    array: bool = True
    args_key: str = "arguments"
    native: bool = False
    id_alphabet: str = ""  # ids this format's templates need (Mistral: 9 letters or digits); "" = call_<hex>

    def new_id(self) -> str:
        if self.id_alphabet:
            return "".join(secrets.choice(self.id_alphabet) for _ in range(9))
        return "call_" + secrets.token_hex(12)

    def call_text(self, calls: Sequence[ToolCall]) -> str:
        """The calls as the model writes them (the generic rendering of history)."""
        objs = [{"name": c.name, self.args_key: json.loads(c.arguments)} for c in calls]
        parts = [json.dumps(o, ensure_ascii=False, separators=(",", ":")) for o in objs]
        if self.array:  # compact, as calls are generated (--json-whitespace compact, the default)
            return self.opener + "[" + ",".join(parts) + "]" + self.closer
        return "\n".join(self.opener + p + self.closer for p in parts)


GENERIC = ToolFormat("generic", "<tool_call>", "</tool_call>", "<tool_call>")
HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "<tool_call>", array=False, native=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "[TOOL_CALLS]", native=True,
                     id_alphabet=string.ascii_letters + string.digits)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", '{"name"', array=False, args_key="parameters", native=True)
FORMATS = {f.name: f for f in (GENERIC, HERMES, MISTRAL, LLAMA3_JSON)}


def template_has_tools(template: str | None) -> bool:
    """Whether a Jinja chat template renders a ``tools`` list (it names the variable)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def detect_format(template: str | None) -> ToolFormat:
    """The tool format of a chat template: its own where it renders tools in a format known here
    (Hermes/Qwen ``<tool_call>``, Mistral ``[TOOL_CALLS]``, Llama-3.1 JSON), else ``GENERIC``."""
    if not template_has_tools(template):
        return GENERIC
    assert template is not None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|start_header_id|>" in template and "parameters" in template:
        return LLAMA3_JSON
    return GENERIC


# -- the grammar ---------------------------------------------------------------------------------------
def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_ref(v) for v in schema)
    return False


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#``, ``#/...``) pointing below ``base`` (a JSON pointer)."""
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + base + v[1:]
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v
        else:
            out[k] = _rebase_refs(v, base)
    return out


def calls_schema(tools: Sequence[Tool], choice: ToolChoice, fmt: ToolFormat, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of VALUE: one call object per allowed tool (``name`` const first, then the
    arguments under the tool's ``parameters``), in a list of at least one call (one with parallel
    calls off) for array formats. A tool whose parameters use ``$ref`` is kept whole under
    ``$defs/tool<i>``, its refs rebased there."""
    allowed = [(i, t) for i, t in enumerate(tools) if choice.mode != "named" or t.name == choice.name]
    defs: dict[str, Any] = {}
    branches = []
    for i, t in allowed:
        params: Any = copy.deepcopy(dict(t.parameters))
        params.setdefault("type", "object")
        if _has_ref(params):
            defs[f"tool{i}"] = _rebase_refs(params, f"/$defs/tool{i}")
            params = {"$ref": f"#/$defs/tool{i}"}
        branches.append({"type": "object", "properties": {"name": {"const": t.name}, fmt.args_key: params},
                         "required": ["name", fmt.args_key], "additionalProperties": False})
    call: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema: dict[str, Any]
    if fmt.array:
        schema = {"type": "array", "items": call, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
    else:
        schema = dict(call)
    if defs:
        schema["$defs"] = defs
    return schema


def tool_of_pointer(message: str, fmt: ToolFormat, tools: Sequence[Tool], choice: ToolChoice) -> int | None:
    """The index of the tool a compile error's JSON pointer points into, if it names one."""
    allowed = [i for i, t in enumerate(tools) if choice.mode != "named" or t.name == choice.name]
    m = re.search(r"/\$defs/tool(\d+)", message)
    if m:
        return int(m.group(1))
    m = re.search(r"/anyOf/(\d+)/properties/" + re.escape(fmt.args_key), message)
    if m and int(m.group(1)) < len(allowed):
        return allowed[int(m.group(1))]
    if len(allowed) == 1:
        return allowed[0]
    return None


# -- the generic rendering (templates without tools) -----------------------------------------------
def generic_system_text(tools: Sequence[Tool], fmt: ToolFormat = GENERIC) -> str:
    """The tool list and the call format, said in the system message (documented in docs/tools.md)."""
    lines = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                 ensure_ascii=False) for t in tools)
    example = fmt.opener + '[{"name":"<tool name>","arguments":{<arguments as JSON>}}]' + fmt.closer
    return ("You can call these tools (functions), described one per line as JSON:\n"
            f"<tools>\n{lines}\n</tools>\n"
            f"To call tools, answer with only the calls, as a JSON list in these tags:\n{example}\n"
            "Each result comes back in <tool_response></tool_response> tags. "
            "If no tool is needed, answer in plain text.")


def generic_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool],
                     fmt: ToolFormat = GENERIC) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tool list joins (or becomes) the
    system message, an assistant's calls become its text, tool results become user messages
    (consecutive results one message) wrapped in <tool_response> tags."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        content = m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls_text = fmt.call_text(m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls_text}" if content else calls_text})
        elif role == "tool":
            wrapped = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + wrapped
            else:
                out.append({"role": "user", "content": wrapped, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        text = generic_system_text(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tool calls itself (Hugging Face's convention: a call's
    arguments as a dict; a tool message keeps its tool_call_id and name)."""
    out = []
    for m in messages:
        d = {k: v for k, v in m.items() if k != "tool_calls"}
        if m.get("tool_calls"):
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                               for c in m["tool_calls"]]
            d["content"] = m.get("content") or ""
        out.append(d)
    return out


# -- reading VALUE as it is generated ------------------------------------------------------------------
@dataclass
class ScannedCall:
    name: str | None = None
    arguments: str = ""
    done: bool = False


class CallScanner:
    """Reads VALUE (grammar-shaped JSON) as it streams in and reports, per call, its name once
    complete and its arguments' text as it grows. ``feed`` returns (call index, name or None,
    new argument text, call complete) updates in order."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.call_depth = 2 if fmt.array else 1
        self.calls: list[ScannedCall] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect_key = False
        self._token = ""  # the string being read at call depth
        self._key = ""
        self._in_args = False
        self._in_name = False

    def feed(self, text: str) -> list[tuple[int, str | None, str, bool]]:
        updates: list[tuple[int, str | None, str, bool]] = []
        args_piece: list[str] = []

        def flush_args() -> None:
            if args_piece:
                updates.append((len(self.calls) - 1, None, "".join(args_piece), False))
                args_piece.clear()

        for ch in text:
            if self._in_args:
                args_piece.append(ch)
                self.calls[-1].arguments += ch
                if self._in_string:
                    if self._escape:
                        self._escape = False
                    elif ch == "\\":
                        self._escape = True
                    elif ch == '"':
                        self._in_string = False
                    continue
                if ch == '"':
                    self._in_string = True
                elif ch in "[{":
                    self._depth += 1
                elif ch in "]}":
                    self._depth -= 1
                    if self._depth == self.call_depth:
                        self._in_args = False
                        flush_args()
                continue
            if self._in_string:
                if self._escape:
                    self._escape = False
                    self._token += ch
                elif ch == "\\":
                    self._escape = True
                    self._token += ch
                elif ch == '"':
                    self._in_string = False
                    self._end_string(updates)
                else:
                    self._token += ch
                continue
            if ch == '"':
                self._in_string = True
                self._token = ""
            elif ch == "{" and self._depth == self.call_depth - 1:
                self._depth += 1
                self.calls.append(ScannedCall())
                self._expect_key = True
            elif ch == "{" and self._depth == self.call_depth and self._key == self.fmt.args_key:
                self._in_args = True
                self._depth += 1
                args_piece.append(ch)
                self.calls[-1].arguments += ch
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                if ch == "}" and self._depth == self.call_depth and self.calls:
                    self.calls[-1].done = True
                    updates.append((len(self.calls) - 1, None, "", True))
                self._depth -= 1
            elif ch == "," and self._depth == self.call_depth:
                self._expect_key = True
            elif ch == ":" and self._depth == self.call_depth:
                self._expect_key = False
        flush_args()
        return updates

    def _end_string(self, updates: list[tuple[int, str | None, str, bool]]) -> None:
        if self._depth != self.call_depth or not self.calls:
            return
        text = json.loads('"' + self._token + '"')
        if self._expect_key:
            self._key = text
        elif self._key == "name":
            self.calls[-1].name = text
            updates.append((len(self.calls) - 1, text, "", False))


# -- one call (the DSL's gen(tools=...)) ----------------------------------------------------------------
def one_call_schema(tools: Sequence[Tool], fmt: ToolFormat = GENERIC) -> dict[str, Any]:
    """The schema of VALUE holding exactly one call of one of ``tools``."""
    return calls_schema(tools, ToolChoice("required"), fmt, parallel=False)


def read_one_call(value: str, fmt: ToolFormat = GENERIC) -> dict[str, Any]:
    """``{"name", "arguments"}`` of the one call in VALUE; ValueError when VALUE is not one
    complete call (a generation cut by its token limit)."""
    try:
        data = json.loads(value)
    except ValueError:
        raise ValueError(f"the tool call was cut before it was complete ({value[-80:]!r}); "
                         "raise max_tokens (max_new_tokens) of the gen") from None
    call = data[0] if fmt.array and isinstance(data, list) and len(data) == 1 else data
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
            not isinstance(call.get(fmt.args_key), dict):
        raise ValueError(f"expected one tool call {{name, {fmt.args_key}}}, got {value[:200]!r}")
    return {"name": call["name"], "arguments": call[fmt.args_key]}
