"""GPU profiles: the datasheet figures the performance model and the scheduler reason with.

A worker may report its own peak TFLOPs and HBM bandwidth, or just a GPU name that is resolved
here. Figures are the vendors' published peaks for the dense case (NVIDIA's datasheets print
tensor throughput "with sparsity" and mark it; the dense figure is half of that), per GPU:

* ``peak_tflops_bf16``, ``peak_tflops_fp8``: dense tensor-core TFLOP/s; ``0.0`` for FP8 means
  the GPU has no FP8 tensor cores (Ampere), so FP8 models run their matmuls at the BF16 rate.
* ``hbm_gib``: device memory as the datasheet states it in GB; HBM and GDDR are built in binary
  sizes, and what the driver reports is within a few percent of the figure read as GiB.
* ``hbm_gbps``: memory bandwidth in GB/s (10^9 bytes per second).
* ``nvlink_gbps``: GPU-to-GPU fabric bandwidth in GB/s, total over both directions as vendors
  quote it (NVLink, or Infinity Fabric for AMD); ``0.0`` for PCIe-only cards. One direction
  carries half of it; see :meth:`GpuProfile.p2p_gbit_per_s`.
* ``price_per_hour_usd``: an ASSUMPTION, not a quote: a rounded, typical public-cloud
  on-demand price for one GPU (an 8-GPU instance's hourly price divided by 8 where the cloud
  sells only those), in the 2025 price range. Cost-per-goodput figures scale with it; replace
  it with your own contract prices.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["GPU_ALIASES", "GPU_PROFILES", "GpuProfile", "UnknownGpuError", "gpu_profile"]


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One GPU model's peak figures and assumed price (units in the module docstring)."""

    name: str
    peak_tflops_bf16: float
    peak_tflops_fp8: float
    hbm_gib: float
    hbm_gbps: float
    nvlink_gbps: float
    price_per_hour_usd: float

    def peak_tflops(self, dtype_bytes: float) -> float:
        """Dense matmul peak for operands of ``dtype_bytes`` bytes.

        FP8 (1 byte) uses the FP8 tensor cores where they exist and the BF16 rate otherwise;
        wider operands use the BF16 rate (FP32 inference is not modelled separately).
        """
        if dtype_bytes <= 1 and self.peak_tflops_fp8 > 0:
            return self.peak_tflops_fp8
        return self.peak_tflops_bf16

    def p2p_gbit_per_s(self) -> float:
        """One direction of the GPU-to-GPU fabric in Gb/s: nvlink_gbps / 2 x 8.

        KV moves one way during a hand-off, and link bandwidths elsewhere in hetero-pd are in
        Gb/s (transfer_ms = bytes x 8 / Gb/s), so this is the figure to put on an intra-node
        link. H100 SXM: 900 GB/s / 2 x 8 = 3,600 Gb/s.
        """
        return self.nvlink_gbps / 2 * 8


def _profiles(*rows: GpuProfile) -> Mapping[str, GpuProfile]:
    return MappingProxyType({row.name: row for row in rows})


# fmt: off
GPU_PROFILES: Mapping[str, GpuProfile] = _profiles(
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 1,979 / FP8 3,958 TFLOPS with
    # sparsity -> 989.5 / 1,979 dense; 80 GB HBM3, 3.35 TB/s; NVLink 900 GB/s.
    # Price assumption: ~$55/h for an 8 x H100 on-demand instance -> $6.90.
    GpuProfile("H100-SXM", 989.5, 1979.0, 80.0, 3350.0, 900.0, 6.90),
    # NVIDIA H100 datasheet, PCIe column: BF16 1,513 / FP8 3,026 with sparsity -> 756.5 /
    # 1,513 dense; 80 GB HBM2e, 2.0 TB/s; NVLink bridge 600 GB/s. Price assumption: $4.50.
    GpuProfile("H100-PCIE", 756.5, 1513.0, 80.0, 2000.0, 600.0, 4.50),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 1,979 / FP8 3,958 with sparsity
    # -> 989.5 / 1,979 dense; 141 GB HBM3e, 4.8 TB/s; NVLink 900 GB/s.
    # Price assumption: $9.00 (about 1.3 x H100).
    GpuProfile("H200", 989.5, 1979.0, 141.0, 4800.0, 900.0, 9.00),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: BF16 312 dense (624 sparse), no
    # FP8; 80 GB HBM2e, 2,039 GB/s; NVLink 600 GB/s. Price assumption: $3.40.
    GpuProfile("A100-80G", 312.0, 0.0, 80.0, 2039.0, 600.0, 3.40),
    # NVIDIA A100 Tensor Core GPU datasheet, 40GB SXM column: BF16 312 dense, no FP8; 40 GB
    # HBM2, 1,555 GB/s; NVLink 600 GB/s. Price assumption: $2.75.
    GpuProfile("A100-40G", 312.0, 0.0, 40.0, 1555.0, 600.0, 2.75),
    # NVIDIA L40S datasheet: BF16 362.05 dense (733 sparse), FP8 733 dense (1,466 sparse);
    # 48 GB GDDR6, 864 GB/s; no NVLink. Price assumption: $1.86 (one-GPU instance).
    GpuProfile("L40S", 362.05, 733.0, 48.0, 864.0, 0.0, 1.86),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 242 / FP8 485 TFLOPS with sparsity -> 121 /
    # 242.5 dense; 24 GB GDDR6, 300 GB/s; no NVLink. Price assumption: $0.80.
    GpuProfile("L4", 121.0, 242.5, 24.0, 300.0, 0.0, 0.80),
    # A10G is AWS's variant of the A10 and has no NVIDIA datasheet of its own; the figures
    # published for it (e.g. AWS G5 material and third-party spec tables): BF16 ~70 TFLOPS
    # dense (the A10 datasheet's 125 is the A10), no FP8; 24 GB GDDR6, 600 GB/s; no NVLink.
    # Price assumption: $1.01 (one-GPU instance).
    GpuProfile("A10G", 70.0, 0.0, 24.0, 600.0, 0.0, 1.01),
    # NVIDIA A10 Tensor Core GPU datasheet: BF16 125 dense (250 sparse), no FP8; 24 GB GDDR6,
    # 600 GB/s; no NVLink. Price assumption: $1.00.
    GpuProfile("A10", 125.0, 0.0, 24.0, 600.0, 0.0, 1.00),
    # NVIDIA H20 product brief (China-market Hopper): BF16 148 / FP8 296 dense; 96 GB HBM3,
    # 4.0 TB/s; NVLink 900 GB/s. Price assumption: $1.80 (not sold by US hyperscalers; a
    # rough figure from its relative position, label it as such).
    GpuProfile("H20", 148.0, 296.0, 96.0, 4000.0, 900.0, 1.80),
    # AMD Instinct MI300X accelerator data sheet: BF16 1,307.4 dense (2,614.9 sparse), FP8
    # 2,614.9 dense; 192 GB HBM3, 5.3 TB/s; Infinity Fabric 896 GB/s (7 links x 128 GB/s).
    # Price assumption: $6.00.
    GpuProfile("MI300X", 1307.4, 2614.9, 192.0, 5300.0, 896.0, 6.00),
)
# fmt: on

GPU_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "H100": "H100-SXM",
        "H100-SXM5": "H100-SXM",
        "H100-80G": "H100-SXM",
        "H100-80GB": "H100-SXM",
        "H100-80GB-HBM3": "H100-SXM",
        "H100-PCIE-80GB": "H100-PCIE",
        "H200-SXM": "H200",
        "H200-141G": "H200",
        "A100": "A100-80G",
        "A100-80GB": "A100-80G",
        "A100-SXM4-80GB": "A100-80G",
        "A100-SXM-80GB": "A100-80G",
        "A100-40GB": "A100-40G",
        "A100-SXM4-40GB": "A100-40G",
        "MI300": "MI300X",
    }
)
"""Other spellings (including what ``nvidia-smi``/``rocm-smi`` print, after normalisation)."""

_VENDOR_PREFIX = re.compile(r"^(NVIDIA|AMD-INSTINCT|AMD|INSTINCT)-")
_SEPARATORS = re.compile(r"[\s_]+")


def _normalise(name: str) -> str:
    """Upper case, spaces and underscores to dashes, vendor prefix dropped."""
    key = _SEPARATORS.sub("-", name.strip().upper())
    return _VENDOR_PREFIX.sub("", key)


class UnknownGpuError(KeyError):
    """A GPU name neither in :data:`GPU_PROFILES` nor in :data:`GPU_ALIASES`."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown GPU {self.name!r}; known: {', '.join(self.known)}"


@functools.lru_cache(maxsize=256)
def gpu_profile(name: str) -> GpuProfile:
    """Resolve a GPU name to its profile, accepting aliases and case/separator variants.

    ``"h100"``, ``"H100_SXM"`` and ``"NVIDIA H100 80GB HBM3"`` all give ``H100-SXM``.
    Resolved names are remembered (a bounded cache: the planner resolves every worker's
    GPU per decision; an unknown name raises and is not remembered).
    """
    key = _normalise(name)
    key = GPU_ALIASES.get(key, key)
    profile = GPU_PROFILES.get(key)
    if profile is None:
        raise UnknownGpuError(name, tuple(sorted(GPU_PROFILES)))
    return profile
