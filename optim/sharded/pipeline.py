"""The communication schedule of one sharded-Muon step, bucket by bucket (see optim/sharded/schedule.py
for what each bucket holds and optim/sharded/muon.py for the step around it).

Per bucket k (buffers and index maps: optim/sharded/index.py; ops per bucket, not per piece):
  launch(k)   write the held pieces of the update direction u, in the NS dtype, into the bucket's
              stage buffer (per parameter: the caller's `direction` per run, or at its rows and one
              index_copy_) and issue ONE uneven all_to_all_single per group (async): pieces travel
              to their blocks' owners.
  compute(k)  assemble every block of the bucket with ONE index_copy_ of its own copies, orthogonalize
              the batches that need nothing received, wait for bucket k's all-to-alls, ONE index_copy_
              of the received pieces, then the other batches: ONE batched `orthogonalize` per shape
              group ([n, short, long]: tall blocks transposed into the batch).
  return(k)   gather the results in the received layout (ONE index_select; own copies: one more) and issue the reverse
              all_to_all_single (async): result pieces travel back to holders.
  finish(k)   wait for the return, apply the results (per parameter: the caller's `apply` of its
              rows); for the parameters split across replicas, issue the all-to-all that moves
              each member's results into equal chunks of the replica group (async).
  gathered(k) wait for it, issue the all-gather of the chunks (all_gather_single, async: a ring on
              NCCL); wait for bucket k-1's all-gather and apply what other replicas computed.

With overlap: launch(k+1) is issued before compute(k), and return(k) is waited only after
compute(k+1), so while bucket k is orthogonalized bucket k+1's pieces are in flight and bucket
k-1's results are returning. Every rank runs the same sequence of buckets and, inside each, the
plan's collectives in the same order (`collectives` in sharded/schedule.py), issuing before
waiting, so no rank waits on a collective another rank has not issued.
"""

import torch
import torch.distributed as dist

from optim.newton_schulz import orthogonalize
from optim.sharded.index import bucket_index


class BucketPipeline:
    def __init__(self, plan, buckets, groups, *, local_shapes, device, ns_dtype, steps, coefficients,
                 method="standard", tf32=False, events=None):
        self.plan, self.buckets, self.groups, self.device = plan, buckets, groups, device
        self.ns_dtype, self.steps, self.coefficients, self.method = ns_dtype, steps, coefficients, method
        self.tf32 = tf32
        self.index = [bucket_index(plan, b, local_shapes, device) for b in buckets]
        self.events = events  # list to append (event, bucket) to, or None
        self.flight = {}
        self.pending = []  # the last bucket's all-gathers: (GatherMap, buffer of all segments, g, work)

    def run(self, direction, apply, overlap: bool) -> None:
        """Orthogonalize every block of the update direction and apply the results.

        direction(param, where, g, out) writes the update direction at `where` of the param's local
        shard into `out` (NS dtype) and returns True, or returns False (no gradient: zeros are
        sent); `where` is a slice of the flat shard (g None, out flat) or an index tensor of rows of
        the shard viewed as [-1, g] (out [n, g]);
        apply(param, where, g, values) applies orthogonalized values (NS dtype, shaped like out) there.
        """
        K = len(self.buckets)
        if not overlap:
            for k in range(K):
                self._launch(k, direction), self._compute(k), self._return(k), self._finish(k, apply)
                self._gathered(k, apply), self._gathered(None, apply)
            return
        if K:
            self._launch(0, direction)
        for k in range(K):
            if k + 1 < K:
                self._launch(k + 1, direction)
            self._compute(k)
            self._return(k)
            if k >= 1:
                self._finish(k - 1, apply)
            if k >= 2:
                self._gathered(k - 2, apply)
        if K:
            self._finish(K - 1, apply)
        for k in range(max(0, K - 2), K):
            self._gathered(k, apply)
        self._gathered(None, apply)

    def _log(self, event: str, k: int) -> None:
        if self.events is not None:
            self.events.append((event, k))

    def _exchange(self, exchanges, send, recv, forward: bool) -> list:
        """One async all_to_all_single per exchange on consecutive segments of send / recv."""
        works, s_off, r_off = [], 0, 0
        for ex in exchanges:
            send_sizes, recv_sizes = (ex.send_sizes, ex.recv_sizes) if forward else (ex.recv_sizes, ex.send_sizes)
            s_end, r_end = s_off + sum(send_sizes), r_off + sum(recv_sizes)
            works.append(dist.all_to_all_single(recv[r_off:r_end], send[s_off:s_end], recv_sizes, send_sizes,
                                                group=self.groups[ex.group], async_op=True))
            s_off, r_off = s_end, r_end
        return works

    def _launch(self, k, direction):
        b, ix, flight = self.buckets[k], self.index[k], self.flight.setdefault(k, {})
        stage = torch.empty(ix.n_stage, dtype=self.ns_dtype, device=self.device)
        for m in ix.pack:  # the direction straight into stage (runs) or through one gather per parameter
            if m.runs is not None:
                for local, at in m.runs:
                    if not direction(m.param, local, None, stage[at]):
                        stage[at].zero_()
                continue
            values = torch.empty(len(m.local_rows), ix.g_stage, dtype=self.ns_dtype, device=self.device)
            if not direction(m.param, m.local_rows, ix.g_stage, values):
                values.zero_()
            stage.view(-1, ix.g_stage).index_copy_(0, m.buffer_rows, values)
        incoming = torch.empty(ix.n_recv, dtype=self.ns_dtype, device=self.device)
        flight["fwd"] = self._exchange(b.exchanges, stage, incoming, forward=True)
        flight["incoming"], flight["copies"] = incoming, stage[ix.n_send:]
        self._log("launch", k)

    def _compute(self, k):
        ix, flight = self.index[k], self.flight[k]
        blocks = torch.empty(ix.n_blocks, dtype=self.ns_dtype, device=self.device)
        rows = blocks.view(-1, ix.g_blocks)
        copies = flight.pop("copies")
        if len(ix.copy_rows):
            rows.index_copy_(0, ix.copy_rows, copies.view(-1, ix.g_blocks))
        del copies  # dropped as soon as possible: the step's peak memory is a few buckets
        out = [None] * len(ix.batches)
        self._log("ns_start", k)
        own = {i: _batch(blocks, *b) for i, b in enumerate(ix.batches) if ix.own_batches[i]}
        self._orthogonalize(own, out)  # the batches that need nothing received, while the pieces travel
        for work in flight.pop("fwd"):
            work.wait()
        self._log("received", k)
        incoming = flight.pop("incoming")
        if len(ix.recv_rows):
            rows.index_copy_(0, ix.recv_rows, incoming.view(-1, ix.g_blocks))
        rest = {i: _batch(blocks, *b) for i, b in enumerate(ix.batches) if not ix.own_batches[i]}
        del incoming, rows, blocks  # the blocks go with the last input
        self._orthogonalize(rest, out)
        flight["out"] = out
        self._log("ns_end", k)

    def _orthogonalize(self, inputs: dict, out: list) -> None:
        """out[i] = orthogonalize(inputs[i]), one batched call each; an input is dropped as NS takes it."""
        for i in sorted(inputs):
            out[i] = orthogonalize(inputs.pop(i), self.steps, self.coefficients, method=self.method, tf32=self.tf32)

    def _return(self, k):
        b, ix, flight = self.buckets[k], self.index[k], self.flight[k]
        out = _blocks_layout(flight.pop("out"), ix.batches, self.ns_dtype, self.device)
        back = torch.empty(ix.n_stage, dtype=self.ns_dtype, device=self.device)
        out_rows = out.view(-1, ix.g_blocks)
        if len(ix.copy_rows):  # own copies: straight into the back buffer
            torch.index_select(out_rows, 0, ix.copy_rows, out=back[ix.n_send:].view(-1, ix.g_blocks))
        ret = out_rows.index_select(0, ix.recv_rows).view(-1)
        del out, out_rows
        flight["ret"] = self._exchange(b.exchanges, ret, back, forward=False)
        flight["back"] = back
        self._log("return", k)

    def _finish(self, k, apply):
        b, ix, flight = self.buckets[k], self.index[k], self.flight[k]
        for work in flight.pop("ret"):
            work.wait()
        back = flight.pop("back")
        _apply_rows(back, ix.pack, ix.g_stage, apply)
        flight["balance"] = []
        for gm, gx in zip(ix.gathers, b.gathers):  # split parameters: my replica's results into the chunks
            mine = back.view(-1, ix.g_stage).index_select(0, gm.send_rows).view(-1)
            chunk = torch.empty(gm.chunk, dtype=self.ns_dtype, device=self.device)
            work = dist.all_to_all_single(chunk[: sum(gm.recv_sizes)], mine, gm.recv_sizes, gm.send_sizes,
                                          group=self.groups[gx.group], async_op=True)
            flight["balance"].append((gm, gx, chunk, work))
        self._log("applied", k)

    def _gathered(self, k, apply):
        """Issue bucket k's all-gathers, then apply bucket k-1's (so one is in flight while the next
        bucket's chunks arrive); k = None: apply the last one."""
        issued = []
        for gm, gx, chunk, work in self.flight.pop(k)["balance"] if k is not None else []:
            work.wait()
            out = torch.empty(gm.chunk * len(gx.group), dtype=self.ns_dtype, device=self.device)
            work = dist.all_gather_single(out, chunk, group=self.groups[gx.group], async_op=True)
            issued.append((gm, out[: gm.total], self.index[k].g_stage, work))
        pending, self.pending = self.pending, issued
        for gm, segments, g, work in pending:
            work.wait()
            _apply_rows(segments, gm.apply, g, apply)


def _batch(blocks, offset, n_wide, n_tall, s, l) -> torch.Tensor:
    """NS input [n, s, l] of one batch: its wide blocks, then its tall ones transposed."""
    wide = blocks[offset : offset + n_wide * s * l].view(n_wide, s, l)
    if not n_tall:
        return wide
    at = offset + n_wide * s * l
    tall = blocks[at : at + n_tall * s * l].view(n_tall, l, s).mT
    return torch.cat([wide, tall]) if n_wide else tall


def _blocks_layout(outs: list, batches, dtype, device) -> torch.Tensor:
    """The NS outputs [n, s, l] per batch in the blocks layout (tall blocks back in their [l, s]),
    one flat tensor; each output is released once copied."""
    if len(outs) == 1 and not batches[0][2]:
        return outs[0].view(-1)
    flat = torch.empty(sum((nw + nt) * s * l for _, nw, nt, s, l in batches), dtype=dtype, device=device)
    for offset, n_wide, n_tall, s, l in batches:
        out = outs.pop(0)
        if n_wide:
            flat[offset : offset + n_wide * s * l].view(n_wide, s, l).copy_(out[:n_wide])
        if n_tall:
            at = offset + n_wide * s * l
            flat[at : at + n_tall * s * l].view(n_tall, l, s).copy_(out[n_wide:].mT)
        del out
    return flat


def _apply_rows(buffer, maps, g, apply) -> None:
    """apply(param, where, g, values) for each parameter's pieces in `buffer` (NS dtype): per run a
    slice of `buffer` for a slice of the flat shard, else the gathered rows for an index tensor."""
    for m in maps:
        if m.runs is None:
            apply(m.param, m.local_rows, g, buffer.view(-1, g).index_select(0, m.buffer_rows))
            continue
        for local, at in m.runs:
            apply(m.param, local, None, buffer[at])
