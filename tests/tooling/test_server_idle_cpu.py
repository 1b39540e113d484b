"""scripts/server_idle_cpu.py counts the CPU of a server's whole process group, children included."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.helpers.script_helpers import load_script


def _own_cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_process_group_cpu_counts_a_busy_child_of_an_idle_parent():
    idle_cpu = load_script("server_idle_cpu")
    # as a server's API process waits while its engine core spins: a sleeping parent, a spinning child
    spin = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass\n"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; "
                               f"subprocess.Popen([sys.executable, '-c', {spin!r}]).wait()"])
    try:
        root = psutil.Process(parent.pid)
        deadline = time.monotonic() + 2
        while not root.children() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        group_before, parent_before = idle_cpu.process_group_cpu_seconds(root), _own_cpu(root)
        time.sleep(0.7)
        group_grew = idle_cpu.process_group_cpu_seconds(root) - group_before
        parent_grew = _own_cpu(root) - parent_before
        assert parent_grew < 0.1  # the parent alone reads idle
        assert group_grew > 0.2  # the child's spinning is counted (a share of a core even on a busy machine)
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
