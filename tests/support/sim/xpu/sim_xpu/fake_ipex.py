"""Install the fake IPEX (or a booby-trapped one) with a dist-info of a chosen version into a folder (tests only)."""

from __future__ import annotations

import shutil
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "fake_ipex_src" / "intel_extension_for_pytorch"

#: Stands in for an IPEX built for another torch: importing it exits the process, like the real mismatch does.
_TRAP = '''import os, sys
open(os.environ["FAKE_IPEX_IMPORTED_MARKER"], "w").write("imported")
sys.exit("ERROR! Intel Extension for PyTorch needs to work with PyTorch 2.8.*, but PyTorch {torch} is found.")
'''


def make_site(site: Path, version: str, trap: bool = False) -> Path:
    """``site/intel_extension_for_pytorch`` + ``site/intel_extension_for_pytorch-<version>.dist-info``."""
    site = Path(site)
    pkg = site / "intel_extension_for_pytorch"
    if trap:
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(_TRAP)
    else:
        shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))
        (pkg / "_version.py").write_text(f"__version__ = {version!r}\n")
    dist = site / f"intel_extension_for_pytorch-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: intel-extension-for-pytorch\nVersion: {version}\n")
    return site
