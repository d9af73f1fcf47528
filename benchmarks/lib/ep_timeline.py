"""Exposed EP time of the interleaved MoE block (`parallel.ep_interleave`, parallel/ep_interleave.py), from
its program order on two streams, for benchmarks/step_projection.py.

The block runs each micro-batch as two halves A and B (half the tokens each), so that one half's
all-to-alls are in flight while the other half computes. Its program is DATA (`FORWARD`, `BACKWARD`:
(kind, name, half) per op, in issue order; provisional until measured on the runtime's timeline):
  compute  on the compute stream, one after another;
  comm     an all-to-all on its comm stream: starts when that stream is free AND the compute issued
           before it is done (its input; the comm stream waits on the compute stream), runs alone on
           it (issue order), as long as its slower link. Rows (dispatch, combine, their gradients) share
           one stream; the count exchanges have their own (their own process group under the halves
           and the pairing, parallel/meshes.py `_counts_group`), so they never queue behind rows;
  wait     the compute stream waits until that comm op is done (`wait counts`: the host reads the
           split sizes: a host sync, charged by the step as SYNC_S, not here).
Compute ops: attn = attention_norm + attention + residual + ffn_norm + router; experts = the routed
experts' grouped matmuls; shared = the shared experts; *_bwd their backward (2x the forward).
Backward under activation checkpointing first reruns the forward's compute ops (full: all of them;
selective: the attention and the routed experts), with parallel.ep_recompute = "resend" also their
all-to-alls in the same order (full: all; selective: the dispatch and combine), with "keep" none.

The exposed EP of one layer and micro-batch = (span of the forward + span of the backward) - their
compute: the time the compute stream stands idle waiting for all-to-alls.

Paired micro-batches (`parallel.ep_pair_micro_batches`, parallel/ep_pairing.py): F(0) runs alone, then
each backward B(m) runs with the forward F(m+1) inside it, then B(M-1) alone. At each of B's gradient
waits (BACKWARD's waits) F runs its next chunk first (`forward_chunks`: from its pending dispatch or
combine wait up to the next one; its count waits are host syncs inside the chunk), both issuing on the
one comm stream in issue order: `paired_program`, B top down, F bottom up, lockstep, except where they
cross (`may_advance`). Only the MoE layers are modelled: the dense layers' and the head's compute,
which would hide some of the all-to-alls in flight around them, is left out (an upper bound).

Recompute ahead (`parallel.ep_recompute_ahead`, parallel/recompute_ahead.py; full checkpointing): the
layer below (b - 1) reruns its forward at B's layer b's first dispatch-gradient wait (`AHEAD`; paired,
after F's chunk there), while that gradient crosses, instead of at the start of its own backward; the top
layer's recompute stays at its start. The step is then simulated whole: F alone, B alone over all its
layers (`backward_program`), and the pairs.
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
YIELDS = ("dispatch", "combine")  # the forward's waits where a paired forward hands the baton back
AHEAD = next(op for op in BACKWARD if op[:2] == ("wait", "dispatch_grad"))  # where the layer below recomputes, ahead


def simulate(ops, seconds: dict) -> tuple[float, float]:
    """(span, compute seconds) of `ops` (module docstring), `seconds[name]` each."""
    compute = busy = 0.0
    comm = {"rows": 0.0, "counts": 0.0}  # the count exchanges have a group of their own (parallel/meshes.py)
    done = {}
    for kind, name, half in ops:
        if kind == "compute":
            compute += seconds[name]
            busy += seconds[name]
        elif kind == "comm":
            stream = "counts" if name.endswith("counts") else "rows"
            comm[stream] = max(comm[stream], compute) + seconds[name]
            done[name, half] = comm[stream]
        else:
            compute = max(compute, done[name, half])
    return max(compute, *comm.values()), busy


def recompute_ops(activation_checkpoint: str, ep_recompute: str) -> tuple:
    """The forward's ops a recompute reruns at the start of the backward (module docstring)."""
    if activation_checkpoint == "none":
        return ()
    rerun = RERUN[activation_checkpoint]
    return tuple(op for op in FORWARD if op[1] in rerun and (op[0] == "compute" or ep_recompute == "resend"))


def op_seconds(compute_s: dict, comm_s: dict) -> tuple[dict, dict, dict]:
    """(forward, recompute, backward) {op name: seconds} of one half. compute_s: {"forward": {op: s},
    "recompute": {op: s}} of the whole micro-batch on one rank (ops attn, experts, shared; the recompute's
    those `activation_checkpoint` reruns); comm_s: {stage: (forward s, backward s)} of one exchange of the
    whole micro-batch's rows (counts, dispatch, combine)."""
    half = lambda name, s: s / 2 if name in HALVED else s  # noqa: E731
    forward = {name: s / 2 for name, s in compute_s["forward"].items()}
    forward |= {name: half(name, s[0]) for name, s in comm_s.items()}
    recompute = {name: s / 2 for name, s in compute_s["recompute"].items()}
    recompute |= {name: half(name, s[0]) for name, s in comm_s.items()}
    backward = {f"{name}_bwd": 2 * s for name, s in forward.items() if name in compute_s["forward"]}
    backward |= {f"{name}_grad": half(name, s[1]) for name, s in comm_s.items()}
    return forward, recompute, backward


def exposed_s(compute_s: dict, comm_s: dict, activation_checkpoint: str = "none",
              ep_recompute: str = "resend") -> float:
    """EP seconds on the critical path per MoE layer and micro-batch (arguments: `op_seconds`)."""
    forward, recompute, backward = op_seconds(compute_s, comm_s)
    exposed = 0.0
    rerun = recompute_ops(activation_checkpoint, ep_recompute)
    for ops, seconds in ((FORWARD, forward), (rerun + BACKWARD, recompute | backward)):
        span, busy = simulate(ops, seconds)
        exposed += span - busy
    return exposed


# -- micro-batch pairing (parallel.ep_pair_micro_batches, parallel/ep_pairing.py)

def forward_chunks(n_layers: int) -> list[tuple[frozenset, tuple]]:
    """F's forward over `n_layers` MoE layers, bottom up, cut before each of its dispatch and combine waits
    (where it hands the baton back; its count waits are host syncs inside a chunk): [(the MoE layers the
    chunk touches, its ops tagged ("F", layer, half))], 4 n + 1 chunks: the first layer's attention and
    dispatches, then per layer 3 inside it and 1 that waits its last combine and starts the next layer."""
    chunks, ops, layers = [], [], set()
    for layer in range(n_layers):
        for kind, name, half in FORWARD:
            if kind == "wait" and name in YIELDS:
                chunks.append((frozenset(layers), tuple(ops)))
                ops, layers = [], set()
            ops.append((kind, name, ("F", layer, half)))
            layers.add(layer)
    chunks.append((frozenset(layers), tuple(ops)))
    return chunks


def may_advance(layers, b: int) -> bool:
    """The runtime's crossing rule: F runs its next chunk only if that chunk's layers are all below B's
    next layer (b - 1) or all above B's (b), so that the two never hold the same or adjacent FSDP units."""
    return all(layer < b - 1 for layer in layers) or all(layer > b for layer in layers)


def paired_program(n_layers: int, recompute: tuple = (), ahead: bool = False) -> tuple:
    """One pair's program: B(m) over `n_layers` MoE layers top down (each layer `recompute` ops, then
    BACKWARD), with F(m+1)'s next chunk (`forward_chunks`) before each of B's gradient waits where
    `may_advance` allows; F's chunks left when B is done run after it. With `ahead`, layer b - 1's
    recompute runs at layer b's `AHEAD` wait (after F's chunk there), the top layer's at its start. Ops
    tagged (who, layer, half); the recompute's ops renamed re_<name> (their own seconds)."""
    chunks = forward_chunks(n_layers)
    rerun = lambda b: [(kind, f"re_{name}", ("B", b, half)) for kind, name, half in recompute]  # noqa: E731
    ops, k = [], 0
    for b in reversed(range(n_layers)):
        if not ahead or b == n_layers - 1:
            ops += rerun(b)
        for kind, name, half in BACKWARD:
            if kind == "wait" and k < len(chunks) and may_advance(chunks[k][0], b):
                ops += chunks[k][1]
                k += 1
            if ahead and b > 0 and (kind, name, half) == AHEAD:
                ops += rerun(b - 1)
            ops.append((kind, name, ("B", b, half)))
    for _, chunk in chunks[k:]:
        ops += chunk
    return tuple(ops)


def backward_program(n_layers: int, recompute: tuple = (), ahead: bool = False) -> tuple:
    """B's backward alone over `n_layers` MoE layers: `paired_program` without F's ops."""
    return tuple(op for op in paired_program(n_layers, recompute, ahead) if op[2][0] == "B")


def unpaired_layers(n_layers: int) -> int:
    """B's MoE layers in `paired_program` into which F inserts no chunk (the crossing; F's chunks left
    then run after B, alone)."""
    paired, previous = set(), None
    for _, _, (who, layer, _) in paired_program(n_layers):
        if who == "B" and previous == "F":
            paired.add(layer)
        previous = who
    return n_layers - len(paired)


def forward_layers_started(n_layers: int) -> dict:
    """{B(m)'s MoE layer b: F(m+1)'s MoE layers started (their kept buffers alive) by the end of B's layer b}
    in `paired_program` (launch/estimate_memory.py's paired moments)."""
    out, started = {}, 0
    for _, _, (who, layer, _) in paired_program(n_layers):
        if who == "F":
            started = max(started, layer + 1)
        else:
            out[layer] = started
    return out


def paired_kept_layers(n_layers: int) -> int:
    """The most MoE layers whose kept buffers are alive at once in a pair: B's layers 0..b (freed after
    each layer's backward) + F's started ones; n + 1 from 3 layers on (the crossing stalls F)."""
    return max(b + 1 + f for b, f in forward_layers_started(n_layers).items())


def step_exposed_s(compute_s: dict, comm_s: dict, n_layers: int, micro_batches: int,
                   activation_checkpoint: str = "none", ep_recompute: str = "resend", paired: bool = False,
                   ahead: bool = False) -> float:
    """EP seconds on the critical path per step, `n_layers` MoE layers x `micro_batches` (arguments:
    `op_seconds`). Unpaired: M x (F alone + B alone); paired: F(0) alone and B(M-1) alone + (M - 1)
    pairs, each the span of `paired_program` less its compute. F alone is n x `exposed_s`'s forward; B
    alone is n x its backward, or with `ahead` (its recomputes run early) `backward_program` simulated."""
    forward, recompute, backward = op_seconds(compute_s, comm_s)
    seconds = forward | {f"re_{name}": s for name, s in recompute.items()} | backward
    rerun = recompute_ops(activation_checkpoint, ep_recompute)

    def idle(ops):
        span, busy = simulate(ops, seconds)
        return span - busy

    if ahead:
        alone = n_layers * idle(FORWARD) + idle(backward_program(n_layers, rerun, ahead))
    else:
        alone = exposed_s(compute_s, comm_s, activation_checkpoint, ep_recompute) * n_layers
    if not paired:
        return alone * micro_batches
    return alone + (micro_batches - 1) * idle(paired_program(n_layers, rerun, ahead))
