"""Multi-node launches: torchrun on every node (c10d or static rendezvous) and a Slurm ``sbatch`` script.

One renderer for every program the course prints a cluster launch for: Megatron-LM's
``pretrain_gpt.py`` (``python -m course_lib megatron-cmd --nodes N --gpus-per-node G``) and the
course trainer (``python -m course_lib train ... --nodes N --print-launch``). A program is an argv
list (``["pretrain_gpt.py", "--tensor-model-parallel-size", "2", ...]`` or ``["-m",
"course_lib.train", ...]``); this module adds how it is started on N nodes of G processes each.

torchrun (``torch.distributed.run``; every flag checked against the installed torch's
``get_args_parser`` in ``tests/megatron/test_megatron_bridge.py``) runs once per node and starts that node's
G ranks. The nodes meet in one of two ways:

* **c10d rendezvous** (what the course prints for clusters): ``--nnodes N --nproc-per-node G
  --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id JOB``. The same line on
  every node; torchrun assigns the node ranks; the host at ``$MASTER_ADDR`` runs the store.
* **static**: ``--nnodes N --nproc-per-node G --node-rank R --master-addr $MASTER_ADDR
  --master-port $MASTER_PORT``: each node passes its own R (0 on the master's host).

Global rank = node_rank x G + local_rank, so with Megatron's order (TP fastest) a TP group of
size <= G stays inside a node (NVLink) and PP/DP groups cross nodes (InfiniBand):
Narayanan et al. 2021, Section 3.3 -- keep TP within a node.

The environment that matters (:func:`environment`):

* ``CUDA_DEVICE_MAX_CONNECTIONS=1`` -- Megatron-LM's ``validate_args`` (main d98e8a6 and
  core_v0.16.1, ``megatron/training/arguments.py``) asserts it when TP > 1 or CP > 1 on GPUs
  before Blackwell (compute capability < 10), so that a TP/SP communication kernel is queued
  before the GEMM that waits for it; with Megatron-FSDP (``--use-megatron-fsdp``) it asserts the
  opposite (unset or > 1), and warns that TP/CP and FSDP want different settings.
* ``NCCL_DEBUG=INFO`` when debugging: NCCL prints, per communicator, the transport each ring or
  tree uses (``NET/IB`` between nodes, ``P2P``/NVLink inside one); ``WARN`` otherwise.
* ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME``: the network interface for NCCL's bootstrap
  (and its socket transport) and for gloo (the course trainer's CPU groups, Megatron's gloo
  groups), e.g. ``eth0`` or ``^lo,docker`` -- needed when the default route is not the cluster
  network. ``NCCL_IB_HCA`` selects the InfiniBand adapters (``ibv_devinfo`` lists them);
  ``NCCL_IB_DISABLE=1`` only on clusters without InfiniBand (sockets: slow).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from course_lib import rules

RENDEZVOUS = ("c10d", "static")
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class EnvVar:
    """One environment variable of a launch: ``value`` is exported when ``required``, else a commented hint."""

    name: str
    value: str
    why: str
    required: bool = True

    def line(self) -> str:
        export = f"export {self.name}={shlex.quote(self.value)}"
        return f"{export}    # {self.why}" if self.required else f"# {export}    # {self.why}"


def environment(*, tp: int = 1, cp: int = 1, megatron_fsdp: bool = False, debug: bool = False,
                gpus: bool = True) -> list[EnvVar]:
    """The variables a launch sets (``required``) or suggests (commented hints), in print order.

    ``gpus=False`` is the course trainer on CPU nodes (gloo only: no CUDA or NCCL lines)."""
    env = []
    if gpus and megatron_fsdp:
        env.append(EnvVar("CUDA_DEVICE_MAX_CONNECTIONS", "32",
                          "Megatron-FSDP asserts it is unset or > 1 (validate_args)", required=False))
    elif gpus and (tp > 1 or cp > 1):
        env.append(EnvVar("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                          "validate_args asserts it for TP > 1 or CP > 1 before Blackwell"))
    if gpus:
        env.append(EnvVar("NCCL_DEBUG", "INFO",
                          "INFO when debugging: the transport of every ring (NET/IB across nodes, P2P in one)",
                          required=debug))
        env.append(EnvVar("NCCL_SOCKET_IFNAME", "eth0",
                          "NCCL's bootstrap/socket interface, when the default route is not the cluster network",
                          required=False))
        env.append(EnvVar("NCCL_IB_HCA", "mlx5", "the InfiniBand adapters NCCL may use (ibv_devinfo lists them)",
                          required=False))
    env.append(EnvVar("GLOO_SOCKET_IFNAME", "eth0", "gloo's interface (CPU process groups)", required=False))
    if not gpus:
        env.append(EnvVar("OMP_NUM_THREADS", "1", "one thread per rank: ranks share the node's cores"))
    return env


def _check(nodes, procs_per_node, rendezvous, master_port) -> tuple[int, int]:
    nodes = rules.integer("nodes", nodes)
    procs = rules.integer("gpus_per_node", procs_per_node)
    if rendezvous not in RENDEZVOUS:
        raise rules.UsageError(f"rendezvous={rendezvous!r} is unknown; use one of {', '.join(RENDEZVOUS)}")
    rules.integer("master_port", master_port, 1, 65535)
    return nodes, procs


def torchrun_args(nodes: int, procs_per_node: int, *, rendezvous: str = "c10d",
                  master_addr: str = "$MASTER_ADDR", master_port: int | str = "$MASTER_PORT",
                  rdzv_id: str = "$JOB_ID", node_rank: int | str = "$NODE_RANK") -> list[str]:
    """torchrun's own options for one node of ``nodes`` x ``procs_per_node`` (values may be shell variables)."""
    args = ["--nnodes", str(nodes), "--nproc-per-node", str(procs_per_node)]
    if rendezvous == "c10d":
        return args + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master_addr}:{master_port}",
                       "--rdzv-id", str(rdzv_id)]
    return args + ["--node-rank", str(node_rank), "--master-addr", str(master_addr),
                   "--master-port", str(master_port)]


def _lines(head: str, launcher_args: list[str], program: list[str], indent: str = "    ") -> str:
    """``head``, then one ``--flag value`` per continuation line: the launcher's (a ``$VAR`` value
    double-quoted so the shell expands it), the program's leading words on a line of their own
    (``pretrain_gpt.py``, ``-m course_lib.train``), then its flags (every value shell-quoted)."""
    def groups(tokens):
        out, cur = [], []
        for tok in tokens:
            if tok.startswith("--") and cur:
                out.append(cur)
                cur = []
            cur.append(tok)
        return out + ([cur] if cur else [])

    def launcher_word(tok):
        return f'"{tok}"' if tok.startswith("$") else shlex.quote(tok)

    lines = [head] + [indent + " ".join(map(launcher_word, g)) for g in groups(launcher_args)]
    lines += [indent + " ".join(map(shlex.quote, g)) for g in groups(program)]
    return " \\\n".join(lines)


def torchrun_command(program: list[str], nodes: int, procs_per_node: int, *, rendezvous: str = "c10d",
                     master_port: int = DEFAULT_MASTER_PORT, launcher: str = "torchrun") -> str:
    """The command to run on every node (c10d) or on node ``$NODE_RANK`` (static), after
    ``MASTER_ADDR``/``MASTER_PORT`` (and ``JOB_ID`` or ``NODE_RANK``) are set."""
    nodes, procs = _check(nodes, procs_per_node, rendezvous, master_port)
    return _lines(launcher, torchrun_args(nodes, procs, rendezvous=rendezvous), list(program))


def sbatch_script(program: list[str], nodes: int, procs_per_node: int, *, env: list[EnvVar] = (),
                  job_name: str = "megatron", time_limit: str = "01:00:00", gpus: bool = True,
                  master_port: int = DEFAULT_MASTER_PORT, workdir: str | None = None) -> str:
    """A Slurm batch script: one task per node (``srun --ntasks-per-node=1``) running torchrun with
    c10d rendezvous at the first node of the allocation (``scontrol show hostnames``)."""
    nodes, procs = _check(nodes, procs_per_node, "c10d", master_port)
    if not job_name or any(c.isspace() for c in job_name):
        raise rules.UsageError(f"job_name={job_name!r} must be one word, e.g. 'megatron'")
    head = ["#!/bin/bash",
            f"#SBATCH --job-name={job_name}",
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts the node's ranks"]
    head.append(f"#SBATCH --gpus-per-node={procs}" if gpus else f"#SBATCH --cpus-per-task={procs}")
    head += ["#SBATCH --exclusive",
             f"#SBATCH --time={time_limit}",
             "#SBATCH --output=%x-%j.out",
             "set -euo pipefail"]
    if workdir:
        head.append(f"cd {shlex.quote(workdir)}")
    head += ['export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"export MASTER_PORT={master_port}"]
    head += [v.line() for v in env]
    launch = torchrun_args("$SLURM_NNODES", procs, master_addr="$MASTER_ADDR", master_port="$MASTER_PORT",
                           rdzv_id="$SLURM_JOB_ID")
    body = _lines("srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun", launch, list(program))
    return "\n".join(head) + "\n" + body + "\n"


def launch_text(program: list[str], nodes: int, procs_per_node: int, *, env: list[EnvVar] = (),
                job_name: str = "megatron", gpus: bool = True, master_port: int = DEFAULT_MASTER_PORT,
                workdir: str | None = None) -> str:
    """Everything ``--nodes`` prints: the world, the environment, the per-node torchrun lines
    (c10d, then static) and the sbatch script."""
    nodes, procs = _check(nodes, procs_per_node, "c10d", master_port)
    unit = "GPUs" if gpus else "processes"
    env_lines = [v.line() for v in env]
    return "\n".join([
        f"# {nodes} nodes x {procs} {unit} = world {nodes * procs}; global rank = node_rank x {procs} + local_rank",
        "",
        "# ---- on every node: c10d rendezvous (MASTER_ADDR = a host every node reaches; JOB_ID any shared word)",
        f"export MASTER_ADDR=node0.example MASTER_PORT={master_port} JOB_ID=job42",
        *env_lines,
        torchrun_command(program, nodes, procs, rendezvous="c10d", master_port=master_port),
        "",
        "# ---- or static rendezvous: the same, with NODE_RANK=0 on MASTER_ADDR's host, 1 .. N-1 on the others",
        torchrun_command(program, nodes, procs, rendezvous="static", master_port=master_port),
        "",
        f"# ---- Slurm: save as {job_name}.sbatch, submit with `sbatch {job_name}.sbatch`",
        sbatch_script(program, nodes, procs, env=env, job_name=job_name, gpus=gpus, master_port=master_port,
                      workdir=workdir).rstrip("\n"),
    ])


# ---- N "nodes" on this machine: the same torchrun lines, each node a torchrun of its own ------------


@dataclass
class NodeRun:
    """One local "node": its torchrun command line, exit code and combined stdout/stderr."""

    command: str
    exit_code: int | None
    output: str


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes_here(program: list[str], nodes: int = 2, procs_per_node: int = 2, *, rendezvous: str = "static",
                   timeout: float = 120, env: dict[str, str] | None = None) -> list[NodeRun]:
    """Run ``program`` as ``nodes`` torchrun "nodes" on this machine, all at once, meeting at
    127.0.0.1 (the lines :func:`torchrun_command` prints, with the variables filled in) and
    return each node's :class:`NodeRun` in node order (static: node rank; c10d: start order).

    ``program`` is what follows torchrun's options, e.g. ``["-m", "course_lib.train", ...]``.
    Every node runs under :class:`course_lib.launch.TorchrunAgent`, so no node, rank or file
    outlives this call: a node still running after ``timeout`` s is stopped (with its ranks) and
    the others too, then ``TimeoutError`` is raised.
    """
    import os
    import subprocess
    import sys
    import tempfile
    import time

    from course_lib.launch import TorchrunAgent
    from course_lib.launch.contract import LOOPBACK_ADDR, loopback_interface
    from course_lib.launch.output import read_back

    nodes, procs = _check(nodes, procs_per_node, rendezvous, DEFAULT_MASTER_PORT)
    timeout = rules.number("timeout", timeout, 0.0)
    port = free_port()
    base = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    # Every node is on this machine: the agents tell each other 127.0.0.1 (torchrun's --local-addr) and gloo binds
    # to loopback, so the run does not depend on this machine's hostname resolving.
    base.setdefault("PET_LOCAL_ADDR", LOOPBACK_ADDR)
    if loopback_interface():
        base.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    runs, agents, logs = [], [], []
    try:
        for r in range(nodes):
            opts = torchrun_args(nodes, procs, rendezvous=rendezvous, master_addr="127.0.0.1", master_port=port,
                                 rdzv_id=f"local{port}", node_rank=r)
            cmd = [sys.executable, "-m", "torch.distributed.run", *opts, *program]
            log = tempfile.TemporaryFile(prefix="course_node_")
            logs.append(log)
            agent = TorchrunAgent(cmd, stdout=log, stderr=subprocess.STDOUT, env=base)
            agents.append(agent)
            agent.start()
            runs.append(" ".join(["torchrun", *map(shlex.quote, cmd[3:])]))
        deadline = time.monotonic() + timeout
        while not all(a.poll(0.1) for a in agents):
            if time.monotonic() > deadline:
                stopped = "; ".join(a.stop() for a in agents)
                raise TimeoutError(f"{nodes} local nodes did not finish within timeout={timeout:g}s; {stopped}")
        return [NodeRun(c, a.exit_code, read_back(log)) for c, a, log in zip(runs, agents, logs)]
    finally:
        for a in agents:
            if a.exit_code is None:
                a.stop()
            a.release()
        for log in logs:
            log.close()
