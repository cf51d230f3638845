"""The bridge's verdict is DeepSpeed 0.19.8's own (course_lib.deepspeed.schema).

DeepSpeed's parser runs live here (``DeepSpeedConfig``, with ``deepspeed.comm`` answering the world
size the config is checked for), beside :func:`ds_schema.check`, on a generated set of configs: every
key of every mirrored section with values of every JSON type and pydantic's edge cases, the batch
keys over several world sizes, the removed blocks, deprecated and aliased keys, precision pairs,
the optimizer and scheduler blocks. Each must get the same accept/reject verdict; the count is printed.
The tables themselves are read back from DeepSpeed's pydantic models, its removed-key lists and the
keys its parser reads (recorded by a dict that logs every lookup). No process is launched.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import time
import types
import typing

import pytest

from course_lib.deepspeed import schema as ds_schema

pytestmark = pytest.mark.skipif(not ds_schema.deepspeed_installed(), reason="DeepSpeed 0.19.8 is not installed")
if ds_schema.deepspeed_installed():
    ds_schema.import_deepspeed()
    from deepspeed.runtime import config as ds_runtime_config
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum)

    MODELS = {"zero_optimization": DeepSpeedZeroConfig, "offload_param": DeepSpeedZeroOffloadParamConfig,
              "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig, "zenflow": ZenFlowConfig,
              "leaf_module": DeepSpeedZeroLeafModuleConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}

VALUES = [True, False, 0, 1, 2, 3, -1, 0.0, -0.0, 1.0, 0.5, 1.5, 3.0, 5e8, 1e20, 9.3e18, 2 ** 63, 10 ** 30,
          "0", "1", "2", "3", "00", "007", "1.0", "1.00", "0001.000", "1_0.0", "1.", ".5", "1e3", "5e-1", "1_000",
          "1__0", "_1", "1_", " 3", "3 ", "\t3\n", "+3", "-1", "-0.0", "1 0", "true", "True", "YES", "oN", "off",
          "n", " true", "", "x", "\u0663", "inf", "nan", "cpu", "CPU", "none", "nvme", "/tmp", "auto", None, [],
          [1], ["a"], {}, {"device": "cpu"}, {"x": 1}]
BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def _deepspeed_accepts(config, world: int) -> tuple[bool, str]:
    """DeepSpeed's own ``DeepSpeedConfig(config)`` with ``deepspeed.comm`` saying ``world`` ranks."""
    comm = ds_runtime_config.dist
    saved = comm.get_rank, comm.get_world_size
    comm.get_rank, comm.get_world_size = (lambda *a, **k: 0), (lambda *a, **k: world)
    try:
        ds_runtime_config.DeepSpeedConfig(config)
        return True, ""
    except Exception as err:     # noqa: BLE001 - any refusal is DeepSpeed's verdict
        return False, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        comm.get_rank, comm.get_world_size = saved


def _bridge_accepts(config, dp) -> tuple[bool, str]:
    try:
        ds_schema.check(config, dp)
        return True, ""
    except ValueError as err:
        assert "\n" not in str(err), str(err)
        return False, str(err)


def _world(config, dp) -> int:
    return dp if dp is not None else ds_schema.implied_dp(config) or 1


def _generated() -> list[tuple[str, dict, int | None]]:
    """``(label, config, dp)``: the generated set (see the module docstring)."""
    cases = []
    for section, table in ds_schema.SECTIONS.items():
        for key in table:
            for value in VALUES:
                if section == "zero_optimization":
                    blocks = [{"zero_optimization": {key: value}}, {"zero_optimization": {"stage": 3, key: value}}]
                elif section in ("offload_param", "offload_optimizer", "zenflow", "leaf_module"):
                    blocks = [{"zero_optimization": {"stage": s, section: {key: value}}} for s in (2, 3)]
                else:
                    blocks = [{section: {key: value}}, {section: {"enabled": True, key: value}}]
                    if section == "bf16":
                        blocks.append({"bfloat16": {key: value}})
                cases += [(f"{section}.{key}={value!r}", {**BASE, **b}, 4) for b in blocks]
    for key in (*ds_schema.SECTIONS["zero_optimization"], "stage3_prefetch_bucket_size"):   # names and aliases
        f = ds_schema.ZERO.get(key)
        if f and f.name:
            cases.append((f"alias {f.name}", {**BASE, "zero_optimization": {f.name: 5}}, 4))
            cases.append((f"alias and name {key}", {**BASE, "zero_optimization": {f.name: 5, key: 5}}, 4))
    for old, new in ds_schema.DEPRECATED.items():
        for value in (True, False, None, "auto"):
            zero = {"stage": 3, old: value}
            cases.append((f"deprecated {old}={value!r}", {**BASE, "zero_optimization": zero}, 4))
            if new:
                other = {"device": "cpu"} if new.startswith("offload_") else True
                cases.append((f"deprecated {old} with {new}", {**BASE, "zero_optimization": {**zero, new: other}}, 4))
    for key in ("elasticity", "amp", "sparse_gradients", "nebula", "curriculum_learning", "eigenvalue"):
        cases.append((f"removed {key}", {**BASE, key: {}}, 4))
    for key in ("mics_shard_size", "zeropp_loco_param", "mics_hierarchical_params_gather"):
        cases.append((f"removed zero {key}", {**BASE, "zero_optimization": {"stage": 3, key: 1}}, 4))
    for value in (True, False, None, 0, 1, "auto", [], "stage3"):
        cases.append((f"zero_optimization={value!r}", {**BASE, "zero_optimization": value}, 4))
        cases.append((f"zero_optimization={value!r} allgather_size", {**BASE, "zero_optimization": value,
                                                                      "allgather_size": -1}, 4))
        for key in ("fp16", "bf16", "bfloat16", "optimizer", "scheduler"):
            cases.append((f"{key}={value!r}", {**BASE, key: value}, 4))
    for opt in ({"type": None}, {"type": 5}, {"type": "AdamW", "params": [1]}, {"type": "AdamW", "params": None},
                {"params": [1]}, {"type": "AdamW", "params": {"max_grad_norm": "x"}},
                {"type": "AdamW", "params": {"max_grad_norm": 1.0, "betas": [0.9]}}, {"type": "Lamb"}):
        cases.append((f"optimizer {opt}", {**BASE, "optimizer": opt}, 4))
    for fp16, bf16 in itertools.product([None, {"enabled": True}, {"enabled": False}, {"enabled": "auto"}],
                                        [None, {"enabled": True}, {"enabled": "yes"}, {"enabled": 0}]):
        config = {**BASE, **({"fp16": fp16} if fp16 is not None else {}), **({"bf16": bf16} if bf16 is not None else {})}
        cases.append((f"fp16 {fp16} bf16 {bf16}", config, 4))
    for block, stage in itertools.product(({"fp16": {"fp16_master_weights_and_grads": True}},
                                           {"bf16": {"bf16_master_weights_and_grads": True}},
                                           {"bf16": {"bf16_optimizer_states": True}},
                                           {"bf16": {"bf16_optimizer_states": True, "bf16_master_weights_and_grads": 1}},
                                           {"zero_optimization": {"compute_grad_norm": False}},
                                           {"zero_optimization": {"offload_optimizer": {"ratio": 0.5}}}), range(4)):
        zero = {**block.get("zero_optimization", {}), "stage": stage}
        cases.append((f"{block} at stage {stage}", {**BASE, **block, "zero_optimization": zero}, 4))
    batch_values = (None, 0, -2, 1, 2, 4, 8, 8.0, 2.5, "8", "auto", True)
    for tbs, micro, ga in itertools.product(batch_values, repeat=3):
        config = {k: v for k, v in zip(ds_schema.BATCH_KEYS, (tbs, micro, ga)) if v is not None}
        for dp in (None, 1, 2, 4):
            cases.append((f"batch {config} dp {dp}", config, dp))
    cases.append(("the seed's file", ds_schema.read(FIXTURE), None))
    cases.append(("typo at the top level", {**BASE, "zero_optimisation": {"stage": 3}}, 4))
    return cases


FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "ds_config_zero3_offload.json"


@pytest.fixture(scope="module", autouse=True)
def _quiet_deepspeed():
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_the_bridge_gives_deepspeeds_verdict_on_every_generated_config():
    start = time.perf_counter()
    cases = _generated()
    disagree, refused = [], 0
    for label, config, dp in cases:
        ours, why = _bridge_accepts(config, dp)
        theirs, their_why = _deepspeed_accepts(config, _world(config, dp))
        refused += not theirs
        if ours != theirs:
            disagree.append(f"{label} (dp {dp}): bridge {'accepts' if ours else 'refuses: ' + why}; "
                            f"DeepSpeed {'accepts' if theirs else 'refuses: ' + their_why}")
    print(f"\n[ds_schema] verdicts agree on {len(cases) - len(disagree)} of {len(cases)} generated configs "
          f"({refused} refused by DeepSpeed) in {time.perf_counter() - start:.1f} s")
    assert not disagree, f"{len(disagree)} disagreements, first ones:\n" + "\n".join(disagree[:15])


def test_what_the_bridge_reads_is_what_deepspeed_reads():
    """The values :class:`ds_schema.Checked` holds are DeepSpeed's own, after coercion and defaults."""
    config = {**BASE, "bf16": {"enabled": "yes"}, "fp16": {"loss_scale": "128"},
              "zero_optimization": {"stage": "3", "reduce_bucket_size": 5e8, "prefetch_bucket_size": "2_000",
                                    "offload_param": {"device": "cpu", "pin_memory": 0},
                                    "cpu_offload": True, "overlap_comm": "auto"}}
    checked = ds_schema.check(config, 4)
    zero, fp16, bf16 = (DeepSpeedZeroConfig(**config["zero_optimization"]), DeepSpeedFP16Config(**config["fp16"]),
                        DeepSpeedBF16Config(**config["bf16"]))
    for key, f in ds_schema.ZERO.items():
        if key not in ds_schema.DEPRECATED and f.kind not in ("offload_param", "offload_optimizer", "leaf", "object?"):
            want = getattr(zero, f.name or key)
            assert checked.zero.get(key, want) == getattr(want, "value", want), key
    for what in ("param", "optimizer"):
        block = getattr(zero, f"offload_{what}")
        assert checked.zero[f"offload_{what}"] == {k: getattr(getattr(block, k), "value", getattr(block, k))
                                                   for k in checked.zero[f"offload_{what}"]}
    assert checked.fp16 == {k: getattr(fp16, k) for k in checked.fp16}
    assert checked.bf16 == {k: getattr(bf16, k) for k in checked.bf16}
    assert checked.stage == 3 and checked.zero["overlap_comm"] is True and checked.precision == "bf16"
    assert ("zero_optimization.overlap_comm", ) == tuple(k for k, _ in checked.notes if "auto" in _)


def _kind(model, name, info) -> str:
    """The mirror's kind of a pydantic field, from its annotation and the validators on it."""
    ann, args = info.annotation, typing.get_args(info.annotation)
    validators = {f for d in model.__pydantic_decorators__.field_validators.values() for f in d.info.fields}
    if name in validators:
        return {"loss_scale": "loss_scale"}.get(name, "scale_int")
    sections = {m: s for s, m in MODELS.items()}
    plain = {bool: "bool", int: "int", float: "float", ZeroStageEnum: "stage", OffloadDeviceEnum: "device",
             pathlib.Path: "path", typing.List[str]: "names", str: "strategy", typing.Union[str, int]: "auto_or_int"}
    if typing.get_origin(ann) is typing.Union and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return sections.get(inner) or plain[inner] + "?"
    return sections.get(ann) or plain[ann]


def test_each_table_is_its_pydantic_model():
    """Keys (JSON names: a field's alias), kinds, bounds, deprecations and defaults, from DeepSpeed's models."""
    for section, model in MODELS.items():
        table = ds_schema.SECTIONS[section]
        fields = {info.alias or name: (name, info) for name, info in model.model_fields.items()}
        assert set(table) == set(fields), section
        for key, (name, info) in fields.items():
            f = table[key]
            assert f.name == (name if info.alias else None), key
            assert f.kind == _kind(model, name, info), key
            bounds = {b: getattr(m, b) for m in info.metadata for b in ("ge", "gt", "le", "lt") if hasattr(m, b)}
            assert (f.ge, f.gt, f.le, f.lt) == tuple(bounds.get(b) for b in ("ge", "gt", "le", "lt")), key
            extra = info.json_schema_extra or {}
            if extra.get("deprecated"):
                new = extra.get("new_param")
                new = next((k for k, (n, _) in fields.items() if n == new), None) if extra.get(
                    "set_new_param", True) else None
                assert ds_schema.DEPRECATED[key] == new, key
            if key in ds_schema.DEFAULTS.get(section, {}):
                default = info.get_default(call_default_factory=True)
                assert ds_schema.DEFAULTS[section][key] == getattr(default, "value", default), key
        assert set(ds_schema.DEPRECATED) <= set(ds_schema.ZERO)


def test_removed_blocks_and_the_keys_deepspeed_reads():
    assert set(ds_schema.REMOVED) == set(ds_runtime_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert set(ds_schema.REMOVED_ZERO) == set(ds_runtime_config._REMOVED_ZERO_CONFIG_KEYS)
    seen = set()

    class Recording(dict):
        def get(self, key, *default):
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):                  # DeepSpeed asks `OPTIMIZER in param_dict.keys()`
            return _Keys(self, seen)

        def __copy__(self):
            return self

    class _Keys:
        def __init__(self, d, log):
            self.d, self.log = d, log

        def __contains__(self, key):
            self.log.add(key)
            return dict.__contains__(self.d, key)

        def __iter__(self):
            return iter(dict.keys(self.d))

    _deepspeed_accepts(Recording(BASE), 4)
    assert seen - set(ds_schema.REMOVED) == ds_schema.DEEPSPEED_KEYS


def test_the_batch_rule_is_deepspeeds():
    """:func:`ds_schema.deepspeed_batch` derives and refuses as DeepSpeed's own two functions do."""
    values = (None, 0, -2, 1, 2, 3, 4, 8, 16, 8.0, 2.5, "8", "auto", True, [2])
    checked = 0
    for tbs, micro, ga in itertools.product(values, repeat=3):
        for world in (1, 2, 3, 4, 8):
            ns = types.SimpleNamespace(train_batch_size=tbs, train_micro_batch_size_per_gpu=micro,
                                       gradient_accumulation_steps=ga, world_size=world)
            try:
                ds_runtime_config.DeepSpeedConfig._set_batch_related_parameters(ns)
                ds_runtime_config.DeepSpeedConfig._batch_assertion(ns)
                assert ns.train_micro_batch_size_per_gpu and ns.gradient_accumulation_steps   # _do_error_check
                want = (ns.train_batch_size, ns.train_micro_batch_size_per_gpu, ns.gradient_accumulation_steps)
            except (AssertionError, TypeError, ZeroDivisionError):
                want = None
            try:
                got = ds_schema.deepspeed_batch(tbs, micro, ga, world)
            except ValueError as err:
                assert "\n" not in str(err)
                got = None
            assert got == want, (tbs, micro, ga, world, got, want)
            checked += 1
    assert checked == 15 ** 3 * 5
    assert ds_schema.deepspeed_batch(256, None, None, 8) == (256, 32, 1)        # only train_batch_size: micro = 256 / DP
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0 .* is not > 0"):
        ds_schema.deepspeed_batch(8, 1, 0, 8)


def test_sections_the_bridge_does_not_mirror_get_deepspeeds_own_verdict():
    """Keys DeepSpeed reads but the bridge does not translate: DeepSpeed's parser is the verdict."""
    cases = [({**BASE, "tensorboard": {"enabled": "maybe"}}, False), ({**BASE, "tensorboard": {"enabled": True}}, True),
             ({**BASE, "communication_data_type": "int3"}, False), ({**BASE, "wall_clock_breakdown": "x"}, False),
             ({**BASE, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, False),
             ({**BASE, "comms_logger": {"enabled": True, "prof_all": True}}, True)]
    for config, accepted in cases:
        ds_schema.check(config, 4)                                   # the mirror has nothing to say
        assert (ds_schema.deepspeed_verdict(config, 4) is None) == accepted == _deepspeed_accepts(config, 4)[0]
