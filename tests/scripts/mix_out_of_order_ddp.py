"""One rank of 2 gloo processes reading a ``Mix`` out of order in a plain loop (run by
tests/ddp_harness): rank 0's batch 2 waits for a gate while later ones are delivered (rank 1,
without workers, delivers in plan order), so when every rank calls ``set_weights`` the ranks
have delivered different steps. Each rank calls it at the earliest rank's ``next_step()``, at
a step of its own, then with no step; it reports what it delivered before and after, its
``next_step()``, what each call did and the state saved in between::

    python tests/scripts/mix_out_of_order_ddp.py GATE
"""

import argparse
from pathlib import Path

import torch.distributed as dist

from lightning_loaders.collectives import all_gather
from tests.ddp_harness import write_result
from tests.mix_sources import gated_mix_loader

parser = argparse.ArgumentParser()
parser.add_argument("gate", type=Path)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
plain = [b.tolist() for b in gated_mix_loader(args.gate, step_size=6, rank=0, world_size=2)]
slow = frozenset(i for i in plain[2] if i < 1000)  # in rank 0's batch 2 only
# rank 1 reads without workers: in plan order, so its steps delivered are known
made = gated_mix_loader(args.gate, slow, step_size=6, num_workers=2 - 2 * rank, in_order=False)
numbers = made.delivery_order()
assert numbers is not None
batches = iter(made)
got = [next(batches).tolist() for _ in range(5)]
delivered = list(numbers)
next_step = made.dataset.next_step()
try:
    made.dataset.set_weights([0, 0, 1], min(all_gather(next_step)))
    explicit = "accepted"
except ValueError as exc:
    explicit = str(exc)
try:
    made.dataset.set_weights([0, 0, 1], 20 + rank)
    differing = "accepted"
except ValueError as exc:
    differing = str(exc)
made.dataset.set_weights([0, 0, 1])
state = made.state_dict()
if rank == 0:
    args.gate.touch()
rest = [b.tolist() for b in batches]
write_result({"rank": rank, "got": got, "delivered": delivered, "next_step": next_step,
              "explicit": explicit, "differing": differing, "state": state, "rest": rest})
