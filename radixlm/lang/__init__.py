"""The radixlm DSL (SGLang's frontend names): programs, their interpreter and backends."""

from radixlm.lang.context import DslContext, set_default_backend
from radixlm.lang.frontend.expr import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.frontend.function import SglFunction, arun_graph, function, run_graph
from radixlm.lang.frontend.tools import FunctionCall, describe_tools
from radixlm.lang.interpreter.runner import ProgramState, TraceError
from radixlm.lang.sessions import Session, session
from radixlm.runtime.programs.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.runtime.programs.ir import Graph, GraphError

__all__ = [
    "DslContext", "FunctionCall", "Graph", "GraphError", "ProgramState", "Session", "SglFunction", "TraceError", "arun_graph",
    "assistant", "assistant_begin", "assistant_end", "describe_tools", "function", "gen", "gen_int", "gen_string",
    "greedy_token_selection", "image", "run_graph", "select", "session", "set_default_backend", "system",
    "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end", "video",
]
