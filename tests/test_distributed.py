"""Data parallel with torchrun on CPU (gloo): 2 ranks x 1 prompt per step == 1 rank x 2 prompts per step,
both ranks hold the same adapter after every step, only rank 0 writes; split-invariant sampling."""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides
from rlora.cli import main
from rlora.config import check_launch, load_config
from rlora.errors import UserError
from rlora.rollout.sampling import counter_uniform
from rlora.train.distributed import World
from rlora.train.metrics import merge_metrics

TESTS = os.path.dirname(__file__)


def _run(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    return _run_command(nproc, ["train", *args])


def _run_command(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """`rlora ARGS` under torchrun with nproc ranks (CPU, gloo), or with nproc=1 in this process (a test worker runs
    torch on one thread, as OMP_NUM_THREADS=1 does the ranks; its output captured as a subprocess's would be): a
    reference run then costs no interpreter start and no imports (~7 s a run on a 2-core CPU)."""
    if nproc == 1:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
        return subprocess.CompletedProcess(["rlora", *args], code, out.getvalue(), err.getvalue())
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return run_process_group([*launcher, "-m", "rlora", *args], env, timeout_s=600)


def run_process_group(command: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) in a session of its own: past timeout_s the whole
    group is killed, torchrun's ranks too (subprocess.run's timeout kills the launcher alone, and ranks waiting on a
    collective that never comes would stay, holding their memory, after the test has failed)."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_a_timed_out_run_leaves_no_process_behind(tmp_path):
    """run_process_group past its time limit kills the launcher's children too (torchrun's ranks), not the launcher
    alone: a child that would sleep for a minute is gone when the TimeoutExpired arrives. (It closes the output it
    inherited, so that the launcher's pipes end with the launcher: otherwise reading them would wait for the child.)"""
    marker = tmp_path / "child-pid"
    child = (f"import os, time; os.close(1); os.close(2); open({str(marker)!r}, 'w').write(str(os.getpid())); "
             "time.sleep(60)")
    parent = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_group([sys.executable, "-c", parent], dict(os.environ), timeout_s=3)
    stat = Path(f"/proc/{int(marker.read_text())}/stat")

    def killed() -> bool:  # gone, or a zombie until whoever adopted it (the launcher is dead) reaps it
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    # SIGKILL lands asynchronously (the child may still show "R" for a moment); a live child sleeps, "S", for 60 s
    deadline = time.monotonic() + 20
    while not killed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert killed()


# 30 s each on a 2-core CPU: plain groups (also run by the DAPO and policies tests) and REINFORCE++'s whitening
# (the same summed statistics as adv_scale=batch) run in the slow target, batch statistics by default
@pytest.mark.parametrize("algo", [pytest.param({}, marks=pytest.mark.slow), {"algo.adv_scale": "batch"},
                                  pytest.param({"algo.name": "reinforce_pp", "algo.beta": 0.01}, marks=pytest.mark.slow),
                                  # episodes of up to three turns with a scripted environment (tests/envs_for_tests.py)
                                  pytest.param({"env": "{fn: envs_for_tests.scripted, args: {turns: 3}}",
                                                "rollout.stop": "[' ']"}, marks=pytest.mark.slow),
                                  # transformers generate (as for a model the built-in engine does not run): it draws
                                  # as the engine does (rollout/generate_draw.py), so its samples do not depend on
                                  # how the batch is split either
                                  pytest.param({"rollout.engine": "hf", "rollout.sampler_dtype": "model"},
                                               marks=pytest.mark.slow)])
def test_two_ranks_equal_one_rank_with_the_whole_batch(tiny_model_dir, prompts_file, tmp_path, algo):
    # Also with batch-wide statistics (GRPO's std over the batch, REINFORCE++'s token whitening): the ranks sum
    # their counts, sums and squared deviations, so each divides by the whole batch's std.
    # One micro-batch per group: each rank's gradient is then computed exactly as that micro-batch's share in one
    # process, and the all-reduce adds the two shares as one process does, so the runs agree to the bit (0.0 here).
    # With smaller micro-batches the float32 sums associate differently (~1e-8 relative) and AdamW can amplify
    # that on a parameter whose gradient nearly cancels (one weight 5.6e-5 apart after 2 steps at lr 0.05 on
    # 2026-11-24); micro-batch invariance itself is tested in test_policy_model.py.
    common = {"train.prompts_per_step": 2, "rollout.num_generations": 4, "train.micro_batch_size": 4,
              "train.steps": 2, "train.lr": 0.05, "algo.beta": 0.04, "eval.before": "false", "eval.after": "false",
              "train.sample_every": 1, "train.threads": 1}
    outs = {}
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        done = _run(nproc, tiny_overrides(tiny_model_dir, prompts_file, str(out), **{**common, **algo}))
        assert done.returncode == 0, done.stderr[-3000:]
        outs[nproc] = out
    rows = {n: [json.loads(line) for line in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)}
    # AdamW's step is invariant to a constant gradient scale (up to its eps and the clipping at
    # train.max_grad_norm), so the adapters below see a world-size factor in the data-parallel reduction (a mean
    # where a sum belongs, normalisers counted per rank) only indirectly, if at all: through eps-sized
    # gradients or step 2 sampling other tokens. The logged loss and pre-clip grad_norm see it at step 1. So
    # every step metric of the two runs must agree, with these exceptions: the wall-clock seconds (keys ending
    # in _s) differ from run to run, and world_size / adapter_rank_divergence only the 2-rank run logs.
    # Tolerance: one micro-batch per rank is one micro-batch of the single process, the float32 gradients are
    # added a + b either way and the metric sums are float64, so the runs agree to the bit (0.0 on 2026-11-26);
    # rel 1e-6 (~8 float32 ulps) only leaves room for a reduction order of gloo's own, while a world-size
    # factor is off by 50-100%.
    compared = _assert_same_step_metrics(rows[1], rows[2], rel=1e-6)
    assert {"loss", "grad_norm", "kl", "entropy", "clip_frac", "reward_mean", "rows", "lr"} <= compared
    one, two = (load_file(str(outs[n] / "adapter" / "adapter_model.safetensors")) for n in (1, 2))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)  # the adapter did move
    assert [r["step"] for r in rows[2]] == [1, 2]  # written once, by rank 0
    assert all(r["world_size"] == 2 and r["adapter_rank_divergence"] == 0.0 for r in rows[2])
    assert [r["gen_tokens"] for r in rows[2]] == [r["gen_tokens"] for r in rows[1]]
    samples = {n: [(json.loads(s)["prompt"], json.loads(s)["completion"])
                   for s in (outs[n] / "samples.jsonl").read_text().splitlines()] for n in (1, 2)}
    assert samples[1] == samples[2] and len(samples[2]) == 2 * 2 * 4


def _assert_same_step_metrics(one: list[dict], two: list[dict], rel: float) -> set[str]:
    """Each step's metrics of the 1-process run equal the 2-rank run's (numbers within rel, others exactly),
    except the wall-clock seconds; -> the keys compared."""
    assert [r["step"] for r in one] == [r["step"] for r in two]
    compared = set()
    for a, b in zip(one, two, strict=True):
        keys = {k for k in a if not k.endswith("_s")}
        assert keys | {"world_size", "adapter_rank_divergence"} == {k for k in b if not k.endswith("_s")}
        for key in sorted(keys):
            if isinstance(a[key], (int, float)) and isinstance(b[key], (int, float)):
                assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-12), (a["step"], key, a[key], b[key])
            else:
                assert b[key] == a[key], (a["step"], key)
        compared |= keys
    return compared


# DAPO drops prompt 0's group (flat_for_zero), rank 0's only one on 2 ranks: rank 0 trains nothing this step
DAPO_EMPTY_RANK = {"algo.name": "dapo", "algo.max_extra_rounds": 0, "data.shuffle": "false",
                   "rewards": "[{fn: rewards_for_tests.flat_for_zero}]", "train.prompts_per_step": 2,
                   "rollout.num_generations": 4, "train.micro_batch_size": 2, "train.steps": 1, "train.lr": 0.05,
                   "eval.before": "false", "eval.after": "false", "train.threads": 1}


# ~15 s each: dapo, and REINFORCE++'s batch-wide whitening with dynamic sampling; dapo with adv_scale=batch slow
@pytest.mark.parametrize("algo", [{}, {"algo.name": "reinforce_pp", "algo.dynamic_sampling": "true"},
                                  pytest.param({"algo.adv_scale": "batch"}, marks=pytest.mark.slow)],
                         ids=["dapo", "reinforce-pp", "dapo-batch-scale"])
def test_a_rank_without_groups_still_joins_the_update(tiny_model_dir, prompts_file, tmp_path, algo):
    """DAPO's dynamic sampling drops the zero-variance group of prompt 0, which is rank 0's share: rank 0 trains
    nothing but adds zeros to the collectives, batch-wide advantage statistics' sums too; the result equals one
    process dropping the same group."""
    common = DAPO_EMPTY_RANK | algo
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"ranks{nproc}"
        done = _run(nproc, tiny_overrides(tiny_model_dir, prompts_file, str(outs[nproc]), **common))
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(outs[n] / "adapter" / "adapter_model.safetensors")) for n in (1, 2))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    [row] = [json.loads(line) for line in (outs[2] / "metrics.jsonl").read_text().splitlines()]
    assert row["groups_dropped"] == 1 and row["reward_mean"] is not None and row["adapter_rank_divergence"] == 0.0
    [alone] = [json.loads(line) for line in (outs[1] / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "trained_frac", "clip_frac", "entropy", "grad_norm"):  # the update's, from summed sums
        assert row[key] == pytest.approx(alone[key], rel=1e-6), key
    for key in ("rows", "groups", "reward_count", "reward_mean", "reward_std", "completion_len_mean"):  # weighted
        assert row[key] == pytest.approx(alone[key], rel=1e-9), key


@pytest.mark.slow  # 60 s: five torchrun launches (scripts/test.sh --slow)
def test_replay_buffers_per_rank_resume_exactly(tiny_model_dir, prompts_file, tmp_path):
    """Experience replay on 2 ranks: each rank stores and replays its own groups, and a checkpoint holds every
    rank's buffer. 2 steps + resume + 2 steps == 4 steps straight (adapters within 1e-6, the same samples and
    replay counts); groups are replayed. Resuming that checkpoint in one process is one line, exit 2."""
    common = {"algo.replay.enabled": "true", "algo.replay.ratio": 1.0, "train.prompts_per_step": 2,
              "rollout.num_generations": 4, "train.micro_batch_size": 4, "train.lr": 0.05, "train.checkpoint_every": 1,
              "eval.before": "false", "eval.after": "false", "train.sample_every": 1, "train.threads": 1}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out, extra in ((straight, {"train.steps": 4}), (resumed, {"train.steps": 2}),
                       (resumed, {"train.steps": 4, "train.resume": "auto"})):
        done = _run(2, tiny_overrides(tiny_model_dir, prompts_file, str(out), **common, **extra))
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in (straight, resumed))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6
    rows = {out: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] for out in (straight, resumed)}
    keys = ("step", "replay_groups", "replay_stored", "replay_buffer", "reward_mean")
    assert [[r[k] for k in keys] for r in rows[straight]] == [[r[k] for k in keys] for r in rows[resumed]]
    assert sum(r["replay_groups"] for r in rows[straight]) > 0  # groups were replayed after the resume point too
    assert sum(r["replay_groups"] for r in rows[straight][2:]) > 0
    assert (straight / "samples.jsonl").read_text() == (resumed / "samples.jsonl").read_text()
    config = (resumed / "config.yaml").read_text()
    done = _run(1, tiny_overrides(tiny_model_dir, prompts_file, str(resumed), **common,
                                  **{"train.steps": 5, "train.resume": "auto"}))
    assert done.returncode == 2 and done.stderr.count("rlora: error:") == 1
    assert "the checkpoint holds the replay buffers of 2 rank(s), this run has 1" in done.stderr
    assert (resumed / "config.yaml").read_text() == config  # refused before anything is written


def test_world_checks_and_metric_merging():
    cfg = load_config(None, ["train.prompts_per_step=3", "train.micro_batch_size=8"])
    with pytest.raises(UserError, match="multiple of the 2 ranks"):
        check_launch(cfg, 2)
    check_launch(load_config(None, ["rollout.engine=hf", "rollout.sampler_dtype=model", "algo.sampler_is_cap=null"]), 2)
    for override in ("algo.adv_scale=batch", "algo.name=reinforce_pp"):  # summed over the ranks, also with dapo's
        check_launch(load_config(None, [override, "algo.dynamic_sampling=true"]), 2)
    check_launch(cfg, 1)  # one process: anything goes
    # the loss is already the global one on every rank (all-reduced in the update): averaging keeps it
    merged = merge_metrics([{"step": 3, "loss": 0.75, "gen_tokens": 10, "rollout_s": 2.0, "reward_mean": 0.5, "kl": None},
                            {"step": 3, "loss": 0.75, "gen_tokens": 12, "rollout_s": 3.0, "reward_mean": 1.0, "kl": None}])
    assert merged == {"step": 3, "loss": 0.75, "gen_tokens": 22, "rollout_s": 3.0, "reward_mean": 0.75, "kl": None}
    # several policies: each policy's metrics merged over the ranks that hold its groups; maxima take the largest
    merged = merge_metrics([{"step": 1, "completion_len_max": 7, "policies": {"a": {"reward_mean": 0.5, "gen_tokens": 4},
                                                                              "b": {"reward_mean": 1.0, "gen_tokens": 6}}},
                            {"step": 1, "completion_len_max": 9, "policies": {"b": {"reward_mean": 0.0, "gen_tokens": 2},
                                                                              "c": {"reward_mean": 0.25, "gen_tokens": 3}}}])
    assert merged == {"step": 1, "completion_len_max": 9, "policies": {
        "a": {"reward_mean": 0.5, "gen_tokens": 4}, "b": {"reward_mean": 0.5, "gen_tokens": 8},
        "c": {"reward_mean": 0.25, "gen_tokens": 3}}}


def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & mask
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & mask
    return x ^ (x >> 31)


def test_counter_uniform_matches_a_plain_python_splitmix64_and_ignores_batch_composition():
    keys = torch.tensor([0, 1, 7, 123456789, 2**40 + 5])
    got = counter_uniform(seed=42, keys_A=keys, t=3)
    mask = (1 << 64) - 1
    base = (42 * 0xD1B54A32D192ED03 + 3 * 0x8CB92BA72F3D8DD7) & mask
    # splitmix64: the increment is added before mixing; the top 52 bits, centred: u in (0, 1)
    want = [((_splitmix64(((k + 1) * 0x9E3779B97F4A7C15 + base) & mask) >> 12) + 0.5) * 2.0**-52
            for k in keys.tolist()]
    assert got.dtype == torch.float64 and got.tolist() == want
    assert counter_uniform(42, keys[2:3], 3).tolist() == got[2:3].tolist()  # a row's draw is its own
    draws = counter_uniform(7, torch.arange(20000), 0)
    assert abs(float(draws.mean()) - 0.5) < 0.01 and float(draws.min()) > 0 and float(draws.max()) < 1


def test_rm_two_ranks_equal_one_rank(tiny_model_dir, tmp_path):
    """rlora rm on 2 ranks: each trains half of every batch of pairs (one micro-batch each, as the one process
    splits it); the pair count and the adapter's and head's gradients summed: the reward model and every metric
    equal one process's (held-out loss within float32 rounding: the held-out pairs are split 1 + 2)."""
    from test_rm import PAIRS, rm_config, write_jsonl

    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"ranks{nproc}"
        config = rm_config(tmp_path, tiny_model_dir, data, {"eval_size": 3}, steps=3, eval_every=2, lr=0.05,
                           threads=1, output_dir=str(outs[nproc]))
        done = _run_command(nproc, ["rm", config])
        assert done.returncode == 0, done.stderr[-3000:]
    for name in ("adapter_model.safetensors", "score_head.safetensors"):
        one, two = (load_file(str(outs[n] / "reward_model" / name)) for n in (1, 2))
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6, name
    rows = {n: [json.loads(line) for line in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)}
    assert rows[1][-1]["loss"] != rows[1][0]["loss"]  # it trained
    for a, b in zip(rows[1], rows[2], strict=True):
        for key in ("loss", "accuracy", "reward_gap", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        assert ("eval_loss" in a) == ("eval_loss" in b)
        if "eval_loss" in a:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6) and a["eval_accuracy"] == b["eval_accuracy"]


@pytest.mark.slow  # 62 s: three torchrun launches; the default suite keeps rlora rm's (the same supervised step loop)
def test_sft_two_ranks_equal_one_rank(tiny_model_dir, tmp_path):
    """rlora sft on 2 ranks: each trains half of every length-sorted batch (one micro-batch each, as the one
    process splits it), the target count and gradients summed: the adapter, losses, token counts and held-out
    losses equal one process's. A batch that does not split over the ranks: each rank exits 2 with the one-line
    error (torchrun then reports the failed job), nothing written."""
    from test_sft import REPETITIVE, sft_config, write_jsonl

    data = write_jsonl(tmp_path / "rows.jsonl", REPETITIVE * 2)
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"ranks{nproc}"
        config = sft_config(tmp_path, tiny_model_dir, data, steps=3, eval_every=2, lr=0.05, threads=1,
                            output_dir=str(outs[nproc]))
        done = _run_command(nproc, ["sft", config, "data.eval_size=3"])
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(outs[n] / "adapter" / "adapter_model.safetensors")) for n in (1, 2))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if "lora_B" in k)
    rows = {n: [json.loads(line) for line in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)}
    for a, b in zip(rows[1], rows[2], strict=True):
        assert a["tokens"] == b["tokens"] and ("eval_loss" in a) == ("eval_loss" in b)
        if "eval_loss" in a:  # steps 2 and 3; the 3 held-out rows split 1 + 2 pad differently: float32 rounding
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    config = sft_config(tmp_path, tiny_model_dir, data, steps=1, batch_size=3, micro_batch_size=1,
                        output_dir=str(tmp_path / "odd"))
    done = _run_command(2, ["sft", config])
    assert done.returncode != 0 and "rlora: error: train.batch_size=3 must be a multiple of the 2 ranks" in done.stderr
    assert "exitcode  : 2" in done.stderr
    assert not (tmp_path / "odd").exists()


@pytest.mark.slow  # 40 s: three launches
def test_sft_resumes_under_torchrun(tiny_model_dir, tmp_path):
    """2 ranks for 2 steps (a checkpoint each step), then 2 ranks resumed to 3 steps, against 2 ranks for 3 steps
    straight, with LoRA dropout: each rank draws its own masks, so the checkpoint holds every rank's RNG states and
    each rank reads back its own (with rank 0's on both ranks, as before, this test fails)."""
    from test_sft import sft_config, write_jsonl

    # rows of two lengths: each step's length-sorted batch gives rank 1 the longer rows, so the ranks' dropout draws
    # take different amounts of randomness and their RNG states part
    data_rows = [{"prompt": f"Say {i}.", "completion": f"{i}"} for i in range(4)]
    data_rows += [{"prompt": f"Count from {i} to {i + 9} in words, please.", "completion": " ".join(["one"] * 9)}
             for i in range(4)]
    data = write_jsonl(tmp_path / "rows.jsonl", data_rows)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    def run(out, steps, *extra):
        config = sft_config(tmp_path, tiny_model_dir, data, steps=steps, lr=0.05, threads=1, checkpoint_every=1,
                            group_window=1, output_dir=str(out))
        done = _run_command(2, ["sft", config, "lora.dropout=0.2", "data.use_chat_template=false", *extra])
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run(straight, 3)
    run(resumed, 2)
    assert "resuming from" in run(resumed, 3, "train.resume=auto").stderr
    one, two = (load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in (straight, resumed))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6
    rows = {out: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (straight, resumed)}
    assert [r["step"] for r in rows[resumed]] == [1, 2, 3]
    for a, b in zip(rows[straight], rows[resumed], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["tokens"] == b["tokens"]


# ~25 s each on a 2-core CPU (two launches): the token router with hydra by default, the sequence router slow
@pytest.mark.parametrize("setting", ["token-hydra", pytest.param("sequence-top2", marks=pytest.mark.slow)])
def test_sft_of_a_molora_two_ranks_equal_one_rank(setting, tiny_model_dir, tmp_path):
    """rlora sft with a molora section on 2 ranks against 1: each rank routes and trains its half of every batch,
    and the routers' batch-wide auxiliary loss sums its statistics over the ranks (models/molora/batch_aux.py), so
    the gradient is the one process's. The saved MoLoRA folder, losses (task and auxiliary), router metrics and
    held-out losses agree."""
    from safetensors.torch import load_file as load
    from test_molora_sft import ROWS, SETTINGS, molora_config
    from test_sft import write_jsonl
    from rlora.models import molora as ml

    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"ranks{nproc}"
        config = molora_config(tmp_path, tiny_model_dir, data, SETTINGS[setting], steps=3, lr=0.05, threads=1,
                               eval_every=2, output_dir=str(outs[nproc]))
        done = _run_command(nproc, ["sft", config])
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load(str(outs[n] / "adapter" / ml.WEIGHTS_FILE)) for n in (1, 2))
    assert one.keys() == two.keys()
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6
    assert any(float(v.abs().max()) > 0 for k, v in two.items() if k.endswith("molora_B"))  # it learnt
    rows = {n: [json.loads(line) for line in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)}
    for a, b in zip(rows[1], rows[2], strict=True):
        assert a["tokens"] == b["tokens"] and ("eval_loss" in a) == ("eval_loss" in b)
        keys = ["loss", "aux_loss", "grad_norm", "molora/balance", "molora/entropy"] + ["eval_loss"] * ("eval_loss" in a)
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
    assert sum("eval_loss" in a for a in rows[1]) == 2  # steps 2 and 3


@pytest.mark.parametrize("command", [["eval"], ["chat"], ["merge", "adapter", "-o", "out"], ["plot", "run"]])
def test_one_process_commands_refuse_torchrun(command, monkeypatch, capsys, tmp_path):
    """rlora eval / chat / merge / plot under torchrun would run once per rank into the same output: one line."""
    from rlora.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"rlora {command[0]} runs in one process" in err, err
    assert list(tmp_path.iterdir()) == []


def _on_rank_zero_worker(rank: int, store: str, results) -> None:
    import torch.distributed as dist

    from rlora.train.distributed import on_rank_zero

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    checked = []

    def check():
        checked.append(rank)
        raise UserError("the output folder already holds files")

    try:
        on_rank_zero(World(rank, 2), check)
        results.put((rank, checked, None))
    except UserError as err:
        results.put((rank, checked, str(err)))
    dist.destroy_process_group()


def test_on_rank_zero_raises_rank_zeros_error_on_every_rank(tmp_path):
    """Two gloo processes: only rank 0 runs the check, and both raise its error with its message."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_on_rank_zero_worker, args=(str(tmp_path / "store"), results), nprocs=2,
                       start_method="spawn")
    got = sorted(results.get() for _ in range(2))
    assert got == [(0, [0], "the output folder already holds files"), (1, [], "the output folder already holds files")]


def test_a_refused_output_folder_stops_every_rank_before_loading(tiny_model_dir, prompts_file, tmp_path):
    """Rank 0 checks the output folder; the others learn its verdict (and its message) from a collective, so
    they stop with it instead of loading the model and dying at their first collective. torchrun stops the
    other ranks (SIGTERM) as soon as one exits, and which rank exits first is a race: so every rank carries
    the message, every rank that exited by itself exited 2, and the others were stopped by torchrun. That
    every rank raises, with rank 0's message, is tested without the race below."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = _run(2, tiny_overrides(tiny_model_dir, prompts_file, str(out)))
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr)
    assert done.returncode != 0 and "2" in codes and set(codes) <= {"2", "-15"}, done.stderr[-2000:]
    assert re.search(r"rlora: error: .*already holds files", done.stderr), done.stderr[-2000:]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

