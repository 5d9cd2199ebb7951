"""GPU profiles: the table, its datasheet figures, and name resolution."""

from __future__ import annotations

import re

import pytest

from hpd_common.gpus import GPU_ALIASES, GPU_PROFILES, GpuProfile, UnknownGpuError, gpu_profile

REQUIRED = ["H100-SXM", "H200", "A100-80G", "A100-40G", "L40S", "L4", "A10G", "H20", "MI300X"]


@pytest.mark.parametrize("name", REQUIRED)
def test_required_profiles_exist_under_their_own_name(name: str) -> None:
    assert GPU_PROFILES[name].name == name
    assert gpu_profile(name) is GPU_PROFILES[name]


@pytest.mark.parametrize("profile", list(GPU_PROFILES.values()), ids=list(GPU_PROFILES))
def test_profile_figures_are_sane(profile: GpuProfile) -> None:
    assert re.fullmatch(r"[A-Z0-9]+(-[A-Z0-9]+)*", profile.name)
    assert profile.peak_tflops_bf16 > 0
    assert profile.hbm_gib > 0
    assert profile.hbm_gbps > 0
    assert profile.nvlink_gbps >= 0
    assert profile.price_per_hour_usd > 0
    # FP8 tensor cores, where present, run at about twice the BF16 rate (dense vs dense)
    if profile.peak_tflops_fp8 > 0:
        assert profile.peak_tflops_fp8 == pytest.approx(2 * profile.peak_tflops_bf16, rel=0.03)
    else:
        assert profile.peak_tflops_fp8 == 0.0


@pytest.mark.parametrize(
    ("name", "bf16", "fp8", "gib", "gbps"),
    [
        # dense = half of the "with sparsity" figure the datasheets print
        pytest.param("H100-SXM", 1979 / 2, 3958 / 2, 80, 3350, id="h100-sxm"),
        pytest.param("H200", 1979 / 2, 3958 / 2, 141, 4800, id="h200"),
        pytest.param("A100-80G", 624 / 2, 0, 80, 2039, id="a100-80g"),
        pytest.param("A100-40G", 624 / 2, 0, 40, 1555, id="a100-40g"),
        pytest.param("L4", 242 / 2, 485 / 2, 24, 300, id="l4"),
        # AMD prints the dense figures directly
        pytest.param("MI300X", 1307.4, 2614.9, 192, 5300, id="mi300x"),
    ],
)
def test_datasheet_spot_checks(name: str, bf16: float, fp8: float, gib: float, gbps: float) -> None:
    p = GPU_PROFILES[name]
    assert p.peak_tflops_bf16 == pytest.approx(bf16)
    assert p.peak_tflops_fp8 == pytest.approx(fp8)
    assert p.hbm_gib == gib
    assert p.hbm_gbps == gbps


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param("H100", "H100-SXM", id="alias-h100"),
        pytest.param("h100", "H100-SXM", id="lower-case"),
        pytest.param("H100_SXM", "H100-SXM", id="underscore"),
        pytest.param("  h100-sxm5 ", "H100-SXM", id="blanks-and-sxm5"),
        pytest.param("NVIDIA H100 80GB HBM3", "H100-SXM", id="nvidia-smi-h100"),
        pytest.param("NVIDIA A100-SXM4-80GB", "A100-80G", id="nvidia-smi-a100-80"),
        pytest.param("NVIDIA A100-SXM4-40GB", "A100-40G", id="nvidia-smi-a100-40"),
        pytest.param("A100", "A100-80G", id="alias-a100"),
        pytest.param("NVIDIA L40S", "L40S", id="nvidia-smi-l40s"),
        pytest.param("NVIDIA A10G", "A10G", id="nvidia-smi-a10g"),
        pytest.param("AMD Instinct MI300X", "MI300X", id="rocm-mi300x"),
        pytest.param("mi300", "MI300X", id="alias-mi300"),
        pytest.param("h200-sxm", "H200", id="alias-h200-sxm"),
    ],
)
def test_name_resolution(query: str, expected: str) -> None:
    assert gpu_profile(query).name == expected


@pytest.mark.parametrize("alias", list(GPU_ALIASES))
def test_every_alias_points_at_a_profile(alias: str) -> None:
    assert GPU_ALIASES[alias] in GPU_PROFILES
    assert alias not in GPU_PROFILES


@pytest.mark.parametrize("query", ["B9000", "", "H100-SXM-but-not"])
def test_unknown_gpu_is_a_key_error_listing_known_names(query: str) -> None:
    with pytest.raises(KeyError) as info:
        gpu_profile(query)
    error = info.value
    assert isinstance(error, UnknownGpuError)
    assert error.name == query
    assert error.known == tuple(sorted(GPU_PROFILES))
    assert "H100-SXM" in str(error)
    assert repr(query) in str(error)


@pytest.mark.parametrize(
    ("name", "dtype_bytes", "expected"),
    [
        pytest.param("H100-SXM", 1, 1979.0, id="h100-fp8-cores"),
        pytest.param("H100-SXM", 2, 989.5, id="h100-bf16"),
        pytest.param("A100-80G", 1, 312.0, id="a100-no-fp8-falls-back"),
        pytest.param("L40S", 1, 733.0, id="l40s-fp8"),
    ],
)
def test_peak_for_operand_width(name: str, dtype_bytes: float, expected: float) -> None:
    assert GPU_PROFILES[name].peak_tflops(dtype_bytes) == expected


@pytest.mark.parametrize(
    ("name", "gbit"),
    [
        # 900 GB/s both ways -> 450 GB/s one way -> 3,600 Gb/s
        pytest.param("H100-SXM", 3600.0, id="h100-nvlink4"),
        # 600 GB/s -> 300 GB/s -> 2,400 Gb/s
        pytest.param("A100-80G", 2400.0, id="a100-nvlink3"),
        pytest.param("L4", 0.0, id="l4-pcie-only"),
    ],
)
def test_p2p_one_direction_in_gbit(name: str, gbit: float) -> None:
    assert GPU_PROFILES[name].p2p_gbit_per_s() == gbit


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        GPU_PROFILES["X"] = GPU_PROFILES["L4"]  # type: ignore[index]
