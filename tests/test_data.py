import json

import pytest

from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import DataConfig, load_config
from rlora.data.files import read_prompt_file
from rlora.data.prompts import PromptOrder, load_prompt_sets, render_prompt
from rlora.data.tasks import check_task
from rlora.errors import UserError
from rlora.models.tiny import build_tokenizer
from rlora.train.session import check_data_and_rewards, check_inputs, check_rows_answered
from rlora.types import Example

ROWS = [{"question": "1 + 1 =", "answer": "2", "level": 1}, {"question": "2 + 2 =", "answer": "4", "level": 2}]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_reads_every_format_with_prompt_column(tmp_path, suffix):
    import pandas as pd

    path = tmp_path / f"data{suffix}"
    frame = pd.DataFrame(ROWS)
    {".json": lambda: path.write_text(json.dumps(ROWS)), ".jsonl": lambda: frame.to_json(path, orient="records", lines=True),
     ".csv": lambda: frame.to_csv(path, index=False), ".parquet": lambda: frame.to_parquet(path)}[suffix]()
    examples = read_prompt_file(str(path), "question", "answer")
    assert [e.prompt for e in examples] == ["1 + 1 =", "2 + 2 ="]
    assert str(examples[1].columns["answer"]) == "4" and examples[1].columns["level"] == 2


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="data file not found"):
        read_prompt_file(str(tmp_path / "none.jsonl"), "prompt", None)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="(no rows|could not read)"):
        read_prompt_file(str(empty), "prompt", None)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(UserError, match=r"no column 'prompt' \(columns: text\); set data.prompt_column"):
        read_prompt_file(str(other), "prompt", None)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        read_prompt_file(str(latin), "prompt", None)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"\n')
    with pytest.raises(UserError, match="could not read data file"):
        read_prompt_file(str(broken), "prompt", None)
    bad_chat = tmp_path / "chat.jsonl"
    bad_chat.write_text(json.dumps({"prompt": ["just text"]}) + "\n")
    with pytest.raises(UserError, match="row 1: column 'prompt' must hold"):
        read_prompt_file(str(bad_chat), "prompt", None)
    with pytest.raises(UserError, match="no column 'solution'.*set data.answer_column"):
        read_prompt_file(str(other), "text", "solution")
    weird = tmp_path / "data.txt"
    weird.write_text("x")
    with pytest.raises(UserError, match="unsupported extension"):
        read_prompt_file(str(weird), "prompt", None)


def test_a_malformed_json_line_is_named_as_an_editor_counts(tmp_path):
    good = json.dumps({"prompt": "a"})
    # line 4 is bad and line 2 blank: pyarrow says "row 2" (from 0, blank lines skipped), an editor shows line 4
    jsonl = tmp_path / "mal4.jsonl"
    jsonl.write_text(f"{good}\n\n{good}\n{{\"prompt\": }}\n{good}\n")
    with pytest.raises(UserError, match=r"could not read data file .*mal4.jsonl: line 4: Expecting value \(column 12\)$"):
        read_prompt_file(str(jsonl), "prompt", None)
    not_object = tmp_path / "list.jsonl"
    not_object.write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(UserError, match=r"line 2: not a JSON object"):
        read_prompt_file(str(not_object), "prompt", None)
    array = tmp_path / "rows.json"
    array.write_text(f'[{good},\n {{"prompt" "b"}}]\n')
    with pytest.raises(UserError, match=r"rows.json: not valid JSON: Expecting ':' delimiter at line 2, column 12$"):
        read_prompt_file(str(array), "prompt", None)


def test_blank_lines_in_a_jsonl_with_answers_of_mixed_types(tmp_path):
    """Numbers and text in one column (3 and "1/2") take datasets' slower reader, which failed on any blank line,
    a trailing one included, with "Expected object or value": the rows are read as without the blank lines."""
    rows = [{"prompt": "a", "answer": 3}, {"prompt": "b", "answer": "1/2"}, {"prompt": "c", "answer": 4.5}]
    lines = [json.dumps(row) for row in rows]
    for name, text in [("middle", f"{lines[0]}\n\n{lines[1]}\n{lines[2]}\n"),
                       ("trailing", "\n".join(lines) + "\n\n"), ("crlf", "\r\n".join(lines) + "\r\n\r\n")]:
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        examples = read_prompt_file(str(path), "prompt", None)
        assert [(ex.prompt, ex.columns["answer"]) for ex in examples] == [("a", 3), ("b", "1/2"), ("c", 4.5)], name


def test_a_missing_data_file_names_the_absolute_path_looked_at(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=rf"data file not found: {tmp_path}/problems.jsonl \(a relative data path is read "
                                        "from the current directory, not from the config file's folder"):
        read_prompt_file("problems.jsonl", "prompt", None)
    cfg = load_config(None, ["data.task=null", "data.path=problems.jsonl"])
    with pytest.raises(UserError, match=rf"data file not found: {tmp_path}/problems.jsonl \("):
        check_data_and_rewards(cfg)


def _rows_file(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_without_an_answer_are_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys):
    rows = _rows_file(tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}, {"prompt": "c"}])
    args = tiny_overrides(tiny_model_dir, rows, str(tmp_path / "o"), rewards="[{fn: format}, {fn: math}]",
                          **{"data.eval_path": "null"})
    assert main(["train", *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlora: error:")]
    assert lines == [f"rlora: error: data file {rows}, row 2: column 'answer' is missing (null), but reward 'math' "
                     "compares completions with it: fill in the answer or remove the row"]
    assert not (tmp_path / "o").exists(), "refused before anything is written"
    # a row without the key, an empty answer, a renamed answer column, a held-out file: each named
    for bad, column, message in [({"prompt": "c"}, "answer", "row 2: column 'answer' is missing"),
                                 ({"prompt": "c", "answer": " "}, "answer", "row 2: column 'answer' is empty"),
                                 ({"prompt": "c", "solution": None}, "solution", "row 2: column 'solution' is missing")]:
        path = _rows_file(tmp_path, [{"prompt": "a", column: "1"}, bad], name="bad.jsonl")
        for setting in ("data.path", "data.eval_path"):
            cfg = load_config(None, tiny_overrides(tiny_model_dir, str(tmp_path / "ok.jsonl"), str(tmp_path / "o"), **{
                "data.answer_column": column, "rewards": "[{fn: math}]", setting: path}))
            _rows_file(tmp_path, [{"prompt": "a", column: "1"}], name="ok.jsonl")
            with pytest.raises(UserError, match=rf"data file {path}, {message}"):
                check_rows_answered(cfg, load_prompt_sets(cfg.data))
    no_column = _rows_file(tmp_path, [{"prompt": "a"}], name="plain.jsonl")
    for answer_column, message in [("answer", "it has no column 'answer'"), ("null", "data.answer_column is null")]:
        cfg = load_config(None, tiny_overrides(tiny_model_dir, no_column, str(tmp_path / "o"), **{
            "rewards": "[{fn: math}]", "data.answer_column": answer_column}))
        with pytest.raises(UserError, match=rf"reward 'math' compares completions with the answer column, but {message}"):
            check_rows_answered(cfg, load_prompt_sets(cfg.data))


def test_the_closeness_reward_also_needs_every_row_answered(tiny_model_dir, tmp_path):
    rows = _rows_file(tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}])
    cfg = load_config(None, tiny_overrides(tiny_model_dir, rows, str(tmp_path / "o"), rewards="[{fn: closeness}]"))
    with pytest.raises(UserError, match="row 2: column 'answer' is missing \\(null\\), but reward 'closeness'"):
        check_rows_answered(cfg, load_prompt_sets(cfg.data))


def test_the_closeness_reward_refuses_a_non_numeric_answer_before_the_model_loads(tiny_model_dir, tmp_path):
    good = _rows_file(tmp_path, [{"prompt": "a", "answer": "-3"}, {"prompt": "b", "answer": "1,234"}], name="good.jsonl")
    bad = _rows_file(tmp_path, [{"prompt": "a", "answer": "1/2"}, {"prompt": "b", "answer": "seven"}], name="bad.jsonl")
    for setting in ("data.path", "data.eval_path"):
        cfg = load_config(None, tiny_overrides(tiny_model_dir, good, str(tmp_path / "o"), **{
            "rewards": "[{fn: closeness}]", setting: bad}))
        with pytest.raises(UserError, match=rf"data file {bad}, row 2: answer 'seven' is not a number \(integer, decimal or a/b, at most 1000 characters\), but reward 'closeness'"):
            check_rows_answered(cfg, load_prompt_sets(cfg.data))
    cfg = load_config(None, tiny_overrides(tiny_model_dir, good, str(tmp_path / "o"), rewards="[{fn: closeness}]"))
    check_rows_answered(cfg, load_prompt_sets(cfg.data))  # every answer a number: no error


def test_the_closeness_reward_checks_a_tasks_answers_too(tiny_model_dir, tmp_path):
    def config(task):
        return load_config(None, tiny_overrides(tiny_model_dir, "null", str(tmp_path / "o"), **{
            "data.task": task, "data.task_args": "{}", "data.eval_path": "null", "data.train_size": 20, "data.eval_size": 4,
            "rewards": "[{fn: gym}, {fn: closeness, weight: 0.1}]"}))
    numeric = config("basic_arithmetic")
    check_rows_answered(numeric, load_prompt_sets(numeric.data))  # arithmetic answers are numbers: no error
    words = config("spell_backward")
    with pytest.raises(UserError, match=r"task 'spell_backward', (training|held-out) problem 1 \('.+'\): answer '\w+' is not a number"):
        check_rows_answered(words, load_prompt_sets(words.data))


def test_rows_without_an_answer_are_fine_for_rewards_that_do_not_compare_with_it(tiny_model_dir, tmp_path):
    rows = _rows_file(tmp_path, [{"prompt": "a", "answer": None}, {"prompt": "b"}])
    for rewards in ("[{fn: rewards_for_tests.count_a}]", "[{fn: format}]"):
        cfg = load_config(None, tiny_overrides(tiny_model_dir, rows, str(tmp_path / "o"), rewards=rewards))
        check_rows_answered(cfg, load_prompt_sets(cfg.data))  # no error: these rewards read no answer
        assert len(check_data_and_rewards(cfg)) == 1


def test_a_run_without_held_out_prompts_says_so(tiny_model_dir, prompts_file, tmp_path, capsys):
    def notice(**extra):
        cfg = load_config(None, tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **extra))
        return " ".join(check_inputs(cfg).notices)  # printed once the model path and context checks have passed

    assert "no held-out evaluation" not in notice()  # data.eval_path set: its first eval_size rows
    # data.path alone trains on every row: eval.before/after have nothing to evaluate, and eval_size counts nothing
    assert "set data.eval_path to a file of held-out prompts" in notice(**{"data.eval_path": "null"})
    assert "data.eval_size=0 holds out no prompts" in notice(**{"data.eval_size": 0})
    assert "no held-out evaluation" not in notice(**{"data.eval_path": "null", "eval.before": "false", "eval.after": "false"})
    sets = load_prompt_sets(DataConfig(path=prompts_file, eval_size=4))
    assert len(sets.train) == 8 and sets.eval == []  # every row still trains


def test_task_splits_are_disjoint_and_bad_task_is_caught():
    # two one-digit terms: only ~200 distinct problems, so independent draws overlap heavily
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    sets = load_prompt_sets(DataConfig(task="chain_sum", task_args=small, train_size=300, eval_size=50))
    held_out = [e.prompt for e in sets.eval]
    assert len(held_out) == len(set(held_out)) == 50
    assert not set(held_out) & {e.prompt for e in sets.train}
    assert 200 < len(sets.train) < 300  # the training draws of held-out problems were removed
    with pytest.raises(UserError, match="did you mean 'chain_sum'"):
        check_task("chain_sm", {})
    with pytest.raises(UserError, match="task_args do not fit task 'chain_sum'"):
        check_task("chain_sum", {"bogus": 1})


def test_render_prompt_uses_chat_template_and_system_prompt():
    tokenizer = build_tokenizer()
    ids = render_prompt(tokenizer, Example("1 + 1 =", {}), "Be brief.", use_chat_template=True)
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1 + 1 =<|im_end|>\n<|im_start|>assistant\n"
    plain = tokenizer.decode(render_prompt(tokenizer, Example("1 + 1 =", {}), None, use_chat_template=False))
    assert plain == "1 + 1 ="


def test_prompt_order_is_deterministic_and_covers_each_epoch():
    order = PromptOrder(num_examples=10, prompts_per_step=3, seed=4)
    first_epoch = [i for step in range(3) for i in order.indices(step)] + order.indices(3)[:1]
    assert sorted(first_epoch) == list(range(10))
    assert order.indices(5) == PromptOrder(10, 3, 4).indices(5)
    assert order.indices(0) != PromptOrder(10, 3, 5).indices(0)
    assert [PromptOrder(4, 3, 0, shuffle=False).indices(s) for s in range(2)] == [[0, 1, 2], [3, 0, 1]]


def test_padding_helpers_by_hand():
    import torch

    from rlora.tensors import left_padded, pad_right, right_padded

    ids, mask = right_padded([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    ids, mask = left_padded([[5, 6, 7], [8]], pad_id=9)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pad_right(torch.tensor([[1.5], [2.0]]), 3, -1.0).tolist() == [[1.5, -1.0, -1.0], [2.0, -1.0, -1.0]]
