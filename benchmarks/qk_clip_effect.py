"""QK-clip's effect on a run whose attention logits grow: the same training run without clipping
(tau = 1e30: maxima recorded, nothing clipped) and with `optim.qk_clip_tau` below that growth,
side by side: per-step max logit and loss.

    python benchmarks/qk_clip_effect.py --steps 120 --lr 0.08 --tau 4 --json out.json --plot out.png

One process on CPU through the real entry point (launch/pretrain.py), the debug model on the
bundled corpus; a high Muon lr makes the logits grow quickly.
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.pretrain import main as pretrain  # noqa: E402
from runtime.cli import user_errors  # noqa: E402
from runtime.paths import check_outputs  # noqa: E402


def run(run_dir: str, steps: int, lr: float, tau: float) -> list[dict]:
    argv = [f"--run.dir={run_dir}", f"--training.steps={steps}", f"--optim.lr={lr}", f"--optim.qk_clip_tau={tau}",
            "--training.warmup_steps=10", "--checkpoint.interval=0", "--eval.interval=0", "--training.log_interval=1000"]
    assert pretrain(argv) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def plot(results: dict, tau: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in results.items():
        steps = [r["step"] for r in records]
        left.plot(steps, [r["max_logit"] for r in records], label=name)
        right.plot(steps, [r["loss"] for r in records], label=name)
    left.axhline(tau, color="gray", linestyle=":", label=f"tau = {tau}")
    left.set(title="max pre-softmax logit of the step", xlabel="step", yscale="log")
    right.set(title="training loss", xlabel="step")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=0.08)
    parser.add_argument("--tau", type=float, default=4.0)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    check_outputs([("--json", args.json), ("--plot", args.plot)])
    with tempfile.TemporaryDirectory() as tmp:
        results = {"no clip": run(os.path.join(tmp, "off"), args.steps, args.lr, 1e30),
                   f"qk_clip_tau={args.tau}": run(os.path.join(tmp, "on"), args.steps, args.lr, args.tau)}
    for name, records in results.items():
        last = records[-1]
        print(f"{name:>18}: max logit {max(r['max_logit'] for r in records):8.2f} (last {last['max_logit']:.2f}), "
              f"final loss {last['loss']:.4f}, clipped head-steps {sum(r['clipped_heads'] for r in records)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if args.plot:
        plot(results, args.tau, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
