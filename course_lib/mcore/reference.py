"""megatron-core itself as the reference: its GPT trained on CPU ranks beside the course trainer.

megatron-core 0.16.1's ``GPTModel`` (local layer spec), ``DistributedDataParallel``,
``get_megatron_optimizer`` (plain or distributed), ``OptimizerParamScheduler`` and
``get_forward_backward_func`` (1F1B over gloo send/recv when PP > 1) run as they are, inside the CPU
shim :func:`course_lib.mcore.cpu.megatron_core_on_cpu`. They start from the course's master
weights (:class:`course_lib.model.GPTModel`, loaded by name: TP shards cut along each parameter's
``partition_dim``, pipeline stages by their layers' ``layer_number``, the last stage's output layer from
the tied word embedding) and read the course's batches (:mod:`course_lib.data`), so their losses and
gradient norms can be set beside :func:`course_lib.train.pretrain`'s on the same layout: Lab 05 does, and
its stored output, compared by nbval in ``make test``, says them equal within 1e-6 on every rank
(``tests/mcore/test_megatron_core_live.py`` checks the rest: logits, gradients, checkpoints). The same for
an MoE GPT (:data:`MOE`: megatron-core's local MoE spec, ``MoELayer`` with ``SequentialMLP`` experts and
the alltoall dispatcher) under expert parallelism (:data:`MOE_LAYOUTS`).

Run on a rank (``torch.distributed`` initialised, gloo), megatron-core imported in the launching process
before the ranks fork. Needs the optional extra ``pip install .[megatron]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from course_lib import rules

__all__ = ["ReferenceRun", "LAYOUTS", "MOE", "MOE_LAYOUTS", "moe_config", "preload", "transformer_config", "master_name", "megatron_core_gpt",
           "model_parallel", "train_megatron_core", "side_by_side"]

_MODULES = ("megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
            "megatron.core.pipeline_parallel", "megatron.core.transformer.moe.moe_layer",
            "megatron.core.dist_checkpointing")


def preload() -> None:
    """Import megatron-core in the launching process, before the ranks fork (each rank importing it on its
    own costs seconds), its warnings that Transformer Engine and Apex are absent silenced. ImportError with
    the fix when the extra is not installed."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for module in _MODULES:
                importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"megatron-core is not installed ({exc}): pip install -e '.[megatron]'") from None


@dataclass(frozen=True)
class ReferenceRun:
    """The model and the run both trainers get: a 4-layer GPT, Adam with linear decay, clipping at 1. A global
    batch of 8 gives DP 2 two micro-batches per iteration (PP 2 a 1F1B with a steady state, DP 2 gradients
    accumulated over two) and DP 4 one: every code path of the layouts at half the collectives of 16 (Lab 05's 9
    layouts on 4 ranks: 138 -> 95 CPU-s, measured one after the other on 2 cores)."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    seq_length: int = 16
    micro_batch_size: int = 2
    global_batch_size: int = 8
    train_iters: int = 3
    lr: float = 1e-3
    seed: int = 1234

    def gpt_config(self, **extra):
        from course_lib.model import GPTConfig

        return GPTConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads, seq_length=self.seq_length, seed=self.seed,
                         **extra)

    def course_argv(self, tp: int, pp: int, sp: bool, distopt: bool, ep: int = 0,
                    dispatcher: str = "alltoall", expert_tp: int = 1) -> list[str]:
        """The course trainer's flags for this run on one layout (Megatron-LM's names); with ``ep`` the MoE
        GPT of :data:`MOE` over that many expert-parallel ranks, ``expert_tp`` and ``dispatcher`` (expert
        TP > 1: ``--disable-bias-linear``, as megatron-core requires)."""
        argv = ["--uniform-vocab-padding", "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
                "--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                "--num-attention-heads", self.num_attention_heads, "--seq-length", self.seq_length,
                "--micro-batch-size", self.micro_batch_size, "--global-batch-size", self.global_batch_size,
                "--train-iters", self.train_iters, "--lr", self.lr, "--seed", self.seed, "--log-interval", 100]
        if ep:
            argv += [f"--{k.replace('_', '-')}={v}" for k, v in MOE.items()]
            argv += ["--moe-token-dispatcher-type", dispatcher, "--expert-model-parallel-size", ep,
                     "--expert-tensor-parallel-size", expert_tp] + ["--disable-bias-linear"] * (expert_tp > 1)
        return [str(a) for a in argv] + ["--sequence-parallel"] * sp + ["--use-distributed-optimizer"] * distopt


# (name, tp, pp, sequence parallel, distributed optimizer) on 4 ranks, DP = 4 / (tp * pp)
LAYOUTS = (
    ("TP2 x DP2 + SP", 2, 1, True, False),
    ("DP4, distributed optimizer", 1, 1, False, True),
    ("TP2 x DP2 + SP, distributed optimizer", 2, 1, True, True),
    ("PP2 x DP2 (1F1B)", 1, 2, False, False),
    ("PP2 x TP2 + SP (1F1B)", 2, 2, True, False),
)
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "moe_aux_loss_coeff": 0.01}
"""The MoE GPT of :data:`MOE_LAYOUTS`: every layer's MLP 4 experts, top-2, the Switch aux loss at 1e-2."""
# (name, tp, pp, sequence parallel, ep, dispatcher, expert tp) on 4 ranks: the MoE GPT, with Megatron's
# biases (router and experts) at expert TP 1; expert TP 2 without any (--disable-bias-linear: megatron-core
# 0.16.1 refuses biased experts with expert TP > 1, "Bias in Moe is only supported when ETP==1").
MOE_LAYOUTS = (
    ("MoE: EP2 x DP4 (4 experts, top-2)", 1, 1, False, 2, "alltoall", 1),
    ("MoE: TP2 + SP, EP2, expert TP 2, no bias", 2, 1, True, 2, "alltoall", 2),
    ("MoE: PP2 x EP2 (1F1B)", 1, 2, False, 2, "alltoall", 1),
    ("MoE: EP2, allgather dispatcher", 1, 1, False, 2, "allgather", 1),
)


def transformer_config(g, tp: int, pp: int, sp: bool, **extra):
    """megatron-core's ``TransformerConfig`` for the course's ``GPTConfig`` ``g`` (dropout 0, no fusions)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=g.num_layers, hidden_size=g.hidden_size,
                             num_attention_heads=g.num_attention_heads, ffn_hidden_size=g.ffn_hidden_size,
                             hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=g.layernorm_epsilon,
                             init_method_std=g.init_method_std, add_bias_linear=g.add_bias_linear,
                             use_cpu_initialization=True,
                             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                             pipeline_dtype=torch.float32, bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, **extra)


def master_name(model, name: str) -> str:
    """The course master's name of a megatron-core GPTModel parameter: local layer ``i`` of this stage is
    global layer ``layer_number - 1``; the last stage's output layer is the tied word embedding."""
    if name.startswith("decoder.layers."):
        _, _, i, rest = name.split(".", 3)
        return f"decoder.layers.{model.decoder.layers[int(i)].layer_number - 1}.{rest}"
    return "embedding.word_embeddings.weight" if name == "output_layer.weight" else name


def moe_config(g) -> dict:
    """megatron-core's MoE fields for the course's MoE ``GPTConfig`` ``g`` (every layer MoE, SequentialMLP,
    the alltoall dispatcher, the Switch aux loss), or ``{}`` for a dense ``g``."""
    from megatron.core import parallel_state as ps

    if not g.num_experts:
        return {}
    return dict(num_moe_experts=g.num_experts, moe_router_topk=g.moe_router_topk,
                moe_ffn_hidden_size=g.moe_ffn_hidden_size, moe_aux_loss_coeff=g.moe_aux_loss_coeff,
                moe_token_dispatcher_type=g.moe_token_dispatcher_type, moe_router_load_balancing_type="aux_loss",
                expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size())


def megatron_core_gpt(g, tp: int, pp: int, sp: bool):
    """megatron-core's GPTModel for this rank's stage (local spec, tied embeddings) holding the course
    master's numbers: ``(model, master, its TransformerConfig)``. Inside :func:`model_parallel`.

    With experts (``g.num_experts``): megatron-core's local MoE spec (``SequentialMLP``); its local expert
    ``j`` is the master's expert ``local_expert_indices[j]`` (megatron-core's own numbering), cut along its
    ``partition_dim`` at the expert-TP rank; the router's and experts' biases (unless ``add_bias_linear`` is
    off) are the master's too."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from course_lib.model import GPTModel as CourseGPT

    master = CourseGPT(g)
    cfg = transformer_config(g, tp, pp, sp, **moe_config(g))
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=g.num_experts or None), vocab_size=g.padded_vocab_size,
                     max_sequence_length=g.seq_length, share_embeddings_and_output_weights=True,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    full = dict(master.named_parameters())
    r = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts.local_experts." in name:      # decoder.layers.i.mlp.experts.local_experts.j.<tensor>
                i, rest = name.split(".")[2], name.split(".mlp.experts.local_experts.")[1]
                j, tensor = rest.split(".", 1)
                e = model.decoder.layers[int(i)].mlp.local_expert_indices[int(j)]
                layer = master_name(model, name).split(".mlp.")[0]
                value = full[f"{layer}.mlp.experts.{tensor}"][e]                     # [F, H], [H, F], [F], [H]
                if getattr(p, "tensor_model_parallel", False):                       # over expert TP
                    value = value.chunk(ps.get_expert_tensor_parallel_world_size(), p.partition_dim)[
                        ps.get_expert_tensor_parallel_rank()]
                p.copy_(value)
                continue
            value = full[master_name(model, name)]
            p.copy_(value.chunk(tp, p.partition_dim)[r] if getattr(p, "tensor_model_parallel", False) else value)
    return model, master, cfg


@contextlib.contextmanager
def model_parallel(tp: int, pp: int, seed: int, **kwargs):
    """megatron-core's ``parallel_state`` for this layout (its groups over the ranks already started), its
    model-parallel RNG seeded; destroyed on exit. ``kwargs`` go to ``initialize_model_parallel``; its groups
    time out after a minute (megatron-core's default is 30), so a rank that fails cannot hold the others."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    kwargs.setdefault("distributed_timeout_minutes", 1)
    ps.initialize_model_parallel(tp, pp, create_gloo_process_groups=False, **kwargs)
    try:
        model_parallel_cuda_manual_seed(seed)
        yield ps
    finally:
        ps.destroy_model_parallel()


def train_megatron_core(run: ReferenceRun, tp: int, pp: int, sp: bool, distopt: bool, before_first_step=None,
                        moe: dict | None = None) -> dict:
    """``run.train_iters`` iterations of megatron-core on this layout, inside :func:`model_parallel`.

    Megatron's ``pretrain_gpt.py`` loop in miniature: per iteration ``get_forward_backward_func`` over
    the rank's micro-batches (its DP share of the course's global batch), the optimizer step, the
    scheduler by ``global_batch_size`` samples. ``before_first_step(model, master, ddp)``, when given, runs
    after the first backward (gradients reduced, weights not yet stepped) and its dict is merged into the
    result. ``moe``: the course's MoE fields (``num_experts``, ``moe_router_topk``, ...) for an MoE GPT,
    EP as :func:`model_parallel` set it. Returns ``{"lm_loss": [...] (last stage; else empty), "grad_norm":
    [...], "model": model}``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from course_lib.data import get_batch
    from course_lib.data.source import corpus_dataset

    g = run.gpt_config(**(moe or {}))
    model, master, cfg = megatron_core_gpt(g, tp, pp, sp)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distopt), model)
    cfg.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=run.lr, min_lr=0.0, weight_decay=0.01,
                                                       clip_grad=1.0, use_distributed_optimizer=distopt),
                                       [ddp], use_gloo_process_groups=False)
    samples = run.train_iters * run.global_batch_size
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=run.lr, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=samples, lr_decay_style="linear", start_wd=0.01,
                                        end_wd=0.01, wd_incr_steps=samples, wd_incr_style="constant")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    micro = run.micro_batch_size
    m = rules.num_microbatches(run.global_batch_size, micro, dp)
    positions = torch.arange(g.seq_length).expand(micro, -1)
    out = {"lm_loss": [], "grad_norm": [], "model": model}

    def forward_step(data, chunk):                          # pretrain_gpt.py's, loss mask all ones
        b = next(data)

        def loss_func(token_losses):                        # [b, s] -> (sum, tokens, what to report)
            total = token_losses.float().sum()
            tokens = torch.tensor(token_losses.numel(), dtype=torch.int)
            return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}

        return chunk(b["tokens"], positions, None, labels=b["labels"]), loss_func

    dataset = corpus_dataset(g.seq_length, run.seed, samples)         # the course trainer's samples, in its order
    for it in range(run.train_iters):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter([get_batch(it, j, dp_rank, dp, micro, g.seq_length, run.seed,
                               global_batch_size=run.global_batch_size, dataset=dataset) for j in range(m)])
        reported = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=[ddp],
                                               num_microbatches=m, seq_length=g.seq_length,
                                               micro_batch_size=micro, forward_only=False)
        if it == 0 and before_first_step is not None:
            out.update(before_first_step(model, master, ddp))
        _, norm, _ = optimizer.step()
        scheduler.step(increment=run.global_batch_size)
        out["grad_norm"].append(float(norm))
        if ps.is_pipeline_last_stage():
            sums = torch.stack([r["lm loss"] for r in reported]).sum(0)
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
            out["lm_loss"].append(float(sums[0] / sums[1]))
    return out


def side_by_side(layouts=LAYOUTS, moe_layouts=MOE_LAYOUTS, run: ReferenceRun = ReferenceRun()) -> dict:
    """On every rank: megatron-core (:func:`train_megatron_core`) and the course trainer
    (:func:`course_lib.train.pretrain`) on each layout of ``layouts`` (the dense GPT) and of ``moe_layouts``
    (the MoE GPT of :data:`MOE`). Returns ``{name: {"megatron-core": {"lm_loss", "grad_norm"}, "course":
    {...}}}`` (the losses on the last pipeline stage only)."""
    from course_lib.mcore.cpu import megatron_core_on_cpu
    from course_lib.train import parse_args, pretrain

    runs = [(name, tp, pp, sp, distopt, 0, "alltoall", 1) for name, tp, pp, sp, distopt in layouts]
    runs += [(name, tp, pp, sp, False, ep, dispatcher, etp) for name, tp, pp, sp, ep, dispatcher, etp in moe_layouts]
    out = {}
    for name, tp, pp, sp, distopt, ep, dispatcher, etp in runs:
        experts = dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp) if ep else {}
        moe = {**MOE, "moe_token_dispatcher_type": dispatcher, "add_bias_linear": etp == 1} if ep else None
        with megatron_core_on_cpu(), model_parallel(tp, pp, run.seed, **experts):
            mcore = train_megatron_core(run, tp, pp, sp, distopt, moe=moe)
        course = pretrain(parse_args(run.course_argv(tp, pp, sp, distopt, ep, dispatcher, etp)), print_args=False,
                          record_comm=False)
        out[name] = {"megatron-core": {k: mcore[k] for k in ("lm_loss", "grad_norm")},
                     "course": {k: course[k] for k in ("lm_loss", "grad_norm")}}
    return out
