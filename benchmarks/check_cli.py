"""The command line that ``ptx_check.py`` and ``sass_check.py`` share: the files to check or a
CMake build (``--build-dir``, as ``make cuda-check`` calls them) in, a report per file and the
exit status out."""

import argparse
from pathlib import Path

# (kernel, whether it failed, the word after its name, the lines under it)
Kernel = tuple[str, bool, str, list]


def parse(argv, doc: str, what: str, build_help: str) -> argparse.Namespace:
    """Parse ``[files ...] [--build-dir DIR]``; at least one of the two must be given.

    Args:
        argv: the arguments (``None``: ``sys.argv[1:]``).
        doc: the script's docstring; its first line describes the command.
        what: what the files are (``"PTX files"``), for their help and the usage error.
        build_help: the help of ``--build-dir``.

    Returns:
        The arguments: ``files`` (a list of paths) and ``build_dir`` (a path or ``None``).
    """
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help=f"{what} to check")
    p.add_argument("--build-dir", type=Path, help=build_help)
    args = p.parse_args(argv)
    if not args.files and args.build_dir is None:
        p.error(f"give {what}, or --build-dir")
    return args


def report(label: str, kernels: list[Kernel], missing: list[str], missing_note: str) -> bool:
    """Print one file's kernels, each with its lines, then the kernels missing from it (each
    with ``missing_note``); return whether any kernel failed or is missing."""
    print(f"{label}: {len(kernels)} kernels")
    for kernel, _, word, lines in kernels:
        print(f"  {kernel}: {word}")
        for line in lines:
            print(f"    {line}")
    for kernel in missing:
        print(f"  {kernel}: {missing_note}")
    return any(failed for _, failed, _, _ in kernels) or bool(missing)


def verdict(name: str, bad: bool, passed: str) -> int:
    """Print the last line, ``name: FAILED`` or ``name: passed``; return the exit status."""
    print(f"{name}: " + ("FAILED" if bad else passed))
    return 1 if bad else 0
