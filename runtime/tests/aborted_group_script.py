"""Helper process for test_a_broadcast_from_a_silent_rank_0_fails_when_its_group_is_aborted.

Both ranks form a gloo group whose collectives would wait 120 s. Rank 0 then waits for the
test's word and never broadcasts. Rank 1 is told its group is aborted (as the driver says
when a member is lost), ``before`` it posts the broadcast's receive or ``while`` it waits;
it prints how long the broadcast took to fail and whether throwing the group away returned."""

import datetime
import sys
import threading
import time

import torch.distributed as dist

from runtime.errors import PeerFailure
from runtime.process_group import abort_group, broadcast_blob, destroy_group, init_group

host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
init_group("gloo", dist.PrefixStore("edt/1/", store), rank, 2,
           datetime.timedelta(seconds=120), generation=1)
if rank == 0:
    store.set("ready", "1")
    store.wait(["done"], datetime.timedelta(seconds=60))
    sys.exit(0)
# Rank 1's side of the group can be up before rank 0's: an abort then would fail rank 0's
# own set-up ("Connection closed by peer"), not the broadcast this script is about.
store.wait(["ready"], datetime.timedelta(seconds=60))
mode = sys.argv[4]
if mode == "before":
    assert abort_group(1)
else:  # while the receive waits, as the link's thread does
    threading.Timer(1.0, abort_group, args=(1,)).start()
t0 = time.monotonic()
try:
    broadcast_blob(None, rank)
    print("the broadcast completed", flush=True)
except PeerFailure as exc:
    print(f"failed after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
destroy_group()
print("destroyed", flush=True)
store.set("done", "1")
