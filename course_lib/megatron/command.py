"""The real Megatron-LM commands for a Day 22 configuration.

``megatron_command(config)`` renders the ``torchrun ... pretrain_gpt.py`` command
for a ``course_lib.topology.ParallelConfig`` (the same validated object the CPU
labs use, so a configuration that is wrong here is wrong there, with the same
one-line error). ``preprocess_command()`` renders Megatron's
``tools/preprocess_data.py`` call for the tiny corpus, ``run_tiny_gpt_script()``
the seed's ``run_tiny_gpt.sh`` (env ``GPUS TP PP CP``) and ``sweep_script()`` the
seed's A-F loop that saves ``logs/day22/<config>.log``.

Every flag printed is listed, with the Megatron-LM file and function (or config
dataclass) that defines it, in ``course_lib/megatron/flags.py``. Things the seed
gets wrong and the commands here get right:

* ``tools/preprocess_data.py`` requires ``--workers`` (``required=True`` in
  ``get_args``); the seed's command omits it and fails.
* With TP > 1 or CP > 1 on GPUs before Blackwell, ``validate_args`` asserts
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (``megatron/training/arguments.py`` at core_v0.15.3,
  core_v0.16.1 and main d98e8a6), so the commands export it -- except with Megatron-FSDP,
  where it asserts the opposite (unset or > 1) and only warns about TP/CP.
* DP is never a flag; ``--context-parallel-size`` is printed only when CP > 1, so
  A-E also run on branches older than context parallelism.
* Interleaved pipelining is ``--num-layers-per-virtual-pipeline-stage``
  (layers / (PP * VPP)), or ``--num-virtual-stages-per-pipeline-rank`` with an uneven
  split (``validate_args`` refuses the former there); Megatron has no
  ``--virtual-pipeline-model-parallel-size``.
* ``--sequence-parallel`` with TP = 1 is turned off with a one-line note, as Megatron
  does (and the course's trainer and planner).

Beyond one node and dense models (flags in ``flags.SHARDING_FLAGS`` / ``flags.MOE_FLAGS``, checked at
core_v0.16.1 and main):

* ``--nodes N --gpus-per-node G``: the multi-node launch (:func:`cluster_launch`, rendered by
  :mod:`course_lib.launch.cluster`): torchrun with c10d or static rendezvous on every node, and a
  Slurm ``sbatch`` script running one torchrun per node with ``srun``.
* ``--sharding dist-opt|fsdp-optim-grads|fsdp|offload`` (``--show sharding``: all four): Megatron's
  distributed optimizer (ZeRO-1) and Megatron-FSDP (ZeRO-2/3), with overlap, and CPU offload of
  the optimizer (:data:`SHARDING`; the rules each follows are beside it). Megatron-FSDP keeps its
  grads in the param dtype at main (``--megatron-fsdp-main-grads-dtype auto``, not printed);
  ``--megatron-fsdp-main-grads-dtype fp32`` prints the flag for fp32 grads (main only:
  ``flags.MAIN_ONLY_FLAGS``).
* ``--num-experts E --ep EP [--expert-tensor-parallel-size T --moe-router-topk K]``: a Mixtral-style
  MoE (:class:`MoESpec`), checked by the course's rules (``rules.moe_experts``, the expert grid of
  ``course_lib.topology.RankGrid``).

CLI: ``python -m course_lib megatron-cmd --tp 2 --pp 2 --cp 1 --nproc 8`` (see
``add_arguments``). ``--data-dir`` is shell-quoted in every line printed (a path with
spaces or ``$`` is safe to paste); ``--export-corpus PATH`` never replaces an existing
file without ``--force``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from course_lib import rules
from course_lib.sizing.memory import FSDP_MAIN_GRADS_DTYPES
from course_lib.topology import ParallelConfig
from course_lib.topology.seed import SEED_SWEEP

# The seed's GPU model: 8 layers so PP = 1/2/4 divide, 8 heads so TP = 1/2/4/8 divide.
SEED_MODEL = {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8}
# Batch shape for the GPU runs: 4 x 16 = 64 sequences of 1024 tokens; E (PP 4, DP 2)
# gets 64 / (4*2) = 8 micro-batches = 2*PP, enough to keep its bubble at (4-1)/8.
DEFAULT_SEQ_LENGTH = 1024
DEFAULT_MICRO_BATCH_SIZE = 4
DEFAULT_GLOBAL_BATCH_SIZE = 64
PRECISIONS = ("bf16", "fp16", "fp32")
GPT2_VOCAB_URL = "https://huggingface.co/gpt2/resolve/main/vocab.json"
GPT2_MERGES_URL = "https://huggingface.co/gpt2/resolve/main/merges.txt"


@dataclass(frozen=True)
class Sharding:
    """One way Megatron-LM shards the training state over the data-parallel (x CP) ranks."""

    zero: str                                  # the ZeRO stage it corresponds to (Rajbhandari et al. 2020)
    what: str                                  # what each DP rank keeps 1/d of
    flags: tuple[tuple[str, str | None], ...]
    fsdp: bool = False


# The distributed-optimizer / Megatron-FSDP variants (issue 14). Every flag is in flags.SHARDING_FLAGS
# (checked at core_v0.16.1 and main). Rules they follow, from validate_args (main d98e8a6):
# --overlap-param-gather needs the distributed optimizer or Megatron-FSDP, and --overlap-grad-reduce;
# Megatron-FSDP needs --ckpt-format fsdp_dtensor (and, v1, turns on the distributed optimizer itself);
# --optimizer-cpu-offload needs --use-precision-aware-optimizer. The sharding strategy's default
# changed ('no_shard' at core_v0.16.1, 'optim_grads_params' at main), so it is always spelled out.
_OVERLAP = (("--overlap-grad-reduce", None), ("--overlap-param-gather", None))
SHARDING = {
    "dist-opt": Sharding("ZeRO-1", "fp32 main params and Adam state; grads reduce-scattered, params all-gathered",
                         (("--use-distributed-optimizer", None),) + _OVERLAP),
    "fsdp-optim-grads": Sharding("ZeRO-2", "optimizer state and grads (Megatron-FSDP; at main the grads are in the "
                                           "param dtype unless --megatron-fsdp-main-grads-dtype fp32)",
                                 (("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads"),
                                  ("--ckpt-format", "fsdp_dtensor")) + _OVERLAP, fsdp=True),
    "fsdp": Sharding("ZeRO-3", "params, grads and optimizer state; params all-gathered just before use (grads "
                               "as ZeRO-2's)",
                     (("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params"),
                      ("--ckpt-format", "fsdp_dtensor")) + _OVERLAP, fsdp=True),
    "offload": Sharding("ZeRO-1 + offload", "as dist-opt, with Adam state and the update on the host (CPU)",
                        (("--use-distributed-optimizer", None), ("--optimizer-cpu-offload", None),
                         ("--optimizer-offload-fraction", "1.0"), ("--use-precision-aware-optimizer", None))
                        + _OVERLAP),
}


@dataclass(frozen=True)
class MoESpec:
    """A Mixtral-style MoE (Jiang et al. 2024: 8 experts, top-2; SwiGLU experts, RMSNorm, RoPE, no
    biases, untied embeddings) in Megatron-LM's flags (``flags.MOE_FLAGS``).

    ``expert_tensor_parallel_size`` ``None`` means TP (Megatron's default, ``validate_args``);
    ``moe_ffn_hidden_size`` ``None`` means 3.5 x hidden (Mixtral-8x7B: 14336 / 4096).
    ``moe_grouped_gemm`` is printed only with Transformer Engine (the default ``--transformer-impl``):
    TE's GroupedLinear; ``validate_args`` asserts compute capability >= 8.
    """

    num_experts: int
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2
    moe_ffn_hidden_size: int | None = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_grouped_gemm: bool = True

    def __post_init__(self):
        rules.integer("expert-model-parallel-size", self.expert_model_parallel_size)
        rules.moe_experts(rules.integer("num-experts", self.num_experts), self.expert_model_parallel_size)
        if self.expert_tensor_parallel_size is not None:
            rules.integer("expert-tensor-parallel-size", self.expert_tensor_parallel_size)
        rules.integer("moe-router-topk", self.moe_router_topk, maximum=self.num_experts)
        rules.number("moe-aux-loss-coeff", self.moe_aux_loss_coeff, 0.0)
        if self.moe_ffn_hidden_size is not None:
            rules.integer("moe-ffn-hidden-size", self.moe_ffn_hidden_size)
        rules.moe_dispatcher(self.moe_token_dispatcher_type)

    def grid(self, cfg: ParallelConfig):
        """The dense and expert grids (``RankGrid``: world divisible by expert-TP x EP x PP, and the rest)."""
        from course_lib.topology import RankGrid

        return RankGrid(cfg.world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=self.expert_model_parallel_size,
                        expert_tp=self.expert_tensor_parallel_size)

    def args(self, cfg: ParallelConfig, transformer_impl: str | None) -> list[tuple[str, str | None]]:
        self.grid(cfg)
        ffn = self.moe_ffn_hidden_size or cfg.hidden_size * 7 // 2
        args = [("--num-experts", str(self.num_experts)),
                ("--expert-model-parallel-size", str(self.expert_model_parallel_size))]
        if self.expert_tensor_parallel_size is not None:
            args.append(("--expert-tensor-parallel-size", str(self.expert_tensor_parallel_size)))
        args += [("--moe-router-topk", str(self.moe_router_topk)),
                 ("--moe-router-load-balancing-type", "aux_loss"),
                 ("--moe-aux-loss-coeff", f"{self.moe_aux_loss_coeff:g}"),
                 ("--moe-token-dispatcher-type", self.moe_token_dispatcher_type),
                 ("--moe-ffn-hidden-size", str(ffn))]
        if self.moe_grouped_gemm and transformer_impl != "local":
            args.append(("--moe-grouped-gemm", None))
        return args + [("--swiglu", None), ("--normalization", "RMSNorm"), ("--position-embedding-type", "rope"),
                       ("--disable-bias-linear", None), ("--untie-embeddings-and-output-weights", None)]

    def notes(self, cfg: ParallelConfig, transformer_impl: str | None) -> list[str]:
        g = self.grid(cfg)
        out = [f"MoE: {self.num_experts} experts, top-{self.moe_router_topk}; expert grid expert-TP {g.expert_tp} x "
               f"EP {g.ep} x expert-DP {g.expert_dp} x PP {g.pp} ({self.num_experts // g.ep} "
               f"expert{'s' if self.num_experts // g.ep > 1 else ''} per rank); "
               f"dense DP stays {g.dp}"]
        if cfg.tp > 1 and not cfg.sequence_parallel:
            out.append("Megatron will not train this: with TP > 1, MoELayer.forward raises in training unless "
                       "--sequence-parallel is on (moe_layer.py; ModelParallelConfig only warns, with EP > 1): "
                       "add --sp")
        if self.moe_grouped_gemm and transformer_impl == "local":
            out.append("--moe-grouped-gemm left out: it is Transformer Engine's GroupedLinear")
        return out


@dataclass(frozen=True)
class MegatronRun:
    """Everything a ``pretrain_gpt.py`` command needs besides the parallel layout and model.

    ``data_dir`` is relative to the Megatron-LM checkout (the commands run there, as in
    the seed). ``precision`` is one of ``bf16``/``fp16``/``fp32`` (fp32: no flag).
    ``transformer_impl='local'`` avoids Transformer Engine (not available everywhere;
    context parallelism needs it). The checkpoint fields are Megatron's flags of the same names
    (``flags.CHECKPOINT_FLAGS``; ``ckpt_format`` ``None``: Megatron's default ``torch_dist``, not
    printed; Megatron-FSDP prints ``fsdp_dtensor`` itself), checked by ``rules.checkpoint_flags``.
    ``megatron_fsdp_main_grads_dtype``: Megatron-FSDP's ``--megatron-fsdp-main-grads-dtype`` (``None``:
    Megatron's default ``auto``, the param dtype, not printed); only with a Megatron-FSDP ``sharding``.
    """

    train_iters: int = 100
    lr: float = 3.0e-4
    min_lr: float = 3.0e-5
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 10
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    precision: str = "bf16"
    use_distributed_optimizer: bool = False
    sharding: str | None = None
    log_interval: int = 10
    log_throughput: bool = True
    eval_interval: int = 1000
    eval_iters: int = 10
    split: str = "949,50,1"
    data_dir: str = "data/tiny"
    transformer_impl: str | None = None
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    ckpt_format: str | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    megatron_fsdp_main_grads_dtype: str | None = None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise rules.UsageError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for name in ("train_iters", "log_interval", "eval_interval"):
            rules.integer(name, getattr(self, name))
        for name in ("lr_warmup_iters", "eval_iters", "seed"):
            rules.integer(name, getattr(self, name), 0)
        for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
            rules.number(name, getattr(self, name), 0.0)
        rules.min_lr(self.min_lr, self.lr)
        if self.sharding is not None and self.sharding not in SHARDING:
            raise rules.UsageError(f"sharding={self.sharding!r} is unknown; use one of {', '.join(SHARDING)}")
        if self.transformer_impl not in (None, "local", "transformer_engine"):
            raise rules.UsageError(f"transformer_impl={self.transformer_impl!r} must be 'local' or 'transformer_engine'")
        _check_path("data_dir", self.data_dir)
        for name in ("save", "load"):
            if getattr(self, name) is not None:
                _check_path(name, getattr(self, name))
        rules.checkpoint_flags(save=self.save, load=self.load, save_interval=self.save_interval,
                               exit_interval=self.exit_interval, ckpt_format=self.ckpt_format or "torch_dist",
                               finetune=self.finetune, no_load_optim=self.no_load_optim, no_load_rng=self.no_load_rng)
        if self.megatron_fsdp:
            rules.megatron_fsdp_checkpoint(self.ckpt_format)
        if self.megatron_fsdp_main_grads_dtype is not None:
            if self.megatron_fsdp_main_grads_dtype not in FSDP_MAIN_GRADS_DTYPES:
                raise rules.UsageError(f"megatron_fsdp_main_grads_dtype={self.megatron_fsdp_main_grads_dtype!r} is not one "
                                       f"of {', '.join(FSDP_MAIN_GRADS_DTYPES)} (Megatron-LM main's choices)")
            if not self.megatron_fsdp:
                raise rules.UsageError(f"--megatron-fsdp-main-grads-dtype {self.megatron_fsdp_main_grads_dtype} sets "
                                       f"Megatron-FSDP's grad buffer; sharding={self.sharding!r} is not Megatron-FSDP: use "
                                       f"--sharding fsdp or fsdp-optim-grads, or drop the flag")

    @property
    def megatron_fsdp(self) -> bool:
        """Whether the run shards with Megatron-FSDP (``--use-megatron-fsdp``)."""
        return self.sharding is not None and SHARDING[self.sharding].fsdp

    @property
    def data_prefix(self) -> str:
        """What ``preprocess_command`` writes: ``<output-prefix>_text_document`` (.bin/.idx)."""
        return f"{self.data_dir}/gpt_text_text_document"


def _check_path(name: str, path) -> None:
    """A path (``data_dir``, ``save``, ``load``) every printed command can carry safely (each line quotes
    it with ``shlex.quote``)."""
    if not isinstance(path, str) or not path:
        raise rules.UsageError(f"{name}={path!r} must be a non-empty path")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in path):
        raise rules.UsageError(f"{name}={path!r} holds a control character (newline, tab, ...); choose a plain path")
    if path.startswith("-"):
        raise rules.UsageError(f"{name}={path!r} starts with '-' and would read as an option; write ./{path}")


def gpu_config(tp: int = 1, pp: int = 1, cp: int = 1, nproc: int = 8, *, seq_length: int = DEFAULT_SEQ_LENGTH,
               micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE,
               global_batch_size: int = DEFAULT_GLOBAL_BATCH_SIZE, sequence_parallel: bool = False,
               vpp: int | None = None, **model) -> ParallelConfig:
    """A validated ``ParallelConfig`` for the seed's GPU model (override sizes via ``model``)."""
    sizes = {**SEED_MODEL, **model}
    return ParallelConfig(world_size=nproc, tp=tp, pp=pp, cp=cp, seq_length=seq_length,
                          micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                          sequence_parallel=sequence_parallel,
                          virtual_pipeline_model_parallel_size=vpp, **sizes)


def _as_config(config) -> ParallelConfig:
    if isinstance(config, ParallelConfig):
        cfg = config
    elif isinstance(config, dict):
        cfg = ParallelConfig(**config)
    else:
        raise rules.UsageError(f"config must be a ParallelConfig or a dict of its fields, got {type(config).__name__}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(cfg, name) is None:
            raise rules.UsageError(f"a Megatron command needs {name}; give it in the config (e.g. gpu_config(...))")
    return cfg


def pretrain_args(config, run: MegatronRun | None = None,
                  moe: MoESpec | None = None) -> list[tuple[str, str | None]]:
    """The ``pretrain_gpt.py`` arguments as ``(flag, value)`` pairs (value ``None`` for switches):
    the config's own (:meth:`ParallelConfig.megatron_args`, the one renderer of a layout's
    flags), the MoE's (``moe``), then the run's."""
    cfg, run = _as_config(config), run or MegatronRun()
    args = cfg.megatron_args() + (moe.args(cfg, run.transformer_impl) if moe else []) + [
        ("--train-iters", str(run.train_iters)),
        ("--lr", f"{run.lr:g}"),
        ("--min-lr", f"{run.min_lr:g}"),
        ("--lr-decay-style", run.lr_decay_style),
        ("--lr-warmup-iters", str(run.lr_warmup_iters)),
        ("--weight-decay", f"{run.weight_decay:g}"),
        ("--clip-grad", f"{run.clip_grad:g}"),
        ("--seed", str(run.seed)),
    ]
    sharding = SHARDING[run.sharding].flags if run.sharding else ()
    if run.use_distributed_optimizer and ("--use-distributed-optimizer", None) not in sharding:
        args.append(("--use-distributed-optimizer", None))
    args += list(sharding)
    if run.precision != "fp32":
        args.append((f"--{run.precision}", None))
    if run.megatron_fsdp_main_grads_dtype is not None:
        args.append(("--megatron-fsdp-main-grads-dtype", run.megatron_fsdp_main_grads_dtype))
    if run.transformer_impl is not None:
        args.append(("--transformer-impl", run.transformer_impl))
    args += checkpoint_args(run)
    args += [
        ("--data-path", run.data_prefix),
        ("--vocab-file", f"{run.data_dir}/gpt2-vocab.json"),
        ("--merge-file", f"{run.data_dir}/gpt2-merges.txt"),
        ("--tokenizer-type", "GPT2BPETokenizer"),
        ("--split", run.split),
        ("--log-interval", str(run.log_interval)),
    ]
    if run.log_throughput:
        args.append(("--log-throughput", None))
    args += [("--eval-interval", str(run.eval_interval)), ("--eval-iters", str(run.eval_iters))]
    return args


def checkpoint_args(run: MegatronRun) -> list[tuple[str, str | None]]:
    """The run's checkpoint flags, as ``(flag, value)`` pairs, in Megatron's names (``flags.CHECKPOINT_FLAGS``);
    ``--ckpt-format`` only when given and not already printed by a Megatron-FSDP variant."""
    values = [("--save", run.save), ("--save-interval", run.save_interval), ("--load", run.load),
              ("--exit-interval", run.exit_interval),
              ("--ckpt-format", None if run.megatron_fsdp else run.ckpt_format)]
    args = [(flag, str(value)) for flag, value in values if value is not None]
    return args + [(flag, None) for flag, on in (("--no-load-optim", run.no_load_optim),
                                                 ("--no-load-rng", run.no_load_rng),
                                                 ("--finetune", run.finetune)) if on]


def _render(prefix: str, args: list[tuple[str, str | None]]) -> str:
    lines = [prefix]
    for flag, value in args:
        lines.append(f"    {flag}" + ("" if value is None else f" {shlex.quote(value)}"))
    return " \\\n".join(lines)


def megatron_command(config, run: MegatronRun | None = None, moe: MoESpec | None = None) -> str:
    """The ``torchrun ... pretrain_gpt.py`` command (run inside a Megatron-LM checkout).

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set except with Megatron-FSDP, where ``validate_args``
    asserts it is unset or > 1 (:mod:`course_lib.launch.cluster`).

    >>> print(megatron_command(gpu_config(tp=2, pp=2)).splitlines()[0])
    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node 8 pretrain_gpt.py \\
    """
    cfg, run = _as_config(config), run or MegatronRun()
    args = pretrain_args(cfg, run, moe)
    env = "" if run.megatron_fsdp else "CUDA_DEVICE_MAX_CONNECTIONS=1 "
    return _render(f"{env}torchrun --nproc_per_node {cfg.world_size} pretrain_gpt.py", args)


def cluster_launch(config, run: MegatronRun | None = None, moe: MoESpec | None = None, *, nodes: int,
                   gpus_per_node: int, debug: bool = False) -> str:
    """The multi-node launch of ``pretrain_gpt.py``: torchrun on every node (c10d, or static) and a
    Slurm sbatch script (:func:`course_lib.launch.cluster.launch_text`). ``nodes x gpus_per_node``
    must equal the config's world size."""
    from course_lib.launch import cluster

    cfg, run = _as_config(config), run or MegatronRun()
    nodes, gpus = rules.integer("nodes", nodes), rules.integer("gpus_per_node", gpus_per_node)
    if nodes * gpus != cfg.world_size:
        raise rules.UsageError(f"nodes={nodes} × gpus_per_node={gpus} = {nodes * gpus} is not the world size "
                               f"{cfg.world_size}; give --nproc {nodes * gpus} or leave --nproc out")
    program = ["pretrain_gpt.py"] + [x for f, v in pretrain_args(cfg, run, moe) for x in ([f] if v is None else [f, v])]
    env = cluster.environment(tp=cfg.tp, cp=cfg.cp, megatron_fsdp=run.megatron_fsdp, debug=debug)
    return cluster.launch_text(program, nodes, gpus, env=env, job_name="megatron")


def describe(config) -> str:
    """One comment line: how the world splits and how many micro-batches a step has."""
    cfg = _as_config(config)
    return (f"# world {cfg.world_size} = TP {cfg.tp} x PP {cfg.pp} x CP {cfg.cp} x DP {cfg.dp} (DP derived); "
            f"{cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} per step "
            f"(global batch {cfg.effective_global_batch_size})")


def preprocess_command(run: MegatronRun | None = None, workers: int = 1) -> str:
    """Megatron's ``tools/preprocess_data.py`` for the tiny corpus (GPT-2 BPE, eod appended).

    Writes ``<data_dir>/gpt_text_text_document.bin/.idx``: the tool names its output
    ``{output_prefix}_{json_key}_document``."""
    run = run or MegatronRun()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise rules.UsageError(f"workers={workers!r} must be a positive integer")
    d = run.data_dir
    return _render("python tools/preprocess_data.py", [
        ("--input", f"{d}/corpus.jsonl"),
        ("--output-prefix", f"{d}/gpt_text"),
        ("--tokenizer-type", "GPT2BPETokenizer"),
        ("--vocab-file", f"{d}/gpt2-vocab.json"),
        ("--merge-file", f"{d}/gpt2-merges.txt"),
        ("--append-eod", None),
        ("--json-keys", "text"),
        ("--workers", str(workers)),
    ])


def setup_commands(run: MegatronRun | None = None) -> str:
    """The seed's setup, with files the course makes (nothing downloaded but Megatron-LM itself): the
    corpus as JSON lines, the course's GPT-2-format BPE files (:mod:`course_lib.data.train_tokenizer`),
    then ``tools/preprocess_data.py`` -- or the course's ``preprocess``, which writes the same bytes.
    ``tests/data/test_setup_commands.py`` runs the course's lines and checks the files."""
    run = run or MegatronRun()
    d, q = run.data_dir, shlex.quote
    return "\n".join([
        "# 1. Megatron-LM (the commands below run inside the checkout)",
        "git clone https://github.com/NVIDIA/Megatron-LM.git",
        "cd Megatron-LM",
        "python -m pip install uv && uv pip install -e .",
        "",
        "# 2. the course corpus as JSON lines (run where course_lib is installed)",
        f"mkdir -p {q(d)}",
        f"python -m course_lib megatron-cmd --export-corpus {q(f'{d}/corpus.jsonl')}",
        "",
        "# 3. GPT-2-format BPE files: the course's byte-level BPE trained on the corpus",
        f"#    (GPT-2's own 50257 tokens instead: wget -O {q(f'{d}/gpt2-vocab.json')} {GPT2_VOCAB_URL}",
        f"#    and wget -O {q(f'{d}/gpt2-merges.txt')} {GPT2_MERGES_URL})",
        course_tokenizer_command(run),
        "",
        f"# 4. indexed dataset: writes {q(run.data_prefix)}.bin/.idx",
        f"#    (the same bytes without Megatron-LM: python -m course_lib preprocess with these flags)",
        preprocess_command(run),
    ])


def course_tokenizer_command(run: MegatronRun | None = None) -> str:
    """``python -m course_lib tokenizer``: the ``--vocab-file``/``--merge-file`` that the commands read."""
    run = run or MegatronRun()
    return _render("python -m course_lib tokenizer", [("--vocab-file", f"{run.data_dir}/gpt2-vocab.json"),
                                                      ("--merge-file", f"{run.data_dir}/gpt2-merges.txt")])


def run_tiny_gpt_script(run: MegatronRun | None = None, *, seq_length: int = DEFAULT_SEQ_LENGTH,
                        micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE,
                        global_batch_size: int = DEFAULT_GLOBAL_BATCH_SIZE) -> str:
    """The seed's ``run_tiny_gpt.sh``: ``GPUS=8 TP=2 PP=2 [CP=2] [SP=1] [VPP=2] ./run_tiny_gpt.sh``.

    The same flags as ``megatron_command`` (a test runs the script with a stub
    ``torchrun`` and compares), and the same divisibility rules, checked in bash
    before anything starts."""
    run = run or MegatronRun()
    m = SEED_MODEL
    fixed = [a for a in pretrain_args(gpu_config(seq_length=seq_length, micro_batch_size=micro_batch_size,
                                                 global_batch_size=global_batch_size), run)
             if a[0] not in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size")]
    flag_lines = "".join(f"    {f}" + ("" if v is None else f" {shlex.quote(v)}") + " \\\n" for f, v in fixed)
    flag_lines = flag_lines.replace(f"--num-layers {m['num_layers']} ", '--num-layers "$NUM_LAYERS" ')
    flag_lines = flag_lines.replace(f"--num-attention-heads {m['num_attention_heads']} ",
                                    '--num-attention-heads "$HEADS" ')
    flag_lines = flag_lines.replace(f"--seq-length {seq_length} ", '--seq-length "$SEQ" ')
    flag_lines = flag_lines.replace(f"--max-position-embeddings {seq_length} ", '--max-position-embeddings "$SEQ" ')
    flag_lines = flag_lines.replace(f"--micro-batch-size {micro_batch_size} ", '--micro-batch-size "$MBS" ')
    flag_lines = flag_lines.replace(f"--global-batch-size {global_batch_size} ", '--global-batch-size "$GBS" ')
    flag_block = flag_lines[:-len(" \\\n")]  # no continuation after the last flag
    return f"""#!/usr/bin/env bash
# run_tiny_gpt.sh -- Day 22: a tiny GPT with Megatron-LM on one node.
# Generated by `python -m course_lib megatron-cmd --show script`; run it inside the Megatron-LM checkout:
#   GPUS=8 TP=2 PP=2 ./run_tiny_gpt.sh          (optional: CP=2, SP=1 sequence parallel, VPP=2 interleaved)
set -euo pipefail
GPUS=${{GPUS:-8}}; TP=${{TP:-1}}; PP=${{PP:-1}}; CP=${{CP:-1}}; SP=${{SP:-0}}; VPP=${{VPP:-1}}
NUM_LAYERS={m['num_layers']}; HEADS={m['num_attention_heads']}; SEQ={seq_length}; MBS={micro_batch_size}; GBS={global_batch_size}

fail() {{ echo "run_tiny_gpt.sh: $*" >&2; exit 2; }}
(( GPUS % (TP * PP * CP) == 0 )) || fail "GPUS=$GPUS is not divisible by TP*PP*CP=$(( TP * PP * CP )); DP must be a whole number"
DP=$(( GPUS / (TP * PP * CP) ))
(( HEADS % TP == 0 )) || fail "num-attention-heads=$HEADS is not divisible by TP=$TP; use TP in 1 2 4 8"
(( NUM_LAYERS % PP == 0 )) || fail "num-layers=$NUM_LAYERS is not divisible by PP=$PP; use PP in 1 2 4 8"
(( GBS % (MBS * DP) == 0 )) || fail "global-batch-size=$GBS is not divisible by micro-batch-size*DP=$(( MBS * DP ))"
(( CP == 1 || SEQ % (2 * CP) == 0 )) || fail "seq-length=$SEQ is not divisible by 2*CP=$(( 2 * CP ))"
if (( SP == 1 && TP == 1 )); then echo "run_tiny_gpt.sh: SP=1 has no effect with TP=1: turned off, as Megatron does" >&2; SP=0; fi
(( VPP == 1 || (PP > 1 && (NUM_LAYERS / PP) % VPP == 0) )) || fail "VPP=$VPP needs PP > 1 and layers per stage divisible by VPP"
echo "world $GPUS = TP $TP x PP $PP x CP $CP x DP $DP; $(( GBS / (MBS * DP) )) micro-batches per step"

PARALLEL=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if (( CP > 1 )); then PARALLEL+=(--context-parallel-size "$CP"); fi
if (( SP == 1 )); then PARALLEL+=(--sequence-parallel); fi
if (( VPP > 1 )); then PARALLEL+=(--num-layers-per-virtual-pipeline-stage $(( NUM_LAYERS / PP / VPP ))); fi

# Megatron asserts this for TP > 1 or CP > 1 on GPUs before Blackwell.
export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nproc_per_node "$GPUS" pretrain_gpt.py \\
    "${{PARALLEL[@]}}" \\
{flag_block}
"""


def sweep_script(log_dir: str = "logs/day22") -> str:
    """The seed's loop over A-F on 8 GPUs, one log per config, then the record table."""
    cfgs = " ".join(f'"{n} {tp} {pp} {cp}"' for n, (tp, pp, cp) in SEED_SWEEP.items())
    return "\n".join([
        f"mkdir -p {log_dir}",
        f"for cfg in {cfgs}; do",
        "  read -r NAME TP PP CP <<< \"$cfg\"",
        f"  GPUS=8 TP=$TP PP=$PP CP=$CP ./run_tiny_gpt.sh 2>&1 | tee \"{log_dir}/${{NAME}}.log\"",
        "done",
        f"python -m course_lib report {log_dir}/*.log",
    ])


# ---- CLI: python -m course_lib megatron-cmd ----------------------------------------------

SHOW = ("train", "preprocess", "setup", "script", "sweep", "sharding", "all")


def add_arguments(parser) -> None:
    parser.description = "Print the Megatron-LM commands for a Day 22 configuration (the seed's GPU model)."
    g = parser.add_argument_group("layout")
    g.add_argument("--config", choices=sorted(SEED_SWEEP), help="one of the seed's configs A-F (sets --tp/--pp/--cp)")
    g.add_argument("--tp", type=int, default=None, help="--tensor-model-parallel-size (default 1)")
    g.add_argument("--pp", type=int, default=None, help="--pipeline-model-parallel-size (default 1)")
    g.add_argument("--cp", type=int, default=None, help="--context-parallel-size (default 1)")
    g.add_argument("--nproc", type=int, default=None,
                   help="GPUs (torchrun --nproc_per_node; default 8, or nodes x gpus-per-node); DP = nproc/(tp*pp*cp)")
    g.add_argument("--sp", action="store_true", help="--sequence-parallel (turned off with tp = 1, as Megatron does)")
    g.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (interleaved 1F1B)")
    g = parser.add_argument_group("batch and training")
    g.add_argument("--seq-length", type=int, default=DEFAULT_SEQ_LENGTH)
    g.add_argument("--micro-batch-size", type=int, default=DEFAULT_MICRO_BATCH_SIZE)
    g.add_argument("--global-batch-size", type=int, default=DEFAULT_GLOBAL_BATCH_SIZE)
    g.add_argument("--train-iters", type=int, default=MegatronRun.train_iters)
    g.add_argument("--lr", type=float, default=MegatronRun.lr)
    g.add_argument("--log-interval", type=int, default=MegatronRun.log_interval)
    g.add_argument("--precision", choices=PRECISIONS, default=MegatronRun.precision)
    g.add_argument("--distributed-optimizer", action="store_true", help="--use-distributed-optimizer")
    g.add_argument("--sharding", choices=sorted(SHARDING), default=None,
                   help="shard the training state: dist-opt (ZeRO-1), fsdp-optim-grads (ZeRO-2), fsdp (ZeRO-3, "
                        "Megatron-FSDP), offload (dist-opt with the optimizer on the host); --show sharding: all")
    g.add_argument("--megatron-fsdp-main-grads-dtype", choices=FSDP_MAIN_GRADS_DTYPES, default=None,
                   help="with a Megatron-FSDP --sharding: its grad buffer dtype (main only; Megatron's default auto, "
                        "the param dtype, is not printed; fp32 for fp32 grads under --bf16)")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None)
    g.add_argument("--data-dir", default=MegatronRun.data_dir, help="relative to the Megatron-LM checkout")
    g = parser.add_argument_group("checkpoints (Megatron-LM's flags; the course trainer takes the same)")
    g.add_argument("--save", default=None, help="folder to save checkpoints into")
    g.add_argument("--load", default=None, help="folder to resume from (its latest_checkpointed_iteration.txt)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations")
    g.add_argument("--exit-interval", type=int, default=None, help="save and stop at an iteration N divides")
    g.add_argument("--ckpt-format", choices=rules.CKPT_FORMATS, default=None,
                   help="default: Megatron's torch_dist (not printed); Megatron-FSDP prints fsdp_dtensor")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load the model only, from iteration 0")
    g = parser.add_argument_group("mixture of experts (a Mixtral-style command: SwiGLU, RMSNorm, RoPE)")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--expert-model-parallel-size", "--ep", type=int, default=1, dest="ep")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, dest="expert_tp",
                   help="default: TP (Megatron's)")
    g.add_argument("--moe-router-topk", type=int, default=MoESpec.moe_router_topk)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=MoESpec.moe_aux_loss_coeff)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default 3.5 x hidden (Mixtral)")
    g = parser.add_argument_group("cluster (multi-node launch: torchrun c10d/static and a Slurm sbatch script)")
    g.add_argument("--nodes", type=int, default=None, help="nodes; with --gpus-per-node (world = nodes x GPUs)")
    g.add_argument("--gpus-per-node", type=int, default=None)
    g.add_argument("--nccl-debug", action="store_true", help="export NCCL_DEBUG=INFO in the launch")
    parser.add_argument("--show", choices=SHOW, default="train",
                        help="train: the pretrain_gpt.py command (the multi-node launch with --nodes); preprocess; "
                             "setup (clone, corpus, tokenizer, preprocess); script: run_tiny_gpt.sh; sweep: the A-F "
                             "loop; sharding: the distributed-optimizer / Megatron-FSDP variants; all")
    parser.add_argument("--export-corpus", metavar="PATH",
                        help="write the course corpus as JSON lines for tools/preprocess_data.py and exit")
    parser.add_argument("--force", action="store_true", help="replace an existing --export-corpus file")


def _world(args) -> int:
    """--nproc, or nodes x GPUs per node (both given: they must agree)."""
    if (args.nodes is None) != (args.gpus_per_node is None):
        raise rules.UsageError("--nodes and --gpus-per-node go together, e.g. --nodes 2 --gpus-per-node 8")
    if args.nodes is None:
        return 8 if args.nproc is None else args.nproc
    world = rules.integer("nodes", args.nodes) * rules.integer("gpus_per_node", args.gpus_per_node)
    if args.nproc is not None and args.nproc != world:
        raise rules.UsageError(f"nproc={args.nproc} is not nodes={args.nodes} × gpus_per_node={args.gpus_per_node} = "
                               f"{world}; leave --nproc out with --nodes")
    return world


def _sharding_note(name: str, cfg: ParallelConfig) -> str:
    s = SHARDING[name]
    d = cfg.dp * cfg.cp
    note = f"# {name} = {s.zero}: each of the DP x CP = {d} ranks keeps 1/{d} of the {s.what}"
    if s.fsdp and (cfg.tp > 1 or cfg.cp > 1):
        note += ("\n# Megatron-FSDP with TP/CP > 1: validate_args warns that they want different "
                 "CUDA_DEVICE_MAX_CONNECTIONS (FSDP asserts != 1): left unset")
    return note


def sharding_variants(config, run: MegatronRun | None = None, moe: MoESpec | None = None) -> str:
    """Every :data:`SHARDING` variant of one configuration (the Day 23 table: config D with the
    distributed optimizer, ZeRO-2/3 through Megatron-FSDP, and offload), one command each."""
    cfg, run = _as_config(config), run or MegatronRun()
    blocks = []
    for name in SHARDING:
        fsdp = SHARDING[name].fsdp
        variant = MegatronRun(**{**run.__dict__, "sharding": name, "use_distributed_optimizer": False,
                                 "ckpt_format": None if fsdp else run.ckpt_format,
                                 "megatron_fsdp_main_grads_dtype": run.megatron_fsdp_main_grads_dtype if fsdp else None})
        blocks.append(_sharding_note(name, cfg) + "\n" + megatron_command(cfg, variant, moe))
    return "\n\n".join(blocks)


def run(args) -> int:
    if args.export_corpus:
        from course_lib.data.corpus import export_jsonl, load_documents
        from course_lib.safe_files import check_output_file

        path = export_jsonl(check_output_file(args.export_corpus, force=args.force, what="--export-corpus"))
        print(f"wrote {len(load_documents())} documents to {path}")
        return 0
    tp, pp, cp = SEED_SWEEP[args.config] if args.config else (1, 1, 1)
    tp = args.tp if args.tp is not None else tp
    pp = args.pp if args.pp is not None else pp
    cp = args.cp if args.cp is not None else cp
    mrun = MegatronRun(train_iters=args.train_iters, lr=args.lr, min_lr=min(MegatronRun.min_lr, args.lr),
                       log_interval=args.log_interval, precision=args.precision,
                       use_distributed_optimizer=args.distributed_optimizer, sharding=args.sharding,
                       transformer_impl=args.transformer_impl, data_dir=args.data_dir, save=args.save,
                       load=args.load, save_interval=args.save_interval, exit_interval=args.exit_interval,
                       ckpt_format=args.ckpt_format, no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
                       finetune=args.finetune, megatron_fsdp_main_grads_dtype=args.megatron_fsdp_main_grads_dtype)
    nproc = _world(args)
    cfg = gpu_config(tp, pp, cp, nproc, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                     global_batch_size=args.global_batch_size, sequence_parallel=args.sp, vpp=args.vpp)
    moe = None
    if args.num_experts is not None or args.ep > 1 or args.expert_tp is not None:
        if args.num_experts is None:
            raise rules.UsageError("--expert-model-parallel-size/--expert-tensor-parallel-size need --num-experts, "
                                   "e.g. --num-experts 8")
        moe = MoESpec(args.num_experts, args.ep, args.expert_tp, args.moe_router_topk, args.moe_aux_loss_coeff,
                      args.moe_ffn_hidden_size)
    parts = []
    if args.show in ("setup", "all"):
        parts.append(setup_commands(mrun))
    elif args.show == "preprocess":
        parts.append(preprocess_command(mrun))
    if args.show in ("train", "all"):
        notes = [describe(cfg)] + [f"# {note}" for note in cfg.notes]
        if cfg.virtual_pipeline_model_parallel_size and cfg.virtual_pipeline_model_parallel_size > 1 and cfg.pp == 2:
            notes.append("# Megatron-LM core <= 0.5 requires PP > 2 for the interleaved schedule")
        if cfg.cp > 1 and mrun.transformer_impl == "local":
            notes.append("# context parallelism runs in Transformer Engine's attention: drop --transformer-impl local")
        notes += [f"# {note}" for note in (moe.notes(cfg, mrun.transformer_impl) if moe else [])]
        if mrun.sharding:
            notes.append(_sharding_note(mrun.sharding, cfg))
        if args.nodes:
            text = cluster_launch(cfg, mrun, moe, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                  debug=args.nccl_debug)
        else:
            text = megatron_command(cfg, mrun, moe)
        parts.append("\n".join(notes + [text]))
    if args.show in ("sharding", "all"):
        parts.append(sharding_variants(cfg, mrun, moe))
    if args.show in ("script", "all"):
        parts.append(run_tiny_gpt_script(mrun, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                         global_batch_size=args.global_batch_size))
    if args.show in ("sweep", "all"):
        parts.append(sweep_script())
    print("\n\n".join(parts))
    return 0
