"""The communication schedule of one sharded-Muon step, bucket by bucket (see optim/sharded_schedule.py
for what each bucket holds and optim/sharded_muon.py for the step around it).

Per bucket k:
  launch(k)   pack the held pieces of the update direction u into one buffer per group and issue
              ONE uneven all_to_all_single per group (async): pieces travel to their blocks' owners.
  compute(k)  wait for bucket k's all-to-alls, assemble full blocks (received pieces + own copies)
              into one [n, short, long] tensor per shape group, ONE batched `orthogonalize` each.
  return(k)   issue the reverse all_to_all_single (async): result pieces travel back to holders.
  finish(k)   wait for the return, apply the results; for the parameters split across replicas,
              issue the all-gather over the replica axis (all_to_all_single with the same segment
              for every member).
  gathered(k) wait for that all-gather and apply what other replicas computed.

With overlap: launch(k+1) is issued before compute(k), and return(k) is waited only after
compute(k+1), so while bucket k is orthogonalized bucket k+1's pieces are in flight and bucket
k-1's results are returning. Every rank runs the same sequence of buckets and, inside each, the
plan's collectives in the same order (`collectives` in sharded_schedule.py), issuing before
waiting, so no rank waits on a collective another rank has not issued.
"""

import torch
import torch.distributed as dist

from optim.newton_schulz import orthogonalize


class BucketPipeline:
    def __init__(self, plan, buckets, groups, *, device, ns_dtype, steps, coefficients, method="standard",
                 events=None):
        self.plan, self.buckets, self.groups, self.device = plan, buckets, groups, device
        self.ns_dtype, self.steps, self.coefficients, self.method = ns_dtype, steps, coefficients, method
        self.events = events  # list to append (event, bucket) to, or None
        self.flight = {}

    def run(self, u: list[torch.Tensor], apply, overlap: bool) -> None:
        """Orthogonalize every block of the update directions `u` (local shards, one per Muon param)
        and call apply(held_piece, result) once per piece of this rank's shards."""
        K = len(self.buckets)
        if not overlap:
            for k in range(K):
                self._launch(k, u), self._compute(k, u), self._return(k), self._finish(k, apply)
                self._gathered(k, apply)
            return
        if K:
            self._launch(0, u)
        for k in range(K):
            if k + 1 < K:
                self._launch(k + 1, u)
            self._compute(k, u)
            self._return(k)
            if k >= 1:
                self._finish(k - 1, apply)
            if k >= 2:
                self._gathered(k - 2, apply)
        if K:
            self._finish(K - 1, apply)
        for k in range(max(0, K - 2), K):
            self._gathered(k, apply)

    def _log(self, event: str, k: int) -> None:
        if self.events is not None:
            self.events.append((event, k))

    def _a2a(self, recv_sizes, send_sizes, send, group):
        recv = torch.empty(sum(recv_sizes), dtype=self.ns_dtype, device=self.device)
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.groups[group], async_op=True)
        return work, recv

    def _pack(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """One flat buffer in the NS dtype (an empty one when there is nothing to send)."""
        if not pieces:
            return torch.empty(0, dtype=self.ns_dtype, device=self.device)
        return torch.cat([t.reshape(-1) for t in pieces]).to(self.ns_dtype)

    def _launch(self, k, u):
        b, flight = self.buckets[k], self.flight.setdefault(k, {})
        flight["fwd"] = []
        for ex in b.exchanges:  # forward: held pieces -> owners
            send = self._pack([u[b.held[i].param][b.held[i].local] for i in ex.sends])
            flight["fwd"].append((ex, *self._a2a(ex.recv_sizes, ex.send_sizes, send, ex.group)))
        self._log("launch", k)

    def _views(self, b, blocks):
        """Owned piece -> view into the batched blocks (tall blocks are stored transposed)."""
        out = []
        for o in b.owned:
            param, _ = b.batches[o.batch].blocks[o.pos]
            r, c = self.plan.params[param].block_shape
            v = blocks[o.batch][o.pos]
            out.append((v.mT if r > c else v)[o.block])
        return out

    def _compute(self, k, u):
        b, flight = self.buckets[k], self.flight[k]
        for ex, work, _ in flight["fwd"]:
            work.wait()
        self._log("received", k)
        short_long = [self.plan.shape_groups[batch.shape_group][:2] for batch in b.batches]
        blocks = [torch.empty(len(batch.blocks), s, l, dtype=self.ns_dtype, device=self.device)
                  for batch, (s, l) in zip(b.batches, short_long)]
        views = self._views(b, blocks)
        for h, o in b.copies:  # (an expert's piece has a leading expert dim of 1 in u)
            views[o].copy_(u[b.held[h].param][b.held[h].local].reshape(views[o].shape))
        for ex, _, recv in flight.pop("fwd"):
            _unpack(recv, [views[i] for i in ex.recvs])
        self._log("ns_start", k)
        flight["out"] = [orthogonalize(x, self.steps, self.coefficients, method=self.method) for x in blocks]
        self._log("ns_end", k)

    def _return(self, k):
        b, flight = self.buckets[k], self.flight[k]
        out = self._views(b, flight.pop("out"))
        flight["ret"] = []
        for ex in b.exchanges:  # reverse: owners -> holders
            send = self._pack([out[i] for i in ex.recvs])
            flight["ret"].append((ex, *self._a2a(ex.send_sizes, ex.recv_sizes, send, ex.group)))
        flight["results"] = {h: out[o] for h, o in b.copies}
        self._log("return", k)

    def _finish(self, k, apply):
        b, flight = self.buckets[k], self.flight[k]
        results = flight.pop("results")
        for ex, work, recv in flight.pop("ret"):
            work.wait()
            for i, piece in zip(ex.sends, _split(recv, [b.held[i].shape for i in ex.sends])):
                results[i] = piece
        for i, piece in results.items():
            apply(b.held[i], piece)
        flight["gather"] = []
        for ex in b.gathers:  # split parameters: my replica's results to the other replicas
            mine = self._pack([results[i] for i in ex.sends])
            send = torch.cat([mine] * sum(1 for n in ex.send_sizes if n)) if mine.numel() else mine
            flight["gather"].append((ex, *self._a2a(ex.recv_sizes, ex.send_sizes, send, ex.group)))
        self._log("applied", k)

    def _gathered(self, k, apply):
        b, flight = self.buckets[k], self.flight.pop(k)
        for ex, work, recv in flight["gather"]:
            work.wait()
            for i, piece in zip(ex.recvs, _split(recv, [b.held[i].shape for i in ex.recvs])):
                apply(b.held[i], piece)


def _unpack(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    offset = 0
    for v in views:
        v.copy_(flat[offset : offset + v.numel()].view(v.shape))
        offset += v.numel()
    assert offset == flat.numel(), (offset, flat.numel())


def _split(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    assert offset == flat.numel(), (offset, flat.numel())
    return out
