"""Low / central / high of every projected figure, from the error the step model was measured to carry on runs it
was not fitted on (planning/calibration/fit.py's leave-one-out ratios, committed in planning/calibration/fitted.json).

A held-out run was projected at r times its measured throughput, r between LOW_RATIO and HIGH_RATIO (the lowest and
the highest of the committed cases' leave-one-out ratios). A projection P of a new layout is therefore read as
    low = P / HIGH_RATIO,   central = P,   high = P / LOW_RATIO
Where two layouts' bands overlap, the model cannot tell them apart (docs/performance.md says so wherever it ranks).
The runs behind the band were force-balanced (or fake-gated): routing skew is not in it.
"""

from planning.parameters import committed

RESTS_ON = ("low / high: the central figure over the highest / lowest leave-one-out ratio of the published runs "
            "(planning/calibration/fitted.json); central: the fitted step model, balanced routing")


def ratios() -> tuple[float, float]:
    """(lowest, highest) leave-one-out ratio of the committed cases."""
    held = committed()["cross_validation"]["ratios"].values()
    return min(held), max(held)


def band(central: float) -> tuple[float, float, float]:
    """(low, central, high) of a projected throughput (module docstring)."""
    low_ratio, high_ratio = ratios()
    return central / high_ratio, central, central / low_ratio


def overlap(a: tuple, b: tuple) -> bool:
    """Whether two bands (low, central, high) overlap: the model cannot rank the two layouts."""
    return a[0] <= b[2] and b[0] <= a[2]
