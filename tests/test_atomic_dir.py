"""titan_jax/atomic_dir.py: a failed write leaves the old file or folder whole, and the
machine's refusals (a full disk, no permission) are one line naming the destination."""

import errno
import os

import pytest

from titan_jax.atomic_dir import DestinationError, atomic_dir, write_text_atomic


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


def test_a_full_disk_or_a_denied_write_is_one_line_and_the_folder_stays_as_it_was(tmp_path):
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "weights").write_text("old")
    for code in (errno.ENOSPC, errno.EACCES):
        words = os.strerror(code)
        with pytest.raises(
            DestinationError,
            match=rf"^{words}: writing {dst} failed; {dst} is "
            "as it was before$",
        ):
            with atomic_dir(dst, overwrite=True) as tmp:
                (tmp / "weights").write_text("half")
                raise OSError(code, words, str(tmp / "weights"))
        assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary left
        assert (dst / "weights").read_text() == "old"
    with pytest.raises(KeyError), atomic_dir(dst, overwrite=True):  # a bug keeps its traceback
        raise KeyError("weights")
    with pytest.raises(
        DestinationError,
        match=f"destination {tmp_path / ('a' * 300)}: the name "
        "aaaaaaaaaaaa...aaaa is 300 bytes, longer than the 255 bytes",
    ):
        with atomic_dir(tmp_path / ("a" * 300)):
            pass
