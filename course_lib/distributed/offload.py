"""``--optimizer-cpu-offload``: the optimizer's tensors live in a host pool that counts its bytes.

Megatron-LM's ``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py`` (``HybridDeviceOptimizer``)
and ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training",
arXiv:2101.06840, §4.1): fp32 main params and Adam's moments stay on the host and the update runs
there; each step the grad shard goes device -> host and the updated param shard host -> device.

On a GPU run the pool is pinned host memory (``pin_memory=True``: page-locked, so the DMA engine
copies it at full PCIe/NVLink-C2C speed). On a CPU run "host" and "device" are the same memory,
so the pool is a separate, tracked allocation: the tensors are still distinct, every byte still
moves through :meth:`to_host` / :meth:`to_device`, and :attr:`allocated` / :attr:`moved` count them.
"""

from __future__ import annotations

import torch


class HostPool:
    """Allocates the offloaded optimizer tensors on the host and counts bytes held and moved.

    ``allocated``: bytes of every tensor :meth:`empty` returned (they live as long as the optimizer);
    ``moved``: ``{"d2h": bytes, "h2d": bytes}`` since the last :meth:`reset_moved`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.allocated = 0
        self.moved = {"d2h": 0, "h2d": 0}

    def empty(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)
        self.allocated += t.numel() * t.element_size()
        return t

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host, from :meth:`empty`) <- ``src`` (device), counted as device -> host.
        Blocking: the host update reads ``dst`` right after (overlapping these copies is left out)."""
        dst.copy_(src)
        self.moved["d2h"] += src.numel() * src.element_size()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (device) <- ``src`` (host), cast to ``dst``'s dtype, counted in ``dst``'s bytes."""
        dst.copy_(src)
        self.moved["h2d"] += dst.numel() * dst.element_size()

    def reset_moved(self) -> None:
        self.moved = {"d2h": 0, "h2d": 0}
