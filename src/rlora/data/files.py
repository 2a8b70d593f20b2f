"""Prompts from local json/jsonl/parquet/csv files, read through `datasets`."""

from __future__ import annotations

from pathlib import Path

from rlora.errors import UserError, first_line
from rlora.types import Example

_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def is_prompt(value) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def read_table(path: str):
    """A local json/jsonl/parquet/csv file as a `datasets` table with at least one row (else UserError)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"data file not found: {path}")
    loader = _LOADERS.get(file.suffix.lower())
    if loader is None:
        raise UserError(f"data file {path}: unsupported extension '{file.suffix}' (use .json, .jsonl, .parquet, .csv)")
    if loader in ("json", "csv"):
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"data file {path} is not UTF-8 text (byte {err.start}); re-encode it as UTF-8") from None
        if not text.strip():
            raise UserError(f"data file {path} has no rows")
    import datasets  # ~1 s: only runs that read a data file import it

    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(loader, data_files=str(file), split="train")
    except Exception as err:  # noqa: BLE001 - any parse failure is a malformed file for the user
        cause = err.__cause__ or err
        raise UserError(f"could not read data file {path}: {first_line(cause)}") from None
    if len(table) == 0:
        raise UserError(f"data file {path} has no rows")
    return table


def read_prompt_file(path: str, prompt_column: str, answer_column: str | None) -> list[Example]:
    """Every row becomes an Example; all columns except the prompt are passed to reward functions."""
    table = read_table(path)
    if prompt_column not in table.column_names:
        raise UserError(
            f"data file {path} has no column '{prompt_column}' (columns: {', '.join(table.column_names)}); "
            "set data.prompt_column"
        )
    if answer_column and answer_column != "answer" and answer_column not in table.column_names:
        raise UserError(
            f"data file {path} has no column '{answer_column}' (columns: {', '.join(table.column_names)}); "
            "set data.answer_column"
        )
    examples = []
    for number, row in enumerate(table, start=1):
        prompt = row.pop(prompt_column)
        if not is_prompt(prompt):
            raise UserError(
                f"data file {path}, row {number}: column '{prompt_column}' must hold non-empty text or a list of "
                "chat messages {role, content}"
            )
        if answer_column and answer_column in row and answer_column != "answer":
            row["answer"] = row[answer_column]
        examples.append(Example(prompt=prompt, columns=row))
    return examples
