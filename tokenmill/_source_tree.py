"""Let a source checkout import the top-level folders as `tokenmill.frontend`, `tokenmill.scheduler`, ... .

Installed (`pip install .` or `-e .`), setuptools maps `frontend/` to `tokenmill.frontend` and so on
(pyproject.toml). Run from the repository root instead (pytest puts it first on sys.path, as do scripts), `tokenmill`
is found as the `tokenmill/` folder there, which does not hold the other four; this finder maps exactly those four
names to their sibling folders, and nothing else. It is installed only when `tokenmill/` sits in such a checkout.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

SUBPACKAGES = ("frontend", "scheduler", "workers", "kernels")


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.folders = {f"tokenmill.{name}": root / name for name in SUBPACKAGES}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def install_if_source_checkout(package_dir: Path) -> None:
    root = package_dir.parent
    if (package_dir / "frontend").is_dir() or not (root / "pyproject.toml").is_file():
        return  # an installed package: its subpackages are inside it
    if all((root / name / "__init__.py").is_file() for name in SUBPACKAGES):
        sys.meta_path.append(SourceTreeFinder(root))
