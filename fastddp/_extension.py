"""Load the compiled ops (``fastddp._C``) once, with one clear error when the build is unusable."""

import importlib

import torch

REBUILD = "pip install --no-build-isolation -e ."

_module = None


class ExtensionError(ImportError):
    """The compiled extension is missing, or was built against another torch."""


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
    _module = module
    return module


def build_info() -> dict:
    """Return what the loaded extension was built against."""
    module = load()
    return {"torch_version": module.torch_version, "with_cuda": bool(module.with_cuda)}
