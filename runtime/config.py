"""The job configuration: a frozen dataclass tree, one section per component, and what the job derives from it
(the layout for a world size, the token batches it reads). runtime/config_parser.py reads it from TOML and
`--section.key=value` and writes its --help.

Sections and where each one's dataclass lives (next to the component it configures):
  [run]       RunConfig       here                    [data]       DataConfig       runtime/data/config.py
  [model]     preset + any ModelConfig field          [training]   TrainingConfig   here
  [parallel]  ParallelConfig  parallel/layout.py      [checkpoint] CheckpointConfig runtime/checkpoint/dirs.py
  [optim]     OptimConfig     optim/config.py         [profile]    ProfileConfig    here
  [eval]      EvalConfig      runtime/eval_config.py  [metrics]    MetricsConfig    runtime/metrics_config.py
  [comm]      CommConfig      runtime/comm_config.py  [posttrain]  PosttrainConfig  runtime/posttrain/config.py
None of these modules imports torch (the model's config reads only models/config.py, presets.py and
models/hf/config.py): entry points check a config before torch loads (launch/precheck.py).
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from models import ModelConfig, preset
from optim.config import OptimConfig
from parallel.layout import DENSE_AXES, EXPERT_AXES, Layout, ParallelConfig
from runtime.checkpoint.dirs import CheckpointConfig
from runtime.comm_config import CommConfig
from runtime.data.config import DataConfig, check_split
from runtime.data.keys import unused_keys
from runtime.eval_config import EvalConfig
from runtime.metrics_config import MetricsConfig
from runtime.posttrain.config import PosttrainConfig

DEFAULT_PRESET = "debug"
NO_PRESET = "none"  # model.preset=none: no preset, the shape comes from posttrain.init_from / model.init_from
HEADLINE_WORLD_SIZE = 8  # dense dp_shard=4 x cp=2, expert ep=8: CP and EP overlap on the same 8 ranks


class ConfigError(ValueError):
    """A user error in the configuration; the message is one line starting with the dotted key."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    dir: str = "runs/debug"  # run directory: metrics.jsonl, checkpoints/ (a run resumes from the newest), traces

    def __post_init__(self):
        if not self.dir.strip():
            raise ValueError("run.dir must not be empty")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    steps: int = 300  # optimizer steps of the whole run (a resumed run continues up to this total)
    seed: int = 0  # seeds weight init and the data order: same seed, same run, whatever the layout
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # FSDP all-gathers weights in this dtype and computes in it (master weights, optimizer state: float32; router: float32)
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # FSDP reduce-scatters / all-reduces gradients in this dtype
    activation_checkpoint: Literal["none", "full", "selective"] = "none"  # recompute in backward: full = every block, selective = attention and routed experts (parallel/activation_checkpoint.py)
    compile: Literal["auto", "true", "false"] = "auto"  # torch.compile(fullgraph) every block's regions (parallel/compile.py); auto = true on cuda when nothing refuses it, false on cpu
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"  # compiler backend; aot_eager = traced but not fused (bit-exact with eager; the CPU test backend)
    grad_clip: float = 1.0  # max global gradient norm over both meshes (0 = no clipping)
    warmup_steps: int = 20  # linear warmup steps from optim.lr/warmup_steps up to optim.lr
    schedule: Literal["cosine", "wsd"] = "cosine"  # after warmup: cosine decay, or warmup-stable-decay
    min_lr_ratio: float = 0.1  # lr at the last step, as a fraction of optim.lr
    decay_fraction: float = 0.2  # wsd: fraction of all steps spent decaying, at the end
    grad_accum: int = 1  # micro-batches per optimizer step (data.batch_size is split into them)
    grad_sync: Literal["every", "replicas_last", "last"] = "every"  # when grad_accum reduces grads (parallel/overlap.py)
    fsdp_prefetch: int = 0  # FSDP units all-gathered ahead on both meshes (0 = FSDP2's implicit prefetch)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda (nccl) if available, else cpu (gloo)
    log_interval: int = 1  # print a log line every N steps (metrics.jsonl gets every step)
    max_nonfinite_steps: int = 10  # stop (exit 3) after this many consecutive non-finite steps (0 = never)
    max_nonfinite_fraction: float = 0.25  # also stop once >= max_nonfinite_steps steps, over this fraction, were skipped

    def __post_init__(self):
        checks = {"steps": (self.steps >= 1, ">= 1"), "seed": (self.seed >= 0, ">= 0"),
                  "grad_clip": (self.grad_clip >= 0, ">= 0"),
                  "warmup_steps": (self.warmup_steps >= 0, ">= 0"),  # > steps is fine: a short run only warms up
                  "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                  "decay_fraction": (0 <= self.decay_fraction <= 1, "in [0, 1]"),
                  "grad_accum": (self.grad_accum >= 1, ">= 1"), "fsdp_prefetch": (self.fsdp_prefetch >= 0, ">= 0"),
                  "log_interval": (self.log_interval >= 1, ">= 1"),
                  "max_nonfinite_steps": (self.max_nonfinite_steps >= 0, ">= 0"),
                  "max_nonfinite_fraction": (0 < self.max_nonfinite_fraction <= 1, "in (0, 1]")}
        for key, (ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"training.{key}={getattr(self, key)} must be {expected}")

    def device_type(self) -> str:
        """"cuda" or "cpu" (resolves "auto")."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    enabled: bool = False  # write a torch.profiler trace of the chosen steps
    steps: tuple[int, ...] = (3, 4)  # optimizer steps of the run to trace (0-based, consecutive; a resumed run traces those ahead)
    dir: str = "profile"  # trace directory, relative to run.dir

    def __post_init__(self):
        steps = ",".join(map(str, self.steps))
        if self.steps and self.steps != tuple(range(self.steps[0], self.steps[0] + len(self.steps))):
            raise ValueError(f"profile.steps={steps} must be consecutive and increasing, e.g. 3,4")
        if self.steps and self.steps[0] < 0:
            raise ValueError(f"profile.steps={steps} must be >= 0")
        if self.enabled and not self.steps:
            raise ValueError("profile.steps is empty but profile.enabled=true: list the steps to trace, e.g. 3,4")


# The embedded default infers every degree: the headline layout on 8 ranks, see `default_layout`.
INFER_ALL = ParallelConfig(dp_replicate=-1, dp_shard=-1, cp=-1, ep=-1, edp_replicate=-1, edp_shard=-1)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model_preset: str = DEFAULT_PRESET  # [model] preset
    model_init_from: str = ""  # [model] init_from: a Hugging Face DeepSeek-V3 directory (shape and weights)
    model: ModelConfig = field(default_factory=lambda: preset(DEFAULT_PRESET))  # the preset + [model] overrides
    parallel: ParallelConfig = INFER_ALL
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    posttrain: PosttrainConfig = field(default_factory=PosttrainConfig)  # launch/posttrain.py only
    comm: CommConfig = field(default_factory=CommConfig)  # timeouts, flight recorder, heartbeat (runtime/comm.py)

    def __post_init__(self):
        if self.profile.enabled and self.profile.steps[-1] >= self.training.steps:
            raise ConfigError(f"profile.steps={','.join(map(str, self.profile.steps))} but training.steps="
                              f"{self.training.steps}: the last step is {self.training.steps - 1} (0-based)")
        if unused := unused_keys(self.data, self.eval):
            raise ConfigError("; ".join(unused))
        if self.data.source == "rollouts" and (unread := self.posttrain.unread(self.model.vocab_size)):
            raise ConfigError("; ".join(unread))
        if self.metrics.max_logit and self.optim.qk_clip_tau > 0:
            raise ConfigError(f"metrics.max_logit=true has no effect with optim.qk_clip_tau={self.optim.qk_clip_tau}: "
                              f"QK-clip records max_logit already")

    def token_splits(self) -> dict[str, tuple[DataConfig, float, str]]:
        """{split: (data config, holdout, the key naming its file)} of the token batches the run reads
        (data.seq_len x data.batch_size): "train" unless it post-trains on rollouts; "eval" when evaluation
        is on (with rollouts: eval.path only; a mixture without eval.path: "eval/<name>" per source). runtime/train.py builds its token loaders from it; launch/
        checks them before any rank works."""
        splits = {}
        if self.data.source != "rollouts":
            splits["train"] = (self.data, self.eval.train_holdout(), "data.path")
        splits.update(self.eval.held_out_splits(self.data))
        return splits

    def layout(self, world_size: int) -> Layout:
        """The resolved layout for `world_size` with the run's checkpointing and compile settings, checked
        against model, batch and grad_accum, the EP refusals among them (ConfigError)."""
        t = self.training
        rollouts = self.data.source == "rollouts"
        compile = "false" if rollouts and t.compile == "auto" else t.compile  # post-training runs eager
        try:
            n_experts = self.model.n_routed_experts if self.model.n_moe_layers > 0 else 0
            layout = fill_layout(self.parallel, world_size, n_experts).resolve(
                world_size, activation_checkpoint=t.activation_checkpoint, compile=compile,
                compile_backend=t.compile_backend)
            splits = self.token_splits()  # none: rollouts are packed by data.batch_tokens, data.seq_len is unused
            for data, *_ in splits.values():
                check_split(data, layout.dp, layout.cp, t.grad_accum)  # names the data.* keys
            shape = (self.data.seq_len, self.data.batch_size) if splits else (None, None)
            layout.validate(self.model, *shape, t.grad_accum)  # and the EP refusals, once (parallel/ep/refusals.py)
            self._check_pipeline(layout)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return layout

    def _check_pipeline(self, layout: Layout) -> None:
        """ValueError (one line) for pipeline parallelism with what the job does beyond the layout
        (the layout's own refusals: parallel/pp/plan.py, run by `Layout.validate`)."""
        if layout.pp == 1:
            return
        t, pp = self.training, f"parallel.pp={layout.pp}"
        if self.data.source == "rollouts":
            raise ValueError(f"{pp} with post-training (data.source='rollouts'): not composed yet; post-train with "
                             f"parallel.pp=1 (a pipelined run's checkpoints load under any layout)")
        if any(data.document_mask for data, *_ in self.token_splits().values()):
            raise ValueError(f"{pp} with data.document_mask=true: not composed yet; use parallel.pp=1 or "
                             f"data.document_mask=false")
        if t.grad_sync != "every":
            raise ValueError(f"training.grad_sync={t.grad_sync!r} with {pp}: the schedule reduces each stage's "
                             f"gradients once per step already; leave it at 'every'")

    def to_dict(self) -> dict:
        """Plain nested dict (for logging the resolved config next to the run)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def default_layout(world_size: int, n_experts: int = 0) -> ParallelConfig:
    """The layout of the embedded default: the headline dp_shard=4 x cp=2 | ep=8 on 8 ranks; otherwise
    FSDP over all ranks (cp=1) and the widest ep that divides both the world size and the expert count."""
    cp = 2 if world_size == HEADLINE_WORLD_SIZE else 1
    ep = math.gcd(world_size, n_experts) if n_experts else 1
    return ParallelConfig(dp_replicate=1, dp_shard=world_size // cp, cp=cp,
                          ep=ep, edp_replicate=1, edp_shard=world_size // ep)


def fill_layout(parallel: ParallelConfig, world_size: int, n_experts: int = 0) -> ParallelConfig:
    """Leave at most one -1 per layout, for `ParallelConfig.resolve` to infer (the shard degree when it is
    unknown): extra -1 degrees are filled from `default_layout`, replicate first, then cp / ep (1 if the
    default would not divide the world size)."""
    parallel.check_degrees()  # before the arithmetic below divides by them
    if world_size % parallel.pp:
        raise ValueError(f"parallel.pp={parallel.pp} does not divide the world size {world_size}")
    world_size //= parallel.pp  # both layouts fill one pipeline stage
    default, values = default_layout(world_size, n_experts), dataclasses.asdict(parallel)
    for axes, fill_order in ((DENSE_AXES, ("dp_replicate", "cp")), (EXPERT_AXES, ("edp_replicate", "ep"))):
        for axis in fill_order:
            unknown = [a for a in axes if values[a] == -1]
            if values[axis] == -1 and len(unknown) > 1:
                known = math.prod(values[a] for a in axes if values[a] != -1)
                guess = getattr(default, axis)
                values[axis] = guess if world_size % (known * guess) == 0 else 1
    return ParallelConfig(**values)
