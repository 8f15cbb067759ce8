"""What the budget step (policies/budget.py) reserves for one call, kept on the call until it ends: a module of its
own, below the pipeline, so that the call names its holds' type and the budget step, which imports the pipeline,
is not imported back."""

from __future__ import annotations

from dataclasses import dataclass

from policies.store.sqlite_holds import HoldRow


@dataclass(slots=True)
class Pledge:
    """A call's reservation as written to the store before the call leaves (where the store asks for it:
    `Budgets.durable`): the call as the ledger would record it, at its reserved bound. One per call, whatever
    number of budgets it counts against (the ledger's rows of a team's keys are the team's)."""

    bucket: int
    model: str
    key_id: str
    prompt: int
    output: int
    backend: str = ""
    served: str = "owned"
    cost: float = 0.0
    id: int | None = None  # the store's, once written

    def row(self) -> HoldRow:
        return HoldRow(self.bucket, self.model, self.backend, self.key_id, self.served, self.prompt, self.output,
                       self.cost)


@dataclass(slots=True)
class Hold:
    key_id: str  # the budget's owner: a key id, or a team's `team:<name>`
    start: int
    end: int
    cost: float
    tokens: int
    pledge: Pledge | None = None  # the call's written reservation (the same for each of its holds)
