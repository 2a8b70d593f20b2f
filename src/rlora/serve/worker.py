"""The model side of `rlora serve`: one frozen base, each training client a peft named LoRA adapter on it.

Everything here runs on the one worker thread (serve/jobs.py), in arrival order: the model is not thread-safe,
and a training client's requests must run in the order it sent them. Several clients' forward_backward requests
queued back to back run in one pass (serve/batched.py); everything else runs one request at a time.

- A training client (create_model) is an adapter `client_N` with its own rank and targets and its own AdamW.
  forward_backward accumulates gradients into it (a sum over tokens, as tinker's losses are); optim_step
  applies them with the request's Adam parameters and clears them (rlora's optimizer_step: clipping, a
  non-finite update skipped).
- A sampler samples from a snapshot of an adapter taken by save_weights_for_sampler (or from the base with
  every adapter off). Snapshots are loaded as adapters `sampler_N` when sampled, the newest few kept loaded;
  the decoder of the last one sampled (its merged weight copies) is kept for the next request (serve/sampling.py).
- A session's clients and samplers are freed when it finishes (free_session); their numbers are capped.
- Log-probs come from serve/logprobs.py (the output layer a chunk of positions at a time); sampling is rlora's
  built-in engine (transformers `generate` for the families it does not run).
"""

from __future__ import annotations

import copy
import math
import secrets
import warnings
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from rlora.models import expert_lora
from rlora.models.loading import TokenizerInfo, causal_lm
from rlora.models.named_adapters import adapter_switched, kept_flags
from rlora.rollout.decoder import DecoderView, unsupported_reason
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import HFGenerator
from rlora.serve import proto, wire
from rlora.serve.batched import forward_backward_batch
from rlora.serve.datum_rows import padded_rows, passes, target_columns, token_limit
from rlora.serve.logprobs import sequence_logprobs, unrouted
from rlora.serve.losses import LOSSES, TokenLoss
from rlora.serve.prefix_cache import DEFAULT_MB, PrefixCache
from rlora.serve.sampling import (
    Sampler, ViewGenerator, asked_of, completions, responses, sample_reusing, sampling_settings,
)
from rlora.serve.shared_prefix import MIN_SHARED, TreePass
from rlora.serve.state import ServeError, Snapshot, StateDir, TinkerPath, sampler_path
from rlora.serve.targets import ClientTargets
from rlora.serve.trainstate import Trainee, adam_state, checked_state, param_names, restore_adam
from rlora.train.optim import optimizer_step

LOADED_SAMPLERS = 4  # snapshots kept loaded as adapters
UNNAMED_SNAPSHOTS = 16  # unnamed snapshots kept in memory (an RL loop takes one per step)
IDLE_ADAPTER = "idle"  # the adapter that keeps the peft model from ever having none (_add_adapter)
MAX_TRAINEES = 64  # training clients at once (each an adapter and its AdamW state in memory)
MAX_SAMPLERS = 1024  # sampling sessions on saved snapshots or the base at once (each a config and a path)


class _NoSchedule:
    """optimizer_step advances a schedule; here each optim_step brings its own learning rate."""

    def step(self) -> None:
        pass


class ModelWorker:
    def __init__(self, base: nn.Module, tokenizer, tok: TokenizerInfo, model_path: str, max_length: int,
                 state: StateDir, prefix_cache_bytes: int = DEFAULT_MB * 2**20):
        self.base, self.model = base, base  # self.model: the base, then the PeftModel holding every adapter
        self.tokenizer, self.tok, self.model_path, self.max_length, self.state = tokenizer, tok, model_path, max_length, state
        self.vocab_size = causal_lm(base).get_output_embeddings().weight.shape[0]
        self.trainees: dict[str, Trainee] = {}
        self.samplers: dict[str, Sampler] = {}  # sampling session id -> what it samples
        self.unnamed: OrderedDict[str, None] = OrderedDict()  # sampling sessions whose snapshot is in memory
        self.loaded: OrderedDict[int, str] = OrderedDict()  # snapshot.key -> its adapter's name
        self.view: tuple[int | None, DecoderView] | None = None  # (snapshot.key, None: the base) of the last sampled
        # owns the base's weight packs on an x86 CPU (rollout/packed.py), shared by every snapshot's decoder
        self.packer = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
        self.counter = 0  # numbers adapter names: never reused, also after one is deleted
        self.max_trainees, self.max_samplers = MAX_TRAINEES, MAX_SAMPLERS
        self.engine_refusal = unsupported_reason(base, max_length)  # None: rlora's built-in sampler runs it
        self.batched_passes, self.last_batch = 0, 0  # batched forward_backward passes that ran; members of the last
        self.targets = ClientTargets(base)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)  # sampled rows' keys and values (serve/prefix_cache.py)
        self.min_shared_prefix: int | None = MIN_SHARED  # data sharing so many tokens run as trees (None: never)

    # ------------------------------------------------------------------------------------------ adapters

    def _name(self, kind: str) -> str:
        self.counter += 1
        return f"{kind}_{self.counter}"

    def _add_adapter(self, name: str, config: LoraConfig) -> None:
        self.view = None  # a decoder holds the model's modules as they were: built again after any change
        if not isinstance(self.model, PeftModel):
            # A peft model left with no adapter at all breaks (its active adapter names a deleted one): the first
            # adapter is a frozen rank-1 one with B = 0 (the base exactly) that is never deleted, on its own seed
            # so that a client's seed alone decides its adapter's initialisation.
            idle = LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=self.targets.first(),
                              bias="none", task_type="CAUSAL_LM", inference_mode=True)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.model = get_peft_model(self.base, idle, adapter_name=IDLE_ADAPTER)
        self.model.add_adapter(name, copy.deepcopy(config))
        expert_lora.install(self.model)  # a client's expert LoRA on the activations (models/expert_lora.py)
        self.model.eval()  # no dropout anywhere: the trainer's and the sampler's numbers agree

    def _delete_adapter(self, name: str) -> None:
        self.view = None
        self.prefix_cache.forget(name)  # rows a sampler adapter sampled (a reloaded snapshot gets another name)
        with warnings.catch_warnings():  # peft's note that it activated another adapter: which one is active is ours
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.model.delete_adapter(name)
        if self.model.active_adapter not in self.model.peft_config:  # peft leaves a deleted one active at times
            self.model.set_adapter(IDLE_ADAPTER, inference_mode=True)

    def room_for(self, what: str) -> None:
        """Refuses one more training client or sampling session beyond the caps (429, not retried)."""
        if what == "trainee" and len(self.trainees) >= self.max_trainees:
            raise ServeError(429, f"this server holds {self.max_trainees} training clients already: finish a session "
                                  "(ServiceClient.close) to free its clients")
        if what == "sampler" and len(self.samplers) - len(self.unnamed) >= self.max_samplers:
            raise ServeError(429, f"this server holds {self.max_samplers} sampling sessions already: finish a session "
                                  "(ServiceClient.close) to free its samplers")

    def lora_config(self, spec: wire.LoraSpec) -> LoraConfig:
        return self.targets.config(spec)

    def _new_trainee(self, model_id: str, config: LoraConfig, seed: int | None) -> Trainee:
        if model_id in self.trainees:
            raise ServeError(409, f"training client '{model_id}' exists already")
        self.room_for("trainee")
        name = self._name("client")
        with torch.random.fork_rng(devices=[]):  # the adapter's initialisation, from its seed (else a fresh one)
            torch.manual_seed(seed if seed is not None else secrets.randbits(62))
            self._add_adapter(name, config)
        params = [p for n, p in self.model.named_parameters() if f".{name}." in n and "lora_" in n]
        trainee = self.trainees[model_id] = Trainee(model_id, name, config.r, config, params,
                                                    routable=self.targets.routable(self.model, name))
        return trainee

    def create_model(self, model_id: str, spec: wire.LoraSpec) -> dict:
        self._new_trainee(model_id, self.lora_config(spec), spec.seed)
        return {"model_id": model_id, "type": "create_model"}

    def free_session(self, session_id: str) -> dict:
        """A finished session's training clients (adapters, gradients, AdamW state) and samplers go."""
        prefix = f"{session_id}:"
        for model_id in [m for m in self.trainees if m.startswith(prefix)]:
            self._delete_adapter(self.trainees.pop(model_id).peft_name)
        for sampler_id in [s for s in list(self.samplers) if s.startswith(prefix)]:
            self._drop_sampler(sampler_id)
        return {}

    def trainee(self, model_id: str) -> Trainee:
        trainee = self.trainees.get(model_id)
        if trainee is None:
            raise ServeError(404, f"unknown model_id '{model_id}' (training clients do not outlive the server: "
                                  "save_state and create_training_client_from_state carry one over)")
        return trainee

    # ------------------------------------------------------------------------------------------ training

    def token_logprobs(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor, targets_BT: torch.Tensor,
                       head_routed=unrouted) -> torch.Tensor:
        """serve/logprobs.py sequence_logprobs under the model as it is switched now."""
        return sequence_logprobs(self.model, ids_BT, mask_BT, targets_BT, head_routed)

    def check_tokens(self, tokens: list[int] | np.ndarray, what: str, positions: bool = True) -> None:
        """The ids within the vocabulary; positions: also no more of them than the model has positions."""
        if positions and len(tokens) > self.max_length:
            raise ServeError(400, f"{what}: {len(tokens)} tokens, more than the model's {self.max_length} positions")
        if len(tokens) and not 0 <= np.min(tokens) <= np.max(tokens) < self.vocab_size:
            raise ServeError(400, f"{what}: a token id outside the vocabulary (0 .. {self.vocab_size - 1})")

    def forward_backward(self, request: proto.ForwardBackward, config: dict[str, float]) -> bytes:
        trainee = self.trainee(request.model_id)
        loss = LOSSES[request.loss_fn]
        outputs: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(request.data)
        train = not request.forward_only
        # a request that fails part-way has added its first micro-batches' gradients: they are taken back
        before = [None if p.grad is None else p.grad.clone() for p in trainee.params] if train else []
        try:
            with adapter_switched(self.model, trainee.peft_name, trainable=train), torch.set_grad_enabled(train):
                total = self._forward_backward(request, config, loss, train, outputs)
        except BaseException:
            for param, grad in zip(trainee.params, before):
                param.grad = grad
            raise
        if train:
            trainee.loss_since_step += total
        return proto.forward_backward_output(outputs, {"loss:sum": total})

    def forward_backward_batch(self, requests: list[tuple[proto.ForwardBackward, dict[str, float]]]) -> list:
        """Several clients' forward_backward requests (one each) in one pass: one outcome each, its result or
        its error (serve/batched.py)."""
        return forward_backward_batch(self, requests)

    def _forward_backward(self, request: proto.ForwardBackward, config: dict[str, float], loss: TokenLoss, train: bool,
                          outputs: list[np.ndarray]) -> float:
        """Each pass's forward (and backward): a micro-batch, or a tree of data that begin alike (their shared
        prefix run once, the others in chunks of a micro-batch's size: serve/shared_prefix.py); its log-probs into
        outputs; -> the summed loss."""
        total = 0.0
        device = next(self.model.parameters()).device
        for group, shared in passes(self.model, request.data, self.min_shared_prefix):
            data = [request.data[i] for i in group]
            ids_BT, mask_BT, targets_BT, inputs = padded_rows(data, loss, max(len(d.tokens) for d in data),
                                                              self.tok.pad_id, device)
            if shared is None:
                parts = [(list(range(len(group))), self.token_logprobs(ids_BT, mask_BT, targets_BT))]
            else:
                tree = TreePass(self.model, ids_BT, mask_BT, targets_BT, shared)
                parts = tree.chunks(token_limit(device))
            for rows, logp_nT in parts:  # a tree's chunks: each one's backward before the next runs
                whole = len(rows) == len(group)  # a micro-batch, or a tree in one chunk: its rows in order
                summed = loss.summed(logp_nT, mask_BT if whole else mask_BT[rows],
                                     inputs if whole else {k: v[rows] for k, v in inputs.items()}, config)
                if train:
                    summed.backward()
                total += float(summed.detach())
                logp = logp_nT.detach().float().cpu().numpy()
                for row, i in zip(logp, (group[r] for r in rows)):
                    datum = request.data[i]
                    kept = row[:len(datum.tokens)]
                    # [n] for a datum of one target per token, [n, K] for one of K (its own columns)
                    outputs[i] = (kept if kept.ndim == 1 else kept[:, :target_columns(datum)].reshape(
                        datum.inputs["target_tokens"].shape)).copy()
            if shared is not None:
                tree.finish()
        return total

    def optim_step(self, model_id: str, adam: wire.Adam) -> dict:
        trainee = self.trainee(model_id)
        hyper = {"lr": adam.lr, "betas": adam.betas, "eps": adam.eps, "weight_decay": adam.weight_decay}
        if trainee.optimizer is None:
            trainee.optimizer = torch.optim.AdamW(trainee.params, **hyper)
        for group in trainee.optimizer.param_groups:
            group.update(hyper)
        stats = optimizer_step(trainee.params, trainee.optimizer, _NoSchedule(), adam.grad_clip_norm or None,
                               trainee.loss_since_step)
        trainee.loss_since_step = 0.0
        return {"metrics": {"grad_norm:mean": stats["grad_norm"], "skipped_update:sum": float(stats["skipped_update"]),
                            "learning_rate:mean": adam.lr}}

    # ------------------------------------------------------------------------------------------ training state

    def _adapter_tensors(self, trainee: Trainee) -> dict[str, torch.Tensor]:
        weights = get_peft_model_state_dict(self.model, adapter_name=trainee.peft_name, save_embedding_layers=False)
        return {k: v.detach().cpu().clone() for k, v in weights.items()}

    def save_state(self, model_id: str, name: str, overwrite: bool, ttl_seconds: int | None = None) -> dict:
        """save_weights (the SDK's save_state): the adapter and its AdamW state under STATE_DIR/.../weights/NAME
        (serve/trainstate.py), expiring after ttl_seconds if given."""
        trainee = self.trainee(model_id)
        path = TinkerPath(model_id, "weights", name)
        if self.state.exists(path) and not overwrite:
            raise ServeError(400, f"{path} exists: save_state(..., overwrite=True) replaces it")
        adam = adam_state(trainee, param_names(self.model, trainee))
        self.state.save_adapter(path, trainee.config, self._adapter_tensors(trainee), self.model_path, adam, ttl_seconds)
        return {"path": str(path), "type": "save_weights"}

    def load_state(self, model_id: str, path: TinkerPath, optimizer: bool, new_client: bool) -> dict:
        """load_weights: the saved adapter into the training client `model_id` (a new one made from the
        checkpoint's LoRA config: create_training_client_from_state), its gradients cleared, and its AdamW
        state restored (optimizer=True) or started afresh. Everything is checked before anything changes."""
        snapshot = self.state.snapshot(path, "weights")
        weights = snapshot.weights()
        tensors, meta = self.state.optimizer_state(path) if optimizer else ({}, {"stepped": False})
        if new_client:
            trainee = self._new_trainee(model_id, snapshot.config, seed=0)
        else:
            trainee = self.trainee(model_id)
        try:
            moments = checked_state(trainee, param_names(self.model, trainee), path, snapshot.config, weights,
                                    tensors if meta["stepped"] else None)
        except ServeError:
            if new_client:  # the client it was to become goes again
                self._delete_adapter(self.trainees.pop(model_id).peft_name)
            raise
        set_peft_model_state_dict(self.model, weights, adapter_name=trainee.peft_name)
        for param in trainee.params:
            param.grad = None
        trainee.loss_since_step, trainee.optimizer = 0.0, None
        if meta["stepped"]:
            restore_adam(trainee, meta, moments)
        return {"path": str(path), "model_id": model_id, "type": "load_weights"}

    # ------------------------------------------------------------------------------------------ snapshots

    def save_for_sampler(self, model_id: str, name: str | None, session_id: str | None,
                         ttl_seconds: int | None = None) -> dict:
        """A snapshot of the training client's adapter: a PEFT folder (named; expiring after ttl_seconds if given)
        or tensors in memory (unnamed, answered with a new sampling session's id; gone with its session)."""
        trainee = self.trainee(model_id)
        tensors = self._adapter_tensors(trainee)
        if name is not None:
            path = TinkerPath(model_id, "sampler_weights", name)
            self.state.save_adapter(path, trainee.config, tensors, self.model_path, ttl_seconds=ttl_seconds)
            return {"path": sampler_path(model_id, name), "type": "save_weights_for_sampler"}
        self.samplers[session_id] = Sampler(Snapshot(trainee.config, tensors=tensors), None)
        self.unnamed[session_id] = None
        while len(self.unnamed) > UNNAMED_SNAPSHOTS:  # the oldest unnamed snapshot goes; its session expires
            self._drop_sampler(next(iter(self.unnamed)))
        return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}

    def add_sampler(self, session_id: str, snapshot: Snapshot | None, model_path: str | None) -> None:
        self.samplers[session_id] = Sampler(snapshot, model_path)

    def _drop_sampler(self, session_id: str) -> None:
        """A sampling session goes: its entry, its snapshot's tensors, its adapter and decoder if loaded."""
        self.unnamed.pop(session_id, None)
        sampler = self.samplers.pop(session_id, None)
        if sampler is not None and sampler.snapshot is not None:
            name = self.loaded.pop(sampler.snapshot.key, None)
            if name is not None:
                self._delete_adapter(name)

    def _loaded_adapter(self, snapshot: Snapshot) -> str:
        name = self.loaded.get(snapshot.key)
        if name is not None:
            self.loaded.move_to_end(snapshot.key)
            return name
        while len(self.loaded) >= LOADED_SAMPLERS:
            _, old = self.loaded.popitem(last=False)
            self._delete_adapter(old)
        weights = snapshot.weights()
        name = self._name("sampler")
        self._add_adapter(name, snapshot.config)
        try:
            result = set_peft_model_state_dict(self.model, weights, adapter_name=name)
            wrong = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
            wrong += [k for k in getattr(result, "missing_keys", []) if f".{name}." in k]
        except RuntimeError as err:  # a tensor of another shape
            wrong = [str(err).splitlines()[-1].strip()]
        if wrong:
            self._delete_adapter(name)
            raise ServeError(400, f"the saved adapter does not fit this base model (e.g. {wrong[0]})")
        self.loaded[snapshot.key] = name
        return name

    @contextmanager
    def sampling_model(self, snapshot: Snapshot | None):
        """(The model as a sampling session on this snapshot samples: its adapter, or the base with adapters off;
        the name of the weights: the loaded adapter's, which no other load ever gets, or None for the base)."""
        if snapshot is None:
            if isinstance(self.model, PeftModel):
                with kept_flags(self.model), self.model.disable_adapter():
                    yield self.model, None
            else:
                yield self.model, None
            return
        name = self._loaded_adapter(snapshot)
        with adapter_switched(self.model, name):
            yield self.model, name

    def sampler_snapshot(self, session_id: str) -> Snapshot | None:
        if session_id not in self.samplers:
            raise ServeError(404, f"unknown or expired sampling session '{session_id}' (rlora serve keeps the "
                                  f"{UNNAMED_SNAPSHOTS} newest unnamed snapshots; named ones stay on disk)")
        return self.samplers[session_id].snapshot

    # ------------------------------------------------------------------------------------------ sampling

    def _generator(self, snapshot: Snapshot | None, model, eos_ids: list[int]):
        """The sampler for the model as sampling_model switched it. rlora's keeps the last sampled snapshot's
        decoder for the next request (an RL loop samples many prompts from one snapshot); any adapter added or
        deleted drops it. On an x86 CPU every decoder runs the base from one set of oneDNN packs, made once, with the
        snapshot's LoRA unmerged beside them; elsewhere the decoder holds the snapshot's merged weight copies (one
        copy of the model's linear layers, made again for another snapshot)."""
        if self.engine_refusal is not None:
            return HFGenerator(self.tokenizer, eos_ids, self.tok.pad_id)
        key = None if snapshot is None else snapshot.key
        if self.view is None or self.view[0] != key:
            self.view = None  # the old copy goes before the new one is made
            self.view = (key, DecoderView.of(model, merge=True, packs=self.packer.packs_for(model)))
        return ViewGenerator(self.view[1], self.tokenizer, eos_ids, self.tok.pad_id, merge=True, dtype=None,
                             decode="auto")

    def sample(self, session_id: str, requests: list[wire.Sample]) -> list[bytes]:
        """Sampling requests of one session, with one num_samples and one set of ending tokens (app.py batches
        only such), in one sampler call. Each prompt keeps its own settings and seed and the key 0 it has alone:
        rlora's samplers (the engine, and generate through rollout/generate_draw.py) draw a row's tokens from (seed,
        key, sample index) only, so a request samples what it samples alone (tested). A prompt that begins with
        tokens a row sampled before from the same weights holds runs only the rest (serve/prefix_cache.py). One result
        each."""
        settings = [sampling_settings(r.sampling_params, self.tok.eos_ids) for r in requests]
        prompts = [r.prompt.tokens() for r in requests]
        G = requests[0].num_samples
        snapshot = self.sampler_snapshot(session_id)  # read once: app.py may replace a session's entry meanwhile
        with self.sampling_model(snapshot) as (model, weights):
            generator = self._generator(snapshot, model, settings[0][1])
            per_prompt = [params for params, _, _ in settings]
            seed = [seed for _, _, seed in settings] if len(requests) > 1 else settings[0][2]
            if self.prefix_cache.enabled and isinstance(generator, BuiltinGenerator):
                rollout = sample_reusing(self.prefix_cache, weights, generator, model, prompts, G, per_prompt, seed,
                                         keys=[0] * len(requests))
            else:  # transformers generate continues no row
                rollout = generator.sample(model, prompts, G, per_prompt, seed=seed, keys=[0] * len(requests))
            logp_BT = rollout.sampling_logp_BTc
            samples = completions(rollout)
            asked = [asked_of(model, r, p, params, seed, samples[i * G:(i + 1) * G], self.vocab_size,
                              self._prompt_logprobs)
                     for i, (r, p, (params, _, seed)) in enumerate(zip(requests, prompts, settings))]
        return responses(rollout, logp_BT, G, asked)

    @torch.no_grad()
    def _prompt_logprobs(self, model, prompt: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) for i >= 1; NaN at 0, where nothing precedes the token."""
        if len(prompt) < 2:
            return [math.nan] * len(prompt)
        device = next(model.parameters()).device
        ids = torch.tensor([prompt[:-1]], device=device)
        logp = self.token_logprobs(ids, torch.ones_like(ids), torch.tensor([prompt[1:]], device=device))
        return [math.nan] + logp[0].float().cpu().tolist()
