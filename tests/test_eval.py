"""`rlora eval`: unbiased pass@k, the base and several adapters side by side on one base, run folders,
and the bad-input contract."""

import json
from math import comb

import pytest
from test_policy_model import make_policy, perturb_adapter

from conftest import tiny_overrides
from rlora.cli import main
from rlora.models.loading import save_adapter
from rlora.train.evaluate import pass_at_k


def naive_pass_at_k(n, c, k):
    return 1 - comb(n - c, k) / comb(n, k)


def test_pass_at_k_hand_computed_and_against_combinations():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(naive_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(200, 7, 100) == pytest.approx(naive_pass_at_k(200, 7, 100), rel=1e-9)  # big n: no overflow
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


@pytest.fixture(scope="module")
def two_adapters(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    paths = []
    for seed, name in ((1, "a"), (2, "b")):
        _, _, model = make_policy(tiny_model_dir)
        perturb_adapter(model, scale=0.5, seed=seed)
        save_adapter(model, folder / name)
        paths.append(str(folder / name))
    return paths


def eval_args(tiny_model_dir, prompts_file, out, *extra):
    """The tiny-model overrides of the train tests, with a binary reward (some prompts solved, some not)."""
    overrides = [o for o in tiny_overrides(tiny_model_dir, prompts_file, str(out)) if not o.startswith("rewards=")]
    return ["eval", *overrides, "rewards=[{fn: rewards_for_tests.has_a}]", "data.eval_size=6",
            "eval.num_samples=4", "eval.temperature=1.0", "eval.pass_k=[1,2,4]", "-o", str(out), *extra]


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_base_and_adapters_side_by_side(tiny_model_dir, prompts_file, two_adapters, tmp_path, capsys):
    a, b = two_adapters
    out = tmp_path / "ev"
    assert main(eval_args(tiny_model_dir, prompts_file, out, "-a", f"a={a}", "-a", f"b={b}")) == 0
    captured = capsys.readouterr()
    assert "rlora eval" in captured.out and "pass@4" in captured.out  # the side-by-side table, on stdout
    report = json.loads((out / "eval.json").read_text())
    assert list(report["results"]) == ["base", "a", "b"] and report["prompts"] == 6
    completions = {}
    for name, metrics in report["results"].items():
        rows = rows_of(out / f"samples_{name}.jsonl")
        assert len(rows) == 6 * 4 and metrics["n"] == 6 and metrics["samples_per_prompt"] == 4
        correct = [sum(r["correct"] for r in rows if r["prompt_index"] == i) for i in range(6)]
        assert all(r["correct"] == ("a" in r["completion"]) for r in rows)  # has_a, scored per completion
        assert metrics["accuracy"] == pytest.approx(sum(correct) / 24)
        assert metrics["pass@1"] == pytest.approx(metrics["accuracy"])
        for k in (2, 4):
            assert metrics[f"pass@{k}"] == pytest.approx(sum(naive_pass_at_k(4, c, k) for c in correct) / 6)
        completions[name] = [r["completion"] for r in rows]
    # each adapter is really switched on (a sampler that ignored it would repeat the base's completions)
    assert completions["a"] != completions["base"] and completions["b"] != completions["a"]
    # the base with adapters loaded but off, and one adapter among others, equal evaluations on their own
    alone = tmp_path / "alone"
    assert main(eval_args(tiny_model_dir, prompts_file, alone)) == 0
    assert [r["completion"] for r in rows_of(alone / "samples_base.jsonl")] == completions["base"]
    only_b = tmp_path / "only_b"
    assert main(eval_args(tiny_model_dir, prompts_file, only_b, "--no-base", "-a", b)) == 0
    assert [r["completion"] for r in rows_of(only_b / "samples_b.jsonl")] == completions["b"]


def test_run_folder_evaluates_its_adapter_greedily(tiny_model_dir, prompts_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(run), **{"eval.before": "false"})]) == 0
    out = tmp_path / "ev"
    assert main(["eval", str(run), "-o", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert list(report["results"]) == ["base", "run"]
    assert report["results"]["run"]["adapter"] == str(run / "adapter")
    # greedy, one sample per prompt: the same numbers the training run wrote for its adapter
    after = json.loads((run / "eval.json").read_text())["after"]
    for key in ("n", "accuracy", "reward_mean"):
        assert report["results"]["run"][key] == pytest.approx(after[key]), key
    assert [r["completion"] for r in rows_of(out / "samples_run.jsonl")] == \
        [r["completion"] for r in rows_of(run / "eval_after.jsonl")]


@pytest.mark.parametrize("extra, message", [
    (["-a", "/no/such/adapter"], "'/no/such/adapter' not found"),
    (["eval.pass_k=[8]"], "eval.pass_k"),
    (["eval.temperature=0"], "eval.num_samples=4 with greedy decoding"),
    (["data.eval_path=null"], "no held-out prompts"),
    (["--no-base"], "--no-base needs at least one --adapter"),
    (["eval.max_new_tokens=4000"], "eval.max_new_tokens=4000 does not fit the model's 2048 positions"),
    (["-a", "base=/x"], "not usable"),
])
def test_bad_input_is_one_line(extra, message, tiny_model_dir, prompts_file, tmp_path, capsys):
    assert main(eval_args(tiny_model_dir, prompts_file, tmp_path / "ev", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_adapter_names_and_paths(two_adapters, tmp_path):
    from rlora.evaluation import parse_adapters

    a, _ = two_adapters
    odd = tmp_path / "lr=1e-4" / "qwen2.5-math" / "adapter"  # '=' in the path, '.' in the run folder's name
    odd.parent.mkdir(parents=True)
    odd.symlink_to(a)
    named, unnamed = parse_adapters([f"x={odd}", str(odd)])
    assert (named.name, named.adapter) == ("x", str(odd))
    assert (unnamed.name, unnamed.adapter) == ("qwen2_5-math", str(odd))


def test_output_folder_rules(tiny_model_dir, prompts_file, two_adapters, tmp_path, capsys):
    """Never into a training run; over an earlier evaluation only with --overwrite, replacing its files."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "adapter").mkdir()
    assert main(eval_args(tiny_model_dir, prompts_file, run, "--overwrite")) == 2
    assert "holds a training run" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["adapter", "metrics.jsonl"]
    out = tmp_path / "ev"
    assert main(eval_args(tiny_model_dir, prompts_file, out, "-a", f"a={two_adapters[0]}")) == 0
    assert main(eval_args(tiny_model_dir, prompts_file, out)) == 2
    assert "already holds files" in capsys.readouterr().err
    assert main(eval_args(tiny_model_dir, prompts_file, out, "--overwrite")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "eval.json", "samples_base.jsonl"]


def test_adapter_for_another_base_is_one_line(prompts_file, tmp_path, capsys):
    from rlora.models.tiny import build_random_model

    small = build_random_model(tmp_path / "small", hidden=32)
    other = build_random_model(tmp_path / "other", hidden=48)
    _, _, model = make_policy(str(other))
    save_adapter(model, tmp_path / "foreign")
    assert main(eval_args(str(small), prompts_file, tmp_path / "ev", "-a", str(tmp_path / "foreign"))) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit model" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("model_cls, message", [
    ("SFTConfig", "is a run of rlora sft: evaluate its adapter on an RL task, e.g. `rlora eval CONFIG.yaml --adapter "
                  "sft="),
    ("RMConfig", "is a run of rlora rm: its reward model scores completions rather than writing them")])
def test_a_run_folder_of_sft_or_rm_says_what_it_is(model_cls, message, tmp_path, capsys):
    _eval_other_commands_run(model_cls, message, tmp_path, capsys, whole_model=False)


def test_a_whole_model_sft_run_is_evaluated_as_a_base(tmp_path, capsys):
    _eval_other_commands_run("SFTConfig", "trained the whole model: evaluate it as a base, e.g. `rlora eval CONFIG.yaml "
                             "model.path=", tmp_path, capsys, whole_model=True)


def _eval_other_commands_run(model_cls, message, tmp_path, capsys, whole_model):
    """`rlora eval runs/sft-x` said "unknown config key 'data.completion_column' (did you mean 'data.prompt_column'?)"."""
    import rlora.config as config
    from rlora.config import to_yaml

    run = tmp_path / "run"
    run.mkdir()
    if whole_model:  # train.full_finetune writes RUN/model, no adapter
        (run / "model").mkdir()
    cfg = config.load_config(None, ["data.path=rows.jsonl"], model_cls=getattr(config, model_cls))
    (run / "config.yaml").write_text(to_yaml(cfg))
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
