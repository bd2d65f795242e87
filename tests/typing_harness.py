"""Type-check a user's snippet with ``mypy --strict`` as a user of the installed package sees it.

The package is read from this checkout without reporting its own errors
(``follow_imports=silent``, as mypy treats an installed package). torch, numpy and Lightning are
skipped (``Any``) except ``torch.utils.data``, whose dataset classes the loaders' signatures
tell apart: a cold run then takes seconds instead of the better part of a minute.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_CONFIG = f"""\
[mypy]
python_version = 3.11
mypy_path = {ROOT}
follow_imports = silent
[mypy-torch.*,numpy.*,lightning.*,lightning_fabric.*]
follow_imports = skip
[mypy-torch.utils.data.*]
follow_imports = silent
"""


def mypy_errors(snippet: str, tmp_path: Path) -> list[str]:
    """The errors ``mypy --strict`` reports in ``snippet`` (dedented), as
    ``line: message [code]``."""
    api = pytest.importorskip("mypy.api")
    (tmp_path / "mypy.ini").write_text(_CONFIG)
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent(snippet))
    stdout, stderr, _ = api.run(["--strict", "--config-file", str(tmp_path / "mypy.ini"),
                                 "--cache-dir", str(tmp_path / "cache"), str(user)])
    assert not stderr, stderr
    return [line.split(":", 1)[1].replace(" error:", "", 1) for line in stdout.splitlines()
            if line.startswith(f"{user}:") and ": error:" in line]
