"""`titan-jax` command line: `titan-jax {train,inspect,compile,parity,generate,prepare-data}
--config PATH [--section.key value ...]`, `titan-jax convert --from FMT --to FMT SRC DST` and
`titan-jax goodput RUN_FOLDER`."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import sys
from pathlib import Path

from titan_jax.atomic_dir import write_text_atomic
from titan_jax.cli_commands import add_commands
from titan_jax.config import ConfigError, JobConfig, load_config, split_overrides
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
    add_commands(parser.add_subparsers(dest="command", required=True))
    rest, overrides = split_overrides(argv)
    args = parser.parse_args(rest)
    if getattr(args, "json", None):  # a report written at the end: checked before the work
        from titan_jax.train.preflight import check_output_file

        check_output_file(args.json, "--json")
    if args.command in ("convert", "goodput"):  # no recipe: anything left over is a mistake
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        return args, None
    config = load_config(args.config, overrides)
    from titan_jax.train.plan_decisions import model_choice

    model_choice(config)  # an unknown model.name or flavor: before anything is built
    return args, config


def _generate(args: argparse.Namespace, config: JobConfig) -> int:
    from titan_jax.parallel.mesh import set_cpu_device_count

    set_cpu_device_count(config.job.cpu_devices)  # before JAX starts, as for train
    from titan_jax.tools.generate import GenerateOptions, generate_text

    options = GenerateOptions(
        args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed
    )
    text, source = generate_text(config, args.checkpoint, args.hf_checkpoint, options)
    print(f"titan-jax generate: {source}", file=sys.stderr)
    print(args.prompt + text)
    return 0


def _inspect(config: JobConfig, json_out: str | None) -> int:
    from titan_jax.parallel.mesh import set_cpu_device_count

    set_cpu_device_count(config.job.cpu_devices)  # before JAX starts, as for train
    from titan_jax.planner.inspect_step import format_report, inspect_trainer
    from titan_jax.train.trainer import build_trainer

    report = inspect_trainer(build_trainer(config))
    print(format_report(report))
    if json_out:
        write_text_atomic(json_out, json.dumps(report, indent=2) + "\n")
    return 0


def _compile(args: argparse.Namespace, config: JobConfig) -> int:
    from titan_jax.planner.aot_compile import compile_report, format_report

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
            raise ConfigError(
                f"--bar {item!r}: expected NAME=NUMBER with NAME one of {', '.join(BARS)}"
            ) from None
        if not math.isfinite(bars[name]):  # nan would fail every check, inf pass every one
            raise ConfigError(
                f"--bar {item!r}: {value} must be a finite number (the largest {name} that passes)"
            )
    _check_parity_lengths(args, config)
    references = REFERENCES if args.reference == "all" else (args.reference,)
    report = run_from_config(
        config,
        args.hf_checkpoint,
        references=references,
        seq_len=args.seq_len,
        trajectory_steps=args.trajectory_steps,
        bars=bars,
        progress=_progress,
    )
    print(report.table())
    if args.json:
        write_text_atomic(args.json, json.dumps(report.to_json(), indent=2) + "\n")
    return 1 if report.failures() else 0


def _check_parity_lengths(args: argparse.Namespace, config: JobConfig) -> None:
    """The prompt fits the model's positions (RoPE past them compares nothing real)."""
    from titan_jax.models import get_model_spec

    spec = get_model_spec(config.model.name)
    if args.hf_checkpoint:
        model, where = spec.hf.read_config(Path(args.hf_checkpoint)), f"{args.hf_checkpoint}'s"
    else:
        model = spec.flavor(config.model.flavor)
        where = f"model.flavor={config.model.flavor}'s"
    from titan_jax.parity.run import run_parity

    decode = inspect.signature(run_parity).parameters["decode_tokens"].default
    most = model.max_seq_len - decode  # the greedy continuation must fit too
    if not 1 <= args.seq_len <= most:
        raise ConfigError(
            f"--seq-len {args.seq_len} must be in [1, {most}]: {where} "
            f"{model.max_seq_len} positions less the {decode} greedy tokens"
        )
    if args.trajectory_steps < 0:
        raise ConfigError(f"--trajectory-steps {args.trajectory_steps} must be >= 0")


def _convert(args: argparse.Namespace) -> int:
    from titan_jax.tools.convert import convert

    model = convert(
        args.src,
        args.dst,
        args.src_format,
        args.dst_format,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    print(
        f"converted {args.src} ({args.src_format}) -> {args.dst} ({args.dst_format}): "
        f"{model.n_layers} layers, dim {model.dim}, vocab {model.vocab_size}"
    )
    return 0


def _goodput(args: argparse.Namespace) -> int:
    from titan_jax.train.goodput_summary import read_records, summarize

    summary = summarize(args.run_folder, read_records(args.run_folder))
    print(summary.table())
    if args.json:
        write_text_atomic(args.json, json.dumps(summary.to_json(), indent=2) + "\n")
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
        if config is None:  # the commands without a recipe
            return _convert(args) if args.command == "convert" else _goodput(args)
        if args.command == "inspect":
            return _inspect(config, args.json)
        if args.command == "compile":
            return _compile(args, config)
        if args.command == "parity":
            return _parity(args, config)
        if args.command == "generate":
            return _generate(args, config)
        if args.command == "prepare-data":
            from titan_jax.tools.prepare_data import prepare_data

            prepare_data(
                config,
                args.output,
                workers=args.workers,
                num_shards=args.num_shards,
                shard_index=args.shard_index,
                verify=args.verify,
            )
            return 0
        if args.print_config:
            print(config.to_toml())
            return 0
        # Simulated CPU devices must be configured before JAX initialises its backends.
        from titan_jax.parallel.mesh import set_cpu_device_count

        set_cpu_device_count(config.job.cpu_devices)
        if config.distributed.num_processes <= 1:
            _enable_compilation_cache()
        from titan_jax.train.goodput import process_start_time
        from titan_jax.train.loop import train
        from titan_jax.train.stopping import BadStepsError

        try:
            train(config, started_at=process_start_time())
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
    """Reuse compiled steps across runs (a resumed run starts without recompiling). Not for
    explicit multi-process runs: JAX writes the cache from process 0 only and the other
    processes' keys differ, so process 0 would load its step while they compile it, and reach
    the first collective alone (on CPU, gloo gives up after 30 s)."""
    import jax

    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = os.environ.get(
        "TITAN_JAX_COMPILATION_CACHE", str(Path(cache_home) / "titan_jax" / "xla")
    )
    if cache and Path(cache).exists() and not Path(cache).is_dir():
        print(
            f"titan-jax: the compilation cache {cache} is not a folder; compiling without "
            "one (set TITAN_JAX_COMPILATION_CACHE to a folder, or to '' for none)",
            file=sys.stderr,
        )
        return
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)


if __name__ == "__main__":
    sys.exit(main())
