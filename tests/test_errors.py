"""titan_jax/errors.py: the root cause of a wrapped failure is found and named first."""

import errno

from titan_jax.errors import root_cause


def test_root_cause_from_the_chain():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("orbax: commit failed " + "x" * 300) from e
    except RuntimeError as wrapped:
        assert root_cause(wrapped) == "No space left on device"


def test_root_cause_from_text_only():
    """tensorstore re-raises OS errors as text deep inside a long message."""
    e = ValueError("Error writing local file " + "y" * 400 + ": [OS error: Permission denied]")
    assert root_cause(e) == "Permission denied"
    assert root_cause(ValueError("shape mismatch")) is None
