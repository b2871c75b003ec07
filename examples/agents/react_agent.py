"""A ReAct agent with tools: each step the model makes one call of a Python function
(`gen(tools=[...])`, generated under the tools' schemas, so it always parses and validates),
Python runs it, and the result goes back into the conversation until the model calls `finish`.

    python examples/agents/react_agent.py "What is 17 * 23?"

Tools: a calculator (arithmetic only, evaluated through `ast`, never `eval`), a small local
lookup table, and `finish`. The loop reads each call to decide what to do next, so the
interpreter runs it step by step (no static graph). The first step must use a real tool
(`finish` is offered from the second step on): the small default model otherwise answers at
once, without one. String arguments are bounded by patterns (the grammar enforces them), so
every call is well-formed input for its tool and completes within the gen's token budget.
"""

from __future__ import annotations

import ast
import operator
import sys
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field

import radixlm as rl

TABLE = {
    "capital of france": "Paris", "capital of japan": "Tokyo", "capital of italy": "Rome",
    "population of paris": "2.1 million", "population of tokyo": "14 million",
    "boiling point of water": "100 degrees Celsius",
}
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def calculator(expression: Annotated[str, Field(pattern=r"^[0-9+*/(). -]{1,40}$")]) -> str:
    """Evaluate an arithmetic expression (+ - * / ** and parentheses over numbers)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is allowed")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def lookup(key: Annotated[str, Field(pattern=r"^[a-z ]{1,40}$")]) -> str:
    """Look up a fact by name, such as 'capital of france'; 'unknown' when it is not known."""
    return TABLE.get(key.strip().lower().rstrip("?."), "unknown")


def finish(answer: Annotated[str, Field(pattern=r"^[^\"\\<>{}]{1,60}$")]) -> str:
    """Give the final answer to the question."""
    return answer


TOOLS = [calculator, lookup, finish]
SYSTEM = ("You solve questions with tools: call one tool per turn, read its result, and call finish "
          "with the final answer.\n\n" + rl.describe_tools(TOOLS))


@rl.function
def react(s, question: str, max_steps: int = 3):
    s += rl.system(SYSTEM)
    s += rl.user("Question: " + question)
    for step in range(max_steps):
        # the first step must consult a tool: the small default model would otherwise answer at once
        tools = TOOLS[:2] if step == 0 else TOOLS
        s += rl.assistant(rl.gen("call", tools=tools, max_tokens=64))
        call = s["call"]  # a FunctionCall: name, validated arguments, call() runs the function
        if call.name == "finish":
            break
        s += rl.user(f"<tool_response>\n{call()}\n</tool_response>")


def main(question: str = "What is 17 * 23?", backend: Any = None) -> rl.ProgramState:
    return react.run(question, backend=backend, temperature=0)


if __name__ == "__main__":
    state = main(*sys.argv[1:2], backend=rl.Engine())
    for m in state.messages():
        print(f"[{m['role']}] {m['content']}")
