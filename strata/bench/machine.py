"""Where a benchmark's figures were measured: the CPU model (figures differ between CPUs, so every benchmark prints
it) and the GPU's name when one ran."""
from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it, else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine() or "unknown CPU"


def machine_line(device: str) -> str:
    """`CPU: <model>, N torch threads`, and the GPU's name when one ran."""
    import torch  # here: cpu_model() serves processes that never load torch

    line = f"CPU: {cpu_model()}, {torch.get_num_threads()} torch threads"
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        line += f"; GPU: {torch.cuda.get_device_name()}"
    return line
