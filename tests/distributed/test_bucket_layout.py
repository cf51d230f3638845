"""The engine's bucket layout (course_lib.distributed.buffer) against megatron-core 0.16.1's own, computed live.

megatron-core's ``_ParamAndGradBuffer`` (``megatron/core/distributed/param_and_grad_buffer.py``) is built on
one forked gloo rank, through the CPU shim course_lib/mcore/cpu.py, for the same parameters, bucket
size and data-parallel size (its group stands in by its ``size()``: the layout reads nothing else of it),
with and without ``use_distributed_optimizer``. Its ``bucket_indices`` and ``param_index_map`` (start, end,
bucket of every parameter in the flat buffer) must equal the course's buckets laid end to end: no padding
for DDP; 64-element parameter starts, buckets padded to ``lcm(d, 128)`` and the ``shared_embedding``
parameter in a bucket of its own for the distributed optimizer. Models: the MLP of tests/sharding_cases.py
and the course GPT as the first pipeline stage holds it (its word embedding marked ``shared_embedding``).
Megatron-FSDP's rules (a multiple of ``d``, the shared embedding alone) are checked by hand: its buffer
needs CUDA streams and a device mesh.
"""

import math

import pytest
import torch

import sharding_cases as C
from course_lib.distributed.buffer import layout_rules, size_buckets, unit_buckets
from course_lib.launch import launch

DPS = (1, 2, 3, 4, 8)
BUCKET_SIZES = (None, 600, 3000)


def _models():
    from course_lib.model import GPTConfig, GPTModel

    gpt = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16))
    gpt.embedding.word_embeddings.weight.shared_embedding = True   # as on the first of two stages
    return {"mlp": list(C.make_model().named_parameters()), "gpt_first_stage": list(gpt.named_parameters())}


def _course_layout(named, bucket_size, dp, distopt):
    """``(bucket_indices, {name: (start, end, bucket)})`` of the course's buckets, laid end to end."""
    buckets = size_buckets(named, bucket_size, dp, "distributed_optimizer" if distopt else "ddp")
    indices, where, offset = [], {}, 0
    for b in buckets:
        indices.append((offset, offset + b.numel))
        where.update({pr.name: (offset + pr.start, offset + pr.end, b.index) for pr in b.params})
        offset += b.numel
    return indices, where


def _megatron_core_layouts():
    """On the rank: megatron-core's layout for every model, dp, bucket size and distributed-optimizer flag."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from course_lib.mcore.cpu import megatron_core_on_cpu

    out = {}
    for model, named in _models().items():
        params = [p for _, p in named]
        for dp in DPS:
            group = SimpleNamespace(size=lambda dp=dp: dp, rank=lambda: 0)
            for bucket_size in BUCKET_SIZES:
                for distopt in (False, True):
                    with megatron_core_on_cpu():
                        buf = _ParamAndGradBuffer(
                            DistributedDataParallelConfig(use_distributed_optimizer=distopt), torch.float32,
                            torch.float32, params, group, bucket_size, {p: n for n, p in named}, 1.0,
                            list(range(len(params))), False, SimpleNamespace(tp=group, dp_cp=group))
                    out[model, dp, bucket_size, distopt] = (list(buf.bucket_indices),
                                                            {n: tuple(buf.param_index_map[p]) for n, p in named})
    return out


@pytest.fixture(scope="module")
def megatron_core():
    pytest.importorskip("megatron.core", reason="megatron-core is the optional extra: pip install .[megatron]")
    return launch(_megatron_core_layouts, world_size=1, output="none", timeout=120)[0]


@pytest.mark.parametrize("distopt", [False, True])
@pytest.mark.parametrize("model", ["mlp", "gpt_first_stage"])
def test_layout_equals_megatron_core(megatron_core, model, distopt):
    named = _models()[model]
    for dp in DPS:
        for bucket_size in BUCKET_SIZES:
            want = megatron_core[model, dp, bucket_size, distopt]
            assert _course_layout(named, bucket_size, dp, distopt) == want, (model, dp, bucket_size, distopt)
    padded = megatron_core[model, 4, None, distopt][0][-1][1]
    assert (padded > sum(p.numel() for _, p in named)) == distopt   # the distributed optimizer does pad


def test_distributed_optimizer_rules_and_the_shared_embedding_bucket():
    named = _models()["gpt_first_stage"]
    buckets = size_buckets(named, None, 4, "distributed_optimizer")
    assert [[pr.name for pr in b.params] for b in buckets if any(
        getattr(pr.param, "shared_embedding", False) for pr in b.params)] == [["embedding.word_embeddings.weight"]]
    assert len(buckets) == 2            # in reverse order: everything else, then the word embedding alone
    for b in buckets:
        assert b.numel % math.lcm(4, 128) == 0 and all(pr.start % 64 == 0 for pr in b.params)
    assert layout_rules("distributed_optimizer", 3) == (64, 384, True)
    with pytest.raises(ValueError, match="layout='zero'"):
        layout_rules("zero", 4)


def test_megatron_fsdp_pads_to_d_and_splits_the_shared_embedding():
    """Megatron-FSDP (``build_data_parallel_buffer_index``): a sharded bucket is a multiple of d, parameters
    are packed without gaps, and the shared embedding gets a bucket of its own (``_does_param_require_new_bucket``)."""
    named = _models()["gpt_first_stage"]
    for b in size_buckets(named, 3000, 3, "fsdp"):
        assert b.numel % 3 == 0 and b.numel - b.data_numel < 3
        assert [pr.start for pr in b.params] == [0] + [pr.end for pr in b.params[:-1]]
    root = [(n, p) for n, p in named if not n.startswith("decoder.layers.")]
    units = [(None, root)] + [(i, [(n, p) for n, p in named if n.startswith(f"decoder.layers.{i}.")]) for i in (0, 1)]
    buckets = unit_buckets(units, 4)
    assert [b.module for b in buckets] == [1, 0, None, None]   # the root unit: its rest, then the embedding
    assert [pr.name for pr in buckets[3].params] == ["embedding.word_embeddings.weight"]
    assert [b.index for b in buckets] == list(range(4)) and all(b.numel % 4 == 0 for b in buckets)
