"""Host memory of a rank reading a rollout file: by line index (runtime/posttrain/rollout_file.py) against the
whole file in memory (runtime/posttrain/rollouts.py read_rollouts, what every rank did before).

    python benchmarks/rollout_memory.py [--sizes-mb 128 1024] [--sequential-mb 128] [--ranks 2]
                                        [--batch-tokens 65536] [--steps 4] [--dir /tmp] [--json PATH]

For each size, a file of long agentic rollouts is generated under --dir (12k-20k tokens a line, a
Kimi-sized vocabulary, log-probs, two flagged turns with hints; about 170 KB a line) and deleted
afterwards. Each measurement runs in a fresh process: the imports, then (indexed) `--ranks` gloo ranks
forked from it, each validating its share of the lines and loading --steps steps of --batch-tokens tokens
as dp rank r of --ranks; or (sequential) one process reading the whole file. Reported per rank: peak RSS
(VmHWM of /proc/self/status) minus the RSS after the imports, in MiB, and the wall time; for the steps
alone (the peak reset by /proc/self/clear_refs after validation): their peak RSS above the RSS where they
began (`steps_peak_mib`), their time and how many trajectories the rank parsed (`parsed`). The index is
built by the first run on a file (its time is reported apart: `index_s`).
"""

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from runtime.cli import user_errors
from runtime.paths import check_output_dir, check_outputs

VOCAB, MAX_LEN = 163_840, 32_768


def _line(rng: np.random.Generator, advantage: float) -> str:
    """One trajectory: system, user, then assistant/tool turns of ~600 tokens; hints on two assistant turns."""
    n = int(rng.integers(12_000, 20_000))
    cuts = [0, 200, 800] + list(range(1400, n - 600, 600)) + [n]
    turns = [{"role": "system", "start": 0, "end": 200}, {"role": "user", "start": 200, "end": 800}]
    turns += [{"role": "assistant" if k % 2 == 0 else "tool", "start": a, "end": b}
              for k, (a, b) in enumerate(zip(cuts[2:], cuts[3:]))]
    flagged = [k for k, t in enumerate(turns) if t["role"] == "assistant"][-2:]
    record = {"tokens": rng.integers(0, VOCAB, n).tolist(), "turns": turns, "advantage": advantage,
              "logprobs": np.round(-rng.random(n), 3).tolist(),
              "feedback": [{"turn": k, "hint": rng.integers(0, VOCAB, 24).tolist()} for k in flagged]}
    return json.dumps(record, separators=(",", ":")) + "\n"


def make_file(path: str, size_mb: int) -> int:
    """A file of at least `size_mb` MiB: 16 distinct trajectories cycled, each line its own advantage."""
    rng = np.random.default_rng(0)
    lines = [_line(rng, 0.0) for _ in range(16)]
    written, k = 0, 0
    with open(path, "w") as f:
        while written < size_mb << 20:
            line = lines[k % 16].replace('"advantage":0.0', f'"advantage":{(k % 997) / 997:.4f}')
            f.write(line)
            written, k = written + len(line), k + 1
    return k


def _status_mib(field: str) -> float:
    """VmHWM (peak resident set) or VmRSS (now) of this process, from /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _rss_mib() -> float:
    return _status_mib("VmHWM")


def _current_rss_mib() -> float:
    return _status_mib("VmRSS")


def _reset_peak() -> None:
    """VmHWM back to the RSS now (Linux: 5 written to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _steps(loader, steps: int) -> dict:
    """Peak RSS above the start, time and trajectories parsed of `steps` steps (the peak reset first)."""
    from runtime.posttrain import rollout_file
    parse, parsed = rollout_file.parse_line, []
    rollout_file.parse_line = lambda raw, number, *a: parsed.append(number) or parse(raw, number, *a)
    base, start = _current_rss_mib(), time.perf_counter()
    _reset_peak()
    for _ in range(steps):
        loader.next_step()
    rollout_file.parse_line = parse
    return {"steps_peak_mib": round(_rss_mib() - base, 1), "steps_s": round(time.perf_counter() - start, 2),
            "parsed": len(parsed)}


def _indexed_rank(rank: int, ranks: int, path: str, batch_tokens: int, steps: int, store: str, conn) -> None:
    import torch.distributed as dist
    from runtime.posttrain.rollout_batch import RolloutLoader
    base = _current_rss_mib()
    dist.init_process_group("gloo", store=dist.FileStore(store, ranks), rank=rank, world_size=ranks)
    start = time.perf_counter()
    data = argparse.Namespace(path=path, batch_tokens=batch_tokens)
    loader = RolloutLoader(data, 0, vocab_size=VOCAB, max_seq_len=MAX_LEN, dp_rank=rank, dp_degree=ranks)
    validated, validate_peak = time.perf_counter() - start, _rss_mib()
    stepped = _steps(loader, steps)
    dist.destroy_process_group()
    peak = max(validate_peak, _rss_mib())
    conn.send({"rank": rank, "peak_minus_start_mib": round(peak - base, 1), "start_rss_mib": round(base, 1),
               "validate_s": round(validated, 2), "total_s": round(time.perf_counter() - start, 2),
               "trajectories": len(loader.plan.costs), **stepped})


def child_indexed(path: str, ranks: int, batch_tokens: int, steps: int) -> list[dict]:
    """`ranks` gloo ranks forked from this process (the imports done once, before)."""
    import runtime.posttrain.rollout_batch  # noqa: F401  the imports every rank shares
    from runtime.posttrain.rollout_file import line_offsets
    start = time.perf_counter()
    line_offsets(path)
    index_s = time.perf_counter() - start
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        pipes = [ctx.Pipe(duplex=False) for _ in range(ranks)]
        procs = [ctx.Process(target=_indexed_rank, args=(r, ranks, path, batch_tokens, steps,
                                                                os.path.join(tmp, "store"), pipes[r][1]))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        out = [pipes[r][0].recv() for r in range(ranks)]
        for p in procs:
            p.join()
    return [dict(o, index_s=round(index_s, 2)) for o in out]


def child_sequential(path: str) -> list[dict]:
    from runtime.posttrain.rollouts import read_rollouts
    base = _current_rss_mib()
    start = time.perf_counter()
    trajs = read_rollouts(path, VOCAB, MAX_LEN)
    return [{"rank": 0, "peak_minus_start_mib": round(_rss_mib() - base, 1), "start_rss_mib": round(base, 1),
             "validate_s": round(time.perf_counter() - start, 2), "trajectories": len(trajs)}]


def measure(mode: str, path: str, ranks: int, batch_tokens: int, steps: int) -> list[dict]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, path, str(ranks),
                          str(batch_tokens), str(steps)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@user_errors
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--sequential-mb", type=int, nargs="*", default=[128])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=65_536, help="data.batch_tokens of the steps loaded")
    parser.add_argument("--steps", type=int, default=4, help="steps each rank loads after validating")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_outputs([("--json", args.json)])
    check_output_dir("--dir", args.dir)
    if args.child:
        mode, path, ranks, batch_tokens, steps = args.child
        print(json.dumps(child_indexed(path, int(ranks), int(batch_tokens), int(steps)) if mode == "indexed"
                         else child_sequential(path)))
        return 0
    results = []
    for size, mode in [(s, "indexed") for s in args.sizes_mb] + [(s, "sequential") for s in args.sequential_mb]:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            path = os.path.join(tmp, "rollouts.jsonl")
            lines = make_file(path, size)
            row = {"mode": mode, "file_mib": round(os.path.getsize(path) / 2**20, 1), "lines": lines,
                   "ranks": measure(mode, path, args.ranks if mode == "indexed" else 1, args.batch_tokens,
                                    args.steps)}
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch_tokens": args.batch_tokens, "steps": args.steps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
