"""`titan-jax` command line: `titan-jax train --config PATH [--section.key value ...]`."""

from __future__ import annotations

import argparse
import logging
import sys

from titan_jax.config import JobConfig, load_config


def _parse(argv: list[str]) -> tuple[argparse.Namespace, JobConfig]:
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
    args, overrides = parser.parse_known_args(argv)
    return args, load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args, config = _parse(argv)
        if args.print_config:
            print(config.to_toml())
            return 0
        # Simulated CPU devices must be configured before JAX initialises its backends.
        from titan_jax.parallel.mesh import set_cpu_device_count

        set_cpu_device_count(config.job.cpu_devices)
        from titan_jax.train.loop import BadStepsError, train

        try:
            train(config)
        except BadStepsError as e:
            print(f"titan-jax: error: {e}", file=sys.stderr)
            return 1
    except (ValueError, OSError) as e:  # ConfigError is a ValueError: bad input, one line
        print(f"titan-jax: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
