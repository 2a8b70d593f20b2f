import math

import pytest
import torch

from rlora.config import TrainConfig
from rlora.train.optim import build_optimizer, lr_factor


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
