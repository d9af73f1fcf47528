"""The Newton-Schulz coefficient sets and the choices of `[optim]` that name NS variants (no torch:
the config tree imports them; optim/newton_schulz.py says what each set does to singular values)."""

JORDAN = ((3.4445, -4.7750, 2.0315),) * 5
# modded-nanogpt's variant of Polar Express (not the tuples of the paper's Algorithm 1, which use a
# 1.01 safety factor); paired with a 1.02 factor on the normalization in COEFFICIENT_SETS.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# name -> (per-iteration (a, b, c) tuples, factor on ||X||_F in the normalization)
COEFFICIENT_SETS = {"jordan": (JORDAN, 1.0), "polar_express": (POLAR_EXPRESS, 1.02)}
LR_ADJUST_MODES = ("rms", "spectral", "none")
NS_METHODS = ("standard", "gram")
