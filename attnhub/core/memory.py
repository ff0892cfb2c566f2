"""Free memory on a device, and a refusal of sizes that cannot fit, checked before the
allocation: on the CPU an allocation that does not fit first swaps or runs for minutes, then
ends in the kernel's OOM killer with no message at all."""

from __future__ import annotations

import torch

from ..errors import InputError


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: the kernel's ``MemAvailable`` on the CPU,
    the driver's free memory on CUDA; None where unknown."""
    if device.type == "cuda":  # free on the card plus what torch's cache holds unused
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(need: int, device: torch.device, what: str, fix: str) -> None:
    """Raise InputError naming ``what`` and ``fix`` when ``need`` bytes exceed what
    ``device`` has free."""
    free = available_memory(device)
    if free is not None and need > free:
        raise InputError(f"{what}: at least {_size(need)} needed on {device}, {_size(free)} "
                         f"free; {fix}")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
