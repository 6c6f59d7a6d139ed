"""Build code-edit requests from real source code (HumanEval prompt + canonical solution).

What it does: turns one complete Python function into an instruction "return this code with X
changed" of three kinds: `rename` (function renamed, every reference updated), `type_hints`
(annotations stripped, the model adds them back) and `docstring` (docstrings stripped, the model
writes them). The answer is mostly a copy of the input, the workload where prompt-lookup and
suffix speculation shine.
What it does not do: check the model's answer.
"""
from __future__ import annotations

import ast

EDIT_KINDS = ("rename", "type_hints", "docstring")


def _new_name(name: str) -> str:
    """snake_case -> camelCase; a name without underscores gets a `compute_` prefix."""
    parts = name.split("_")
    if len(parts) > 1 and all(parts):
        return parts[0] + "".join(p[:1].upper() + p[1:] for p in parts[1:])
    return f"compute_{name}"


def strip_docstrings(code: str) -> str:
    """`code` with every function/class/module docstring removed (line-based, comments kept)."""
    tree = ast.parse(code)
    drop: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                if len(body) == 1:  # keep the function valid
                    continue
                drop.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = code.splitlines(keepends=True)
    return "".join(line for i, line in enumerate(lines, 1) if i not in drop)


def strip_annotations(code: str) -> str:
    """`code` without parameter and return annotations (re-printed by `ast.unparse`, comments lost)."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    arg.annotation = None
    return ast.unparse(tree) + "\n"


def build_edit(problem: dict, kind: str) -> tuple[str, str]:
    """(instruction text, the code it carries) for one HumanEval problem and one edit kind."""
    code = (problem["prompt"] + problem["canonical_solution"]).strip("\n") + "\n"
    entry = problem["entry_point"]
    fence = "Return the complete updated code in a single ```python block and nothing else."
    if kind == "rename":
        new = _new_name(entry)
        text = (f"Rename the function `{entry}` to `{new}` and update every reference to it. {fence}\n\n"
                f"```python\n{code.rstrip()}\n```")
    elif kind == "type_hints":
        code = strip_annotations(code)
        text = (f"Add precise type hints to every parameter and return value in this code, "
                f"importing from typing where needed. {fence}\n\n```python\n{code.rstrip()}\n```")
    elif kind == "docstring":
        code = strip_docstrings(code)
        text = (f"Add a concise Google-style docstring (summary, Args, Returns) to every function in "
                f"this code without changing the code itself. {fence}\n\n```python\n{code.rstrip()}\n```")
    else:
        raise ValueError(f"unknown edit kind {kind!r}; valid: {', '.join(EDIT_KINDS)}")
    return text, code
