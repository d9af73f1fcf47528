"""The `[comm]` section: collective timeouts, the flight recorder and the heartbeat (no torch: the config
tree imports it; runtime/comm.py applies it)."""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    init_timeout_s: float = 1800.0  # collectives before the first step ends (communicator set-up, resume, first step)
    train_timeout_s: float = 300.0  # every training collective after the first step: a rank stuck longer ends the run (exit 4) with a report
    checkpoint_timeout_s: float = 3600.0  # checkpoint coordination (its own gloo group): a slow write of tens of GiB must not end the run
    trace_entries: int = 2000  # collectives torch's flight recorder keeps per rank, dumped to run.dir/comm_traces on a timeout (0 = off)
    heartbeat: bool = True  # every rank rewrites run.dir/heartbeat/rank_<r> after each step

    def __post_init__(self):
        for key in ("init_timeout_s", "train_timeout_s", "checkpoint_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"comm.{key}={getattr(self, key)} must be > 0 seconds")
        if self.trace_entries < 0:
            raise ValueError(f"comm.trace_entries={self.trace_entries} must be >= 0")
