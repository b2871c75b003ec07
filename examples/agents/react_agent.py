"""A ReAct agent: the model picks a tool (select), writes its input (gen), Python runs the tool,
and the observation goes back into the conversation until the model picks `finish`.

    python examples/agents/react_agent.py "What is 17 * 23?"

Tools: a calculator (arithmetic only, evaluated through `ast`, never `eval`) and a small local
lookup table. The loop reads generated values to decide what to do next, so the interpreter runs
it step by step (no static graph). The first step must use a tool (`finish` is offered from the
second step on): the small default model otherwise answers at once, without one.
"""

from __future__ import annotations

import ast
import operator
import sys
from collections.abc import Callable
from typing import Any

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


def calculator(expression: str) -> str:
    """Evaluate + - * / ** and parentheses over numbers; anything else is an error message."""
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


def lookup(key: str) -> str:
    """A fact from the local table, or 'unknown'."""
    return TABLE.get(key.strip().lower().rstrip("?."), "unknown")


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "lookup": lookup}
SYSTEM = (
    "You solve questions with tools. Each turn, pick an action and its input.\n"
    "Actions: calculator (input: an arithmetic expression), lookup (input: a fact name such as "
    "'capital of france'), finish (input: the final answer).\n"
    "Example: question 'What is 2 + 3?' -> Action: calculator, Input: 2 + 3; after the "
    "observation 5 -> Action: finish, Input: 5."
)


@rl.function
def react(s, question: str, max_steps: int = 3):
    s += rl.system(SYSTEM)
    s += rl.user("Question: " + question)
    for step in range(max_steps):
        # the first step must consult a tool: the small default model would otherwise answer at once
        actions = list(TOOLS) if step == 0 else [*TOOLS, "finish"]
        with s.assistant():
            s += "Action: " + rl.select("action", actions)
            s += "\nInput: " + rl.gen("input", max_tokens=16, stop="\n")
        if s["action"] == "finish":
            break
        s += rl.user("Observation: " + TOOLS[s["action"]](s["input"]))


def main(question: str = "What is 17 * 23?", backend: Any = None) -> rl.ProgramState:
    return react.run(question, backend=backend, temperature=0)


if __name__ == "__main__":
    state = main(*sys.argv[1:2], backend=rl.Engine())
    for m in state.messages():
        print(f"[{m['role']}] {m['content']}")
