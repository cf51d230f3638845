"""The course GPT with MoE layers on real ranks, against the single-process MoE GPT (course_lib.model).

Two fork launches. 4 ranks: EP2 (every other layer MoE), EP4, EP2 with the allgather dispatcher,
TP2×EP2 with sequence parallelism (expert TP 2, the default), and EP4 misrouted. 8 ranks: TP2×PP2×EP2
with expert TP 1 and SP (a 0/1 ``moe_layer_freq`` pattern). Every configuration is built from the
same master weights (``GPTConfig.seed``); each dense data-parallel replica gets its own batch, and
the reference is one process running every replica's batch. Checked per configuration:

* logits, the gradient that reaches the embedding output (the model's input grads) and, after
  the trainer's ``finalize_model_grads`` (dense grads over DP, expert grads over expert DP), every parameter's
  gradient, gathered whole, equal the reference (tight tolerance);
* three SGD steps: the loss equals one process within 1e-4 relative at every step;
* ``track_moe_metrics`` (the logged ``load_balancing_loss``) equals the reference's mean;
* all-to-all bytes per MoE layer = tokens × top-k × hidden × 4 B each way, forward and backward;
* misrouted tokens, a skipped expert-DP reduction and experts reduced over the dense DP group fail.
"""

import dataclasses
import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import course_lib.moe.transformer as moe_transformer
from course_lib import comm
from course_lib.comm import CommRecorder
from course_lib.launch import launch
from course_lib.model import GPTConfig, GPTModel, build_model, gather_full_parameters, gpt_loss
from course_lib.moe.transformer import moe_modules, set_aux_loss_scale, track_moe_metrics
from course_lib.process_groups import new_moe_process_groups, new_process_groups
from course_lib.topology import ParallelConfig
from course_lib.training.finalize_model_grads import finalize_model_grads
from helpers import group_of_one

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, num_experts=8,
            moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
            moe_token_dispatcher_type="alltoall")
MICRO, STEPS, LR = 2, 3, 0.5
LAYOUTS4 = {  # name: (grid sizes, config changes, misrouted)
    "ep2": (dict(ep=2), dict(moe_layer_freq=2), False),
    "ep4": (dict(ep=4), dict(), False),
    "ep2-allgather": (dict(ep=2), dict(moe_token_dispatcher_type="allgather"), False),
    # expert TP = TP = 2: no biases (megatron-core refuses biased experts with expert TP > 1)
    "tp2-ep2-sp": (dict(tp=2, ep=2), dict(add_bias_linear=False), False),
    "tp2-ep2-sp-allgather": (dict(tp=2, ep=2), dict(moe_token_dispatcher_type="allgather", add_bias_linear=False),
                             False),
    "ep4-misrouted": (dict(ep=4), dict(), True),
}
LAYOUTS8 = {"tp2-pp2-ep2-etp1-sp": (dict(tp=2, pp=2, ep=2, expert_tp=1), dict(moe_layer_freq=[1, 1, 0, 1]), False)}


def config_of(changes) -> GPTConfig:
    return GPTConfig(**{**BASE, **changes})


def batch(replica: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(0, 257, (MICRO, BASE["seq_length"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _keep(out, into: list) -> None:
    """A forward hook's body: keep the embedding output and its gradient (returns None: output unchanged)."""
    out.retain_grad()
    into.append(out)


def _step(chunks, groups, tokens, labels, keep_input_grad):
    """One micro-batch forward + backward through this rank's stage (send/recv between two stages);
    returns (loss or None, logits or None, grad of the embedding output or None)."""
    grabbed, hook = {}, None
    if chunks[0].pre_process and keep_input_grad:
        hook = chunks[0].embedding.register_forward_hook(lambda m, i, out: _keep(out, grabbed.setdefault("x", [])))
    (chunk,) = chunks
    if chunk.pre_process:
        x = tokens
    else:
        x = torch.empty(BASE["seq_length"] // groups.grid.tp, MICRO, BASE["hidden_size"])
        comm.recv(x, groups.pp_ranks[groups.coords["pp"] - 1], kind="pp")
        x.requires_grad_(True)
    y = chunk(x)
    loss = logits = None
    if chunk.post_process:
        total, count = gpt_loss(y, labels, groups.tp)
        loss, logits = total / count, y.detach()
        loss.backward()
    else:
        comm.send(y.detach(), groups.pp_ranks[groups.coords["pp"] + 1], kind="pp")
        dy = torch.empty_like(y)
        comm.recv(dy, groups.pp_ranks[groups.coords["pp"] + 1], kind="pp")
        y.backward(dy)
    if not chunk.pre_process:
        comm.send(x.grad, groups.pp_ranks[groups.coords["pp"] - 1], kind="pp")
    if hook is not None:
        hook.remove()
    return loss, logits, (grabbed["x"][0].grad.clone() if "x" in grabbed else None)


def misrouted(all_to_all_uneven):
    """A dispatch that delivers rows to the wrong experts: the received rows reversed."""
    def dispatch(x, group, output_splits, input_splits, source):
        y = all_to_all_uneven(x, group, output_splits, input_splits, source)
        return y.flip(0) if source == "moe_dispatch" else y
    return dispatch


def _run_layouts(layouts):
    rank, world, out = dist.get_rank(), dist.get_world_size(), {}
    for name, (sizes, changes, wrong_route) in layouts.items():
        config, layout = config_of(changes), ParallelConfig(world, **sizes, sequence_parallel=sizes.get("tp", 1) > 1)
        grid, sp = layout.grid, layout.sequence_parallel
        groups, moe_groups = new_process_groups(grid, timeout=60), new_moe_process_groups(grid, timeout=60)
        chunks = build_model(config, groups, sequence_parallel=sp, moe_groups=moe_groups)
        route_with = misrouted(moe_transformer.all_to_all_uneven) if wrong_route else moe_transformer.all_to_all_uneven
        replica = groups.coords["dp"]
        wrong = [w for w, real in (("skipped", grid.expert_dp > 1),
                                   ("over_dense_dp", grid.expert_groups("dp") != grid.groups("dp-cp"))) if real]
        held = {id(p): p for p in chunks[0].parameters()}.values()
        numel = {"expert": sum(p.numel() for p in held if hasattr(p, "expert_partition_dim"))}
        numel["dense"] = sum(p.numel() for p in held) - numel["expert"]
        res = dict(numel=numel, coords=groups.coords, wrong=wrong, tp_rank=groups.coords["tp"], post=chunks[0].post_process,
                   pre=chunks[0].pre_process, losses=[], local_experts=[m.local_expert_indices for m in moe_modules(chunks)])
        for step in range(1 if wrong_route else STEPS):
            tokens, labels = batch(replica, step)
            for p in chunks[0].parameters():
                p.grad = None
            with CommRecorder() as rec, mock.patch.object(moe_transformer, "all_to_all_uneven", route_with):
                loss, logits, dx = _step(chunks, groups, tokens, labels, keep_input_grad=step == 0)
            if wrong_route:
                res["logits"] = None if logits is None else comm.all_gather(logits, groups.tp, dim=2, kind="tp")
                break
            raw = {n: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None}
            finalize_model_grads(chunks, groups, layout, moe_groups)
            right = {n: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None}
            metrics, line = track_moe_metrics(chunks, moe_groups)
            mean_loss = torch.tensor([0.0 if loss is None else loss.item()], dtype=torch.float64)
            comm.all_reduce(mean_loss, moe_groups.dp_cp, kind="dp")
            res["losses"].append(float(mean_loss) / moe_groups.size("dp_cp"))
            if step == 0:
                res.update(dx=dx, metrics=metrics, line=line,
                           logits=None if logits is None else comm.all_gather(logits, groups.tp, dim=2, kind="tp"),
                           grads=gather_full_parameters(chunks, groups, grads=True),
                           events=[e for e in rec.events if e.op == "all_to_all"])
                # the two wrong reductions, from the same raw grads: experts not reduced, experts over dense DP
                for wrong, expert_dp in (("skipped", group_of_one()), ("over_dense_dp", moe_groups.dp_cp)):
                    for n, p in chunks[0].named_parameters():
                        if n in raw:
                            p.grad = raw[n].clone()
                    finalize_model_grads(chunks, groups, layout, dataclasses.replace(moe_groups, expert_dp=expert_dp))
                    res[wrong] = gather_full_parameters(chunks, groups, grads=True)
                for n, p in chunks[0].named_parameters():     # the step takes the right gradients
                    if n in raw:
                        p.grad = right[n]
            with torch.no_grad():
                for p in chunks[0].parameters():
                    p -= LR * p.grad
        out[name] = res
    dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def reference(name, dp):
    """One process: every replica's batch, loss = mean over replicas (aux scaled alike), SGD.
    One thread: the reference is tiny, and two cores shared by many processes make threads crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference({**LAYOUTS4, **LAYOUTS8}[name][1], dp)
    finally:
        torch.set_num_threads(threads)


def _reference(changes, dp):
    model = GPTModel(config_of(changes))
    set_aux_loss_scale([model], 1.0 / dp)
    hooks, first = {}, {}
    model.embedding.register_forward_hook(lambda m, i, out: _keep(out, hooks.setdefault("x", [])))
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        hooks.clear()
        parts = [model.loss(*batch(r, step)) for r in range(dp)]
        total = sum(parts) / dp
        total.backward()
        losses.append(total.item())
        if step == 0:
            metrics = {name: sum(float(m.metrics.get(name, 0)) for m in moe_modules([model]))
                       / len(model.config.moe_layers) / dp for name in ("load_balancing_loss", "z_loss")}
            tokens = [batch(r, 0) for r in range(dp)]
            first = dict(grads={n: p.grad.clone() for n, p in model.named_parameters()}, metrics=metrics,
                         dx=[x.grad.clone() for x in hooks["x"]],
                         logits=[model(t).detach() for t, _ in tokens])
        for m in moe_modules([model]):
            m.metrics.clear()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return dict(first, losses=losses)


@pytest.fixture(scope="module")
def runs4():
    return launch(_run_layouts, world_size=4, backend="gloo", timeout=180, output="none", layouts=LAYOUTS4)


@pytest.fixture(scope="module")
def runs8():
    return launch(_run_layouts, world_size=8, backend="gloo", timeout=240, output="none", layouts=LAYOUTS8)


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def _check_against_one_process(per_rank, name, layouts):
    sizes, changes, _ = layouts[name]
    dp = max(r[name]["coords"]["dp"] for r in per_rank) + 1
    ref = reference(name, dp)
    tp = sizes.get("tp", 1)
    s_local = BASE["seq_length"] // tp
    for rank, got in enumerate(r[name] for r in per_rank):
        replica = got["coords"]["dp"]
        if got["post"]:
            assert close(got["logits"], ref["logits"][replica]), (name, rank)
        if got["pre"]:
            want = ref["dx"][replica][got["tp_rank"] * s_local:(got["tp_rank"] + 1) * s_local]
            assert close(got["dx"] / dp, want), (name, rank)  # the reference loss is the mean over replicas
        for pname, g in got["grads"].items():
            assert close(g, ref["grads"][pname]), (name, rank, pname, float((g - ref["grads"][pname]).abs().max()))
        assert got["wrong"]   # every layout here has a wrong reduction that differs from the right one
        for wrong in got["wrong"]:  # a wrong expert reduction (where it differs from the right one) is caught
            bad = [p for p, g in got[wrong].items() if ".experts." in p and not close(g, ref["grads"][p])]
            assert bad, (name, rank, wrong)
        for step, (loss, want) in enumerate(zip(got["losses"], ref["losses"]) if got["post"] else ()):
            assert abs(loss - want) <= 1e-4 * abs(want), (name, rank, step, loss, want)
        assert got["metrics"]["load_balancing_loss"] == pytest.approx(ref["metrics"]["load_balancing_loss"], rel=1e-5)
        assert got["metrics"]["z_loss"] == pytest.approx(ref["metrics"]["z_loss"], rel=1e-5)
        assert got["line"].startswith(" load_balancing_loss: ") and got["line"].endswith(" |")
    return ref


@pytest.mark.parametrize("name", ["ep2", "ep4", "ep2-allgather", "tp2-ep2-sp", "tp2-ep2-sp-allgather"])
def test_4_ranks_equal_one_process(runs4, name):
    _check_against_one_process(runs4, name, LAYOUTS4)


def test_8_ranks_tp2_pp2_ep2_expert_tp1_equal_one_process(runs8):
    _check_against_one_process(runs8, "tp2-pp2-ep2-etp1-sp", LAYOUTS8)


def test_misrouted_tokens_change_the_output(runs4):
    ref = reference("ep4", 4)
    assert not all(close(r["ep4-misrouted"]["logits"], ref["logits"][r["ep4-misrouted"]["coords"]["dp"]])
                   for r in runs4)


@pytest.mark.parametrize("name,runs", [("ep2", "runs4"), ("ep4", "runs4"), ("tp2-ep2-sp", "runs4"),
                                       ("tp2-pp2-ep2-etp1-sp", "runs8")])
def test_all_to_all_bytes_per_moe_layer_are_tokens_times_topk_times_hidden_each_way(request, name, runs):
    """Per rank and MoE layer: dispatch forward and combine backward send the rank's own T·k rows
    (T = b·s/t tokens under SP); combine forward and dispatch backward send what its experts received,
    T·k·H on average over the EP group. 4 bytes an element (fp32)."""
    per_rank = request.getfixturevalue(runs)
    layouts = {**LAYOUTS4, **LAYOUTS8}
    sizes, changes, _ = layouts[name]
    config = config_of(changes)
    each_way = MICRO * BASE["seq_length"] // sizes.get("tp", 1) * config.moe_router_topk * BASE["hidden_size"] * 4
    by_stage = {}
    for r in per_rank:
        got = r[name]
        layers = sum(1 for _ in got["local_experts"])
        rec = comm.summarize(got["events"])
        assert rec.bytes(direction="fwd", source="moe_dispatch") == layers * each_way
        assert rec.bytes(direction="bwd", source="moe_combine") == layers * each_way
        by_stage.setdefault(got["coords"]["pp"], []).append((rec, layers))
    for ranks in by_stage.values():
        for direction, source in (("fwd", "moe_combine"), ("bwd", "moe_dispatch")):
            assert sum(rec.bytes(direction=direction, source=source) for rec, _ in ranks) == \
                sum(layers for _, layers in ranks) * each_way


def test_the_allgather_dispatcher_sends_no_all_to_all(runs4):
    for r in runs4:
        assert not r["ep2-allgather"]["events"] and not r["tp2-ep2-sp-allgather"]["events"]


def test_trainer_flags_reach_the_model_and_bad_layouts_are_one_line_errors():
    from course_lib.training.arguments import args_to_argv, gpt_config_from_args, parse_args, validate_args

    argv = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--moe-layer-freq", "([1]+[0])*4", "--moe-aux-loss-coeff", "0.01",
            "--disable-bias-linear"]
    args = validate_args(parse_args(argv), 4, check_memory=False).namespace()
    assert (args.expert_tensor_parallel_size, args.moe_ffn_hidden_size) == (2, args.ffn_hidden_size)
    config = gpt_config_from_args(args)
    assert config.moe_layers == [0, 2, 4, 6] and config.moe_token_dispatcher_type == "allgather"  # Megatron's default
    assert not config.add_bias_linear and not any(n.endswith("bias") and "layernorm" not in n
                                                  for n, _ in GPTModel(config).named_parameters())
    again = gpt_config_from_args(parse_args(args_to_argv(args)))
    assert again.moe_layers == [0, 2, 4, 6] and not again.add_bias_linear
    for argv, world, message in (
            (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2, "num-experts=3 is not divisible by"),
            (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "needs sequence parallelism"),
            (["--num-experts", "4", "--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
              "--sequence-parallel", "--disable-bias-linear"], 4,
             r"world_size=4 is not divisible by expert-tensor-parallel-size=2 × "),
            (argv[:-1], 4, r"expert-tensor-parallel-size=2 and biased linears: megatron-core refuses it \('Bias in "
                           r"Moe is only supported when ETP==1'\); add --disable-bias-linear"),
            (["--expert-model-parallel-size", "2"], 2, "expert-model-parallel-size=2 needs experts"),
            (["--num-experts", "4", "--moe-router-topk", "5"], 1, "moe-router-topk=5"),
            (["--num-experts", "4", "--context-parallel-size", "2"], 2, "not tested with context parallelism"),
            (["--num-experts", "4", "--moe-ffn-hidden-size", "30", "--expert-tensor-parallel-size", "4"], 4,
             "moe-ffn-hidden-size=30 is not divisible by expert-tensor-parallel-size=4")):
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args(argv), world, check_memory=False)


def test_moe_layer_freq_follows_megatron():
    from course_lib.moe.pattern import moe_layer_pattern, parse_moe_layer_freq

    assert moe_layer_pattern(6, 1) == [1] * 6 and moe_layer_pattern(6, 4) == [1, 0, 0, 0, 1, 0]
    assert parse_moe_layer_freq("([1]*3+[0]*1)*3") == [1, 1, 1, 0] * 3 and parse_moe_layer_freq("2") == 2
    for bad in ('__import__("os")', "[1]*[2]", "[1]*10**9"):
        with pytest.raises(ValueError, match="moe-layer-freq="):
            parse_moe_layer_freq(bad)
    with pytest.raises(ValueError, match="moe-layer-freq has 3 entries but num-layers=4"):
        GPTConfig(**{**BASE, "moe_layer_freq": [1, 0, 1]})


@pytest.mark.parametrize("name", ["ep2", "ep4", "tp2-ep2-sp"])
def test_parameters_each_rank_holds_equal_the_sizing_formula(runs4, name):
    """course_lib.sizing.moe's per-rank counts (dense split over TP, experts over expert TP × EP) equal
    what the ranks' modules hold (pp = 1: exact)."""
    from course_lib.sizing.moe import moe_bytes_per_rank, moe_parameter_counts

    sizes, changes, _ = LAYOUTS4[name]
    c = config_of(changes)
    counts = moe_parameter_counts(num_layers=c.num_layers, hidden_size=c.hidden_size,
                                  num_attention_heads=c.num_attention_heads, vocab_size=c.padded_vocab_size,
                                  num_experts=c.num_experts, moe_router_topk=c.moe_router_topk,
                                  moe_ffn_hidden_size=c.moe_ffn_hidden_size, moe_layer_freq=c.moe_layer_freq,
                                  max_position_embeddings=c.max_position_embeddings,
                                  add_bias_linear=c.add_bias_linear)
    want = moe_bytes_per_rank(counts, world_size=4, **sizes)
    for r in runs4:
        assert r[name]["numel"] == {"expert": want["expert_params"], "dense": want["dense_params"]}
