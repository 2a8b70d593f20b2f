"""Rich console output: a progress bar with the key metrics and ETA, and a final summary table."""

from __future__ import annotations

import logging
import os
import time
import warnings
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=True)
_now = time.monotonic  # the piped progress lines' clock (tests set their own)


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def metrics_line(m: dict) -> str:
    return (
        f"reward {_fmt(m.get('reward_mean'))}  kl {_fmt(m.get('kl'), '.4f')}  clip {_fmt(m.get('clip_frac'), '.2f')}"
        f"  len {_fmt(m.get('completion_len_mean'), '.1f')}  {_fmt(m.get('step_s'), '.1f')}s/step"
    )


@contextmanager
def progress_bar(description: str, total: int):
    """Yields update(completed, text) for a bar with metrics text, elapsed time and ETA; where the output is not a
    terminal (logs, CI, a pipe), a plain line per update with text instead: a bar drawn there would come out once,
    at the end, cut to the console's width."""
    if not console.is_terminal:
        last_line_at = [_now()]

        def print_line(completed: int, text: str = "") -> None:
            # each update with metrics (a training step); a bare count (evaluation batches) at most every 10 s
            now = _now()
            if text or completed >= total or now - last_line_at[0] >= 10.0:
                console.print(f"{description} {completed}/{total}  {text}".rstrip(), soft_wrap=True)
                last_line_at[0] = now

        yield print_line
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[text]}"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total, text="")

        def update(completed: int, text: str = "") -> None:
            progress.update(task, completed=completed, text=text)

        yield update


def print_summary(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


def info(message: str) -> None:
    # soft_wrap: a line longer than the console stays one line (the terminal wraps it; a log keeps it whole and
    # greppable) instead of being broken at 80 columns where stderr is not a terminal
    console.print(message, soft_wrap=True)


def quiet_libraries() -> None:
    """transformers' per-load progress bars and deprecation chatter would bury rlora's own output."""
    # bitsandbytes (the quant extra) warns at import, on CPUs with AVX512-BF16, that an optional kernel
    # package is missing; that package would fetch kernels from a hub at run time, which rlora never does
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging  # transformers (~2 s): `rlora --help` starts without it

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
