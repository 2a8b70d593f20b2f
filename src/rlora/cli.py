"""`rlora <command>`: thin — parse arguments, load and validate the config, call the recipe.

Bad input (UserError) prints one line `rlora: error: ...` and exits with code 2, no traceback (--debug
prints the traceback too).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from rlora import __version__
from rlora.errors import Terminated, UserError
from rlora.logging.console import info, quiet_libraries
from rlora.plot import plot_runs

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
  train.lr train.seed train.output_dir   (any other config key works too; see src/rlora/config/)
"""

SFT_EPILOG = """\
examples:
  rlora sft configs/sft_math.yaml                          # LoRA SFT on prompt/completion rows
  rlora sft my.yaml train.epochs=2 data.eval_size=50       # two passes, 50 rows held out for eval_loss
  rlora sft my.yaml train.full_finetune=true               # every parameter (models up to 1B parameters)
  rlora train rl.yaml lora.init_from=runs/sft-X/adapter    # then RL from the SFT adapter
"""

RM_EPILOG = """\
examples:
  rlora rm configs/rm_pairs.yaml                           # reward adapter + score head on prompt/chosen/rejected rows
  rlora rm my.yaml data.margin_column=margin data.eval_size=100   # Bradley-Terry with a per-pair margin
"""

EVAL_EPILOG = """\
examples:
  rlora eval runs/train-X                       # the run's adapter against the base, on the run's held-out set
  rlora eval my.yaml -a a=runs/a/adapter -a b=runs/b/adapter   # several adapters side by side
  rlora eval my.yaml eval.num_samples=8 eval.temperature=0.7 eval.pass_k=[1,4,8]   # unbiased pass@k
"""


class Supervised(NamedTuple):
    """A supervised command (`rlora sft`, `rlora rm`): its config, recipe and help texts."""

    config_class: str
    example: str
    module: str
    function: str
    help: str
    description: str
    epilog: str


SUPERVISED = {
    "sft": Supervised(
        "SFTConfig", "configs/sft_math.yaml", "rlora.train.sft", "run_sft",
        "supervised fine-tuning of a LoRA adapter (or a small model) on prompt/completion or chat rows",
        "Supervised fine-tuning with the loss on completion (assistant) tokens only; writes the same run folder and "
        "adapter format as `rlora train` (docs/sft.md).", SFT_EPILOG),
    "rm": Supervised(
        "RMConfig", "configs/rm_pairs.yaml", "rlora.train.rm", "run_rm",
        "train a reward model (a LoRA adapter plus a scalar score head) on preference pairs",
        "Train a reward adapter and a scalar score head on the same base with the Bradley-Terry loss on "
        "chosen/rejected pairs; reports held-out pair accuracy and saves OUTPUT/reward_model (docs/reward_models.md).",
        RM_EPILOG),
}


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
    for name, spec in SUPERVISED.items():
        command = commands.add_parser(name, help=spec.help, description=spec.description, epilog=spec.epilog,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_argument("items", nargs="+", metavar="CONFIG.yaml [key=value ...]",
                             help="a YAML config file, then dotted overrides")
        command.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        command.add_argument("--debug", action="store_true",
                             help="on bad input, print the traceback before the one-line error")
    evaluate = commands.add_parser(
        "eval", help="evaluate the base model and adapters side by side on held-out prompts",
        description="Evaluate the base model (adapters off) and each --adapter on the held-out prompts of a config: "
                    "accuracy, unbiased pass@k (eval.num_samples, eval.pass_k), mean reward; samples to JSONL.",
        epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    evaluate.add_argument("items", nargs="*", metavar="[CONFIG.yaml | RUN_DIR] [key=value ...]",
                          help="a config file or a run folder of `rlora train` (default: the demo config), then overrides")
    evaluate.add_argument("--adapter", "-a", action="append", default=[], metavar="[NAME=]PATH",
                          help="a PEFT adapter folder to evaluate (repeatable); default: a run folder's adapter (or every "
                               "policy's adapter of a run of several policies)")
    evaluate.add_argument("--no-base", action="store_true", help="skip the base model")
    evaluate.add_argument("--output", "-o", help="folder for eval.json and samples (default: runs/eval-TIMESTAMP)")
    evaluate.add_argument("--overwrite", action="store_true", help="write into a non-empty output folder")
    evaluate.add_argument("--debug", action="store_true", help="on bad input, print the traceback too")
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
    chat = commands.add_parser(
        "chat", help="chat in the terminal with a base model and its adapters (switch live)",
        description="Interactive multi-turn chat through the tokenizer's chat template. All adapters sit on one "
                    "base model: /adapter NAME switches, /base turns the adapter off, /save FILE writes the "
                    "conversation as JSON, /help lists the commands (docs/chat.md).")
    chat.add_argument("--model", metavar="PATH_OR_ALIAS",
                      help="base model folder or alias (default: the first adapter's recorded base, else "
                           "smollm2-135m-instruct)")
    chat.add_argument("--adapter", action="append", default=[], metavar="[NAME=]PATH",
                      help="a PEFT adapter folder (repeatable; a bare PATH is named after its folder); the first is "
                           "active at the start")
    chat.add_argument("--system", metavar="TEXT", help="system prompt")
    chat.add_argument("--tool", action="append", default=[], metavar="calculator|MODULE.FN|FILE.py:FN",
                      help="a tool the model may call (repeatable): its results come back as tool messages "
                           "(docs/environments.md)")
    chat.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="longest reply in tokens (default 256)")
    chat.add_argument("--temperature", type=float, default=0.7, metavar="T", help="0: greedy (default 0.7)")
    chat.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1.0: off)")
    chat.add_argument("--seed", type=int, default=0, metavar="S", help="reply i is sampled with seed S + i (default 0)")
    chat.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    chat.add_argument("--debug", action="store_true", help="on bad input, print the traceback too")
    serve = commands.add_parser(
        "serve", help="a local tinker-compatible training server: the tinker SDK trains LoRA adapters on one base",
        description="Serve the tinker API (the official `tinker` SDK, 0.38.0) on one frozen base model: each training "
                    "client is a LoRA adapter on it; sampling, saved adapters (PEFT folders under --state-dir). Point "
                    "the SDK at it with TINKER_BASE_URL=http://HOST:PORT (docs/serve.md). Needs the serve extra: "
                    "pip install 'rlora[serve]'.")
    serve.add_argument("--model", metavar="PATH_OR_ALIAS",
                       help="base model folder or alias (default: smollm2-135m-instruct); no model hub")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other "
                                                          "needs --api-key)")
    serve.add_argument("--port", type=int, default=8000, metavar="N", help="port (default 8000)")
    serve.add_argument("--state-dir", default="runs/serve", metavar="DIR",
                       help="where saved adapters go (default runs/serve)")
    serve.add_argument("--api-key", metavar="KEY", help="the key clients must send (TINKER_API_KEY; starts with 'tml-')")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                       help="the base model's dtype (default float32)")
    serve.add_argument("--prefix-cache-mb", type=int, metavar="MB",
                       help="keep sampled rows' keys and values up to this size, so that a prompt that begins with "
                            "one (an episode's next turn) runs only its new tokens (default 1024; 0: off)")
    serve.add_argument("--no-shared-prefixes", action="store_true",
                       help="run every datum of a forward_backward whole (by default data that begin alike, e.g. an "
                            "episode's turns, run their shared prefix once: the same numbers, less work)")
    serve.add_argument("--debug", action="store_true", help="on bad input, print the traceback too")
    plot = commands.add_parser(
        "plot", help="PNG figures of training runs' metrics (reward, KL, entropy, length, clip fraction, step time)",
        description="Plot RUN_DIR/metrics.jsonl against the step: one PNG per metric and overview.png. One run: "
                    "in RUN_DIR/plots; several runs are overlaid (legend: folder names) and need -o.")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output folder of `rlora train`")
    plot.add_argument("--output", "-o", help="folder for the figures (default: RUN_DIR/plots; required for several runs)")
    plot.add_argument("--debug", action="store_true", help="on bad input, print the traceback too")
    return parser


def _plot(args: argparse.Namespace) -> int:
    result = plot_runs(args.runs, args.output)
    for key in result.skipped:
        info(f"note: no run has values of {key}: skipped")
    info(f"rlora plot: {len(result.files)} figures -> {result.files[0].parent}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from rlora.train.outputs import check_merge_output  # no torch: a used folder is refused in a second

    check_merge_output(args.output, args.overwrite)
    from rlora.merge import merge_adapter  # torch: `rlora --help` and the other commands start without it

    target = merge_adapter(args.adapter, args.output, args.base, args.dtype, args.overwrite)
    info(f"rlora merge: {args.adapter} merged into its base -> {target}")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from rlora.chat import chat_main  # torch: `rlora --help` and the other commands start without it

    return chat_main(args)


def _serve(args: argparse.Namespace) -> int:
    try:
        # fastapi, uvicorn, tinker: the optional serve extra; torch too (`rlora --help` starts without them)
        from rlora.serve.main import serve_main
    except ImportError as err:
        if err.name and err.name.split(".")[0] in ("fastapi", "uvicorn", "tinker", "starlette"):
            raise UserError(f"rlora serve needs the serve extra ({err.name} is missing): pip install 'rlora[serve]'") from None
        raise
    return serve_main(args)


def _eval(args: argparse.Namespace) -> int:
    from rlora.train.outputs import check_eval_output  # no torch: a used folder is refused in a second

    if args.output is not None:
        check_eval_output(Path(args.output), args.overwrite)
    # torch: `rlora --help` and the other commands start without it
    from rlora.evaluation import BASE, Candidate, parse_adapters, resolve_config, run_eval_command

    cfg, run_adapters = resolve_config(args.items)
    adapters = parse_adapters(args.adapter or run_adapters)
    candidates = ([] if args.no_base else [Candidate(BASE, None)]) + adapters
    if not candidates:
        raise UserError("nothing to evaluate: --no-base needs at least one --adapter")
    run_eval_command(cfg, candidates, args.output, args.overwrite)
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
    from rlora.config import load_config, to_yaml  # pydantic: `rlora --help` starts without it

    config_path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(config_path, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    _refuse_used_output_folder(cfg)
    from rlora.train.grpo import run_grpo  # torch: --print-config and config errors come without it

    run_grpo(cfg)
    return 0


def _refuse_used_output_folder(cfg) -> None:
    """A fresh run into a folder that already holds files is refused now rather than after ~10 s of importing the
    training stack (the recipe checks again; resumes read the checkpoints there). A single process only: under
    torchrun rank 0 makes the folder, and a later rank's look could find it already made."""
    resume = getattr(cfg.train, "resume", None)  # sft and rm have none
    if resume is None and cfg.train.output_dir is not None and os.environ.get("WORLD_SIZE", "1") == "1":
        from rlora.train.outputs import RunDir  # no torch

        RunDir(cfg.train.output_dir, cfg.train.overwrite).check_writable()


def _supervised(args: argparse.Namespace) -> int:
    from rlora import config as config_module  # pydantic: `rlora --help` starts without it

    spec = SUPERVISED[args.command]
    config_path, overrides = _split_config_and_overrides(args.items)
    if config_path is None:
        raise UserError(f"rlora {args.command} needs a CONFIG.yaml first (e.g. {spec.example}), then key=value overrides")
    cfg = config_module.load_config(config_path, overrides, model_cls=getattr(config_module, spec.config_class))
    if args.print_config:
        print(config_module.to_yaml(cfg), end="")
        return 0
    _refuse_used_output_folder(cfg)
    getattr(importlib.import_module(spec.module), spec.function)(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "items") and all("=" in item and not item.startswith("-") for item in extra):
        args.items += extra  # overrides given after options (`rlora eval -a A key=value`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    quiet_libraries()  # after parsing: --help, --version and usage errors exit without importing transformers
    with _sigterm_interrupts():
        return _run(args)


def _run(args) -> int:
    try:
        if args.command not in ("train", *SUPERVISED) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError(f"rlora {args.command} runs in one process (every rank would write the same output): run "
                            "it without torchrun (train, sft and rm run data parallel)")
        if args.command == "train":
            return _train(args)
        if args.command in SUPERVISED:
            return _supervised(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "merge":
            return _merge(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "serve":
            return _serve(args)
    except UserError as err:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"rlora: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as stop:
        if args.command == "serve":
            return 0
        saved = " (a run that had started training saved its adapter and summary.json)" if args.command in ("train", "sft", "rm") else ""
        terminated = isinstance(stop, Terminated)
        print(f"rlora: {'terminated (SIGTERM)' if terminated else 'interrupted'}{saved}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    return 0


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises Terminated (an interrupt) while a command runs, so a training run killed by `timeout`, a
    scheduler or `docker stop` keeps its adapter as on Ctrl-C; the previous handler comes back afterwards (main()
    may be called in a longer-lived process, e.g. the tests). Only the main thread may set handlers. `rlora serve`:
    uvicorn installs its own (a graceful shutdown) while it serves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
