"""megatron-core 0.16.1 itself, on 4 forked CPU gloo ranks, against the course: model, trainer, MoE layer,
checkpoints.

Nothing of Megatron is re-implemented here: its ``GPTModel`` (local layer spec), ``DistributedDataParallel``,
``get_megatron_optimizer`` (plain and distributed), ``OptimizerParamScheduler``, ``get_forward_backward_func``
(1F1B over gloo send/recv with PP), ``finalize_model_grads``, ``MoELayer`` (alltoall and allgather
dispatchers) and ``dist_checkpointing`` (torch_dist) run as they are; the shim :mod:`course_lib.mcore.cpu`
only reroutes their CUDA calls; the training loop is :func:`course_lib.mcore.reference.train_megatron_core`.
The course's master weights (:class:`course_lib.model.GPTModel`, seed 1234) are loaded into megatron-core by
name: TP shards cut along each parameter's ``partition_dim`` at the TP rank, pipeline stages mapped by their
layers' ``layer_number`` (Megatron's layer offset), the last stage's ``output_layer.weight`` from the tied
word embedding. Then, per layout:

* logits and every gradient (after megatron-core's own DP reduction and ``finalize_model_grads``: SP
  LayerNorm sums, the tied embedding over the embedding group) equal the dense master's on the same
  global batch;
* 3 training iterations (Adam, linear decay, clipping) give the losses and gradient norms of the course
  trainer (:func:`course_lib.train.pretrain`) on the same layout;
* megatron-core's ``MoELayer`` and the course's ``MoEMLP`` (router with aux and z losses, experts, either
  dispatcher; Megatron's router and expert biases at expert TP 1, expert TP 2 with ``--disable-bias-linear``)
  give the same output, input gradient, router and expert gradients (biases' too) on every rank;
* a torch_dist checkpoint crosses both ways, resharded: megatron-core's ``dist_checkpointing.save``
  (TP2 x DP2) loads into the course trainer under PP2 x DP2 (``--finetune``), and the course's save
  (PP2 x DP2) loads by ``dist_checkpointing.load`` into megatron-core's GPTModel under TP2 x DP2 -- the
  same losses (:mod:`course_lib.training.checkpointing` writes megatron-core's sharded keys and layout);
  an MoE model's (EP2, every other layer MoE: megatron-core's non-homogeneous layers) has exactly the keys and
  global shapes of megatron-core's own ``sharded_state_dict`` on that layout, and ``dist_checkpointing.load``
  (strict) puts the course's experts and routers, biases included, into megatron-core's ``SequentialMLP``.

One launch, megatron-core imported once (in this process, before the ranks fork). Needs the optional
extra (``pip install .[megatron]``); skipped with a reason without it.
"""

import pytest

from course_lib.launch import launch
from course_lib.mcore.reference import (LAYOUTS, MOE_LAYOUTS, ReferenceRun, model_parallel, preload,
                                                side_by_side, transformer_config)

# (tp, ep, expert tp, sequence parallel, dispatcher); 4 experts, top-2, aux and z losses on; Megatron's router
# and expert biases at expert TP 1, none at expert TP 2 (--disable-bias-linear, which megatron-core requires)
MOE_CASES = [(1, 4, 1, False, "alltoall"), (1, 4, 1, False, "allgather"), (2, 2, 1, True, "alltoall"),
             (2, 2, 1, True, "allgather"), (2, 2, 2, True, "alltoall")]
RUN = ReferenceRun()
MODEL = dict(num_layers=RUN.num_layers, hidden_size=RUN.hidden_size, num_attention_heads=RUN.num_attention_heads,
             seq_length=RUN.seq_length)
# the MoE checkpoint: 4 experts over EP2, layers 0 and 2 MoE (--moe-layer-freq 2), top-2
MOE_CKPT = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "moe_layer_freq": 2}
MICRO, GLOBAL, ITERS, SEED = RUN.micro_batch_size, RUN.global_batch_size, RUN.train_iters, RUN.seed
TOL = 1e-6          # relative: losses, gradient norms, logits (measured <= 1.9e-7: float32 summation order)
GRAD_TOL = 3e-6     # relative to the tensor's largest entry: each gradient, the MoE layer (measured <= 8.2e-7)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------ megatron-core's side (runs on a rank)


def _tp_gather(value, dim: int, tp_group):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, value.contiguous(), group=tp_group)
    return torch.cat(parts, dim)


def _tp_full(value, p, tp_group):
    """A TP shard gathered along its ``partition_dim`` (replicated tensors as they are)."""
    return _tp_gather(value, p.partition_dim, tp_group) if getattr(p, "tensor_model_parallel", False) else value


def _master_grads(master, g) -> dict:
    """The dense master's gradients of the mean token loss of iteration 1's global batch."""
    from course_lib.data import get_global_batch

    batch = get_global_batch(0, GLOBAL, g.seq_length, SEED)
    master.loss(batch["tokens"], batch["labels"]).backward()
    return {n: p.grad for n, p in master.named_parameters()}


def _mcore_train(tp: int, pp: int, sp: bool, distopt: bool, save=None) -> dict:
    """ITERS iterations of megatron-core on this layout (:func:`train_megatron_core`); the first one's logits
    and gradients checked against the master. Returns ``{"lm_loss", "grad_norm", "logits", "grads"}``
    (relative errors); with ``save`` (a folder, pp = 1) also the model saved by ``dist_checkpointing`` as
    ``save/iter_0000003`` (the tracker written as Megatron-LM writes it) and ``"loss of the saved model"`` on
    iteration 1's batch."""
    import torch

    from course_lib.data import get_global_batch
    from course_lib.mcore.reference import master_name, model_parallel, train_megatron_core

    def first_step_checks(model, master, ddp):
        """Before any step: the logits of a batch (pp = 1) and every gradient (reduced over DP, SP sums,
        the tied embedding summed) against the dense master's."""
        from megatron.core import parallel_state as ps

        tp_group, g = ps.get_tensor_model_parallel_group(), master.config
        checks = {"logits": None, "grads": {}}
        if pp == 1:
            batch = get_global_batch(0, MICRO, g.seq_length, SEED)
            with torch.no_grad():
                positions = torch.arange(g.seq_length).expand(MICRO, -1)
                logits = _tp_gather(model(batch["tokens"], positions, None), -1, tp_group)   # [b, s, V/t] -> V
                checks["logits"] = _rel(logits, master(batch["tokens"]).transpose(0, 1))    # [b, s, V]
        if not distopt:
            reference = _master_grads(master, g)
            for name, p in model.named_parameters():
                key = master_name(model, name)
                checks["grads"][key] = _rel(_tp_full(p.main_grad, p, tp_group), reference[key])
        return checks

    with model_parallel(tp, pp, SEED):
        out = train_megatron_core(RUN, tp, pp, sp, distopt, before_first_step=first_step_checks)
        model = out.pop("model")
        if save is not None:
            _mcore_save(model, save, ITERS)
            out["loss of the saved model"] = _mcore_loss(model, 0, RUN.seq_length)
    return out


def _mcore_save(model, root, iteration: int) -> None:
    """megatron-core's torch_dist save of the model (``dist_checkpointing.save`` of its sharded state
    dict) into ``root/iter_XXXXXXX``, then the tracker, as Megatron-LM's training loop writes it."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from course_lib.training.checkpointing import checkpoint_dir, get_checkpoint_tracker_filename

    folder = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(folder))
    if dist.get_rank() == 0:
        get_checkpoint_tracker_filename(root).write_text(str(iteration))
    dist.barrier()


def _mcore_loss(model, iteration: int, seq_length: int) -> float:
    """The mean token loss of the global batch of (0-based) ``iteration`` under megatron-core's ``model``
    (pp = 1): each DP rank its micro-batches, sum and count reduced over DP."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from course_lib.data import get_batch

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sums = torch.zeros(2)
    with torch.no_grad():
        for j in range(GLOBAL // (MICRO * dp)):
            b = get_batch(iteration, j, dp_rank, dp, MICRO, seq_length, SEED, global_batch_size=GLOBAL)
            losses = model(b["tokens"], torch.arange(seq_length).expand(MICRO, -1), None, labels=b["labels"])
            sums += torch.stack([losses.sum(), torch.tensor(float(losses.numel()))])
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return float(sums[0] / sums[1])


def _mcore_load_course_checkpoint(folder, tp: int, sp: bool, iteration: int) -> float:
    """megatron-core's GPTModel (its own random init) loaded by ``dist_checkpointing.load`` from a course
    torch_dist checkpoint folder; the loss of (0-based) ``iteration``'s global batch under it."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.safe_globals import register_safe_globals

    from course_lib.model import GPTConfig

    with model_parallel(tp, 1, SEED):
        g = GPTConfig(**MODEL, seed=SEED)
        model = GPTModel(transformer_config(g, tp, 1, sp), get_gpt_layer_local_spec(), vocab_size=g.padded_vocab_size,
                         max_sequence_length=g.seq_length, share_embeddings_and_output_weights=True)
        register_safe_globals()     # common.pt's args Namespace: weights_only with megatron-core's allow-list
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))   # + common.pt's items
        model.load_state_dict(state["model"])
        loss = _mcore_loss(model, iteration, g.seq_length)
    return loss


def _moe_checkpoint_layout(root) -> dict:
    """The course saves an MoE GPT under EP2 (``MOE_CKPT``); megatron-core's GPTModel of that model on that
    layout loads it by ``dist_checkpointing.load``. Returns ``{"course": {key: global shape or None (an
    object)}}`` of the model part of DCP's ``.metadata``, ``"mcore"``: this rank's ``sharded_state_dict`` in
    the same form (its ``_extra_state`` objects by unique key), and ``"loaded"``: the largest difference
    between each local expert's (and router's) weights after the load and the course's saved tensor."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from course_lib.model import GPTConfig
    from course_lib.train import parse_args, pretrain

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in MOE_CKPT.items()] + ["--expert-model-parallel-size", "2"]
    pretrain(parse_args(RUN.course_argv(1, 1, False, False) + flags + ["--train-iters", "1", "--save", root,
                                                                        "--save-interval", "1"]),
             print_args=False, record_comm=False)
    folder = f"{root}/iter_0000001"
    md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    out = {"course": {k: tuple(m.size) if hasattr(m, "size") else None for k, m in md.items()
                      if not k.startswith(("optimizer.", "rng_state/"))}, "mcore": {}}
    with model_parallel(1, 1, SEED, expert_model_parallel_size=2):
        g = GPTConfig(**MODEL, **MOE_CKPT)
        cfg = transformer_config(g, 1, 1, False, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                            moe_layer_freq=2, expert_model_parallel_size=2)
        model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                         vocab_size=g.padded_vocab_size, max_sequence_length=g.seq_length,
                         share_embeddings_and_output_weights=True)
        sharded = model.sharded_state_dict()
        for v in sharded.values():
            if isinstance(v, ShardedTensor):
                out["mcore"][v.key] = tuple(v.global_shape)
            elif isinstance(v, ShardedObject):
                out["mcore"][v.unique_key] = None
        model.load_state_dict(dist_checkpointing.load({"model": sharded}, folder)["model"])   # + common.pt's items
        out["loaded"] = 0.0
        for layer in (0, 2):
            mlp, prefix = model.decoder.layers[layer].mlp, f"decoder.layers.{layer}.mlp."
            names = [f"{m}.{kind}" for m in ("router", "experts.experts.linear_fc1", "experts.experts.linear_fc2")
                     for kind in ("weight", "bias")]
            saved = {prefix + k: torch.empty(md[prefix + k].size) for k in names}
            dcp.load(saved, checkpoint_id=folder, no_dist=True)          # the course's tensors, whole
            pairs = [(getattr(mlp.router, kind), saved[f"{prefix}router.{kind}"]) for kind in ("weight", "bias")]
            for i, expert in enumerate(mlp.experts.local_experts):
                e = ps.get_expert_model_parallel_rank() * len(mlp.experts.local_experts) + i
                pairs += [(getattr(getattr(expert, fc), kind), saved[f"{prefix}experts.experts.{fc}.{kind}"][e])
                          for fc in ("linear_fc1", "linear_fc2") for kind in ("weight", "bias")]
            out["loaded"] = max([out["loaded"]] + [float((a - b).abs().max()) for a, b in pairs])
    return out


def _moe_case(tp: int, ep: int, etp: int, sp: bool, dispatcher: str) -> dict:
    """megatron-core's MoELayer and the course's MoEMLP, one set of weights (biases at expert TP 1), this rank's
    tokens ``[s/tp (SP), b, h]``: relative errors of the output, the input gradient, router and expert grads
    (biases' included)."""
    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.spec_utils import build_module

    from course_lib.model import GPTConfig
    from course_lib.moe.transformer import MoEMLP
    from course_lib.process_groups import new_moe_process_groups
    from course_lib.topology import RankGrid

    experts, topk, s, b, h, ffn = 4, 2, 8, 2, 16, 32
    with model_parallel(tp, 1, SEED, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp) as ps:
        g = GPTConfig(num_layers=1, hidden_size=h, num_attention_heads=4, seq_length=s, num_experts=experts,
                      moe_router_topk=topk, moe_ffn_hidden_size=ffn, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                      moe_token_dispatcher_type=dispatcher, init_method_std=0.3, add_bias_linear=etp == 1)
        with torch.random.fork_rng(devices=[]):                 # every expert, the same numbers on every rank
            torch.manual_seed(SEED)
            master = MoEMLP(g, 1, None, init=True)
            with torch.no_grad():                                 # the experts' biases start at zero: not here
                for bias in (master.experts.linear_fc1.bias, master.experts.linear_fc2.bias):
                    if bias is not None:
                        bias.normal_(0.0, 0.3)
        course = MoEMLP(g, 1, new_moe_process_groups(RankGrid(dist.get_world_size(), tp=tp, ep=ep, expert_tp=etp)))
        if sp:
            course.mark_sequence_parallel()
        course.load_from_master(master)
        cfg = transformer_config(g, tp, 1, sp, num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                            moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                            moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss",
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        assert cfg.add_bias_linear == g.add_bias_linear
        layer = build_module(get_gpt_layer_local_spec(num_experts=experts).submodules.mlp, config=cfg, layer_number=1)
        pairs = [(layer.router, course.router, None)] + [       # (megatron-core module, course module, local expert)
            (getattr(e, fc), getattr(course.experts, fc), i)
            for i, e in enumerate(layer.experts.local_experts) for fc in ("linear_fc1", "linear_fc2")]
        assert ps.get_expert_tensor_parallel_world_size() == etp
        with torch.no_grad():   # course: [L, F/etp, H], [L, H, F/etp], [L, F/etp], [L, H]; the same shards as mcore's
            for theirs, ours, i in pairs:
                for kind in ("weight", "bias"):
                    assert (getattr(theirs, kind) is None) == (getattr(ours, kind) is None), (kind, g.add_bias_linear)
                    if getattr(ours, kind) is not None:
                        getattr(theirs, kind).copy_(getattr(ours, kind) if i is None else getattr(ours, kind)[i])
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        x = torch.randn(s // (tp if sp else 1), b, h, generator=gen)
        dy = torch.randn(x.shape, generator=gen)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # the course's aux_loss_scale: 1
        x_m, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_m, _ = layer(x_m)
        (y_m * dy).sum().backward()
        y_c = course(x_c)
        (y_c * dy).sum().backward()
        grads = {"router grad": [], "expert grads": []}
        for theirs, ours, i in pairs:
            for kind in ("weight", "bias"):
                if getattr(ours, kind) is not None:
                    mine = getattr(ours, kind).grad
                    grads["router grad" if i is None else "expert grads"].append(
                        _rel(getattr(theirs, kind).grad, mine if i is None else mine[i]))
        out = {"output": _rel(y_m, y_c), "input grad": _rel(x_m.grad, x_c.grad),
               **{k: max(v) for k, v in grads.items()}}
    return {"errors": out, "biases compared": sum(getattr(ours, "bias") is not None for _, ours, _ in pairs)}


# ------------------------------------------------------------------ the launch


def _rank(layouts, moe_cases, root):
    """Runs on every rank: megatron-core and the course trainer on each layout (the first layout's
    megatron-core model saved for the course to load), the checkpoints both ways, then the MoE cases."""
    from course_lib.mcore.cpu import megatron_core_on_cpu

    from course_lib.train import parse_args, pretrain

    out = {"train": {}, "moe": {}}
    for i, (name, tp, pp, sp, distopt) in enumerate(layouts):
        with megatron_core_on_cpu():
            mcore = _mcore_train(tp, pp, sp, distopt, save=f"{root}/mcore" if i == 0 else None)
        course = pretrain(parse_args(RUN.course_argv(tp, pp, sp, distopt)), print_args=False, record_comm=False)
        out["train"][name] = {"mcore": mcore, "course": {k: course[k] for k in ("lm_loss", "grad_norm")}}
    out["moe train"] = side_by_side(layouts=(), moe_layouts=MOE_LAYOUTS, run=RUN)   # the MoE GPT, 3 iterations
    # megatron-core saved TP2 x DP2 (SP): the course loads its model under PP2 x DP2, one iteration
    pp2 = RUN.course_argv(1, 2, False, False)
    out["course loads mcore"] = pretrain(parse_args(pp2 + ["--load", f"{root}/mcore", "--finetune", "--train-iters",
                                                           "1"]), print_args=False, record_comm=False)["lm_loss"]
    # the course saves PP2 x DP2 at iteration 3 (the layout's run, then a 4th); megatron-core loads it under TP2 x DP2
    out["course saved"] = pretrain(parse_args(pp2 + ["--save", f"{root}/course", "--save-interval", str(ITERS),
                                                     "--train-iters", str(ITERS + 1), "--lr-decay-iters", str(ITERS)]),
                                   print_args=False, record_comm=False)["lm_loss"]
    with megatron_core_on_cpu():
        out["mcore loads course"] = _mcore_load_course_checkpoint(f"{root}/course/iter_{ITERS:07d}", 2, True, ITERS)
        for case in moe_cases:
            out["moe"][case] = _moe_case(*case)
        out["moe checkpoint"] = _moe_checkpoint_layout(f"{root}/moe")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (optional extra: pip install .[megatron])")
    preload()
    return launch(_rank, world_size=4, backend="gloo", timeout=240, output="none", layouts=LAYOUTS,
                  moe_cases=MOE_CASES, root=str(tmp_path_factory.mktemp("mcore_ckpt")))


@pytest.mark.parametrize("name, pp", [(layout[0], layout[2]) for layout in LAYOUTS])
def test_megatron_core_trains_like_the_course_trainer(ranks, name, pp):
    for rank, res in enumerate(ranks):
        mcore, course = res["train"][name]["mcore"], res["train"][name]["course"]
        for ours, theirs in zip(course["grad_norm"], mcore["grad_norm"], strict=True):
            assert abs(ours - theirs) <= TOL * ours, (name, rank, course["grad_norm"], mcore["grad_norm"])
        if mcore["lm_loss"]:                                # the last stage reports the loss
            for ours, theirs in zip(course["lm_loss"], mcore["lm_loss"], strict=True):
                assert abs(ours - theirs) <= TOL * ours, (name, rank, course["lm_loss"], mcore["lm_loss"])
    assert sum(bool(res["train"][name]["mcore"]["lm_loss"]) for res in ranks) == 4 // pp     # the last stages


@pytest.mark.parametrize("name", [layout[0] for layout in MOE_LAYOUTS])
def test_megatron_core_trains_the_moe_gpt_like_the_course_trainer(ranks, name):
    """megatron-core's GPTModel with MoE layers (SequentialMLP, aux loss, either dispatcher) and the course
    trainer's MoE GPT under EP2, with TP2 + SP or PP2: the same losses and gradient norms."""
    reported = 0
    for rank, res in enumerate(ranks):
        mcore, course = res["moe train"][name]["megatron-core"], res["moe train"][name]["course"]
        assert len(mcore["grad_norm"]) == ITERS
        for ours, theirs in zip(course["grad_norm"], mcore["grad_norm"], strict=True):
            assert abs(ours - theirs) <= TOL * ours, (name, rank, course["grad_norm"], mcore["grad_norm"])
        if mcore["lm_loss"]:                                # the last stage reports the loss
            reported += 1
            for ours, theirs in zip(course["lm_loss"], mcore["lm_loss"], strict=True):
                assert abs(ours - theirs) <= TOL * ours, (name, rank, course["lm_loss"], mcore["lm_loss"])
    assert reported >= 2


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS if not layout[4]])
def test_megatron_core_gpt_has_the_course_models_logits_and_gradients(ranks, name):
    seen = set()
    for res in ranks:
        mcore = res["train"][name]["mcore"]
        if mcore["logits"] is not None:
            assert mcore["logits"] <= TOL, (name, mcore["logits"])
        for key, err in mcore["grads"].items():
            assert err <= GRAD_TOL, (name, key, err)
        seen |= set(mcore["grads"])
    from course_lib.model import GPTConfig, GPTModel

    assert seen == {n for n, _ in GPTModel(GPTConfig(**MODEL)).named_parameters()}     # every gradient


@pytest.mark.parametrize("case", MOE_CASES)
def test_megatron_core_moe_layer_equals_the_course_moe_layer(ranks, case):
    etp = case[2]
    for rank, res in enumerate(ranks):
        for what, err in res["moe"][case]["errors"].items():
            assert err <= GRAD_TOL, (case, rank, what, err)
        # the router's bias and each local expert's two (expert TP 1), or none at all (expert TP 2)
        assert res["moe"][case]["biases compared"] == (0 if etp > 1 else 1 + 2 * 4 // case[1]), res["moe"][case]


def test_megatron_core_and_the_course_load_each_others_torch_dist_checkpoints(ranks):
    """megatron-core's save (TP2 x DP2) read by the course under PP2 x DP2 (``--finetune``): its first loss is
    megatron-core's loss of the saved model on that batch; the course's save at iteration 3 (PP2 x DP2) read
    by ``dist_checkpointing.load`` into megatron-core's GPTModel under TP2 x DP2: the loss of batch 4 is the
    course's 4th."""
    last = ranks[-1]                                        # a last pipeline stage: it reports the loss
    saved = last["train"][LAYOUTS[0][0]]["mcore"]["loss of the saved model"]
    assert abs(last["course loads mcore"][0] - saved) <= TOL * saved, (last["course loads mcore"], saved)
    course_4th = last["course saved"][ITERS]
    for res in ranks:
        assert abs(res["mcore loads course"] - course_4th) <= TOL * course_4th, (res["mcore loads course"], course_4th)
    assert last["course saved"][:ITERS] == last["train"]["PP2 x DP2 (1F1B)"]["course"]["lm_loss"]


def test_an_moe_checkpoint_has_megatron_cores_keys_and_loads_into_its_experts(ranks):
    """The course's save of an MoE GPT under EP2 with layers 0 and 2 MoE: megatron-core keys each layer on its
    own (``decoder.layers.2.mlp.experts.experts.linear_fc1.weight`` [E, F, H], SequentialMLP's); every key and
    global shape the course wrote is megatron-core's, every ``_extra_state`` object too, and megatron-core's
    load (strict) puts the course's experts and router, biases included, exactly, into each EP rank's local
    experts: both sides hold the same keys."""
    course, mcore = ranks[0]["moe checkpoint"]["course"], {}
    for res in ranks:
        mcore.update(res["moe checkpoint"]["mcore"])
    assert {k: mcore.get(k, "missing") for k in course} == course
    assert set(mcore) == set(course), set(mcore) ^ set(course)
    assert course["decoder.layers.2.mlp.experts.experts.linear_fc2.bias"] == (4, 32)
    assert course["decoder.layers.0.mlp.router.bias"] == (4,)
    assert course["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"] == (4, 48, 32)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in course and "decoder.layers.2.mlp.linear_fc1.weight" not in course
    assert "decoder.layers.2.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in course
    assert all(res["moe checkpoint"]["loaded"] == 0.0 for res in ranks), [r["moe checkpoint"]["loaded"] for r in ranks]
