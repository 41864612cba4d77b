"""Data at pod scale: prepare-data throughput, train start-up and memory from token stores of
1 GB and 4 GB next to the embedded corpus, and the loader's tokens/s per process.

`python benchmarks/bench_data.py [--prepare-mb 32] [--store-gb 1 4]` (not in CI). Everything it
generates lives under a temporary folder (--tmp, default /tmp) and is deleted at the end:
  1. prepare-data tokens/s with 1 and 2 workers, on a generated jsonl corpus of --prepare-mb MB
     (synthetic English-like documents, shipped tokenizer);
  2. stores of --store-gb GB of token bytes (uint16 ids, ~1,000-token documents), written in the
     store format by prepare-data's own shard writer from generated token blocks (tokenizing
     4 GB of text would take hours on this machine: the reading side is what is measured);
  3. `titan-jax train` (debugmodel, 8 x 64 tokens, 2 steps, no compilation cache, one CPU
     device) on the embedded corpus and on each store: seconds to the first step's log line and
     peak RSS (/usr/bin/time -v);
  4. the loader (`WindowStream`) on the largest store: tokens/s for the 8 rows one of 8 hosts
     holds in a 64-row batch, at seq_len 2048 and 8192, next to what one v5p host (4 chips)
     consumes at the 8B and 235B-A22B recipes at 50% MFU: 4 x 459e12 x 0.5 / FLOPs-per-token.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import numpy as np

from titan_jax.data.prepare import _request, _write_shard, prepare_store
from titan_jax.data.store import MANIFEST, open_corpus
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.data.windows import Source, WindowStream
from titan_jax.models import get_model_spec

ROOT = Path(__file__).resolve().parents[1]
V5P_HOST_FLOPS = 4 * 459e12  # 4 chips a host, bf16 peak
MFU = 0.5
WORDS = (
    "the of and to in is that for it as with was on be by this are from or have an "
    "which not but all were can when there been has their more one if will would what "
    "function return value object class module string list file error type data"
).split()


def make_jsonl(folder: Path, megabytes: int, files: int = 8) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    words = np.array(WORDS)
    per_file = megabytes * 2**20 // files
    for f in range(files):
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            written = 0
            while written < per_file:
                text = " ".join(words[rng.integers(0, len(words), rng.integers(100, 1500))])
                line = '{"text": "' + text + '"}\n'
                out.write(line)
                written += len(line)


def bench_prepare(src: Path, out: Path, workers: int) -> tuple[float, int]:
    start = time.perf_counter()
    manifest = prepare_store(
        dataset="jsonl",
        dataset_path=str(src),
        text_field="text",
        tokenizer=load_tokenizer(),
        output=str(out),
        workers=workers,
    )
    seconds = time.perf_counter() - start
    return manifest["tokens"] / seconds, manifest["tokens"]


def make_store(out: Path, gigabytes: float, shard_bytes: int = 2**28) -> None:
    """A store of random ids (< 2048) in ~1,000-token documents, `gigabytes` of token bytes."""
    import json

    tok = load_tokenizer()
    rng = np.random.default_rng(1)
    fs = fsspec.filesystem("file")
    out.mkdir(parents=True)
    n_shards = max(1, round(gigabytes * 2**30 / shard_bytes))
    entries = []
    for i in range(n_shards):

        def blocks():
            for _ in range(shard_bytes // 2 // 2**22):  # 4M tokens a block
                lengths = rng.integers(200, 1800, 2**22 // 1000 - 200)
                lengths[-1] += 2**22 - lengths.sum()
                tokens = rng.integers(1, 2048, 2**22).astype("<u2")
                tokens[np.cumsum(lengths) - 1] = tok.eos_id
                yield tokens.tobytes(), lengths

        entries.append({**_write_shard(fs, str(out), i, blocks()), "source": f"synthetic-{i}"})
    request = _request(
        "jsonl",
        "synthetic",
        "text",
        "train",
        tok,
        [f"synthetic-{i}" for i in range(n_shards)],
        1,
        0,
    )
    manifest = {
        **request,
        "tokens": sum(e["tokens"] for e in entries),
        "documents": sum(e["documents"] for e in entries),
        "shards": entries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest))


def time_to_first_step(dump: Path, *data_args: str) -> tuple[float, float]:
    """(seconds from launch to the first step's line, peak RSS in GB) of a 2-step train run."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TITAN_JAX_COMPILATION_CACHE": "",
        "PYTHONPATH": str(ROOT),
    }
    command = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "titan_jax.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "qwen3_debug.toml"),
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "1",
        "--metrics.progress_bar",
        "false",
        "--job.cpu_devices",
        "1",
        "--job.dump_folder",
        str(dump),
        *data_args,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    first = None
    for line in proc.stdout:
        if first is None and line.startswith("step 1/"):
            first = time.perf_counter() - start
    err = proc.stderr.read()
    assert proc.wait() == 0 and first is not None, err[-2000:]
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))
    return first, rss_kb / 2**20


def loader_rate(store: Path, seq_len: int, batches: int = 200) -> tuple[float, float]:
    """Tokens/s of one host's 8 rows: first read of the windows (pages not yet mapped), then
    the same batches again (in the page cache and mapped)."""
    corpus = open_corpus(str(store), load_tokenizer())
    stream = WindowStream(
        [Source("store", corpus)], seq_len=seq_len, global_batch_size=64, seed=0, rows=range(8)
    )
    rates = []
    for _ in range(2):
        stream.set_state({**stream.get_state(), "samples": 0})
        start = time.perf_counter()
        for _ in range(batches):
            next(stream)
        rates.append(batches * 8 * seq_len / (time.perf_counter() - start))
    return rates[0], rates[1]


def report_start_up(root: Path, stores: list[tuple[str, Path]], repeats: int) -> None:
    """Time to the first step and peak RSS per input, the inputs interleaved run by run so
    that a change in the machine's load touches them alike; medians of `repeats` runs."""
    inputs = [("embedded corpus", ())] + [
        (name, ("--training.dataset", "tokens", "--training.dataset_path", str(path)))
        for name, path in stores
    ]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in inputs}
    for repeat in range(repeats):
        for k, (name, args) in enumerate(inputs):
            runs[name].append(time_to_first_step(root / f"run_{repeat}_{k}", *args))
    for name, results in runs.items():
        firsts = sorted(first for first, _ in results)
        rss = max(peak for _, peak in results)
        print(
            f"| train, {name} | first step {float(np.median(firsts)):.1f} s (median of "
            f"{len(firsts)}: {', '.join(f'{t:.1f}' for t in firsts)}), peak RSS {rss:.2f} GB |",
            flush=True,
        )


def host_consumption(flavor: str, seq_len: int) -> float:
    spec = get_model_spec("qwen3")
    return V5P_HOST_FLOPS * MFU / spec.flops_per_token(spec.flavor(flavor), seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare-mb", type=int, default=32)
    parser.add_argument("--store-gb", type=float, nargs="+", default=[1, 4])
    parser.add_argument("--tmp", default="/tmp")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="train runs per input, interleaved; the median is reported",
    )
    parser.add_argument(
        "--loader-only",
        action="store_true",
        help="only the loader figures (no prepare, no train runs)",
    )
    a = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="titan_jax_bench_data_", dir=a.tmp))
    try:
        make_jsonl(root / "jsonl", 0 if a.loader_only else a.prepare_mb)
        for workers in () if a.loader_only else (1, 2):
            rate, tokens = bench_prepare(root / "jsonl", root / f"prepared{workers}", workers)
            print(
                f"| prepare-data, {a.prepare_mb} MB jsonl, {workers} worker(s) | "
                f"{rate:,.0f} tokens/s ({tokens:,} tokens) |",
                flush=True,
            )
        stores = []
        for gb in a.store_gb:
            stores.append((f"{gb:g} GB store", root / f"store_{gb:g}gb"))
            make_store(stores[-1][1], gb)
        if not a.loader_only:
            report_start_up(root, stores, a.repeats)
        store = stores[-1][1]
        for seq_len in (2048, 8192):
            cold, warm = loader_rate(store, seq_len)
            print(
                f"| loader, 8 of 64 rows, seq_len {seq_len}, {a.store_gb[-1]:g} GB store | "
                f"{cold:,.0f} tokens/s first read, {warm:,.0f} again |",
                flush=True,
            )
            for flavor in ("8B", "235B-A22B"):
                print(
                    f"| one v5p host consumes, {flavor}, seq_len {seq_len}, 50% MFU | "
                    f"{host_consumption(flavor, seq_len):,.0f} tokens/s |",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
