"""The per-bucket planner of ``dtype="auto"``: a model of one backward pass, fitted to the trial.

During the trial every candidate mode reduces every bucket for a few steps, and ``measured.py``
reads, per mode, the figures of :class:`Profile` off its steps: how long the backward pass
computes before each bucket is ready, the host time the mode's codec spends per element, the
bytes each bucket puts on the slowest link, and the time from the first bucket to the last
reduction's end. ``choice.py`` proposes the plan this model finds.

The model has two resources: the thread that runs the backward pass (and the hooks' encoding
and decoding) and the link, which carries one bucket after the other. A bucket goes on the link
once encoded and the link is free; it is decoded on the compute thread once its bytes are
through, at the next bucket (the pipeline's rule) or at the end of the backward pass. On the CPU
the pipeline waits for a mode's previous bucket once that mode's next bucket is on the link
(``blocking``).

The one figure the model cannot read off the trial is how fast each mode's collectives move its
bytes: all-reduce, all-to-all and two-level paths differ, and on the CPU the collectives share
the cores. :func:`calibrate` takes, for each mode, the link rate at which the model reproduces
that mode's measured reduction time (a slower link is not needed to explain a mode whose
transfers hide behind the backward pass, so it takes the slowest rate that still hides them).
:func:`search` then changes one bucket at a time, from the last bucket to the first: first
keeping changes that shorten the modelled pass, then changes to more accurate modes that keep
it within a small slack of the shortest.
"""

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Profile", "calibrate", "confirms", "search", "simulate"]

_LOWEST_RATE = 1e4  # bytes per second: the calibration's bounds
_HIGHEST_RATE = 1e13
_HIDDEN = 1.01  # a mode is "hidden" when its time is within this of the model's infinite rate


@dataclass
class Profile:
    """What the trial measured, per mode (keys of every dict: the candidate names).

    Attributes:
        numel: elements of each bucket, in the order the hook receives them.
        gaps: seconds of backward compute before each bucket reaches the hook (``gaps[m][0]``
            is unused: the first bucket starts the clock).
        cost: host seconds per element of encoding and decoding together.
        sent: bytes of each bucket on the slowest link (across nodes, when there are several).
        reduce_s: measured seconds from the first bucket reaching the hook to the end of the last
            reduction.
        blocking: modes whose pipeline waits on the compute thread for the previous bucket's
            transfer (compressed modes on CPU tensors).
    """

    numel: Sequence[int]
    gaps: dict[str, Sequence[float]]
    cost: dict[str, float]
    sent: dict[str, Sequence[float]]
    reduce_s: dict[str, float]
    blocking: frozenset = frozenset()


def simulate(profile: Profile, plan: Sequence[str], rates: dict[str, float]) -> float:
    """Modelled seconds from the first bucket to the end of the last reduction under ``plan``."""
    t = 0.0  # the compute thread's clock
    link = 0.0  # when the link is next free
    pending: list[tuple[float, float]] = []  # (bytes through, decode seconds), oldest first
    last_of: dict[str, float] = {}  # each mode's previous bucket: when its bytes are through

    def decode_through(t: float) -> float:
        while pending and pending[0][0] <= t:
            t += pending.pop(0)[1]
        return t

    for i, mode in enumerate(plan):
        if i:
            t += profile.gaps[plan[i - 1]][i]
        t = decode_through(t)
        half = profile.cost[mode] * profile.numel[i] / 2
        t += half  # encode, then the bucket goes on the link
        link = max(t, link) + profile.sent[mode][i] / rates[mode]
        if mode in profile.blocking and mode in last_of:
            t = decode_through(max(t, last_of[mode]))  # the pipeline waits for the one before
        pending.append((link, half))
        last_of[mode] = link
    for through, decode in pending:
        t = max(t, through) + decode
    return t


def calibrate(profile: Profile) -> dict[str, float]:
    """Each mode's link rate (bytes per second) that makes its uniform plan take its measured
    time: the slowest rate that hides its transfers where even an infinite one is too slow."""
    n = len(profile.numel)
    rates = {}
    for mode, measured in profile.reduce_s.items():
        plan = [mode] * n

        def at(rate: float, plan=plan, mode=mode) -> float:
            return simulate(profile, plan, {mode: rate})

        target = max(measured, at(_HIGHEST_RATE) * _HIDDEN)
        lo, hi = _LOWEST_RATE, _HIGHEST_RATE  # at(lo) >= target >= at(hi)
        if at(lo) <= target:
            rates[mode] = lo
            continue
        for _ in range(60):  # bisection on the logarithm: 2^-60 of 9 decades
            mid = (lo * hi) ** 0.5
            if at(mid) > target:
                lo = mid
            else:
                hi = mid
        rates[mode] = hi
    return rates


def search(
    profile: Profile,
    rates: dict[str, float],
    start: Sequence[str],
    order: Sequence[str],
    slack: float = 0.005,
    passes: int = 3,
) -> list[str]:
    """The plan reached from ``start`` by changing one bucket's mode at a time.

    First for speed: a change is kept if it shortens the modelled pass by more than 0.1 %.
    Then for accuracy: a change to a mode earlier in ``order`` is kept while the pass stays
    within ``slack`` of the fastest found. The last buckets, whose transfers the backward pass
    cannot hide, are tried first.
    """
    plan = list(start)
    best = simulate(profile, plan, rates)

    def improve(keep) -> None:
        nonlocal plan, best
        for _ in range(passes):
            changed = False
            for i in reversed(range(len(plan))):
                for mode in order:
                    if mode == plan[i]:
                        continue
                    trial = plan[:i] + [mode] + plan[i + 1 :]
                    took = simulate(profile, trial, rates)
                    if keep(took, order.index(mode) < order.index(plan[i])):
                        plan, best, changed = trial, min(best, took), True
            if not changed:
                return

    improve(lambda took, _: took < best * (1 - 1e-3))
    fastest = best
    improve(lambda took, accurate: accurate and took <= fastest * (1 + slack))
    return plan


def confirms(mixed_s: float, uniform_s: float, predicted_s: float, least: float) -> bool:
    """Whether measured steps of a mixed plan (``mixed_s``) and of the uniform plan confirm the
    modelled gain ``predicted_s``: faster by half of it, and by ``least`` of the uniform step."""
    return uniform_s - mixed_s >= max(least * uniform_s, predicted_s / 2)
