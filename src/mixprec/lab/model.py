"""A small GPT: a decoder-only transformer in the style of nanoGPT, for character-level language modelling.

Precision contract (docs/lab.md has the full table per mode):

* Parameters may be held in fp32, bf16 or fp16 (``model.to(dtype)``).
* The residual stream is fp32: the embedding tables are upcast (exactly) before the lookup, so the gradient of a
  token that occurs several times is summed in fp32 and rounded once.
* Outside autocast, every op computes in its input's dtype: a bf16/fp16 weight is upcast exactly to fp32 for the
  matmul, so on a CPU the low-precision runs cost what fp32 costs, and the weight's gradient is rounded once to
  the weight's dtype by the upcast's backward (round to nearest even, torch's cast).
* Under autocast (GPU), weights are handed to the op unchanged and autocast picks the compute dtype: matmuls and
  attention in bf16/fp16, layer norm, softmax and the loss in fp32.

Linear layers are :class:`Linear`, a subclass of ``torch.nn.Linear``, so ``mixprec.emulate.emulate_linear_layers``
can swap them for emulated ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.core.validate import check_positive_int

__all__ = ["GPT", "Embedding", "GPTConfig", "LayerNorm", "Linear"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int
    """Number of distinct tokens (characters)."""
    block_size: int
    """Context length, in tokens."""
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream, in channels."""
    dropout: float = 0.0
    """Dropout probability after attention, MLP and embeddings; 0 disables."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1); got {self.dropout!r}")


def _in_compute_dtype(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``weight`` as the op should see it: untouched under autocast (autocast casts), else in ``x``'s dtype.

    The upcast bf16/fp16 -> fp32 is exact; its backward rounds the fp32 gradient to the weight's dtype.
    """
    if weight is None or weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return weight
    return weight.to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose weights may be held in a lower precision than its input (upcast for the matmul)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _in_compute_dtype(self.weight, x), _in_compute_dtype(self.bias, x))


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose affine parameters may be held in a lower precision than its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = _in_compute_dtype(self.weight, x), _in_compute_dtype(self.bias, x)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that looks up in an fp32 copy of its table (exact upcast from bf16/fp16).

    Why: a lookup in the low-precision table would accumulate the gradients of a token that occurs several times
    in the batch in bf16/fp16, rounding at every addition; upcast first, they sum in fp32 and are rounded once.
    """

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight.float())  # (..., C) fp32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` pre-norm blocks, a final layer norm and an untied LM head.

    ``forward(idx, targets=None)`` takes int64 token ids ``(B, T)`` with ``T <= block_size`` and returns the
    logits ``(B, T, vocab_size)`` and, when ``targets`` is given, the mean cross-entropy in fp32 (nats per token).
    The head is not tied to the token embedding (nanoGPT ties them), so that every parameter has exactly one use.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd)
        self.lm_head = Linear(config.n_embd, config.vocab_size)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream: its variance grows with depth otherwise.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.shape  # (B, T)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C), fp32 whatever the parameters' dtype
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(b * t, -1), targets.view(b * t))
        return logits, loss
