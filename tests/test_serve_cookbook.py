"""tinker-cookbook's recipes, unchanged, against `rlora serve` on the real embedded SmolLM2-135M-Instruct (slow).

The server is the `rlora serve` command in its own process; each recipe runs as `python -m tinker_cookbook...` with
command-line settings only (no code of the cookbook is changed): the model is the server's model folder (the
cookbook loads the tokenizer from it), the renderer `qwen3_instruct` (ChatML, as SmolLM2's template writes it).

- `recipes/math_rl/train.py env=arithmetic` (problems made locally) with `loss_fn=importance_sampling` (the
  recipe's default `stable_reinforce` is not served: docs/serve.md): the reward rises.
- `recipes/chat_sl/train.py` on the cookbook's own `example_data/conversations.jsonl`: the training NLL falls.
- `recipes/decisions` (its functions, in this process): a choice's probability read through `target_prompt_logprobs`,
  and learned with `decision_choice_datums`.
- `recipes/multiplayer_rl` `guess_number` and `text_arena` (TicTacToe): multi-turn episodes, one step each.
The numbers of longer runs of both are in docs/serve.md."""

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow
cookbook = pytest.importorskip("tinker_cookbook", reason="the cookbook extra: bash scripts/test.sh --slow installs it")

KEY = "tml-rlora-cookbook"
RENDERER = "qwen3_instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, model folder) of `rlora serve` on the embedded model, in its own process."""
    from rlora.models.embedded import resolve_alias

    folder = resolve_alias("smollm2-135m-instruct")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    state = tmp_path_factory.mktemp("cookbook-state")
    log = open(state / "server.log", "w")
    process = subprocess.Popen([str(Path(sys.executable).parent / "rlora"), "serve", "--model", folder, "--port", str(port),
                                "--state-dir", str(state / "serve")], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, (state / "server.log").read_text()
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "rlora serve did not start"
            time.sleep(0.5)
        yield url, folder
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def recipe(module: str, args: list[str], url: str, log_path: Path) -> list[dict]:
    """Runs a cookbook recipe against the server -> its metrics.jsonl rows. The URL goes in TINKER_BASE_URL, which the
    SDK reads where a recipe's command line has no base_url (the multiplayer recipes), and as base_url where it has."""
    env = dict(os.environ, TINKER_API_KEY=KEY, TINKER_TELEMETRY="0", TINKER_BASE_URL=url)
    takes_url = module.endswith(("math_rl.train", "chat_sl.train"))
    done = subprocess.run([sys.executable, "-m", module, *args, *([f"base_url={url}"] if takes_url else []),
                           f"log_path={log_path}", "behavior_if_log_dir_exists=delete"], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_math_rl_arithmetic_reward_rises(server, tmp_path):
    url, folder = server
    rows = recipe("tinker_cookbook.recipes.math_rl.train",
                  [f"model_name={folder}", f"renderer_name={RENDERER}", "env=arithmetic", "loss_fn=importance_sampling",
                   "groups_per_batch=8", "group_size=8", "lora_rank=16", "learning_rate=4e-4", "max_steps=8",
                   "eval_every=0", "save_every=0"], url, tmp_path / "math_rl")
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == 8
    reward = [r["env/all/reward/total"] for r in steps]
    answered = [r["env/all/format"] for r in steps]  # the answer ended (stop token) within max_tokens
    # the sampler's log-probs are the trainer's: the cookbook measures their KL on every batch it trains on
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in steps)
    # SmolLM2-135M rarely adds two 2-digit numbers right (greedy: 1 in 40), so the reward rises through the
    # format: the base ends its answer in time for about a third of the samples, a few steps later nearly all do
    # (docs/serve.md: 0.33 -> 0.98 in two steps)
    assert mean(answered[-3:]) > answered[0] + 0.2, answered
    assert mean(reward[-3:]) > reward[0] + 0.03, reward


def test_chat_sl_on_the_cookbooks_conversations_lowers_the_nll(server, tmp_path):
    url, folder = server
    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    rows = recipe("tinker_cookbook.recipes.chat_sl.train",
                  [f"model_name={folder}", f"renderer_name={RENDERER}", f"dataset={data}", "batch_size=32",
                   "max_length=512", "lora_rank=16", "learning_rate=2e-4", "num_epochs=3", "eval_every=0",
                   "save_every=0"], url, tmp_path / "chat_sl")
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 12  # 128 conversations, 32 a batch, 3 epochs
    assert mean(nll[-4:]) < mean(nll[:4]) - 0.1, nll


@pytest.mark.parametrize("module, args", [
    ("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", ["group_size=2", "batch_size=1"]),
    ("tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
     ["batch_size=2", "num_train_datapoints=2", "num_test_datapoints=2"]),
], ids=["guess_number", "text_arena-tictactoe"])
def test_the_multiplayer_recipes_run_a_step(server, tmp_path, module, args):
    """The cookbook's multi-turn recipes (their default loss, importance_sampling; their command lines have no
    base_url: the SDK reads TINKER_BASE_URL): guess_number (up to 10 guesses an episode, each answered "too low" /
    "too high") and text_arena's TicTacToe (self-play, moves through textarena; SmolLM2's first move is mostly
    invalid, which ends the game: one turn). One training step each, small: the episodes run, the step trains, and the
    sampler's log-probs are the trainer's. (SmolLM2-135M learns neither game in a step: this shows the protocol, not
    learning; the server samples SmolLM2 with its built-in engine.)"""
    url, folder = server
    rows = recipe(module, [f"model_name={folder}", f"renderer_name={RENDERER}", "max_tokens=24", "max_steps=1",
                           "eval_every=0", "save_every=0", *args], url, tmp_path / "run")
    [step] = [r for r in rows if "env/all/reward/total" in r]
    assert step["tokens/trained"] > 0 and abs(step["optim/kl_sample_train_v1"]) < 1e-3
    if "guess_number" in module:
        assert step["env/all/turns_per_episode"] > 1  # the game went on after a wrong guess


def test_the_decision_recipe_reads_and_learns_a_choice_through_target_prompt_logprobs(server):
    """tinker-cookbook's decision recipe (recipes/decisions, its own functions unchanged): `sample_decision` asks for
    the log-probs of the choices' label tokens at the answer position (`target_prompt_logprobs`, sent sparse); its
    probabilities are the softmax of those tokens' log-probs in the whole next-token distribution (the top-k with k =
    the vocabulary: another code path). Trained with `decision_choice_datums` (cross-entropy on the right label's
    token), the right choice's probability rises; with `decision_dist_datums` and `probability_loss` (soft labels:
    [n, K] target_tokens and weights through forward_backward_custom) the probability moves to the labelled ones."""
    import asyncio

    import tinker
    from tinker import types
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.decisions import Decision, DecisionRenderer, decision_choice_datums, sample_decision
    from tinker_cookbook.recipes.decisions.train import decision_dist_datums, probability_loss
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    url, folder = server
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    decision_renderer = DecisionRenderer(renderers.get_renderer(RENDERER, get_tokenizer(folder)))
    decision = Decision("Which number is the largest?", [("a", "3"), ("b", "71"), ("c", "12"), ("d", "5")])
    rendering = decision_renderer.render(decision)
    training = service.create_lora_training_client(base_model=folder, rank=8, seed=0)

    def decide():
        sampler = training.save_weights_and_get_sampling_client()
        return sampler, asyncio.run(sample_decision(sampler, rendering))

    sampler, before = decide()
    assert sum(before.values()) == pytest.approx(1.0, abs=1e-5)
    out = sampler.sample(types.ModelInput.from_ints(rendering.tokens), 1, types.SamplingParams(max_tokens=1),
                         topk_prompt_logprobs=min(1024, training.get_tokenizer().vocab_size)).result(timeout=120)
    listed = dict(out.topk_prompt_logprobs[rendering.choice_pos])
    label_logps = [listed.get(rendering.label_tokens[label], -math.inf) for label in decision.labels]
    assert all(math.isfinite(lp) for lp in label_logps), "a label token is not among the 1024 most likely"
    total = math.log(sum(math.exp(lp) for lp in label_logps))
    assert [before[label] for label in decision.labels] == pytest.approx(
        [math.exp(lp - total) for lp in label_logps], abs=1e-4)
    datums = decision_choice_datums(decision_renderer, [(decision, "b")])
    for _ in range(4):
        training.forward_backward(datums, "cross_entropy").result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    _, after = decide()
    assert after["b"] > max(0.9, before["b"] + 0.2), (before, after)
    # soft labels: the recipe's decision_dist_datums ([n, K] target_tokens and weights) with its probability_loss,
    # through forward_backward_custom (the loss in this process, on the server's [n, K] log-probs)
    datums = decision_dist_datums(decision_renderer, [(decision, {"c": 0.5, "d": 0.5})])
    # cross-entropy to the target distribution (a squared error's gradient vanishes where p(b) is ~1 by now)
    soft_ce = probability_loss(lambda probs, target: -(target * probs.clamp(min=1e-30).log()).sum())
    for _ in range(6):
        training.forward_backward_custom(datums, soft_ce).result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    _, soft = decide()
    assert soft["c"] + soft["d"] > 0.8 and soft["b"] < 0.2, soft
    print(f"decision probabilities before {before}, after hard labels {after}, after soft ones {soft}")  # docs
    service.close("success").result(timeout=30)
