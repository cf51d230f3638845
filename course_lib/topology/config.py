"""A whole run's parallel layout, validated once: :class:`ParallelConfig`.

``ParallelConfig`` carries the model and batch sizes as well as the grid, derives
``dp`` and ``num_microbatches = global_batch_size / (micro_batch_size * dp)``
and checks every rule a Megatron run checks (``validate_args``,
``initialize_model_parallel``) -- the rules of :mod:`course_lib.rules`, each failure a
one-line ``ValueError`` that names the rule and a fix -- and renders the layout's
Megatron-LM flags (:meth:`ParallelConfig.megatron_args`). The trainer, the planner,
``megatron-cmd`` and ``rankmap`` validate through it and pass it down.

Pure Python (no torch), like :mod:`course_lib.topology.grid`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib import rules
from course_lib.topology.grid import DEFAULT_ORDER, RankGrid

@dataclass(frozen=True)
class ParallelConfig:
    """A Megatron-style parallel training configuration, validated on creation.

    Fields follow Megatron's argument names (``--tensor-model-parallel-size`` is
    ``tp`` here, etc.). Model sizes left as ``None`` are not checked, so
    ``ParallelConfig(world_size=8, tp=2, pp=2)`` validates just the grid.

    The MoE layers' sizes sit beside the dense ones (as in torchtitan's ``ParallelDims``):
    ``ep`` = ``--expert-model-parallel-size``, ``expert_tp`` = ``--expert-tensor-parallel-size``
    (None: tp); the grid validates the expert grid too and derives ``expert_dp``. Their flags are
    rendered with the MoE flags (``megatron.command``), not by :meth:`megatron_args`.

    Derived: ``dp`` (= world / (tp·pp·cp), never a flag), ``expert_dp``, ``num_microbatches``
    (= global / (micro·dp)), ``grid`` (the ``RankGrid``), ``layers_per_stage``, ``vpp``
    (model chunks per pipeline rank, 1 without interleaving) and ``notes`` (what was
    adjusted, one line each).

    The rules are :mod:`course_lib.rules`' (each a one-line ValueError naming the rule and a fix):
      * world_size % (tp·pp·cp) == 0 (``data_parallel_size``); with experts
        world_size % (expert_tp·ep·pp) == 0 (``expert_data_parallel_size``) and the expert grid's order
        rules (``RankGrid``)
      * the order contains every axis of size > 1; with pp > 1 and cp > 1 it must
        end in 'pp' (initialize_model_parallel's assertion)
      * num_attention_heads % tp == 0, num_query_groups % tp == 0, hidden % heads == 0
      * num_layers % pp == 0 -- an **error**, as in Megatron; an uneven split is only
        accepted when made explicit with ``decoder_first_pipeline_num_layers`` /
        ``decoder_last_pipeline_num_layers`` (Megatron's flags of the same name, each >= 1), the
        remaining layers dividing evenly over the middle stages
      * virtual pipeline: pp > 1, layers of every stage % vpp == 0, and the interleaved
        schedule's micro-batch groups (num_microbatches % pp == 0); vpp = 1 means none
      * cp > 1: seq_length % (2·cp) == 0 (load-balanced causal CP cuts the sequence
        into 2·cp chunks, two per rank)
      * sequence_parallel: turned off with tp = 1 (Megatron's policy; said in ``notes``),
        else (seq_length / cp) % tp == 0
      * global_batch_size % (micro_batch_size · dp) == 0; default global = micro · dp
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    num_layers: int | None = None
    num_attention_heads: int | None = None
    hidden_size: int | None = None
    seq_length: int | None = None
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    sequence_parallel: bool = False
    num_query_groups: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    order: str = DEFAULT_ORDER
    ep: int = 1
    expert_tp: int | None = None
    grid: RankGrid = field(init=False, repr=False, compare=False)
    notes: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        grid = RankGrid(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, expert_tp=self.expert_tp,
                        order=self.order)
        object.__setattr__(self, "grid", grid)
        tp, pp, cp = self.tp, self.pp, self.cp
        rules.order_ends_with_pp(self.order, grid.order[-1], pp, cp)
        for name in ("num_layers", "num_attention_heads", "hidden_size", "seq_length", "num_query_groups"):
            if getattr(self, name) is not None:
                rules.integer(name, getattr(self, name))
        rules.integer("micro_batch_size", self.micro_batch_size)
        if self.global_batch_size is not None:
            rules.integer("global_batch_size", self.global_batch_size)
        sequence_parallel, note = rules.sequence_parallel(self.sequence_parallel, tp)
        object.__setattr__(self, "sequence_parallel", sequence_parallel)
        object.__setattr__(self, "notes", (note,) if note else ())
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and rules.integer(rules.VPP, vpp) == 1:
            object.__setattr__(self, "virtual_pipeline_model_parallel_size", None)   # Megatron: 1 chunk = none

        heads, seq = self.num_attention_heads, self.seq_length
        if heads is not None:
            rules.heads_divisible_by_tp(heads, tp)
        if self.num_query_groups is not None:
            rules.query_groups(self.num_query_groups, heads, tp)
        if heads is not None and self.hidden_size is not None:
            rules.hidden_divisible_by_heads(self.hidden_size, heads)
        stages = self._check_layers()
        if seq is not None and cp > 1:
            rules.sequence_split(seq, cp)
        if seq is not None and self.sequence_parallel:
            rules.sequence_parallel_split(seq, cp, tp)
        m = rules.num_microbatches(self.effective_global_batch_size, self.micro_batch_size, grid.dp)
        if self.virtual_pipeline_model_parallel_size is not None:
            rules.virtual_pipeline(self.virtual_pipeline_model_parallel_size, pp, stages)
            rules.interleaved_microbatch_group(pp, m, self.virtual_pipeline_model_parallel_size)

    def _check_layers(self) -> list[int] | None:
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if self.num_layers is None:
            for name, v in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
                if v is not None:
                    raise rules.UsageError(f"{name}={v} needs num_layers; give num_layers too")
            return None
        return rules.pipeline_split(self.num_layers, self.pp, first, last)

    # ---- derived -------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.grid.dp

    @property
    def expert_dp(self) -> int:
        return self.grid.expert_dp

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (1: no interleaving)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def effective_global_batch_size(self) -> int:
        """Megatron's default when global_batch_size is not given: micro · dp."""
        return self.global_batch_size if self.global_batch_size is not None else self.micro_batch_size * self.dp

    @property
    def num_microbatches(self) -> int:
        """global_batch_size / (micro_batch_size · dp): micro-batches per step per pipeline."""
        return rules.num_microbatches(self.effective_global_batch_size, self.micro_batch_size, self.dp)

    @property
    def uneven_pipeline(self) -> bool:
        """Whether the pipeline split is made uneven with decoder_first/last_pipeline_num_layers."""
        return self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None

    def layers_per_stage(self) -> list[int]:
        """Number of transformer layers on each pipeline stage."""
        if self.num_layers is None:
            raise rules.UsageError("layers_per_stage() needs num_layers; give num_layers")
        return rules.pipeline_split(self.num_layers, self.pp, self.decoder_first_pipeline_num_layers,
                                    self.decoder_last_pipeline_num_layers)

    def layer_ranges(self) -> list[range]:
        """0-based global layer indices on each pipeline stage."""
        out, start = [], 0
        for n in self.layers_per_stage():
            out.append(range(start, start + n))
            start += n
        return out

    def megatron_args(self) -> list[tuple[str, str | None]]:
        """This config as ``pretrain_gpt.py`` arguments: ``(flag, value)`` pairs, value ``None`` for a switch.

        The one renderer of a layout's Megatron-LM flags (``megatron_flags`` flattens it,
        :func:`course_lib.megatron.command.pretrain_args` adds a run's). Model sizes appear
        when given. Note what is *not* here: there is no --data-parallel-size (DP is
        derived) and --model-parallel-size was removed (use --tensor-model-parallel-size).
        Interleaving is ``--num-layers-per-virtual-pipeline-stage`` (layers per chunk; also
        understood by old Megatron-LM), or ``--num-virtual-stages-per-pipeline-rank`` with an
        uneven split, where Megatron's validate_args refuses the former.
        """
        args: list[tuple[str, str | None]] = [("--tensor-model-parallel-size", str(self.tp)),
                                              ("--pipeline-model-parallel-size", str(self.pp))]
        if self.cp > 1:
            args.append(("--context-parallel-size", str(self.cp)))
        if self.sequence_parallel:
            args.append(("--sequence-parallel", None))
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and self.uneven_pipeline:
            args.append(("--num-virtual-stages-per-pipeline-rank", str(vpp)))
        elif vpp is not None:
            args.append(("--num-layers-per-virtual-pipeline-stage", str(self.layers_per_stage()[0] // vpp)))
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if getattr(self, name) is not None:
                args.append(("--" + name.replace("_", "-"), str(getattr(self, name))))
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            if getattr(self, name) is not None:
                args.append(("--" + name.replace("_", "-"), str(getattr(self, name))))
        if self.num_query_groups is not None:
            args += [("--group-query-attention", None), ("--num-query-groups", str(self.num_query_groups))]
        if self.seq_length is not None:
            args += [("--seq-length", str(self.seq_length)), ("--max-position-embeddings", str(self.seq_length))]
        args += [("--micro-batch-size", str(self.micro_batch_size)),
                 ("--global-batch-size", str(self.effective_global_batch_size))]
        return args

    def megatron_flags(self) -> list[str]:
        """:meth:`megatron_args` as one flat argv list."""
        return [x for flag, value in self.megatron_args() for x in ((flag,) if value is None else (flag, value))]

    def summary(self) -> str:
        """One line: the sizes and derived numbers."""
        s = f"world_size={self.world_size} = tp {self.tp} × pp {self.pp} × cp {self.cp} × dp {self.dp}"
        if self.global_batch_size is not None:
            s += (f"; micro-batches per step = {self.global_batch_size} / ({self.micro_batch_size} × "
                  f"{self.dp}) = {self.num_microbatches}")
        if self.num_layers is not None:
            s += f"; layers per stage {self.layers_per_stage()}"
        return s

