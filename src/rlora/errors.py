"""The one exception type that means "the user must fix something" (CLI: one line, exit code 2)."""

import re


class UserError(Exception):
    """Bad input: config, data, model or adapter folder, reward function. The message says how to fix it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler, `docker stop`, torchrun stopping the other ranks) raised as an
    interrupt, so a run stops as on Ctrl-C: it saves what it learnt and says why it stopped (cli.py installs it)."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal control sequences (colours, erase line)


def first_line(err: BaseException, limit: int = 300) -> str:
    """A one-line description of a library exception, for wrapping it into a UserError: its first line with a
    letter or digit (nltk opens with a row of '*'), terminal colour codes removed."""
    lines = [_ANSI.sub("", line).strip() for line in str(err).splitlines()]
    words = [line for line in lines if any(ch.isalnum() for ch in line)]
    return (words[0] if words else type(err).__name__)[:limit]
