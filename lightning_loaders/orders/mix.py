"""The order of a weighted mixture of sources: which source, and which of its samples, sits at
each position of an epoch (``MixOrder``), as a pure function of the configuration.

- **Which source.** ``source_at(seed, epoch, positions, weights)``: a uniform hashed from
  ``(seed, epoch, position)`` against the cumulative weights, the weights being those of the
  position's global step (``WeightSchedule``). Every rank computes the same source for every
  position without communication, whatever the world size or the worker count.
- **Global step** of position ``p`` in epoch ``e``: ``e * ceil(L / G) + p // G`` for an epoch
  of ``L`` samples and a global batch of ``G`` samples (``batch_size``, all ranks together):
  Lightning's ``global_step`` under ``last_batch="keep"``, one optimizer step per batch.
- **Which sample of that source** depends on the exhaustion mode:

  ``"cycle"``: source ``k``'s ``c``-th draw of the epoch (``c`` = earlier positions of the
  epoch that drew ``k``) reads its own stream: pass ``c // n_k`` is a fresh permutation of
  ``range(n_k)`` keyed by ``(seed, epoch, k, pass)``, so an exhausted source restarts
  reshuffled. The epoch has ``samples_per_epoch`` positions.

  ``"replacement"``: every draw picks a uniformly random sample of its source (sampling with
  replacement); ``samples_per_epoch`` positions.

  ``"stop"``: the epoch ends when the first source runs out: source ``k`` contributes exactly
  ``c_k`` samples, ``c`` proportional to the weights (largest remainders) and as large as the
  sources allow, so the source that runs out first is read entirely and no sample is read twice.
  The positions are a keyed shuffle of that multiset. Weights must then be constant.

The draw counts of ``"cycle"`` are the only non-local quantity: they are counted from the
draws (vectorised, a chunk of ``2**16`` positions at a time) and checkpointed at chunk starts.
Counts at one chunk start give those at any other by counting the chunks between them, forwards
or backwards, so the state carries the counts at the latest chunk start planned in each of the
last two epochs (O(number of sources)), and a resume is a jump: it counts only the chunks
between that checkpoint and the cursor (the prefetch depth), never the epoch up to the cursor.
Weight changes made mid-run (``set_weights(weights, step)``) are breakpoints kept in the state;
they bump ``version`` so that a loader re-plans what it had prefetched, and drop the
checkpoints that counted draws at or after their step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from lightning_loaders.errors import StateMismatchError
from lightning_loaders.hashing import digest, mix64, mix64_array
from lightning_loaders.orders.dynamic_weighted import check_same_on_every_rank
from lightning_loaders.orders.permutation import KeyedPermutation
from lightning_loaders.orders.random import check_weights, weighted_draws

__all__ = ["MIX_MODES", "MixMode", "MixOrder", "WeightSchedule", "source_at"]

MixMode = Literal["cycle", "replacement", "stop"]
MIX_MODES: tuple[MixMode, ...] = ("cycle", "replacement", "stop")

# Stream tags: independent hashes for the source draw, the picks and the permutations.
_SOURCE, _PICK, _PASS, _STOP, _STOP_SOURCE = 0x313, 0x314, 0x315, 0x316, 0x317
_CHUNK_BITS = 16
_CHUNK = 1 << _CHUNK_BITS
_SMALL_SOURCE = 4096  # sources up to this size are permuted by sorting hashes
_EPOCHS_KEPT = 2  # epochs whose checkpoints are kept (a prefetch, or rollover, spans two)
_PROBED_STEPS = sorted({0, *(m << k for k in range(24) for m in (1, 3))})  # 0 .. 2**24, sparse

Weights = Any  # a sequence (or array, tensor) of one non-negative weight per source


def source_at(seed: int, epoch: int, positions: np.ndarray, weights: Weights) -> np.ndarray:
    """The source (int64) drawn at each of ``positions`` of ``epoch`` under ``weights``: the
    inverse CDF of a uniform hashed from ``(seed, epoch, position)``. A pure function."""
    array = check_weights(weights)
    return weighted_draws(np.cumsum(array), int(np.flatnonzero(array)[-1]),
                          mix64(seed, epoch, _SOURCE), np.asarray(positions, dtype=np.int64))


class WeightSchedule:
    """The sources' weights as a function of the global step.

    Args:
        weights: one weight per source (constant); or ``(step, weights)`` breakpoints (a list
            of pairs, or a dict ``{step: weights}``), the first at step 0, each holding until
            the next; or a callable ``step -> weights``, which must be a pure function of the
            step (it is called again on resume; its weights at a few steps up to 2**24 are
            its fingerprint).
        num_sources: how many weights each step has.
    """

    def __init__(self, weights: Any, num_sources: int) -> None:
        self.num_sources = num_sources
        self._fn: Callable[[int], Weights] | None = None
        if callable(weights):
            self._fn = weights
            self.steps = np.zeros(0, dtype=np.int64)
            self.table: list[np.ndarray] = []
            name = getattr(weights, "__qualname__", type(weights).__name__)
            self.fingerprint = f"callable {name} {digest(_probed(weights, num_sources))}"
            return
        steps, table = _breakpoints(weights, num_sources)
        self.steps, self.table = steps, table
        self.fingerprint = f"steps {digest(steps)} weights {digest(np.stack(table))}"

    @property
    def constant(self) -> bool:
        return self._fn is None and len(self.table) == 1

    def keys(self, steps: np.ndarray) -> np.ndarray:
        """A key per step; steps with equal keys have equal weights."""
        if self._fn is not None:
            return steps
        return np.searchsorted(self.steps, steps, side="right") - 1

    def weights(self, key: int) -> np.ndarray:
        """The weights of a key returned by ``keys``."""
        if self._fn is None:
            return self.table[key]
        return _checked(self._fn(key), self.num_sources, f"weights({key})")


def _probed(fn: Callable[[int], Weights], num_sources: int) -> list[Any]:
    """What a schedule callable gives at ``_PROBED_STEPS`` (an error's type where it raises):
    its fingerprint, so that a function edited between a save and a resume is refused."""
    out: list[Any] = []
    for step in _PROBED_STEPS:
        try:
            out.append(_checked(fn(step), num_sources, f"weights({step})").tolist())
        except Exception as exc:  # a schedule defined only over the run's steps
            out.append(type(exc).__name__)
    return out


def _breakpoints(weights: Any, num_sources: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(steps, weights per segment)`` of constant weights, ``(step, weights)`` pairs, or a
    dict of them."""
    items = sorted(weights.items()) if isinstance(weights, Mapping) else list(weights)
    pairs = items and all(isinstance(item, tuple | list) and len(item) == 2
                          and not np.isscalar(item[1]) for item in items)
    if not pairs:
        return np.zeros(1, dtype=np.int64), [_checked(items, num_sources, "weights")]
    steps = [item[0] for item in items]
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps) or \
            steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError(f"a weight schedule's steps must be increasing ints from 0, got {steps}: "
                         "give [(0, weights), (step, weights), ...]")
    table = [_checked(w, num_sources, f"weights at step {s}") for s, w in items]
    return np.asarray(steps, dtype=np.int64), table


def _checked(weights: Weights, num_sources: int, what: str) -> np.ndarray:
    try:
        return check_weights(weights, num_sources)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc} (one weight per source, {num_sources} sources)") from None


class MixOrder:
    """``SampleOrder`` of a mixture: position -> (source, sample of it) -> index into the
    sources laid end to end (source ``k``'s sample ``i`` is index ``offsets[k] + i``).

    Args:
        lengths: samples per source.
        schedule: the weights per global step.
        mode: ``"cycle"``, ``"replacement"`` or ``"stop"`` (see the module docstring).
        samples_per_epoch: positions per epoch for ``"cycle"``/``"replacement"`` (default: the
            total of ``lengths``); fixed by the weights for ``"stop"``.
        batch_size: samples per global step (per-rank batch size x world size), needed to
            place weight changes at steps; ``None`` allows only constant weights.
        seed: keys every draw; ``None`` takes the loader's seed (``bind``).
        members: what each source is (its own fingerprint, or its type), for the fingerprint.
    """

    def __init__(self, lengths: Sequence[int], schedule: WeightSchedule, mode: MixMode,
                 samples_per_epoch: int | None, batch_size: int | None,
                 seed: int | None, members: Sequence[str] = ()) -> None:
        if mode not in MIX_MODES:
            raise ValueError(f"mode must be one of {MIX_MODES}, got {mode!r}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.size < 1 or (self.lengths < 1).any():
            raise ValueError(f"every source needs at least one sample, got lengths "
                             f"{self.lengths.tolist()}")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.schedule, self.mode, self.seed = schedule, mode, seed
        self.members = list(members)
        if batch_size is not None and (not isinstance(batch_size, int)
                                       or isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1 (samples per global step), got "
                             f"{batch_size!r}")
        if batch_size is None and not schedule.constant:
            raise ValueError("weights that change with the step need batch_size= (samples per "
                             "global step: the per-rank batch size x the world size), which "
                             "maps a position to its step")
        self.batch_size = batch_size
        if mode == "stop":
            if not schedule.constant:
                raise ValueError("mode='stop' needs constant weights: the epoch is a shuffle of "
                                 "fixed per-source counts, which a weight change would alter; "
                                 "use mode='cycle' or 'replacement' with a schedule")
            if samples_per_epoch is not None:
                raise ValueError("mode='stop' fixes the epoch length (it ends when the first "
                                 "source runs out); drop samples_per_epoch, or use 'cycle'")
            self._quota = _stop_quota(schedule.weights(0), self.lengths)
            self.samples_per_epoch = int(self._quota.sum())
        else:
            total = int(self.lengths.sum())
            self.samples_per_epoch = total if samples_per_epoch is None else samples_per_epoch
            if not isinstance(self.samples_per_epoch, int) or self.samples_per_epoch < 1:
                raise ValueError(f"samples_per_epoch must be an int >= 1, got "
                                 f"{samples_per_epoch!r}")
        self.version = 0
        self._overrides: list[tuple[int, np.ndarray]] = []
        self._frontier: weakref.WeakMethod[Any] | None = None
        # Memos: draw counts per source at chunk starts ({epoch: {chunk: counts}}, the epochs
        # last counted in), and the last chunk's draw counts at every position.
        self._checkpoints: dict[int, dict[int, np.ndarray]] = {}
        self._ranks: tuple[int, int, np.ndarray] | None = None

    def bind(self, seed: int) -> MixOrder:
        """Take the loader's seed unless one was given."""
        if self.seed is None:
            self.seed = seed
        return self

    # -- SampleOrder ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.samples_per_epoch

    @property
    def fingerprint(self) -> str:
        return (f"mix(lengths={digest(self.lengths.tolist())}, members={digest(self.members)}, "
                f"mode={self.mode}, seed={self.seed}, "
                f"samples_per_epoch={self.samples_per_epoch}, batch_size={self.batch_size}, "
                f"{self.schedule.fingerprint})")

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Indices into the sources laid end to end, at ``positions`` of ``epoch``."""
        source, sample = self.locate(epoch, positions)
        return self.offsets[source] + sample

    def locate(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, sample of that source)`` at each of ``positions`` of ``epoch``."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= self.samples_per_epoch):
            raise IndexError(f"positions must lie in [0, {self.samples_per_epoch})")
        if self.mode == "stop":
            return self._stop(epoch, pos)
        source = self.sources(epoch, pos)
        if self.mode == "replacement":
            bits = mix64_array(mix64(self._seed, epoch, _PICK), pos.astype(np.uint64))
            return source, (bits % self.lengths[source].astype(np.uint64)).astype(np.int64)
        return source, self._cycled(epoch, source, self._draw_counts(epoch, pos))

    def sources(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The source drawn at each position (``source_at`` under each step's weights)."""
        pos = np.asarray(positions, dtype=np.int64)
        keys = self._keys(self.steps(epoch, pos))
        out = np.empty_like(pos)
        key = mix64(self._seed, epoch, _SOURCE)
        for k in np.unique(keys):
            mask = keys == k
            weights = self.weights_for_key(int(k))
            out[mask] = weighted_draws(np.cumsum(weights), int(np.flatnonzero(weights)[-1]), key,
                                       pos[mask])
        return out

    def steps(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The global step of each position (0 everywhere without ``batch_size``)."""
        if self.batch_size is None:
            return np.zeros_like(positions)
        return epoch * self._steps_per_epoch(self.batch_size) + positions // self.batch_size

    def _steps_per_epoch(self, batch_size: int) -> int:
        """Global steps of an epoch (its last one may hold fewer samples)."""
        return -(-self.samples_per_epoch // batch_size)

    # -- weights ----------------------------------------------------------------------------

    def weights_at(self, step: int) -> np.ndarray:
        """The weights in force at global ``step``."""
        return self.weights_for_key(int(self._keys(np.array([step]))[0]))

    def weights_for_key(self, key: int) -> np.ndarray:
        if key < 0:
            return self._overrides[-1 - key][1]
        return self.schedule.weights(key)

    def follow(self, frontier: Callable[[], tuple[int, int] | None]) -> None:
        """Learn where delivery stands from ``frontier`` (a loader's: ``(epoch, first
        position after the last batch delivered)``), held weakly, so that ``set_weights``
        refuses a step whose samples were delivered already."""
        self._frontier = weakref.WeakMethod(frontier)

    def next_step(self) -> int | None:
        """The first global step after every batch delivered (``None``: unknown, before the
        loader that plans this order starts, or without ``batch_size``). With
        ``in_order=False`` it is past the batches delivered ahead of the frontier: steps
        before it still in flight keep the weights they were planned with."""
        reference = self._frontier
        frontier = reference() if reference is not None else None
        where = frontier() if frontier is not None else None
        if where is None or self.batch_size is None:
            return None
        epoch, position = where
        return epoch * self._steps_per_epoch(self.batch_size) - (-position // self.batch_size)

    def __getstate__(self) -> dict[str, Any]:
        """A copy follows no loader until the copied loader starts."""
        return {**self.__dict__, "_frontier": None}

    def set_weights(self, weights: Weights, step: int | None = None) -> None:
        """Use ``weights`` from global ``step`` on, replacing the schedule from there.

        Call it at the same step on every rank with the same weights, with ``step`` no earlier
        than the first step after every batch delivered (``next_step()``) and no earlier than
        the last change; ``None`` (the usual call, from a Lightning callback too): that first
        step. ``trainer.global_step`` is not that step in general: with ``in_order=False``,
        batches delivered ahead put ``next_step()`` past it (2 workers: 7 at global step 5),
        so it is refused; after a resume on another world size it counts other steps than
        the mixture's ``batch_size``. Under a process group the ranks compare their weights,
        steps and ``next_step()`` (one collective): out of order, ranks deliver different
        steps, so the first step is the latest rank's, and a step one rank delivered is
        refused on every rank.
        """
        if self.mode == "stop":
            raise ValueError("mode='stop' needs constant weights (see MixOrder); use "
                             "mode='cycle' or 'replacement' to change weights mid-run")
        if self.batch_size is None:
            raise ValueError("set_weights needs the mixture's batch_size= (samples per global "
                             "step) to place the change at a step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)
                                 or step < 0):
            raise ValueError(f"step must be an int >= 0 (the global step the weights apply "
                             f"from), got {step!r}")
        new = _checked(weights, self.lengths.size, "set_weights")
        ranks = check_same_on_every_rank(new, (step, self.next_step()))
        asked = [asked_step for asked_step, _ in ranks]
        if len(set(asked)) > 1:
            raise ValueError(f"set_weights got different steps on different ranks (by rank: "
                             f"{asked}): call it at the same step on every rank, or with no "
                             "step on every rank (the first step after every rank's batches "
                             "delivered)")
        firsts = [first for _, first in ranks if first is not None]
        first = max(firsts, default=None)
        if step is None:
            step = 0 if first is None else first
        if self._overrides and step < self._overrides[-1][0]:
            raise ValueError(f"set_weights at step {step} is earlier than the last change (step "
                             f"{self._overrides[-1][0]}): weight changes must be in step order")
        if first is not None and step < first:
            by_rank = f", next_step() by rank: {[f for _, f in ranks]}" if len(ranks) > 1 else ""
            raise ValueError(
                f"set_weights from step {step}, but samples of step {first - 1} were "
                f"delivered already (batch_size={self.batch_size} samples per step{by_rank}; "
                "with in_order=False, a batch delivered ahead of earlier ones in flight "
                "counts): a change there would not be what was trained on, nor what a resume "
                f"reads. Give a step >= {first} (mix.next_step()); after a resume on another "
                "world size, trainer.global_step counts other steps than the mixture's "
                "batch_size")
        overrides = [o for o in self._overrides if o[0] < step]
        self._use(overrides + [(step, new)], step)

    def _keys(self, steps: np.ndarray) -> np.ndarray:
        """Schedule keys (>= 0) of steps before the first change, ``-1 - i`` after change i."""
        keys = self.schedule.keys(steps)
        if self._overrides:
            starts = np.array([s for s, _ in self._overrides], dtype=np.int64)
            change = np.searchsorted(starts, steps, side="right") - 1
            keys = np.where(change >= 0, -1 - change, keys)
        return keys

    def _use(self, overrides: list[tuple[int, np.ndarray]], step: int = 0) -> None:
        """Draw with ``overrides``, which change the weights from global ``step`` on: the
        memos that counted a draw at or after ``step`` are dropped."""
        self._overrides = overrides
        kept: dict[int, dict[int, np.ndarray]] = {}
        for epoch, table in self._checkpoints.items():
            first = self._first_position(epoch, step)
            kept[epoch] = {c: v for c, v in table.items() if c << _CHUNK_BITS <= first}
        ranks = self._ranks
        if ranks is not None and min((ranks[1] + 1) << _CHUNK_BITS, self.samples_per_epoch) > \
                self._first_position(ranks[0], step):
            ranks = None
        self._checkpoints, self._ranks = kept, ranks
        self.version += 1

    def _first_position(self, epoch: int, step: int) -> int:
        """The first position of ``epoch`` at global ``step`` or later."""
        if self.batch_size is None:
            return 0
        return max(0, (step - epoch * self._steps_per_epoch(self.batch_size)) * self.batch_size)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The weight changes made with ``set_weights``, as ``[step, weights]`` pairs, and
        (``"cycle"``) the draws per source before the latest chunk start counted in each kept
        epoch, as ``[epoch, chunk, counts]``: a resume counts on from there."""
        state: dict[str, Any] = {
            "changes": [[step, weights.tolist()] for step, weights in self._overrides]}
        counts = [[epoch, max(table), table[max(table)].tolist()]
                  for epoch, table in self._checkpoints.items() if max(table, default=0) > 0]
        if counts:
            state["counts"] = counts
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the weight changes, and seed the draw counts with the saved checkpoints
        (checked for shape; a wrong count would fail the loader's audit of the resumed batch)."""
        changes, counts = state.get("changes", []), state.get("counts", [])
        for name, value in (("changes", changes), ("counts", counts)):
            if not isinstance(value, list):
                raise StateMismatchError(f"corrupted mixture state: {name!r}={value!r} is not a "
                                         "list")
        overrides: list[tuple[int, np.ndarray]] = []
        for entry in changes:
            overrides.append(self._checked_change(entry, overrides[-1][0] if overrides else -1))
        seeds = [self._checked_counts(entry) for entry in counts]
        self._use(overrides)
        self._checkpoints, self._ranks = {}, None
        if self.mode == "cycle":
            for epoch, chunk, counts in seeds[-_EPOCHS_KEPT:]:
                self._checkpoints[epoch] = {0: np.zeros_like(counts), chunk: counts}

    def _checked_change(self, entry: Any, previous: int) -> tuple[int, np.ndarray]:
        """A saved ``[step, weights]`` weight change after one at step ``previous``, or a
        ``StateMismatchError``."""
        reason = ""
        try:
            step, weights = entry
            checked = _checked(weights, self.lengths.size, f"change at step {step}")
        except (TypeError, ValueError) as exc:
            step, reason = None, f" ({exc})"
        if not isinstance(step, int) or isinstance(step, bool) or step <= previous:
            raise StateMismatchError(
                f"corrupted mixture state: weight change {entry!r} is not [step, weights] with "
                f"an int step after the previous change's ({previous}; -1: none) and one "
                f"weight >= 0 per source ({self.lengths.size}){reason}")
        return step, checked

    def _checked_counts(self, entry: Any) -> tuple[int, int, np.ndarray]:
        """A saved ``[epoch, chunk, counts]`` checkpoint, or a ``StateMismatchError``."""
        try:
            epoch, chunk, counts = entry
            array = np.asarray(counts, dtype=np.int64)
        except (TypeError, ValueError):
            epoch = chunk = None
            array = np.zeros(0, dtype=np.int64)
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(chunk, int)
                and 0 < chunk << _CHUNK_BITS < self.samples_per_epoch
                and array.shape == self.lengths.shape and (array >= 0).all()
                and int(array.sum()) == chunk << _CHUNK_BITS):
            raise StateMismatchError(
                f"corrupted mixture state: draw counts {entry!r} are not [epoch, chunk, counts] "
                f"with one count per source ({self.lengths.size}) summing to the chunk's start "
                f"(chunk * {_CHUNK}) inside the epoch ({self.samples_per_epoch} samples); save "
                "the state again, or drop its 'counts' (the resume then counts from the epoch "
                "start)")
        return epoch, chunk, array

    # -- the modes --------------------------------------------------------------------------

    @property
    def _seed(self) -> int:
        return 0 if self.seed is None else self.seed

    def _stop(self, epoch: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slot = KeyedPermutation(self.samples_per_epoch, mix64(self._seed, epoch, _STOP))[pos]
        ends = np.cumsum(self._quota)
        source = np.searchsorted(ends, slot, side="right").astype(np.int64)
        rank = slot - (ends[source] - self._quota[source])
        sample = np.empty_like(rank)
        for k in np.unique(source):
            mask = source == k
            perm = KeyedPermutation(int(self.lengths[k]), mix64(self._seed, epoch, _STOP_SOURCE,
                                                                int(k)))
            sample[mask] = perm[rank[mask]]
        return source, sample

    def _cycled(self, epoch: int, source: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Sample ``counts % n_k`` of pass ``counts // n_k`` of source ``k``'s stream."""
        passes, offsets = np.divmod(counts, self.lengths[source])
        sample = np.empty_like(counts)
        for k in np.unique(source).tolist():
            mask = source == k
            sample[mask] = self._passes(epoch, k, passes[mask], offsets[mask])
        return sample

    def _passes(self, epoch: int, k: int, passes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Element ``offsets`` of the permutations ``passes`` of source ``k``: a small source's
        permutations are sorted hashes (all passes at once), a large one's keyed bijections."""
        n = int(self.lengths[k])
        unique, row = np.unique(passes, return_inverse=True)
        if n <= _SMALL_SOURCE:
            values = (unique[:, None] * n + np.arange(n)).astype(np.uint64)
            perms = np.argsort(mix64_array(mix64(self._seed, epoch, _PASS, k), values), axis=1,
                               kind="stable")
            return perms[row.ravel(), offsets]
        out = np.empty_like(offsets)
        for i, p in enumerate(unique.tolist()):
            mask = row.ravel() == i
            out[mask] = KeyedPermutation(n, mix64(self._seed, epoch, _PASS, k, p))[offsets[mask]]
        return out

    def _draw_counts(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """For each position, how many earlier positions of the epoch drew its source."""
        out = np.empty_like(pos)
        chunks = pos >> _CHUNK_BITS
        for chunk in np.unique(chunks):
            mask = chunks == chunk
            ranks = self._chunk_ranks(epoch, int(chunk))
            out[mask] = ranks[pos[mask] - (int(chunk) << _CHUNK_BITS)]
        return out

    def _chunk_ranks(self, epoch: int, chunk: int) -> np.ndarray:
        """Draw counts at every position of ``chunk`` (the last chunk computed is kept)."""
        memo = self._ranks
        if memo is not None and memo[0] == epoch and memo[1] == chunk:
            return memo[2]
        base = self._chunk_start_counts(epoch, chunk)
        source = self._chunk_sources(epoch, chunk)
        order = np.argsort(source, kind="stable")
        group_start = np.searchsorted(source[order], source[order], side="left")
        ranks = np.empty_like(source)
        ranks[order] = np.arange(source.size) - group_start
        ranks += base[source]
        self._ranks = (epoch, chunk, ranks)
        return ranks

    def _chunk_start_counts(self, epoch: int, chunk: int) -> np.ndarray:
        """Draws per source before ``chunk``, counted from the nearest checkpoint (the epoch's
        start, or one saved in a state), forwards or backwards."""
        memos = self._checkpoints
        known = memos.get(epoch)
        if known is not None and chunk in known:
            return known[chunk]
        # Extended on copies and replaced by one assignment: a concurrent caller never sees a
        # table being extended.
        table = dict(known or {0: np.zeros(self.lengths.size, dtype=np.int64)})
        nearest = min(table, key=lambda c: (abs(c - chunk), c))
        step = 1 if nearest < chunk else -1
        for done in range(nearest, chunk, step):
            drawn = np.bincount(self._chunk_sources(epoch, min(done, done + step)),
                                minlength=self.lengths.size)
            table[done + step] = table[done] + step * drawn
        others = [(e, t) for e, t in memos.items() if e != epoch][1 - _EPOCHS_KEPT:]
        self._checkpoints = {**dict(others), epoch: table}
        return table[chunk]

    def _chunk_sources(self, epoch: int, chunk: int) -> np.ndarray:
        start = chunk << _CHUNK_BITS
        stop = min(start + _CHUNK, self.samples_per_epoch)
        return self.sources(epoch, np.arange(start, stop, dtype=np.int64))


def _stop_quota(weights: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-source counts proportional to ``weights`` (largest remainders) for the longest epoch
    that reads no source past its end."""
    share = weights / weights.sum()
    drawn = share > 0
    total = int(min(math.floor(n / s + 1e-9) for n, s in zip(lengths[drawn], share[drawn],
                                                              strict=True)))
    exact = share * total
    quota = np.floor(exact).astype(np.int64)
    remainder = exact - quota
    for k in np.argsort(-remainder, kind="stable")[: total - int(quota.sum())]:
        quota[k] += 1
    return np.minimum(quota, lengths)
