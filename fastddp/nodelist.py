"""Slurm's host lists (``node[01-04,07],gpu5``) expanded into host names, as Slurm does."""

import re

__all__ = ["expand"]


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"malformed Slurm node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"malformed Slurm node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str, whole: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"malformed Slurm node list {whole!r}: bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"malformed Slurm node list {whole!r}: {item!r} runs backwards")
        width = len(lo)  # node[01-10] keeps the zero padding
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as ``node[01-04,07],gpu5`` into host names, in order.

    Several bracket groups in one name (``rack[1-2]-n[1-2]``) expand as Slurm does.

    Raises:
        ValueError: the list is malformed; the message quotes it and says where.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        m = re.search(r"\[([^\[\]]*)\]", part)
        if m is None:
            hosts.append(part)
            continue
        head, tail = part[: m.start()], part[m.end() :]
        for middle in _expand_range(m.group(1), nodelist):
            hosts.extend(expand(head + middle + tail))
    if not hosts:  # ("," or spaces: its first host was read as hosts[0])
        raise ValueError(f"malformed Slurm node list {nodelist!r}: it names no host")
    return hosts
