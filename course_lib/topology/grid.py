"""The 3D/4D rank grid: which rank sits where, and every process group.

``RankGrid(world_size, tp, pp, cp)`` numbers ranks exactly like Megatron-LM's
``RankGenerator`` (``megatron/core/parallel_state.py``): the parallel sizes are
laid out in ``order`` (default ``"tp-cp-ep-dp-pp"``) with the **first axis
varying fastest**, so

    rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

and a group for a set of axes (a ``token`` such as ``"tp"`` or ``"dp-cp"``) is
the set of ranks that differ only along those axes, listed in group-rank order
(the first axis of ``order`` varies fastest inside the group too). Groups are
listed in Megatron's creation order. ``dp`` is derived: ``world_size / (tp*pp*cp*ep)``.

``ParallelConfig`` carries the model and batch sizes as well, derives
``dp`` and ``num_microbatches = global_batch_size / (micro_batch_size * dp)``
and checks every rule a Megatron run checks -- the rules of :mod:`course_lib.rules`,
each failure a one-line ``ValueError`` that names the rule and a fix -- and renders
the layout's Megatron-LM flags (:meth:`ParallelConfig.megatron_args`).

No torch here: this module is pure Python + numpy, so it is instant to import
and the rank-map CLI works without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from course_lib import rules
from course_lib.rules import AXIS_FLAG, divisors  # noqa: F401  (re-exported: topology's names since Lab 01)

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Megatron appends axes missing from `order` in the order of its name_to_size
# dict (RankGenerator.__init__); only axes of size 1 may be missing.
_MEGATRON_APPEND_ORDER = ("tp", "pp", "dp", "ep", "cp")
SPECIAL_TOKENS = ("embedding", "position_embedding")

# The groups Megatron's initialize_model_parallel builds from the non-expert
# grid, with the global variable that holds them and what runs inside.
MEGATRON_GROUPS = {
    "tp": ("_TENSOR_MODEL_PARALLEL_GROUP",
           "all-reduce after each row-parallel GEMM (2 per layer forward, 2 backward); "
           "with sequence parallel: all-gather + reduce-scatter instead"),
    "cp": ("_CONTEXT_PARALLEL_GROUP",
           "ring exchange of K/V chunks (send/recv) inside attention"),
    "dp": ("_DATA_PARALLEL_GROUP",
           "gradient all-reduce (or reduce-scatter + all-gather with the distributed optimizer)"),
    "dp-cp": ("_DATA_PARALLEL_GROUP_WITH_CP",
              "gradient all-reduce when cp > 1 (CP ranks hold the same weights)"),
    "pp": ("_PIPELINE_MODEL_PARALLEL_GROUP",
           "send/recv of activations (forward) and their gradients (backward) between neighbouring stages"),
    "tp-pp": ("_MODEL_PARALLEL_GROUP",
              "all-reduce of scalars over one model replica (grad norm, inf/nan check)"),
    "embedding": ("_EMBEDDING_GROUP",
                  "all-reduce of the tied word-embedding gradient between first and last stage"),
    "position_embedding": ("_POSITION_EMBEDDING_GROUP",
                           "first stage only (learned position embeddings live there)"),
    "tp-cp": ("_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "used by some MoE and attention code paths"),
    "tp-dp": ("_TENSOR_AND_DATA_PARALLEL_GROUP", "fp8 amax reduction, MoE"),
    "tp-dp-cp": ("_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "fp8 amax reduction with cp"),
}


def parse_order(order: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """Validate ``order`` like Megatron's RankGenerator and return the full axis order.

    Axes of size 1 may be left out (they are appended, as Megatron does); an axis of
    size > 1 that is missing is an error. Unknown or repeated axes are errors too
    (Megatron fails on them with a KeyError or builds wrong groups).
    """
    if not isinstance(order, str) or not order.strip():
        raise ValueError(f"order={order!r} must be a '-'-joined list of axes such as '{DEFAULT_ORDER}'")
    tokens = [t.strip() for t in order.lower().split("-")]
    for t in tokens:
        if t not in AXES:
            raise ValueError(f"order={order!r} has unknown axis {t!r}; use only {', '.join(AXES)} "
                             f"joined by '-', e.g. '{DEFAULT_ORDER}'")
    dup = sorted({t for t in tokens if tokens.count(t) > 1})
    if dup:
        raise ValueError(f"order={order!r} repeats axis {dup[0]!r}; list each axis once, e.g. '{DEFAULT_ORDER}'")
    given = list(tokens)
    for name in _MEGATRON_APPEND_ORDER:
        if name not in tokens:
            if sizes[name] != 1:
                # suggest: insert it where Megatron's default order has it
                later = [t for t in given if AXES.index(t) > AXES.index(name)]
                at = given.index(later[0]) if later else len(given)
                fixed = "-".join(given[:at] + [name] + given[at:])
                raise ValueError(f"{AXIS_FLAG[name]}={sizes[name]} but {name!r} is missing from "
                                 f"order={order!r}; add it, e.g. order='{fixed}'")
            tokens.append(name)
    return tuple(tokens)


class RankGrid:
    """Megatron's rank layout for ``world_size`` ranks (``RankGenerator`` semantics).

    Args:
        world_size: number of ranks (GPUs).
        tp, pp, cp: tensor-, pipeline- and context-parallel sizes.
            ``dp = world_size // (tp*pp*cp)`` is derived, never given.
        ep, expert_tp: expert-model-parallel and expert tensor-parallel sizes
            (``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``; default tp).
        order: axes joined by '-', **first varies fastest** (Megatron's default
            ``"tp-cp-ep-dp-pp"``: TP neighbours get consecutive ranks, i.e. the same
            NVLink box; pipeline stages are the slowest axis).

    Like Megatron-core (MoE parallel folding, ``initialize_model_parallel``), the same
    ranks are numbered twice: ``groups``/``coords`` are the **dense** grid (ep = 1, so DP
    is world / (tp·pp·cp) whatever EP is) and ``expert_groups``/``expert_coords`` the
    **expert** grid (expert_tp × ep × expert_dp × pp, cp = 1), see :mod:`course_lib.moe.grid`.

    >>> g = RankGrid(8, tp=2, pp=2)
    >>> g.groups("tp"), g.groups("pp"), g.groups("dp")
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
    >>> g.coords(5)
    {'tp': 1, 'cp': 0, 'dp': 0, 'pp': 1}
    >>> g.rank_of(tp=1, dp=0, pp=1)
    5
    """

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 expert_tp: int | None = None, order: str = DEFAULT_ORDER):
        tp, pp, cp, ep = (rules.integer(AXIS_FLAG[n], v) for n, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)))
        # The dense grid has ep = 1 (Megatron-core since MoE parallel folding): EP never shrinks DP.
        dp = rules.data_parallel_size(world_size, tp, pp, cp)
        self.world_size = int(world_size)
        self.sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        self.order = parse_order(order, self.sizes)
        self._shape = [self.sizes[a] for a in self.order]  # fastest first
        self._stride = [math.prod(self._shape[:i]) for i in range(len(self._shape))]
        self._cache: dict[tuple, np.ndarray] = {}
        self._ep, self._expert_tp = ep, expert_tp
        self._moe = None
        if ep > 1 or expert_tp is not None:
            self.moe  # validate the expert grid now (Megatron's rules), not at first use

    @property
    def moe(self):
        """The dense + expert grids as :class:`course_lib.moe.grid.MoEGrid` (validated)."""
        if self._moe is None:
            from course_lib.moe.grid import MoEGrid  # moe.grid imports this module

            self._moe = MoEGrid(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self._ep,
                                expert_tp=self._expert_tp, order=self.order_str)
        return self._moe

    # ---- sizes -------------------------------------------------------------
    tp = property(lambda self: self.sizes["tp"])
    pp = property(lambda self: self.sizes["pp"])
    cp = property(lambda self: self.sizes["cp"])
    dp = property(lambda self: self.sizes["dp"], doc="data-parallel size, derived: world / (tp*pp*cp), whatever ep is")
    ep = property(lambda self: self._ep, doc="expert-model-parallel size (the expert grid's; the dense grid has ep = 1)")
    expert_tp = property(lambda self: self.moe.expert_tp, doc="expert tensor-parallel size (default: tp)")
    expert_dp = property(lambda self: self.moe.expert_dp, doc="expert data-parallel size: world / (expert_tp*ep*pp)")

    @property
    def order_str(self) -> str:
        return "-".join(self.order)

    @property
    def axes(self) -> tuple[str, ...]:
        """Axes reported by ``coords`` (the dense grid's: tp, cp, dp, pp), in grid order."""
        return tuple(a for a in self.order if a != "ep")

    def __repr__(self) -> str:
        expert = (f", ep={self.ep}, expert_tp={self.expert_tp}, expert_dp={self.expert_dp}"
                  if self._moe is not None else "")
        return (f"RankGrid(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, "
                f"dp={self.dp}{expert}, order='{self.order_str}')")

    # ---- coordinates ---------------------------------------------------------
    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is outside the grid; use 0 <= rank < world_size={self.world_size}")
        return int(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` in the dense grid: ``{'tp': .., 'cp': .., 'dp': .., 'pp': ..}``
        (its place in the expert grid: :meth:`expert_coords`)."""
        rank = self._check_rank(rank)
        idx = {a: (rank // d) % s for a, s, d in zip(self.order, self._shape, self._stride)}
        return {a: idx[a] for a in self.axes}

    def rank_of(self, **coords: int) -> int:
        """Inverse of ``coords``: ``rank_of(tp=1, dp=0, pp=1)``. Omitted axes count as 0."""
        for a in coords:
            if a not in AXES:
                raise ValueError(f"unknown axis {a!r} in rank_of(); use {', '.join(AXES)}")
        rank = 0
        for a, s, d in zip(self.order, self._shape, self._stride):
            i = coords.get(a, 0)
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < s:
                raise ValueError(f"{a}={i!r} is outside 0..{s - 1} ({a} size is {s})")
            rank += int(i) * d
        return rank

    # ---- groups -------------------------------------------------------------
    def _parse_token(self, token: str) -> tuple[str, ...]:
        if not isinstance(token, str) or not token.strip():
            raise ValueError(f"token={token!r} must name axes joined by '-', e.g. 'tp' or 'dp-cp'")
        parts = [t.strip() for t in token.lower().split("-")]
        for t in parts:
            if t not in AXES:
                raise ValueError(f"token={token!r} has unknown axis {t!r}; use {', '.join(AXES)} joined by '-', "
                                 f"or one of {', '.join(SPECIAL_TOKENS)}")
        if len(set(parts)) != len(parts):
            raise ValueError(f"token={token!r} repeats an axis; list each axis once, e.g. 'dp-cp'")
        return tuple(sorted(parts, key=self.order.index))

    def group_array(self, token: str) -> np.ndarray:
        """Groups of ``token`` as a read-only int array of shape [num_groups, group_size]."""
        token = token.strip().lower() if isinstance(token, str) else token
        if token in SPECIAL_TOKENS:
            key = (token,)
            if key not in self._cache:
                pp = self.group_array("pp")
                cols = [0] if token == "position_embedding" or self.pp == 1 else [0, -1]
                arr = np.ascontiguousarray(pp[:, cols])
                arr.setflags(write=False)
                self._cache[key] = arr
            return self._cache[key]
        masked = self._parse_token(token)
        if masked not in self._cache:
            k = len(self.order)
            # numpy is slowest-axis-first: order axis i is numpy axis k-1-i.
            grid = np.arange(self.world_size, dtype=np.int64).reshape(self._shape[::-1])
            unmasked = [i for i in range(k) if self.order[i] not in masked]
            inside = [i for i in range(k) if self.order[i] in masked]
            # Group index enumerates the other axes (first fastest), rank-in-group the
            # token's axes (first fastest): Megatron's generate_masked_orthogonal_rank_groups.
            perm = [k - 1 - i for i in reversed(unmasked)] + [k - 1 - i for i in reversed(inside)]
            size = math.prod(self.sizes[a] for a in masked)
            arr = np.ascontiguousarray(grid.transpose(perm).reshape(-1, size))
            arr.setflags(write=False)
            self._cache[masked] = arr
        return self._cache[masked]

    def groups(self, token: str) -> list[list[int]]:
        """Every group of ``token``, each a list of global ranks in group-rank order.

        ``token``: axes joined by '-' in any order (``"tp"``, ``"dp"``, ``"dp-cp"``,
        ``"tp-pp"`` = Megatron's model-parallel group, ``"tp-dp-cp"``, ...), or
        ``"embedding"`` (first and last rank of each pipeline group; only the first
        when pp == 1) or ``"position_embedding"`` (first rank of each pipeline group).
        Identical to ``RankGenerator.get_ranks(token)`` / initialize_model_parallel.
        """
        return self.group_array(token).tolist()

    def group_of(self, rank: int, token: str) -> list[int] | None:
        """The ``token`` group that contains ``rank`` (None: rank is in no
        embedding / position-embedding group, e.g. a middle pipeline stage)."""
        rank = self._check_rank(rank)
        arr = self.group_array(token)
        hit = np.nonzero((arr == rank).any(axis=1))[0]
        return arr[hit[0]].tolist() if len(hit) else None

    def groups_of(self, rank: int, tokens: Iterable[str] | None = None) -> dict[str, list[int] | None]:
        """``{token: group containing rank}`` for the main groups (see ``main_tokens``)."""
        return {t: self.group_of(rank, t) for t in (tokens or self.main_tokens())}

    # ---- the expert grid (MoE layers) ------------------------------------------
    def expert_groups(self, token: str) -> list[list[int]]:
        """Groups of the expert grid (Megatron's second ``RankGenerator``: expert_tp × ep ×
        expert_dp × pp, cp = 1): ``"ep"`` (token all-to-all), ``"tp"`` (expert TP), ``"dp"``
        (expert DP: expert-gradient reduction), ``"pp"``, ``"tp-ep"``, ``"tp-ep-pp"``."""
        return self.moe.expert_groups(token)

    def expert_group_of(self, rank: int, token: str) -> list[int]:
        """The expert-grid ``token`` group that contains ``rank``."""
        return self.moe.expert_group_of(self._check_rank(rank), token)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` in the expert grid: ``{'tp', 'ep', 'dp', 'pp'}`` (each its
        index inside that expert group)."""
        rank = self._check_rank(rank)
        return {a: self.moe.expert_group_of(rank, a).index(rank) for a in ("tp", "ep", "dp", "pp")}

    def main_tokens(self) -> list[str]:
        """The dense groups worth showing for this grid: tp, cp, dp (dp-cp), pp, tp-pp, embedding."""
        toks = ["tp"]
        if self.cp > 1:
            toks.append("cp")
        toks.append("dp")
        if self.cp > 1:
            toks.append("dp-cp")
        toks += ["pp", "tp-pp", "embedding"]
        return toks

    def stage_ranks(self, stage: int) -> list[int]:
        """All ranks on pipeline stage ``stage`` (pp coordinate), ascending."""
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage={stage} is outside 0..{self.pp - 1}")
        return sorted(int(g[stage]) for g in self.group_array("pp"))

    # ---- text ----------------------------------------------------------------
    def table(self, tokens: Iterable[str] | None = None, max_groups: int = 64) -> str:
        """A plain-text table of groups (one line per token) for printing."""
        lines = [f"{self!r}", f"{'group':<20} {'size':>4} {'count':>5}  groups"]
        for t in (tokens or self.main_tokens()):
            arr = self.group_array(t)
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in arr[:max_groups].tolist())
            if len(arr) > max_groups:
                shown += f" ... ({len(arr) - max_groups} more)"
            lines.append(f"{t:<20} {arr.shape[1]:>4} {arr.shape[0]:>5}  {shown}")
        if tokens is None and self.ep > 1:
            for t in ("ep", "tp", "dp"):
                groups = self.expert_groups(t)
                shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:max_groups])
                if len(groups) > max_groups:
                    shown += f" ... ({len(groups) - max_groups} more)"
                lines.append(f"{'expert ' + t:<20} {len(groups[0]):>4} {len(groups):>5}  {shown}")
        return "\n".join(lines)

    def coords_table(self) -> str:
        """One line per rank: its coordinates."""
        head = "rank " + " ".join(f"{a:>3}" for a in self.axes)
        rows = [f"{r:>4} " + " ".join(f"{v:>3}" for v in self.coords(r).values()) for r in range(self.world_size)]
        return "\n".join([head] + rows)


# --------------------------------------------------------------------------------------
# Whole-run configuration: the checks Megatron's validate_args / initialize_model_parallel do
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelConfig:
    """A Megatron-style parallel training configuration, validated on creation.

    Fields follow Megatron's argument names (``--tensor-model-parallel-size`` is
    ``tp`` here, etc.). Model sizes left as ``None`` are not checked, so
    ``ParallelConfig(world_size=8, tp=2, pp=2)`` validates just the grid.

    Derived: ``dp`` (= world / (tp·pp·cp), never a flag), ``num_microbatches``
    (= global / (micro·dp)), ``grid`` (the ``RankGrid``), ``layers_per_stage``, ``vpp``
    (model chunks per pipeline rank, 1 without interleaving) and ``notes`` (what was
    adjusted, one line each).

    The rules are :mod:`course_lib.rules`' (each a one-line ValueError naming the rule and a fix):
      * world_size % (tp·pp·cp) == 0 (``data_parallel_size``)
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
    grid: RankGrid = field(init=False, repr=False, compare=False)
    notes: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        grid = RankGrid(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, order=self.order)
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
                    raise ValueError(f"{name}={v} needs num_layers; give num_layers too")
            return None
        return rules.pipeline_split(self.num_layers, self.pp, first, last)

    # ---- derived -------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.grid.dp

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
            raise ValueError("layers_per_stage() needs num_layers; give num_layers")
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

