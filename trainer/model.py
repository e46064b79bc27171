"""A small decoder-only transformer and its FSDP2 sharding.

``build_model`` creates the full model on every rank from the same seed (so every rank starts
from the same weights whatever the world size); ``shard_model`` applies ``fully_shard`` to each
block and then to the root, on a 1-D device mesh over all ranks ("cpu" with gloo, "cuda" with
NCCL).  The mesh is passed explicitly: on a machine with GPUs a meshless ``fully_shard`` over a
gloo group moves the model to CUDA (pytorch#132471).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig


class Block(nn.Module):
    """Pre-norm causal self-attention plus MLP, with dropout on both residual branches."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: ModelConfig, *, seed: int) -> DecoderLM:
    """The full, unsharded model; the same weights on every rank for the same seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DecoderLM(cfg)


def shard_model(model: DecoderLM, *, device_type: str, world_size: int) -> DecoderLM:
    """FSDP2: ``fully_shard`` per block, then the root, on a 1-D mesh over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the model with this config (without building it)."""
    d, v, t, n = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.n_layers
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return v * d + t * d + n * block + 2 * d + d * v
