"""The config roots of `rlora sft` and `rlora rm` and their own sections; model, lora, molora and the optimizer
keys are `rlora train`'s (config/schema.py)."""

from __future__ import annotations

from pydantic import Field

from rlora.config.schema import LoraConfig, ModelConfig, MoLoRAConfig, OptimizerConfig, ResumableConfig, Section


# ---- rlora sft -----------------------------------------------------------------------------------------

class SFTDataConfig(Section):
    """Supervised rows: prompt/completion columns, or a column of chat messages (docs/sft.md)."""

    path: str = Field(description="Local json/jsonl/parquet/csv file of training rows")
    eval_path: str | None = Field(None, description="Local held-out file (same columns as path)")
    prompt_column: str = Field("prompt", description="Prompt text (or a list of chat messages) of a row")
    completion_column: str = Field("completion", description="Target text; the loss covers its tokens only")
    messages_column: str | None = Field(
        None, description="Chat rows instead of prompt/completion: a list of {role, content}; the loss covers every "
        "assistant turn (needs a tokenizer with a chat template)")
    system_prompt: str | None = Field(None, description="Added as the first message where a row has none")
    use_chat_template: bool = Field(True, description="Wrap prompt/completion rows with the tokenizer's chat template")
    eval_size: int = Field(0, ge=0, description="Without eval_path: rows held out from path, drawn with seed (0: no "
                           "eval); with eval_path: the first eval_size rows of it (0: all)")
    seed: int = Field(0, description="Seed of the held-out draw")


class SFTTrainConfig(ResumableConfig):
    steps: int | None = Field(None, gt=0, description="Optimizer steps (null: train.epochs, or 20 without it)")
    epochs: float | None = Field(
        None, gt=0, description="Train this many passes over the rows instead of train.steps (leave steps unset)")
    batch_size: int = Field(8, gt=0, description="Rows per optimizer step")
    micro_batch_size: int = Field(8, gt=0, description="Rows per forward/backward pass (divides batch_size)")
    max_length: int = Field(
        1024, gt=1, description="Tokens per row: longer rows are cut at the end (counted in summary.json "
        "truncated_rows); a row left with no completion token is dropped (dropped_rows)")
    group_window: int = Field(
        16, ge=1, description="Length grouping: after each epoch's seeded shuffle, every window of this many batches "
        "is sorted by length (1: batches of similar length only by chance)")
    eval_every: int = Field(0, ge=0, description="eval_loss every N steps (0: only at the end)")
    full_finetune: bool = Field(
        False, description="Train every parameter instead of a LoRA adapter (models up to 1B parameters); saves "
        "OUTPUT/model, a transformers folder with the tokenizer")


class _SupervisedRoot(Section):
    """The sections `rlora sft` and `rlora rm` configs share with `rlora train`'s."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)


class SFTConfig(_SupervisedRoot):
    """Root of a `rlora sft` config."""

    data: SFTDataConfig
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig)
    molora: MoLoRAConfig | None = Field(
        None, description="Train a mixture of LoRA experts (docs/molora.md) instead of the lora adapter; every "
        "lora.* key must then keep its default (null: plain LoRA)")


class RMDataConfig(Section):
    """Preference pairs: a prompt, a chosen and a rejected response per row (docs/reward_models.md)."""

    path: str = Field(description="Local json/jsonl/parquet/csv file of preference rows")
    eval_path: str | None = Field(None, description="Local held-out file (same columns as path)")
    prompt_column: str = Field("prompt", description="Prompt text (or a list of chat messages) of a row")
    chosen_column: str = Field("chosen", description="The preferred response (text)")
    rejected_column: str = Field("rejected", description="The other response (text)")
    margin_column: str | None = Field(
        None, description="Optional per-pair margin m (a number): loss -log sigmoid(r_chosen - r_rejected - m)")
    system_prompt: str | None = Field(None, description="Added as the first message where a row has none")
    use_chat_template: bool = Field(True, description="Render prompt + response as a conversation whose last turn "
                                    "is the assistant's (else plain text: the prompt's tokens, then the response's and EOS)")
    eval_size: int = Field(0, ge=0, description="Without eval_path: pairs held out from path, drawn with seed (0: no "
                           "eval); with eval_path: the first eval_size pairs of it (0: all)")
    seed: int = Field(0, description="Seed of the held-out draw")


class RMTrainConfig(ResumableConfig):
    batch_size: int = Field(8, gt=0, description="Preference pairs per optimizer step")
    micro_batch_size: int = Field(8, gt=0, description="Pairs per forward/backward pass (divides batch_size)")
    max_length: int = Field(
        1024, gt=1, description="Tokens per sequence (prompt + response): the prompt is cut from its start (left) "
        "to fit (truncated_pairs in summary.json); a pair whose response alone does not fit is dropped "
        "(dropped_pairs)")
    margin: float = Field(0.0, description="Margin m of every pair, added to data.margin_column's: -log sigmoid(r_c - r_r - m)")
    eval_every: int = Field(0, ge=0, description="eval_loss / eval_accuracy every N steps (0: only at the end)")
    head_init_std: float = Field(0.0, ge=0, description="Normal std of the score head's initial weight (0: zeros)")


class RMConfig(_SupervisedRoot):
    """Root of a `rlora rm` config."""

    data: RMDataConfig
    train: RMTrainConfig = Field(default_factory=RMTrainConfig)
