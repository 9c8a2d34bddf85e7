"""docs/errors.md lists every error fastddp raises on purpose.

Each ``raise`` of the package (its test bed, benchmarks and demo aside: their command lines'
errors have rows of their own, checked by their tests) is read from the source, and its
message traced to its literal text: written in the raise, held in a variable (each of the
function's assignments to it), or returned by a function of the package (each of its
returns, by the function's name). The text is taken as words of three letters or more (what
an f-string fills in, numbers and punctuation drop out). The message is listed when four of
those words in a row appear in one quoted message of errors.md's message column, read the same
way, in order and each at most 6 words after the one before (the doc fills in what the message
formats); messages of fewer than four such words are too short to tell apart and are not
checked. A raise whose message cannot be traced must be named in ``_UNLISTED`` with why; a new
error without a row fails here, naming its file, line and text.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_WORD = re.compile(r"[A-Za-z_]{3,}")
_NOT_CHECKED = ("fastddp/testing/", "fastddp/bench/", "fastddp/demo.py", "fastddp/netns.py")
# Python's own kinds of error that are not messages to a user.
_SKIPPED_TYPES = {"NotImplementedError", "AssertionError", "StopIteration", "SystemExit"}
# Raised on purpose but not traced to a row here, each with why: (file, the raise's source).
_UNLISTED = {
    # Python's own message for a missing module attribute (the lazy names of __getattr__).
    ("fastddp/__init__.py", "module 'fastddp' has no attribute"),
    # A runner of the hooks' jobs that waits is never given a callback by fastddp itself.
    ("fastddp/hooks/runtime.py", "completes jobs by waiting, not by callbacks"),
    # The ValueError of fastddp/nodelist.py, whose raises are checked here, as a VariableError.
    ("fastddp/cluster.py", "raise VariableError(str(e)) from None"),
    # The exception a thread of the join made (its raises are checked where they are made).
    ("fastddp/joining.py", "raise made[0]"),
    # The verdict rank 0 wrote in the store for every rank: joining.py's own messages.
    ("fastddp/joining.py", "raise ClusterError(verdict.decode())"),
    # The error a rank's own set-up raised (checked where it is made), raised once the ranks
    # have agreed, so that every rank raises.
    ("fastddp/fsdp/_agree.py", "raise problem"),
    # Caught by script_apart, which then leaves the line to torchrun's parser.
    ("fastddp/launch/options.py", "raise _Unparsed(message)"),
}


def _strings(node: ast.AST) -> list[str]:
    return [
        sub.value
        for sub in ast.walk(node)
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
    ]


def _called(func: ast.AST) -> str:
    return getattr(func, "id", getattr(func, "attr", ""))


class _Tracer:
    """The literal parts of a raise's message, traced through variables and functions."""

    def __init__(self, functions: dict[str, list]):
        self.functions = functions  # every function of the package, by name

    def parts(self, expr, scope, depth: int = 0):
        """``expr``'s message parts (an exception, or its message) in ``scope``; None where
        they cannot be traced."""
        if depth > 4 or expr is None:
            return None
        if isinstance(expr, (ast.Constant, ast.JoinedStr, ast.BinOp, ast.IfExp)):
            return _strings(expr)
        if isinstance(expr, ast.Name):
            values = [
                node.value
                for node in ast.walk(scope)
                if isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.value is not None
                and any(
                    isinstance(t, ast.Name) and t.id == expr.id
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                )
            ]
            return self._each(values, scope, depth)
        if isinstance(expr, ast.Call):
            if _called(expr.func) in self.functions:  # a function of the package: its returns
                found = [
                    (ret.value, function)
                    for function in self.functions[_called(expr.func)]
                    for ret in ast.walk(function)
                    if isinstance(ret, ast.Return) and ret.value is not None
                ]
                parts = [self.parts(value, function, depth + 1) for value, function in found]
                traced = [p for p in parts if p is not None]
                return [s for p in traced for s in p] if traced else None
            return self.parts(expr.args[0], scope, depth + 1) if expr.args else None
        return None

    def _each(self, values, scope, depth):
        # Where some assignments are None or another module's value, the others still say.
        parts = [self.parts(value, scope, depth + 1) for value in values]
        traced = [p for p in parts if p is not None]
        return [s for p in traced for s in p] if traced else None


def _sources():
    for path in sorted((ROOT / "fastddp").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(_NOT_CHECKED):
            yield rel, ast.parse(path.read_text())


def _messages():
    """(file, line, the raise's source, its message's literal text or None) of each raise."""
    trees = list(_sources())
    functions: dict[str, list] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.setdefault(node.name, []).append(node)
    tracer = _Tracer(functions)
    for rel, tree in trees:
        scope_of = {}  # each raise's innermost function (or the module): inner ones walked last
        scopes = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
        for scope in [tree, *sorted(scopes, key=lambda f: len(list(ast.walk(f))), reverse=True)]:
            for node in ast.walk(scope):
                if isinstance(node, ast.Raise):
                    scope_of[node] = scope
        for node, scope in scope_of.items():
            if node.exc is None:
                continue  # a re-raise
            if isinstance(node.exc, ast.Call) and _called(node.exc.func) in _SKIPPED_TYPES:
                continue
            parts = tracer.parts(node.exc, scope)
            text = None if parts is None else " ".join(parts)
            yield rel, node.lineno, ast.unparse(node), text


def _quoted_messages() -> list[list[str]]:
    """The words of each quoted message in errors.md's message column."""
    spans = []
    for line in (ROOT / "docs" / "errors.md").read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 3:
            spans += [_WORD.findall(s) for s in re.findall(r"`([^`]+)`", cells[1])]
    return spans


def _listed(words: list[str], quoted: list[list[str]]) -> bool:
    """Whether some run of 4 words of a message appears in one quoted message in order, at
    most 6 of its words apart (where the doc fills in what the message formats, or shortens
    it)."""
    for doc in quoted:
        for i in range(len(words) - 3):
            for at in (k for k, word in enumerate(doc) if word == words[i]):
                for word in words[i + 1 : i + 4]:
                    ahead = doc[at + 1 : at + 8]
                    if word not in ahead:
                        break
                    at += 1 + ahead.index(word)
                else:
                    return True
    return False


def test_every_error_raised_on_purpose_has_a_row():
    quoted = _quoted_messages()
    missing, untraced, checked = [], [], 0
    for rel, line, source, text in _messages():
        if any(rel == f and part in (text or source) for f, part in _UNLISTED):
            continue
        if text is None:
            untraced.append(f"{rel}:{line}: {source[:100]}")
            continue
        words = _WORD.findall(text)
        if len(words) < 4:
            continue
        checked += 1
        if not _listed(words, quoted):
            missing.append(f"{rel}:{line}: {' '.join(text.split())[:120]}")
    assert checked > 200, checked  # the reading of the sources found the package's errors
    assert not untraced, "raises whose message is not traced (name them in _UNLISTED):\n" + (
        "\n".join(untraced)
    )
    assert not missing, "errors without a row in docs/errors.md:\n" + "\n".join(missing)


def test_the_check_reads_a_message_as_errors_md_does():
    quoted = [_WORD.findall("--nnodes 'a:b': give N or MIN:MAX, whole numbers")]
    message = "--nnodes {x!r}: give N or MIN:MAX, whole numbers"
    assert _listed(_WORD.findall(message.replace("{x!r}", "")), quoted)
    assert not _listed(_WORD.findall(message.replace("MIN:MAX", "MAX:MIN")), quoted)
    # What the doc fills in may stand between the message's words; a word too far may not.
    assert _listed(
        _WORD.findall("topology must be one of , got "),
        [_WORD.findall("topology must be one of 'auto', 'flat', 'hierarchical', got 'x'")],
    )
    assert not _listed(
        _WORD.findall("the store is unreachable"),
        [_WORD.findall("the store of node 0, the one on its launcher, is unreachable")],
    )
    # One quoted message at a time: words of two do not make a third.
    assert not _listed(
        _WORD.findall("the quantised tensor must be empty"),
        [_WORD.findall("the quantised tensor"), _WORD.findall("must be empty")],
    )


def test_a_message_is_traced_through_a_variable_and_a_function():
    tree = ast.parse(
        "def why(n):\n"
        "    return f'the bucket holds {n} elements too many'\n"
        "def check(n):\n"
        "    problem = None\n"
        "    if n:\n"
        "        problem = why(n)\n"
        "    raise ValueError(problem)\n"
    )
    functions = {f.name: [f] for f in tree.body}
    raised = next(n for n in ast.walk(tree) if isinstance(n, ast.Raise))
    parts = _Tracer(functions).parts(raised.exc, functions["check"][0])
    assert " ".join(parts).split() == ["the", "bucket", "holds", "elements", "too", "many"]
