"""The layout of a run's ranks and servers (pure: no Ray): which slot each role gets, how slots are
shared, and the refusal of a layout that does not fit, with what was asked and what there is."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.launch.placement import (
    NodeResources,
    PlacementError,
    PlacementRequest,
    plan_layout,
)


def _cpu_nodes(*cpus: float) -> list[NodeResources]:
    return [NodeResources(f"node{i}", f"10.0.0.{i}", c) for i, c in enumerate(cpus)]


def _gpu_nodes(*gpus: int, cpus: int = 16) -> list[NodeResources]:
    return [NodeResources(f"node{i}", f"10.0.0.{i}", cpus, g) for i, g in enumerate(gpus)]


def test_on_one_cpu_slot_actor_critic_and_reference_take_turns() -> None:
    """PPO with a critic and a KL reference on a 2-core laptop: one slot, three sharers."""
    request = PlacementRequest(actor_ranks=1, critic_ranks=1, reference=True)
    layout = plan_layout(request, _cpu_nodes(2))
    assert not layout.gpu and layout.slot_count == 1
    assert layout.roles == {"actor": (0,), "reference": (0,), "critic": (0,)}
    assert layout.bundle == {"CPU": 1.0}
    assert layout.sharers(0) == 3
    assert layout.share(0) == {"CPU": pytest.approx(0.3333)}
    assert 3 * layout.share(0)["CPU"] <= 1.0


def test_cpu_roles_share_slots_and_servers_get_their_own() -> None:
    request = PlacementRequest(actor_ranks=2, critic_ranks=3, reference=True, rollout_gpus=2)
    layout = plan_layout(request, _cpu_nodes(4, 2))
    assert layout.roles["critic"] == (0, 1, 2) and layout.roles["actor"] == (0, 1)
    assert layout.engines == ((3,), (4,)) and layout.slot_count == 5
    assert [layout.sharers(s) for s in range(5)] == [3, 3, 1, 1, 1]


def test_gpu_layout_disjoint_as_slime() -> None:
    request = PlacementRequest(
        actor_ranks=4, critic_ranks=2, reference=True, rollout_gpus=4, gpus_per_engine=2
    )
    layout = plan_layout(request, _gpu_nodes(8, 8))
    assert layout.gpu and layout.bundle == {"GPU": 1.0, "CPU": 1.0}
    assert layout.roles["actor"] == layout.roles["reference"] == (0, 1, 2, 3)
    assert layout.roles["critic"] == (4, 5)
    assert layout.engines == ((6, 7), (8, 9)) and layout.slot_count == 10
    assert layout.share(0) == {"GPU": 0.5, "CPU": 0.5}  # actor and reference
    assert layout.share(6) == {"GPU": 1.0, "CPU": 1.0}  # an engine's host alone


def test_gpu_layout_colocated() -> None:
    request = PlacementRequest(actor_ranks=4, rollout_gpus=4, gpus_per_engine=2, colocate=True)
    layout = plan_layout(request, _gpu_nodes(2, 2))
    assert layout.slot_count == 4 and layout.engines == ((0, 1), (2, 3))
    assert [layout.sharers(s) for s in range(4)] == [2, 1, 2, 1]
    assert "rollout engine 1: GPUs 2-3" in layout.describe()


def test_a_layout_that_does_not_fit_says_what_was_asked_and_what_there_is() -> None:
    request = PlacementRequest(actor_ranks=3)
    with pytest.raises(PlacementError) as caught:
        plan_layout(request, _cpu_nodes(2))
    message = str(caught.value)
    assert "it needs 3 CPU slots and the cluster has room for 2" in message
    assert "actor: 3 rank(s) on CPU slots 0-2" in message
    assert "1 node(s): 10.0.0.0 [node0] (2 CPUs, no GPUs)" in message
    assert "--actor-num-gpus-per-node" in message


def test_an_engine_larger_than_any_node_is_refused() -> None:
    request = PlacementRequest(actor_ranks=2, rollout_gpus=4, gpus_per_engine=4)
    with pytest.raises(PlacementError, match="a rollout engine needs 4 GPUs on one node"):
        plan_layout(request, _gpu_nodes(3, 3))


def test_gpu_slots_also_need_a_cpu_each() -> None:
    with pytest.raises(PlacementError, match="room for 2"):
        plan_layout(PlacementRequest(actor_ranks=4), _gpu_nodes(4, cpus=2))


def test_requests_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of gpus_per_engine"):
        PlacementRequest(actor_ranks=1, rollout_gpus=3, gpus_per_engine=2)
    with pytest.raises(ValueError, match="colocated"):
        PlacementRequest(actor_ranks=1, rollout_gpus=2, colocate=True)


@st.composite
def _requests(draw: st.DrawFn) -> PlacementRequest:
    actor = draw(st.integers(1, 8))
    k = draw(st.integers(1, 4))
    colocate = draw(st.booleans())
    engines = draw(st.integers(0, (actor // k) if colocate else 3))
    return PlacementRequest(
        actor_ranks=actor,
        critic_ranks=draw(st.integers(0, 8)),
        reference=draw(st.booleans()),
        rollout_gpus=engines * k,
        gpus_per_engine=k,
        colocate=colocate,
    )


@given(
    _requests(),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), min_size=1, max_size=4),
)
def test_every_layout_fits_or_is_refused(
    request: PlacementRequest, shapes: list[tuple[int, int]]
) -> None:
    nodes = [NodeResources(f"n{i}", f"10.0.0.{i}", c, g) for i, (c, g) in enumerate(shapes)]
    try:
        layout = plan_layout(request, nodes)
    except PlacementError as exc:
        assert "The cluster has" in str(exc)
        return
    assert layout.slot_count <= sum(n.slots(layout.gpu) for n in nodes)
    assert len(layout.roles["actor"]) == request.actor_ranks
    assert len(layout.roles.get("critic", ())) == request.critic_ranks
    assert len(layout.engines) == request.engines
    used = {s for slots in layout.roles.values() for s in slots}
    used |= {s for slots in layout.engines for s in slots}
    assert used == set(range(layout.slot_count))
    for slot in range(layout.slot_count):
        # The processes in a slot never ask for more than the slot holds.
        assert layout.sharers(slot) * layout.share(slot)["CPU"] <= 1.0
    if layout.gpu:  # on GPUs the critic and disjoint servers have GPUs of their own
        critic = set(layout.roles.get("critic", ()))
        assert not critic & set(layout.roles["actor"])
        if not request.colocate:
            assert not {s for e in layout.engines for s in e} & (
                critic | set(layout.roles["actor"])
            )
