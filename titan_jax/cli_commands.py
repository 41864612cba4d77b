"""The `titan-jax` commands and their arguments, as one table: (name, help, description,
arguments), each argument its argparse flags and keywords; a `Choice` is a required choice of
one among several arguments (argparse's mutually exclusive group)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from titan_jax.parity import BARS

Argument = tuple[tuple[str, ...], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Choice:
    arguments: tuple[Argument, ...]


def _arg(*flags: str, **keywords: Any) -> Argument:
    return flags, keywords


RECIPE = _arg("--config", help="TOML recipe, e.g. configs/qwen3_debug.toml")
JSON_OUT = _arg("--json", metavar="OUT", help="also write the report as JSON to OUT")
OVERRIDES = "config overrides as for train"
BARS_HELP = "override a bar; defaults: " + ", ".join(f"{k}={v:g}" for k, v in BARS.items())

COMMANDS: tuple[tuple[str, str, str, list[Argument | Choice]], ...] = (
    (
        "train",
        "train a model",
        "Train; any config key can be overridden with --section.key "
        "value (e.g. --training.steps 20).",
        [
            RECIPE,
            _arg(
                "--print-config",
                action="store_true",
                help="print the resolved config as TOML and exit",
            ),
        ],
    ),
    (
        "inspect",
        "show shardings, collectives and memory without running a step",
        "Per-parameter shardings and bytes per device, and the collectives and memory of the "
        f"compiled train step (compiled, never run); {OVERRIDES}.",
        [RECIPE, JSON_OUT],
    ),
    (
        "compile",
        "compile the train step for a TPU slice from this host, to plan a job",
        "Compile the recipe's whole train step ahead of time for a named TPU slice (needs "
        "libtpu, no TPU) and report per-chip memory against HBM, FLOPs per step, the "
        "collectives and an estimate of step time and MFU (each instruction at the MXU peak or "
        "HBM bandwidth, plus the collectives the schedule leaves exposed; the roofline bound "
        f"beside it); {OVERRIDES}. The parallelism degrees must multiply to the slice's chips "
        "(x --num-slices).",
        [
            _arg("--config", help="TOML recipe, e.g. configs/qwen3_8b.toml"),
            _arg(
                "--topology",
                required=True,
                metavar="NAME",
                help="a Cloud TPU slice name: v4-16, v5e-256, v5p-128, v6e-8, ... (v4/v5p count "
                "TensorCores: v5p-8 is 4 chips)",
            ),
            _arg(
                "--num-slices",
                type=int,
                default=1,
                metavar="N",
                help="slices joined over DCN (multislice; default 1)",
            ),
            JSON_OUT,
        ],
    ),
    (
        "parity",
        "compare with PyTorch (HF transformers, TorchTitan) on the same weights",
        "Load the same weights into titan-jax and the PyTorch references and compare, in fp32: "
        "logits, per-token KL, greedy decoding, the loss, every gradient (HF) and optionally a "
        "training trajectory. Exits 1 when a figure is over its bar. Without --hf-checkpoint "
        "the recipe's model.flavor is randomly initialised (training.seed). Config overrides "
        "as for train (the trajectory uses the recipe's optimizer, lr_scheduler, "
        "training.local_batch_size, seq_len, max_norm and data).",
        [
            _arg("--config", required=True, help="TOML recipe, e.g. configs/qwen3_debug.toml"),
            _arg("--hf-checkpoint", metavar="DIR", help="HF model directory to load"),
            _arg(
                "--reference",
                choices=["hf", "torchtitan", "all"],
                default="all",
                help="which PyTorch reference(s) to compare with (default: all)",
            ),
            _arg(
                "--seq-len",
                type=int,
                default=512,
                help="prompt length (default 512; short prompts miss RoPE bugs)",
            ),
            _arg(
                "--trajectory-steps",
                type=int,
                default=0,
                metavar="N",
                help="also run N train steps on both sides and compare the losses",
            ),
            _arg("--json", metavar="OUT", help="also write the figures as JSON to OUT"),
            _arg("--bar", action="append", default=[], metavar="NAME=VALUE", help=BARS_HELP),
        ],
    ),
    (
        "convert",
        "convert model weights between HF safetensors, orbax and PEFT adapters",
        "HF model directory (config.json + safetensors) <-> titan-jax model-only orbax "
        "checkpoint (DST/model_args.json + DST/params). --from orbax also reads one step of a "
        "training run ({dump_folder}/checkpoint/{step}, or the checkpoint folder for its newest "
        "step); a LoRA run's step converts to PEFT's "
        "adapter directory (--to peft: adapter_config.json + adapter_model.safetensors) or, "
        "adapters merged into the weights, to a plain HF model (--to hf). hf -> hf re-types or "
        "re-shards.",
        [
            _arg("--from", dest="src_format", choices=["hf", "orbax"], required=True),
            _arg("--to", dest="dst_format", choices=["hf", "orbax", "peft"], required=True),
            _arg("src", metavar="SRC"),
            _arg("dst", metavar="DST"),
            _arg(
                "--dtype",
                choices=["float32", "bfloat16"],
                default="float32",
                help="dtype of HF or PEFT output tensors",
            ),
            _arg(
                "--max-shard-size",
                default="5GB",
                help="split HF output into files of at most this size (e.g. 5GB, 500MiB)",
            ),
            _arg(
                "--overwrite",
                action="store_true",
                help="replace a DST that exists and is not empty (never the source)",
            ),
        ],
    ),
    (
        "generate",
        "generate text from a checkpoint (KV-cached, jitted)",
        "Continue a prompt with a trained model: a run's checkpoint (its folder for the newest "
        "step, or one step folder), a `convert --to orbax` directory, or a HF Qwen3 directory. "
        f"Runs on the recipe's mesh; {OVERRIDES}.",
        [
            RECIPE,
            Choice(
                (
                    _arg(
                        "--checkpoint",
                        metavar="PATH",
                        help="a run's checkpoint folder or step, or an orbax model directory",
                    ),
                    _arg(
                        "--hf-checkpoint",
                        metavar="DIR",
                        help="HF model directory (config.json, safetensors, tokenizer.json)",
                    ),
                )
            ),
            _arg("--prompt", required=True),
            _arg("--max-new-tokens", type=int, default=64),
            _arg("--temperature", type=float, default=0.0, help="0 = greedy (default)"),
            _arg("--top-p", type=float, default=1.0, help="nucleus sampling mass"),
            _arg("--seed", type=int, default=0),
        ],
    ),
    (
        "prepare-data",
        "tokenize the recipe's training source into a token store",
        "Read training.dataset / dataset_path / text_field streaming, tokenize with "
        "model.tokenizer_path (EOS after each document) and write a token store to --output "
        "(local or gs://...); train from it with --training.dataset tokens. A rerun after a "
        "crash keeps finished shards. Several machines: the same command with --num-shards N "
        "--shard-index I and an --output each; training reads the outputs together.",
        [
            RECIPE,
            _arg("--output", required=True, metavar="DIR", help="the store's folder"),
            _arg(
                "--workers",
                type=int,
                default=1,
                metavar="N",
                help="tokenizing processes (default 1)",
            ),
            _arg(
                "--num-shards",
                type=int,
                default=1,
                metavar="N",
                help="machines splitting the input files (default 1)",
            ),
            _arg(
                "--shard-index",
                type=int,
                default=0,
                metavar="I",
                help="this machine's part: input files i with i %% N == I",
            ),
            _arg(
                "--verify",
                action="store_true",
                help="check the store at --output against its checksums, then exit",
            ),
        ],
    ),
    (
        "goodput",
        "where a run's wall time went, across its restarts",
        "Summarise RUN_FOLDER/goodput.jsonl (written by train): the seconds and share of each of "
        "ml-goodput-measurement's categories (productive steps, startup, compilation, data "
        "loading, checkpoint save and restore, evaluation, steps recomputed after a restart, "
        "pauses between processes, other), goodput = productive / wall time, and the same for "
        "each process of the run.",
        [_arg("run_folder", metavar="RUN_FOLDER", help="a run's job.dump_folder"), JSON_OUT],
    ),
)


def add_commands(sub: argparse._SubParsersAction) -> None:
    for name, help_, description, arguments in COMMANDS:
        parser = sub.add_parser(name, help=help_, description=description)
        for argument in arguments:
            if isinstance(argument, Choice):
                group = parser.add_mutually_exclusive_group(required=True)
                for flags, keywords in argument.arguments:
                    group.add_argument(*flags, **keywords)
            else:
                flags, keywords = argument
                parser.add_argument(*flags, **keywords)
