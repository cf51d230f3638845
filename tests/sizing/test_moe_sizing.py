"""course_lib.sizing.moe against a hand count, the course's real MoE GPT, and Mixtral 8x7B's published figures.

The per-rank counts are also checked against the parameters real ranks hold (tests/moe/test_moe_model.py).
"""

import pytest

from course_lib.model import GPTConfig, GPTModel
from course_lib.sizing.memory import megatron_optimizer_bytes_per_param
from course_lib.sizing.moe import MIXTRAL_8X7B, moe_bytes_per_rank, moe_parameter_counts

TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, num_experts=8, moe_router_topk=2,
            moe_ffn_hidden_size=48, moe_layer_freq=2)


def tiny_counts():
    config = GPTConfig(**TINY)
    return config, moe_parameter_counts(num_layers=4, hidden_size=32, num_attention_heads=4,
                                        vocab_size=config.padded_vocab_size, num_experts=8, moe_router_topk=2,
                                        moe_ffn_hidden_size=48, moe_layer_freq=2, max_position_embeddings=16)


def test_tiny_model_by_hand_and_by_its_real_parameters():
    config, c = tiny_counts()
    # by hand: V = 384 (257 padded to 128), h = 32, 4 layers, MoE in layers 0 and 2 (--moe-layer-freq 2)
    assert c["embedding"] == 384 * 32 + 16 * 32                       # words + learned positions (tied output)
    assert c["attention"] == 4 * ((32 * 96 + 96) + (32 * 32 + 32))    # qkv w+b, proj w+b
    assert c["norms"] == 4 * 2 * (2 * 32) + 2 * 32                    # two LayerNorms a layer + final
    assert c["dense_mlp"] == 2 * ((32 * 128 + 128) + (128 * 32 + 32))  # layers 1 and 3
    assert c["router"] == 2 * (8 * 32 + 8)                            # weight + bias (Megatron's Router)
    assert c["per_expert"] == (32 * 48 + 48) + (48 * 32 + 32)          # fc1 w+b, fc2 w+b
    assert c["experts"] == 2 * 8 * c["per_expert"]
    assert c["total"] == sum(p.numel() for p in GPTModel(config).parameters())   # the real nn.Module
    bare = moe_parameter_counts(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=384, num_experts=8,
                                moe_ffn_hidden_size=48, moe_layer_freq=2, max_position_embeddings=16,
                                add_bias_linear=False)                 # --disable-bias-linear: no bias anywhere
    assert bare["total"] == sum(p.numel() for p in GPTModel(config.with_(add_bias_linear=False)).parameters())
    assert c["total"] - bare["total"] == 4 * (96 + 32) + 2 * (128 + 32) + 2 * (8 + 8 * (48 + 32))
    assert c["active"] == c["total"] - 2 * (8 - 2) * c["per_expert"]            # 2 of 8 experts per MoE layer


def test_mixtral_8x7b_matches_the_published_46_7b_total_and_12_9b_active():
    """Mistral AI, 'Mixtral of experts' (2023-12-11): '46.7B total parameters but only uses 12.9B
    parameters per token'; shape from Jiang et al. 2024 (arXiv:2401.04088), Table 1."""
    c = moe_parameter_counts(**MIXTRAL_8X7B)
    assert round(c["total"] / 1e9, 1) == 46.7
    assert round(c["active"] / 1e9, 1) == 12.9


def test_bytes_per_rank_split_experts_over_ep_and_shard_their_optimizer_over_expert_dp():
    _, c = tiny_counts()
    one = moe_bytes_per_rank(c, world_size=8)
    ep4 = moe_bytes_per_rank(c, world_size=8, ep=4)
    assert ep4["expert_params"] == one["expert_params"] / 4 and ep4["dense_params"] == one["dense_params"]
    assert (ep4["dp"], ep4["expert_dp"]) == (8, 2)                     # EP does not shrink dense DP
    sharded = moe_bytes_per_rank(c, world_size=8, ep=4, distributed_optimizer=True)
    per_expert_param = megatron_optimizer_bytes_per_param(2, True)      # optimizer over expert DP = 2
    per_dense_param = megatron_optimizer_bytes_per_param(8, True)       # over dense DP = 8
    assert sharded["expert"].total == pytest.approx(per_expert_param.weights * ep4["expert_params"]
                                                    + per_expert_param.grads * ep4["expert_params"]
                                                    + per_expert_param.optimizer * ep4["expert_params"])
    assert sharded["dense"].optimizer == pytest.approx(12 / 8 * one["dense_params"])   # bf16 Adam: 12 B over d
    tp2 = moe_bytes_per_rank(c, world_size=8, tp=2, ep=2, expert_tp=1)
    assert tp2["dense_params"] == c["tp_split"] / 2 + c["replicated"] and tp2["expert_params"] == c["experts"] / 2
    with pytest.raises(ValueError, match="world_size=8 is not divisible by expert-tensor-parallel-size=2"):
        moe_bytes_per_rank(c, world_size=8, tp=2, ep=8)
