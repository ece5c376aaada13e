"""Layers ask `cpu_kernels_apply` whether strata's C kernels may take a tensor; the device checks left in layers/
and the TP collectives are the ones that choose something else than strata's C kernels."""
from __future__ import annotations

import re
from pathlib import Path

import strata

ROOT = Path(strata.__file__).parent
CPU_CHECK = re.compile(r"""device\.type\s*[!=]=\s*["']cpu["']""")
# Each remaining check, and what it chooses instead of a C kernel of strata's.
NOT_STRATA_KERNELS = {
    "layers/moe.py": "torch's own int8 matmul for experts_int8",
    "layers/sampler.py": "sampling arithmetic in numpy on the host",
    "layers/attention.py": "a decode step's key ranges computed in numpy on the host",
    "layers/onednn_weights.py": "oneDNN's weight packing (torch's)",
}


def test_c_kernel_choices_in_layers_and_collectives_go_through_cpu_kernels_apply():
    files = [*(ROOT / "layers").rglob("*.py"), ROOT / "executor" / "shm_collectives.py"]
    found = {str(f.relative_to(ROOT)) for f in files if CPU_CHECK.search(f.read_text())}
    assert found == set(NOT_STRATA_KERNELS), found ^ set(NOT_STRATA_KERNELS)


def test_the_pattern_finds_a_device_check():
    assert CPU_CHECK.search('if x.device.type == "cpu":') and CPU_CHECK.search("if w.device.type != 'cpu':")
