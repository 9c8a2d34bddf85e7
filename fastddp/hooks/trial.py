"""The trial of ``dtype="auto"``: whose turn each step is, and what each measured round leaves.

The plan is made by trial, on the job itself. After one warm-up step and one unmeasured step of
each candidate that makes buffers, the candidates take turns, one step each, for up to
``trial_rounds`` - 1 measured rounds. Taking turns step by step puts every candidate under the
same drifts of the machine's load. A step's figure is its period, from one backward's first
bucket to the next's (forward, backward, waiting and optimizer, all of it; on CUDA the device's
queue emptied at each, :func:`settle`, so that it is the kernels' period). After each round the
slowest rank's medians (one all-reduce) drop the candidates that cannot win, ``eliminate`` times
slower than the fastest: on a slow link fp32 runs one measured step, not three. Where the two
fastest left then lie within ``runoff`` of each other, they take ``runoff_rounds`` more turns
(one step varies by about 7 % on a shared machine, and two modes can lie closer than that).
``"none"`` is ranked ``plain_edge`` faster than measured (:func:`ranked`): compression must beat
it by more than the trial's noise. What is then chosen from those left is ``choice.py``'s.

The figures are :class:`Rules`, the constants of ``fastddp.hooks.auto`` read at each decision.
"""

import statistics
import zlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from fastddp.hooks import handshake
from fastddp.hooks.candidates import MIXED, NONE
from fastddp.hooks.measured import StepRecord

__all__ = ["Rules", "Trial", "agree", "ranked", "settle", "steps"]

Turn = tuple[str, Optional[str]]  # (label, kind): kind "trial", "verify" or None (not measured)


class Rules(NamedTuple):
    """The figures ``dtype="auto"`` decides by (see ``fastddp.hooks.auto``'s constants)."""

    trial_rounds: int
    verify_rounds: int
    check_every: int
    margin: float
    prefer: float
    plain_edge: float
    mix_gain: float
    eliminate: tuple
    runoff: float
    runoff_rounds: int


class Trial:
    """The turns of one trial, from step ``start`` on, and the measured steps they recorded."""

    __slots__ = ("allow", "start", "turns", "rounds", "round_ms", "records")

    def __init__(self, allow: tuple[str, ...], start: int = 0) -> None:
        self.allow, self.start = allow, start
        turns = [(allow[0], None)]  # the warm-up: DDP lays its buckets out again after it
        turns += [(name, None) for name in allow if name != NONE]  # buffers are made
        self.turns: list[Turn] = turns + [(name, "trial") for name in allow]
        self.rounds = [list(allow)]  # the candidates of each measured round
        self.round_ms: list[dict[str, float]] = []  # the slowest rank's medians after each
        self.records: dict[str, list[StepRecord]] = {}  # by "kind:label"

    def turn(self, step: int) -> Optional[Turn]:
        """The turn of ``step``, or None past the turns scheduled so far."""
        k = step - self.start
        return self.turns[k] if k < len(self.turns) else None

    def add(self, finished: list[StepRecord], periods: list[float]) -> None:
        """Keep the measured ones of the steps ``finished``, with their periods (the last
        ``len(periods)`` steps have one: the first step of all has none)."""
        n = min(len(finished), len(periods))
        for record, seconds in zip(finished[len(finished) - n :], periods[len(periods) - n :]):
            if record.kind is not None:
                record.period = seconds
                self.records.setdefault(f"{record.kind}:{record.label}", []).append(record)

    def periods(self, kind: str, label: str) -> list[float]:
        return [r.period for r in self.records.get(f"{kind}:{label}", [])]

    def runs(self) -> dict[str, list[StepRecord]]:
        """Each candidate's measured trial steps."""
        return {n: self.records.get(f"trial:{n}", []) for n in self.allow}

    def collectives(self) -> Iterator[list[tuple]]:
        """The collectives of each measured trial step (``links.py``)."""
        for key, records in self.records.items():
            if key.startswith("trial:"):
                yield from (r.collectives for r in records)

    def slowest(self, group, device: torch.device) -> dict[str, float]:
        """Each candidate's median measured step on the slowest rank (one all-reduce)."""
        medians = [statistics.median(self.periods("trial", n)) for n in self.allow]
        figures = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(self.allow, figures.tolist()))

    def next_round(
        self, measured_s: dict[str, float], rules: Rules, none_last: bool
    ) -> Optional[list[str]]:
        """After a measured round, from the slowest rank's medians ``measured_s``: schedule
        another round of the candidates that can still win and return None, or return those
        left to choose from. ``none_last``: a later round runs ``"none"`` last."""
        alive, measured = self.rounds[-1], len(self.rounds)
        self.round_ms.append({n: measured_s[n] * 1e3 for n in alive})
        seconds = ranked(measured_s, rules.plain_edge)
        last = rules.trial_rounds - 1 + rules.runoff_rounds  # the most measured rounds
        if measured <= rules.trial_rounds - 1:
            fastest = min(seconds[n] for n in alive)
            limit = rules.eliminate[min(measured, len(rules.eliminate)) - 1]
            alive = [n for n in alive if seconds[n] <= limit * fastest]
        if measured == rules.trial_rounds - 1 and len(alive) > 1 and rules.runoff_rounds > 0:
            # The run-off: the two fastest, if their medians lie within the trial's noise.
            first, second = sorted(alive, key=lambda n: seconds[n])[:2]
            if seconds[second] <= seconds[first] * (1 + rules.runoff):
                alive = [n for n in alive if n in (first, second)]
            else:
                last = measured  # no run-off: the trial ends here
        if measured < last and len(alive) > 1:
            if none_last and NONE in alive:
                # Its turns run in C++, handed over by the step before, whose candidate must
                # be known then: not the first of a round, which is decided at its first bucket.
                alive = [n for n in alive if n != NONE] + [NONE]
            self.rounds.append(alive)
            self.turns += [(name, "trial") for name in alive]
            return None
        return alive

    def verify(self, uniform: str, rounds: int) -> None:
        """Schedule the turns of a proposed mixed plan and the uniform choice."""
        self.turns += [(MIXED, "verify"), (uniform, "verify")] * rounds


def settle(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA) before a trial's step is timed: the host
    runs ahead of the kernels, and the period between two of its clock readings would be the
    host's, or the backlog another candidate's turn left, not the step's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ranked(seconds: dict[str, float], plain_edge: float) -> dict[str, float]:
    """The figures candidates are ranked by: ``"none"``'s lowered by ``plain_edge``."""
    return {n: s / (1 + plain_edge) if n == NONE else s for n, s in seconds.items()}


def steps(allow: Sequence[str], rules: Rules) -> int:
    """Steps before the first plan at most: a warm-up, a round of the candidates that make
    buffers, ``trial_rounds`` - 1 measured rounds and, with several candidates, a run-off of
    two and the turns of a proposed mixed plan."""
    several = len(allow) > 1
    verify = 2 * rules.verify_rounds if several else 0
    runoff = 2 * rules.runoff_rounds if several else 0
    made = sum(name != NONE for name in allow)
    return 1 + made + (rules.trial_rounds - 1) * len(allow) + runoff + verify


def agree(
    allow: Sequence[str],
    rules: Rules,
    cpp: bool,
    group,
    device: torch.device,
    plan: Optional[str] = None,
    topology: str = "auto",
    load_problem: Optional[str] = None,
    loaded: tuple = (),
) -> None:
    """Raise, on every rank alike, unless every rank runs the same trial (``cpp``: registered
    with :func:`fastddp.register_comm_hook`, which orders the turns) or the same ``plan`` (what
    a loaded state dict runs, None for none), or if a rank's load failed (``load_problem``) or
    loaded residuals of another rank, world size or model (``loaded``: the candidates)."""
    # First the handshake a fixed mode's first bucket makes: a rank given a fixed mode meets
    # this one there, and both raise (in the trial's own check below, they would not meet).
    rows = handshake.exchange_auto(topology, group, device, load_problem is not None, loaded)
    handshake.check(rows, load_problem)
    # A rank with other candidates would issue other collectives.
    mine = zlib.crc32(",".join(allow).encode())
    figures = [mine, rules.trial_rounds, rules.verify_rounds, rules.check_every, int(cpp)]
    figures.append(0 if plan is None else zlib.crc32(plan.encode()) + 1)
    rows = torch.tensor(figures, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, rows, group=group)
    differ = [r for r, row in enumerate(everyone) if not torch.equal(row[:-1], everyone[0][:-1])]
    if differ:
        raise ValueError(
            f"fastddp: ranks disagree on CompressState(dtype='auto', allow=...): ranks "
            f"{differ} differ from rank 0 (this rank allows {list(allow)}, registered "
            f"{'with' if cpp else 'without'} fastddp.register_comm_hook); give every rank the "
            "same allow list, register every rank's hook alike (and the same fastddp version)"
        )
    plans = [int(row[-1]) for row in everyone]
    if len(set(plans)) > 1:
        # A rank running a loaded plan issues other collectives than one that starts a trial.
        kinds = {p: [r for r, q in enumerate(plans) if q == p] for p in dict.fromkeys(plans)}
        names = iter("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        lines = [
            f"  ranks {ranks}: " + ("no plan" if p == 0 else f"plan {next(names, '?')}")
            for p, ranks in kinds.items()
        ]
        raise ValueError(
            "fastddp: CompressState(dtype='auto').load_state_dict gave the ranks different "
            f"plans (this rank's: {plan or 'none'}):\n" + "\n".join(lines) + "\nLoad into "
            "every rank the state dict it saved in the same job (every rank saves the same "
            "plan), on every rank or on none."
        )
