import atexit
import json
import os
import shutil
import tempfile

# Every data file a test reads through `datasets` leaves an arrow copy and a lock file in its cache: a run of the
# suite would add ~250 to the user's ~/.cache/huggingface/datasets. Before anything imports datasets (it reads the
# variable once), each test process (and the commands it starts) gets its own cache, removed at its exit.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="rlora-tests-datasets-")
atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

from rlora.models.tiny import build_random_model  # noqa: E402

# keep tests single-threaded-deterministic and quiet
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite checks exact CPU numbers (and calls models with CPU tensors), so it hides any GPU: model.device=auto
# then means the CPU. RLORA_TEST_GPU=1 leaves the GPU visible for tests/test_gpu.py (bench/gpu_suite.sh).
if os.environ.get("RLORA_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# scripts/test.sh runs the suite on one pytest-xdist worker per core: one thread each, so the workers do not
# fight over the cores (tests of tiny models gain nothing from a second thread)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama (hidden 64) with a byte-level BPE tokenizer and a chat template."""
    return str(build_random_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny_overrides(model_dir: str, data_path: str, out_dir: str, **extra) -> list[str]:
    """CLI overrides that turn the demo config into a seconds-long run on the tiny model."""
    values = {
        "model.path": model_dir, "data.task": "null", "data.path": data_path, "data.eval_path": data_path,
        "data.eval_size": 4, "rewards": "[{fn: rewards_for_tests.count_a}]", "rollout.num_generations": 4,
        "rollout.max_new_tokens": 8, "train.steps": 2, "train.prompts_per_step": 2, "train.micro_batch_size": 4,
        "train.output_dir": out_dir, "train.sample_every": 1, "eval.batch_size": 4, "lora.rank": 4,
        # the demo's `auto` resolves per CPU: pinned to one choice, so tests do the same work on every machine
        "rollout.sampler_dtype": "bfloat16",
        # the demo's recipe may change (it samples at 1.0 since 2026-11-26): tests keep the draws they were written for
        "rollout.temperature": 0.7,
        "log.plot": "false",  # figures cost ~1 s a run; tests/test_plot.py turns them on where it checks them
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
