"""``init_parallel``'s process groups under torch.distributed (gloo): an EP group is ``ep``
consecutive ranks, an expert-DP group the ranks at the same EP index, and both carry
collectives among exactly those ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_util import run_world
from lrmoe.parallel.groups import init_parallel


def _check_groups(rank: int, world: int, ep: int) -> None:
    ctx = init_parallel(ep, "cpu")
    want_ep = [rank // ep * ep + i for i in range(ep)]
    want_dp = list(range(rank % ep, world, ep))
    assert (ctx.world, ctx.rank, ctx.ep_size, ctx.ep_rank) == (world, rank, ep, rank % ep)
    assert dist.get_process_group_ranks(ctx.ep_group) == want_ep
    assert dist.get_process_group_ranks(ctx.expert_dp_group) == want_dp
    for group, want in ((ctx.ep_group, want_ep), (ctx.expert_dp_group, want_dp)):
        t = torch.tensor([float(2**rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(2**r for r in want)  # each member's bit, no other's


@pytest.mark.parametrize("world,ep", [(4, 2), (4, 4)])
def test_ep_and_expert_dp_groups(tmp_path, world, ep):
    run_world(world, _check_groups, ep, tmp_path=tmp_path)
