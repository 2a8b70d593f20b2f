"""The progress output where stderr is not a terminal (a log file, CI, `| tee`): whole plain lines, never a bar
drawn once at the end and cut to the console's width."""

from rlora.logging import console as console_module
from rlora.logging.console import progress_bar


def test_piped_progress_prints_whole_lines(capsys, monkeypatch):
    assert not console_module.console.is_terminal  # pytest captures stderr
    long_text = "reward 0.500  kl -  clip 0.00  len 37.9  " + "x" * 120 + "  9.9s/step"
    with progress_bar("train", 3) as update:
        update(0, "")  # the start: no metrics yet, no line
        update(1, long_text)
        update(2, long_text)
    with progress_bar("eval (before)", 100) as update:
        update(32)  # a bare count within 10 s of the start: no line
        update(100)  # done: one line
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"train 1/3  {long_text}", f"train 2/3  {long_text}", "eval (before) 100/100"]


def test_piped_progress_counts_at_most_every_ten_seconds(capsys, monkeypatch):
    clock = iter([0.0, 5.0, 11.0, 12.0])  # the bar's start, then three updates
    monkeypatch.setattr(console_module, "_now", lambda: next(clock))
    with progress_bar("eval a", 100) as update:
        update(25)
        update(50)
        update(75)
    assert capsys.readouterr().err.splitlines() == ["eval a 50/100"]


def test_notices_stay_one_line_in_a_log(capsys):
    from rlora.logging.console import info

    notice = "rollout.sampler_dtype=auto -> float16_weights (x86 CPU without native bf16: " + "y" * 100
    info(notice)
    assert capsys.readouterr().err == notice + "\n"


def test_first_line_is_the_first_worded_line_without_terminal_codes():
    from rlora.errors import first_line

    nltk_like = LookupError("\n" + "*" * 70 + "\n  Resource \x1b[93mwordnet\x1b[0m not found.\x1b[K\n  Please use the downloader")
    assert first_line(nltk_like) == "Resource wordnet not found."
    assert first_line(ValueError("")) == "ValueError" and first_line(ValueError("a\nb")) == "a"
    assert first_line(ValueError("x" * 500), limit=10) == "x" * 10
