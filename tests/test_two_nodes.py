"""The course trainer on two torchrun "nodes" of this machine: the multi-node launch is real.

Each node is a torchrun of its own, started as ``megatron-cmd --nodes`` prints it
(:func:`course_lib.launch.cluster.run_nodes_here`), once with static rendezvous (``--node-rank 0/1
--master-addr --master-port``, ``--nnodes 2 --nproc-per-node 2``: world 4) and once with c10d
(``--rdzv-backend c10d --rdzv-endpoint --rdzv-id``, ``--nproc-per-node 1``: world 2, each rank a node
of its own -- what c10d adds is the rendezvous, and two ranks fewer are two fresh interpreters less).
The static layout is TP2 x DP2, so TP stays inside a node and the DP all-reduce crosses the nodes
(Megatron's advice, Narayanan et al. 2021 Sec. 3.3); c10d's is DP2, its all-reduce across the nodes.
The loss of every logged iteration equals the single-process model's within 1e-4 relative
(tests/test_train.py's settings and tolerance), and the log shows the ranks really were split:
rank 0's memory lines come from one node, the last rank's iteration lines from the other.
Two launches (each two torchruns started together), run at once: ~30 s on 2 busy cores.
"""

import pytest
from test_train import BASE, TOL, _megatron_logged

from course_lib.training.logs import parse_log
from course_lib.launch.cluster import run_nodes_here
from course_lib.train import parse_args, train_single_process

LAYOUT = ["--tensor-model-parallel-size", "2"]
SHAPES = {"static": (2, LAYOUT), "c10d": (1, [])}      # rendezvous: (processes per node, layout flags)


@pytest.fixture(scope="module")
def expected():
    return _megatron_logged(train_single_process(parse_args(BASE))["lm_loss"], 2)


@pytest.fixture(scope="module")
def runs():
    """Both launches at once (a thread each): most of a launch is waiting (start-up, rendezvous)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = {r: pool.submit(run_nodes_here, ["-m", "course_lib.train", *BASE, *layout], nodes=2,
                                  procs_per_node=procs, rendezvous=r, timeout=240)
                   for r, (procs, layout) in SHAPES.items()}
        return {r: f.result() for r, f in futures.items()}


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_torchrun_nodes_train_the_single_process_model(rendezvous, runs, expected):
    nodes = runs[rendezvous]
    procs, layout = SHAPES[rendezvous]
    tp = 2 if layout else 1
    assert [n.exit_code for n in nodes] == [0, 0], "\n\n".join(n.output[-3000:] for n in nodes)
    for n in nodes:
        assert f"--nnodes 2 --nproc-per-node {procs}" in n.command
        assert ("--node-rank" in n.command) == (rendezvous == "static")
        assert ("--rdzv-backend c10d" in n.command) == (rendezvous == "c10d")
    log = parse_log("\n".join(n.output for n in nodes))
    assert {k: log.config[k] for k in ("world_size", "tp", "pp", "cp", "dp")} == dict(world_size=2 * procs, tp=tp,
                                                                                   pp=1, cp=1, dp=2)
    assert [it["iteration"] for it in log.iterations] == sorted(expected) == [1, 2, 4]
    for it in log.iterations:
        assert abs(it["lm_loss"] - expected[it["iteration"]]) / expected[it["iteration"]] < TOL, (it, expected)
    # the ranks of DP rank 0 (static: ranks 0-1, TP group 0) on one node print the memory lines; the last rank,
    # on the other, the iterations
    first = [n for n in nodes if "[Rank 0]" in n.output]
    last = [n for n in nodes if " iteration        4/" in n.output]
    assert len(first) == len(last) == 1 and first[0] is not last[0]
    if tp == 2:
        assert "[Rank 1]" in first[0].output and "[Rank 1]" not in last[0].output    # TP group [0, 1] in one node
    if rendezvous == "static":
        assert first[0] is nodes[0]                 # --node-rank 0 holds global ranks 0 and 1


def test_train_print_launch_is_the_launch_run_here(capsys):
    """``python -m course_lib train ... --nodes 2 --print-launch`` prints the torchrun lines this file runs."""
    import argparse
    import re
    import shlex

    from torch.distributed.run import get_args_parser

    from course_lib.train import add_arguments, run

    parser = add_arguments(argparse.ArgumentParser())
    assert run(parser.parse_args(BASE + LAYOUT + ["--nodes", "2", "--nproc-per-node", "2", "--print-launch"])) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 2 nodes x 2 processes = world 4")
    assert "export OMP_NUM_THREADS=1" in out and "#SBATCH --nodes=2" in out and "srun --ntasks-per-node=1" in out
    blocks = [b[b.index("torchrun"):] for b in out.split("\n\n") if "\ntorchrun \\" in b]
    env = {"MASTER_ADDR": "n0", "MASTER_PORT": "1234", "JOB_ID": "j", "NODE_RANK": "1"}
    parsed = [get_args_parser().parse_args(shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)],
                                                                b.replace("\\\n", " ")))[1:]) for b in blocks]
    c10d, static = parsed
    assert (c10d.nnodes, c10d.nproc_per_node, c10d.rdzv_backend, c10d.rdzv_endpoint) == ("2", "2", "c10d", "n0:1234")
    assert (static.nnodes, static.node_rank, static.master_addr, static.master_port) == ("2", 1, "n0", 1234)
    for a in parsed:
        assert a.module and a.training_script == "course_lib.train"
        assert parse_args(a.training_script_args) == parse_args(BASE + LAYOUT)
    with pytest.raises(ValueError, match="nodes=2 runs on other machines: add --print-launch"):
        run(parser.parse_args(BASE + LAYOUT + ["--nodes", "2", "--nproc-per-node", "2"]))
    with pytest.raises(ValueError, match="world_size=4 is not divisible by tensor-model-parallel-size=8"):
        run(parser.parse_args(BASE + ["--tensor-model-parallel-size", "8", "--nodes", "2", "--nproc-per-node", "2",
                                      "--print-launch"]))
