"""How deep a step's drafts go: the depth that maximizes the expected tokens per second, from the measured time of
decode and verification steps by their number of tokens and the measured acceptance of each draft position. While a
step is bound by reading the weights, more tokens cost little and drafts go deep; once it is bound by compute (a
large batch, a slow or busy CPU) every token costs its share and drafts get shallow or vanish."""
from __future__ import annotations

_SMOOTHING = 0.2  # weight of a new step time in its size's moving average
_EXPLORE_EVERY = 16  # steps between two that keep every draft (and, halfway between, two that keep none while
# drafts only promise a little more), so that both ends keep being measured as contexts grow: otherwise the size
# not chosen keeps its early, shorter-context time
_RECHECK_BELOW = 1.5  # drafts promising less than this over plain decoding have the plain step re-measured
_MIN_GAIN = 1.05  # drafts must promise this much more than plain decoding: step times are noisy estimates, and a
# draft costs proposing and bookkeeping beyond the forward


class StepTimes:
    """Moving averages of the seconds a decode or verification step takes, by its number of tokens."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else old + _SMOOTHING * (seconds - old)

    def estimate(self, tokens: int) -> float | None:
        """Seconds for a step of `tokens`: measured, or on the line through the nearest measured sizes (never below
        the smallest measured step); None until two sizes are known."""
        if tokens in self.seconds:
            return self.seconds[tokens]
        known = sorted(self.seconds)
        if len(known) < 2:
            return None
        below = [t for t in known if t < tokens][-2:]
        above = [t for t in known if t > tokens][:2]
        a, b = (below[-1], above[0]) if below and above else ((below or above)[0], (below or above)[-1])
        if a == b:
            a, b = known[0], known[-1]
        slope = (self.seconds[b] - self.seconds[a]) / (b - a)
        return max(self.seconds[a] + slope * (tokens - a), self.seconds[known[0]])


class DraftDepth:
    """Chooses the depth of each step's drafts from StepTimes and the acceptance by position."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self.drafted: list[int] = []  # by position: drafts that had a token there
        self.accepted: list[int] = []  # by position: drafts whose token there was accepted
        self._steps = 0

    def record(self, drafted: int, accepted: int) -> None:
        for counts, n in ((self.drafted, drafted), (self.accepted, accepted)):
            if len(counts) < n:
                counts += [0] * (n - len(counts))
            for position in range(n):
                counts[position] += 1

    def acceptance(self, position: int) -> float:
        """The chance that a draft's token at `position` is accepted, and so every token before it, among drafts
        that reach that position; with a prior of one accepted and one rejected draft."""
        drafted = self.drafted[position] if position < len(self.drafted) else 0
        accepted = self.accepted[position] if position < len(self.accepted) else 0
        return (accepted + 1) / (drafted + 2)

    def choose(self, num_decodes: int, lengths: list[int], seconds_per_depth: float = 0.0,
               room: int | None = None) -> int:
        """The draft depth (the most draft tokens per request) for a step of `num_decodes` decodes whose proposals
        have `lengths`: every depth up to the longest is weighed, expected tokens over estimated seconds (with
        `seconds_per_depth` for each draft position, a draft model's pass). `room`: the draft tokens the step can
        hold, filled nearest positions first (as `within_budget` cuts), so that each depth is weighed at the size
        its step will have."""
        self._steps += 1
        deepest = max(lengths, default=0)
        if deepest == 0 or self._steps % _EXPLORE_EVERY == 0:
            return deepest
        left = sum(lengths) if room is None else room
        best_depth, best_rate, plain_rate = deepest, -1.0, 0.0
        expected, tokens = float(num_decodes), num_decodes
        for depth in range(deepest + 1):
            if depth:
                reaching = min(sum(1 for n in lengths if n >= depth), left)
                left -= reaching
                expected += reaching * self.acceptance(depth - 1)
                tokens += reaching
            seconds = self.times.estimate(tokens)
            if seconds is None:  # not measured yet: keep every draft, and measure
                return deepest
            seconds += depth * seconds_per_depth
            rate = expected / seconds if depth else expected / seconds * _MIN_GAIN
            plain_rate = plain_rate or expected / seconds
            if rate > best_rate:
                best_depth, best_rate = depth, rate
            if not left:
                break  # deeper drafts would be cut to this very step
        if best_depth and self._steps % _EXPLORE_EVERY == _EXPLORE_EVERY // 2 \
                and best_rate < _RECHECK_BELOW * plain_rate:
            return 0
        return best_depth
