"""Files of every kind for the bad-input probes (tests/test_bad_input.py and
scripts/probe_bad_input.py), some of them damaged."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_damaged_inputs(folder: Path) -> None:
    """A plain file, a folder, a good parquet file and two damaged ones (footer, data pages), a
    JSON file that is not UTF-8, and an HF directory whose safetensors file is empty."""
    (folder / "file").write_text("a file")
    (folder / "folder").mkdir()
    good = folder / "good.parquet"
    pq.write_table(pa.table({"text": ["hello world " * 50] * 200}), good)
    data = bytearray(good.read_bytes())
    (folder / "bad_footer.parquet").write_bytes(bytes(data[:-12]) + b"\0" * 12)
    data[200:1200] = b"\xab" * 1000
    (folder / "bad_pages.parquet").write_bytes(bytes(data))
    (folder / "latin1.json").write_bytes(b'{"caf\xe9": 1}')
    (folder / "hf").mkdir()
    (folder / "hf" / "config.json").write_text("{}")
    (folder / "hf" / "model.safetensors").write_text("")
