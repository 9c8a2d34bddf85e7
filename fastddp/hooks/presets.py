"""Presets: the one table of named modes of :class:`~fastddp.CompressState`.

A name says what travels on the wire and how it is summed: ``bf16`` lets the collective sum
bf16 payloads (rounding at every hop); ``-acc`` sums the payloads in fp32 (one rounding however
many ranks); ``-ef`` adds error feedback. int8, int4 and int2 are always summed in fp32
(int4 and int2 are for slow links; int2 trains only with error feedback). Benchmarks, tests,
examples and docs take mode names from here; benchmark modes are these names prefixed with
``fastddp-`` (next to ``fp32``, ``torch-fp16``, ``powersgd-r1``, ...).
"""

from typing import Any

import torch

__all__ = ["PRESETS", "named_preset", "preset"]

_ACC = {"accumulate_dtype": torch.float32}
_EF = {"error_feedback": True}

PRESETS: dict[str, dict[str, Any]] = {
    "fp16": {"dtype": torch.float16},
    "bf16": {"dtype": torch.bfloat16},
    "fp16-acc": {"dtype": torch.float16, **_ACC},
    "bf16-acc": {"dtype": torch.bfloat16, **_ACC},
    "bf16-acc-ef": {"dtype": torch.bfloat16, **_ACC, **_EF},
    "int8": {"dtype": torch.int8},
    "int8-ef": {"dtype": torch.int8, **_EF},
    "int4-ef": {"dtype": torch.int4, **_EF},
    "int2-ef": {"dtype": torch.int2, **_EF},
}


def preset(name: str) -> dict[str, Any]:
    """Return a copy of the :class:`~fastddp.CompressState` keyword arguments of ``name``.

    Raises:
        ValueError: ``name`` is not in :data:`PRESETS` (the message lists the names).
    """
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown fastddp preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def named_preset(value: Any, where: str = "CompressState.from_preset") -> str:
    """``"; 'int8-ef' is a preset: ...from_preset('int8-ef')"`` where ``value`` names a preset
    (given where a dtype or a state goes), else ``""``: the end of an error's message."""
    if isinstance(value, str) and value in PRESETS:
        return f"; {value!r} is a preset: {where}({value!r})"
    return ""
