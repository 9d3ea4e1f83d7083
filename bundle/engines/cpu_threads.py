"""The training step's intra-op thread count on a CPU: fixed, or tuned by timing the step itself."""

from __future__ import annotations


class CPUThreadTuner:
    """The intra-op thread count of each training step on a CPU.

    ``"auto"`` times the step with 1, 2, 4, ... up to ``most`` threads on the first iterations (``trials`` steps
    each, the fastest kept) and again every ``retune_every`` iterations: on a machine whose cores are shared with
    other processes, fewer threads than cores can be several times faster (OpenMP threads wait for each other at
    every operation), on an idle one they are not.

    Args:
        num_threads: None (torch's setting left alone), a positive int (that count), or ``"auto"``.
        most: the largest count tried by ``"auto"`` (the caller's ``torch.get_num_threads()``).
        trials: timed steps per count in a tuning.
        retune_every: iterations between tunings.

    Per step: :meth:`threads_for_step` gives the count to set (None: leave it), :meth:`record` takes the step's
    seconds.
    """

    def __init__(self, num_threads: int | str | None, most: int, trials: int = 1, retune_every: int = 200) -> None:
        if not (num_threads is None or num_threads == "auto" or (isinstance(num_threads, int) and num_threads >= 1)):
            raise ValueError(f"num_threads must be None, 'auto' or a positive integer, got {num_threads!r}")
        if trials < 1 or retune_every < 1:
            raise ValueError(f"trials and retune_every must be >= 1, got {trials}, {retune_every}")
        self.num_threads, self.trials, self.retune_every = num_threads, int(trials), int(retune_every)
        auto = num_threads == "auto"
        self.candidates = sorted({min(2**k, most) for k in range(most.bit_length() + 1)}) if auto else []
        self.threads_chosen: int | None = num_threads if isinstance(num_threads, int) else None
        self.timings: dict[int, float] = {}  # seconds per thread count in the current (or last) tuning
        self._calls = 0
        self._trial = False

    def threads_for_step(self) -> int | None:
        """The thread count of this step: a fixed one, the warm-up (first call, untimed, the largest count), a
        trial of the tuning phase, or the one chosen."""
        self._trial = False
        if self.num_threads != "auto":
            return self.threads_chosen
        if self._calls == 0:
            return self.candidates[-1]
        phase = (self._calls - 1) % self.retune_every
        n_trials = len(self.candidates) * self.trials
        if phase < n_trials:
            if phase == 0:
                self.timings = {}
            self._trial = True
            return self.candidates[phase // self.trials]
        if phase == n_trials or self.threads_chosen is None:
            self.threads_chosen = min(self.timings, key=self.timings.get)
        return self.threads_chosen

    def record(self, threads: int | None, seconds: float) -> None:
        """The step just run with ``threads`` took ``seconds``: kept when it was a trial (``"auto"`` only)."""
        if self.num_threads != "auto":
            return
        if self._trial:
            self.timings[threads] = min(seconds, self.timings.get(threads, float("inf")))
        self._calls += 1
