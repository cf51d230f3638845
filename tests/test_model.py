"""The tiny GPT of course_lib.model: one set of master weights, any layout, same gradients.

Every multi-rank test runs one training step of a parallel layout on real forked ranks
(gloo) and compares every parameter and every gradient, re-assembled from the shards and
stages, with the dense single-process model on the same global batch.
"""

import math

import pytest
import torch

from course_lib.data import (ByteTokenizer, cp_token_positions, get_batch, get_batch_on_this_cp_rank, get_global_batch,
                             vocab_size_with_padding)
from course_lib.launch import launch
from course_lib.model import GPTConfig, GPTModel, build_model, gather_full_parameters, gpt_loss, layer_ranges
from course_lib.process_groups import new_process_groups
from course_lib.topology import ParallelConfig

CFG = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, seed=1234)
MICRO, GLOBAL = 2, 8


def test_vocabulary_is_padded_once_for_every_tp_size():
    assert ByteTokenizer.vocab_size == 257
    assert vocab_size_with_padding(257) == 384 == CFG.padded_vocab_size  # 3 x 128: TP 1, 2, 4, 8 all divide it
    assert vocab_size_with_padding(257, make_vocab_size_divisible_by=4) == 260
    assert vocab_size_with_padding(384, make_vocab_size_divisible_by=128) == 384
    assert GPTConfig(vocab_padding_tp=2).padded_vocab_size == vocab_size_with_padding(257, 2) == 512


def test_config_rejects_bad_sizes_in_one_line():
    with pytest.raises(ValueError, match="hidden_size=66 is not divisible by num_attention_heads=4"):
        GPTConfig(hidden_size=66, num_attention_heads=4)
    with pytest.raises(ValueError, match="max_position_embeddings=32 is shorter than seq_length=64"):
        GPTConfig(seq_length=64, max_position_embeddings=32)
    with pytest.raises(ValueError, match="num_layers=0 must be an integer >= 1"):
        GPTConfig(num_layers=0)


def test_master_weights_are_seeded_once_named_like_megatron_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = GPTModel(CFG), GPTModel(CFG)
    assert torch.equal(torch.get_rng_state(), state)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    other = dict(GPTModel(CFG.with_(seed=7)).named_parameters())
    assert not torch.equal(pa["decoder.layers.0.self_attention.linear_qkv.weight"],
                           other["decoder.layers.0.self_attention.linear_qkv.weight"])
    # Megatron-core's GPTModel names; tied embeddings: no separate output_layer.weight
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 "decoder.layers.3.input_layernorm.weight", "decoder.layers.3.self_attention.linear_proj.weight",
                 "decoder.layers.3.mlp.linear_fc1.weight", "decoder.final_layernorm.bias"):
        assert name in pa
    assert not any(n.startswith("output_layer") for n in pa)
    assert pa["embedding.word_embeddings.weight"].shape == (384, 64)
    # init: N(0, 0.02^2); output GEMMs scaled by 1/sqrt(2L)
    assert abs(pa["embedding.word_embeddings.weight"].std().item() - 0.02) < 1e-3
    assert abs(pa["decoder.layers.0.mlp.linear_fc2.weight"].std().item() - 0.02 / math.sqrt(8)) < 5e-4


def test_dense_model_output_layer_is_the_embedding_matrix():
    model = GPTModel(CFG)
    batch = get_global_batch(0, 2, CFG.seq_length)
    logits = model(batch["tokens"])                                        # [s, b, V]
    assert logits.shape == (CFG.seq_length, 2, 384)
    hidden = model.decoder(model.embedding(batch["tokens"]))
    torch.testing.assert_close(logits, hidden @ model.embedding.word_embeddings.weight.t(), rtol=0, atol=0)
    # small initial weights: logits nearly uniform, loss close to ln(V)
    loss = model.loss(batch["tokens"], batch["labels"]).item()
    assert abs(loss - math.log(384)) < 0.05


def test_layer_ranges_follow_megatron_virtual_stage_order():
    # virtual stage c * pp + r; 8 layers, pp 2, vp 2: rank 0 holds layers 0-1 and 4-5
    assert layer_ranges(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="not divisible"):
        layer_ranges(6, 4)


# ------------------------------------------------------------------------ one step, any layout


def _one_step(tp, pp, cp, vp, sp, optimizer_steps):
    """On each rank: build the layout, run one pipeline schedule + finalize_model_grads, gather."""
    import torch.distributed as dist

    from course_lib.pipeline.check import check_schedule
    from course_lib.pipeline.executor import run_rank_schedule
    from course_lib.pipeline.schedules import build_schedule
    from course_lib.train import Optimizer, finalize_model_grads

    config = ParallelConfig(dist.get_world_size(), tp=tp, pp=pp, cp=cp, num_layers=CFG.num_layers,
                            num_attention_heads=CFG.num_attention_heads, hidden_size=CFG.hidden_size,
                            seq_length=CFG.seq_length, micro_batch_size=MICRO, global_batch_size=GLOBAL,
                            sequence_parallel=sp, virtual_pipeline_model_parallel_size=vp)
    groups = new_process_groups(config.grid, timeout=60)
    c = groups.coords
    chunks = build_model(CFG, groups, vp=config.vpp, sequence_parallel=config.sequence_parallel)
    start = gather_full_parameters(chunks, groups)
    m = config.num_microbatches
    toks, labs = [], []
    for j in range(m):
        b = get_batch(0, j, c["dp"], config.dp, MICRO, CFG.seq_length, CFG.seed, global_batch_size=GLOBAL)
        b = get_batch_on_this_cp_rank({"tokens": b["tokens"], "labels": b["labels"]}, c["cp"], cp)
        toks.append(b["tokens"])
        labs.append(b["labels"])
    schedule = build_schedule("interleaved" if vp > 1 else "1f1b", pp, m, vp)
    shape = (CFG.seq_length // cp // (tp if sp else 1), MICRO, CFG.hidden_size)

    def loss_fn(logits, labels):
        total, count = gpt_loss(logits, labels, groups.tp)
        return total / count

    out = run_rank_schedule(schedule, c["pp"], dict(enumerate(chunks)), torch.cat(toks), torch.cat(labs),
                            activation_shape=shape, pp_group=groups.pp, p2p=check_schedule(schedule),
                            loss_fn=loss_fn)
    finalize_model_grads(chunks, groups, config)
    grads = gather_full_parameters(chunks, groups, grads=True)
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
    opt = Optimizer(named, "adam", weight_decay=0.01)
    for _ in range(optimizer_steps):
        opt.step(1e-2)
    after = gather_full_parameters(chunks, groups)
    positions = chunks[0].embedding.position_ids if chunks[0].embedding is not None else None
    attention = {type(layer.self_attention).__name__ for chunk in chunks for layer in chunk.decoder.layers.values()}
    return dict(start=start, grads=grads, after=after, coords=c, losses=out["losses"], positions=positions,
                attention=attention)


@pytest.fixture(scope="module")
def dense():
    model = GPTModel(CFG)
    batch = get_global_batch(0, GLOBAL, CFG.seq_length, CFG.seed)
    loss = model.loss(batch["tokens"], batch["labels"])
    loss.backward()
    return dict(loss=loss.item(), params={n: p.detach().clone() for n, p in model.named_parameters()},
                grads={n: p.grad.clone() for n, p in model.named_parameters()})


LAYOUTS = {   # name: (tp, pp, cp, vp, sp); 4 ranks each, DP derived
    "TP2+SP x PP2": (2, 2, 1, 1, True),
    "TP2 x CP2 + SP": (2, 1, 2, 1, True),
    "PP2 interleaved vp2 x DP2": (1, 2, 1, 2, False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_parameter_and_gradient_equals_the_dense_model(layout, dense):
    tp, pp, cp, vp, sp = LAYOUTS[layout]
    res = launch(_one_step, world_size=4, output="none", timeout=120, tp=tp, pp=pp, cp=cp, vp=vp, sp=sp,
                 optimizer_steps=2)
    covered = set()
    for r in res:
        for name, value in r["start"].items():        # identical starting numbers, from the one master
            torch.testing.assert_close(value, dense["params"][name], rtol=0, atol=0, msg=f"{layout} {name}")
        for name, g in r["grads"].items():            # every gradient, after finalize_model_grads
            torch.testing.assert_close(g, dense["grads"][name], rtol=1e-5, atol=1e-6, msg=f"{layout} grad {name}")
        covered |= set(r["grads"])
    assert covered == set(dense["grads"]), f"{layout}: parameters no rank holds: {set(dense['grads']) - covered}"
    # the last stage's micro-batch losses (each / m) add up to the dense loss of the global batch
    last = [r for r in res if r["coords"]["pp"] == pp - 1]
    for r in last:
        assert len(r["losses"]) == GLOBAL // (MICRO * (4 // (tp * pp * cp)))
    dp = 4 // (tp * pp * cp)
    per_dp = {}
    for r in last:
        per_dp[r["coords"]["dp"], r["coords"]["cp"]] = sum(r["losses"])
    assert abs(sum(per_dp.values()) / (dp * cp) - dense["loss"]) < 1e-5


def test_tied_embedding_copies_start_equal_and_take_identical_steps():
    res = launch(_one_step, world_size=2, output="none", timeout=120, tp=1, pp=2, cp=1, vp=1, sp=False,
                 optimizer_steps=3)
    first, last = (r for r in sorted(res, key=lambda r: r["coords"]["pp"]))
    name = "embedding.word_embeddings.weight"
    # the last stage's copy started at zero and got the first stage's values over the embedding group
    assert torch.equal(first["start"][name], last["start"][name])
    assert torch.equal(first["grads"][name], last["grads"][name])
    assert torch.equal(first["after"][name], last["after"][name])             # bit for bit after 3 steps
    assert not torch.equal(first["after"][name], first["start"][name])


def test_context_parallel_ranks_embed_their_true_zigzag_positions():
    res = launch(_one_step, world_size=2, output="none", timeout=120, tp=1, pp=1, cp=2, vp=1, sp=False,
                 optimizer_steps=0)
    got = {r["coords"]["cp"]: r["positions"].tolist() for r in res}
    assert all(r["attention"] == {"ContextParallelSelfAttention"} for r in res)   # the ring is the core attention
    c = CFG.seq_length // 4
    assert got[0] == list(range(0, c)) + list(range(3 * c, 4 * c))           # chunks 0 and 3
    assert got[1] == list(range(c, 3 * c))                                   # chunks 1 and 2
    assert got[0] == cp_token_positions(CFG.seq_length, 0, 2).tolist()
