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


def test_the_readme_api_reference_lists_every_public_name() -> None:
    text = README.read_text()
    missing = [name for name in lightning_loaders.__all__ if f"| `{name}` |" not in text]
    assert missing == []
