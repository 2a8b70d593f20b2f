"""`rlora serve`'s training state through the official tinker SDK: save_state writes the adapter and its AdamW state
(safetensors, no pickle); a client made from it, with the optimizer, continues exactly as the original does, also
on a server started afresh on the same --state-dir; without the optimizer it starts Adam over. A state saved before
any gradient loads; a checkpoint not of the client's exact shape is refused and changes nothing. Saved folders are
swapped in whole (a crash half-way leaves the old one), and names and ids cannot leave the state folder. A checkpoint
saved with ttl_seconds expires."""

import json
import shutil
import time

import numpy as np
import pytest
import tinker
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from serve_helpers import KEY, running_server
from tinker import types

from rlora.models.tiny import build_random_model
from rlora.serve.state import ServeError, StateDir, TinkerPath, check_name, parse_path

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
ADAM = types.AdamParams(learning_rate=1e-2, beta2=0.99)


def logprobs(training, data) -> np.ndarray:
    return np.concatenate([o["logprobs"].to_numpy() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs])


def step(training, data) -> None:
    training.forward_backward(data, "cross_entropy")
    training.optim_step(ADAM).result()


def test_saved_state_resumes_exactly_also_after_a_restart(tmp_path):
    model_dir = str(build_random_model(tmp_path / "model", seed=0))
    state_dir = tmp_path / "state"
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10], "weights": [1.0] * 5}),
            types.Datum(model_input=types.ModelInput.from_ints([20, 21, 22]),
                        loss_fn_inputs={"target_tokens": [21, 22, 23], "weights": [0.0, 1.0, 1.0]})]
    with running_server(model_dir, state_dir) as (url, _):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        original = service.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
        for _ in range(3):
            step(original, data)
        path = original.save_state("ckpt").result().path
        assert path == f"tinker://{original.model_id}/weights/ckpt"
        [folder] = list(state_dir.glob("models/*/weights/ckpt"))
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                            "optimizer.json", "optimizer.safetensors"]
        at_checkpoint = logprobs(original, data)
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        fresh_adam = service.create_training_client_from_state(path).result()
        assert resumed.get_info().lora_rank == 4
        for client in (resumed, fresh_adam):
            np.testing.assert_array_equal(logprobs(client, data), at_checkpoint)
        for client in (original, resumed, fresh_adam):
            step(client, data)
        after_step = logprobs(original, data)
        np.testing.assert_allclose(logprobs(resumed, data), after_step, atol=1e-6)  # Adam's moments came along
        assert np.abs(logprobs(fresh_adam, data) - after_step).max() > 1e-3  # Adam started over
        # load_state puts the checkpoint back into a client; a client of another shape refuses it
        original.load_state_with_optimizer(path).result()
        np.testing.assert_array_equal(logprobs(original, data), at_checkpoint)
        other = service.create_lora_training_client(base_model=model_dir, rank=8).result()
        with pytest.raises(tinker.RequestFailedError, match="is a rank-4 LoRA"):
            other.load_state(path).result()
        with pytest.raises(tinker.RequestFailedError, match="exists: save_state"):
            original.save_state("ckpt").result()
        assert original.save_state("ckpt", overwrite=True).result().path == path  # the same state again
        with pytest.raises(tinker.BadRequestError,
                           match=r"a sampler takes sampler_weights \(save_weights_for_sampler writes them\)"):
            service.create_sampling_client(model_path=path).result()
        service.close("success").result(timeout=30)

    with running_server(model_dir, state_dir) as (url, _):  # a new server process state: only the folder is left
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        restarted = service.create_training_client_from_state_with_optimizer(path).result()
        np.testing.assert_array_equal(logprobs(restarted, data), at_checkpoint)
        step(restarted, data)
        np.testing.assert_allclose(logprobs(restarted, data), after_step, atol=1e-6)
        service.close("success").result(timeout=30)


DATA = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10], "weights": [1.0] * 5})]


def changed_copy(folder, name: str, weights=None, optimizer=None, alpha=None) -> str:
    """A copy of the checkpoint folder beside it, its tensors changed by weights(dict) / optimizer(dict) or its
    lora_alpha set; -> its tinker path."""
    target = folder.parent / name
    shutil.copytree(folder, target)
    for change, file in [(weights, "adapter_model.safetensors"), (optimizer, "optimizer.safetensors")]:
        if change is not None:
            tensors = load_file(str(target / file))
            change(tensors)
            save_file(tensors, str(target / file))
    if alpha is not None:
        config = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}))
    return name


def test_a_state_saved_before_any_gradient_loads_and_other_shapes_are_refused(tmp_path):
    model_dir = str(build_random_model(tmp_path / "model", seed=0))
    with running_server(model_dir, tmp_path / "state") as (url, served):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        original = service.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
        original.optim_step(ADAM).result()  # an AdamW with no state yet: no gradient came
        path = original.save_state("no-gradient").result().path
        [folder] = list((tmp_path / "state").glob("models/*/weights/no-gradient"))
        assert json.loads((folder / "optimizer.json").read_text())["stepped"] is False  # a fresh AdamW, saved as one
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        for client in (original, resumed):
            step(client, DATA)
        np.testing.assert_allclose(logprobs(resumed, DATA), logprobs(original, DATA), atol=1e-6)

        path = original.save_state("ckpt").result().path
        [folder] = list((tmp_path / "state").glob("models/*/weights/ckpt"))
        first = min(load_file(str(folder / "adapter_model.safetensors")))
        cases = [
            (changed_copy(folder, "lacks", weights=lambda t: t.pop(first)), False, "lacks"),
            (changed_copy(folder, "extra", weights=lambda t: t.update({f"{first}.x": torch.zeros(1)})), False,
             "has a tensor this adapter does not"),
            (changed_copy(folder, "reshaped", weights=lambda t: t.update({first: torch.zeros(3, 3)})), False,
             "has a tensor of another shape"),
            (changed_copy(folder, "alpha", alpha=16), False, "with lora_alpha 16"),
            (changed_copy(folder, "adam-part", optimizer=lambda t: t.pop(f"{first}.step")), True, "is incomplete"),
            (changed_copy(folder, "adam-extra", optimizer=lambda t: t.update({"x.exp_avg": torch.zeros(1)})), True,
             "optimizer state for a tensor this adapter does not have"),
        ]
        before, clients = logprobs(original, DATA), len(served.worker.trainees)
        for name, with_optimizer, message in cases:
            bad = path.replace("/ckpt", f"/{name}")
            load = original.load_state_with_optimizer if with_optimizer else original.load_state
            with pytest.raises(tinker.RequestFailedError, match=message):
                load(bad).result()
            if name == "alpha":  # a new client takes the checkpoint's lora_alpha
                continue
            create = (service.create_training_client_from_state_with_optimizer if with_optimizer
                      else service.create_training_client_from_state)
            with pytest.raises(tinker.RequestFailedError, match=message):
                create(bad).result()
        np.testing.assert_array_equal(logprobs(original, DATA), before)  # nothing changed
        assert len(served.worker.trainees) == clients  # the refused new clients are gone again
        # a parameter without AdamW state (as one that never had a gradient) starts afresh; the others resume
        partial = changed_copy(folder, "adam-partial", optimizer=lambda t: [t.pop(f"{first}.{part}") for part in
                                                                              ("exp_avg", "exp_avg_sq", "step")])
        restored = service.create_training_client_from_state_with_optimizer(path.replace("/ckpt", f"/{partial}")).result()
        trainee = served.worker.trainees[restored.model_id]
        assert 0 < len(trainee.optimizer.state) == len(trainee.params) - 1
        service.close("success").result(timeout=30)


def test_saved_folders_are_swapped_whole_and_names_stay_inside(tmp_path):
    state = StateDir(tmp_path / "state")
    path = TinkerPath("session:train:0", "weights", "ckpt")
    config = LoraConfig(r=1, target_modules=["q_proj"])
    for value in (1.0, 2.0):
        state.save_adapter(path, config, {"w": torch.full((2,), value)}, "base")
    folder = state.folder(path)
    assert state.snapshot(path, "weights").weights()["w"].tolist() == [2.0, 2.0]
    assert [p.name for p in folder.parent.iterdir()] == ["ckpt"]  # no temporary or old folder left
    aside = folder.parent / ".old-ckpt"
    folder.rename(aside)  # a crash after the old folder was set aside, before the new one was renamed in
    assert state.exists(path) and state.snapshot(path, "weights").weights()["w"].tolist() == [2.0, 2.0]
    shutil.copytree(folder, aside)  # a crash after the swap, before the old one was deleted
    assert state.exists(path) and not aside.exists()
    for name in ["ckpt\n", "..", ".hidden", "a/b", ""]:
        with pytest.raises(ServeError, match="is not usable"):
            check_name(name)
    for bad in ["tinker://../weights/x", "tinker://./weights/x"]:
        with pytest.raises(ServeError, match="not usable in a path"):
            state.snapshot(parse_path(bad), "weights")


def test_a_checkpoint_saved_with_a_ttl_expires(tmp_path):
    """ttl_seconds (Tinker's range: 1 hour to 10 years) writes an expiry beside the adapter: before it the checkpoint
    loads, at it a load is a 404 that says it expired and the folder is deleted; a server started after the expiry
    deletes it on start; a checkpoint saved without one stays; a ttl outside the range is a 400."""
    now = [1_000_000.0]
    state = StateDir(tmp_path / "state", clock=lambda: now[0])
    config = LoraConfig(r=1, target_modules=["q_proj"])
    expiring, kept, other = (TinkerPath("s:train:0", "weights", n) for n in ("expiring", "kept", "other"))
    state.save_adapter(expiring, config, {"w": torch.ones(2)}, "base", ({}, {"stepped": False}), ttl_seconds=3600)
    state.save_adapter(other, config, {"w": torch.ones(2)}, "base", ttl_seconds=7200)
    state.save_adapter(kept, config, {"w": torch.ones(2)}, "base")
    now[0] += 3599
    assert state.exists(expiring) and state.snapshot(expiring, "weights").weights()["w"].tolist() == [1.0, 1.0]
    opened = state.snapshot(expiring, "weights")  # a sampling session opened before the expiry reads it lazily
    now[0] += 1
    with pytest.raises(ServeError, match=r"tinker://s:train:0/weights/expiring expired at 1970-01-12 .* UTC"):
        state.snapshot(expiring, "weights")
    assert not state.folder(expiring).exists() and not state.exists(expiring)
    with pytest.raises(ServeError, match="is gone .its ttl_seconds passed, or it was removed."):
        opened.weights()
    with pytest.raises(ServeError, match="no saved weights"):
        state.snapshot(expiring, "weights")
    restarted = StateDir(tmp_path / "state", clock=lambda: now[0] + 3600)  # past `other`'s expiry too
    assert not restarted.folder(other).exists() and restarted.snapshot(kept, "weights").config.r == 1
    model_dir = str(build_random_model(tmp_path / "model", seed=0))
    with running_server(model_dir, tmp_path / "sdk-state") as (url, served):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds=60 is outside 3600 .1 hour."):
            training.save_state("short", ttl_seconds=60).result()
        path = training.save_state("hour", ttl_seconds=3600).result().path
        sampler_path = training.save_weights_for_sampler("hour-sampler", ttl_seconds=3600).result().path
        assert len(list((tmp_path / "sdk-state").glob("models/*/*/*/expires.json"))) == 2
        service.create_training_client_from_state(path).result()  # within the hour: loads
        served.state.clock = lambda: time.time() + 3601
        with pytest.raises(tinker.NotFoundError, match="expired at"):
            service.create_training_client_from_state(path).result()
        with pytest.raises(tinker.NotFoundError, match="hour-sampler expired at"):  # the SDK opens the session
            sampler = service.create_sampling_client(model_path=sampler_path)  # with its first request
            sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
        assert list((tmp_path / "sdk-state").glob("models/*/*/*/expires.json")) == []
