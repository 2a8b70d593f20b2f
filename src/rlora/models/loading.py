"""Load a base causal LM and its tokenizer; attach, load and save LoRA adapters (through peft)."""

from __future__ import annotations

import difflib
import functools
import json
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from huggingface_hub import constants, try_to_load_from_cache
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedTokenizerBase

from rlora.config import LoraConfig, ModelConfig
from rlora.errors import UserError, first_line
from rlora.models.dropouts import base_dropouts
from rlora.models import expert_lora
from rlora.models.embedded import ALIASES, resolve_alias
from rlora.models.sparse_blocks import check_all_linear_on_layers, check_layers_kept

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def looks_like_local_path(name: str) -> bool:
    """A hub id is 'org/name'; anything absolute, relative-dotted, ~-prefixed or deeper is a local path."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).exists()


def resolve_model_path(name: str, option: str = "model.path", download: bool = True) -> str:
    """Built-in alias -> cached folder; existing local folder -> itself; else a hub id (in the local Hugging Face
    cache, or with the hub reachable). Anything else is refused now: handed to the hub offline, a typo costs a
    minute of huggingface_hub retries before a generic error. option: what the user set, for the messages;
    download=False (rlora serve): a hub id only from the cache, its snapshot folder."""
    alias_folder = resolve_alias(name)
    if alias_folder is not None:
        return alias_folder
    # 'mymodels/qwen' with mymodels/ here is a mistyped local path, not the hub id of an org 'mymodels'
    if looks_like_local_path(name) or Path(name.split("/")[0]).expanduser().is_dir():
        folder = Path(name).expanduser()
        if not folder.exists():
            raise UserError(f"{option} '{name}' not found{_close_entries(folder)}")
        if not (folder / "config.json").is_file():
            raise UserError(f"{option} '{name}' is not a Hugging Face model folder (no config.json there)")
        return str(folder)
    if "/" not in name:  # a hub id is always 'org/name'
        close = difflib.get_close_matches(name.lower(), ALIASES, n=1, cutoff=0.6)
        hint = f": did you mean '{close[0]}'?" if close else ": give a model folder, an alias or a hub id 'org/name'"
        raise UserError(f"{option} '{name}' is not a local folder or a built-in alias ({', '.join(ALIASES)}){hint}")
    if not download:
        cached = cached_hub_folder(name, option)
        if cached is None:
            raise UserError(f"{option} '{name}' is not a local folder, a built-in alias ({', '.join(ALIASES)}) or a "
                            "hub id in the local Hugging Face cache (nothing is downloaded here): give a model folder")
        return cached
    return _hub_model(name, option)


def _close_entries(folder: Path) -> str:
    """': close entries in PARENT: ...' for a path that does not exist, where its folder holds look-alikes."""
    parent = folder.parent
    try:
        entries = [entry.name for entry in parent.iterdir()] if parent.is_dir() else []
    except OSError:
        return ""
    close = difflib.get_close_matches(folder.name, entries, n=3, cutoff=0.6)
    return f" (close entries in {parent}/: {', '.join(close)})" if close else ""


def _hub_model(name: str, option: str) -> str:
    """A hub id: itself where it can load (cached, or the hub reachable to fetch or update it); the cached snapshot
    folder when the hub is not reachable (a hub id makes transformers retry the network first)."""
    cached = cached_hub_folder(name, option)
    offline = constants.is_offline_mode()
    if cached is not None:
        return cached if offline or not hub_reachable() else name
    if offline or not hub_reachable():
        host = urlparse(constants.ENDPOINT).hostname
        why = "HF_HUB_OFFLINE is set" if offline else f"{host} is not reachable"
        raise UserError(f"{option} '{name}' is not a local folder, not a built-in alias ({', '.join(ALIASES)}), not in "
                        f"the local Hugging Face cache, and {why}: give a local model folder")
    return name


def cached_hub_folder(name: str, option: str = "model.path") -> str | None:
    """The local Hugging Face cache's snapshot folder of hub id `name` (where its config.json is), else None."""
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError as err:  # HFValidationError: not a valid repo id ('a b/c', '-x/y', ...)
        raise UserError(f"{option} '{name}' is not a local folder or a valid hub id ({first_line(err)})") from None
    return str(Path(cached).parent) if isinstance(cached, str) else None


@functools.lru_cache(maxsize=1)  # a run resolves its model more than once: one probe per process
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub (HF_ENDPOINT) opens within timeout_s. In a thread: name resolution
    has no timeout of its own and can hang where there is no network."""
    url = urlparse(constants.ENDPOINT)
    address = (url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443))
    opened = threading.Event()

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            opened.set()
        except OSError:
            pass

    threading.Thread(target=probe, daemon=True).start()
    return opened.wait(timeout_s)


@dataclass
class TokenizerInfo:
    eos_ids: list[int]  # tokens that end a completion
    pad_id: int


def load_tokenizer(path: str, trust_remote_code: bool = False) -> tuple[PreTrainedTokenizerBase, TokenizerInfo]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any loader failure is a bad model path for the user
        raise UserError(f"could not load the tokenizer of '{path}': {first_line(err)}") from None
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError(f"the tokenizer of '{path}' has no eos_token: set one in its tokenizer_config.json")
    eos_ids = [eos]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return tokenizer, TokenizerInfo(eos_ids=eos_ids, pad_id=pad_id)


def add_model_eos_ids(tok: TokenizerInfo, model: torch.nn.Module) -> None:
    """Chat models often end turns with ids listed only in generation_config (e.g. Llama-3's eot_id)."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for eos in [extra] if isinstance(extra, int) else (extra or []):
        if eos not in tok.eos_ids:
            tok.eos_ids.append(eos)


def quantization_config(cfg: ModelConfig):
    """bitsandbytes settings for a quantized frozen base (None: not quantized). NF4 with double
    quantization for 4-bit; matmuls run in model.dtype."""
    if cfg.quantization == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401 - optional extra [quant]
    except ImportError:
        raise UserError(f"model.quantization={cfg.quantization} needs bitsandbytes: pip install bitsandbytes "
                        "(GPU machines), or set model.quantization=none") from None
    if cfg.quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=DTYPES[cfg.dtype])
    return BitsAndBytesConfig(load_in_8bit=True)


def resolve_device(name: str) -> torch.device:
    """model.device -> a torch device. 'auto' is the current GPU when torch sees one (under torchrun:
    the rank's LOCAL_RANK GPU, set by init_world), else the CPU. Asking for a GPU that is not there is an
    error, not a silent fall-back to a run 100x slower."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"model.device={name} but torch sees no GPU (torch {torch.__version__}): install a CUDA "
                            "build of torch, or set model.device=cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()  # torchrun: LOCAL_RANK
        if index >= torch.cuda.device_count():
            raise UserError(f"model.device={name} but torch sees {torch.cuda.device_count()} GPU(s): use cuda:0 .. "
                            f"cuda:{torch.cuda.device_count() - 1}")
        return torch.device("cuda", index)
    return device


def load_base_model(cfg: ModelConfig, path: str, place: bool = True, no_dropout: bool = False,
                    trains: bool = True) -> torch.nn.Module:
    """The frozen base on model.device (a quantized base is placed there by bitsandbytes while loading);
    place=False leaves an unquantized base on the CPU (train.fsdp moves it layer by layer as it shards it).
    no_dropout: the config's dropout rates set to 0 before the modules are built (they read them once, at
    construction, some as nn.Dropout modules, some as a rate for a functional dropout), then every nn.Dropout too.
    trains=False (`rlora eval`): nothing will take a gradient through it, so a 4-bit base may use bitsandbytes'
    faster CPU inference kernel (below)."""
    quantization = quantization_config(cfg)
    device = resolve_device(cfg.device)
    try:
        settings = {}
        if no_dropout:
            config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
            for key in base_dropouts(path, cfg.trust_remote_code):
                setattr(config.get_text_config(), key, 0.0)
            settings["config"] = config
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code, **settings,
            **({"quantization_config": quantization, "device_map": {"": device}} if quantization is not None else {}),
        )
    except Exception as err:  # noqa: BLE001
        raise UserError(f"could not load the model '{path}': {first_line(err)}") from None
    if quantization is None and place:
        model.to(device)
    model.requires_grad_(False)
    for module in model.modules() if quantization is not None and trains else ():
        # bitsandbytes (0.50) repacks a 4-bit layer's weight in place for its CPU inference kernel at the first
        # no-grad eval forward on a CPU with AVX512-BF16, and that kernel has no backward: every later training pass
        # would get wrong adapter gradients (measured: up to 0.85 against a largest gradient of 1.18). Kept unpacked.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    for module in model.modules() if no_dropout else ():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def max_positions(path: str, trust_remote_code: bool = False) -> int | None:
    """The model config's max_position_embeddings (None where it states none), read without loading the weights."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    return getattr(config, "max_position_embeddings", None)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def linear_module_names(base: torch.nn.Module, within: str = ".layers.") -> list[str]:
    """Names of the linear layers inside the decoder layers (what peft's 'all-linear' selects there); within:
    a narrower part of their path, e.g. '.self_attn.' for the attention projections only."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in base.named_modules()
                   if isinstance(module, torch.nn.Linear) and ".layers." in name and within in name})


def _check_target_names(targets: list[str], base: torch.nn.Module) -> None:
    """peft matches a listed name against the end of each module's path; one that matches nothing is a typo, and
    peft's own error does not say what the model has."""
    paths = [name for name, _ in base.named_modules()]
    missing = [t for t in targets if not any(p == t or p.endswith(f".{t}") for p in paths)]
    if missing:
        # models whose layers are not under `.layers.` (GPT-2's transformer.h.N): name their leaf modules instead
        names, what = linear_module_names(base), "the linear layers of its decoder layers"
        if not names:
            names, what = sorted({p.rpartition(".")[2] for p, m in base.named_modules()
                                  if p and not any(True for _ in m.children())}), "its leaf modules"
        raise UserError(f"lora.target_modules {missing} match no module of this model: choose from "
                        f"{', '.join(names)} ({what}) or set lora.target_modules=all-linear")


# rotary types whose frequencies transformers chooses from the longest position of each call (dynamic_rope_update)
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")


def rope_parameter_sets(config) -> list[dict]:
    """The config's rotary parameters: one set per layer type (Gemma 3, OLMo 3), or the one set of every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [params] if isinstance(params, dict) else []


def reachable_window(config, window: int | None) -> int | None:
    """`window` where some sequence of the model can be longer, else None: a window at least the model's positions
    (Phi-3.5/4-mini's 262144 on 131072) never applies."""
    positions = getattr(config, "max_position_embeddings", None)
    return window if window and (positions is None or window < positions) else None


def rope_switch_length(config) -> int | None:
    """The length from which a length-dependent rotary scaling (LENGTH_DEPENDENT_ROPE) may use other frequencies
    than its original ones (None: no such scaling). Calls whose positions all stay below it compute with the original
    frequencies, whatever their batch: longrope switches to its long factors past its original length, dynamic
    scaling grows past it and resets below it."""
    limits = [min(params.get("original_max_position_embeddings") or config.max_position_embeddings,
                  config.max_position_embeddings)
              for params in rope_parameter_sets(config) if params.get("rope_type") in LENGTH_DEPENDENT_ROPE]
    return min(limits) if limits else None


def activation_checkpointing(hf_model: torch.nn.Module) -> bool:
    """Whether gradient checkpointing is on (transformers 5's is_activation_checkpointing; is_gradient_checkpointing,
    its deprecated alias, in earlier versions)."""
    if isinstance(getattr(type(hf_model), "is_activation_checkpointing", None), property):
        return bool(hf_model.is_activation_checkpointing)
    return bool(getattr(hf_model, "is_gradient_checkpointing", False))


def skeleton(path: str, trust_remote_code: bool = False) -> torch.nn.Module | None:
    """The model's modules built from its config on the meta device: its module names and types without reading or
    allocating a weight (a tenth of a second, where loading takes seconds to minutes). None where a model cannot be
    built so (custom code that computes on its weights as it builds): the checks that use it then run after loading,
    on the loaded model, as they always do."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - loading says what is wrong with such a model, with its own message
        return None


def check_lora_targets(cfg: LoraConfig, path: str, trust_remote_code: bool = False) -> None:
    """lora.target_modules naming no module of the model, refused before its weights load (as attach_lora would
    after); all-linear needs no check."""
    bare = skeleton(path, trust_remote_code) if isinstance(cfg.target_modules, list) else None
    if bare is not None:
        _check_target_names(cfg.target_modules, bare)


def peft_lora_config(cfg: LoraConfig, base: torch.nn.Module):
    layers, targets = cfg.layers, cfg.target_modules
    if cfg.top_layers is not None:
        num_layers = causal_lm(base).config.num_hidden_layers
        if cfg.top_layers > num_layers:
            raise UserError(f"lora.top_layers={cfg.top_layers} exceeds the model's {num_layers} decoder layers")
        layers = list(range(num_layers - cfg.top_layers, num_layers))
    if layers is not None and targets == "all-linear":  # peft takes layer indices only with explicit names
        check_all_linear_on_layers(base)
        targets = linear_module_names(base)
    elif isinstance(targets, list):
        _check_target_names(targets, base)
    return PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
        layers_to_transform=layers, use_rslora=cfg.use_rslora, bias="none", task_type="CAUSAL_LM",
    )


# what marks a folder of rlora rm / a PPO run's critic: a LoRA with a scoring head, not a policy
_SCORING_ADAPTERS = {"reward_model.json": "reward model", "value_model.json": "value model"}


def _check_role(path: Path, key: str, command: str | None = None) -> None:
    """A reward or value model where a policy adapter is expected loads without its head and is silently a policy
    (chat, merge, lora.init_from took one): refuse it, except where that kind of model is what `key` asks for."""
    role = next((role for name, role in _SCORING_ADAPTERS.items() if (path / name).is_file()), None)
    if role is not None and role != key:
        if command == "rm":  # lora.init_from of `rlora rm`: its LoRA under a new head would not continue it
            use = (f"rlora rm starts a new score head, so it cannot continue a {role}: start from a policy or SFT "
                   "adapter, or set lora.init_from=null")
        elif role == "reward model":
            use = f"score with it through `rewards: [{{fn: reward_model, args: {{path: {path}}}}}]`"
        else:
            use = "it is the critic of a PPO run; its policy is the adapter/ beside it"
        raise UserError(f"{key} '{path}' is a {role} (it holds {role.replace(' ', '_')}.json), not a policy adapter: "
                        f"{use}")


def check_adapter_folder(folder: str, key: str = "lora.init_from", command: str | None = None) -> None:
    """A PEFT adapter folder that `key` may load (command: the one whose config names it, for its hints)."""
    path = Path(folder)
    if not path.exists():  # a typo, or a run that has not written its adapter yet: say that, not "not an adapter"
        hint = ": train that run first (e.g. the SFT warm-up a config names), or set lora.init_from=null to start " \
               "from a fresh adapter" if key == "lora.init_from" else ""
        raise UserError(f"{key} '{folder}' not found{hint}")
    # the run folder of rlora train/sft (adapter/; several policies: policies/NAME/adapter/) or rlora rm
    inside = sorted(p.parent for p in [*path.glob("adapter/*_config.json"), *path.glob("reward_model/*_config.json"),
                                       *path.glob("policies/*/adapter/*_config.json")])
    if inside and not (path / "adapter_config.json").is_file():
        _check_role(inside[0], key, command)
        raise UserError(f"{key} '{folder}' is a run folder: give the adapter inside it, '{inside[0]}'")
    _check_role(path, key, command)
    if not (path / "adapter_config.json").is_file():
        raise UserError(f"{key} '{folder}' is not a PEFT adapter folder (no adapter_config.json)")
    try:
        json.loads((path / "adapter_config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{folder}/adapter_config.json is not valid JSON") from None
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        try:
            with safe_open(str(weights), framework="pt") as handle:
                for key in handle.keys():  # reading every tensor catches a file cut short
                    handle.get_tensor(key)
        except Exception as err:  # noqa: BLE001 - header or data unreadable
            raise UserError(f"{weights} is damaged (truncated or not safetensors): {first_line(err)}") from None


def read_format_file(folder: str | Path, filename: str, fmt: str, what: str, hint: str = "") -> tuple[Path, dict]:
    """(path, contents) of the JSON description `filename` that rlora writes into its own folder formats
    (reward models, MoLoRA adapters), checked: present, valid JSON, and tagged {"format": fmt}. Else a
    one-line UserError naming `what` the folder should be."""
    meta_path = Path(folder) / filename
    if not meta_path.is_file():
        raise UserError(f"'{folder}' is not a {what} folder (no {filename}{hint})")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{meta_path} is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise UserError(f"{meta_path} is not an rlora {what} description (format != {fmt})")
    return meta_path, meta


def attach_lora(base: torch.nn.Module, cfg: LoraConfig):
    """Wrap the frozen base with a trainable LoRA adapter named 'default' (new, or loaded from a folder)."""
    if cfg.init_from:
        check_adapter_folder(cfg.init_from)
        try:
            model = PeftModel.from_pretrained(base, cfg.init_from, is_trainable=True)
        except Exception as err:  # noqa: BLE001 - shape/name mismatch with this base, broken weights ...
            raise UserError(
                f"adapter '{cfg.init_from}' does not fit model: {first_line(err)}"
            ) from None
        expert_lora.install(model)
        return model
    try:
        config = peft_lora_config(cfg, base)
        model = get_peft_model(base, config)
    except ValueError as err:
        raise UserError(f"LoRA config does not fit the model: {first_line(err)}") from None
    check_layers_kept(model, config.layers_to_transform)
    expert_lora.install(model)
    return model


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face *ForCausalLM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def save_adapter(model, folder: Path, adapter_name: str = "default") -> None:
    """PEFT format: adapter_config.json + adapter_model.safetensors in `folder` (the caller makes it atomic).
    Only the named adapter: peft would write other adapters on the same base (a reward adapter) into
    subfolders."""
    model.save_pretrained(str(folder), safe_serialization=True, selected_adapters=[adapter_name])
