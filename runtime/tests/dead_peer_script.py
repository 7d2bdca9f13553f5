"""Helper process for test_forming_a_group_gives_up_on_a_dead_member_but_collectives_wait.

``publish``: join a 3-member group as rank 2 (the test kills it once its address is in the
store); ``form``: join it as rank 0 or 1 with a one-second connect timeout and a collective
timeout of an hour, say how long until that failed, then form a 2-member group and
all-reduce after rank 1 was slow for three times the connect timeout."""

import datetime
import sys
import time

import torch
import torch.distributed as dist

from runtime.errors import PeerFailure
from runtime.process_group import destroy_group, init_group

mode, host, port, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
HOUR, SECOND = datetime.timedelta(hours=1), datetime.timedelta(seconds=1)
if mode == "publish":
    init_group("gloo", dist.PrefixStore("edt/1/", store), 2, 3, HOUR, connect_timeout=SECOND)
    raise SystemExit("formed without the others")
started = time.monotonic()
try:
    init_group("gloo", dist.PrefixStore("edt/1/", store), rank, 3, HOUR, connect_timeout=SECOND)
    raise SystemExit("the group with a dead member formed")
except PeerFailure as exc:
    print(f"gave up after {time.monotonic() - started:.1f}s: {exc}", flush=True)
# gloo's waiting side may give up on the dead member seconds after the other member did.
# The runtime's store then waits for an address as long as the peer timeout; this bare
# TCPStore would wait only the one-second connect timeout, so the two meet here first.
store.set(f"met/{rank}", "1")
store.wait(["met/0", "met/1"], datetime.timedelta(seconds=60))
init_group("gloo", dist.PrefixStore("edt/2/", store), rank, 2, HOUR, connect_timeout=SECOND)
if rank == 1:
    time.sleep(3)  # a slow step: the collectives wait as long as a peer is alive
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(f"sum {int(t.item())}", flush=True)
destroy_group()
