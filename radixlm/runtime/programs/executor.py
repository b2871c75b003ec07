"""The asyncio executor: runs IR nodes on program states, over any Connection.

``execute`` runs one node on one state; ``run_sequence`` runs a graph's sequence, starting each
fork's branches as concurrent tasks (after prefilling the parent's text once) and gathering them
at the join. The DSL runs it over its backends (traced graphs, and step-by-step programs through
radixlm.lang.interpreter.handles, node by node); the server runs received graphs with it over
its in-process connection (POST /run_program), so both sides share one semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixlm.runtime.chat_template import ChatTemplate
from radixlm.runtime.programs.connection import Connection, GenRequest
from radixlm.runtime.programs.ir import (
    ForkNode,
    GenNode,
    JoinNode,
    RoleBeginNode,
    RoleEndNode,
    SelectNode,
    TextNode,
    VarBeginNode,
    VarEndNode,
)
from radixlm.runtime.programs.sampling import SamplingArgs, convert_dtype
from radixlm.runtime.programs.select import run_select
from radixlm.runtime.programs.state import StateCore
from radixlm.runtime.tool_calls import GENERIC, Tool, one_call_schema, read_one_call

_FAILED_AT = "radixlm_failed_at"


class SessionLink(Protocol):
    """A run's link to a runtime session: the session_params of a gen on ``core`` (None when that
    gen is no turn of the session), and the text whose KV the newest turn holds."""

    covered: str

    def params(self, core: StateCore, n: int | None) -> dict[str, Any] | None: ...


@dataclass
class SessionTurns:
    """A SessionLink: the gens of ``root`` (the run's own state, not its fork branches) are turns
    of runtime session ``session_id``. A turn sends the state's whole text and replaces the
    session's history with it, so a gen sees exactly the tokens it would see without a session
    (docs/sessions.md, "The DSL")."""

    session_id: str
    root: StateCore
    covered: str = ""  # the text whose KV the session's newest turn holds

    def params(self, core: StateCore, n: int | None) -> dict[str, Any] | None:
        """session_params for a gen on ``core``: a turn that resends the whole conversation."""
        if core is not self.root or (n or 1) != 1:
            return None
        return {"id": self.session_id, "replace": True}

    async def pin(self, conn: Connection) -> None:
        """Pin the run's whole text: one prefill-only turn if it grew after the last gen."""
        root = self.root
        if root.text != self.covered:
            await conn.generate(GenRequest(root.text, {"max_new_tokens": 0}, session=self.params(root, 1),
                                           plain_spans=list(root.plain_spans)))
            self.covered = root.text


@dataclass(frozen=True)
class RunContext:
    """What every node of one run shares: the backend connection, chat template and defaults.

    ``sites`` maps id(node) to where the program added it, for error notes; ``session``: the
    session whose turns the run's own gens are."""

    conn: Connection
    template: ChatTemplate
    defaults: SamplingArgs
    stream: bool = False
    program: str = ""
    sites: dict[int, str] | None = None
    session: SessionLink | None = None


async def execute(core: StateCore, node: Any, ctx: RunContext, site: str | None = None) -> None:
    """Run one node on ``core``; a failure gets a note naming the node and where it was added."""
    try:
        await _execute(core, node, ctx)
    except Exception as e:
        if failed_at(e) is None:  # the innermost node that failed and its state, for a server's error event
            with contextlib.suppress(AttributeError):
                setattr(e, _FAILED_AT, (node, core.path))
        where = site or (ctx.sites or {}).get(id(node))
        e.add_note(f"in program {ctx.program!r}, while running {_describe(node)}"
                   + (f" added at {where}" if where else ""))
        raise


def failed_at(e: BaseException) -> tuple[Any, str] | None:
    """(node, state path) of the execution that raised ``e``, when ``e`` came from ``execute``."""
    at: tuple[Any, str] | None = getattr(e, _FAILED_AT, None)
    return at


async def _execute(core: StateCore, node: Any, ctx: RunContext) -> None:
    if isinstance(node, TextNode):
        core.append(node.text)
    elif isinstance(node, GenNode):
        await _gen(core, node, ctx)
    elif isinstance(node, SelectNode):
        result = await run_select(ctx.conn, core.text, node.choices, node.method)
        core.append(result.choice, node.name)
        if node.name is not None:
            core.variables[node.name] = result.choice
            core.meta[node.name] = result.meta
    elif isinstance(node, RoleBeginNode):
        if core.open_role is not None:
            raise ValueError(f"{node.role} message begins inside an open {core.open_role[0]} message")
        core.append(ctx.template.begin(node.role, at_start=not core.text))
        core.open_role = (node.role, len(core.text))
    elif isinstance(node, RoleEndNode):
        if core.open_role is None or core.open_role[0] != node.role:
            raise ValueError(f"{node.role} message ends, but it was never begun")
        content = core.text[core.open_role[1]:]
        if ctx.template.holds_special(content):  # message content is text, never control tokens
            core.plain_spans.append((core.open_role[1], len(core.text)))
        core.append(ctx.template.end(node.role))
        core.messages.append({"role": node.role, "content": content})
        core.open_role = None
    elif isinstance(node, VarBeginNode):
        core.scopes[node.name] = len(core.text)
    elif isinstance(node, VarEndNode):
        core.variables[node.name] = core.text[core.scopes.pop(node.name):]
    else:
        raise TypeError(f"execute() cannot run a {type(node).__name__}")


async def _gen(core: StateCore, node: GenNode, ctx: RunContext) -> None:
    if node.tools is not None:
        await _tool_gen(core, node, ctx)
        return
    sampling = ctx.defaults.merged(node.sampling)
    constraint = {node.constraint.kind: node.constraint.spec} if node.constraint else {}
    role = core.open_role
    session = ctx.session.params(core, sampling.n) if ctx.session is not None else None
    req = GenRequest(core.text, sampling.to_native(**constraint), list(core.messages),
                     (role[0], core.text[role[1]:]) if role else None, node.return_logprob, node.top_logprobs_num,
                     session, plain_spans(core, ctx.template))
    if ctx.stream and (sampling.n or 1) == 1:
        parts: list[str] = []
        meta: dict[str, Any] = {}
        async for chunk in ctx.conn.stream(req):
            parts.append(chunk.text)
            core.append(chunk.text, node.name)
            meta = chunk.meta or meta
        texts, metas = ["".join(parts)], [meta]
    else:
        outs = await ctx.conn.generate(req)
        texts, metas = [o.text for o in outs], [o.meta for o in outs]
        core.append(texts[0], node.name)  # with n > 1 the state continues with the first sample
    if session is not None and ctx.session is not None:  # a turn of the run's session
        ctx.session.covered = core.text
    if node.name is None:
        return
    values = [convert_dtype(node.dtype, t) if node.dtype else t for t in texts]
    core.variables[node.name] = values if len(values) > 1 else values[0]
    core.meta[node.name] = metas if len(metas) > 1 else metas[0]


async def _tool_gen(core: StateCore, node: GenNode, ctx: RunContext) -> None:
    """One call of one of the node's tools: ``opener + VALUE + closer`` in the generic format,
    VALUE generated under the one-call schema (or by the API's own tool calling); the variable
    holds ``{"name", "arguments"}`` (bound by the node's binder)."""
    assert node.tools is not None
    sampling = ctx.defaults.merged(node.sampling)
    if (sampling.n or 1) != 1:
        raise ValueError("a gen with tools makes one call; n must be 1")
    tools = [Tool(t.name, t.description, t.parameters) for t in node.tools]
    params = sampling.to_native()
    for key in ("stop", "ignore_eos", "min_new_tokens"):  # they shape text, never a call (as on the OpenAI route)
        params.pop(key, None)
    fmt = GENERIC
    role = core.open_role
    session = ctx.session.params(core, 1) if ctx.session is not None else None
    if ctx.conn.native_tools:
        req = GenRequest(core.text, params, list(core.messages), (role[0], core.text[role[1]:]) if role else None,
                         session=session, plain_spans=plain_spans(core, ctx.template),
                         tools=[t.to_openai() for t in tools])
        out = (await ctx.conn.generate(req))[0]
        value, meta = out.text, out.meta
        core.append(fmt.opener + value, node.name)
    else:
        core.append(fmt.opener, node.name)
        params["json_schema"] = json.dumps(one_call_schema(tools, fmt), separators=(",", ":"))
        req = GenRequest(core.text, params, list(core.messages),
                         (role[0], core.text[role[1]:]) if role else None, session=session,
                         plain_spans=plain_spans(core, ctx.template))
        parts: list[str] = []
        meta = {}
        if ctx.stream:
            async for chunk in ctx.conn.stream(req):
                parts.append(chunk.text)
                core.append(chunk.text, node.name)
                meta = chunk.meta or meta
        else:
            out = (await ctx.conn.generate(req))[0]
            parts.append(out.text)
            core.append(out.text, node.name)
            meta = out.meta
        value = "".join(parts)
    if session is not None and ctx.session is not None:
        ctx.session.covered = core.text
    call = read_one_call(value, fmt)
    core.append(fmt.closer, node.name)
    if node.name is not None:
        core.variables[node.name] = node.bind(call)
        core.meta[node.name] = meta


def plain_spans(core: StateCore, template: ChatTemplate) -> list[tuple[int, int]]:
    """The spans of ``core.text`` a backend must tokenize as plain text: message contents holding
    special-token text, the open message's included."""
    spans = list(core.plain_spans)
    if core.open_role is not None and template.holds_special(core.text[core.open_role[1]:]):
        spans.append((core.open_role[1], len(core.text)))
    return spans


async def run_sequence(core: StateCore, nodes: Sequence[Any], ctx: RunContext) -> None:
    """Run a graph sequence on ``core``: forks start their branches as tasks, joins wait for them.
    Branches never joined are awaited at the end, so their errors surface."""
    forks: dict[int, tuple[list[StateCore], list[asyncio.Task[None]], set[str], int]] = {}
    try:
        for node in nodes:
            if isinstance(node, ForkNode):
                prefix_conn, conns = ctx.conn.fork(f"{core.path}/f{node.id}", len(node.branches))
                if core.text:  # one prefill of the parent, then every branch reads it from the cache
                    await prefix_conn.prefill(core.text)
                branches = [core.branch(f"f{node.id}.{i}") for i in range(len(node.branches))]
                tasks = [asyncio.create_task(run_branch(b, seq, dataclasses.replace(ctx, conn=c)))
                         for b, seq, c in zip(branches, node.branches, conns)]
                forks[node.id] = (branches, tasks, set(core.variables), len(core.text))
            elif isinstance(node, JoinNode):
                branches, tasks, known, base = forks.pop(node.fork)
                await gather_all(tasks)
                core.join(branches, node.mode, known, base)
            else:
                await execute(core, node, ctx)
        for _, tasks, _, _ in list(forks.values()):
            await gather_all(tasks)
    finally:
        for _, tasks, _, _ in forks.values():
            for t in tasks:
                t.cancel()


async def run_branch(core: StateCore, nodes: Sequence[Any], ctx: RunContext) -> None:
    try:
        await run_sequence(core, nodes, ctx)
    except BaseException as e:
        core.finish(e)
        raise
    core.finish()


async def gather_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Wait for every task; on the first failure cancel the rest and raise it."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _describe(node: Any) -> str:
    name = getattr(node, "name", None)
    return f"{node.op}({name!r})" if name else node.op
