"""Tree-of-thought: fork the reasoning into `width` options at each of `depth` levels (8 leaves
for 2 x 3), let the model judge every leaf, and report the best path.

    python examples/agents/tree_of_thought.py

The program never reads a generated value while it runs, so it compiles into one request graph
of nested forks: sibling branches run concurrently, and each fork prefills its parent's text
once so that every branch reads it from the radix cache.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import radixlm as rl

PROBLEM = "A farmer has 3 fields and plants 4 rows of corn in each field. How many rows in total?"


def expand(s, width: int, depth: int, step_tokens: int) -> None:
    """Fork `width` next steps; recurse until depth 0, where the model judges the path."""
    if depth == 0:
        s += "\nIs this reasoning correct? Answer:" + rl.select("verdict", [" yes", " no"])
        return
    branches = s.fork(width)
    for i, b in enumerate(branches):
        b += f"\nStep (idea {i + 1}):" + rl.gen(f"step{depth}", max_tokens=step_tokens, stop="\n")
        expand(b, width, depth - 1, step_tokens)
    branches.join()


@rl.function
def tree_of_thought(s, problem: str, width: int = 2, depth: int = 3, step_tokens: int = 10):
    s += "Problem: " + problem + "\nLet's think step by step."
    expand(s, width, depth, step_tokens)


def best_path(state: rl.ProgramState, width: int = 2, depth: int = 3) -> tuple[float, list[str]]:
    """The path whose leaf the model judged most likely correct: (mean logprob of ' yes', steps).

    Joins gather nested lists: ``state["step3"][i]``, ``state["step2"][i][j]``,
    ``state["step1"][i][j][k]`` and the verdict's meta info at ``[i][j][k]``."""
    def at(nested: Any, index: tuple[int, ...]) -> Any:
        for i in index:
            nested = nested[i]
        return nested

    metas = state.get_meta_info("verdict")
    paths = []
    for leaf in itertools.product(range(width), repeat=depth):
        steps = [at(state[f"step{d}"], leaf[: depth - d + 1]) for d in range(depth, 0, -1)]
        paths.append((at(metas, leaf)["scores"][0], steps))
    return max(paths)


def main(backend: Any = None, width: int = 2, depth: int = 3,
         step_tokens: int = 10) -> tuple[rl.ProgramState, float, list[str]]:
    state = tree_of_thought.run(PROBLEM, width, depth, step_tokens, backend=backend, temperature=0)
    score, path = best_path(state, width, depth)
    return state, score, path


if __name__ == "__main__":
    _, score, path = main(backend=rl.Engine(*sys.argv[1:2]))
    print(f"best path (mean logprob of ' yes' = {score:.3f}):")
    for step in path:
        print(" -", step.strip())
