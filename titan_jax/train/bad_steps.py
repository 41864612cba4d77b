"""The bad-step policy: a non-finite step is skipped by the step's finite guard (the state stays
as it was) and counted here; `training.max_consecutive_bad_steps` in a row stop the run."""

from __future__ import annotations


class BadStepsError(RuntimeError):
    """Too many non-finite steps in a row: the run stops instead of training on garbage."""


class BadSteps:
    """Counts non-finite steps in a row."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def record(self, step: int, values: dict[str, float]) -> str | None:
        """Counts `step`; returns the line to log for a skipped step (None for a good one)."""
        if values["finite"]:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        return (f"step {step}: non-finite loss={values['loss']} or grad_norm="
                f"{values['grad_norm']}; update skipped ({self.in_a_row} in a row)")

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit

    def check(self, step: int) -> None:
        """Raises BadStepsError once `limit` steps in a row were bad."""
        if self.exhausted:
            raise BadStepsError(
                f"{self.in_a_row} non-finite steps in a row (training.max_consecutive_bad_steps="
                f"{self.limit}); stopping at step {step} without saving it")
