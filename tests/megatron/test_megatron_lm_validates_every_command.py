"""Every command ``megatron-cmd`` prints passes Megatron-LM's own ``parse_args`` + ``validate_args``
(``megatron/training/arguments.py`` of a checkout, run by ``megatron_lm_validate.py`` in a subprocess), over
every ``--show`` variant the course prints: the seed sweep and the layouts of the bridge tests x three runs,
every sharding variant, MoE, multi-node and checkpoint flags. A command with a main-only flag is judged
against main only ("main only" at core_v0.16.1). Needs MEGATRON_LM_DIR (a checkout); skipped without it.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.megatron import MegatronRun, gpu_config, megatron_command
from course_lib.topology.seed import SEED_SWEEP
from course_lib.megatron.command import MoESpec, cluster_launch, sharding_variants
from course_lib.megatron.flags import MAIN_ONLY_FLAGS

RUNNER = Path(__file__).with_name("megatron_lm_validate.py")


def _commands() -> list[str]:
    runs = [MegatronRun(), MegatronRun(precision="fp16", use_distributed_optimizer=True, transformer_impl="local"),
            MegatronRun(precision="fp32", log_throughput=False)]
    cfgs = [gpu_config(*SEED_SWEEP[n]) for n in SEED_SWEEP]
    cfgs += [gpu_config(2, 2, 2, sequence_parallel=True), gpu_config(1, 4, vpp=2), gpu_config(2, 2, vpp=2),
             gpu_config(2, 1, num_query_groups=4), gpu_config(1, 2, vpp=2, decoder_first_pipeline_num_layers=2),
             gpu_config(1, 4, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1)]
    out = [megatron_command(c, r) for c in cfgs for r in runs]
    d = gpu_config(*SEED_SWEEP["D"])
    for run in (MegatronRun(), MegatronRun(sharding="fsdp", megatron_fsdp_main_grads_dtype="fp32")):
        out += [block[block.index("CUDA") if "CUDA" in block.split("torchrun")[0] else block.index("torchrun"):]
                for block in sharding_variants(d, run).split("\n\n") if "torchrun" in block]
    out += [megatron_command(d, moe=MoESpec(8, expert_model_parallel_size=2)),
            megatron_command(d, moe=MoESpec(8, 4, expert_tensor_parallel_size=1, moe_router_topk=1))]
    out += [megatron_command(d, MegatronRun(save="ckpt", save_interval=50, load="ckpt", exit_interval=200,
                                            ckpt_format="torch", no_load_optim=True, no_load_rng=True,
                                            finetune=True)),
            megatron_command(d, MegatronRun(save="ckpt", save_interval=50))]
    for nodes, gpus, run in ((2, 4, MegatronRun()), (4, 2, MegatronRun(sharding="fsdp"))):
        text = cluster_launch(d, run, nodes=nodes, gpus_per_node=gpus)
        env = " ".join(f"{k}={v}" for k, v in re.findall(r"^export (CUDA_DEVICE_MAX_CONNECTIONS)=(\S+)", text, re.M))
        block = text[text.index("torchrun"):].split("\n\n")[0]
        out.append(f"{env} {block}".strip())
    return out


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM checkout")
def test_megatron_lm_validates_every_command_megatron_cmd_prints():
    commands = _commands()
    request = json.dumps({"commands": commands, "main_only": sorted(MAIN_ONLY_FLAGS)})
    out = subprocess.run([sys.executable, str(RUNNER), os.environ["MEGATRON_LM_DIR"]], input=request,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    verdicts = json.loads(out.stdout.strip().splitlines()[-1])
    refused = {c.split("pretrain_gpt.py")[-1][:200]: v for c, v in verdicts.items() if v.startswith("error")}
    assert not refused, refused
    assert len(verdicts) == len(set(commands)) and sum(v == "ok" for v in verdicts.values()) >= len(verdicts) - 4
