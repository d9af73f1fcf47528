"""Per-step metrics (the `[metrics]` section: runtime/metrics_config.py): `<run.dir>/metrics.jsonl` plus a
readable line, both from rank 0 only, and optionally TensorBoard event files under `<run.dir>/tb` with the
same scalars.

One JSON object per optimizer step, flushed line by line so a crash loses nothing already logged.
Non-finite floats are written as null (JSON has no NaN). The logger does no communication: the loop
passes values already reduced over ranks. `python launch/plot_metrics.py RUN_DIR ...` plots them.
"""

import json
import math
import os
import resource
import sys

import torch

# Dense bf16 tensor-core peak per GPU (vendor datasheets, SXM parts), matched by substring of the name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12, "MI300X": 1307e12,
                   "L40S": 362e12}
FIELDS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "optimizer_time_s", "memory_gib")


def peak_flops(device_name: str) -> float | None:
    """Datasheet bf16 peak of a GPU from its name (torch.cuda.get_device_name()), None if unknown."""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), None)


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a ModelConfig at `seq_len`.

    6 per active matmul parameter (Kaplan et al. 2020: 2 forward, 4 backward) plus causal attention:
    per layer and head, scores and the weighted sum cost 2*(qk + v) per key, a query sees S/2 keys on
    average, times 3 for the backward: 3 * S * (qk + v). The embedding lookup is not a matmul.
    """
    from models import count_params  # models imports are deferred: metrics must not build anything at import

    _, active = count_params(config)
    matmul_params = active - config.vocab_size * config.dim
    if config.attn == "mla":
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        qk = v = config.head_dim
    return 6.0 * matmul_params + 3.0 * config.n_layers * config.n_heads * seq_len * (qk + v)


def memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory on cuda, else the current resident set size of this process, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:  # not Linux: peak RSS instead (KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**30 if sys.platform == "darwin" else 2**20)


def _finite_or_none(value):
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Rank 0 appends to `<run_dir>/metrics.jsonl` and prints; every other rank does nothing."""

    def __init__(self, run_dir: str, rank: int, total_steps: int, *, start_step: int = 0, device="cpu",
                 flops_per_token: float | None = None, peak_flops: float | None = None, world_size: int = 1,
                 log_interval: int = 1, tensorboard: bool = False):
        """`start_step` > 0 (a resume) drops records of steps >= start_step left by the interrupted run.

        MFU is reported when both `flops_per_token` and `peak_flops` (per device) are given. The readable
        line is printed every `log_interval` steps and at the last step; the JSON line every step.
        """
        self.rank, self.total_steps, self.device = rank, total_steps, torch.device(device)
        self.log_interval = log_interval
        self.flops_per_token, self.peak_flops, self.world_size = flops_per_token, peak_flops, world_size
        self.path, self._file, self._tb = os.path.join(run_dir, "metrics.jsonl"), None, None
        if rank == 0:
            os.makedirs(run_dir, exist_ok=True)
            self._keep_steps_before(start_step)
            self._file = open(self.path, "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

                self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)

    def _keep_steps_before(self, start_step: int) -> None:
        """Drop records of steps >= start_step and a torn last line (a crash mid-write); atomic rewrite."""
        if not os.path.exists(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn by a crash while being written
                if record["step"] < start_step:
                    kept.append(json.dumps(record) + "\n")
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.path + ".tmp", self.path)

    def log(self, step: int, *, loss, grad_norm, lr, tokens: int, step_time_s: float, optimizer_time_s: float,
            **extra) -> dict | None:
        """Record optimizer step `step` (global `tokens` processed in `step_time_s`); returns the record."""
        if self._file is None:
            return None
        if extra.get("skipped"):
            print(f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; skipped", flush=True)
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "tokens_per_s": tokens / max(step_time_s, 1e-9),
                  "step_time_s": step_time_s, "optimizer_time_s": optimizer_time_s,
                  "memory_gib": memory_gib(self.device)}
        if self.flops_per_token and self.peak_flops:
            achieved = record["tokens_per_s"] * self.flops_per_token
            record["mfu"] = achieved / (self.world_size * self.peak_flops)
        record = {k: _finite_or_none(v) if isinstance(v, (float, torch.Tensor)) else v
                  for k, v in {**record, **extra}.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if step % self.log_interval == 0 or step == self.total_steps - 1:
            print(self.format(record), flush=True)
        return record

    def format(self, record: dict) -> str:
        """One readable line: step/total, loss (eval loss; post-training: RL loss, feedback KL, target tokens),
        grad norm, lr, tokens/s, step and optimizer time, memory, MFU."""
        def num(key, spec):
            return "nan" if record.get(key) is None else format(record[key], spec)

        parts = [f"step {record['step']}/{self.total_steps}", f"loss {num('loss', '.4f')}",
                 *([f"eval {num('eval_loss', '.4f')}"] if "eval_loss" in record else []),
                 *([f"rl {num('rl_loss', '.4f')}", f"kl {num('feedback_kl', '.4f')}",
                    f"targets {record.get('target_tokens')}"] if "rl_loss" in record else []),
                 f"grad {num('grad_norm', '.3f')}", f"lr {num('lr', '.2e')}", f"{num('tokens_per_s', ',.0f')} tok/s",
                 f"step {num('step_time_s', '.3f')}s", f"optim {num('optimizer_time_s', '.3f')}s",
                 f"{'max alloc' if self.device.type == 'cuda' else 'rss'} {num('memory_gib', '.2f')} GiB"]
        if "mfu" in record:
            parts.append(f"mfu {num('mfu', '.1%')}")
        return " | ".join(parts)

    def info(self, message: str) -> None:
        """A free-form line (warnings, resume notices) on rank 0's stdout."""
        if self.rank == 0:
            print(message, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
