"""The one exception type that means "the user must fix something" (CLI: one line, exit code 2)."""


class UserError(Exception):
    """Bad input: config, data, model or adapter folder, reward function. The message says how to fix it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler, `docker stop`, torchrun stopping the other ranks) raised as an
    interrupt, so a run stops as on Ctrl-C: it saves what it learnt and says why it stopped (cli.py installs it)."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """A one-line description of a library exception, for wrapping it into a UserError."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line[:limit]
