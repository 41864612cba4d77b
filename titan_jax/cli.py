"""`titan-jax` command line: `titan-jax {train,inspect,compile,parity,generate,prepare-data}
--config PATH [--section.key value ...]` and `titan-jax convert --from FMT --to FMT SRC DST`."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
from pathlib import Path

from titan_jax.atomic_dir import write_text_atomic
from titan_jax.config import ConfigError, JobConfig, load_config
from titan_jax.errors import TitanJaxError
from titan_jax.jax_platform import (
    compile_only_libtpu,
    default_libtpu_flags,
    default_to_cpu_without_accelerator,
    is_tpu_host,
)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, JobConfig | None]:
    parser = argparse.ArgumentParser(
        prog="titan-jax", description="JAX-native Qwen3 pre-training (TorchTitan recipes)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a model", description="Train; any config key can be overridden "
        "with --section.key value (e.g. --training.steps 20)."
    )
    train.add_argument("--config", help="TOML recipe, e.g. configs/qwen3_debug.toml")
    train.add_argument("--print-config", action="store_true",
                       help="print the resolved config as TOML and exit")
    inspect = sub.add_parser(
        "inspect", help="show shardings, collectives and memory without running a step",
        description="Per-parameter shardings and bytes per device, and the collectives and "
        "memory of the compiled train step (compiled, never run); config overrides as for train."
    )
    inspect.add_argument("--config", help="TOML recipe, e.g. configs/qwen3_debug.toml")
    inspect.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    _add_compile_parser(sub)
    _add_parity_parser(sub)
    _add_convert_parser(sub)
    _add_generate_parser(sub)
    _add_prepare_data_parser(sub)
    rest, overrides = _split_overrides(argv)
    args = parser.parse_args(rest)
    if args.command == "convert":  # no recipe: anything left over is a mistake
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        return args, None
    if getattr(args, "json", None):  # a report written at the end: checked before the work
        from titan_jax.train.preflight import check_output_file

        check_output_file(args.json, "--json")
    config = load_config(args.config, overrides)
    _check_flavor(config)
    return args, config


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the command's own arguments, the `--section.key value` overrides). Taken out before
    argparse reads the rest, so that an override's value is never read as a flag (`-h...`
    would print the help)."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg[2:].split("=", 1)[0]:
            takes_next = "=" not in arg and i + 1 < len(argv)
            overrides.extend(argv[i:i + 2] if takes_next else [arg])
            i += 2 if takes_next else 1
        else:
            rest.append(arg)
            i += 1
    return rest, overrides


def _check_flavor(config: JobConfig) -> None:
    """An unknown `model.name` or `model.flavor` is bad input (a ConfigError naming the valid
    ones), reported before anything is built."""
    from titan_jax.models import get_model_spec

    get_model_spec(config.model.name).flavor(config.model.flavor)


def _add_compile_parser(sub: argparse._SubParsersAction) -> None:
    compile_ = sub.add_parser(
        "compile", help="compile the train step for a TPU slice from this host, to plan a job",
        description="Compile the recipe's whole train step ahead of time for a named TPU slice "
        "(needs libtpu, no TPU) and report per-chip memory against HBM, FLOPs per step, the "
        "collectives and an estimate of step time and MFU (each instruction at the MXU peak or "
        "HBM bandwidth, plus the collectives the schedule leaves exposed; the roofline bound "
        "beside it); config overrides as for train. The parallelism degrees must multiply to "
        "the slice's chips (x --num-slices).")
    compile_.add_argument("--config", help="TOML recipe, e.g. configs/qwen3_8b.toml")
    compile_.add_argument("--topology", required=True, metavar="NAME",
                          help="a Cloud TPU slice name: v4-16, v5e-256, v5p-128, v6e-8, ... "
                          "(v4/v5p count TensorCores: v5p-8 is 4 chips)")
    compile_.add_argument("--num-slices", type=int, default=1, metavar="N",
                          help="slices joined over DCN (multislice; default 1)")
    compile_.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")


def _add_parity_parser(sub: argparse._SubParsersAction) -> None:
    from titan_jax.parity import BARS

    parity = sub.add_parser(
        "parity", help="compare with PyTorch (HF transformers, TorchTitan) on the same weights",
        description="Load the same weights into titan-jax and the PyTorch references and compare, "
        "in fp32: logits, per-token KL, greedy decoding, the loss, every gradient (HF) and "
        "optionally a training trajectory. Exits 1 when a figure is over its bar. Without "
        "--hf-checkpoint the recipe's model.flavor is randomly initialised (training.seed). "
        "Config overrides as for train (the trajectory uses the recipe's optimizer, "
        "lr_scheduler, training.local_batch_size, seq_len, max_norm and data)."
    )
    parity.add_argument("--config", required=True,
                        help="TOML recipe, e.g. configs/qwen3_debug.toml")
    parity.add_argument("--hf-checkpoint", metavar="DIR", help="HF model directory to load")
    parity.add_argument("--reference", choices=["hf", "torchtitan", "all"], default="all",
                        help="which PyTorch reference(s) to compare with (default: all)")
    parity.add_argument("--seq-len", type=int, default=512,
                        help="prompt length (default 512; short prompts miss RoPE bugs)")
    parity.add_argument("--trajectory-steps", type=int, default=0, metavar="N",
                        help="also run N train steps on both sides and compare the losses")
    parity.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    parity.add_argument("--bar", action="append", default=[], metavar="NAME=VALUE",
                        help="override a bar; defaults: "
                        + ", ".join(f"{k}={v:g}" for k, v in BARS.items()))


def _add_convert_parser(sub: argparse._SubParsersAction) -> None:
    convert = sub.add_parser(
        "convert", help="convert model weights between HF safetensors and orbax",
        description="HF model directory (config.json + safetensors) <-> titan-jax model-only "
        "orbax checkpoint (DST/model_args.json + DST/params). --from orbax also reads one step "
        "of a training run ({dump_folder}/checkpoint/{step}). hf -> hf re-types or re-shards."
    )
    convert.add_argument("--from", dest="src_format", choices=["hf", "orbax"], required=True)
    convert.add_argument("--to", dest="dst_format", choices=["hf", "orbax"], required=True)
    convert.add_argument("src", metavar="SRC")
    convert.add_argument("dst", metavar="DST")
    convert.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                         help="dtype of HF output tensors")
    convert.add_argument("--max-shard-size", default="5GB",
                         help="split HF output into files of at most this size (e.g. 5GB, 500MiB)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a DST that exists and is not empty (never the source)")


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    generate = sub.add_parser(
        "generate", help="generate text from a checkpoint (KV-cached, jitted)",
        description="Continue a prompt with a trained model: a run's checkpoint (its folder for "
        "the newest step, or one step folder), a `convert --to orbax` directory, or a HF Qwen3 "
        "directory. Runs on the recipe's mesh; config overrides as for train.")
    generate.add_argument("--config", help="TOML recipe, e.g. configs/qwen3_debug.toml")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="PATH",
                        help="a run's checkpoint folder or step, or an orbax model directory")
    source.add_argument("--hf-checkpoint", metavar="DIR",
                        help="HF model directory (config.json, safetensors, tokenizer.json)")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    generate.add_argument("--seed", type=int, default=0)


def _add_prepare_data_parser(sub: argparse._SubParsersAction) -> None:
    prepare = sub.add_parser(
        "prepare-data", help="tokenize the recipe's training source into a token store",
        description="Read training.dataset / dataset_path / text_field streaming, tokenize with "
        "model.tokenizer_path (EOS after each document) and write a token store to --output "
        "(local or gs://...); train from it with --training.dataset tokens. A rerun after a "
        "crash keeps finished shards. Several machines: the same command with --num-shards N "
        "--shard-index I and an --output each; training reads the outputs together.")
    prepare.add_argument("--config", help="TOML recipe, e.g. configs/qwen3_debug.toml")
    prepare.add_argument("--output", required=True, metavar="DIR", help="the store's folder")
    prepare.add_argument("--workers", type=int, default=1, metavar="N",
                         help="tokenizing processes (default 1)")
    prepare.add_argument("--num-shards", type=int, default=1, metavar="N",
                         help="machines splitting the input files (default 1)")
    prepare.add_argument("--shard-index", type=int, default=0, metavar="I",
                         help="this machine's part: input files i with i %% N == I")
    prepare.add_argument("--verify", action="store_true",
                         help="check the store at --output against its checksums, then exit")


def _generate(args: argparse.Namespace, config: JobConfig) -> int:
    from titan_jax.parallel.mesh import set_cpu_device_count

    set_cpu_device_count(config.job.cpu_devices)  # before JAX starts, as for train
    from titan_jax.tools.generate import GenerateOptions, generate_text

    options = GenerateOptions(args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                              args.seed)
    text, source = generate_text(config, args.checkpoint, args.hf_checkpoint, options)
    print(f"titan-jax generate: {source}", file=sys.stderr)
    print(args.prompt + text)
    return 0


def _inspect(config: JobConfig, json_out: str | None) -> int:
    from titan_jax.parallel.mesh import set_cpu_device_count

    set_cpu_device_count(config.job.cpu_devices)  # before JAX starts, as for train
    from titan_jax.tools.inspect_step import format_report, inspect_trainer
    from titan_jax.train.trainer import build_trainer

    report = inspect_trainer(build_trainer(config))
    print(format_report(report))
    if json_out:
        write_text_atomic(json_out, json.dumps(report, indent=2) + "\n")
    return 0


def _compile(args: argparse.Namespace, config: JobConfig) -> int:
    from titan_jax.tools.aot_compile import compile_report, format_report

    report = compile_report(config, args.topology, args.num_slices)
    print(format_report(report))
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=2) + "\n")
    return 0


def _progress(message: str) -> None:
    print(f"titan-jax parity: {message} ...", file=sys.stderr, flush=True)


def _parity(args: argparse.Namespace, config: JobConfig) -> int:
    from titan_jax.parity import BARS, REFERENCES
    from titan_jax.parity.run import run_from_config

    bars = dict(BARS)
    for item in args.bar:
        name, eq, value = item.partition("=")
        try:
            if name not in BARS or not eq:
                raise ValueError
            bars[name] = float(value)
        except ValueError:
            raise ConfigError(f"--bar {item!r}: expected NAME=NUMBER with NAME one of "
                             f"{', '.join(BARS)}") from None
    _check_parity_lengths(args, config)
    references = REFERENCES if args.reference == "all" else (args.reference,)
    report = run_from_config(config, args.hf_checkpoint, references=references,
                             seq_len=args.seq_len, trajectory_steps=args.trajectory_steps,
                             bars=bars, progress=_progress)
    print(report.table())
    if args.json:
        write_text_atomic(args.json, json.dumps(report.to_json(), indent=2) + "\n")
    return 1 if report.failures() else 0


def _check_parity_lengths(args: argparse.Namespace, config: JobConfig) -> None:
    """The prompt fits the model's positions (RoPE past them compares nothing real)."""
    from titan_jax.models import get_model_spec
    from titan_jax.models.qwen3.hf_config import read_hf_config

    if args.hf_checkpoint:
        model, where = read_hf_config(Path(args.hf_checkpoint)), f"{args.hf_checkpoint}'s"
    else:
        model = get_model_spec(config.model.name).flavor(config.model.flavor)
        where = f"model.flavor={config.model.flavor}'s"
    from titan_jax.parity.run import run_parity

    decode = inspect.signature(run_parity).parameters["decode_tokens"].default
    most = model.max_seq_len - decode  # the greedy continuation must fit too
    if not 1 <= args.seq_len <= most:
        raise ConfigError(f"--seq-len {args.seq_len} must be in [1, {most}]: {where} "
                          f"{model.max_seq_len} positions less the {decode} greedy tokens")
    if args.trajectory_steps < 0:
        raise ConfigError(f"--trajectory-steps {args.trajectory_steps} must be >= 0")


def _convert(args: argparse.Namespace) -> int:
    from titan_jax.tools.convert import convert

    model = convert(args.src, args.dst, args.src_format, args.dst_format, dtype=args.dtype,
                    max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    print(f"converted {args.src} ({args.src_format}) -> {args.dst} ({args.dst_format}): "
          f"{model.n_layers} layers, dim {model.dim}, vocab {model.vocab_size}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:
        compile_only_libtpu()  # before anything imports JAX
    elif is_tpu_host():
        default_libtpu_flags()
    default_to_cpu_without_accelerator()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args, config = _parse(argv)
        if args.command == "inspect":
            return _inspect(config, args.json)
        if args.command == "compile":
            return _compile(args, config)
        if args.command == "parity":
            return _parity(args, config)
        if args.command == "convert":
            return _convert(args)
        if args.command == "generate":
            return _generate(args, config)
        if args.command == "prepare-data":
            from titan_jax.tools.prepare_data import prepare_data

            prepare_data(config, args.output, workers=args.workers, num_shards=args.num_shards,
                         shard_index=args.shard_index, verify=args.verify)
            return 0
        if args.print_config:
            print(config.to_toml())
            return 0
        # Simulated CPU devices must be configured before JAX initialises its backends.
        from titan_jax.parallel.mesh import set_cpu_device_count

        set_cpu_device_count(config.job.cpu_devices)
        _enable_compilation_cache()
        from titan_jax.train.bad_steps import BadStepsError
        from titan_jax.train.loop import train

        try:
            train(config)
        except BadStepsError as e:  # the run diverged: one line, but not bad input
            print(f"titan-jax: error: {e}", file=sys.stderr)
            return 1
    except TitanJaxError as e:  # bad input: one line. Anything else keeps its traceback.
        print(f"titan-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: the first one already asked for a clean stop
        print("titan-jax: interrupted", file=sys.stderr)
        return 130
    return 0


def _enable_compilation_cache() -> None:
    """Reuse compiled steps across runs (a resumed run starts without recompiling)."""
    import jax

    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = os.environ.get("TITAN_JAX_COMPILATION_CACHE",
                           str(Path(cache_home) / "titan_jax" / "xla"))
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)


if __name__ == "__main__":
    sys.exit(main())
