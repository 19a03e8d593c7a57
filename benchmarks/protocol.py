"""How lightning_regions measures time: one protocol for the demo, ``benchmarks/`` and
``make gpu-check``.

- **Warm-up excluded.** Steady steps start after ``WARMUP_STEPS`` warm steps (and after any
  compile): the first steps of a compiled model still allocate and autotune.
- **Rounds, interleaved.** Where variants are compared, each round runs every variant for
  a few steps in turn (``interleave``), so that a slow stretch of the machine falls on all
  of them, not on whichever ran then.
- **The statistic: the median of per-round medians** (``estimate``). A stall on a busy
  machine (an OpenMP thread descheduled at its barrier: 1.75 s steps among 30 ms ones)
  comes in stretches of consecutive steps. It can take over one round's median, but it
  moves the median of the rounds only when more than half the rounds are mostly stalled;
  ``STALL_BOUND`` is the bound the tests hold it to. The spread, the interquartile range
  of the round medians over their median, is reported beside it (one odd round does not
  widen it), and the uncertainty of the median from it (``Estimate.uncertainty``).
- **Ratios from paired rounds** (``paired_ratio``): a comparison is the median over
  rounds of each round's ratio, so that a slow stretch of the machine (on this VM, steps
  of one variant drift by 20% over seconds with nothing else running) cancels within the
  round that saw it. Rounds are short (a few steps per variant) for the same reason.
- **CPU time beside wall time** (``CpuClock``): this process and all its children,
  inductor's compile workers and the g++ they run included, live or finished. Unlike wall
  time it hardly moves when another program takes cores.
- **Threads stated** (``torch.get_num_threads()`` beside each figure); a single-thread
  run where a ratio is the point, since one thread does not wait at a barrier for a
  descheduled sibling.
- **A disturbed measurement says so** (``disturbance``): other programs' CPU use during
  the measurement (from ``/proc/stat``, this process tree's own use taken out) above
  ``BUSY_CORES``, or an uncertainty above ``UNCERTAINTY_LIMIT``, is named instead of
  printing a ratio as if it were good.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Warm steps before any timed one.
WARMUP_STEPS = 3
#: Other programs using more than this many cores make a measurement disturbed.
BUSY_CORES = 0.25
#: An estimate whose median is uncertain by more than this (relative) is disturbed. Set
#: from the demo's measurement on this kind of machine (``benchmarks/demo_noise.py``):
#: idle runs reach +-7%, runs beside a CPU-bound load +-16% and more.
UNCERTAINTY_LIMIT = 0.10
#: McGill, Tukey and Larsen's notch: median +- 1.57 IQR / sqrt(n) covers the true median
#: about 95% of the time.
NOTCH = 1.57
#: The most a stall may move the reported figure, relative, while fewer than half the
#: rounds are mostly stalled (held by tests/test_protocol.py on recorded series).
STALL_BOUND = 0.10


@dataclass(frozen=True)
class Estimate:
    """A steady-state figure: the median of per-round values (round medians of step
    seconds, or per-round ratios)."""

    value: float
    round_medians: tuple[float, ...]
    samples: int

    @property
    def spread(self) -> float:
        """The interquartile range of the round medians over their median (max - min
        with fewer than 4 rounds)."""
        medians = sorted(self.round_medians)
        if len(medians) < 4:
            return (medians[-1] - medians[0]) / self.value
        first, _, third = statistics.quantiles(medians, n=4)
        return (third - first) / self.value

    @property
    def uncertainty(self) -> float:
        """How far the median may be off, relative: the notch half-width over the median
        (the whole max - min range with fewer than 4 rounds)."""
        if len(self.round_medians) < 4:
            return self.spread
        return NOTCH * self.spread / len(self.round_medians) ** 0.5

    @property
    def steady(self) -> bool:
        return self.uncertainty <= UNCERTAINTY_LIMIT

    def ms(self) -> str:
        return f"{1000 * self.value:.1f} ms"

    def __str__(self) -> str:
        return (
            f"{self.ms()} (median of {len(self.round_medians)} round medians, "
            f"{self.samples} steps, spread {100 * self.spread:.0f}%, "
            f"+-{100 * self.uncertainty:.1f}%)"
        )


def estimate(rounds: Sequence[Sequence[float]]) -> Estimate:
    """The protocol's statistic over ``rounds`` of step times (seconds)."""
    medians = tuple(statistics.median(times) for times in rounds if times)
    if not medians:
        raise ValueError("no timed steps to estimate from")
    return Estimate(statistics.median(medians), medians, sum(len(times) for times in rounds))


def paired_ratio(
    rounds: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]
) -> Estimate:
    """``rounds`` against ``reference``, timed in the same interleaved rounds: the median
    over rounds of each round's ratio of medians."""
    ratios = tuple(
        statistics.median(times) / statistics.median(base)
        for times, base in zip(rounds, reference, strict=True)
        if times and base
    )
    if not ratios:
        raise ValueError("no paired rounds to compare")
    return Estimate(statistics.median(ratios), ratios, sum(len(times) for times in rounds))


def split_rounds(
    times: Sequence[float], rounds: int, warmup: int = WARMUP_STEPS
) -> list[list[float]]:
    """One series of step times as ``rounds`` consecutive rounds after ``warmup`` steps
    (for a single run; comparisons should ``interleave`` instead)."""
    timed = list(times[warmup:])
    size = max(1, len(timed) // rounds)
    return [timed[i * size : (i + 1) * size] for i in range(rounds) if timed[i * size :]]


def interleave(
    variants: dict[str, Callable[[], None]], rounds: int, steps: int, clock: Callable[[], None]
) -> dict[str, list[list[float]]]:
    """Step every variant ``steps`` times per round, in turn, for ``rounds`` rounds;
    ``clock`` is called before each timer read (a device synchronize). The step times."""
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, step in variants.items():
            round_times = []
            for _ in range(steps):
                clock()
                start = time.perf_counter()
                step()
                clock()
                round_times.append(time.perf_counter() - start)
            times[name].append(round_times)
    return times


class CpuClock:
    """CPU seconds (user + system) of this process and all its children, live or
    finished, since the clock was made."""

    def __init__(self) -> None:
        self.start = tree_cpu_seconds()

    def seconds(self) -> float:
        return tree_cpu_seconds() - self.start


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, its finished children (``RUSAGE_CHILDREN``) and its
    live children with what they reaped (psutil, where installed)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    try:
        import psutil
    except ImportError:
        return total
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # it ended meanwhile: RUSAGE_CHILDREN has it, or will
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def earliest_with_extra_cpu(
    eager_cpu: float, eager_wall: float, eager_at: float, extra_cpu: float, cores: int
) -> float:
    """The earliest a run that spends ``extra_cpu`` CPU seconds beyond eager's (a compile)
    could reach the step eager reached at ``eager_at`` seconds, on ``cores`` cores, where
    eager's whole run took ``eager_cpu`` CPU seconds in ``eager_wall``: the cores eager
    left idle absorb what they can, the rest is spread over every core (each step's own
    work as eager's)."""
    idle = max(0.0, cores * eager_wall - eager_cpu)
    return eager_at + max(0.0, extra_cpu - idle) / cores


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (``/proc/stat``), or None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How many cores other programs used while this one was measured: the machine's busy
    CPU time less this process tree's, over the wall time."""

    def __init__(self) -> None:
        self.machine = busy_cpu_seconds()
        self.own = CpuClock()
        self.wall = time.perf_counter()

    def cores(self) -> float | None:
        now = busy_cpu_seconds()
        wall = time.perf_counter() - self.wall
        if now is None or self.machine is None or wall <= 0:
            return None
        return max(0.0, (now - self.machine - self.own.seconds()) / wall)


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def disturbance(
    other_cores: Sequence[float | None] = (), uncertainties: Sequence[float] = ()
) -> str | None:
    """Why a measurement is not to be trusted as it is, or None: other programs used
    cores meanwhile, or a median too uncertain (``Estimate.uncertainty`` of each)."""
    reasons = []
    busy = [cores for cores in other_cores if cores is not None and cores > BUSY_CORES]
    if busy:
        average = load_average()
        load = f", load average {average:.1f}" if average is not None else ""
        reasons.append(
            f"other programs used up to {max(busy):.1f} of {os.cpu_count()} cores meanwhile{load}"
        )
    wide = [value for value in uncertainties if value > UNCERTAINTY_LIMIT]
    if wide:
        reasons.append(
            f"rounds too scattered: a median uncertain by up to +-{100 * max(wide):.0f}% "
            f"(limit {100 * UNCERTAINTY_LIMIT:.0f}%)"
        )
    return "; ".join(reasons) or None
