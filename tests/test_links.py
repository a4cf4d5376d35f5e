"""Link presets: datasheet peaks at published all-to-all efficiencies, and the two-level
NVLink + IB preset priced from closed-form ``[src, dst]`` byte matrices."""

from __future__ import annotations

import pytest
import torch

from lrmoe.errors import LrmoeError
from lrmoe.policy.plan import native_plan
from lrmoe.sim.cost import step_times
from lrmoe.sim.links import LINKS, exchange_time, get_link, rank_bytes
from lrmoe.sim.vstats import Timers, VirtualStats, pair_ratios

TWO_RANKS = torch.ones(2, 2, dtype=torch.long)  # one pair per (home rank, expert): 4 pairs


@pytest.mark.parametrize("name,peak,achieved", [("nvlink", 450e9, 370e9), ("ib", 50e9, 48e9),
                                                ("pcie", 64e9, 28e9)])
def test_each_flat_preset_runs_at_its_published_all_to_all_figure(name, peak, achieved):
    link = get_link(name)
    assert link.bandwidth_Bps == peak and link.effective_Bps == pytest.approx(achieved)
    assert "published, not measured by us" in link.efficiency_source
    # closed form: rank 0 sends 3 GB to 1 and 1 GB to 2; rank 2 sends 2 GB to 0
    G = 3
    b = torch.tensor([[7e9, 3e9, 1e9], [0, 0, 0], [2e9, 0, 5e9]])  # diagonal: no link
    lat = link.latency_s * (G - 1)
    want = [4e9 / achieved + lat, 3e9 / achieved + lat, 2e9 / achieved + lat]
    assert exchange_time(b, link) == pytest.approx(want, rel=1e-12)


def test_two_level_preset_prices_intra_and_inter_node_bytes_apart():
    """EP 16 on two nodes of 8: NVLink inside a node, IB between nodes, at once."""
    link = get_link("nvlink+ib")
    nv, ib = LINKS["nvlink"], LINKS["ib"]
    assert link.node_size == 8 and link.inter == ib
    G = 16
    b = torch.zeros(G, G)
    b[0, 1] = 37e9     # intra-node: 0.1 s at 370 GB/s
    b[0, 9] = 2.4e9    # inter-node: 0.05 s at 48 GB/s
    b[3, 12] = 9.6e9   # inter-node: 0.2 s
    b[3, 4] = 3.7e9    # intra-node: 0.01 s
    lat_in, lat_out = 7 * nv.latency_s, 8 * ib.latency_s
    t = exchange_time(b, link)
    assert t[0] == pytest.approx(max(0.1 + lat_in, 0.05 + lat_out))  # NVLink-bound
    assert t[3] == pytest.approx(max(0.01 + lat_in, 0.2 + lat_out))  # IB-bound
    assert t[1] == pytest.approx(max(0.1 + lat_in, lat_out))         # receives intra
    assert t[9] == pytest.approx(max(lat_in, 0.05 + lat_out))        # receives inter
    assert t[12] == pytest.approx(max(lat_in, 0.2 + lat_out))
    # the same bytes on one flat NVLink fabric would be far cheaper for rank 3
    assert exchange_time(b, nv)[3] < t[3] / 5
    # within one node the preset is NVLink
    small = torch.rand(8, 8) * 1e9
    assert exchange_time(small, link) == pytest.approx(exchange_time(small, nv))


def test_step_times_use_the_byte_matrices_on_the_two_level_link():
    """The emulator's stage times price each exchange's [src, dst] matrix: an exchange
    with every byte between nodes costs its IB time, not NVLink's."""
    G = 16
    st = VirtualStats(native_plan(torch.ones(G, G, dtype=torch.long)))
    b = torch.zeros(G, G)
    for g in range(G):
        b[g, (g + 8) % G] = 4.8e9  # every rank sends 0.1 s of IB traffic to the other node
    st.bytes_GG["fwd_dispatch"] = b
    t = step_times(st, get_link("nvlink+ib"))
    ib = LINKS["ib"]
    assert t.fwd_dispatch == pytest.approx(0.1 + 8 * ib.latency_s)
    assert step_times(st, LINKS["nvlink"]).fwd_dispatch < t.fwd_dispatch / 5


def test_unknown_link_is_one_readable_error():
    with pytest.raises(LrmoeError, match="nvlink\\+ib"):
        get_link("infiniband")


def test_rank_bytes_is_the_larger_of_sent_and_received_without_the_self_copy():
    b = torch.tensor([[7e9, 3e9, 1e9], [0, 0, 0], [2e9, 0, 5e9]])
    # sent (off the diagonal) 4, 0, 2 GB; received 2, 3, 1 GB
    assert rank_bytes(b) == [4e9, 3e9, 2e9]


def test_count_exchange_and_a_modelled_layer_rerun_are_charged_from_their_bytes():
    """By hand on IB (48 GB/s, one peer): ``count_exchange`` is the count all-gather plus
    the sampled estimator's count exchange; a modelled whole-layer checkpoint's
    ``bwd_recompute`` is the slowest rank's forward experts, dispatch and combine again."""
    st = VirtualStats(native_plan(TWO_RANKS))
    st.bytes_GG["count_allgather"] = torch.tensor([[0, 4.8e9], [4.8e9, 0]])  # 0.1 s each rank
    st.bytes_GG["bwd_count_exchange"] = torch.tensor([[0, 2.4e9], [2.4e9, 0]])  # 0.05 s
    st.recompute_mode = "layer"
    st.expert_ms["fwd"] = [30.0, 10.0]
    st.bytes_GG["fwd_dispatch"] = torch.tensor([[0, 4.8e9], [0, 0]])  # 0.1 s, sender and receiver
    st.bytes_GG["fwd_combine"] = torch.tensor([[0, 0], [2.4e9, 0]])  # 0.05 s
    ib = LINKS["ib"]
    t = step_times(st, ib)
    assert t.count_exchange == pytest.approx(0.15 + 2 * ib.latency_s)
    assert t.bwd_recompute == pytest.approx(0.03 + 0.15 + 2 * ib.latency_s)


def test_timers_add_up_a_ranks_regions_per_bucket():
    t = Timers(2, torch.device("cpu"))
    t.add("expert_fwd", 0, 1.5)
    t.add("expert_fwd", 0, 2.0)
    t.add("expert_fwd", 1, 1.0)
    t.add("select", 1, 0.25)
    assert t.ms == {"expert_fwd": [3.5, 1.0], "select": [0.0, 0.25]}


def test_measured_control_plane_stages_charge_their_slowest_rank():
    st = VirtualStats(native_plan(TWO_RANKS))
    st.stage_ms = {"plan": [1.0, 1.0], "select": [2.0, 3.0], "gather": [5.0, 4.0], "local": [0.5, 7.0]}
    t = step_times(st, LINKS["ib"])
    assert (t.plan, t.select, t.gather, t.local) == pytest.approx((1e-3, 3e-3, 5e-3, 7e-3))


def test_pair_ratios_count_recomputed_rows_of_every_rank():
    plan = native_plan(TWO_RANKS)
    r = pair_ratios([plan, plan], [[1, 2], None])  # 3 of 8 pairs recomputed
    assert r == {"keep_ratio": 1.0, "retain_ratio": 1.0, "recompute_ratio": 3 / 8}
