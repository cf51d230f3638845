"""The bridge's bytes are DeepSpeed 0.19.8's estimators, and its sentences about DeepSpeed are true.

``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs`` run live on a grid
of models, GPU counts, nodes and offload options; ``ds_memory.deepspeed_estimate`` must give the same
bytes per GPU and per node, and its items must add up to them. DeepSpeed's ``model_to_params`` gives
the largest layer of the course GPT. DeepSpeed's ``DynamicLossScaler`` runs beside the course's
Megatron scaler to check the line the bridge prints about the two. No process is launched.
"""

from __future__ import annotations

import itertools

import pytest

from course_lib.deepspeed import config as ds_config, memory as ds_memory, schema as ds_schema

pytestmark = pytest.mark.skipif(not ds_schema.deepspeed_installed(), reason="DeepSpeed 0.19.8 is not installed")


@pytest.fixture(scope="module")
def estimators():
    ds_schema.import_deepspeed()
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    return stage_1_and_2, stage3


def test_the_estimate_is_deepspeeds_byte_for_byte(estimators):
    stage_1_and_2, stage3 = estimators
    checked = 0
    for psi, largest, gpus, nodes in itertools.product((38272, 1.3e9, 7.5e9), (12288, 4e8), (1, 4, 8), (1, 2)):
        d = gpus * nodes
        for offload in (False, True):
            cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=offload)
            ours = ds_memory.deepspeed_estimate(2, psi, d, offload_optimizer=offload, nodes=nodes)
            assert (ours.gpu, ours.host) == (gpu, cpu), (psi, gpus, nodes, offload)
            assert sum(i.bytes for i in ours.items if i.where == "GPU") == pytest.approx(gpu, rel=1e-9, abs=1)
            if offload:        # the estimator's host figure is the node's; the no-offload one counts loading
                assert sum(i.bytes for i in ours.items if i.where == "host") == pytest.approx(cpu, abs=1)
            checked += 1
        for off_opt, off_param, zero_init in itertools.product((False, True), (False, True), (False, True)):
            if off_param and not off_opt:
                continue
            cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(psi, largest, gpus, nodes, cpu_offload=off_opt,
                                                                       cpu_offload_params=off_param,
                                                                       zero_init=zero_init)
            ours = ds_memory.deepspeed_estimate(3, psi, d, largest, offload_optimizer=off_opt,
                                                offload_param=off_param, nodes=nodes, zero_init=zero_init)
            assert (ours.gpu, ours.host) == (gpu, cpu), (psi, largest, gpus, nodes, off_opt, off_param, zero_init)
            assert sum(i.bytes for i in ours.items if i.where == "GPU") == pytest.approx(gpu, abs=2)
            assert sum(i.bytes for i in ours.items if i.where == "host") == pytest.approx(cpu, abs=2)
            checked += 1
    assert checked == 3 * 2 * 3 * 2 * (2 + 6)
    assert ds_memory.deepspeed_estimate(1, 1e9, 8) is None and ds_memory.deepspeed_estimate(0, 1e9, 8) is None


def test_the_largest_layer_is_deepspeeds_of_the_course_gpt(estimators):
    from course_lib.model import GPTConfig, GPTModel

    _, stage3 = estimators
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16))
    total, largest = stage3.model_to_params(model)
    assert ds_memory.largest_layer(model) == largest == model.embedding.word_embeddings.weight.numel()
    assert total == sum(p.numel() for p in model.parameters())


def test_each_extra_over_the_paper_is_an_item():
    """ZeRO-3 without offload over d = 8: the paper's 16/d, then +2/d and 4L, each on a line of its own."""
    t = ds_config.translate(ds_config.parse({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    b = ds_config.state_bytes(t, 8e9, 8, largest_layer=1e8)
    extra = [i for i in b["deepspeed"].items if i.extra and i.where == "GPU"]
    assert [i.bytes for i in extra] == [2 * 8e9 / 8, 4 * 1e8]
    paper = sum(i.bytes for i in b["deepspeed"].items if not i.extra and i.where == "GPU")
    assert paper == b["paper"][0].total == 16 * 8e9 / 8


def test_the_fp16_scaler_line_is_true():
    """DeepSpeed's DynamicLossScaler first grows after window + 1 clean steps, Megatron's after window; at
    the minimum scale an overflow raises in DeepSpeed and is skipped in Megatron."""
    ds_schema.import_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from course_lib.mixed_precision import make_loss_scaler

    window = 4
    ours = make_loss_scaler(True, initial_loss_scale=2.0 ** 8, min_loss_scale=1.0, loss_scale_window=window,
                            hysteresis=1)
    theirs = DynamicLossScaler(init_scale=2.0 ** 8, scale_window=window, min_scale=1.0, delayed_shift=1,
                               consecutive_hysteresis=False)
    grew = {"ours": None, "theirs": None}
    for step in range(1, 2 * window + 2):
        ours.update(False)
        theirs.update_scale(False)
        if grew["ours"] is None and ours.value > 2.0 ** 8:
            grew["ours"] = step
        if grew["theirs"] is None and theirs.cur_scale > 2.0 ** 8:
            grew["theirs"] = step
    assert grew == {"ours": window, "theirs": window + 1}
    low = make_loss_scaler(True, initial_loss_scale=1.0, min_loss_scale=1.0, hysteresis=1)
    low.update(True)
    assert low.value == 1.0
    at_min = DynamicLossScaler(init_scale=1.0, scale_window=window, min_scale=1.0, delayed_shift=1,
                               consecutive_hysteresis=False)
    with pytest.raises(Exception, match="already at minimum"):
        at_min.update_scale(True)
