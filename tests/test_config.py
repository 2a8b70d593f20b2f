import pytest

from rlora.config import RLConfig, load_config, parse_overrides, to_yaml
from rlora.errors import UserError


def test_demo_config_loads_with_stable_override_keys():
    overrides = [
        "model.path=/some/model", "lora.rank=8", "lora.alpha=16", "lora.target_modules=[q_proj,v_proj]",
        "rollout.num_generations=4", "rollout.max_new_tokens=16", "rollout.temperature=0.7", "algo.beta=0.04",
        "algo.loss_agg=seq_mean", "train.steps=3", "train.prompts_per_step=2", "train.micro_batch_size=8", "train.lr=5e-5", "train.seed=7",
        "train.output_dir=/tmp/x",
    ]
    cfg = load_config(None, overrides)
    assert cfg.lora.rank == 8 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.rollout.temperature == 0.7 and cfg.algo.beta == 0.04 and cfg.algo.loss_agg == "seq_mean"
    assert cfg.train.lr == 5e-5 and cfg.train.seed == 7 and cfg.train.output_dir == "/tmp/x"
    assert cfg.data.task == "chain_sum" and cfg.rewards[0].fn == "gym"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=3"])
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("override, message", [
    (["train.stpes=3"], "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
    (["lora.rnak=3"], "did you mean 'lora.rank'"),
    (["trian.steps=3"], "did you mean 'train'"),
    (["train.steps=abc"], "invalid value for train.steps"),
    (["train.lr=-1"], "invalid value for train.lr"),
    (["algo.loss_agg=mean"], "invalid value for algo.loss_agg"),
    (["train.micro_batch_size=5"], "not divisible by train.micro_batch_size = 5"),
    (["data.path=x.jsonl"], "set exactly one of data.task"),
    (["data.eval_seed=0"], "held-out split would repeat"),
    (["rewards=[]"], "no reward functions: add e.g. `rewards: [{fn: gym}]`"),
    (["rewards=[]", "data.task=null", "data.path=x.jsonl"], "no reward functions: add e.g. `rewards: [{fn: math}]`"),
    (["algo.name=grpp"], "did you mean 'grpo'"),
    (["rollout.num_generations=0"], "invalid value for rollout.num_generations"),
    (["rollout.num_generations=1", "train.micro_batch_size=2"], "rollout.num_generations=1 gives grpo no group"),
    (["train.steps"], "not of the form section.key=value"),
])
def test_bad_config_gives_one_line(override, message):
    with pytest.raises(UserError) as err:
        load_config(None, override)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n  lr: [1e-4\n")
    with pytest.raises(UserError, match=r"YAML syntax error in .*bad.yaml at line"):
        load_config(str(path))


def test_missing_and_non_mapping_config(tmp_path):
    with pytest.raises(UserError, match="config file not found") as missing:
        load_config(str(tmp_path / "nope.yaml"))
    assert "KEY=VALUE" not in str(missing.value)
    with pytest.raises(UserError, match=r"^config file not found: train.steps \(an override needs KEY=VALUE, "):
        load_config("train.steps")  # `rlora train train.steps`: the '=' forgotten
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="must be a mapping"):
        load_config(str(path))
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  steps: 3 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        load_config(str(path))


def test_parse_overrides_types_and_nesting():
    tree = parse_overrides(["a.b=1", "a.c=true", "d=[1, 2]", "e=null", "f=text", "g.h.i=0.5"])
    assert tree == {"a": {"b": 1, "c": True}, "d": [1, 2], "e": None, "f": "text", "g": {"h": {"i": 0.5}}}


def test_file_config_merges_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {path: p.jsonl}\nrewards: [{fn: format}]\ntrain: {steps: 9}\n")
    cfg = load_config(str(path), ["train.steps=4"])
    assert isinstance(cfg, RLConfig)
    assert cfg.train.steps == 4 and cfg.data.path == "p.jsonl" and cfg.model.path == "smollm2-135m-instruct"


def test_example_configs_validate():
    from pathlib import Path

    from rlora.config import RMConfig, SFTConfig

    files = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert files
    roots = {"train": RLConfig, "sft": SFTConfig, "rm": RMConfig}
    for path in files:
        first = path.read_text().splitlines()[0]
        command = first.split()[2] if first.startswith("# rlora ") else None
        assert command in roots, f"{path.name} must start with the command that runs it (# rlora train/sft/rm ...)"
        assert first.split()[3] == f"configs/{path.name}", f"{path.name}: the first line names another file"
        assert isinstance(load_config(str(path), model_cls=roots[command]), roots[command])


def test_misspelt_key_in_a_list_of_sections_names_the_valid_keys():
    """policies is `list[PolicySpec] | None`: the suggestion looks inside the Optional and the list."""
    from rlora.config.schema import PolicySpec

    with pytest.raises(UserError) as err:
        load_config(None, ["policies=[{name: a, lr: 1e-4}, {name: b, lrr: 3e-4}]"])
    assert str(err.value) == "unknown config key 'policies.1.lrr' (did you mean 'policies.1.lr'?)"
    with pytest.raises(UserError) as err:
        load_config(None, ["policies=[{name: a}, {name: b, zzzz: 1}]"])
    assert "lr" in PolicySpec.model_fields
    assert str(err.value) == f"unknown config key 'policies.1.zzzz' (valid: {', '.join(PolicySpec.model_fields)})"


def test_a_key_given_twice_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` dropped train.steps without a word."""
    path = tmp_path / "twice.yaml"
    path.write_text("data: {task: chain_sum}\ntrain:\n  steps: 3\nrewards: [{fn: gym}]\ntrain:\n  lr: 1.0e-4\n")
    with pytest.raises(UserError) as err:
        load_config(str(path))
    assert str(err.value) == (f"key 'train' is given twice in {path} (lines 2 and 5): YAML would silently keep only "
                              "the last one: give it once")
    path.write_text("train:\n  steps: 3\n  lr: 1.0e-4\n  steps: 4\n")
    with pytest.raises(UserError, match=r"key 'steps' is given twice in .* \(lines 2 and 4\)"):
        load_config(str(path))
    # a key brought in by a merge (<<: *anchor) may be overridden: that is what the merge is for
    from rlora.config.loading import _read_yaml

    path.write_text("a: &c {steps: 3, lr: 1.0e-4}\nb:\n  <<: *c\n  steps: 5\n")
    assert _read_yaml(str(path)) == {"a": {"steps": 3, "lr": 1e-4}, "b": {"steps": 5, "lr": 1e-4}}


def test_a_whole_section_check_does_not_repeat_the_section():
    """A section's own check (eval.pass_k against eval.num_samples) names its keys; the section's dict is left out.
    A single value's error still shows the value it got."""
    with pytest.raises(UserError) as err:
        load_config(None, ["eval.pass_k=[1, 4]"])
    assert str(err.value) == ("invalid value for eval: eval.pass_k=[1, 4]: each k must be between 1 and "
                              "eval.num_samples=1")
    with pytest.raises(UserError) as err:
        load_config(None, ["eval=5"])
    assert str(err.value).endswith("(got 5)")
    with pytest.raises(UserError) as err:
        load_config(None, ["policies=[{name: a}, {name: b, seed: x}]"])
    assert str(err.value).startswith("invalid value for policies.1.seed: ") and str(err.value).endswith("(got 'x')")


def test_both_of_two_exclusive_keys_say_how_to_unset_one():
    """The demo sets data.task and configs/sft_math.yaml sets train.epochs: the message says how to unset it, and
    doing so loads."""
    from pathlib import Path

    from rlora.config import SFTConfig

    sft_math = str(Path(__file__).resolve().parents[1] / "configs" / "sft_math.yaml")
    with pytest.raises(UserError) as err:
        load_config(None, ["data.path=rows.jsonl"])
    assert str(err.value) == ("set exactly one of data.task (a reasoning-gym task) or data.path (a local file), "
                              "not both (data.task=null unsets the task chain_sum, e.g. the demo's)")
    assert load_config(None, ["data.path=rows.jsonl", "data.task=null"]).data.path == "rows.jsonl"
    with pytest.raises(UserError) as err:
        load_config(None, ["data.task=null"])
    assert str(err.value) == "set exactly one of data.task (a reasoning-gym task) or data.path (a local file)"
    with pytest.raises(UserError) as err:
        load_config(sft_math, ["train.steps=2"], model_cls=SFTConfig)
    assert str(err.value) == ("set train.steps or train.epochs, not both (train.epochs=null or train.steps=null "
                              "unsets one)")
    assert load_config(sft_math, ["train.steps=2", "train.epochs=null"], model_cls=SFTConfig).train.steps == 2


def test_an_item_of_a_list_is_set_by_its_index():
    """`rewards.1.args.path=...` was 'Input should be a valid list': list items are addressed from 0, after a whole
    list given earlier on the same command line."""
    cfg = load_config(None, ["rewards=[{fn: gym}, {fn: format, args: {a: 1}}]", "rewards.1.weight=0.5",
                             "rewards.0.fn=math"])
    assert [(r.fn, r.weight, r.args) for r in cfg.rewards] == [("math", 1.0, {}), ("format", 0.5, {"a": 1})]
    for bad in ("rewards.2.weight=1", "rewards.first.weight=1"):
        with pytest.raises(UserError) as err:
            load_config(None, ["rewards=[{fn: gym}, {fn: format}]", bad])
        key = bad.split("=")[0].rsplit(".", 1)[0]
        assert str(err.value) == (f"{key}: rewards is a list of 2 item(s): give an index 0..1 (e.g. rewards.0.KEY=VALUE) "
                                  "or set the whole list (rewards=[...])")


def test_several_keys_of_one_args_dict_on_the_command_line_add_up():
    """The first key under an args dict replaces the file's dict (as it always did); the later ones add to it."""
    cfg = load_config(None, ["data.task_args.min_terms=2", "data.task_args.max_terms=3"])
    assert cfg.data.task_args == {"min_terms": 2, "max_terms": 3}
    cfg = load_config(None, ["env={fn: calculator}", "env.args.call_start=<a>", "env.args.call_end=</a>"])
    assert cfg.env.args == {"call_start": "<a>", "call_end": "</a>"}
