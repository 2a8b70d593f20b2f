"""Every run has K >= 1 policies (train/policies.py): a plain run is one policy, `default`, whose files and
metrics are the run's own (OUTPUT/adapter, metrics.jsonl with plain names); several policies each have their
folder OUTPUT/policies/NAME and their metrics under NAME/key."""

from pathlib import Path

from conftest import tiny_overrides
from rlora.config import load_config
from rlora.train.outputs import RunDir
from rlora.train.policies import Policy, per_run, split_metrics
from rlora.train.session import prepare


def _policy(name: str, index: int, own_folder: bool, path: str = "out") -> Policy:
    return Policy(name, index, seed=0, beta=0.0, params=[], optimizer=None, scheduler=None,
                  run_dir=RunDir(path, overwrite=True, writer=False), own_folder=own_folder)


def test_one_policy_owns_the_runs_names_and_folders():
    lone = _policy("default", 0, own_folder=False)
    step = {"step": 3, "step_s": 1.5, "policies": {"default": {"loss": 0.25, "reward_mean": 0.5}}}
    flat, own = split_metrics(step, [lone])
    assert flat == {"step": 3, "step_s": 1.5, "loss": 0.25, "reward_mean": 0.5} and own == {}
    assert lone.adapter_in(Path("ck")) == Path("ck/adapter")
    assert per_run([lone], {"default": {"accuracy": 1.0}}) == {"accuracy": 1.0}


def test_several_policies_have_their_names_and_folders():
    a, b = _policy("a", 0, True, "out/policies/a"), _policy("b", 1, True, "out/policies/b")
    step = {"step": 1, "policies": {"a": {"loss": 1.0}, "b": {"loss": 2.0}}}
    flat, own = split_metrics(step, [a, b])
    assert flat == {"step": 1, "a/loss": 1.0, "b/loss": 2.0}
    assert own == {"a": {"step": 1, "loss": 1.0}, "b": {"step": 1, "loss": 2.0}}
    assert b.adapter_in(Path("ck")) == Path("ck/policies/b/adapter")
    assert per_run([a, b], {"a": {"accuracy": 0.0}, "b": {"accuracy": 1.0}}) == {"a": {"accuracy": 0.0},
                                                                                 "b": {"accuracy": 1.0}}


def test_a_plain_run_is_one_policy_with_the_runs_optimizer(tiny_model_dir, prompts_file, tmp_path):
    """prepare builds the plain run's policy: named default, the run's folder, the algorithm's beta, an optimizer
    over exactly the adapter's trainable parameters."""
    s = prepare(load_config(None, tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"),
                                                 **{"algo.beta": 0.03})))
    [policy] = s.policies
    assert (policy.name, policy.index, policy.own_folder, policy.beta) == ("default", 0, False, 0.03)
    assert policy.run_dir is s.run_dir and policy.seed == s.cfg.train.seed
    in_optimizer = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in in_optimizer] == [id(p) for p in s.adapter.parameters_per_policy()[0]] != []
