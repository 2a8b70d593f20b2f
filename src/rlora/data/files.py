"""Prompts from local json/jsonl/parquet/csv files, read through `datasets`."""

from __future__ import annotations

import json
import tempfile
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


def check_data_file(path: str) -> None:
    """UserError unless `path` is a file. The message names the absolute path looked at: a relative data path is
    read from the current directory, while reward files (`fn: FILE.py:fn`) are found next to the config file, so
    a run started from another folder would otherwise name a path that looks right."""
    file = Path(path)
    if file.is_file():
        return
    where = "" if file.is_absolute() else (" (a relative data path is read from the current directory, not from the "
                                           "config file's folder: run from the folder it is relative to, or give an "
                                           "absolute path)")
    raise UserError(f"data file not found: {file.absolute()}{where}")


def _first_bad_json_line(text: str) -> str | None:
    """`line N: problem` for the first line of JSON Lines text that is not one JSON object (N from 1, as an
    editor counts, blank lines included; pyarrow's own message counts rows from 0 and skips blank lines)."""
    # split on newlines only: splitlines() also breaks at U+2028 and the like, which JSON strings may hold
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {number}: {err.msg} (column {err.colno})"
        if not isinstance(row, dict):
            return f"line {number}: not a JSON object (one {{\"column\": value, ...}} per line)"
    return None


def _has_blank_lines(text: str) -> bool:
    lines = text.split("\n")
    return any(not line.strip() for line in (lines[:-1] if text.endswith("\n") else lines))


def _without_blank_lines(path: str, text: str, datasets):
    with tempfile.TemporaryDirectory() as folder:  # the copy and its arrow cache, both gone afterwards
        copy = Path(folder) / "rows.jsonl"
        copy.write_text("".join(line + "\n" for line in text.split("\n") if line.strip()), encoding="utf-8")
        try:
            return datasets.load_dataset("json", data_files=str(copy), split="train", keep_in_memory=True,
                                         cache_dir=str(Path(folder) / "cache"))
        except Exception as err:  # noqa: BLE001 - a malformed file for the user
            raise UserError(f"could not read data file {path}: {first_line(err.__cause__ or err)}") from None


def _json_problem(text: str, suffix: str) -> str | None:
    """Where a .json/.jsonl file that `datasets` could not read first goes wrong, or None (then its message stands)."""
    if suffix == ".jsonl":
        return _first_bad_json_line(text)
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().startswith("{"):  # JSON Lines in a .json file (datasets reads it)
            return _first_bad_json_line(text)
        return f"not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"


def read_table(path: str):
    """A local json/jsonl/parquet/csv file as a `datasets` table with at least one row (else UserError)."""
    file = Path(path)
    check_data_file(path)
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
        problem = _json_problem(text, file.suffix.lower()) if loader == "json" else None
        if problem is None and file.suffix.lower() == ".jsonl" and _has_blank_lines(text):
            # every line is a JSON object: datasets' reader of columns with mixed types (answers 3 and "1/2")
            # parses each line again, blank ones too, and fails on them; read the rows without the blank lines
            return _without_blank_lines(path, text, datasets)
        raise UserError(f"could not read data file {path}: {problem or first_line(cause)}") from None
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
