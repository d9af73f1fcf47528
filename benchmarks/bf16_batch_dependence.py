"""Does this CPU round bf16 batched matmuls differently with the batch size (AMX-bf16 CPUs do)?

    python benchmarks/bf16_batch_dependence.py

For a few Newton-Schulz block shapes: whether batched bf16 NS equals one-matrix-per-call bf16 NS
bitwise, their largest difference, and the bf16-vs-fp32 difference of the same inputs (the yardstick
the bf16 tests bound batch effects by). Prints one line per shape; no GPU needed.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from optim.newton_schulz import orthogonalize  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    for shape in [(6, 12, 16), (8, 32, 64), (16, 64, 128), (64, 128, 256)]:
        x = torch.randn(shape).bfloat16()
        batched = orthogonalize(x)
        looped = torch.stack([orthogonalize(m) for m in x])
        yardstick = (batched.float() - orthogonalize(x.float())).abs().max()
        print(f"{str(shape):>16}: batched == one-by-one {torch.equal(batched, looped)!s:5}  max difference "
              f"{float((batched.float() - looped.float()).abs().max()):.3e}  bf16-vs-fp32 {float(yardstick):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
