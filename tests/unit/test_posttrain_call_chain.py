"""A post-training step's calls, followed through runtime/posttrain/: each file of it is entered from one
place. Before, the batcher called the step plan and the deal in rollouts.py itself, then the file reader,
which called rollouts.py again to parse, and then rollouts.py's trajectory methods once more while building
tensors (rollout_batch -> rollout_file -> rollouts three times a step). Now the batcher asks the reader
once (rollout_batch -> rollout_file -> rollouts) and the objective calls the losses (objective -> feedback)."""

import os
import sys
from collections import defaultdict

import torch

from models import Transformer, preset
from runtime.posttrain.config import PosttrainConfig
from runtime.posttrain.objective import FeedbackObjective
from runtime.posttrain.rollout_batch import RolloutLoader

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WING = os.path.join(REPO, "runtime", "posttrain") + os.sep
EXAMPLE = os.path.join(REPO, "examples", "rollouts.jsonl")


class Data:
    path, batch_tokens = EXAMPLE, 2048


def _callers(run) -> dict[str, set[str]]:
    """{post-training file: the post-training files that call into it} while `run()` runs (calls within a
    file left out; the loop, torch and the model call in from outside: callbacks and hooks included)."""
    callers = defaultdict(set)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(WING) and frame.f_back is not None:
            callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
            if caller != callee:
                inside = caller.startswith(WING)
                callers[os.path.basename(callee)].add(os.path.basename(caller) if inside else "outside")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return callers


def test_each_post_training_file_of_a_step_is_entered_from_one_place():
    torch.manual_seed(0)
    model = Transformer(preset("debug"))
    model.init_weights(torch.Generator().manual_seed(0))
    loader = RolloutLoader(Data(), 0, vocab_size=256, max_seq_len=256)
    objective = FeedbackObjective(PosttrainConfig())
    callers = _callers(lambda: objective.forward_backward(model, loader.next_step(), torch.device("cpu")))
    inside = {callee: sources - {"outside"} for callee, sources in callers.items()}
    assert inside == {"rollout_batch.py": set(),  # entered by the loop's loader.next_step
                      "rollout_file.py": {"rollout_batch.py"},  # once a step: Rollouts.step
                      "rollouts.py": {"rollout_file.py"},  # the plan, the deal, the parse
                      "objective.py": set(),  # entered by the loop's forward_backward (and the head's loss callbacks)
                      "feedback.py": {"objective.py"}}, dict(callers)  # (and autograd's backward of its functions)
    assert callers["rollout_file.py"] == {"rollout_batch.py"} and callers["rollouts.py"] == {"rollout_file.py"}
