"""`rlora serve`'s training state through the official tinker SDK: save_state writes the adapter and its AdamW state
(safetensors, no pickle); a client made from it, with the optimizer, continues exactly as the original does, also
on a server started afresh on the same --state-dir; without the optimizer it starts Adam over."""

import numpy as np
import pytest
import tinker
from serve_helpers import KEY, running_server
from tinker import types

from rlora.models.tiny import build_random_model

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
        with pytest.raises(tinker.BadRequestError, match="a sampler takes sampler_weights"):
            service.create_sampling_client(model_path=path).result()
        service.close("success").result(timeout=30)

    with running_server(model_dir, state_dir) as (url, _):  # a new server process state: only the folder is left
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        restarted = service.create_training_client_from_state_with_optimizer(path).result()
        np.testing.assert_array_equal(logprobs(restarted, data), at_checkpoint)
        step(restarted, data)
        np.testing.assert_allclose(logprobs(restarted, data), after_step, atol=1e-6)
        service.close("success").result(timeout=30)
