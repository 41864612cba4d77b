"""The comparison figures, on host arrays: logit differences, per-token KL, greedy agreement,
norm-relative errors. Float64 throughout: a KL bar of 1e-9 is below fp32's rounding of a
log-softmax, so the figures must not add noise of their own."""

from __future__ import annotations

import numpy as np

# Tokens per chunk when computing KL, so (tokens, vocab) float64 temporaries stay small for
# real vocabularies (151936).
_KL_CHUNK = 64


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_per_token(ref_TV: np.ndarray, ours_TV: np.ndarray) -> np.ndarray:
    """KL(p_ref || p_ours) per position from logits (T, V): sum p_ref (log p_ref - log p_ours)."""
    out = np.empty(ref_TV.shape[0], np.float64)
    for start in range(0, ref_TV.shape[0], _KL_CHUNK):
        chunk = slice(start, start + _KL_CHUNK)
        log_p = _log_softmax(ref_TV[chunk].astype(np.float64))
        log_q = _log_softmax(ours_TV[chunk].astype(np.float64))
        # Clamp at 0: for identical distributions rounding can leave a tiny negative sum.
        out[chunk] = np.maximum((np.exp(log_p) * (log_p - log_q)).sum(axis=-1), 0.0)
    return out


def abs_diff_stats(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max, mean) of |ours - ref|."""
    diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    return float(diff.max()), float(diff.mean())


def first_greedy_mismatch(logits_TV: np.ndarray, tokens: np.ndarray, prompt_len: int) -> int | None:
    """First k where argmax(logits[prompt_len - 1 + k]) != tokens[prompt_len + k], or None.

    `tokens` is a prompt followed by a greedy continuation (from any model) and `logits` are
    another model's logits on those tokens. The other model's own greedy decode from the prompt
    reproduces the continuation exactly when this is None (by induction over k), so one
    teacher-forced forward stands in for a whole token-by-token decode.
    """
    n = len(tokens) - prompt_len
    predicted = np.argmax(logits_TV[prompt_len - 1 : prompt_len - 1 + n], axis=-1)
    wrong = np.nonzero(predicted != tokens[prompt_len : prompt_len + n])[0]
    return int(wrong[0]) if wrong.size else None


def rel_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    """||ours - ref|| / ||ref|| (Frobenius), 0 when both are zero."""
    ours, ref = ours.astype(np.float64), ref.astype(np.float64)
    num, den = np.linalg.norm(ours - ref), np.linalg.norm(ref)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)
