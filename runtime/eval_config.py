"""The `[eval]` section and which held-out batches it evaluates (no torch: the config tree imports it).

`held_out_splits` is the one place that says what a run's evaluation reads: launch/pretrain.py builds
its eval loaders from it (through JobConfig.token_splits) and launch/evaluate.py, given a run, rebuilds
the same splits from what the run's checkpoint recorded (runtime/evaluate.py), so both read the same tokens.
"""

import dataclasses
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    interval: int = 100  # evaluate every N optimizer steps and after the last one (0 = never)
    steps: int = 4  # global batches (of data.batch_size sequences) per evaluation
    path: str = ""  # a .bin of held-out tokens; empty = the last eval.holdout of the training source
    holdout: float = 0.05  # fraction of the training source held out for evaluation when eval.path is empty

    def __post_init__(self):
        if self.interval < 0 or self.steps < 1:
            raise ValueError(f"eval.interval={self.interval} must be >= 0 and eval.steps={self.steps} >= 1")
        if not 0 < self.holdout < 1:
            raise ValueError(f"eval.holdout={self.holdout} must be in (0, 1)")

    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int, total_steps: int) -> bool:
        """Whether to evaluate after `step` optimizer steps are done."""
        return self.enabled() and (step % self.interval == 0 or step == total_steps)

    def train_holdout(self) -> float:
        """The fraction the TRAINING loader must leave out of its source."""
        return self.holdout if self.enabled() and not self.path else 0.0

    def data(self, data_config):
        """The DataConfig the eval loader reads."""
        if not self.path:
            return data_config
        return dataclasses.replace(data_config, source="bin", path=self.path, sources=())  # a mixture's too

    def held_out_splits(self, data_config) -> dict:
        """{split: (data config, holdout, the key naming its file)} of what an evaluation reads: "eval",
        or for a mixture without eval.path "eval/<name>" per source (eval_loss: their weighted mean,
        runtime/data/mixture.py); none when evaluation is off, or for rollouts without eval.path."""
        if not self.enabled():
            return {}
        if data_config.sources and not self.path:  # a mixture: each source's own held-out part
            return {f"eval/{source.label()}": (dataclasses.replace(data_config, sources=(), path=source.path),
                                               self.holdout, f"data.sources[{i}].path")
                    for i, source in enumerate(data_config.sources)}
        if data_config.source == "rollouts" and not self.path:
            return {}
        key = "eval.path" if self.path else "data.path"
        return {"eval": (self.data(data_config), 0.0 if self.path else self.holdout, key)}


def recorded_settings(config) -> dict:
    """What a checkpoint records of its run's data and evaluation (file paths made absolute, so the
    record holds wherever the run was started): launch/evaluate.py rebuilds the run's held-out batches
    from it, and a resume names what changed (runtime/train.py run_meta)."""
    data, evaluation = dataclasses.asdict(config.data), dataclasses.asdict(config.eval)
    data["path"], evaluation["path"] = _absolute(data["path"]), _absolute(evaluation["path"])
    for source in data["sources"]:
        source["path"] = _absolute(source["path"])
    return {"data": data, "eval": evaluation, "training.seed": config.training.seed}


def _absolute(path: str) -> str:
    return os.path.abspath(path) if path else path


def settings_change(saved: dict, config) -> str | None:
    """One line naming every data / eval setting (and training.seed) that differs from what the checkpoint
    `saved` (its marker) recorded, `key: old -> new`; None when none does or nothing was recorded."""
    now = json.loads(json.dumps(recorded_settings(config)))  # tuples -> lists, as the marker stores them
    diffs = []
    for section in ("data", "eval"):
        old = saved.get(section) or {}
        for key, value in now[section].items():
            if key in old and old[key] != value:
                diffs += _differences(f"{section}.{key}", old[key], value)
    if saved.get("training.seed", now["training.seed"]) != now["training.seed"]:
        diffs.append(f"training.seed: {saved['training.seed']} -> {now['training.seed']}")
    return f"resuming with other data settings than the checkpoint's: {'; '.join(diffs)}" if diffs else None


def _differences(key: str, old, new) -> list[str]:
    """`key: old -> new`; for a mixture's sources of the same count, per source and field."""
    if key == "data.sources" and len(old) == len(new):
        return [f"{key}[{i}].{field}: {a[field]!r} -> {b[field]!r}" for i, (a, b) in enumerate(zip(old, new))
                for field in b if a.get(field) != b[field]]
    return [f"{key}: {old!r} -> {new!r}"]
