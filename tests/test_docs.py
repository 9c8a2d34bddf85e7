"""The documentation's links lead somewhere and its commands parse.

Every relative link of the README, ``docs/``, ``benchmarks/RESULTS.md`` and
``benchmarks/results/`` must name a file that exists, and an ``#anchor`` into a markdown file a
heading of it. Every command in a code block is checked without running it:
``python -m fastddp.bench`` and ``python -m fastddp.launch`` lines parse with their tools'
parsers, ``make`` names targets of the Makefile, ``python some/script.py`` names a script that
exists.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
    + list((ROOT / "docs").glob("*.md"))
    + list((ROOT / "benchmarks" / "results").glob("*.md"))
)
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")


def _name(page):
    return page.relative_to(ROOT).as_posix()


def _split(page):
    """Return the page's prose lines and its code blocks, each with its line number."""
    prose, code = [], []
    fenced = False
    previous_blank = True
    in_indented = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            in_indented = False
            previous_blank = False
            continue
        if fenced:
            code.append((number, line))
            continue
        indented = line.startswith("    ") and line.strip()
        if indented and (previous_blank or in_indented):
            in_indented = True
            code.append((number, line.strip()))
        else:
            in_indented = False
            prose.append((number, line))
        previous_blank = not line.strip()
    return prose, code


def slug(heading):
    """Return the anchor GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    text = _INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page):
    """Return every anchor of a markdown page (repeated headings get -1, -2, ... as on GitHub)."""
    seen, result = {}, set()
    prose, _ = _split(page)
    for _, line in prose:
        if not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(page):
    """Return (line, target) for every relative link of the page, outside code."""
    found = []
    prose, _ = _split(page)
    for number, line in prose:
        text = _INLINE_CODE.sub("", line)
        targets = _LINK.findall(text) + _REFERENCE.findall(text)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            found.append((number, target))
    return found


def _commands(page):
    """Return (line, command) for every command line of the page's code blocks."""
    found, pending, start = [], "", None
    _, code = _split(page)
    for number, line in code:
        stripped = line.strip()
        if pending:
            pending += " " + stripped
        else:
            pending, start = stripped, number
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        found.append((start, pending))
        pending = ""
    if pending:
        found.append((start, pending))
    return found


def _words(command):
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return []
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value before it
        words.pop(0)
    return words


def _python_at(words):
    """Return the index of the python executable in ``words``, or None."""
    for i, word in enumerate(words):
        if re.match(r"^python3?$", Path(word).name) and not word.startswith("-"):
            return i
    return None


def classify(command):
    """Return (kind, arguments) for a command the docs check, or None for anything else."""
    words = _words(command)
    if not words:
        return None
    if words[0] == "make":
        return "make", words[1:]
    at = _python_at(words)
    if at is None or at + 1 >= len(words):
        return None
    rest = words[at + 1 :]
    if rest[0] == "-m" and len(rest) > 1:
        if rest[1] in ("fastddp.bench", "fastddp.launch"):
            return rest[1], rest[2:]
        return None
    if rest[0].endswith(".py"):
        return "script", rest[:1]
    return None


def _all_commands():
    cases = []
    for page in PAGES:
        for number, command in _commands(page):
            kind = classify(command)
            if kind is not None:
                cases.append(pytest.param(kind[0], kind[1], id=f"{_name(page)}:{number}"))
    return cases


def _make_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def _parses(parser, argv):
    """Return None if ``parser`` accepts ``argv``, else what it printed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip() or f"exit {e.code}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_lead_to_files_and_headings(page):
    broken = []
    for number, target in links(page):
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        if not goal.exists():
            broken.append(f"{_name(page)}:{number}: {target}: no such file")
        elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
            broken.append(f"{_name(page)}:{number}: {target}: no heading #{anchor}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("kind, argv", _all_commands())
def test_commands_in_code_blocks_parse(kind, argv):
    if kind == "make":
        targets = _make_targets()
        named = [w for w in argv if not w.startswith("-") and "=" not in w]
        assert named, "make with no target"
        missing = [t for t in named if t not in targets]
        assert not missing, f"no such Makefile target: {missing}"
    elif kind == "script":
        assert (ROOT / argv[0]).is_file(), f"no such script: {argv[0]}"
    elif kind == "fastddp.bench":
        from fastddp.bench.cli import _parser

        problem = _parses(_parser(), argv)
        assert problem is None, f"python -m fastddp.bench {shlex.join(argv)}\n{problem}"
    else:
        from fastddp.launch.cli import build_parser

        parser = build_parser()
        problem = _parses(parser, argv)
        assert problem is None, f"python -m fastddp.launch {shlex.join(argv)}\n{problem}"
        script = parser.parse_args(argv).training_script
        if "/" in script:  # a path in this tree, not a placeholder such as train.py
            assert (ROOT / script).is_file(), f"no such script: {script}"


def test_the_checks_see_the_commands():
    """The extraction finds the commands it is meant to check (so the test cannot pass empty)."""
    kinds = {case.values[0] for case in _all_commands()}
    assert {"make", "script", "fastddp.bench", "fastddp.launch"} <= kinds
    assert classify("OMP_NUM_THREADS=1 python -m fastddp.bench ddp --link 1gbit")[0] == (
        "fastddp.bench"
    )
    assert classify("srun --ntasks-per-node=1 python -m fastddp.launch train.py")[0] == (
        "fastddp.launch"
    )
    assert classify("pip install .") is None


def test_the_readme_is_a_landing_page_that_links_every_docs_page():
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for _, t in links(readme)}
    unlinked = [_name(p) for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_results_page_is_linked_from_results():
    results = ROOT / "benchmarks" / "RESULTS.md"
    linked = {(results.parent / t.partition("#")[0]).resolve() for _, t in links(results)}
    pages = (ROOT / "benchmarks" / "results").glob("*.md")
    unlinked = [_name(p) for p in pages if p.resolve() not in linked]
    assert not unlinked, f"results pages RESULTS.md does not link: {unlinked}"


def test_every_top_level_name_the_docs_use_is_exported():
    # ``fastddp.X`` in a page is a name of ``from fastddp import *`` or a submodule (not a
    # file such as ``fastddp.cpp``, nor a state dict key such as ``fastddp.rank0_of_3``).
    import importlib.util

    import fastddp

    assert set(fastddp._LAZY) <= set(fastddp.__all__)
    used = set()
    for page in PAGES:
        used |= set(re.findall(r"(?<![\w/.])fastddp\.([A-Za-z_]\w*)", page.read_text()))
    used -= {"cpp", "rank0_of_3", "rankR_of_W", "OP"}  # a file, keys, an op placeholder
    missing = sorted(
        name
        for name in used
        if name not in fastddp.__all__ and importlib.util.find_spec(f"fastddp.{name}") is None
    )
    assert not missing, f"fastddp.<name> in the docs, neither exported nor a module: {missing}"
