"""The public API of ``lightning_loaders/__init__.py``."""

import subprocess
import sys
from pathlib import Path

import lightning_loaders

README = Path(__file__).resolve().parents[1] / "README.md"


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert lightning_loaders.__all__ == sorted(lightning_loaders.__all__)
    for name in lightning_loaders.__all__:
        assert getattr(lightning_loaders, name) is not None


def test_importing_the_package_does_not_import_lightning() -> None:
    code = "import sys, lightning_loaders; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert lightning_loaders.DataStallMonitor.__module__ == "lightning_loaders.lightning.monitor"


def test_the_readme_api_reference_is_what_the_script_prints() -> None:
    """Every public name, described by the first paragraph of its docstring, as it is now."""
    printed = subprocess.run([sys.executable, str(README.parent / "scripts" / "api_reference.py")],
                             capture_output=True, text=True, check=True).stdout
    assert all(f"| `{name}` |" in printed for name in lightning_loaders.__all__)
    assert printed in README.read_text()
