"""The job configuration: a frozen dataclass tree read from TOML, overridden by `--section.key=value`.

Sections and where each one's dataclass lives (next to the component it configures):
  [run]       RunConfig       here                    [data]       DataConfig       runtime/data/config.py
  [model]     preset + any ModelConfig field          [training]   TrainingConfig   here
  [parallel]  ParallelConfig  parallel/layout.py      [checkpoint] CheckpointConfig runtime/checkpoint/dirs.py
  [optim]     OptimConfig     optim/config.py         [profile]    ProfileConfig    here
  [eval]      EvalConfig      runtime/eval_config.py  [metrics]    MetricsConfig    runtime/metrics_config.py
  [comm]      CommConfig      runtime/comm_config.py  [posttrain]  PosttrainConfig  runtime/posttrain/config.py
None of these modules imports torch (the model's config reads only models/config.py, presets.py and
models/hf/config.py): entry points check a config before torch loads (launch/precheck.py).

Precedence: section defaults (the embedded debug job, = configs/debug.toml) < the TOML file given with
`--config` < command-line overrides. Values are checked against the field's annotation (int, float,
bool, str, Literal choices, tuple[...]); every error is a `ConfigError` whose one line starts with
the dotted key. The help for each key is the comment after its field (or `metadata={"help": ...}`).
"""

import ast
import dataclasses
import inspect
import io
import math
import textwrap
import tokenize
import typing
from dataclasses import dataclass, field
from typing import Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from models import PRESETS, ModelConfig, preset
from models.hf.config import read_hf_config
from optim.config import OptimConfig
from parallel.ep.config import REMOVED_EP_KNOBS
from parallel.layout import DENSE_AXES, EXPERT_AXES, Layout, ParallelConfig
from runtime.posttrain import init_source
from runtime.checkpoint.dirs import CheckpointConfig
from runtime.comm_config import CommConfig
from runtime.data.config import DataConfig, check_split
from runtime.data.keys import unused_keys
from runtime.eval_config import EvalConfig
from runtime.metrics_config import MetricsConfig
from runtime.posttrain.config import PosttrainConfig

DEFAULT_PRESET = "debug"
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


# ---- reading TOML and the command line ----------------------------------------------------------

def _sections() -> dict[str, type]:
    return {"run": RunConfig, "model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig,
            "data": DataConfig, "training": TrainingConfig, "checkpoint": CheckpointConfig, "eval": EvalConfig,
            "metrics": MetricsConfig, "profile": ProfileConfig, "posttrain": PosttrainConfig, "comm": CommConfig}


def _key_types(section: str, cls: type) -> dict[str, object]:
    types = typing.get_type_hints(cls)
    keys = {f.name: types[f.name] for f in dataclasses.fields(cls)}
    return {"preset": str, "init_from": str, **keys} if section == "model" else keys


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return tp.__name__


def _coerce(value, tp, key: str, from_text: bool):
    """`value` (TOML value, or command-line text when `from_text`) as type `tp`, else ConfigError."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _coerce_table(value, tp, key, from_text)
    if origin is tuple:
        if from_text:
            inner = value.strip().strip("[]()")
            value = [v.strip() for v in inner.split(",")] if inner.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        inner = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(inner):
            return tuple(_coerce(v, inner, f"{key}[{i}]", from_text) for i, v in enumerate(value))
        return tuple(_coerce(v, inner, key, from_text) for v in value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and str(value).lower() in choices:  # TOML `compile = true` is "true"
            value = str(value).lower()
        if value not in choices:
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return value
    try:
        return _scalar(value, tp, from_text)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {'a finite ' if tp is float else ''}{_type_name(tp)}, "
                          f"got {value!r}") from None


def _coerce_table(value, cls, key: str, from_text: bool):
    """One TOML table of an array of tables (e.g. `[[data.sources]]`) as the dataclass `cls`."""
    if from_text:
        raise ConfigError(f"{key}: give it as [[{key.split('[')[0]}]] tables in the --config TOML file")
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table of {', '.join(f.name for f in dataclasses.fields(cls))}, "
                          f"got {value!r}")
    types = typing.get_type_hints(cls)
    for name in value:
        if name not in types:
            raise ConfigError(f"{key}.{name}: unknown key (valid: {', '.join(types)})")
    return cls(**{name: _coerce(v, types[name], f"{key}.{name}", False) for name, v in value.items()})


def _scalar(value, tp, from_text: bool):
    """int, float, bool or str from command-line text or a TOML value; TypeError/ValueError if it is not one."""
    if from_text and tp is bool:
        if value.lower() not in ("true", "false"):
            raise ValueError(value)
        return value.lower() == "true"
    if from_text:
        return _finite(tp(value))  # int("abc") and float("x") raise ValueError
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {bool: isinstance(value, bool), int: is_number and isinstance(value, int), float: is_number,
          str: isinstance(value, str)}[tp]
    if not ok:
        raise TypeError(value)
    return _finite(tp(value))


def _finite(value):
    """No knob takes inf or nan: they pass range checks like `x >= 0` and poison the run."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(value)
    return value


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None


def _parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """(config path or None, [(dotted key, text)]) from `--config PATH` and `--section.key=value`."""
    path, overrides, args = None, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--config" and args:
            path = args.pop(0)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("--") and "=" in arg and "." in arg.split("=", 1)[0]:
            overrides.append(tuple(arg[2:].split("=", 1)))
        else:
            raise ConfigError(f"{arg}: expected --config PATH or --section.key=value (see --help)")
    return path, overrides


def _collect(toml: dict, overrides: list[tuple[str, str]], sections: dict) -> dict[str, dict]:
    """Typed values per section: the TOML file's, then the command line's on top."""
    values = {name: {} for name in sections}
    for section, table in toml.items():
        if section not in sections or not isinstance(table, dict):
            raise ConfigError(f"{section}: unknown section (valid: {', '.join(sections)})")
        for key, value in table.items():
            values[section][key] = _coerce(value, _lookup(sections, section, key), f"{section}.{key}", False)
    for dotted, text in overrides:
        section, _, key = dotted.partition(".")
        if section not in sections:
            raise ConfigError(f"{dotted}: unknown section {section!r} (valid: {', '.join(sections)})")
        values[section][key] = _coerce(text, _lookup(sections, section, key), dotted, True)
    return values


MOVED_KEYS = {"optim.ranks_per_node": "parallel.ranks_per_node"}  # old dotted key -> its new home


def _lookup(sections: dict, section: str, key: str):
    if f"{section}.{key}" in MOVED_KEYS:
        raise ConfigError(f"{section}.{key}: moved to {MOVED_KEYS[f'{section}.{key}']} (one node size for the "
                          f"whole job: the optimizer plan and the EP dispatch read it)")
    if section == "parallel" and key in REMOVED_EP_KNOBS:
        raise ConfigError(f"parallel.{key}: {REMOVED_EP_KNOBS[key]}")
    types = _key_types(section, sections[section])
    if key not in types:
        raise ConfigError(f"{section}.{key}: unknown key (valid: {', '.join(types)})")
    return types[key]


def _build(values: dict[str, dict]) -> JobConfig:
    defaults, built = JobConfig(), {}
    overrides = dict(values.pop("model"))
    given_preset = overrides.get("preset")
    name = overrides.pop("preset", defaults.model_preset)
    init_from = overrides.pop("init_from", "")
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (valid: {', '.join(PRESETS)})")
    for section, section_values in values.items():
        built[section] = _construct(section, lambda: dataclasses.replace(getattr(defaults, section), **section_values))
    if built["posttrain"].init_from and built["data"].source == "rollouts":  # post-training: the model's shape
        # (and, for a Hugging Face dir, the weights) come from there; launch/pretrain.py refuses the key
        built["model"], init_from = _posttrain_model(built["posttrain"].init_from, init_from, given_preset, overrides)
        return JobConfig(model_preset=name, model_init_from=init_from, **built)
    built["model"] = _construct("model", lambda: _model_config(name, init_from, overrides))
    return JobConfig(model_preset=name, model_init_from=init_from, **built)


def _model_config(name: str, init_from: str, overrides: dict) -> ModelConfig:
    """The preset with overrides, or, with init_from, the checkpoint's config.json with overrides."""
    if not init_from:
        return preset(name, **overrides)
    try:
        base, _ = read_hf_config(init_from)
    except ValueError as e:
        raise ValueError(f"model.init_from: {e}") from None
    return dataclasses.replace(base, **overrides)


def _posttrain_model(path: str, model_init_from: str, given_preset, overrides: dict) -> tuple[ModelConfig, str]:
    """(model config, model.init_from) when posttrain.init_from is given (runtime/posttrain/init_source.py)."""
    if model_init_from:
        raise ConfigError(f"model.init_from={model_init_from} and posttrain.init_from={path}: give one (both name "
                          f"the starting weights)")
    try:
        return init_source.model_config(path, given_preset, overrides), path if init_source.kind(path) == "hf" else ""
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _construct(section: str, make):
    """Run a section constructor, turning its validation ValueError into a ConfigError on the section."""
    try:
        return make()
    except ValueError as e:
        message = str(e).replace("ModelConfig.", "model.")
        raise ConfigError(message if message.startswith(section + ".") else f"{section}: {message}") from None


def load_config(argv: list[str], *, path_source: str = "bin") -> JobConfig:
    """The job config from `--config PATH` (optional) and `--section.key=value` overrides.

    Raises ConfigError (one line, naming the dotted key) on any unknown key, wrong type or invalid value.
    `--help` is not handled here: the entry point prints `help_text()` when it sees it.
    `path_source`: the data.source that a data.path given without one means ("rollouts" for posttrain).
    """
    path, overrides = _parse_argv(argv)
    sections = _sections()
    values = _collect(_read_toml(path) if path else {}, overrides, sections)
    given = values["data"]
    if (given.get("path") or given.get("sources")) and "source" not in given:  # a path alone is never ignored
        values["data"]["source"] = path_source
    return _build(values)


# ---- --help -----------------------------------------------------------------------------------

def field_help(cls: type) -> dict[str, str]:
    """One-line help per field: `metadata["help"]`, else the comment after the field in its class source."""
    comments = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        comments.update(_trailing_comments(klass))
    return {f.name: f.metadata.get("help", comments.get(f.name, "")) for f in dataclasses.fields(cls)}


def _trailing_comments(cls: type) -> dict[str, str]:
    """{field: text of the comment ending its `name: type = default` line} from the class source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source available: help stays empty
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    return {node.target.id: comments[node.end_lineno] for node in ast.parse(source).body[0].body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.end_lineno in comments}


# Meanings of fields whose owners' classes have no comment yet (their comments win once they exist).
_FALLBACK_HELP = {
    "model.vocab_size": "token vocabulary size (embedding rows, output columns)",
    "model.dim": "hidden size",
    "model.n_layers": "transformer blocks",
    "model.n_heads": "attention heads",
    "model.n_kv_heads": "gqa: key/value heads (divides n_heads)",
    "model.head_dim": "gqa: width of one head",
    "model.kv_lora_rank": "mla: rank of the compressed key/value latent",
    "model.qk_nope_head_dim": "mla: per-head query/key width without RoPE",
    "model.qk_rope_head_dim": "mla: per-head query/key width with RoPE (even)",
    "model.v_head_dim": "mla: per-head value width",
    "model.n_routed_experts": "routed experts per MoE layer",
    "model.n_shared_experts": "always-active shared experts per MoE layer",
    "model.score_func": "router score function: \"sigmoid\" (DeepSeek-V3) or \"softmax\"",
    "model.route_scale": "multiplier of the combined routed-expert output",
    "model.rope_theta": "RoPE base",
    "model.max_seq_len": "longest sequence the model supports (data.seq_len <= this)",
    "model.norm_eps": "RMSNorm epsilon",
    "model.init_std": "standard deviation of the normal weight init",
    "optim.adam_beta1": "AdamW beta1 (the AdamW parameters under muon, all under adamw)",
    "optim.adam_beta2": "AdamW beta2",
    "optim.adam_eps": "AdamW epsilon",
}


def help_text(entry: str = "launch/pretrain.py") -> str:
    """Usage of `entry`, then every key as `--section.key=DEFAULT  meaning`, grouped by section."""
    defaults, sections = JobConfig(), _sections()
    out = [f"usage: torchrun --nproc_per_node N {entry} [--config PATH] [--section.key=value ...]",
           "", "With no --config: the embedded debug job (= configs/debug.toml). Keys and defaults:"]
    for section, cls in sections.items():
        out.append(f"\n[{section}]")
        default_obj = defaults.model if section == "model" else getattr(defaults, section)
        helps = field_help(cls)
        rows = [(name, getattr(default_obj, name), helps[name]) for name in helps]
        if section == "model":
            rows.insert(0, ("preset", defaults.model_preset, "named model shape; the keys below override "
                            "its fields (defaults shown: the debug preset)"))
            rows.insert(1, ("init_from", "", "a Hugging Face DeepSeek-V3 / Kimi K2 directory: its config.json "
                            "replaces the preset, its weights the init (ignored when run.dir has checkpoints)"))
        for name, default, meaning in rows:
            meaning = meaning or _FALLBACK_HELP.get(f"{section}.{name}", "")
            out.append(f"  --{section}.{name}={_format(default)}".ljust(44) + f"  {meaning}")
    return "\n".join(out)


def _format(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)
