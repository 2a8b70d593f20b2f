import math

import pytest
import torch

from rlora.config import TrainConfig
from rlora.train.optim import build_optimizer, load_optimizer_state, lr_factor


def test_warmup_then_cosine_hand_computed():
    # 2 warmup steps: 1/2, 2/2; then cosine over the remaining 4 steps: 0.5 * (1 + cos(pi * k / 4))
    got = [lr_factor(step, total_steps=6, warmup_steps=2, schedule="cosine") for step in range(6)]
    want = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert got == pytest.approx(want)


def test_constant_schedule_and_optimizer_lr():
    assert [lr_factor(s, 5, 1, "constant") for s in range(5)] == [1.0] * 5
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer, scheduler = build_optimizer([param], TrainConfig(lr=0.1, warmup_steps=2, schedule="cosine"), 4)
    lrs = []
    for _ in range(4):
        lrs.append(scheduler.get_last_lr()[0])
        param.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    # warmup 0.05, 0.1, then cosine over 2 steps: 0.1 * 0.5 * (1 + cos(0)) = 0.1, 0.1 * 0.5 * (1 + cos(pi/2)) = 0.05
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.05])


def test_release_memory_sets_the_allocator_in_a_fresh_process():
    """train.release_memory changes a process-wide glibc setting: check it in a child process."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from rlora.system import return_freed_memory as r; print(r())"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("True" if sys.platform.startswith("linux") else "False")


def test_a_resume_keeps_the_moments_and_takes_this_runs_settings():
    """A resume with another train.lr (or schedule, betas, weight decay) ran on with the saved ones while config.yaml
    said the new: the checkpoint gives the moments and the step count, the run gives the settings."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    before, sched = build_optimizer([weight], TrainConfig(lr=1e-3, warmup_steps=4), total_updates=10)
    for _ in range(2):
        weight.grad = torch.randn(4, 3)
        before.step()
        sched.step()
    saved_opt, saved_sched = before.state_dict(), sched.state_dict()
    cfg = TrainConfig(lr=1e-5, warmup_steps=4, weight_decay=0.1, adam_beta2=0.95)
    after, sched_after = build_optimizer([weight], cfg, total_updates=10)
    load_optimizer_state(after, sched_after, saved_opt, saved_sched)
    group = after.param_groups[0]
    assert group["lr"] == pytest.approx(1e-5 * 3 / 4) and sched_after.get_last_lr() == [group["lr"]]  # warmup step 2
    assert group["weight_decay"] == 0.1 and group["betas"] == (0.9, 0.95)
    assert torch.equal(after.state[weight]["exp_avg"], before.state[weight]["exp_avg"])
    assert int(after.state[weight]["step"]) == 2
    sched_after.step()
    assert group["lr"] == pytest.approx(1e-5 * 4 / 4)  # the schedule goes on from the saved step
