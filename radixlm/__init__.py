"""radixlm: LM programs on a radix-tree KV cache runtime."""

from typing import Any

# The public DSL (SGLang's frontend names) and the backends, imported on first use so that the
# runtime's processes never pay for the DSL, and `import radixlm` never pulls in torch.
__all__ = [
    "Engine",
    "FunctionCall",
    "Graph",
    "GraphError",
    "OpenAI",
    "ProgramState",
    "RuntimeEndpoint",
    "Session",
    "TraceError",
    "arun_graph",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "describe_tools",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "greedy_token_selection",
    "image",
    "run_graph",
    "select",
    "session",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
_LAZY = {
    **{name: "radixlm.lang" for name in __all__},
    "Engine": "radixlm.runtime.engine",
    "RuntimeEndpoint": "radixlm.lang.backends.runtime_endpoint",
    "OpenAI": "radixlm.lang.backends.openai",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
