"""Which linears of a compressed-tensors checkpoint are INT4 (`quantization_config`), and its
constants; no torch: reading a model config imports it (models/hf/int4.py has the tensors).

Which linears are quantized is what `quantization_config` says, as written: a module is quantized when
a config group's `targets` match it (a class name such as "Linear", an exact module name, or "re:REGEX"
matched from the start of the name, as compressed-tensors matches) and no `ignore` entry does. Module
names are the checkpoint's (with the K2.5 `language_model.` prefix).
"""

import re
from dataclasses import dataclass

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
BITS = 4
GROUP = 32  # the one group size we read and write (Kimi's)
PER_WORD = 32 // BITS  # 8 values per int32 word
WORDS_PER_GROUP = GROUP // PER_WORD  # 4
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
_WEIGHTS = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}


@dataclass(frozen=True)
class Int4Scheme:
    targets: tuple[str, ...]  # config group targets, as written
    ignore: tuple[str, ...]  # quantization_config ignore, as written

    def quantized(self, module: str, is_linear: bool) -> bool:
        """Whether `module` (a checkpoint module name; `is_linear`: an nn.Linear in the HF model) is INT4."""
        return _matches(module, is_linear, self.targets) and not _matches(module, is_linear, self.ignore)


def _matches(module: str, is_linear: bool, patterns: tuple[str, ...]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p == module or (p == "Linear" and is_linear):
            return True
    return False


def read_scheme(quant: dict, where: str) -> Int4Scheme:
    """The INT4 scheme of a compressed-tensors `quantization_config`; ValueError (one line) for anything
    else than pack-quantized, 4-bit, symmetric int, group 32, weights only."""
    fmt = quant.get("format")
    if fmt != FORMAT:
        raise ValueError(f"{where}: quantization_config quant_method={METHOD!r} format={fmt!r} is not supported "
                         f"(only {FORMAT!r})")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}: quantization_config has {len(groups)} config_groups {sorted(groups)}, "
                         f"supported: exactly one")
    (name, group), = groups.items()
    weights = group.get("weights") or {}
    for key, value in _WEIGHTS.items():
        if weights.get(key) != value:
            raise ValueError(f"{where}: quantization_config config_groups.{name}.weights.{key}={weights.get(key)!r} "
                             f"is not supported (supported: num_bits=4, type='int', symmetric=true, "
                             f"strategy='group', group_size=32)")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise ValueError(f"{where}: quantization_config config_groups.{name}.{key} is set; only weight "
                             f"quantization is supported")
    targets = group.get("targets")
    if not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}: quantization_config config_groups.{name}.targets={targets!r}: expected a list "
                         f"of names")
    return Int4Scheme(targets=tuple(targets), ignore=tuple(quant.get("ignore") or ()))
