"""Which [data] and [eval] keys the chosen mode reads: a key set away from its default that has no effect
is refused in one line (JobConfig.__post_init__), never silently ignored. docs/data.md lists the pairs."""

from runtime.data.config import DataConfig


def unused_keys(data: DataConfig, eval_config) -> list[str]:
    """One message per [data] / [eval] key set away from its default that the chosen mode never reads
    (a key with no effect is refused, never silently ignored); `eval_config`: runtime/evaluate.EvalConfig."""
    data_default, eval_default = DataConfig(), type(eval_config)()
    eval_file = eval_config.enabled() and bool(eval_config.path)

    def changed(cfg, default, key):
        return getattr(cfg, key) != getattr(default, key)

    out = []
    if changed(data, data_default, "dtype") and data.source != "bin" and not eval_file:
        out.append(f"data.dtype={data.dtype} applies to token files only (data.source='bin' or eval.path), but "
                   f"data.source={data.source!r} and no eval.path is read")
    if changed(data, data_default, "batch_tokens") and data.source != "rollouts":
        out.append(f"data.batch_tokens={data.batch_tokens} is read only by data.source='rollouts' (post-training; "
                   f"token batches are data.batch_size x data.seq_len), but data.source={data.source!r}")
    for key in ("seq_len", "batch_size"):
        if changed(data, data_default, key) and data.source == "rollouts" and not eval_file:
            out.append(f"data.{key}={getattr(data, key)} has no effect: rollouts are packed by data.batch_tokens, "
                       f"and data.seq_len/batch_size shape only eval.path's batches (none is read)")
    out += _unused_eval_keys(data, eval_config, eval_default)
    return out


def _unused_eval_keys(data: DataConfig, config, default) -> list[str]:
    changed = [k for k in ("steps", "path", "holdout") if getattr(config, k) != getattr(default, k)]
    if not config.enabled():  # the off switch: a TOML's eval.steps etc. stay, so `--eval.interval=0` turns it off
        return []
    out = []
    if data.source == "rollouts" and not config.path:
        out += [f"eval.{k}={getattr(config, k)} has no effect: post-training evaluates only on an eval.path token file"
                for k in ("interval", "steps", "holdout") if getattr(config, k) != getattr(default, k)]
    elif "holdout" in changed and config.path:
        out.append(f"eval.holdout={config.holdout} has no effect: eval.path={config.path!r} is the held-out data")
    elif "holdout" in changed and data.source == "synthetic":
        out.append(f"eval.holdout={config.holdout} has no effect on data.source='synthetic' (held-out batches are "
                   f"drawn from their own random stream)")
    return out
