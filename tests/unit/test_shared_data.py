"""The project's shared data (``../shared`` beside the checkout) is found from the repository
(``tests/conftest.py``), never at an absolute path that holds on one machine only."""

from __future__ import annotations

from tests.conftest import MOONCAKE_TRACE, REPO_ROOT, SHARED_DIR

ABSOLUTE = "/work/" + "shared"  # split, so this file does not name it


def test_the_shared_folder_is_found_beside_the_repository() -> None:
    assert (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "tests").is_dir()
    assert REPO_ROOT.parent / "shared" == SHARED_DIR
    assert MOONCAKE_TRACE.is_relative_to(SHARED_DIR)


def test_no_test_or_loadtest_file_names_an_absolute_shared_path() -> None:
    files = [*(REPO_ROOT / "tests").rglob("*.py"), *(REPO_ROOT / "loadtest").rglob("*.py")]
    files += (REPO_ROOT / "loadtest").rglob("*.md")
    named = [str(p.relative_to(REPO_ROOT)) for p in files if ABSOLUTE in p.read_text()]
    assert named == []
