"""Transformer language-modelling recipe: a small decoder-only (GPT-style) transformer on Penn Treebank.

The workload most users train today: a causal transformer with AdamW, a linear learning-rate
warm-up and cosine decay, and bf16 autocast where the accelerator has it (``trainer.precision:
bf16-mixed`` in the GPU config). Data: the word-level PTB files through
:class:`lightning_dgc_recipes.language.PTBDataModule`, the same windows as the LSTM recipe; each BPTT window is an
independent sequence (no state is carried from one window to the next), so a token's context is
the tokens before it in its window.

Model: token and learned positional embeddings, pre-LayerNorm blocks (causal self-attention through
``scaled_dot_product_attention(is_causal=True)``, then a GELU MLP, each around a residual), a final
LayerNorm and an output layer tied to the token embedding. GPT-2's initialisation (normal, std 0.02;
residual projections scaled by ``1/sqrt(2 num_layers)``).

With the compressed exchanges (README: which optimizer):

* DGC applies no momentum of its own by default (``momentum: 0``, plain error feedback), which is
  what Adam-family optimizers need: AdamW keeps its moments and weight decay. ``configs/algo/dgc.yaml``
  works unchanged; a strategy ``momentum > 0`` is refused with AdamW.
* PowerSGD leaves the optimizer alone: ``configs/algo/powersgd.yaml`` works unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from lightning_dgc_recipes.language import setup_vocabulary

__all__ = ["TransformerLanguageModel", "WarmupCosine"]


@dataclass
class WarmupCosine:
    """Learning-rate factor of optimizer step ``step``: linear warm-up, then cosine decay to a floor.

    ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps (so the first step already
    moves), then ``min_ratio + (1 - min_ratio) (1 + cos(pi p)) / 2`` with ``p`` going from 0 to 1 over
    the remaining steps up to ``total_steps``; ``min_ratio`` after that. A callable object rather than
    a lambda, so that ``LambdaLR`` saves it in checkpoints.
    """

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attention(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.ln_attention = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        # [batch, length, 3 * width] -> 3 x [batch, heads, length, head width]
        q, k, v = self.qkv(self.ln_attention(x)).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        x = x + self.residual_dropout(self.out(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.residual_dropout(self.mlp(self.ln_mlp(x)))


class TransformerLanguageModel(L.LightningModule):
    """Decoder-only transformer; cross-entropy on the next word of every position.

    Logs the LSTM recipe's metrics under the same names (``train_loss``, ``val_loss``, ``val_ppl``,
    ``test_loss``, ``test_ppl``), plus ``lr``.

    Weight decay applies to the weight matrices of the blocks only; biases, LayerNorm parameters and
    the embeddings (token, positional, and so the tied output layer) are not decayed (as in minGPT):
    decaying the embedding of a word pulls rare words towards zero on every step in which they are
    absent.

    Args:
        vocab_size: number of words; ``None`` takes it from the DataModule's ``vocab_size`` at setup.
        d_model: width of the residual stream and of the embeddings.
        num_layers: transformer blocks.
        num_heads: attention heads (must divide ``d_model``).
        mlp_ratio: hidden width of the MLP over ``d_model``.
        dropout: on the embeddings, the attention weights and each residual branch.
        max_seq_len: positions the positional embedding has; must be at least the data's ``bptt``.
        lr: peak learning rate of AdamW (reached at the end of the warm-up).
        weight_decay: AdamW's decoupled weight decay (on the weight matrices only, see above).
        betas: AdamW's moment coefficients.
        eps: AdamW's epsilon.
        warmup_fraction: warm-up length as a fraction of all optimizer steps of the run
            (``trainer.estimated_stepping_batches``); ignored when ``warmup_steps`` is set.
        warmup_steps: warm-up length in optimizer steps.
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio`` on the run's last step.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        d_model: int = 512,
        num_layers: int = 6,
        num_heads: int = 8,
        mlp_ratio: int = 4,
        dropout: float = 0.2,
        max_seq_len: int = 256,
        lr: float = 5e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_fraction: float = 0.05,
        warmup_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model}); change one of them.")
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must lie in [0, 1), got {warmup_fraction}.")
        if warmup_steps is not None and warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0 (or null to use warmup_fraction), got {warmup_steps}.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}.")
        self.save_hyperparameters()
        self.positions = nn.Embedding(max_seq_len, d_model)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, num_heads, mlp_ratio, dropout) for _ in range(num_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.embedding: nn.Embedding | None = None
        self.val_perplexity = Perplexity()
        self.test_perplexity = Perplexity()
        self._init_weights()
        if vocab_size is not None:
            self._build_vocabulary_layers(vocab_size)

    def _init_weights(self) -> None:
        """GPT-2: normal(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 layers)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for projection in (block.out, block.mlp[-1]):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * self.hparams.num_layers))

    def _build_vocabulary_layers(self, vocab_size: int) -> None:
        self.embedding = nn.Embedding(vocab_size, self.hparams.d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def setup(self, stage: str) -> None:
        """Create the token embedding once the DataModule knows the vocabulary; check the window length."""
        datamodule = setup_vocabulary(self)
        bptt = getattr(datamodule, "bptt", None)
        if bptt is not None and bptt > self.hparams.max_seq_len:
            raise ValueError(
                f"data.bptt={bptt} is longer than model.max_seq_len={self.hparams.max_seq_len}: raise"
                " model.max_seq_len to at least data.bptt."
            )

    def configure_model(self) -> None:
        """Under a strategy with a device mesh (the sharded ones, ``algo/*_hsdp``; Lightning's
        ``ModelParallelStrategy``): FSDP2 on each block, then on the rest (the embeddings, tied to the output, and
        the final LayerNorm), over ``device_mesh["data_parallel"]`` (the sharded strategies: the node's processes).
        Under the replicated strategies (DDP, ``dgc``, ...) nothing happens."""
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-word logits ``[batch, length, vocab]`` of token windows ``[batch, length]``."""
        if self.embedding is None:
            raise RuntimeError("vocab_size is unknown: pass it to the constructor or train with a DataModule.")
        length = tokens.shape[1]
        if length > self.hparams.max_seq_len:
            raise ValueError(
                f"A window of {length} tokens is longer than model.max_seq_len={self.hparams.max_seq_len};"
                " raise max_seq_len or shorten the windows (data.bptt)."
            )
        positions = torch.arange(length, device=tokens.device)
        x = self.embedding_dropout(self.embedding(tokens) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_final(x), self.embedding.weight)  # output tied to the token embedding

    def _step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        inputs, targets = batch
        logits = self(inputs).float()  # the loss and perplexity in fp32 under bf16 autocast
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        _, loss = self._step(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", loss.detach().exp(), on_step=True, on_epoch=False)
        self.log("lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, loss = self._step(batch)
        self.val_perplexity(logits, batch[1])
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", self.val_perplexity, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, loss = self._step(batch)
        self.test_perplexity(logits, batch[1])
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_ppl", self.test_perplexity)

    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW's groups: the blocks' weight matrices with weight decay, everything else without."""
        decay = [p for name, p in self.blocks.named_parameters() if p.ndim == 2 and name.endswith("weight")]
        chosen = {id(p) for p in decay}
        rest = [p for p in self.parameters() if id(p) not in chosen]
        return [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameter_groups(), lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError(
                "The cosine schedule needs the run's length: set trainer.max_steps or trainer.max_epochs."
            )
        total = int(total)
        warmup = hp.warmup_steps if hp.warmup_steps is not None else round(hp.warmup_fraction * total)
        schedule = WarmupCosine(warmup_steps=warmup, total_steps=total, min_ratio=hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
