"""The device to run on: one place that reads a requested device ("auto", "cpu", "cuda", "cuda:1", a torch.device)
and says whether a device is a GPU, by its device type, never by comparing strings ("cuda:1" and
torch.device("cuda") are GPUs too).

Inference paths (`ultrathink eval`/`generate`/`chat`, the registered pyfunc model, the scorers) take a device and
resolve it here; functions that get a model run on the device its parameters are on (`model_device`).
"""

from __future__ import annotations

import torch

AUTO = "auto"
DeviceLike = str | torch.device


class DeviceError(ValueError):
    """A requested device that is not a device, or not one this machine has; the message names it."""


def resolve_device(requested: DeviceLike | None = None) -> torch.device:
    """The device to run on. None or "auto": the GPU when torch sees one (cuda), else the CPU. Anything else is
    torch's own device syntax ("cpu", "cuda", "cuda:1", "mps", a torch.device) and must exist on this machine:
    an unknown name, or a GPU that is not there, raises DeviceError naming the requested value."""
    if requested is None or (isinstance(requested, str) and requested.strip().lower() in (AUTO, "")):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested.strip() if isinstance(requested, str) else requested)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceError(f"device {str(requested)!r} is not a device ({exc}); use auto, cpu, cuda or cuda:N") \
            from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(requested)!r} is not available: torch {torch.__version__} sees no CUDA GPU "
                              "on this machine; use --device cpu (or auto)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {str(requested)!r} is not available: this machine has {count} CUDA GPU(s), "
                              f"cuda:0 to cuda:{count - 1}")
        return device
    try:  # any other kind (mps, xpu, ...): usable when a tensor can be put on it
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, AttributeError, NotImplementedError) as exc:
        raise DeviceError(f"device {str(requested)!r} is not available on this machine ({exc})") from None
    return device


def device_type(device: DeviceLike) -> str:
    """"cuda" for "cuda", "cuda:1" and torch.device("cuda", 1); "cpu" for the CPU; and so on."""
    return torch.device(device).type


def is_cuda(device: DeviceLike) -> bool:
    """Whether `device` is a CUDA GPU, whatever its index or spelling."""
    return device_type(device) == "cuda"


def synchronize(device: DeviceLike) -> None:
    """Wait until the work queued on `device` is done, so a clock read after it counts that work: a GPU runs its
    kernels asynchronously; a CPU has finished when the call returns (nothing to wait for)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def release_device_memory(device: DeviceLike) -> None:
    """Hand the caching allocator's free blocks back to the GPU (after an out-of-memory error); nothing on a CPU."""
    if is_cuda(device):
        torch.cuda.empty_cache()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's parameters are on: where its inputs must be put."""
    return next(model.parameters()).device


def place(model: torch.nn.Module, device: DeviceLike | None) -> torch.device:
    """Move `model` to `device` (resolved: "auto" means the GPU when there is one) unless it is None, and return
    the device the model now runs on."""
    if device is not None:
        model.to(resolve_device(device))  # a no-op when it is there already
    return model_device(model)


# The float functions torch computes through oneMKL's VML on a CPU (ATen/cpu/vml.h). VML picks each function's
# kernel on that function's first call, and when the first call runs on several of torch's threads at once one of
# them can compute its share with a low-accuracy kernel (pytorch/pytorch#188792). Here the rotary tables of a model
# built in a fresh process came out different in about one process of three (cos(64) = 0.3918521 on one thread's
# half of the rows, for 0.3918572), and with them the trained weights.
VML_FUNCTIONS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin",
                 "sqrt", "tan", "tanh", "trunc")


def settle_cpu_math() -> None:
    """Call each VML function once on one element, on this thread alone, so its kernel is chosen before any call
    that torch splits over threads: every process then computes the same bits. Microseconds; once is enough."""
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(one)
