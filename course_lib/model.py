"""One tiny GPT for every parallel layout, built from one set of master weights.

For: the course's model, Megatron-core's ``GPTModel`` in miniature (token + position embeddings,
pre-LayerNorm layers, final LayerNorm, an output layer tied to the word embeddings; activations
``[s, b, h]``, logits ``[s, b, V]``, mcore's parameter names). Main names: :class:`GPTConfig`,
:class:`GPTModel` (the dense reference and master weights), :class:`GPTChunk` and :func:`build_model`
(a rank's PP/VP chunks with its TP/SP/CP/EP shards cut from the master), :func:`allreduce_embedding_grads`.
Follows: ``megatron/core/models/gpt/gpt_model.py``, ``LanguageModule.setup_embeddings_and_output_layer``;
Narayanan et al. 2021, Sec. 2.2 (stages, interleaving).
Manual (one set of numbers for every layout, vocabulary padding, how each layout splits the model):
docs/internals/model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import comm, rules
from course_lib.context_parallel.attention import build_layer
from course_lib.process_groups import ProcessGroups
from course_lib.tensor_parallel import (ColumnParallelLinear, DenseTransformerLayer, TransformerConfig,
                                        VocabParallelEmbedding, copy_dense_to_parallel, is_tensor_parallel,
                                        scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)

__all__ = ["GPTConfig", "GPTModel", "GPTChunk", "build_model", "layer_ranges", "gpt_loss", "sync_tied_embeddings",
           "allreduce_embedding_grads", "master_name", "gather_full_parameters"]


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes (Megatron's argument names). ``vocab_size`` is the tokenizer's (257 for
    :class:`course_lib.data.ByteTokenizer`); the embedding has ``padded_vocab_size`` rows, a
    multiple of ``make_vocab_size_divisible_by * vocab_padding_tp`` (Megatron pads for the run's
    own TP; the default 1 pads every layout alike, see the module doc).
    ``max_position_embeddings`` defaults to ``seq_length``; ``ffn_hidden_size`` to ``4 h``."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 257
    make_vocab_size_divisible_by: int = 128
    vocab_padding_tp: int = 1
    max_position_embeddings: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    add_bias_linear: bool = True                            # --disable-bias-linear: False (every linear, router too)
    seed: int = 1234
    # Mixture of Experts (Megatron's flags; num_experts None: a dense model). See course_lib.moe.transformer.
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_layer_freq: object = 1
    moe_token_dispatcher_type: str = "allgather"            # Megatron's default (TransformerConfig)

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "seq_length", "vocab_size", "make_vocab_size_divisible_by",
                     "vocab_padding_tp"):
            rules.integer(name, getattr(self, name))
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        rules.max_position_embeddings(rules.integer("max_position_embeddings", self.max_position_embeddings),
                                      self.seq_length)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        self.transformer_config()        # the layers' own checks: heads, hidden % heads, ffn, dropout, init
        self._check_moe()

    def _check_moe(self) -> None:
        """Megatron's MoE checks (``validate_args``): experts >= 1 (0 means none), top-k <= experts,
        ``moe_ffn_hidden_size`` defaults to ``ffn_hidden_size``, a valid ``moe_layer_freq``."""
        object.__setattr__(self, "num_experts", rules.moe_experts(self.num_experts))
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.num_experts is None:
            return
        from course_lib.moe.pattern import moe_layer_pattern

        rules.integer("moe-router-topk", self.moe_router_topk, maximum=self.num_experts)
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        rules.integer("moe-ffn-hidden-size", self.moe_ffn_hidden_size)
        rules.number("moe-aux-loss-coeff", self.moe_aux_loss_coeff, 0.0)
        if self.moe_z_loss_coeff is not None:
            rules.number("moe-z-loss-coeff", self.moe_z_loss_coeff, 0.0)
        rules.moe_dispatcher(self.moe_token_dispatcher_type)
        moe_layer_pattern(self.num_layers, self.moe_layer_freq)

    @property
    def moe_layers(self) -> list[int]:
        """0-based indices of the layers whose MLP is an MoE (``--moe-layer-freq``); [] for a dense model."""
        if self.num_experts is None:
            return []
        from course_lib.moe.pattern import moe_layer_pattern

        return [i for i, moe in enumerate(moe_layer_pattern(self.num_layers, self.moe_layer_freq)) if moe]

    @property
    def padded_vocab_size(self) -> int:
        return rules.vocab_size_with_padding(self.vocab_size, self.vocab_padding_tp, self.make_vocab_size_divisible_by)

    def transformer_config(self, sequence_parallel: bool = False) -> TransformerConfig:
        return TransformerConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                                 ffn_hidden_size=self.ffn_hidden_size, num_layers=self.num_layers,
                                 sequence_parallel=sequence_parallel, layernorm_epsilon=self.layernorm_epsilon,
                                 init_method_std=self.init_method_std, hidden_dropout=self.hidden_dropout,
                                 attention_dropout=self.attention_dropout, add_bias_linear=self.add_bias_linear)

    def with_(self, **changes) -> "GPTConfig":
        return replace(self, **changes)


# ---------------------------------------------------------------------------- the dense model


def _embedding_table(rows: int, cols: int, init_method) -> nn.Embedding:
    weight = torch.empty(rows, cols)
    init_method(weight)                      # N(0, std^2) from the global generator
    return nn.Embedding(rows, cols, _weight=weight)


class LanguageModelEmbedding(nn.Module):
    """Dense word + learned position embedding: tokens ``[b, s]`` -> ``[s, b, h]`` (mcore's name)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        init = config.transformer_config().init_method
        self.config = config
        self.word_embeddings = _embedding_table(config.padded_vocab_size, config.hidden_size, init)
        self.position_embeddings = _embedding_table(config.max_position_embeddings, config.hidden_size, init)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(position_ids)     # [b, s, h]
        x = x.transpose(0, 1).contiguous()                                            # [s, b, h]
        return F.dropout(x, p=self.config.hidden_dropout, training=self.training)


class TransformerBlock(nn.Module):
    """``layers`` (a ModuleDict keyed by the *global* layer index, so names match the master's
    ``decoder.layers.<i>``) and, on the last stage, ``final_layernorm``."""

    def __init__(self, layers: dict, final_layernorm: Optional[nn.LayerNorm]):
        super().__init__()
        self.layers = nn.ModuleDict(layers)
        self.final_layernorm = final_layernorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x if self.final_layernorm is None else self.final_layernorm(x)


class GPTModel(nn.Module):
    """The dense GPT in one process: the single-process reference and the master weights.

    Built in a forked RNG state seeded with ``config.seed`` (the global generator is left
    untouched), drawing, in order: word embeddings ``[V, h]``, position embeddings
    ``[max_pos, h]``, then each layer's ``linear_qkv``, ``linear_proj``, ``linear_fc1``,
    ``linear_fc2`` (``N(0, 0.02^2)``; the two output GEMMs scaled by ``1/sqrt(2 L)``); an MoE
    layer (``config.moe_layers``) then draws its router ``[E, h]`` (and its bias ``[E]``), experts'
    fc1 ``[E, F, h]`` and fc2 ``[E, h, F]`` and takes them as its ``mlp`` (:class:`course_lib.moe.transformer.MoEMLP`), so
    its attention holds the same numbers as the dense model's.
    ``forward(tokens [b, s], position_ids=None) -> logits [s, b, V]`` (padded ``V``).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        tcfg = config.transformer_config()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.embedding = LanguageModelEmbedding(config)
            layers = {str(i): DenseTransformerLayer(tcfg, layer_number=i + 1) for i in range(config.num_layers)}
            if config.moe_layers:
                from course_lib.moe.transformer import MoEMLP

                for i in config.moe_layers:
                    layers[str(i)].mlp = MoEMLP(config, i + 1, None, init=True)
            self.decoder = TransformerBlock(layers, nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon))

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.decoder(self.embedding(tokens, position_ids))                  # [s, b, h]
        return F.linear(hidden, self.embedding.word_embeddings.weight)               # [s, b, V] tied

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every token of ``tokens``/``labels`` ``[b, s]``."""
        logits = self(tokens)                                                        # [s, b, V]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1))


# ------------------------------------------------------------------------ the parallel pieces


class ParallelLanguageModelEmbedding(nn.Module):
    """Word embedding split by vocabulary over TP + learned positions, for this rank's tokens.

    ``forward(tokens [b, s_local]) -> [s_local, b, h]`` or ``[s_local/t, b, h]`` under SP
    (mcore: the sum is transposed, then scattered along the sequence; with learned positions
    the word embedding all-reduces rather than reduce-scatters). ``position_ids`` (a buffer)
    are the *global* positions of the rank's tokens: with CP they are not contiguous."""

    def __init__(self, config: GPTConfig, tp_group, position_ids: torch.Tensor, sequence_parallel: bool):
        super().__init__()
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                      tp_group=tp_group)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.register_buffer("position_ids", position_ids.clone(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != self.position_ids.numel():
            raise rules.UsageError(f"tokens have {tokens.shape[1]} positions per sample but this rank's chunk expects "
                                   f"{self.position_ids.numel()} (seq_length / context-parallel-size)")
        x = self.word_embeddings(tokens) + self.position_embeddings(self.position_ids)   # [b, s_l, h]
        x = x.transpose(0, 1).contiguous()                                               # [s_l, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)                    # [s_l/t, b, h]
        return F.dropout(x, p=self.config.hidden_dropout, training=self.training)


class GPTChunk(nn.Module):
    """One virtual pipeline stage of the GPT on this rank.

    ``forward(x)``: on the first virtual stage ``x`` is tokens ``[b, s_local]``, else the
    activation ``[s_local(/t), b, h]`` from the previous stage; returns the activation, or on
    the last virtual stage the vocab-parallel logits ``[s_local, b, V/t]``.
    Attributes ``pre_process`` / ``post_process`` (mcore's names) say which ends it holds.
    """

    def __init__(self, config: GPTConfig, layer_ids: range, *, pre_process: bool, post_process: bool,
                 tp_group, cp_group, position_ids: torch.Tensor, sequence_parallel: bool = False,
                 moe_groups=None):
        super().__init__()
        self.config, self.layer_ids = config, layer_ids
        self.pre_process, self.post_process = pre_process, post_process
        tcfg = config.transformer_config(sequence_parallel)
        # The constructors draw throw-away weights (the values are copied from the master later):
        # keep the global generator, which drives dropout, untouched.
        with torch.random.fork_rng(devices=[]):
            self.embedding = (ParallelLanguageModelEmbedding(config, tp_group, position_ids, sequence_parallel)
                              if pre_process else None)
            final = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon) if post_process else None
            if final is not None and sequence_parallel:
                for p in final.parameters():
                    p.sequence_parallel = True
            self.decoder = TransformerBlock(
                {str(i): build_layer(tcfg, tp_group, cp_group, layer_number=i + 1) for i in layer_ids}, final)
            for i in set(config.moe_layers) & set(layer_ids):       # the MLP of an MoE layer is an MoEMLP
                from course_lib.moe.transformer import MoEMLP

                mlp = MoEMLP(config, i + 1, moe_groups)
                if sequence_parallel:
                    mlp.mark_sequence_parallel()
                self.decoder.layers[str(i)].mlp = mlp
            self.output_layer = (ColumnParallelLinear(config.hidden_size, config.padded_vocab_size,
                                                      tp_group=tp_group, bias=False, gather_output=False,
                                                      sequence_parallel=sequence_parallel)
                                 if post_process else None)
        if pre_process and post_process:   # tied on one stage: the output layer *is* the embedding matrix
            self.output_layer.weight = self.embedding.word_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        x = self.decoder(x)
        if self.output_layer is not None:
            x, _ = self.output_layer(x)       # SP: all-gathers [s_l/t, b, h] -> [s_l, b, h] first
        return x


def master_name(chunk_param_name: str) -> str:
    """The master (:class:`GPTModel`) parameter a chunk parameter is a piece of."""
    return "embedding.word_embeddings.weight" if chunk_param_name == "output_layer.weight" else chunk_param_name


def layer_ranges(num_layers: int, pp: int, vp: int = 1) -> list[range]:
    """Layers of each virtual stage ``c * pp + r`` (even split; Megatron's layer offsets)."""
    from course_lib.pipeline.stages import layer_split

    return layer_split(num_layers, pp * vp)


@torch.no_grad()
def _load_from_master(chunk: GPTChunk, master: GPTModel, tp_group) -> None:
    if chunk.embedding is not None:
        copy_dense_to_parallel(master.embedding, chunk.embedding, tp_group)
    for i in chunk.layer_ids:
        dense, mine = master.decoder.layers[str(i)], chunk.decoder.layers[str(i)]
        if hasattr(mine.mlp, "load_from_master"):           # an MoE layer: the experts are cut by EP/expert TP
            for name, child in mine.named_children():
                if name != "mlp":
                    copy_dense_to_parallel(getattr(dense, name), child, tp_group)
            mine.mlp.load_from_master(dense.mlp)
        else:
            copy_dense_to_parallel(dense, mine, tp_group)
    if chunk.post_process:
        copy_dense_to_parallel(master.decoder.final_layernorm, chunk.decoder.final_layernorm, tp_group)
        if chunk.pre_process:
            return                                            # output weight = embedding weight, copied above
        # mcore: the last stage's copy starts at 0 and receives the first stage's values through an
        # all-reduce over the embedding group (sync_tied_embeddings).
        chunk.output_layer.weight.zero_()
        chunk.output_layer.weight.shared = True
        chunk.output_layer.weight.shared_embedding = True


def build_model(config: GPTConfig, groups: ProcessGroups, *, vp: int = 1, sequence_parallel: bool = False,
                master: Optional[GPTModel] = None, device=None, moe_groups=None) -> list[GPTChunk]:
    """This rank's model chunks (``vp`` of them; chunk ``c`` is virtual stage ``c * pp + pp_rank``).

    Every rank builds the dense master (``config.seed``) -- or takes ``master`` -- and keeps its
    pieces. Collective over the embedding group when ``pp > 1`` (see :func:`sync_tied_embeddings`).
    A config with ``num_experts`` needs ``moe_groups``
    (:func:`course_lib.process_groups.new_moe_process_groups` of the same grid): each MoE layer keeps
    its ``num_experts / ep`` experts, split over expert TP.
    """
    grid, c = groups.grid, groups.coords
    pp, cp = grid.pp, grid.cp
    t = comm.group_size(groups.tp)
    rules.heads_divisible_by_tp(config.num_attention_heads, t)
    rules.vocab_divisible_by_tp(config.padded_vocab_size, t)
    if sequence_parallel:
        rules.sequence_parallel_split(config.seq_length, cp, t)
    if config.num_experts is not None:
        rules.moe_sequence_parallel(config.num_experts, t, sequence_parallel)
        rules.moe_context_parallel(config.num_experts, cp)
        if moe_groups is None:
            raise rules.UsageError(f"num_experts={config.num_experts}: pass moe_groups="
                                   f"course_lib.process_groups.new_moe_process_groups(grid) to build_model")
        rules.moe_experts(config.num_experts, moe_groups.size("ep"))
    from course_lib.data import cp_token_positions

    positions = cp_token_positions(config.seq_length, c["cp"], cp)       # [s/cp] global positions
    ranges = layer_ranges(config.num_layers, pp, vp)
    master = GPTModel(config) if master is None else master
    chunks = []
    for chunk_id in range(vp):
        stage = chunk_id * pp + c["pp"]
        chunk = GPTChunk(config, ranges[stage], pre_process=stage == 0, post_process=stage == pp * vp - 1,
                         tp_group=groups.tp, cp_group=groups.cp, position_ids=positions,
                         sequence_parallel=sequence_parallel, moe_groups=moe_groups)
        _load_from_master(chunk, master, groups.tp)
        if chunk.pre_process and not chunk.post_process:
            chunk.embedding.word_embeddings.weight.shared_embedding = True
        chunks.append(chunk.to(device) if device is not None else chunk)
    sync_tied_embeddings(chunks, groups)
    return chunks


def _shared_embedding_weight(chunks: list[GPTChunk], groups: ProcessGroups) -> Optional[nn.Parameter]:
    """The word-embedding matrix this rank holds as a member of the embedding group, if any."""
    if groups.grid.pp == 1 or groups.embedding is None:
        return None
    if groups.is_first_stage:
        return chunks[0].embedding.word_embeddings.weight
    if groups.is_last_stage:
        return chunks[-1].output_layer.weight
    return None


@torch.no_grad()
def sync_tied_embeddings(chunks: list[GPTChunk], groups: ProcessGroups) -> None:
    """Make the last stage's copy of the word embeddings equal the first stage's: the last
    stage's copy is zero, so a sum over the embedding group copies the values (mcore's
    ``setup_embeddings_and_output_layer``). No-op when pp == 1 or on middle stages."""
    weight = _shared_embedding_weight(chunks, groups)
    if weight is not None:
        comm.all_reduce(weight.data, groups.embedding, kind="embedding", direction="fwd",
                        source="sync_tied_embeddings")


@torch.no_grad()
def allreduce_embedding_grads(chunks: list[GPTChunk], groups: ProcessGroups) -> int:
    """Sum the word-embedding gradient of the first stage (input embedding) and the last stage
    (output layer) over the embedding group, so both copies take the same step.

    Megatron: ``_allreduce_word_embedding_grads`` in ``megatron/core/distributed/
    finalize_model_grads.py``. Returns the elements reduced (0 when nothing to do)."""
    weight = _shared_embedding_weight(chunks, groups)
    if weight is None or weight.grad is None or comm.group_size(groups.embedding) == 1:
        return 0
    comm.all_reduce(weight.grad, groups.embedding, kind="embedding", direction="bwd",
                    source="allreduce_embedding_grads")
    return weight.grad.numel()


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of per-token losses, number of tokens)`` for vocab-parallel logits ``[s, b, V/t]``
    and labels ``[b, s]`` (the loss_func of Megatron's ``pretrain_gpt.py``, loss mask all ones).
    Every TP rank gets the same numbers."""
    losses = vocab_parallel_cross_entropy(logits, labels.t(), tp_group)          # [s, b]
    return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)


def gather_full_parameters(chunks: list[GPTChunk], groups: ProcessGroups, grads: bool = False) -> dict:
    """``{master name: full tensor}`` of what this rank's chunks hold (TP shards all-gathered).
    Collective over TP (and, for expert weights, over expert TP and EP: every expert, unsplit).
    For tests and notebooks: compare with :class:`GPTModel`'s tensors."""
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            value = (p.grad if grads else p.data)
            if value is None:
                raise rules.UsageError(f"{name} has no gradient: run backward first")
            value = value.detach()
            if hasattr(p, "expert_partition_dim"):         # decoder.layers.<i>.mlp.experts.linear_fc1.weight
                owner = chunk.get_submodule(name.rsplit(".experts.", 1)[0])
                value = owner.full_expert_tensor(value, p.expert_partition_dim)
            elif is_tensor_parallel(p):
                value = comm.all_gather(value, groups.tp, dim=p.partition_dim, kind="tp")
            out[master_name(name)] = value.clone()
    return out
