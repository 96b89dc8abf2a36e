"""The MFU denominator: exact-name datasheet peaks, a measured peak for any other accelerator, None (one warning)
where even that fails. No GPU needed: the GPU's name and the GPU measurement are stood in for; the CPU really measures."""

import logging
import os

import pytest
import torch

from ultrathink.train import precision
from ultrathink.train.precision import GPU_PEAK_FLOPS, cpu_peak_gflops, matmul_gflops, peak_flops, table_peak


@pytest.fixture(autouse=True)
def fresh_cache():
    """peak_flops caches per (precision, device): every test starts, and leaves, with nothing cached."""
    peak_flops.cache_clear()
    yield
    peak_flops.cache_clear()


def gpu_named(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == precision.__name__ and r.levelno == logging.WARNING]


def test_table_lookup_is_by_exact_name():
    assert table_peak("NVIDIA L40S", "bf16") == 362e12
    assert table_peak("NVIDIA L4", "bf16") == 121e12  # the L40S must never get this one
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert table_peak("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert table_peak("NVIDIA A100-SXM4-40GB", "fp32") == 156e12
    assert table_peak("NVIDIA GeForce RTX 4090", "fp16") == 165.2e12
    # Near misses of table names are unknown, not matched by substring or case.
    for name in ("H100", "NVIDIA H100", "nvidia l4", "NVIDIA L4 ", "NVIDIA GeForce RTX 5090", "AMD Instinct MI300X"):
        assert table_peak(name, "bf16") is None, name


def test_gpus_without_bf16_have_no_bf16_peak():
    assert table_peak("Tesla T4", "bf16") is None
    assert table_peak("Tesla T4", "fp16") == 65e12
    assert table_peak("Tesla T4", "fp32") == 8.1e12  # plain fp32: no TF32 on Turing
    assert table_peak("Tesla V100-SXM2-32GB", "bf16") is None
    assert table_peak("Tesla V100-SXM2-32GB", "fp16") == 125e12


def test_table_rows_are_dense_tensor_peaks():
    """Every row: known precisions only, bf16 as fast as fp16, and on a TF32 GPU (the ones with bf16) TF32 at half
    the 16-bit rate, as dense datasheet figures are: a sparse figure mixed in with dense ones would be 2× off."""
    for name, row in GPU_PEAK_FLOPS.items():
        assert set(row) <= {"bf16", "fp16", "fp32"} and "fp16" in row and "fp32" in row, name
        assert row["fp16"] > row["fp32"], name
        if "bf16" in row:
            assert row["bf16"] == row["fp16"], name
            assert 1.9 < row["bf16"] / row["fp32"] < 2.1, name


def test_known_gpu_gets_its_table_peak_without_measuring(monkeypatch, caplog):
    gpu_named(monkeypatch, "NVIDIA L40S")
    monkeypatch.setattr(precision, "matmul_gflops", lambda *a, **k: pytest.fail("a known GPU must not be measured"))
    assert peak_flops("bf16", "cuda:0") == 362e12
    assert peak_flops("fp32", "cuda:0") == 183e12
    assert warnings_of(caplog) == []


def test_unknown_gpu_gets_a_measured_peak_and_one_warning(monkeypatch, caplog):
    gpu_named(monkeypatch, "NVIDIA GeForce RTX 5090")
    calls = []

    def measured(dtype, size=512, repeats=3, device="cpu"):
        calls.append((dtype, device))
        return 150_000.0  # GFLOP/s

    monkeypatch.setattr(precision, "matmul_gflops", measured)
    assert peak_flops("bf16", "cuda:0") == 150e12
    assert peak_flops("bf16", "cuda:0") == 150e12  # cached: measured, and warned about, once
    assert calls == [(torch.bfloat16, "cuda:0")]
    [warning] = warnings_of(caplog)
    assert "'NVIDIA GeForce RTX 5090'" in warning and "measured matmul peak" in warning and "150 TFLOP/s" in warning


def test_precision_missing_from_a_known_row_is_measured(monkeypatch, caplog):
    gpu_named(monkeypatch, "Tesla T4")
    calls = []
    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype, **k: calls.append(dtype) or 20_000.0)
    assert peak_flops("bf16", "cuda") == 20e12
    assert calls == [torch.bfloat16]
    assert len(warnings_of(caplog)) == 1


def test_failing_measurement_leaves_mfu_out_with_one_warning(monkeypatch, caplog):
    gpu_named(monkeypatch, "NVIDIA GeForce RTX 5090")

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(precision, "matmul_gflops", out_of_memory)
    assert peak_flops("fp16", "cuda:0") is None
    assert peak_flops("fp16", "cuda:0") is None  # cached: one warning, not one per log line
    [warning] = warnings_of(caplog)
    assert "'NVIDIA GeForce RTX 5090'" in warning and "CUDA out of memory" in warning and "MFU is left out" in warning


def test_no_usable_gpu_gives_none_not_an_error(monkeypatch, caplog):
    def no_driver(device=None):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_driver)
    assert peak_flops("bf16", "cuda:0") is None
    [warning] = warnings_of(caplog)
    assert "no NVIDIA driver" in warning and "MFU is left out" in warning


def test_cpu_peak_is_a_real_measurement_that_leaves_the_global_rng_alone(caplog):
    rng = torch.get_rng_state()
    peak = peak_flops("fp32", "cpu")
    assert isinstance(peak, float) and 1e8 < peak < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s
    assert peak_flops("fp32", "cpu") is peak  # cached
    assert torch.equal(torch.get_rng_state(), rng)
    assert warnings_of(caplog) == []


def test_matmul_gflops_takes_a_device():
    rng = torch.get_rng_state()
    assert matmul_gflops(torch.float32, size=128, repeats=2, device="cpu") > 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_train_deterministic_switches_torch_to_deterministic_kernels(monkeypatch):
    from ultrathink.train.precision import use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert not torch.backends.cudnn.benchmark
    finally:
        use_deterministic_kernels(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_cpu_peak_stops_growing_before_a_matmul_that_would_take_too_long(monkeypatch):
    """An AVX2-only CPU runs bf16 at ~1 GFLOP/s a thread: a 2048² matmul there takes ~20 s, so its peak is taken at
    the sizes that stay quick, while fp32 (~60 GFLOP/s a thread) is timed at every size; the peak is the fastest."""
    rates = {torch.float32: {512: 40.0, 1024: 60.0, 2048: 58.0}, torch.bfloat16: {512: 1.2, 1024: 0.9, 2048: 0.8}}
    asked = []

    def measured(dtype, size=512, repeats=3, device="cpu"):
        asked.append((dtype, size))
        return rates[dtype][size]

    monkeypatch.setattr(precision, "matmul_gflops", measured)
    assert cpu_peak_gflops(torch.float32) == 60.0
    assert cpu_peak_gflops(torch.bfloat16) == 1.2  # 1024² at 1.2 GFLOP/s would take 1.8 s
    assert asked == [(torch.float32, 512), (torch.float32, 1024), (torch.float32, 2048), (torch.bfloat16, 512)]
    assert 2 * 1024**3 / 1.2e9 > precision.PEAK_MATMUL_SECONDS > 2 * 2048**3 / 60e9
