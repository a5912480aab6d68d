"""Runs a training script under torch.profiler and counts its broadcasts (for the tests, under torchrun):

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_broadcasts.py OUT SCRIPT [ARGS ...]

writes OUT.<rank>.json: {"forwards": DDP forward calls, "in_forward": broadcasts inside them, "all": broadcasts}.
DDP with its per-forward buffer broadcast (forward_sync_buffers / broadcast_buffers True, DDP's default) broadcasts
the module's buffers inside every forward (one c10d::broadcast_ per bucket of them: 2, float and int64, for
BatchNorm's); without it, in_forward < forwards: DDP's only other broadcasts in a forward are those of its one-time
bucket rebuild, in its second forward (2 on torch 2.14: not buffers, and not per forward). A broadcast is
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
    counts = dict(forwards=sum(e.name == 'ddp_forward' for e in events),
                  in_forward=sum(inside(e, 'ddp_forward') for e in casts), all=len(casts))
    with open(f'{out}.{os.environ["RANK"]}.json', 'w') as f:
        json.dump(counts, f)
