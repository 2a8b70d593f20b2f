"""`rlora <command>`: thin — parse arguments, load and validate the config, call the recipe.

Bad input (UserError) prints one line `rlora: error: ...` and exits with code 2, no traceback (--debug
prints the traceback too).
"""

from __future__ import annotations

import argparse
import os
import sys

from rlora import __version__
from rlora.errors import UserError

EXIT_BAD_INPUT = 2

TRAIN_EPILOG = """\
examples:
  rlora train                                  # the embedded demo (SmolLM2-135M-Instruct, chain_sum)
  rlora train train.steps=5 lora.rank=8        # the demo with overrides
  rlora train my.yaml algo.beta=0.04           # your config with overrides
  rlora train --print-config                   # show the resolved config and exit
  rlora train algo.name=dapo                   # another algorithm (docs/algorithms.md)
  rlora train my.yaml train.checkpoint_every=10   # resumable checkpoints in OUTPUT/checkpoints ...
  rlora train my.yaml train.output_dir=OUTPUT train.resume=auto   # ... and continuing from the newest

stable override keys: model.path lora.rank lora.alpha lora.target_modules rollout.num_generations
  rollout.max_new_tokens rollout.temperature algo.beta algo.loss_agg train.steps train.prompts_per_step
  train.lr train.seed train.output_dir   (any other config key works too; see src/rlora/config.py)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlora", description="RL fine-tuning of language models with LoRA adapters on one frozen base model."
    )
    parser.add_argument("--version", action="version", version=f"rlora {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    train = commands.add_parser(
        "train", help="GRPO with LoRA (no arguments: the embedded demo)",
        description="Train a LoRA adapter with GRPO. With no CONFIG, the embedded demo config is used.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                       help="an optional YAML config file, then dotted overrides")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--debug", action="store_true", help="on bad input, print the traceback before the one-line error")
    merge = commands.add_parser(
        "merge", help="merge a LoRA adapter into its base and save a Hugging Face model folder",
        description="Fold ADAPTER into its base model (the one recorded in adapter_config.json, or --base) and save "
                    "a plain transformers folder with the tokenizer.")
    merge.add_argument("adapter", help="PEFT adapter folder (e.g. runs/train-.../adapter)")
    merge.add_argument("--output", "-o", required=True, help="folder for the merged model")
    merge.add_argument("--base", help="base model folder or alias (default: the adapter's own base)")
    merge.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    merge.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    merge.add_argument("--debug", action="store_true", help="on bad input, print the traceback too")
    return parser


def _merge(args: argparse.Namespace) -> int:
    from rlora.logging.console import info
    from rlora.merge import merge_adapter

    target = merge_adapter(args.adapter, args.output, args.base, args.dtype, args.overwrite)
    info(f"rlora merge: {args.adapter} merged into its base -> {target}")
    return 0


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    config_path = None
    overrides = list(items)
    if overrides and "=" not in overrides[0]:
        config_path = overrides.pop(0)
    for item in overrides:
        if "=" not in item:
            raise UserError(f"unexpected argument '{item}': give at most one CONFIG.yaml, then key=value overrides")
    return config_path, overrides


def _train(args: argparse.Namespace) -> int:
    from rlora.config import load_config, to_yaml

    config_path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(config_path, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from rlora.train.grpo import run_grpo

    run_grpo(cfg)
    return 0


def _quiet_libraries() -> None:
    """transformers' per-load progress bars and deprecation chatter would bury rlora's own output."""
    import logging
    import warnings

    # bitsandbytes (the quant extra) warns at import, on CPUs with AVX512-BF16, that an optional kernel
    # package is missing; that package would fetch kernels from a hub at run time, which rlora never does
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "merge":
            return _merge(args)
    except UserError as err:
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exc()
        print(f"rlora: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("rlora: interrupted (a run that had started training saved its adapter and summary.json)", file=sys.stderr)
        return 130
    return 0
