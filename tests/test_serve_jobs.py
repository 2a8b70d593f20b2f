"""`rlora serve`'s futures (serve/jobs.py), without a model: a finished job keeps its result and not its request;
results are dropped by time (shortly after they are retrieved, or after a long wait if never), not by count, so a
slow client's future survives a busy server; nothing a finished job does can stop the worker thread."""

import time

import pytest

from rlora.serve.jobs import RETRIEVED_GRACE, UNRETRIEVED_TTL, Job, Jobs


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the worker did not get there"
        time.sleep(0.005)


@pytest.fixture
def clock_and_jobs():
    clock = Clock()
    jobs = Jobs(clock)
    yield clock, jobs
    jobs.stop()


def test_results_are_kept_by_time_not_by_count_and_requests_are_dropped(clock_and_jobs):
    clock, jobs = clock_and_jobs
    slow = jobs.submit(lambda: {"n": -1}, key=("model", 1, "fb"))
    many = [jobs.submit(lambda i=i: {"n": i}) for i in range(5000)]  # more than any count-based table kept
    wait_for(lambda: jobs.get(many[-1]).result is not None)
    assert jobs.get(slow).result.body == {"n": -1}  # nobody asked yet, on a busy server: still there
    assert all(jobs.get(j).run is None for j in [slow, *many])  # each request (its closure) went when it ran
    assert jobs.submit(lambda: {"n": -2}, key=("model", 1, "fb")) == slow  # a resend gets the first future

    jobs.retrieved(many[0])
    clock.now += RETRIEVED_GRACE + 1
    jobs.sweep(force=True)
    assert jobs.get(many[0]) is None  # retrieved, then its grace ran out
    assert jobs.get(slow) is not None and jobs.get(many[1]) is not None and jobs.has_key(("model", 1, "fb"))

    clock.now += UNRETRIEVED_TTL
    jobs.sweep(force=True)
    assert jobs.get(slow) is None and not jobs.has_key(("model", 1, "fb")) and len(jobs) == 0


def test_a_failing_job_and_a_failing_finish_do_not_stop_the_worker(clock_and_jobs, monkeypatch, capsys):
    _, jobs = clock_and_jobs

    def broken(self, result):
        raise RuntimeError("finish broke")

    with monkeypatch.context() as patch:
        patch.setattr(Job, "finish", broken)
        lost = jobs.submit(lambda: {"n": 1})
        seen: list[str] = []
        wait_for(lambda: seen.append(capsys.readouterr().err) or "finish broke" in "".join(seen))
    assert jobs.get(lost).run is None

    def fails():
        raise ValueError("the model broke")

    failed = jobs.submit(fails)
    after = jobs.submit(lambda: {"n": 2})
    wait_for(lambda: jobs.get(after).result is not None)
    assert jobs.get(after).result.body == {"n": 2}
    result = jobs.get(failed).result
    assert result.error == "rlora serve failed: ValueError: the model broke" and not result.user_error
    assert jobs.get(failed).run is None
