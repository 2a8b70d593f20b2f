"""Padding: token lists to rectangular batches, and [B, T] tensors widened to a common T; the common prefix of two
token arrays. One place for what the sampler, the trainers and the reward scorers all need (no model code)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def right_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids_BT, mask_BT), padded on the right with pad_id (mask 0 there)."""
    return _padded(sequences, pad_id, left=False)


def left_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids_BT, mask_BT), padded on the left (prompts, so that every row ends at the same column)."""
    return _padded(sequences, pad_id, left=True)


def _padded(sequences: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids_BT = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            columns = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids_BT[row, columns] = torch.tensor(seq, dtype=torch.long)
            mask_BT[row, columns] = 1
    return ids_BT, mask_BT


def pad_right(values_BT: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    """[B, T] -> [B, width] (width >= T), the new columns filled with value."""
    return F.pad(values_BT, (0, width - values_BT.shape[1]), value=value)


def common_prefix_length(a_T: np.ndarray, b_T: np.ndarray) -> int:
    """How many leading tokens two token arrays share."""
    n = min(len(a_T), len(b_T))
    same = a_T[:n] == b_T[:n]
    return n if same.all() else int(same.argmin())


def position_ids_from_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift a sequence's positions."""
    return (mask_BT.long().cumsum(-1) - 1).clamp(min=0)
