"""The one exception type that means "the user must fix something" (CLI: one line, exit code 2)."""


class UserError(Exception):
    """Bad input: config, data, model or adapter folder, reward function. The message says how to fix it."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """A one-line description of a library exception, for wrapping it into a UserError."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line[:limit]
