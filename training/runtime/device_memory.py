"""How much memory one local device can hold: what the config check of decoding's memory compares with."""

import os

import jax


def memory_per_device() -> tuple[int, str]:
    """(bytes one local device can hold, a description): the accelerator's limit, or on CPU
    the host's available memory shared by its local devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"], f"the memory of {device.platform}:{device.id}"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:  # Counts reclaimable caches, unlike SC_AVPHYS_PAGES.
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    devices = jax.local_device_count()
    return available // devices, "the host's available memory" + (
        f" per CPU device (of {devices})" if devices > 1 else ""
    )
