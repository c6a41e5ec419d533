"""Fixtures of the loader tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf_helpers import write_gguf_file


@pytest.fixture
def write_gguf(tmp_path: Path) -> Callable[..., str]:
    """``write_gguf(name, arch, tensors, metadata=None) -> path``: ``write_gguf_file`` into ``tmp_path``."""

    def write(name: str, arch: str, tensors, metadata=None) -> str:
        return write_gguf_file(tmp_path / name, arch, tensors, metadata)

    return write
