"""Helper process for test_a_failed_group_init_leaves_the_process_able_to_form_the_next.

``fail_first``: try a 2-member group whose peer never comes (it times out), then join the
real one; ``fresh``: join the real one straight away. Both then all-reduce their rank + 1."""

import datetime
import sys

import torch
import torch.distributed as dist

from runtime.errors import PeerFailure
from runtime.process_group import init_group

mode, host, port, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=20))
if mode == "fail_first":
    try:
        init_group("gloo", dist.PrefixStore("edt/1/", store), 0, 2,
                   datetime.timedelta(seconds=1))
        raise SystemExit("the group without its peer formed")
    except PeerFailure:
        pass
    store.set("failed-once", "1")
init_group("gloo", dist.PrefixStore("edt/2/", store), rank, 2, datetime.timedelta(seconds=20))
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(int(t.item()), flush=True)
dist.destroy_process_group()
