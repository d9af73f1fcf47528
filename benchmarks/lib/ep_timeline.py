"""Exposed EP time of the interleaved MoE block (`parallel.ep_interleave`, parallel/ep_interleave.py), from
its program order on two streams, for benchmarks/step_projection.py.

The block runs each micro-batch as two halves A and B (half the tokens each), so that one half's
all-to-alls are in flight while the other half computes. Its program is DATA (`FORWARD`, `BACKWARD`:
(kind, name, half) per op, in issue order; provisional until measured on the runtime's timeline):
  compute  on the compute stream, one after another;
  comm     an all-to-all on the comm stream: starts when the comm stream is free AND the compute
           issued before it is done (its input; the comm stream waits on the compute stream), runs
           alone (issue order), as long as its slower link;
  wait     the compute stream waits until that comm op is done (`wait counts`: the host reads the
           split sizes: a host sync, charged by the step as SYNC_S, not here).
Compute ops: attn = attention_norm + attention + residual + ffn_norm + router; experts = the routed
experts' grouped matmuls; shared = the shared experts; *_bwd their backward (2x the forward).
Backward under activation checkpointing first reruns the forward's compute ops (full: all of them;
selective: the attention and the routed experts), with parallel.ep_recompute = "resend" also their
all-to-alls in the same order (full: all; selective: the dispatch and combine), with "keep" none.

The exposed EP of one layer and micro-batch = (span of the forward + span of the backward) - their
compute: the time the compute stream stands idle waiting for all-to-alls.
"""

FORWARD = (
    ("compute", "attn", "A"),
    ("comm", "counts", "A"), ("wait", "counts", "A"),
    ("comm", "dispatch", "A"),
    ("compute", "attn", "B"),
    ("comm", "counts", "B"), ("wait", "counts", "B"),
    ("comm", "dispatch", "B"),
    ("wait", "dispatch", "A"), ("compute", "experts", "A"), ("comm", "combine", "A"),
    ("wait", "dispatch", "B"), ("compute", "experts", "B"), ("comm", "combine", "B"),
    ("compute", "shared", "A"), ("wait", "combine", "A"),
    ("compute", "shared", "B"), ("wait", "combine", "B"),
)
BACKWARD = (
    ("comm", "combine_grad", "B"), ("compute", "shared_bwd", "B"),
    ("comm", "combine_grad", "A"), ("compute", "shared_bwd", "A"),
    ("wait", "combine_grad", "B"), ("compute", "experts_bwd", "B"), ("comm", "dispatch_grad", "B"),
    ("wait", "combine_grad", "A"), ("compute", "experts_bwd", "A"), ("comm", "dispatch_grad", "A"),
    ("wait", "dispatch_grad", "B"), ("compute", "attn_bwd", "B"),
    ("wait", "dispatch_grad", "A"), ("compute", "attn_bwd", "A"),
)
RERUN = {"full": ("attn", "experts", "shared", "counts", "dispatch", "combine"),  # what a recompute reruns
         "selective": ("attn", "experts", "dispatch", "combine")}
OP_PARTS = {"attn": ("norms", "attention", "sdpa", "router"), "experts": ("routed",),
            "shared": ("shared",)}  # the compute ops' parts (benchmarks/lib/block_flops.py)
HALVED = ("dispatch", "combine")  # rows split between the halves; each half exchanges its own counts


def simulate(ops, seconds: dict) -> tuple[float, float]:
    """(span, compute seconds) of `ops` (module docstring), `seconds[name]` each."""
    compute = comm = busy = 0.0
    done = {}
    for kind, name, half in ops:
        if kind == "compute":
            compute += seconds[name]
            busy += seconds[name]
        elif kind == "comm":
            comm = max(comm, compute) + seconds[name]
            done[name, half] = comm
        else:
            compute = max(compute, done[name, half])
    return max(compute, comm), busy


def recompute_ops(activation_checkpoint: str, ep_recompute: str) -> tuple:
    """The forward's ops a recompute reruns at the start of the backward (module docstring)."""
    if activation_checkpoint == "none":
        return ()
    rerun = RERUN[activation_checkpoint]
    return tuple(op for op in FORWARD if op[1] in rerun and (op[0] == "compute" or ep_recompute == "resend"))


def exposed_s(compute_s: dict, comm_s: dict, activation_checkpoint: str = "none",
              ep_recompute: str = "resend") -> float:
    """EP seconds on the critical path per MoE layer and micro-batch. compute_s: {"forward": {op: s},
    "recompute": {op: s}} of the whole micro-batch on one rank (ops attn, experts, shared; the recompute's
    those `activation_checkpoint` reruns); comm_s: {stage: (forward s, backward s)} of one exchange of the
    whole micro-batch's rows (counts, dispatch, combine)."""
    half = lambda name, s: s / 2 if name in HALVED else s  # noqa: E731
    forward = {name: s / 2 for name, s in compute_s["forward"].items()}
    forward |= {name: half(name, s[0]) for name, s in comm_s.items()}
    backward = {name: s / 2 for name, s in compute_s["recompute"].items()}
    backward |= {name: half(name, s[0]) for name, s in comm_s.items()}
    backward |= {f"{name}_bwd": 2 * s for name, s in forward.items() if name in compute_s["forward"]}
    backward |= {f"{name}_grad": half(name, s[1]) for name, s in comm_s.items()}
    exposed = 0.0
    recompute = recompute_ops(activation_checkpoint, ep_recompute)
    for ops, seconds in ((FORWARD, forward), (recompute + BACKWARD, backward)):
        span, busy = simulate(ops, seconds)
        exposed += span - busy
    return exposed
