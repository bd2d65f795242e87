"""One rank of a plain training loop over a source of unknown length with
``last_batch="drop"`` (launched by ``tests/ddp_harness.run_ddp``): every slot reads one shard
of 13 samples in batches of 2 (6 batches, one sample dropped), and the ranks agree every 3
batches, so the state after the epoch's last batch cannot say it ended. Reports, per
``--workers`` count, the uninterrupted epochs and those read after resuming from rank 0's
state saved after epoch 0's last batch (with the loader's ``epoch`` after each).

    python tests/scripts/iterable_epoch_end_ddp.py --workers 0 [--workers 2]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from lightning_loaders import GeneratorSource, ResumableLoader
from tests.ddp_harness import write_result


def _shard(shard: int) -> Iterator[int]:
    return iter(range(100 * shard, 100 * shard + 13))


def _loader(workers: int) -> ResumableLoader:
    slots = 2 * max(workers, 1)  # one shard per (rank, worker) slot
    return ResumableLoader(GeneratorSource(_shard, list(range(slots))), batch_size=2, seed=5,
                           num_workers=workers, last_batch="drop", sync_interval=3)


def _epoch(loader: ResumableLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, action="append", default=[])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = {}
    for workers in args.workers:
        loader = _loader(workers)
        full = [_epoch(loader) for _ in range(3)]
        loader.close()
        loader = _loader(workers)
        batches = iter(loader)
        for _ in full[0]:
            next(batches)
        state = [loader.state_dict()]  # every rank gathers; rank 0's is the checkpoint's
        loader.close()
        dist.broadcast_object_list(state, 0)
        resumed = _loader(workers)
        resumed.load_state_dict(state[0])
        after = [(_epoch(resumed), resumed.epoch) for _ in range(2)]
        resumed.close()
        results[workers] = {"full": full, "ended": state[0]["parts"]["slots"]["ended"],
                            "resumed": after}
    write_result(results)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
