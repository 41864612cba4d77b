"""What the compiled program tells the planner's estimate (`planner/hlo_cost.py`) about itself,
set by the code that knows it.

A `lax.cond` runs one branch; which one depends on values the estimate does not have. The
branch a step takes under the estimate's assumptions (a finite loss, balanced expert routing)
is traced under the `EXPECTED_BRANCH` name scope, which the compiled program keeps in its ops'
metadata: the estimate prices that branch and reports the other beside it. A branch that may
compile to no ops at all (one that returns its operands) has no metadata to carry that name:
then its sibling, the one the step rarely takes, is traced under `RARE_BRANCH` instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

EXPECTED_BRANCH = "expected_branch"
RARE_BRANCH = "rare_branch"


def _in_scope(scope: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        with jax.named_scope(scope):
            return fn(*args)

    return traced


def expected_branch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, a `lax.cond` branch, traced under the `EXPECTED_BRANCH` name scope."""
    return _in_scope(EXPECTED_BRANCH, fn)


def rare_branch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, a `lax.cond` branch the step rarely takes, traced under `RARE_BRANCH`: its
    sibling is the expected one."""
    return _in_scope(RARE_BRANCH, fn)
