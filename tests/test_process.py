"""The in-run whole-device figure (gpu/device_used_gib) reads what nvidia-smi reads, through a stand-in NVML."""

import sys
import types

import pytest

from miniverl.process import device_used_gib

GIB = 2**30


def _fake_nvml(*, has_v2: bool, v2_fails: bool = False, init_fails: bool = False):
    """An NVML whose first query counts a 0.5 GiB reserve as used (12.5 GiB) and whose v2 query does not (12)."""

    class NVMLError(Exception):
        pass

    def init():
        if init_fails:
            raise NVMLError("driver not loaded")

    def memory_info(handle, version=None):
        assert handle == "gpu0"
        if version is None:
            return types.SimpleNamespace(used=int(12.5 * GIB))
        if v2_fails:
            raise NVMLError("function not found")
        return types.SimpleNamespace(used=12 * GIB, reserved=GIB // 2)

    module = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetMemoryInfo=memory_info,
    )
    if has_v2:
        module.nvmlMemory_v2 = 0x02000028
    return module


@pytest.mark.parametrize(
    ("nvml", "expected"),
    [
        (_fake_nvml(has_v2=True), 12.0),  # the v2 query, as nvidia-smi: the reserve is not used memory
        (_fake_nvml(has_v2=True, v2_fails=True), 12.5),  # a driver without it: the first query
        (_fake_nvml(has_v2=False), 12.5),  # a pynvml without it: the first query
        (_fake_nvml(has_v2=True, init_fails=True), None),  # no driver: no figure, not an error
    ],
)
def test_device_used_reads_what_nvidia_smi_reads(monkeypatch, nvml, expected):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert device_used_gib() == expected


def test_without_pynvml_there_is_no_figure(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert device_used_gib() is None
