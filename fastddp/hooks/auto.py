"""``CompressState(dtype="auto")``: the plan that makes the step shortest, chosen by measuring.

Each allowed mode is a candidate: ``"none"`` (PyTorch's fp32 all-reduce hook) or a preset of
:data:`fastddp.PRESETS`, each a fixed :class:`~fastddp.CompressState` of its own. The plan is
made by trial, on the job itself. After one warm-up step and one unmeasured step of each
candidate that makes buffers, the candidates take turns, one step each, for up to
:data:`TRIAL_ROUNDS` - 1 measured rounds. Taking turns step by step puts every candidate under
the same drifts of the machine's load. A step's figure is its period, from one backward's first
bucket to the next's (forward, backward, waiting and optimizer, all of it). After each round the
slowest rank's medians (one all-reduce) drop the candidates that cannot win, :data:`ELIMINATE`
times slower than the fastest: on a slow link fp32 runs one measured step, not three. Where the
two fastest left then lie within :data:`RUNOFF` of each other, they take
:data:`RUNOFF_ROUNDS` more turns (one step varies by about 7 % on a shared machine, and two modes
can lie closer than that). Then the medians decide, identically on every rank: the fastest
candidate left, or the first in ``allow`` order within :data:`PREFER` of it, so that a mode
compresses only when that pays measurably. ``"none"`` is ranked :data:`PLAIN_EDGE` faster than
measured, in the eliminations, the run-off and the choice: compression must beat it by more
than the trial's noise.

Then, per bucket (``planner.py``): the trial also recorded (``measured.py``) when each bucket
reached the hook, the host time of each codec and the bytes each bucket sent, and a model of the
backward pass fitted to those figures proposes a mode per bucket: fewer bytes where the backward
pass cannot hide the transfer, more accurate modes where it can. Rank 0's proposal is broadcast.
It is tried only if the model makes the step shorter by :data:`MIX_GAIN` of the uniform choice's
step, by taking turns with the uniform choice for :data:`VERIFY_ROUNDS` rounds, and kept only if
the turns confirm the model: faster by half the modelled gain, and by :data:`PREFER` at least
(where compute and transfers share the same cores, the model's overlap is not there). With the
default four candidates the plan is made by step 16 (at step 8 where one candidate is left after
the first round), 22 after a run-off, and 6 steps later when a mixed plan was tried. Mixed plans
are proposed for CPU tensors only: on CUDA the host's clock does not see the kernels.

The trial also times each level of the network (``links.py``): every collective of a measured
step, with its bytes, its level (inside a node, across nodes, or flat over both) and when it
was issued and completed. ``stats()["plan"]["links"]`` has what each level gave, per node, and
the INFO line says it.

Then every :data:`CHECK_EVERY` steps the median period is held against the planned figure
(again the slowest rank's); off by more than :data:`MARGIN` at two checks in a row (a link
that degrades, or recovers), the trial runs again. During a trial each candidate keeps its
error-feedback residuals in its own buckets until its next turn. At a new plan, the residuals of
every bucket a candidate no longer reduces are owed: the next buckets holding those parameters
add them before they are reduced, and so when DDP moves a parameter to a bucket of another
mode (``owed.py``). Nothing error feedback kept is lost.

Registered with :func:`fastddp.register_comm_hook`, ``"none"`` runs in a hook in C++
(``csrc/ddp/switch_hook.cpp``): PyTorch's fp32 all-reduce without Python. Its measured trial
turns are handed over by the step before and recorded there (so a later round runs it last),
and a plan of ``"none"`` hands over the steps between two checks; the C++ hook stamps when each
step starts, and the checks read those stamps.
"""

import logging
import statistics
import time
import zlib
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from fastddp import _extension
from fastddp.hooks import links, measured, planner
from fastddp.hooks.hook import compress_hook
from fastddp.hooks.measured import StepRecord
from fastddp.hooks.owed import Owed
from fastddp.hooks.presets import PRESETS
from fastddp.hooks.state import CompressState

__all__ = ["AutoState", "DEFAULT_ALLOW", "MIXED", "NONE"]

NONE = "none"
MIXED = "mixed"  # the label of a plan with a mode per bucket
DEFAULT_ALLOW = (NONE, "bf16", "bf16-acc", "int8-ef")
TRIAL_ROUNDS = 4  # steps per candidate in a trial, taken in turns; the first is not measured
VERIFY_ROUNDS = 3  # turns of a proposed mixed plan and the uniform choice
CHECK_EVERY = 10  # steps between checks of the planned step time
MARGIN = 0.25  # relative change of the step time that, at two checks in a row, re-plans
PREFER = 0.02  # a candidate earlier in ``allow`` within this of the fastest is chosen
# "none" is ranked as if this much faster: compression is chosen only where it measures faster
# by more than a trial's noise (no compression is exact, and where modes lie that close, noise
# picks the winner; the promise is never to be slower than no compression).
PLAIN_EDGE = 0.05
MIX_GAIN = 0.05  # a mixed plan is tried if the model makes the step shorter by this much
# After measured round r (1, 2), a candidate this much slower than the fastest is out: a step of
# a shared machine can take twice another's, so one measured step must show more than that.
ELIMINATE = (2.5, 1.5)
# Two candidates left within RUNOFF of each other after the measured rounds take RUNOFF_ROUNDS
# more turns, and all their steps decide: one step varies by about 7 % on a shared machine.
RUNOFF = 0.10
RUNOFF_ROUNDS = 3

logger = logging.getLogger("fastddp")
_PATHS = ("flat", "hierarchical")  # the paths a candidate may name: "int8-ef:flat"
# Settings of a fixed mode, which dtype="auto" takes only at their defaults.
_FIXED_ONLY = ("accumulate_dtype", "error_feedback", "stochastic_rounding", "block_size", "delay")
Assignment = Union[str, tuple[str, ...]]  # one mode for every bucket, or a mode per bucket


def _checked_allow(allow) -> tuple[str, ...]:
    if allow is None:
        return DEFAULT_ALLOW
    if isinstance(allow, str) or not hasattr(allow, "__iter__"):
        raise TypeError(
            f"CompressState: allow must be a list of mode names, got {allow!r}; for example "
            "allow=['none', 'bf16', 'int8-ef']"
        )
    names = tuple(allow)
    bad = [n for n in names if not _known(n)]
    if bad or not names or len(set(names)) != len(names):
        why = f"unknown {bad}" if bad else "empty" if not names else "repeated names"
        raise ValueError(
            f"CompressState: allow is {why}; name each candidate once, from "
            f"{', '.join((NONE, *PRESETS))}, a preset with a path ('int8-ef:flat', "
            f"'int8-ef:hierarchical') included"
        )
    return names


def _known(name) -> bool:
    if not isinstance(name, str):
        return False
    preset, _, path = name.partition(":")
    return name == NONE or (preset in PRESETS and path in ("", *_PATHS))


def _make(name: str, process_group, topology: str, seed: int) -> CompressState:
    """The candidate ``name``: a preset, with the path after a colon if one is named."""
    preset, _, path = name.partition(":")
    return CompressState.from_preset(preset, process_group, topology=path or topology, seed=seed)


class AutoState(CompressState):
    """:class:`~fastddp.CompressState` with ``dtype="auto"`` (see the module docstring).

    Args:
        process_group (ProcessGroup, optional): the group; ``None`` is the default group.
        allow (list of str, optional): the candidates, most accurate first: ``"none"`` and
            names of :data:`fastddp.PRESETS` (default ``["none", "bf16", "bf16-acc",
            "int8-ef"]``; int4 and int2 only when listed). A preset may name its path:
            ``"int8-ef:flat"`` and ``"int8-ef:hierarchical"`` are two candidates, so that the
            plan chooses the path per bucket too.
        topology (str): as for a fixed mode, given to every candidate that names no path.
        seed (int): as for a fixed mode.
    """

    __slots__ = (
        "allow",
        "_states",
        "_using",
        "_task",
        "_step",
        "_trial_start",
        "_schedule",
        "_rounds",
        "_round_ms",
        "_record",
        "_records",
        "_recent",
        "_strikes",
        "_plan",
        "_proposal",
        "_owed",
        "_checked",
        "_steps_in",
        "_held",
        "_switch",
        "_native_seen",
        "_handed",
        "_stamp",
        "_nodes",
    )

    def __init__(
        self,
        dtype: str = "auto",
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        allow=None,
        topology: str = "auto",
        seed: int = 0,
        **fixed: Any,
    ) -> None:
        if dtype != "auto":
            raise ValueError(f"CompressState: dtype must be a torch.dtype or 'auto', got {dtype!r}")
        for name in fixed:
            if name not in _FIXED_ONLY:
                raise TypeError(f"CompressState() got an unexpected keyword argument {name!r}")
        given = [k for k, v in fixed.items() if v not in (None, False, 0)]
        if given:
            raise ValueError(
                f"CompressState: with dtype='auto' the modes come from allow; {', '.join(given)} "
                "belongs to a fixed mode (allow=['bf16-acc', 'int8-ef', ...] names presets)"
            )
        self.allow = _checked_allow(allow)
        self.dtype, self.process_group, self.topology, self.seed = (
            "auto",
            process_group,
            topology,
            seed,
        )
        self.delay = 0
        self._states = {
            name: _make(name, process_group, topology, seed) for name in self.allow if name != NONE
        }
        self._using: Assignment = self.allow[0]
        self._task = None
        self._plan: Optional[dict[str, Any]] = None
        self._owed = Owed()  # residuals of buckets a candidate left (owed.py)
        self._checked = False
        self._steps_in = dict.fromkeys((*self.allow, MIXED), 0)  # steps each plan reduced
        # The C++ hook's control where fastddp.register_comm_hook registered this state: it
        # runs the steps handed to it (fp32 plans) and stamps when every step starts.
        self._switch = None
        self._native_seen = 0  # steps it ran, as last counted here
        self._stamp = None  # the extension's completion stamp, where levels are timed
        self._nodes = 1
        self._restart()

    def _restart(self) -> None:
        """Forget measurements: the next step starts a trial (or runs a loaded plan)."""
        self._step, self._trial_start = -1, 0
        self._schedule = self._trial_schedule()
        self._record: Optional[StepRecord] = None
        self._records: dict[str, list[StepRecord]] = {}
        self._recent: list[float] = []
        self._strikes = 0
        self._proposal: Optional[tuple[str, ...]] = None
        self._held: dict[str, set[int]] = {}  # parameter keys each mode reduced a step ago
        self._handed: list[tuple[str, Optional[str]]] = []  # trial turns handed to C++
        if self._switch is not None:
            self._switch.run_native(0)

    def _trial_schedule(self) -> list[tuple[str, Optional[str]]]:
        turns = [(self.allow[0], None)]  # the warm-up: DDP lays its buckets out again after it
        turns += [(name, None) for name in self.allow if name != NONE]  # buffers are made
        self._rounds = [list(self.allow)]
        self._round_ms: list[dict[str, float]] = []  # the slowest rank's medians after each
        return turns + [(name, "trial") for name in self.allow]

    # -- the hook -------------------------------------------------------------------------

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        task = torch._C._current_graph_task_id()
        if task == -1 or task != self._task:  # the first bucket of a backward pass
            self._task = task
            self._begin_step(bucket.buffer().device)
        keys = self._keys_of(bucket.parameters())
        if len(self._owed):
            self._owed.repay(bucket, dist.get_world_size(self.process_group))
        mode = self._mode_of(bucket.index())
        state = self._states.get(mode)
        record = self._record
        waited = 0.0 if state is None else state._pipeline.waited
        began = time.perf_counter()
        if state is None:
            future = allreduce_hook(self.process_group, bucket)
        else:
            future = compress_hook(state, bucket)
        record.began.append(began)
        record.held.setdefault(mode, set()).update(k for k, _ in keys)
        if record.kind is not None:  # a measured step: what the per-bucket model needs
            record.left.append(time.perf_counter())
            record.numel.append(bucket.buffer().numel())
            record.waited.append(0.0 if state is None else state._pipeline.waited - waited)
            future.add_done_callback(record.finished)
        return future

    def _keys_of(self, parameters: list[torch.Tensor]) -> tuple:
        # Every candidate names parameters alike (by first sight here), so that residuals
        # saved by one plan find their parameters in a job resumed under another. The tables
        # grow together, so the others need the parameters only when the first did not know
        # them (the hook's own cost, every bucket of every step).
        tables = [candidate._table for candidate in self._states.values()]
        if not tables:
            return ()
        before = len(tables[0].param_keys)
        keys = tables[0].keys_of(parameters)
        if len(tables[0].param_keys) != before:
            for table in tables[1:]:
                table.keys_of(parameters)
        return keys

    def _mode_of(self, index: int) -> str:
        using = self._using
        if isinstance(using, str):
            return using
        # A bucket the plan does not know (DDP laid its buckets out again): the uniform choice.
        return using[index] if index < len(using) else self._plan["uniform"]

    def _begin_step(self, device: torch.device) -> None:
        now = time.perf_counter()
        last = self._record
        period = None if last is None or not last.began else now - last.began[0]
        periods = [] if period is None else [period]
        native: list[StepRecord] = []
        if self._switch is not None:  # the steps run in C++ since the last one here count too
            periods = self._switch.take_periods()  # the last step's, then each C++ step's
            native = self._native_records()
            self._count_native()
        self._step += 1
        if not self._checked:
            self._check_ranks(device)
            self._stamp = _stamper(device, self.process_group)
        if last is not None:
            self._settle_moves(last)
        label, kind = self._label_now(), None
        if self._plan is None or self._plan["trial"]:
            finished = ([] if last is None else [last]) + native
            n = min(len(finished), len(periods))  # (the first step has no period)
            for record, seconds in zip(finished[len(finished) - n :], periods[len(periods) - n :]):
                if record.kind is not None:
                    record.period = seconds
                    self._records.setdefault(f"{record.kind}:{record.label}", []).append(record)
            label, kind = self._trial(device)
        elif periods:
            self._recent += periods
            if len(self._recent) >= CHECK_EVERY:
                self._check_plan(device)
            label = self._label_now()
        self._record = StepRecord(label, kind)
        on_issue = self._on_issue if kind == "trial" and self._stamp is not None else None
        for state in self._states.values():
            state._pipeline.on_issue = on_issue
        self._steps_in[label] += 1
        self._hand_over()

    def _on_issue(self, job, stage: int) -> None:
        # A collective of a measured trial step: its level, bytes and when it was issued; the
        # extension stamps when it completes (links.py).
        topo = job.topo
        self._nodes = len(topo.nodes)
        level = links.level_of(job.path.roles[stage], topo)
        stamp = self._stamp(job.work.get_future())
        sent = job.path.stage_bytes(job, stage)
        self._record.collectives.append((level, sent, time.perf_counter(), stamp))

    def _native_records(self) -> list["StepRecord"]:
        """The measured trial turns the C++ hook ran since the last step here, as records."""
        records = []
        for (began, left, numel, done), (label, kind) in zip(
            self._switch.take_records(), self._handed
        ):
            record = StepRecord(label, kind)
            record.began, record.left, record.numel = began, left, numel
            record.waited, record.done = [0.0] * len(numel), done
            records.append(record)
        self._handed = []
        return records

    def _count_native(self) -> None:
        native = 0 if self._switch is None else self._switch.native_total - self._native_seen
        if native:  # (only ever steps of "none": trial turns, or under a plan of "none")
            self._native_seen += native
            self._step += native
            self._steps_in[NONE] += native

    def _hand_over(self) -> None:
        # Steps of "none" run in C++ where nothing is owed, as alike on every rank as the
        # trial and the checks: in a trial, the next step if it is a measured turn of "none"
        # (recorded there as here, so that "none" is measured as it will run); under a plan of
        # "none", the steps up to the next check.
        plan = self._plan
        if self._switch is None or len(self._owed):
            return
        if plan is None or plan["trial"]:
            k = self._step + 1 - self._trial_start
            turn = self._schedule[k] if k < len(self._schedule) else None
            if turn is not None and turn[0] == NONE and turn[1] is not None:
                self._handed = [turn]
                self._switch.run_native(1, measure=True)
            return
        if self._using != NONE:
            return
        if CHECK_EVERY - len(self._recent) > 1:
            self._switch.run_native(CHECK_EVERY - len(self._recent) - 1)

    def _settle_moves(self, last: "StepRecord") -> None:
        # DDP lays its buckets out again (after its first step, say): a parameter that left a
        # mode's buckets left its residual in that mode, which no bucket of it will take up. It
        # is repaid through the parameter's new bucket (a step late; nothing is lost).
        # (In a trial, where modes take turns, each keeps its residuals in its own buckets.)
        for name, keys in self._held.items():
            state = self._states.get(name)
            if state is None or not state.error_feedback or name not in last.held:
                continue
            if keys - last.held[name]:
                self._collect_owed(state)
        self._held = last.held

    def _label_now(self) -> str:
        return self._using if isinstance(self._using, str) else MIXED

    # -- the trial ------------------------------------------------------------------------

    def _trial(self, device: torch.device) -> tuple[str, Optional[str]]:
        k = self._step - self._trial_start
        if k == len(self._schedule):
            (self._next_round if self._proposal is None else self._conclude)(device)
        if self._plan is not None and not self._plan["trial"]:
            return self._label_now(), None
        label, kind = self._schedule[k]
        self._use(self._proposal if label == MIXED else label)
        return label, kind

    def _periods(self, kind: str, label: str) -> list[float]:
        return [r.period for r in self._records.get(f"{kind}:{label}", [])]

    def _next_round(self, device: torch.device) -> None:
        """After a measured round: drop the candidates that cannot win, then another round of
        the others, or the plan."""
        medians = [statistics.median(self._periods("trial", n)) for n in self.allow]
        figures = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.process_group)
        measured_s = dict(zip(self.allow, figures.tolist()))
        alive, measured = self._rounds[-1], len(self._rounds)
        self._round_ms.append({n: measured_s[n] * 1e3 for n in alive})
        seconds = _ranked(measured_s)
        last = TRIAL_ROUNDS - 1 + RUNOFF_ROUNDS  # the most measured rounds a trial has
        if measured <= TRIAL_ROUNDS - 1:
            fastest = min(seconds[n] for n in alive)
            limit = ELIMINATE[min(measured, len(ELIMINATE)) - 1]
            alive = [n for n in alive if seconds[n] <= limit * fastest]
        if measured == TRIAL_ROUNDS - 1 and len(alive) > 1 and RUNOFF_ROUNDS > 0:
            # The run-off: the two fastest, if their medians lie within the trial's noise.
            first, second = sorted(alive, key=lambda n: seconds[n])[:2]
            if seconds[second] <= seconds[first] * (1 + RUNOFF):
                alive = [n for n in alive if n in (first, second)]
            else:
                last = measured  # no run-off: the trial ends here
        if measured < last and len(alive) > 1:
            if self._switch is not None and NONE in alive:
                # Its turns run in C++, handed over by the step before, whose candidate must
                # be known then: not the first of a round, which is decided at its first bucket.
                alive = [n for n in alive if n != NONE] + [NONE]
            self._rounds.append(alive)
            self._schedule += [(name, "trial") for name in alive]
        else:
            self._decide(device, alive)

    def _decide(self, device: torch.device, alive: list[str]) -> None:
        """The uniform choice among ``alive``, then a mode per bucket proposed from the trial."""
        medians = [statistics.median(self._periods("trial", n)) for n in self.allow]
        profile = None
        if len(alive) > 1 and len(self.allow) > 1 and device.type == "cpu":
            runs = {n: self._records.get(f"trial:{n}", []) for n in self.allow}
            profile = measured.profile(self.allow, self._states, runs)
        n = 0 if profile is None else len(profile)
        trial = [rs for key, rs in self._records.items() if key.startswith("trial:")]
        timed = links.in_flight(r.collectives for rs in trial for r in rs)
        # (The least of the ranks' times in flight, as the most of their negatives.)
        busy = [-s for s in timed[1::3]]
        figures = [*medians, *busy, self._nodes, n, -n]
        figures = torch.tensor(figures, dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.process_group)
        values = figures.tolist()
        seconds = dict(zip(self.allow, values[: len(self.allow)]))
        busy = [-s for s in values[len(self.allow) : len(self.allow) + len(busy)]]
        sums = torch.tensor([*timed[0::3], *timed[2::3]], dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.process_group)
        world, nodes = dist.get_world_size(self.process_group), int(values[-3])
        k, totals = len(links.LEVELS), sums.tolist()
        measured_links = links.summary(totals[:k], busy, totals[k:], nodes, world)
        if values[-2] != -values[-1] or n == 0:  # a rank without a model: no rank plans buckets
            profile = None
        else:  # the slowest rank's figures, on every rank
            flat = torch.tensor(profile, dtype=torch.float64, device=device)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.process_group)
            profile = flat.tolist()
        ranked = _ranked(seconds)
        fastest = min(ranked[n] for n in alive)
        choice = next(n for n in self.allow if n in alive and ranked[n] <= fastest * (1 + PREFER))
        plans = 1 if self._plan is None else self._plan["plans"] + 1
        self._plan = {
            "mode": choice,
            "uniform": choice,
            "trial": True,
            "step_ms": {n: s * 1e3 for n, s in seconds.items()},
            # This rank's measured steps, per candidate, in the order they ran.
            "trial_ms": {n: [p * 1e3 for p in self._periods("trial", n)] for n in self.allow},
            "made_at_step": self._step,
            "plans": plans,
            "buckets": None,
            "model": None,
            "rounds": [list(r) for r in self._rounds],  # the candidates of each measured round
            "round_ms": [dict(r) for r in self._round_ms],  # and what each left them at
            "left": list(alive),  # and those left after the last
            # What each level of the network gave the trial's collectives (links.py).
            "links": measured_links,
        }
        if profile is not None:
            self._propose(profile, choice, seconds[choice], alive, device)
        if self._proposal is None:
            self._adopt(choice)
        else:
            self._schedule += [(MIXED, "verify"), (choice, "verify")] * VERIFY_ROUNDS

    def _propose(self, flat: list[float], uniform: str, step_s: float, alive, device) -> None:
        n = int(flat[0])
        numel = [int(v) for v in flat[1 : 1 + n]]
        gaps, cost, reduce_s, sent = {}, {}, {}, {}
        at = 1 + n
        for name in self.allow:
            gaps[name] = flat[at : at + n]
            cost[name], reduce_s[name] = flat[at + n], flat[at + n + 1]
            sent[name] = flat[at + n + 2 : at + 2 * n + 2]
            at += 2 * n + 2
        blocking = frozenset(self._states)  # compressed modes on CPU tensors: see pipeline.py
        profile = planner.Profile(numel, gaps, cost, sent, reduce_s, blocking)
        rates = planner.calibrate(profile)
        plan = planner.search(profile, rates, [uniform] * n, alive)
        # Rank 0 decides; every rank runs what it sent (all ranks issue the same collectives).
        codes = torch.tensor([self.allow.index(m) for m in plan], dtype=torch.int64, device=device)
        group = self.process_group
        dist.broadcast(codes, 0 if group is None else dist.get_global_rank(group, 0), group=group)
        plan = [self.allow[c] for c in codes.tolist()]
        self._plan["model"] = {
            "rate_MBps": {m: r / 1e6 for m, r in rates.items()},
            "cost_ns_per_element": {m: c * 1e9 for m, c in cost.items()},
            "reduce_ms": {m: s * 1e3 for m, s in reduce_s.items()},
            "modelled_ms": {
                uniform: planner.simulate(profile, [uniform] * n, rates) * 1e3,
                MIXED: planner.simulate(profile, plan, rates) * 1e3,
            },
        }
        self._plan["buckets"] = [
            {"mode": m, "numel": numel[i], "gap_ms": gaps[m][i] * 1e3, "sent_bytes": sent[m][i]}
            for i, m in enumerate(plan)
        ]
        gain = (
            self._plan["model"]["modelled_ms"][uniform] - self._plan["model"]["modelled_ms"][MIXED]
        )
        if any(m != uniform for m in plan) and gain >= MIX_GAIN * step_s * 1e3:
            self._proposal = tuple(plan)

    def _conclude(self, device: torch.device) -> None:
        """Keep the proposed mixed plan if the turns confirm the model: faster than the uniform
        choice by half the modelled gain, and by PREFER of its step at least."""
        uniform = self._plan["uniform"]
        means = torch.tensor(
            [statistics.mean(self._periods("verify", label)) for label in (MIXED, uniform)],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(means, op=dist.ReduceOp.MAX, group=self.process_group)
        mixed, alone = means.tolist()
        self._plan["verify_ms"] = {MIXED: mixed * 1e3, uniform: alone * 1e3}
        modelled = self._plan["model"]["modelled_ms"]
        predicted = (modelled[uniform] - modelled[MIXED]) / 1e3
        keep = planner.confirms(mixed, alone, predicted, PREFER)
        self._adopt(MIXED if keep else uniform)

    def _adopt(self, label: str) -> None:
        plan = self._plan
        plan["trial"] = False
        plan["mode"] = label
        if label != MIXED and plan["buckets"] is not None:
            if any(b["mode"] != label for b in plan["buckets"]):
                plan["proposed"] = [b["mode"] for b in plan["buckets"]]  # measured slower
            for b in plan["buckets"]:
                b["mode"] = label
        plan["planned_ms"] = {**plan["step_ms"], **plan.get("verify_ms", {})}[label]
        self._use(self._proposal if label == MIXED else label)
        self._settle_plan()
        self._proposal = None
        self._recent, self._strikes = [], 0
        plan["summary"] = what = self._summary()
        figures = {
            **plan["step_ms"],
            **{f"{n} again": s for n, s in plan.get("verify_ms", {}).items()},
        }
        rates = plan.get("links") or {}
        logger.info(
            "fastddp auto: plan %d at step %d: %s (step ms, slowest rank: %s)%s",
            plan["plans"],
            self._step,
            what,
            ", ".join(f"{n} {s:.1f}" for n, s in figures.items()),
            "; collectives' MB/s per node: "
            + ", ".join(f"{level} {r['MBps']:.1f}" for level, r in rates.items())
            if rates
            else "",
        )

    def _summary(self) -> str:
        """The mode in use, or the modes of a mixed plan with their numbers of buckets."""
        if isinstance(self._using, str):
            return self._using
        counts = {m: self._using.count(m) for m in self.allow if m in self._using}
        return "mixed (" + ", ".join(f"{m} x{c}" for m, c in counts.items()) + ")"

    def _check_plan(self, device: torch.device) -> None:
        now = torch.tensor([statistics.median(self._recent)], dtype=torch.float64, device=device)
        dist.all_reduce(now, op=dist.ReduceOp.MAX, group=self.process_group)
        self._recent = []
        planned = self._plan["planned_ms"] / 1e3
        ratio = now.item() / planned
        self._plan["last_check_ratio"] = ratio
        self._strikes = self._strikes + 1 if abs(ratio - 1) > MARGIN else 0
        if self._strikes >= 2:
            logger.info(
                "fastddp auto: the step takes %.2fx the planned %.1f ms; trying every mode again",
                ratio,
                planned * 1e3,
            )
            self._plan["trial"] = True
            step = self._step
            self._restart()
            self._step = self._trial_start = step
            self._use(self._schedule[0][0])

    def _check_ranks(self, device: torch.device) -> None:
        # Every rank must run the same trial: a rank with other candidates would issue other
        # collectives. Raise on every rank alike.
        self._checked = True
        mine = zlib.crc32(",".join(self.allow).encode())
        cpp = int(self._switch is not None)  # the turns' order depends on it
        rows = torch.tensor(
            [mine, TRIAL_ROUNDS, VERIFY_ROUNDS, CHECK_EVERY, cpp], dtype=torch.int64, device=device
        )
        everyone = [torch.empty_like(rows) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(everyone, rows, group=self.process_group)
        differ = [r for r, row in enumerate(everyone) if not torch.equal(row, everyone[0])]
        if differ:
            raise ValueError(
                f"fastddp: ranks disagree on CompressState(dtype='auto', allow=...): ranks "
                f"{differ} differ from rank 0 (this rank allows {list(self.allow)}, registered "
                f"{'with' if cpp else 'without'} fastddp.register_comm_hook); give every rank the "
                "same allow list, register every rank's hook alike (and the same fastddp version)"
            )

    # -- switching modes ------------------------------------------------------------------

    def _use(self, using: Assignment) -> None:
        # During a trial each candidate's residuals stay in its buckets until it runs again:
        # moving them at every turn would cost the next candidate the copies.
        self._using = using

    def _settle_plan(self) -> None:
        """At a new plan: the residuals of every bucket a candidate no longer reduces are
        taken out, for the bucket's next reduction to add."""
        using = self._using
        for name, state in self._states.items():
            if not state.error_feedback or not state._verified or using == name:
                continue  # (a candidate that reduces every bucket keeps its residuals)
            mine = () if isinstance(using, str) else [i for i, m in enumerate(using) if m == name]
            self._collect_owed(state, frozenset(mine))

    def _collect_owed(self, state: CompressState, keep: frozenset = frozenset()) -> None:
        self._owed.collect(state, dist.get_rank(self.process_group), keep)

    # -- what CompressState offers ----------------------------------------------------------

    @property
    def path(self) -> str:
        return "auto"

    @property
    def trial_steps(self) -> int:
        """Steps before the first plan at most: a warm-up, a round of the candidates that make
        buffers, :data:`TRIAL_ROUNDS` - 1 measured rounds and, with several candidates, a
        run-off of two and the turns of a proposed mixed plan."""
        several = len(self.allow) > 1
        verify = 2 * VERIFY_ROUNDS if several else 0
        runoff = 2 * RUNOFF_ROUNDS if several else 0
        made = sum(name != NONE for name in self.allow)
        return 1 + made + (TRIAL_ROUNDS - 1) * len(self.allow) + runoff + verify

    def settings(self) -> dict[str, Any]:
        return {"dtype": "auto", "allow": list(self.allow), "topology": self.topology}

    def __repr__(self) -> str:
        return f"CompressState(dtype=auto, allow={list(self.allow)}, mode={self._label_now()})"

    def flush(self) -> None:
        for state in self._states.values():
            state.flush()

    def stats(self) -> dict[str, Any]:
        """Settings, ``mode`` (the candidate now in use, or ``"mixed"``), ``steps_in`` (steps
        per candidate and mixed plan), ``plan`` and each used candidate's own ``stats()``.

        ``plan`` has ``mode`` (the chosen candidate, or ``"mixed"``), ``summary`` (the mode, or
        the modes of a mixed plan with their numbers of buckets), ``uniform`` (the best single
        candidate), ``step_ms`` (each candidate's measured step on the slowest rank),
        ``trial_ms`` (this rank's measured steps of each candidate), ``made_at_step``, ``plans``
        (how many so far), ``planned_ms`` (the figure later steps are held against) and, where a
        model was fitted, ``model`` (each candidate's fitted link rate, host cost of its codec,
        measured and modelled reduction times) and ``buckets`` (per bucket of a mixed plan: its
        mode, size, the compute before it and its bytes on the slowest link). ``rounds`` lists
        the candidates of each measured round (a run-off's last), ``round_ms`` the slowest
        rank's medians after each, and ``left`` the candidates left after the last.
        ``links`` has, per level of the network the trial's collectives used (``"intra"``,
        ``"cross"``, ``"flat"``: ``links.py``), a node's ``MB`` and its rate while they were in
        flight (``MBps``), ``busy_ms`` and the ``collectives`` per rank; CPU tensors on Gloo.
        ``native_steps`` counts the steps run in C++ (:func:`fastddp.register_comm_hook`).
        ``verify_ms`` has the turns of a mixed plan against the uniform choice; ``proposed`` the
        model's mixed plan where it was not kept (its modelled gain under :data:`MIX_GAIN`, or
        not confirmed by its turns).
        """
        self._count_native()
        native_now = self._switch is not None and self._switch.native_now
        return {
            **self.settings(),
            "mode": NONE if native_now else self._label_now(),
            "step": self._step,
            "steps_in": dict(self._steps_in),
            # Steps the C++ hook ran (fastddp.register_comm_hook), of those under "none".
            "native_steps": self._native_seen,
            "plan": _plain(self._plan),
            "candidates": {n: s.stats() for n, s in self._states.items() if s._verified},
        }

    def state_dict(self) -> dict[str, Any]:
        """The plan and every candidate's state dict; a resumed job keeps the plan."""
        self.flush()
        done = self._plan is not None and not self._plan["trial"]
        return {
            "settings": self.settings(),
            "plan": _plain(self._plan) if done else None,
            "candidates": {n: s.state_dict() for n, s in self._states.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("settings", {})
        if saved.get("dtype") != "auto" or saved.get("allow") != list(self.allow):
            raise ValueError(
                f"CompressState.load_state_dict: saved settings {saved} do not match this "
                f"state's {self.settings()}; build the state with the settings it was saved with"
            )
        plan = state_dict.get("plan")
        if plan is not None:
            modes = (
                [plan["mode"]] if plan["mode"] != MIXED else [b["mode"] for b in plan["buckets"]]
            )
            bad = [m for m in modes if m not in self.allow]
            if bad:
                raise ValueError(
                    f"CompressState.load_state_dict: the saved plan uses {bad}, which allow "
                    f"{list(self.allow)} does not hold; save and load with the same allow"
                )
        for name, sd in state_dict["candidates"].items():
            self._states[name].load_state_dict(sd)
        self._owed = Owed()
        self._restart()
        self._plan = None if plan is None else {**_plain(plan), "trial": False}
        if plan is None:
            self._using = self.allow[0]
        elif plan["mode"] == MIXED:
            self._using = tuple(b["mode"] for b in plan["buckets"])
        else:
            self._using = plan["mode"]
        if self._plan is not None:
            self._plan["summary"] = self._summary()

    def __getstate__(self) -> dict:
        return {"allow": self.allow, "seed": self.seed, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        AutoState.__init__(self, allow=saved["allow"], seed=saved["seed"])
        self.load_state_dict(saved["state_dict"])


def _stamper(device: torch.device, group: Optional[dist.ProcessGroup]):
    """The extension's completion stamp where the levels are timed (CPU tensors on Gloo:
    see links.py), else None."""
    if device.type != "cpu" or "gloo" not in str(dist.get_backend(group)):
        return None
    return _extension.load().stamp_completion


def _ranked(seconds: dict[str, float]) -> dict[str, float]:
    """The figures the trial ranks candidates by: ``"none"``'s lowered by :data:`PLAIN_EDGE`."""
    return {n: s / (1 + PLAIN_EDGE) if n == NONE else s for n, s in seconds.items()}


def _plain(plan: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A copy of ``plan`` that shares no dict or list with it."""
    if plan is None:
        return None
    copy = {}
    for key, value in plan.items():
        if isinstance(value, dict):
            value = _plain(value)
        elif isinstance(value, list):
            value = [dict(v) if isinstance(v, dict) else v for v in value]
        copy[key] = value
    return copy
