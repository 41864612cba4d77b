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


def test_an_abandoned_orbax_task_collected_later_prints_nothing(tmp_path):
    """orbax's failed reads can also end as Tasks that asyncio reports when they are collected
    ("Task exception was never retrieved", through its logger): dropped for orbax's coroutines
    and the TensorStore futures orbax hands to the loop as they are (asyncio wraps each in a
    Task of its own), or any Task or Future failing with a TensorStore read error, so a failed
    read still prints just its one line; other Tasks and Futures still print."""
    import subprocess
    import sys

    (tmp_path / "orbax").mkdir()
    (tmp_path / "orbax" / "reader.py").write_text("async def read():\n    raise ValueError(1)\n")
    (tmp_path / "other.py").write_text(
        "async def read():\n    raise ValueError(2)\n"
        "async def failed_store_read():\n"
        "    raise ValueError(\"NOT_FOUND: Error reading [tensorstore_spec='{}']\")\n"
        "class Awaitable:\n    def __await__(self):\n        raise ValueError(3)\n        yield\n"
    )
    script = (
        "import asyncio, gc, sys\n"
        f"sys.path[:0] = [{str(tmp_path)!r}, {str(tmp_path / 'orbax')!r}]\n"
        "from titan_jax.errors import quiet_closed_loop_callbacks\n"
        "import reader, other\n"
        "quiet_closed_loop_callbacks()\n"
        "import tensorstore as ts\n"
        "failed_open = ts.open({'driver': 'zarr', 'kvstore': 'memory://none/'}, open=True)\n"
        "for read in (reader.read(), other.read(), failed_open, other.Awaitable(),\n"
        "             other.failed_store_read()):\n"
        "    loop = asyncio.new_event_loop()\n"
        "    asyncio.ensure_future(read, loop=loop)\n"
        "    loop.run_until_complete(asyncio.sleep(0.01))\n"
        "    loop.close()\n"
        "    gc.collect()\n"
        "for error in (ValueError(\"NOT_FOUND: Error reading [tensorstore_spec='{}']\"),\n"
        "              ValueError(4)):\n"
        "    loop = asyncio.new_event_loop()\n"
        "    loop.create_future().set_exception(error)  # collected unretrieved at once\n"
        "    loop.close()\n"
        "    gc.collect()\n"
    )
    err = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    ).stderr
    assert "ValueError: 2" in err and "ValueError: 3" in err and "ValueError: 4" in err
    assert "ValueError: 1" not in err and "NOT_FOUND" not in err


def test_reads_a_failed_read_left_unstarted_warn_only_until_it_is_quieted():
    """orbax closes a restore's loop when one read fails; a read whose coroutine was made but
    could not be scheduled on the closed loop warns "coroutine ... was never awaited" when
    collected (a CI run printed it at exit, after the one-line error)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import asyncio, gc, sys
        from titan_jax.errors import quiet_unstarted_reads
        async def read_metadata():
            pass
        def abandon():
            loop = asyncio.new_event_loop()
            loop.close()
            try:
                loop.create_task(read_metadata())
            except RuntimeError:  # Event loop is closed
                pass
            gc.collect()
        abandon()
        print('quieted', file=sys.stderr)
        quiet_unstarted_reads()
        abandon()
        """)
    err = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    ).stderr
    before, after = err.split("quieted\n")
    assert "coroutine 'read_metadata' was never awaited" in before
    assert after == ""
