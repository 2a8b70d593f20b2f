"""The code-execution sandbox and the HumanEval task: what is contained, and real problems scored."""

import socket
import threading
import time

import pytest

from rlora.config import DataConfig
from rlora.data.prompts import load_prompt_sets
from rlora.rewards.code import build_program, code_reward, extract_code
from rlora.rewards.sandbox import Limits, run_program, run_programs

FAST = Limits(timeout_s=2.0, memory_mb=256)


def test_passing_and_failing_programs():
    assert run_program("assert sum(range(5)) == 10", FAST).status == "passed"
    failed = run_program("assert 1 == 2, 'nope'", FAST)
    assert failed.status == "failed" and "nope" in failed.output


def test_infinite_loop_is_killed_at_the_time_limit():
    outcome = run_program("while True:\n    pass\n", Limits(timeout_s=1.0))
    assert outcome.status == "timeout" and not outcome.passed
    assert outcome.seconds < 4.0


def test_sleeping_program_is_killed_at_the_wall_clock_limit():
    outcome = run_program("import time\ntime.sleep(60)\n", Limits(timeout_s=1.0))
    assert outcome.status == "timeout" and outcome.seconds < 4.0


@pytest.mark.parametrize("bomb", [
    "import os\nwhile True:\n    os.fork()\n",
    "import subprocess\nwhile True:\n    subprocess.Popen(['python3', '-c', 'pass'])\n",
    "import multiprocessing\nmultiprocessing.Process(target=print).start()\n",
    "import os\nos.system('echo ' + 'esc' + 'aped')\n",
])
def test_process_creation_is_refused(bomb):
    outcome = run_program(bomb, FAST)
    assert outcome.status == "failed" and "not allowed" in outcome.output and "escaped" not in outcome.output


def test_huge_allocation_fails_inside_the_memory_limit():
    outcome = run_program("x = bytearray(4 * 1024**3)\n", FAST)
    assert outcome.status == "failed" and "MemoryError" in outcome.output


@pytest.mark.parametrize("attack", [
    "open({target!r}, 'w').write('pwned')",
    "import os\nos.remove({victim!r})",
    "import os\nos.rename({victim!r}, {victim!r} + '.moved')",
    "import shutil\nshutil.rmtree({folder!r})",
    "import os\nfd = os.open({target!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'pwned')",
    "import pathlib\npathlib.Path({target!r}).write_text('pwned')",
    "import os\nos.symlink('/etc/passwd', {target!r})",
])
def test_file_changes_outside_the_sandbox_are_refused(attack, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("original")
    target = tmp_path / "written.txt"
    outcome = run_program(attack.format(target=str(target), victim=str(victim), folder=str(tmp_path)), FAST)
    assert outcome.status == "failed" and "not allowed" in outcome.output
    assert victim.read_text() == "original" and not target.exists()


def test_writing_inside_the_throwaway_folder_works_and_leaves_nothing():
    outcome = run_program("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())", FAST)
    assert outcome.status == "passed"
    import os
    assert not os.path.exists(outcome.output.strip())  # the working folder is gone afterwards


def test_no_network_and_no_native_code():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3.0)
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: _accept(server, accepted))
    thread.start()
    outcome = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'x')", FAST)
    thread.join()
    server.close()
    assert outcome.status == "failed" and not accepted
    assert run_program("import ctypes", FAST).status == "failed"
    assert run_program("import __main__\n__main__.__dict__.clear()\nimport os\nos.fork()", FAST).status == "failed"


def _accept(server, accepted):
    try:
        accepted.append(server.accept())
    except OSError:
        pass


def test_programs_run_concurrently_and_keep_order():
    start = time.perf_counter()
    outcomes = run_programs(["import time\ntime.sleep(0.5)\nprint(1)", "print(2)", "assert False"], FAST, workers=3)
    assert [o.status for o in outcomes] == ["passed", "passed", "failed"]
    assert outcomes[1].output.strip() == "2" and time.perf_counter() - start < 3.0


def test_extract_code_and_program_assembly():
    assert extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut at the length limit
    assert extract_code("    return 1\n") == "    return 1\n"
    header = 'def add(a, b):\n    """Add."""\n'
    body = build_program("    return a + b\n", "def check(c):\n    assert c(1, 2) == 3", "add", header)
    assert body.startswith(header + "    return a + b") and body.rstrip().endswith("check(add)")
    full = build_program("```python\ndef add(a, b):\n    return a + b\n```", "def check(c):\n    assert c(1, 2) == 3",
                         "add", header)
    assert full.startswith(header + "\ndef add(a, b)")


def test_humaneval_task_and_code_reward_on_real_problems():
    sets = load_prompt_sets(DataConfig(task="humaneval", eval_size=32, train_size=1000))
    assert len(sets.train) == 132 and len(sets.eval) == 32
    assert not {e.columns["task_id"] for e in sets.train} & {e.columns["task_id"] for e in sets.eval}
    problems = sets.train[:3]
    cols = {k: [p.columns[k] for p in problems] for k in ("test", "entry_point", "code_prompt")}
    right = [p.columns["answer"] for p in problems]  # the reference solutions (function bodies)
    wrong = ["    return None\n"] * 3
    looping = ["    while True:\n        pass\n"] * 3
    scores = code_reward(["p"] * 9, right + wrong + looping, **{k: v * 3 for k, v in cols.items()}, timeout_s=2.0)
    assert scores == [1.0] * 3 + [0.0] * 6


@pytest.mark.parametrize("attack", [
    # a relative path anchored on a descriptor of a folder outside
    "import os\nd = os.open({folder!r}, os.O_RDONLY)\nfd = os.open('written.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)\n"
    "os.write(fd, b'pwned')",
    "import os\nd = os.open({folder!r}, os.O_RDONLY)\nos.remove('keep.txt', dir_fd=d)",
    # a native helper module loaded under another dotted name, to spawn a shell
    "import importlib.util, glob, sys\npath = glob.glob(sys.base_prefix + '/lib/python3*/lib-dynload/_posixsubprocess*')[0]\n"
    "spec = importlib.util.spec_from_file_location('x._posixsubprocess', path)\n"
    "importlib.util.module_from_spec(spec)",
    # no audit event exists for mkfifo: only the switch to user nobody (when rlora runs as root) refuses it
    pytest.param("import os\nos.mkfifo({target!r})",
                 marks=pytest.mark.skipif(__import__("os").geteuid() != 0, reason="needs the switch to user nobody")),
])
def test_descriptor_and_native_module_escapes_are_refused(attack, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("original")
    target = tmp_path / "written.txt"
    outcome = run_program(attack.format(target=str(target), folder=str(tmp_path)), FAST)
    assert outcome.status == "failed", outcome.output
    assert victim.read_text() == "original" and not target.exists()


def test_signals_cannot_reach_processes_outside():
    import os
    import subprocess
    import sys

    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        attacks = [f"import os, signal\nos.kill({outside.pid}, signal.SIGKILL)"]
        if os.geteuid() == 0:  # pidfd signals have no audit event: only the switch to user nobody stops them
            attacks.append(f"import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({outside.pid}), signal.SIGKILL)")
        for attack in attacks:
            assert run_program(attack, FAST).status == "failed"
        time.sleep(0.2)
        assert outside.poll() is None, "the process outside must still run"
    finally:
        outside.kill()
        outside.wait()


def test_endless_output_is_capped():
    outcome = run_program("while True:\n    print('x' * 10000)\n", Limits(timeout_s=2.0, memory_mb=256, file_size_mb=1))
    assert not outcome.passed and len(outcome.output) <= 2000


def test_a_usage_example_after_the_solution_does_not_hide_it():
    completion = ("```python\ndef add(a, b):\n    return a + b\n```\nUsage:\n```python\nprint(add(1, 2))\n```")
    assert "return a + b" in extract_code(completion, "add")
