"""Planted temp folders for the session check's own test (tests/test_tempdirs.py runs this
file in a child pytest; the normal run does not collect it: its name is not test_*.py).

The session must fail when a test leaves a kvs* folder directly in the system temp dir,
name that test, and leave alone a folder made and removed there, or made in the root.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


def system_tmp() -> Path:
    return Path(tempfile.gettempdir()).parent  # the session's root sits in the system temp dir


@pytest.mark.unit
def test_leaves_a_folder_in_the_system_temp_dir() -> None:
    tempfile.mkdtemp(prefix="kvs-planted-", dir=system_tmp())


@pytest.mark.unit
def test_removes_what_it_made_there() -> None:
    Path(tempfile.mkdtemp(prefix="kvs-planted-", dir=system_tmp())).rmdir()


@pytest.mark.unit
def test_makes_its_folder_in_the_root() -> None:
    tempfile.mkdtemp(prefix="kvs-planted-")
