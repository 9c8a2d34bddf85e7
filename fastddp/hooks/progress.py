"""The progress thread: later stages of CPU reductions, run as soon as their inputs are ready.

On CPU (Gloo) the thread that calls the hook spends most of its time in the backward pass, so a
stage that waits for its next call starts late, and the slow link idles between buckets. One
thread per process therefore runs, for every pipeline, each CPU job's stages after the first
the moment the previous collective has completed, and decodes the result. The calling thread
still issues every first stage and completes every future, so no user callback runs here.

Order: each stage index of a path has a process group of its own (``topology.py`` makes the
twins), and each group's collectives are issued in submission order: a stage waits until every
earlier job's stage on that group has been issued. Every rank thus issues the same sequence on
every group, whatever the timing. The thread never blocks on one collective (it could deadlock
against a peer blocked on another): it polls, backing off to 1 ms while nothing is ready.
"""

import threading
import time
from collections import deque
from typing import Any, Optional

__all__ = ["Progress", "PROGRESS"]

_MAX_DELAY = 1e-3


class Progress:
    """Runs jobs' stages after the first (see the module docstring)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: list[Any] = []  # in submission order
        self._queues: dict[int, deque] = {}  # id(group) -> (job, stage), in submission order
        self._thread: Optional[threading.Thread] = None

    def add(self, job: Any) -> None:
        """Take over ``job``, whose first stage has been issued."""
        with self._cv:
            for i in range(1, job.path.stages):
                self._queues.setdefault(id(job.groups[i]), deque()).append((job, i))
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fastddp-progress", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def wait(self, job: Any) -> None:
        """Block until ``job`` is finished: decoded into its bucket, or failed (``job.error``)."""
        with self._cv:
            while not job.finished:
                # A stuck collective ends with its group's timeout, which finishes the job.
                self._cv.wait(0.05)

    def _run(self) -> None:
        delay = 0.0
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                jobs = list(self._jobs)
            moved = False
            for job in jobs:
                moved |= self._advance(job)
            if moved:
                delay = 0.0
                continue
            delay = min(_MAX_DELAY, max(5e-5, 2 * delay))
            time.sleep(delay)

    def _advance(self, job: Any) -> bool:
        try:
            if not job.work.is_completed():
                return False
            if job.stage == job.path.stages:
                job.work.wait()  # re-raises a failed collective
                job.path.finish(job)
                self._finish(job, None)
                return True
            queue = self._queues[id(job.groups[job.stage])]
            head, stage = queue[0]
            if head is not job or stage != job.stage:
                return False  # an earlier job's collective on this group goes first
            job.work.wait()
            job.work = job.path.stage(job, job.stage)
            queue.popleft()
            job.stage += 1
            return True
        except Exception as e:
            self._finish(job, e)
            return True

    def _finish(self, job: Any, error: Optional[BaseException]) -> None:
        with self._cv:
            job.error = error
            job.finished = True
            self._jobs.remove(job)
            if error is not None:
                # Its later stages will never be issued: let other jobs' go first.
                for queue in self._queues.values():
                    for item in [item for item in queue if item[0] is job]:
                        queue.remove(item)
            self._cv.notify_all()


PROGRESS = Progress()
