"""Runs a training script under torch.profiler and counts its broadcasts (for the tests, under torchrun):

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_broadcasts.py OUT SCRIPT [ARGS ...]

writes OUT.<rank>.json: {"forwards": DDP forward calls, "in_forward": broadcasts inside them, "all": broadcasts,
"per_forward": the broadcasts inside each forward}. With DDP's buffer broadcast (forward_sync_buffers or
broadcast_buffers True, DDP's default) a forward broadcasts the module's buffers whenever the one before it
synchronised gradients (not after a no_sync one): every step, at least once. Without it, a forward's only
broadcasts are the 2 of DDP's one-time bucket rebuild (in one forward, torch 2.14): in_forward <= 2. A broadcast is
the c10d::broadcast_ operator the profiler records in the calling thread, which dist.broadcast and DDP's coalesced
buffer broadcast both dispatch to (the gloo:broadcast event of its work runs in gloo's thread, outside any range).
"""
import json
import os
import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ddp_forward = torch.nn.parallel.DistributedDataParallel.forward


def forward(self, *args, **kw):  # DDP's forward, marked: its buffer broadcast runs inside it, before the module's
    with record_function('ddp_forward'):
        return ddp_forward(self, *args, **kw)


def inside(event, name):
    while event is not None and event.name != name:
        event = event.cpu_parent
    return event is not None


if __name__ == '__main__':
    out, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # (the script's own imports)
    torch.nn.parallel.DistributedDataParallel.forward = forward
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runpy.run_path(script, run_name='__main__')
    events = prof.events()
    casts = [e for e in events if e.name == 'c10d::broadcast_']
    forwards = sorted((e for e in events if e.name == 'ddp_forward'), key=lambda e: e.time_range.start)
    per_forward = [sum(inside(c, 'ddp_forward') and f.time_range.start <= c.time_range.start <= f.time_range.end
                       for c in casts) for f in forwards]
    counts = dict(forwards=len(forwards), in_forward=sum(inside(e, 'ddp_forward') for e in casts), all=len(casts),
                  per_forward=per_forward)
    with open(f'{out}.{os.environ["RANK"]}.json', 'w') as f:
        json.dump(counts, f)
