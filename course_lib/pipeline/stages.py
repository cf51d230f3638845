"""A small language model cut into pipeline stages (流水线阶段) between its blocks.

The model: token + position embedding -> ``num_layers`` pre-LayerNorm residual
MLP blocks (``x + W2 gelu(W1 LN(x))``, the MLP half of a transformer layer) ->
final LayerNorm -> output layer -> cross-entropy. Activations are ``[s, b, h]``
(sequence, micro-batch, hidden), Megatron's layout.

The pipeline boundary sits *between* blocks: stage ``k`` owns a contiguous run of
blocks, stage 0 also the embedding, the last stage also the head and the loss.
Only the ``[s, b, h]`` activation crosses a boundary (forward) and its gradient
(backward). :func:`layer_split` gives the run of each stage, evenly (by the rules of
:mod:`course_lib.rules`, as Megatron checks them) or from an explicit list (Megatron:
``--decoder-first-pipeline-num-layers`` / ``--pipeline-model-parallel-layout`` for uneven splits).

Every rank builds the whole model from the same seed and keeps its stages' parts,
so parameter names and values equal the unsplit model's: gradients compare 1:1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import rules


@dataclass(frozen=True)
class StackConfig:
    """Sizes of the toy model and its data. ``layers_per_stage``: an explicit, possibly uneven,
    number of blocks per (virtual) stage; ``None`` splits ``num_layers`` evenly."""

    vocab_size: int = 32
    hidden_size: int = 16
    ffn_hidden_size: int = 32
    num_layers: int = 8
    seq_length: int = 4
    micro_batch_size: int = 2
    layers_per_stage: Optional[tuple] = None
    seed: int = 0

    def with_(self, **changes) -> "StackConfig":
        return replace(self, **changes)


class Block(nn.Module):
    """Pre-LN residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``; ``x``: [s, b, h]."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))  # [s, b, h]


class Embedding(nn.Module):
    """Token + learned position embedding; tokens [b, s] -> [s, b, h] (Megatron transposes here)."""

    def __init__(self, vocab: int, seq: int, hidden: int):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(seq, hidden)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        return (self.word(tokens) + self.position(positions)).transpose(0, 1).contiguous()


class Head(nn.Module):
    """Final LayerNorm + output layer: [s, b, h] -> logits [s, b, vocab]."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.output(self.norm(x))


class StackModel(nn.Module):
    """The unsplit model: the single-process reference."""

    def __init__(self, cfg: StackConfig):
        super().__init__()
        with torch.random.fork_rng():  # same weights on every rank, global RNG untouched
            torch.manual_seed(cfg.seed)
            self.embedding = Embedding(cfg.vocab_size, cfg.seq_length, cfg.hidden_size)
            self.layers = nn.ModuleList(Block(cfg.hidden_size, cfg.ffn_hidden_size)
                                        for _ in range(cfg.num_layers))
            self.head = Head(cfg.hidden_size, cfg.vocab_size)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def lm_loss(logits, labels):
    """Mean cross-entropy; ``logits`` [s, b, vocab], ``labels`` [b, s]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.transpose(0, 1).reshape(-1))


def layer_split(num_layers: int, num_stages: int, layers_per_stage: Optional[Sequence[int]] = None, *,
                vp_size: int = 1) -> list:
    """The blocks of each (virtual) stage as ``range`` s: even, or an explicit ``layers_per_stage``.

    An even split follows Megatron's rules in :mod:`course_lib.rules`: ``num_layers`` divides over
    the ``num_stages // vp_size`` pipeline ranks (:func:`~course_lib.rules.pipeline_split`) and each
    rank's layers over its ``vp_size`` model chunks (:func:`~course_lib.rules.virtual_pipeline`).
    ``layers_per_stage``: one count ``>= 0`` per virtual stage, adding up to ``num_layers``
    (Megatron's ``--pipeline-model-parallel-layout`` spells such a split out layer by layer)."""
    rules.integer("num_stages", num_stages)
    if layers_per_stage is None:
        pp = rules.pipeline_ranks(num_stages, vp_size)
        per_rank = rules.pipeline_split(num_layers, pp)
        per_chunk = rules.virtual_pipeline(vp_size, pp, per_rank) if vp_size > 1 else per_rank
        counts = [per_chunk[k % pp] for k in range(num_stages)]     # virtual stage k runs on rank k % pp
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or any((not isinstance(c, int)) or c < 0 for c in counts):
            raise rules.UsageError(f"layers_per_stage={tuple(counts)} needs {num_stages} integers >= 0 "
                                   f"(one per virtual stage)")
        if sum(counts) != num_layers:
            raise rules.UsageError(f"layers_per_stage={tuple(counts)} adds up to {sum(counts)} blocks, but "
                                   f"num_layers={num_layers}")
    starts = [sum(counts[:k]) for k in range(num_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


class Stage(nn.Module):
    """One virtual stage of a :class:`StackModel`: its blocks, plus the embedding (first) and head (last).

    ``forward(x)``: first stage ``x`` = tokens [b, s], else activations [s, b, h];
    returns [s, b, h], or logits [s, b, vocab] on the last stage.
    """

    def __init__(self, model: StackModel, index: int, split: list):
        super().__init__()
        self.index, self.num_stages = index, len(split)
        self.first, self.last = index == 0, index == len(split) - 1
        self.embedding = model.embedding if self.first else None
        self.layers = nn.ModuleList(model.layers[i] for i in split[index])
        self.head = model.head if self.last else None

    def forward(self, x):
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def build_stages(cfg: StackConfig, pp_rank: int, pp_size: int, vp_size: int = 1):
    """``(model, {chunk: Stage})`` for ``pp_rank``: chunk ``c`` is virtual stage ``c * pp_size + pp_rank``."""
    split = layer_split(cfg.num_layers, pp_size * vp_size, cfg.layers_per_stage, vp_size=vp_size)
    model = StackModel(cfg)
    return model, {c: Stage(model, c * pp_size + pp_rank, split) for c in range(vp_size)}


def make_batch(cfg: StackConfig, num_microbatches: int):
    """Deterministic tokens and labels ``[m * micro_batch_size, s]`` (labels: the next token)."""
    g = torch.Generator().manual_seed(1000 + cfg.seed)
    tokens = torch.randint(0, cfg.vocab_size, (num_microbatches * cfg.micro_batch_size, cfg.seq_length + 1),
                           generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_gradients(cfg: StackConfig, num_microbatches: int):
    """The unsplit model on the whole batch in one process: ``(loss, {param name: grad})``."""
    model = StackModel(cfg)
    tokens, labels = make_batch(cfg, num_microbatches)
    loss = lm_loss(model(tokens), labels)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
