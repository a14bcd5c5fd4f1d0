"""Energy, power and SM clock of one GPU while a loop runs, read from NVML
through ctypes (no pynvml on the GPU machine).

Why (session 39): under sustained GEMM load the H200 runs at ~1.5 GHz, not
its 1.98 GHz boost (scripts/device-timeline's nvidia-smi samples), so a
backend's step time depends on the energy a step takes as well as on its
instruction schedule. `sustained()` runs a step back to back and reports
time, joules and mean clock per step, the same way for every backend.
"""
from __future__ import annotations

import ctypes
import statistics
import threading
import time
from typing import Any, Callable

NVML_CLOCK_SM = 1
# nvmlClocksEventReasons bits (nvml.h)
REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


class Nvml:
    """The device's NVML handle (by PCI bus id, so CUDA_VISIBLE_DEVICES does
    not confuse the index); raises OSError / RuntimeError where NVML is missing."""

    def __init__(self, torch_device):
        import torch

        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._ok(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        props = torch.cuda.get_device_properties(torch_device)
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus), ctypes.byref(self.handle)),
                 f"nvmlDeviceGetHandleByPciBusId_v2({bus.decode()})")

    def _ok(self, rc: int, what: str):
        if rc != 0:
            raise RuntimeError(f"NVML {what}: error {rc}")

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        self._ok(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(v)), "energy")
        return v.value

    def sm_mhz(self) -> int:
        v = ctypes.c_uint()
        self._ok(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(v)), "clock")
        return v.value

    def power_w(self) -> float:
        v = ctypes.c_uint()
        self._ok(self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(v)), "power")
        return v.value / 1e3

    def reasons(self) -> int:
        v = ctypes.c_ulonglong()
        fn = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.lib.nvmlDeviceGetCurrentClocksThrottleReasons
        self._ok(fn(self.handle, ctypes.byref(v)), "clock event reasons")
        return v.value


def sustained(step: Callable[[], Any], steps: int, device) -> dict[str, Any]:
    """`steps` calls of step() back to back (no sync, no L2 flush between them:
    as in training), timed by CUDA events around the whole loop; NVML's energy
    counter read after a sync before and after; the SM clock, the power and
    the clock-event reasons sampled every ~5 ms by a thread meanwhile."""
    import torch

    nv = Nvml(device)
    samples: list[tuple[int, float, int]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((nv.sm_mhz(), nv.power_w(), nv.reasons()))
            time.sleep(0.005)

    torch.cuda.synchronize(device)
    e0 = nv.energy_mj()
    th = threading.Thread(target=sample, daemon=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    th.start()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize(device)
    stop.set()
    th.join()
    e1 = nv.energy_mj()
    ms = start.elapsed_time(end)
    seen = 0
    for *_, r in samples:
        seen |= r
    # The sampler starts before the GPU does and may catch its idle clock: the median, not the mean.
    return {"steps": steps, "ms_per_step": ms / steps, "joules_per_step": (e1 - e0) / 1e3 / steps,
            "mean_w": (e1 - e0) / ms, "sm_mhz_median": statistics.median(s[0] for s in samples) if samples else None,
            "power_w_median": statistics.median(s[1] for s in samples) if samples else None,
            "samples": len(samples), "clock_reasons": sorted(n for b, n in REASONS.items() if seen & b)}


def describe(sus: dict[str, Any]) -> str:
    """One line of sustained()'s result."""
    return (f"{sus['steps']} steps back to back, {sus['ms_per_step']:.3f} ms, {sus['joules_per_step']:.3f} J a step, "
            f"{sus['mean_w']:.0f} W, SM clock median {sus['sm_mhz_median']} MHz ({sus['samples']} samples; "
            f"limited by: {', '.join(sus['clock_reasons']) or 'nothing reported'})")
