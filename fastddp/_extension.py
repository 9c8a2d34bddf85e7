"""Load the compiled ops (``fastddp._C``) once, with one clear error when the build is unusable."""

import ctypes
import importlib
import os
import sys

import torch

REBUILD = "pip install --no-build-isolation -e ."

_module = None


class ExtensionError(ImportError):
    """The compiled extension is missing, was built against another torch, or carries a C++
    runtime of its own."""


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def carries_cxx_runtime(path: str) -> bool:
    """Whether the loaded library at ``path`` defines libstdc++'s ``std::locale::classic()``
    itself: a copy of the C++ runtime linked in statically, beside torch's shared one.

    Such a copy shares torch's locale facet ids but not its locale: the first message that
    formats a number ends the process (setup.py's ``_cxx_runtime``). Linux only; False
    elsewhere, and where the copy hides its symbols.
    """
    if not sys.platform.startswith("linux"):
        return False
    lib = ctypes.CDLL(path)  # the loaded library again: dlsym searches it first
    try:
        address = ctypes.cast(lib["_ZNSt6locale7classicEv"], ctypes.c_void_p).value
    except AttributeError:
        return False
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not libc.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return False
    return os.path.realpath(info.dli_fname.decode()) == os.path.realpath(path)


def load():
    """Import ``fastddp._C`` (registering ``torch.ops.fastddp``) and check what it was built for.

    Returns:
        The ``fastddp._C`` module; its ``torch_version`` and ``with_cuda`` record the build.

    Raises:
        ExtensionError: the extension is missing or does not match the installed torch.
    """
    global _module
    if _module is not None:
        return _module
    try:
        module = importlib.import_module("fastddp._C")
    except ImportError as e:  # also covers OSError-style "undefined symbol" load failures
        raise ExtensionError(
            f"fastddp's compiled extension could not be loaded ({e}). It is missing or was "
            f"built against another torch; rebuild it from the source tree with: {REBUILD}"
        ) from e
    if module.torch_version != torch.__version__:
        raise ExtensionError(
            f"fastddp._C was built against torch {module.torch_version} but torch "
            f"{torch.__version__} is installed; rebuild it with: {REBUILD}"
        )
    if carries_cxx_runtime(module.__file__):
        raise ExtensionError(
            f"fastddp._C ({module.__file__}) carries its own copy of libstdc++, linked in "
            "statically by its compiler: the first op error that formats a number would end "
            "the process. Rebuild it with setup.py, which links the libstdc++.so.6 torch "
            f"uses: {REBUILD}"
        )
    _module = module
    return module


def build_info() -> dict:
    """Return what the loaded extension was built against."""
    module = load()
    return {"torch_version": module.torch_version, "with_cuda": bool(module.with_cuda)}
