"""How every run ends (`rlora train`, `rlora sft`, `rlora rm`): whatever stops it, what was learnt is saved
and summary.json says why it stopped; then the error goes on to the command line (one line, an exit code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rlora.errors import Terminated
from rlora.logging.console import info
from rlora.train.outputs import RunDir


def stop_status(stop: BaseException) -> str:
    """summary.json's status for what stopped a run: an error may name its own (`run_status`, e.g. reward failures)."""
    if isinstance(stop, Terminated):
        return "terminated"
    if isinstance(stop, KeyboardInterrupt):
        return "interrupted"
    return getattr(stop, "run_status", None) or f"failed: {type(stop).__name__}: {stop}"


@contextmanager
def kept_on_stop(run_dir: RunDir, summary: dict, save: Callable[[], None],
                 before_save: Callable[[], None] | None = None) -> Iterator[None]:
    """Run the body (the steps); if anything stops it: before_save() (e.g. close the log sinks), save() (the
    adapter), summary.json = `summary` (as the body left it) with the stop's status; then re-raise. A save that
    fails too (a full disk) is reported in one line and the original error goes on."""
    try:
        yield
    except BaseException as stop:
        summary["status"] = stop_status(stop)
        if before_save is not None:
            before_save()
        try:
            save()
            run_dir.write_json("summary.json", summary)
        except OSError as err:
            info(f"could not save what was learnt after the run stopped: {err}")
        raise
