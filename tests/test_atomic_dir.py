"""titan_jax/atomic_dir.py's report writer: a failed write leaves the old file whole."""

import os

import pytest

from titan_jax.atomic_dir import write_text_atomic


def test_a_report_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    report = tmp_path / "fsdp8.json"
    report.write_text("old\n")
    write_text_atomic(report, "new\n")
    assert report.read_text() == "new\n"

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(report, "half of a newer report")
    assert report.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp8.json"]  # no temporary left
