"""GPU cluster profiles for :mod:`course_lib.sizing.projection`: what one GPU and its links can do.

Every number is a vendor peak (or a cluster's published network) with its source beside it, except
the NVLink bandwidth NCCL reaches, which its maintainers measured. Conventions:

* FLOP/s are **dense** bf16 Tensor Core peaks (datasheets also print a 2x "with sparsity"
  figure: that is not what training runs at).
* Link bandwidths are **bytes per second one GPU can send** (one direction). NVIDIA prints
  NVLink as the bidirectional total per GPU (A100: "600 GB/s" = 300 + 300; H100/H200:
  "900 GB/s" = 450 + 450), so the profile holds half the printed number. The inter-node
  figure is the GPU's own network adapter: DGX/HGX nodes have one HCA per GPU
  ("rail-optimised"), so a GPU sends at one HCA's line rate (200 Gb/s HDR = 25 GB/s,
  400 Gb/s NDR = 50 GB/s), and a group with ``k`` GPUs on each node sends on ``k`` of them.
* ``nvlink_bus_bandwidth`` is what NCCL's ring reaches on that NVLink (nccl-tests' "busbw"), the
  bandwidth :mod:`.projection` prices NVLink collectives at. The NCCL maintainers give it: A100,
  "each NVLink has a line rate of 25GB/s (in each direction) which converts to ~20GB/s effective
  bandwidth with a 128B payload size ... other bottlenecks on the GPUs limits it to ~230GB/s"
  (github.com/NVIDIA/nccl-tests/issues/149, 2023-07-05): 230 of 300 GB/s; H100, "450GB/s is the
  line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
  370GB/s" (github.com/NVIDIA/nccl-tests/issues/212, 2024-05-06; NVLink SHARP all-reduces, which
  the ring model does not describe, are left out): 370 of 450 GB/s, H200 the same NVLink 4. The
  network is priced at its line rate: an assumption (efficiency 1.0), printed as such.
* ``collective_latency_s`` is the fixed start-up cost of one collective or one send
  (the alpha of the alpha-beta model). No datasheet prints it; the values are the order of
  magnitude NCCL's own benchmarks (nccl-tests ``all_reduce_perf``) show for small messages
  inside a node and across an InfiniBand fabric. Treat them as assumptions.

Sources (vendor datasheets, read through the copies the course's ``search`` tool found):

* A100: NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4):
  BF16 Tensor Core 312 TFLOPS dense (624 with sparsity); A100 80GB SXM HBM2e 2,039 GB/s;
  NVLink 600 GB/s. Node network: Narayanan et al. 2021 §5 (Selene DGX A100 nodes: eight
  80-GB A100s on NVLink/NVSwitch and eight Mellanox 200 Gb/s HDR InfiniBand HCAs per node).
* H100 SXM: NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS *with
  sparsity*, so 989.4 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s. Node network: DGX H100
  / HGX H100 systems, eight ConnectX-7 400 Gb/s NDR InfiniBand adapters (MLCommons system
  descriptions list "8x 400Gb Infiniband" for 8 x H100 SXM nodes).
* H200 SXM: NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e at 4.8 TB/s; the same GH100
  compute as H100 SXM (BF16 1,979 TFLOPS with sparsity, 989.4 dense); NVLink 900 GB/s.
  Node network: HGX H200, one 400 Gb/s NDR adapter per GPU, as HGX H100.
"""

from __future__ import annotations

from dataclasses import dataclass
from course_lib.rules import UsageError

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the node it sits in (every bandwidth: bytes/s one GPU sends)."""

    name: str
    peak_flops: float           # dense bf16 Tensor Core FLOP/s per GPU
    hbm_bytes: float            # HBM capacity per GPU (decimal bytes, as datasheets print)
    hbm_bandwidth: float        # HBM bytes/s per GPU
    nvlink_bandwidth: float     # NVLink bytes/s one GPU sends (half the datasheet's bidirectional)
    nvlink_bus_bandwidth: float  # what NCCL's ring reaches on it (nccl-tests busbw; the maintainers' figure)
    internode_bandwidth: float  # network bytes/s one GPU sends to another node (its own HCA)
    gpus_per_node: int
    intra_latency_s: float      # start-up cost of one collective/send inside a node (NVLink)
    inter_latency_s: float      # same, across nodes (InfiniBand)
    sources: str = ""

    @property
    def hbm_gb(self) -> float:
        return self.hbm_bytes / GB

    def summary(self) -> str:
        return (f"{self.name}: {self.peak_flops / TERA:.1f} TFLOP/s bf16 dense, {self.hbm_gb:.0f} GB HBM at "
                f"{self.hbm_bandwidth / 1e12:.3g} TB/s, NVLink {self.nvlink_bandwidth / GB:.0f} GB/s per GPU "
                f"per direction (priced at NCCL's measured {self.nvlink_bus_bandwidth / GB:.0f}), network "
                f"{self.internode_bandwidth / GB:.0f} GB/s per GPU (one NIC each; priced at line rate, an "
                f"assumption), {self.gpus_per_node} GPUs per node")


_A100_SRC = ("NVIDIA A100 datasheet (BF16 312 TFLOPS dense; 80GB SXM HBM2e 2,039 GB/s; NVLink 600 GB/s "
             "bidirectional); Narayanan et al. 2021 §5 (Selene: 8 x 200 Gb/s HDR InfiniBand HCAs per node); NCCL "
             "ring busbw on NVLink ~230 GB/s (NVIDIA/nccl-tests#149, NCCL maintainer)")
_H100_SRC = ("NVIDIA H100 datasheet, SXM (BF16 1,979 TFLOPS with sparsity = 989.4 dense; 80 GB HBM3 3.35 TB/s; "
             "NVLink 900 GB/s bidirectional); DGX/HGX H100: 8 x 400 Gb/s NDR ConnectX-7 per node; NCCL effective "
             "NVLink bandwidth 370 GB/s (NVIDIA/nccl-tests#212, NCCL maintainer)")
_H200_SRC = ("NVIDIA H200 datasheet, SXM (141 GB HBM3e 4.8 TB/s; BF16 as H100 SXM, 989.4 TFLOPS dense; "
             "NVLink 900 GB/s bidirectional); HGX H200: 8 x 400 Gb/s NDR per node; NVLink 4 as H100: NCCL 370 GB/s "
             "(NVIDIA/nccl-tests#212)")

HARDWARE: dict[str, Hardware] = {
    "A100": Hardware("A100-80GB SXM (DGX A100, HDR)", peak_flops=312 * TERA, hbm_bytes=80 * GB,
                     hbm_bandwidth=2.039e12, nvlink_bandwidth=300 * GB, nvlink_bus_bandwidth=230 * GB,
                     internode_bandwidth=200e9 / 8, gpus_per_node=8, intra_latency_s=10e-6, inter_latency_s=20e-6,
                     sources=_A100_SRC),
    "H100": Hardware("H100 SXM (DGX H100, NDR)", peak_flops=989.4 * TERA, hbm_bytes=80 * GB,
                     hbm_bandwidth=3.35e12, nvlink_bandwidth=450 * GB, nvlink_bus_bandwidth=370 * GB,
                     internode_bandwidth=400e9 / 8, gpus_per_node=8, intra_latency_s=10e-6, inter_latency_s=20e-6,
                     sources=_H100_SRC),
    "H200": Hardware("H200 SXM (HGX H200, NDR)", peak_flops=989.4 * TERA, hbm_bytes=141 * GB,
                     hbm_bandwidth=4.8e12, nvlink_bandwidth=450 * GB, nvlink_bus_bandwidth=370 * GB,
                     internode_bandwidth=400e9 / 8, gpus_per_node=8, intra_latency_s=10e-6, inter_latency_s=20e-6,
                     sources=_H200_SRC),
}
ALIASES = {"A100-80GB": "A100", "A100-80GB-SXM": "A100", "H100-SXM": "H100", "H200-SXM": "H200"}


def get_hardware(name) -> Hardware:
    """The profile called ``name`` (case-insensitive; a :class:`Hardware` passes through)."""
    if isinstance(name, Hardware):
        return name
    if isinstance(name, str):
        key = name.strip().upper()
        key = ALIASES.get(key, key)
        if key in HARDWARE:
            return HARDWARE[key]
    raise UsageError(f"hardware={name!r} is unknown: use one of {', '.join(HARDWARE)}")
