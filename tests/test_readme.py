"""The front page's config and reward run as written (on the tiny model, with the size keys made small)."""

import json
import re
from pathlib import Path

from rlora.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(language: str, starts_with: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)
    [block] = [b for b in blocks if b.startswith(starts_with)]
    return block


def test_the_front_page_config_and_reward_run(tiny_model_dir, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my.yaml").write_text(_block("yaml", "# my.yaml"))
    (folder / "my_reward.py").write_text(_block("python", "# my_reward.py"))
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    (folder / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(folder)  # data.path is relative to where rlora runs; the reward file to the config
    small = [f"model.path={tiny_model_dir}", "rollout.num_generations=4", "rollout.max_new_tokens=8", "train.steps=1",
             "train.prompts_per_step=2", "train.micro_batch_size=4", "lora.rank=4", "eval.before=false",
             "eval.after=false", "log.plot=false", "data.eval_size=2", f"train.output_dir={tmp_path / 'run'}"]
    assert main(["train", "my.yaml", *small]) == 0, capsys.readouterr().err
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/math", "reward/brevity"} <= set(row) and 0 < row["reward/brevity"] <= 1
