"""A learned absolute position embedding that fails fast and extends with the same strategies.

Examples:
    >>> pe = LearnedPositionalEmbedding(d_model=64, max_len=512)
    >>> x = torch.zeros(8, 100, 64)
    >>> pe(x).shape                      # x + P[0:100]
    torch.Size([8, 100, 64])
    >>> pe(x, offset=400).shape          # x + P[400:500] (a KV-cache continuation)
    torch.Size([8, 100, 64])
    >>> longer = pe.extend(2048, "interpolate")
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posextend.tables.strategies import resize_table


class LearnedPositionalEmbedding(nn.Module):
    """``x + P[positions]`` (then dropout) for ``x`` of shape ``(L, D)`` or ``(N, L, D)``.

    - ``position_ids=None``: the rows ``offset .. offset+L-1``, taken as a slice (no gather).
    - ``position_ids`` of shape ``(L,)`` or ``(N, L)``: those rows, looked up.

    Never clamps or wraps: a position outside ``[0, max_len)`` raises ``ValueError``.
    The table is initialised N(0, ``init_std``).
    """

    def __init__(self, d_model: int, max_len: int, dropout: float = 0.0, *, init_std: float = 0.02):
        super().__init__()
        for name, value in (("d_model", d_model), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model, self.max_len, self.init_std = d_model, max_len, init_std
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=init_std)
        self.dropout = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"

    def positions(self, length: int, offset: int = 0, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The position rows for ``length`` tokens: ``(L, D)``, or ``(N, L, D)`` for 2-D ids."""
        if position_ids is None:
            if not isinstance(offset, int) or offset < 0:
                raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
            if offset + length > self.max_len:
                raise ValueError(
                    f"positions {offset}..{offset + length - 1} exceed max_len={self.max_len} "
                    f"(offset {offset} + length {length}); extend the table with .extend()"
                )
            return self.weight[offset : offset + length]
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
        if position_ids.dim() not in (1, 2) or position_ids.shape[-1] != length:
            raise ValueError(
                f"position_ids must have shape ({length},) or (N, {length}), got {tuple(position_ids.shape)}"
            )
        if position_ids.numel():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= self.max_len:
                bad = lo if lo < 0 else hi
                raise ValueError(f"position id {bad} is out of range [0, {self.max_len})")
        return F.embedding(position_ids, self.weight)

    def forward(self, x: torch.Tensor, offset: int = 0, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() not in (2, 3):
            raise ValueError(f"x must be 2-D (L, D) or 3-D (N, L, D), got {x.dim()}-D shape {tuple(x.shape)}")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x's last dimension is {x.shape[-1]}, expected d_model={self.d_model}")
        pos = self.positions(x.shape[-2], offset, position_ids)
        if position_ids is not None and position_ids.dim() == 2:
            if x.dim() == 2:
                raise ValueError("position_ids of shape (N, L) need a batched x of shape (N, L, D)")
            if position_ids.shape[0] not in (1, x.shape[0]):
                raise ValueError(f"position_ids batch {position_ids.shape[0]} does not match x's batch {x.shape[0]}")
        return self.dropout(x + pos.to(x.dtype))

    def extend(self, new_len: int, strategy: str = "tile", *, seed: int | None = None, **params: Any):
        """A new module with ``new_len`` positions, filled by a registered strategy."""
        new = LearnedPositionalEmbedding(self.d_model, new_len, self.dropout.p, init_std=self.init_std)
        table = resize_table(
            self.weight, new_len, strategy, seed=seed, params=params, context={"initializer_range": self.init_std}
        )
        with torch.no_grad():
            new.weight.copy_(table)
        return new.to(self.weight.device)


class TokenAndPositionEmbedding(nn.Module):
    """Token + position (+ token-type) embeddings, then (LayerNorm and) dropout.

    GPT style: ``TokenAndPositionEmbedding(vocab, d, max_len)``.
    BERT style: ``TokenAndPositionEmbedding(vocab, d, max_len, type_vocab_size=2, layer_norm=True)``.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        max_len: int,
        *,
        type_vocab_size: int = 0,
        layer_norm: bool = False,
        dropout: float = 0.0,
        padding_idx: int | None = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        nn.init.normal_(self.tokens.weight, std=init_std)
        if padding_idx is not None:
            with torch.no_grad():
                self.tokens.weight[padding_idx].zero_()
        self.positions = LearnedPositionalEmbedding(d_model, max_len, init_std=init_std)
        self.token_types = nn.Embedding(type_vocab_size, d_model) if type_vocab_size else None
        if self.token_types is not None:
            nn.init.normal_(self.token_types.weight, std=init_std)
        self.norm = nn.LayerNorm(d_model) if layer_norm else None
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        offset: int = 0,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.positions(self.tokens(input_ids), offset, position_ids)
        if token_type_ids is not None:
            if self.token_types is None:
                raise ValueError("token_type_ids given, but this block was built with type_vocab_size=0")
            x = x + self.token_types(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)

    def extend(self, new_len: int, strategy: str = "tile", **kwargs: Any) -> TokenAndPositionEmbedding:
        """Replace the position table with a ``new_len`` one (in place); returns self."""
        self.positions = self.positions.extend(new_len, strategy, **kwargs)
        return self
