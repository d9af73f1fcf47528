"""The `[posttrain]` section: the loss weights, the feedback KL mode and the teacher (no torch: the config
tree imports it; runtime/posttrain/objective.py has the objective, and its docstring what each key does)."""

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class PosttrainConfig:
    sft_coef: float = 0.0  # weight of the next-token (SFT) loss over all assistant tokens
    rl_coef: float = 1.0  # weight of the policy-gradient loss over all assistant tokens
    feedback_coef: float = 1.0  # weight of the KL(student || teacher) loss on feedback turns
    clip_eps: float = 0.2  # PPO ratio clip: the ratio pi/pi_old is clipped to [1-eps, 1+eps]
    mode: Literal["full", "topk", "sampled"] = "full"  # feedback KL: exact, teacher top-k + tail, sampled token
    feedback_norm: Literal["targets", "assistant"] = "targets"  # L_feedback / the step's target or assistant tokens
    top_k: int = 32  # topk: teacher tokens kept per position (one tail bucket holds the rest)
    vocab_chunk: int = 8192  # full: vocabulary chunk of the exact KL (bounds its extra memory)
    head_chunk: int = 2048  # the student's output head and losses run over this many tokens at a time (models/output_head.py)
    teacher: Literal["live", "initial", "ema"] = "live"  # teacher weights: current, frozen start, EMA
    ema_decay: float = 0.99  # ema: teacher = decay * teacher + (1 - decay) * student after each step
    init_from: str = ""  # a run dir (its newest checkpoint), a checkpoint dir (any layout) or a Hugging Face dir: the model's shape and starting weights

    def __post_init__(self):
        checks = {"sft_coef": self.sft_coef >= 0, "rl_coef": self.rl_coef >= 0,
                  "feedback_coef": self.feedback_coef >= 0, "clip_eps": self.clip_eps > 0, "top_k": self.top_k >= 1,
                  "vocab_chunk": self.vocab_chunk >= 1, "head_chunk": self.head_chunk >= 1, "ema_decay": 0 <= self.ema_decay < 1}
        expected = {"clip_eps": "> 0", "top_k": ">= 1", "vocab_chunk": ">= 1", "head_chunk": ">= 1", "ema_decay": "in [0, 1)"}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"posttrain.{key}={getattr(self, key)} must be {expected.get(key, '>= 0')}")

    def unread(self, vocab_size: int) -> list[str]:
        """One line per key that is set but has no effect with the other keys (or that the vocabulary caps)."""
        default, out = PosttrainConfig(), []
        for key, needed, read in (("top_k", "posttrain.mode=topk", self.mode == "topk"),
                                  ("vocab_chunk", "posttrain.mode=full", self.mode == "full"),
                                  ("ema_decay", "posttrain.teacher=ema", self.teacher == "ema")):
            if getattr(self, key) != getattr(default, key) and not read:
                out.append(f"posttrain.{key}={getattr(self, key)} is read only with {needed}")
        if self.mode == "topk" and self.top_k > vocab_size:
            out.append(f"posttrain.top_k={self.top_k} is above model.vocab_size={vocab_size}: the teacher's top-k would "
                       f"be the whole vocabulary (posttrain.mode=full is the exact KL)")
        return out
