"""docs/errors.md lists every error fastddp raises on purpose.

Each ``raise`` of the package (its test bed, benchmarks and demo aside: their command lines'
errors have rows of their own, checked by their tests) is read from the source: the literal
text of its message, as words of three letters or more (what an f-string fills in, numbers and
punctuation drop out). The message is listed when four of those words in a row appear in
errors.md's text, read the same way, in order and each at most 6 words after the one before
(the doc fills in what the message formats); messages of fewer than four such words are too short to
tell apart and are not checked. A new error without a row fails here, naming its file, line
and text.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_WORD = re.compile(r"[A-Za-z_]{3,}")
_NOT_CHECKED = ("fastddp/testing/", "fastddp/bench/", "fastddp/demo.py", "fastddp/netns.py")
# Python's own kinds of error that are not messages to a user.
_SKIPPED_TYPES = {"NotImplementedError", "AssertionError", "StopIteration", "SystemExit"}
# Raised on purpose but not for a user to act on, each with why.
_UNLISTED = {
    # Python's own message for a missing module attribute (the lazy names of __getattr__).
    ("fastddp/__init__.py", "module 'fastddp' has no attribute"),
    # A runner of the hooks' jobs that waits is never given a callback by fastddp itself.
    ("fastddp/hooks/runtime.py", "completes jobs by waiting, not by callbacks"),
}


def _messages():
    """(file, line, the literal text of the message) of each raise of the package."""
    for path in sorted((ROOT / "fastddp").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(_NOT_CHECKED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            kind = getattr(func, "id", getattr(func, "attr", ""))
            if kind in _SKIPPED_TYPES or not node.exc.args:
                continue
            parts = [
                sub.value
                for sub in ast.walk(node.exc.args[0])
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
            ]
            yield rel, node.lineno, " ".join(parts)


def _listed(words: list[str], doc: list[str]) -> bool:
    """Whether some run of 4 words of a message appears in the doc in order, at most 6 of the
    doc's words apart (where the doc fills in what the message formats, or shortens it)."""
    starts: dict[str, list[int]] = {}
    for at, word in enumerate(doc):
        starts.setdefault(word, []).append(at)
    for i in range(len(words) - 3):
        for at in starts.get(words[i], ()):
            for word in words[i + 1 : i + 4]:
                ahead = doc[at + 1 : at + 8]
                if word not in ahead:
                    break
                at += 1 + ahead.index(word)
            else:
                return True
    return False


def test_every_error_raised_on_purpose_has_a_row():
    doc = _WORD.findall((ROOT / "docs" / "errors.md").read_text())
    missing = []
    checked = 0
    for rel, line, text in _messages():
        words = _WORD.findall(text)
        if len(words) < 4 or any(rel == f and part in text for f, part in _UNLISTED):
            continue
        checked += 1
        if not _listed(words, doc):
            missing.append(f"{rel}:{line}: {' '.join(text.split())[:120]}")
    assert checked > 200, checked  # the reading of the sources found the package's errors
    assert not missing, "errors without a row in docs/errors.md:\n" + "\n".join(missing)


def test_the_check_reads_a_message_as_errors_md_does():
    doc = _WORD.findall("`--nnodes 'a:b': give N or MIN:MAX, whole numbers` / `topology x`")
    message = "--nnodes {x!r}: give N or MIN:MAX, whole numbers"
    assert _listed(_WORD.findall(message.replace("{x!r}", "")), doc)
    assert not _listed(_WORD.findall(message.replace("MIN:MAX", "MAX:MIN")), doc)
    # What the doc fills in may stand between the message's words; a word too far may not.
    assert _listed(
        _WORD.findall("topology must be one of , got "),
        _WORD.findall("`topology must be one of 'auto', 'flat', 'hierarchical', got 'x'`"),
    )
    assert not _listed(
        _WORD.findall("the store is unreachable"),
        _WORD.findall("the store of node 0, the one on its launcher, is unreachable"),
    )
