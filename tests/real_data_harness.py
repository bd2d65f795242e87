"""Real 2-rank DDP Trainer runs over a dataset a test builds: launch
``tests/scripts/real_data_fit.py`` and check what the ranks saw.

    runs = check_real_data_ddp("tests.sources.test_x:ddp_dataset", data_dir, total=40,
                               result_dir=tmp_path / "ddp", workers=2)

``check_real_data_ddp`` asserts that in every epoch every id in ``0..total-1`` arrives exactly
once across the two ranks, that the ranks train on equal numbers of batches (``len()`` equal
too, when known), and that every resumed run equals the rest of the uninterrupted one on its
rank. It returns the ranks' reports (``runs[rank]["seen" | "len" | "resumes"]``, see the
script's docstring) for further checks. Given a list of datasets it runs them all in one
launch (one process start for all) and returns ``{spec: runs}``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from tests.ddp_harness import REPO, run_ddp

__all__ = ["SCRIPT", "check_real_data_ddp", "check_real_data_runs"]

SCRIPT = REPO / "tests" / "scripts" / "real_data_fit.py"


def check_real_data_ddp(dataset: str | list[str], data_dir: str | Path, total: int,
                        result_dir: Path, *, workers: int = 2, batch_size: int = 4,
                        epochs: int = 2, shuffle: bool = False,
                        extra_args: tuple[str, ...] = ()) -> Any:
    """Launch the script on 2 ranks over ``dataset`` (``module:function``, or a list of them)
    and check every one; returns its per-rank reports (a dict of them by spec for a list)."""
    specs = [dataset] if isinstance(dataset, str) else list(dataset)
    args = [*(arg for spec in specs for arg in ("--dataset", spec)), "--data", str(data_dir),
            "--total", str(total), "--workers", str(workers), "--batch-size", str(batch_size),
            "--epochs", str(epochs), *(["--shuffle"] if shuffle else []), *extra_args]
    reports = run_ddp(SCRIPT, args, result_dir)
    by_spec = {spec: [report[spec] for report in reports] for spec in specs}
    for spec, runs in by_spec.items():
        try:
            check_real_data_runs(runs, total, epochs)
        except AssertionError as exc:
            raise AssertionError(f"{spec}: {exc}") from None
    return by_spec[dataset] if isinstance(dataset, str) else by_spec


def check_real_data_runs(runs: list[Any], total: int, epochs: int) -> None:
    """Exactly once per epoch across ranks, equal batch counts, resumes equal to the rest."""
    assert runs[0]["len"] == runs[1]["len"], f"len() differs by rank: {[r['len'] for r in runs]}"
    for epoch in range(epochs):
        steps = [[ids for e, ids in run["seen"] if e == epoch] for run in runs]
        assert len(steps[0]) == len(steps[1]), (
            f"epoch {epoch}: ranks trained on {[len(s) for s in steps]} batches")
        if runs[0]["len"] is not None:
            assert len(steps[0]) == runs[0]["len"], (
                f"epoch {epoch}: {len(steps[0])} steps, but len() said {runs[0]['len']}")
        counts = Counter(i for rank_steps in steps for ids in rank_steps for i in ids)
        missing = sorted(set(range(total)) - set(counts))
        repeated = sorted(i for i, n in counts.items() if n > 1)
        foreign = sorted(set(counts) - set(range(total)))
        assert not missing and not repeated and not foreign, (
            f"epoch {epoch}: {len(missing)} ids missing {missing[:10]}, {len(repeated)} repeated "
            f"{repeated[:10]}, ids outside 0..{total - 1}: {foreign[:10]}")
    for rank, run in enumerate(runs):
        assert run["resumes"], f"rank {rank} resumed from no checkpoint"
        for step, resumed in run["resumes"].items():
            assert resumed == run["seen"][int(step):], (
                f"rank {rank}, resumed after step {step}:\n  got      {resumed[:3]}\n"
                f"  expected {run['seen'][int(step):int(step) + 3]}")
