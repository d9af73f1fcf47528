"""Reading the job configuration (runtime/config.py) from TOML and the command line, and its --help.

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
from typing import Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from models import PRESETS, ModelConfig, preset
from models.hf.config import read_hf_config
from optim.config import OptimConfig
from parallel.ep.config import REMOVED_EP_KNOBS
from parallel.layout import ParallelConfig
from runtime.checkpoint.dirs import CheckpointConfig
from runtime.comm_config import CommConfig
from runtime.config import NO_PRESET, ConfigError, JobConfig, ProfileConfig, RunConfig, TrainingConfig
from runtime.data.config import DataConfig
from runtime.eval_config import EvalConfig
from runtime.metrics_config import MetricsConfig
from runtime.posttrain import init_source
from runtime.posttrain.config import PosttrainConfig


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
    if name not in PRESETS and name != NO_PRESET:
        raise ConfigError(f"model.preset: unknown preset {name!r} (valid: {', '.join(PRESETS)}, or {NO_PRESET!r} "
                          f"when posttrain.init_from or model.init_from gives the shape)")
    for section, section_values in values.items():
        built[section] = _construct(section, lambda: dataclasses.replace(getattr(defaults, section), **section_values))
    if name == NO_PRESET:  # unsets a preset of the --config file: the shape comes from the starting weights
        if not (init_from or built["posttrain"].init_from and built["data"].source == "rollouts"):
            raise ConfigError(f"model.preset={NO_PRESET!r}: the model's shape then comes from posttrain.init_from "
                              f"(post-training) or model.init_from; give one of them, or a preset")
        given_preset = None
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
                            "its fields (defaults shown: the debug preset); none: no preset, the shape of "
                            "posttrain.init_from / model.init_from"))
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
