"""One loss contract: advantages per token [B, T]; a loss returns its per-token loss and per-token metric terms,
which the update reduces with one masked reducer, so a new loss's metric reaches metrics.jsonl without a change
to train/update.py. Capability flags are data (rlora/presets.py TRAITS), read by the registry and the refusals."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from test_policy_model import make_policy, sample, vary_lengths

from conftest import tiny_overrides
from rlora.algos import registry
from rlora.algos.advantages import per_token
from rlora.algos.losses import LossInputs, grpo_token_loss, gspo_token_loss
from rlora.cli import main
from rlora.config import AlgoConfig
from rlora.presets import PRESETS, TRAITS, Traits
from rlora.train.update import ScoredRollout, accumulate_policy_gradient

SRC = Path(__file__).resolve().parents[1] / "src" / "rlora"


def toy_loss(inp: LossInputs, **kwargs):
    """GRPO's loss, reporting three more terms: each token's position, its advantage, and one it never measures."""
    out = grpo_token_loss(inp, **kwargs)
    B, T = inp.mask_BT.shape
    position_BT = torch.arange(T, dtype=torch.float32).expand(B, T)
    return dataclasses.replace(out, metrics_BT=out.metrics_BT | {
        "position": position_BT, "advantage": inp.advantages_BT.detach(), "unmeasured": None})


TOY = dataclasses.replace(registry.get_algorithm("grpo"), name="toy", token_loss=toy_loss)


def test_a_new_loss_metric_is_its_mean_over_the_trained_tokens(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=3), tok.pad_id)  # lengths 6, 2, 5, 1, 6, 3, 4, 6
    mask = rollout.completion_mask_BTc
    # advantage 0 and no KL term: rows 2, 4, 5, 6 are not trained; rows 0, 1, 3, 7 are (6 + 2 + 1 + 6 = 15 tokens)
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0, 0.0, 0.0, 0.0, -1.0])
    scored = ScoredRollout(rollout, per_token(advantages, mask), mask)
    metrics = accumulate_policy_gradient(model, TOY, AlgoConfig(), scored, micro_batch_size=3, constant_len=6)
    # positions: (0+..+5) + (0+1) + 0 + (0+..+5) = 31; advantages: 6 x 1 - 2 x 0.5 + 1 x 2 - 6 x 1 = 1
    assert metrics["position"] == pytest.approx(31 / 15, abs=1e-12)
    assert metrics["advantage"] == pytest.approx(1 / 15, abs=1e-12)
    assert "unmeasured" in metrics and metrics["unmeasured"] is None  # logged as null
    assert metrics["trained_frac"] == 0.5 and metrics["kl"] is None  # the others as before
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0) and metrics["entropy"] > 0


def test_a_new_loss_metric_reaches_metrics_jsonl(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setitem(registry.ALGORITHMS, "grpo", dataclasses.replace(TOY, name="grpo"))
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "train.steps": 1, "eval.before": "false", "eval.after": "false"})]) == 0
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["completion_len_mean"] == row["completion_len_max"] == 8  # every completion ran to the limit
    assert row["position"] == pytest.approx(3.5)  # (0 + ... + 7) / 8 on every trained row
    assert "unmeasured" in row and row["unmeasured"] is None


def test_a_loss_may_not_report_under_the_updates_own_names(tiny_model_dir):
    def clashing(inp, **kwargs):
        out = grpo_token_loss(inp, **kwargs)
        return dataclasses.replace(out, metrics_BT=out.metrics_BT | {"entropy": out.loss_BT.detach()})

    tokenizer, tok, model = make_policy(tiny_model_dir)
    rollout = sample(model, tokenizer, tok)
    mask = rollout.completion_mask_BTc
    scored = ScoredRollout(rollout, per_token(torch.linspace(-1, 1, 8), mask), mask)
    with pytest.raises(ValueError, match="entropy"):
        accumulate_policy_gradient(model, dataclasses.replace(TOY, token_loss=clashing), AlgoConfig(), scored, 4, 6)

    def counted(inp, **kwargs):  # "rows" is a count the ranks' metrics add up: a term is the batch's already
        out = grpo_token_loss(inp, **kwargs)
        return dataclasses.replace(out, metrics_BT=out.metrics_BT | {"rows": out.loss_BT.detach()})

    with pytest.raises(ValueError, match=r"join as counts, times or weighted means \['rows'\]"):
        accumulate_policy_gradient(model, dataclasses.replace(TOY, token_loss=counted), AlgoConfig(), scored, 4, 6)


def test_scored_advantages_are_one_per_token(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    rollout = sample(model, tokenizer, tok)
    with pytest.raises(ValueError, match="one per token"):
        ScoredRollout(rollout, torch.linspace(-1, 1, 8), rollout.completion_mask_BTc)


def test_loss_inputs_broadcast_one_advantage_per_completion():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    inp = LossInputs(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0.5, -2.0]), mask)
    assert inp.advantages_BT.tolist() == [[0.5, 0.5, 0.5], [-2.0, -2.0, -2.0]]
    with pytest.raises(RuntimeError):  # per token, but not of the mask's width
        LossInputs(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), mask)


def test_gspo_takes_a_completions_advantage_from_its_counted_tokens():
    logp = torch.tensor([[0.2, 0.4, 0.0], [0.1, -0.3, 0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    per_row = gspo_token_loss(LossInputs(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask), 0.2, 0.2, 0.0)
    # the same advantages per token, 0 on padding (as per-token advantages are): the same loss
    padded = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    per_tok = gspo_token_loss(LossInputs(logp, torch.zeros(2, 3), padded, mask), 0.2, 0.2, 0.0)
    assert torch.equal(per_row.loss_BT, per_tok.loss_BT)
    varying = torch.tensor([[1.0, 0.5, 0.0], [-1.0, -1.0, -1.0]])
    with pytest.raises(ValueError, match="one advantage per completion"):
        gspo_token_loss(LossInputs(logp, torch.zeros(2, 3), varying, mask), 0.2, 0.2, 0.0)


def test_the_registry_builds_its_flags_from_the_traits():
    assert list(TRAITS) == list(PRESETS) == list(registry.ALGORITHMS)
    for name, traits in TRAITS.items():
        algo = registry.get_algorithm(name)
        assert {f.name: getattr(algo, f.name) for f in dataclasses.fields(Traits)} == dataclasses.asdict(traits), name


def test_no_algorithm_name_is_compared_outside_the_presets_and_the_registry():
    """What code needs to know about an algorithm is a trait (rlora/presets.py), not a check of its name."""
    name_check = re.compile(r"algo\.name\s*[!=]=|algo\.name\.startswith|\.name\s*[!=]=\s*\"(ppo|gspo|reinforce_pp)")
    allowed = {SRC / "presets.py", SRC / "algos" / "registry.py"}
    found = [f"{path.relative_to(SRC)}:{n}" for path in sorted(SRC.rglob("*.py")) if path not in allowed
             for n, line in enumerate(path.read_text().splitlines(), 1) if name_check.search(line)]
    assert not found, found


def test_a_replay_checkpoint_from_before_holds_one_advantage_per_completion(tiny_model_dir):
    """replay.pt written before advantages were per token: its groups load with the advantage on every token."""
    from rlora.config import ReplayConfig
    from rlora.train.replay import ReplayBuffer
    from rlora.train.resume import _load_replay

    tokenizer, tok, model = make_policy(tiny_model_dir)
    rollout = sample(model, tokenizer, tok, n_prompts=1)
    rollout.sampling_logp_BTc = torch.zeros(rollout.completion_ids_BTc.shape)
    mask = rollout.completion_mask_BTc
    saved = [{"rollout": vars(rollout), "advantages_G": torch.tensor([0.5, -0.5, 1.0, -1.0]), "loss_mask_GT": mask,
              "step": 1, "uses": 0}]
    buffer = ReplayBuffer(ReplayConfig(), seed=0)
    _load_replay(buffer, saved, world_size=1, policy=0)
    assert torch.equal(buffer.groups[0].advantages_GT, per_token(torch.tensor([0.5, -0.5, 1.0, -1.0]), mask))


def test_replay_checkpoints_of_every_format_give_each_policy_its_entry():
    """replay.pt as written since several policies replay ({"policies": [each policy's {"ranks": ...}]}), as written
    before by a run of one policy ({"ranks": [...]}) and before data-parallel replay (one rank's list)."""
    from rlora.train.resume import _replay_policies, _replay_ranks

    group = {"step": 1}
    assert [_replay_ranks(e) for e in _replay_policies({"policies": [{"ranks": [[group]]}, {"ranks": [[]]}]})] == \
        [[[group]], [[]]]
    assert [_replay_ranks(e) for e in _replay_policies({"ranks": [[group], []]})] == [[[group], []]]
    assert [_replay_ranks(e) for e in _replay_policies([group])] == [[[group]]]
