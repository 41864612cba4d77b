"""What the compiled program tells the planner's estimate (`planner/hlo_cost.py`) about itself,
set by the code that knows it.

A `lax.cond` runs one branch; which one depends on values the estimate does not have. The
branch a step takes under the estimate's assumptions (a finite loss, balanced expert routing)
is traced under the `EXPECTED_BRANCH` name scope, which the compiled program keeps in its ops'
metadata: the estimate prices that branch and reports the other beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

EXPECTED_BRANCH = "expected_branch"


def expected_branch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, a `lax.cond` branch, traced under the `EXPECTED_BRANCH` name scope."""

    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        with jax.named_scope(EXPECTED_BRANCH):
            return fn(*args)

    return traced
