"""model.path / --model / --base resolution (models/loading.py resolve_model_path): a typo of an alias, a mistyped
local path and a hub id that cannot load offline are refused at once, in one line, never reaching the network
(handed to the hub offline, each cost a minute of retries before a generic error)."""

import time

import pytest

from rlora.cli import main
from rlora.errors import UserError
from rlora.models import loading
from rlora.models.loading import resolve_model_path


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """An empty Hugging Face cache, and a hub probe that fails the test if called unless a test sets the answer."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    answer = {}

    def probe(timeout_s: float = 3.0) -> bool:
        assert "reachable" in answer, "the hub was probed where the name alone says no"
        return answer["reachable"]

    monkeypatch.setattr(loading, "hub_reachable", probe)
    return answer


def _refusal(name: str, option: str = "model.path") -> str:
    start = time.perf_counter()
    with pytest.raises(UserError) as err:
        resolve_model_path(name, option)
    assert time.perf_counter() - start < 1.0
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_name_without_a_slash_is_an_alias_typo(no_network):
    message = _refusal("smollm2-135m")
    assert message.startswith("model.path 'smollm2-135m' is not a local folder or a built-in alias")
    assert "did you mean 'smollm2-135m-instruct'?" in message
    assert "hub id 'org/name'" in _refusal("qwen")  # nothing close: says what a name may be


def test_a_mistyped_local_path_lists_close_entries(no_network, tmp_path, monkeypatch):
    (tmp_path / "mymodels" / "qwen-0.5b-instruct").mkdir(parents=True)
    (tmp_path / "mymodels" / "llama").mkdir()
    monkeypatch.chdir(tmp_path)  # mymodels/ exists here: 'mymodels/qwen-0.5b' is not the hub's org 'mymodels'
    message = _refusal("mymodels/qwen-0.5b")
    assert message.startswith("model.path 'mymodels/qwen-0.5b' not found") and "qwen-0.5b-instruct" in message
    assert "llama" not in message
    assert _refusal(str(tmp_path / "nope"), "--model") == f"--model '{tmp_path / 'nope'}' not found"


def test_a_hub_id_offline_and_not_cached_is_refused_at_once(no_network):
    no_network["reachable"] = False
    message = _refusal("Qwen/Qwen2.5-0.5B-Instruct")
    assert "not in the local Hugging Face cache, and huggingface.co is not reachable: give a local model folder" \
        in message
    no_network["reachable"] = True  # online: the hub id goes to transformers, as before
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_cached_hub_id_loads_from_the_cache_offline(no_network, tmp_path):
    repo = tmp_path / "hf-cache" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    no_network["reachable"] = False
    assert resolve_model_path("org/tiny") == str(snapshot)  # a local folder: transformers makes no request
    no_network["reachable"] = True
    assert resolve_model_path("org/tiny") == "org/tiny"


def test_the_commands_name_the_option_given(no_network, tmp_path, capsys):
    for args, option in [(["chat", "--model", "/nope"], "--model '/nope'"),
                         (["chat", "--model", "smollm2-135m"], "--model 'smollm2-135m'"),
                         (["train", "model.path=smollm2-135m", f"train.output_dir={tmp_path / 'o'}"],
                          "model.path 'smollm2-135m'")]:
        assert main(args) == 2, args
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlora: error:")]
        assert len(errors) == 1 and errors[0].startswith(f"rlora: error: {option}"), errors


def test_serve_loads_a_cached_hub_id_from_the_cache_even_with_the_hub_reachable(no_network, tiny_model_dir, tmp_path):
    """rlora serve never fetches a model: a hub id in the cache is served from its snapshot, not refused as 'not a
    model folder' because the hub happened to be reachable (train would hand the id to transformers)."""
    import shutil

    from rlora.serve.main import build

    repo = tmp_path / "hf-cache" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("b" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    no_network["reachable"] = True
    _, served = build("org/tiny", tmp_path / "state")
    assert served.names == [str(snapshot.resolve()), "org/tiny"]  # clients may name the base either way
    with pytest.raises(UserError, match=r"--model 'org/absent' is not a local folder, a built-in alias \(.*\) or a hub id "
                                        r"in the local Hugging Face cache \(nothing is downloaded here\)"):
        build("org/absent", tmp_path / "state2")
