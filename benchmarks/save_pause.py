"""The training thread's pause per checkpoint save, next to a plain orbax async save of the same
state (issue 21, "saves at scale").

The pause is the time from the save call until the next step is dispatched: that step donates
the state, so it can start only once the save no longer needs the device buffers. The "step"
here is a jitted function that donates the whole state and bumps its step counter (no copy,
no compute), so the figure is the save's alone and a 0.6B state fits in 10 GB with orbax's host
copy. One CPU device, fp32 train state (params + AdamW moments: ~12 bytes per parameter).

    python benchmarks/save_pause.py --model qwen3-100M --mode titan --saves 3
    --mode orbax: ocp.CheckpointManager(...).save(step, StandardSave(state)), async.
Prints one JSON line: params, state bytes, each save's pause, peak RSS before and after.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

sys.path.insert(0, str(Path(__file__).parent))
from bench_step import QWEN3_100M  # noqa: E402

from titan_jax.config import load_config  # noqa: E402
from titan_jax.models.qwen3 import Qwen3Args, get_flavor  # noqa: E402
from titan_jax.train.checkpoint import Checkpointer  # noqa: E402
from titan_jax.train.trainer import build_trainer  # noqa: E402

# ~300M: the largest whose state (3.8 GB) and orbax's write buffers fit in 10 GB here.
QWEN3_300M = Qwen3Args(
    dim=1024,
    n_layers=20,
    n_heads=16,
    n_kv_heads=8,
    head_dim=64,
    hidden_dim=3072,
    vocab_size=32000,
    max_seq_len=2048,
    tie_embeddings=False,
)
MODELS = {
    "debugmodel": get_flavor("debugmodel"),
    "qwen3-100M": QWEN3_100M,
    "qwen3-300M": QWEN3_300M,
    "0.6B": get_flavor("0.6B"),
}


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _next_step(state: dict) -> dict:
    return {**state, "step": state["step"] + 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="qwen3-100M")
    parser.add_argument("--mode", choices=["titan", "orbax"], default="titan")
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="save_pause_"))
    config = load_config(
        None,
        [
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "1",
            "--checkpoint.enable",
            "true",
            "--checkpoint.keep_latest_k",
            "1",
        ],
    )
    trainer = build_trainer(config, jax.devices()[:1], model_args=MODELS[args.model])
    step = jax.jit(_next_step, donate_argnums=0)
    state = step(trainer.init_state())
    jax.block_until_ready(state)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    before = _peak_rss_gib()
    if args.mode == "titan":
        saver = Checkpointer.for_run(trainer)
        save = lambda n, s: saver.save(n, s, data_state={}, tokens_seen=0)  # noqa: E731
    else:
        saver = ocp.CheckpointManager(
            folder / "checkpoint",
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True),
        )
        save = lambda n, s: saver.save(n, args=ocp.args.StandardSave(s))  # noqa: E731
    pauses = []
    for n in range(1, args.saves + 1):
        start = time.perf_counter()
        save(n, state)
        state = step(state)  # dispatched once the save has let go of the donated buffers
        pauses.append(time.perf_counter() - start)
        jax.block_until_ready(state)
        saver.wait_until_finished() if args.mode == "orbax" else saver.wait()
    saver.close()
    print(
        json.dumps(
            {
                "model": args.model,
                "mode": args.mode,
                "params": trainer.plan.model.num_params(),
                "state_bytes": state_bytes,
                "pauses_s": [round(p, 3) for p in pauses],
                "peak_rss_gib_before_saves": round(before, 2),
                "peak_rss_gib": round(_peak_rss_gib(), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
