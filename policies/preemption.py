"""Preemption: a batch line gives its slot back the moment a better class's request must wait for one.

The reserve (policies/admission.py) keeps a few slots free of batch work, but when more interactive requests
arrive at once than it holds, the extra ones would wait for a batch line to end (seconds). Instead:

- the runner (policies/batches/runner.py) says, for each run of a line, whether it may be preempted (`PREEMPTIBLE`):
  while `batch.preempt` is on and the line was preempted fewer than `batch.max_preemptions` times;
- a line that may be runs its call in a task of its own and files it here, under its call, for as long as it runs
  (gateway/batch_calls.py, `stoppable`);
- when a request of a better class than the batch class must wait for a slot of a model, its queue stops one
  such call holding a slot of a replica the request may use: the youngest, sent last (the least work lost)
  (`preempt_youngest`), at most one per waiting request. Its task is cancelled, which closes its upstream
  connection (vLLM aborts the request and keeps the prompt's blocks in its prefix cache, so the next run's prefill
  is cheap) and ends the call as one whose client hung up ends (status 499: its slot released once, its pipeline
  left, its record published, the tokens it was sent counted as any aborted call's); the slot goes to the
  waiters through the queue's normal hand-off, the best class first;
- the line's caller raises `Preempted` (policies/batches/runner.py), and the runner runs the line again at once,
  under its claim: it waits for a slot in the batch class's turn like any line, and is answered once.

Only Batch API lines are stopped (a client's own request of a batch class has nobody to run it again), and only
while they are in a batch class (`batch.priority_class` or a class listed after it): a better class never is.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from backends.replicas import Replica
from policies.pipeline import Call

# whether the batch line the current task runs may be preempted: set by its runner for each run of it (a line
# preempted batch.max_preemptions times runs to its end); False outside a batch line
PREEMPTIBLE: ContextVar[bool] = ContextVar("batch_line_preemptible", default=False)


@dataclass(eq=False, slots=True)
class Stoppable:
    """A batch line's call in flight that a better class's waiting request may stop."""

    cancel: Callable[[], bool]  # cancels the task that runs the call (asyncio.Task.cancel)
    preempted: bool = False

    def preempt(self) -> bool:
        """Stop the call, once; False when it was stopped already or had ended."""
        if self.preempted:
            return False
        self.preempted = self.cancel()
        return self.preempted


# the calls that may be stopped now, by call (a Call is hashed by identity); each is filed for as long as its task
# runs (`stoppable`), so a process holds at most batch.max_in_flight of them
RUNNING: dict[Call, Stoppable] = {}


@contextmanager
def stoppable(call: Call, cancel: Callable[[], bool]) -> Iterator[Stoppable]:
    """File `call` as one admission may stop (by `cancel`) while the block runs."""
    stop = RUNNING[call] = Stoppable(cancel)
    try:
        yield stop
    finally:
        RUNNING.pop(call, None)


def preempt_youngest(held: Container[int], replicas: Collection[Replica]) -> bool:
    """Stop the stoppable call sent last among `held` (the id()s of a queue's batch-class calls holding a slot)
    that holds a slot of one of `replicas`; False when there is none."""
    candidates = [(call.sent_at, stop) for call, stop in RUNNING.items()
                  if not stop.preempted and call.holds_replica and call.replica in replicas and id(call) in held]
    candidates.sort(key=lambda found: found[0], reverse=True)
    return any(stop.preempt() for _, stop in candidates)  # the first that can be stopped
