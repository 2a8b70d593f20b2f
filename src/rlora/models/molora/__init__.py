"""Mixture of LoRA experts (MoLoRA) on one frozen base (docs/molora.md), split by concern:

    routing.py    the router's input, top-k gates, the routing state the layers share, a layer's record
    layer.py      MoLoRALinear: the frozen linear layer plus N LoRA experts (the mixture math)
    model.py      a model carrying MoLoRA layers: attaching them, finding them, the routing context
    aux_loss.py   the auxiliary losses (balance, z-loss) and metrics of one forward
    batch_aux.py  a batch run as several forwards (micro-batches, ranks): RouterStats and BatchAuxLoss, the
                  one batch-wide auxiliary loss that `rlora sft` and the RL update use
    folder.py     the saved folder: save_molora, load_molora, read_molora_meta

Callers import the names below from `rlora.models.molora`; where rlora runs a model (log-prob passes, samplers,
the reference policy, the RL update's batch) is models/molora_runtime.py."""

from rlora.config import MoLoRAConfig  # the settings: one definition, the YAML config's `molora:` section
from rlora.models.molora.aux_loss import (
    AuxLosses, balance_loss, collect_aux_losses, expert_utilisation, last_records, router_entropy, router_metrics,
    unit_mask, unit_weights, z_loss,
)
from rlora.models.molora.batch_aux import BatchAuxLoss, RouterStats, SumOverRanks, batch_aux_losses
from rlora.models.molora.folder import (
    CONFIG_FILE, FORMAT, VERSION, WEIGHTS_FILE, expected_shapes, load_molora, read_molora_meta, save_molora,
)
from rlora.models.molora.layer import PARAM_TAG, MoLoRALinear, mixture_delta
from rlora.models.molora.model import (
    attach_modules, attach_molora, aux_losses_on, check_bare, check_molora_targets, has_molora, molora_disabled, molora_modules,
    prompt_summary, prompt_summary_padded, routing_from_prompts, routing_state, sequence_routed, sequence_routing,
    set_sequence_routing, target_names,
)
from rlora.models.molora.routing import RMS_EPS, RouterRecord, RoutingState, rms_normalize, route

__all__ = [  # sorted: constants, classes, functions
    "CONFIG_FILE", "FORMAT", "PARAM_TAG", "RMS_EPS", "VERSION", "WEIGHTS_FILE",
    "AuxLosses", "BatchAuxLoss", "MoLoRAConfig", "MoLoRALinear", "RouterRecord", "RouterStats", "RoutingState",
    "SumOverRanks",
    "attach_modules", "attach_molora", "aux_losses_on", "balance_loss", "batch_aux_losses", "check_bare",
    "check_molora_targets",
    "collect_aux_losses", "expected_shapes", "expert_utilisation", "has_molora", "last_records", "load_molora",
    "mixture_delta", "molora_disabled", "molora_modules", "prompt_summary", "prompt_summary_padded",
    "read_molora_meta", "rms_normalize", "route", "router_entropy", "router_metrics", "routing_from_prompts",
    "routing_state", "save_molora", "sequence_routed", "sequence_routing", "set_sequence_routing", "target_names",
    "unit_mask", "unit_weights", "z_loss",
]
