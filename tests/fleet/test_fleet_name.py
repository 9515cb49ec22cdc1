"""Which fleet ``mixrl-fleet status`` / ``down`` act on without --name: ``up`` named it after the
config's run.name, which they do not read, so they take the cluster's only fleet."""

import pytest

from fleet.cli import fleet_name
from fleet.spec import FleetError


def test_status_and_down_find_the_only_fleet_without_name():
    assert fleet_name(None, ["local_mixed"]) == "local_mixed"
    assert fleet_name("other", ["local_mixed"]) == "other"  # --name wins
    assert fleet_name(None, []) is None  # none runs: the commands say so (not "no fleet named 'run'")
    with pytest.raises(FleetError, match=r"2 fleets on this cluster \(a, b\): pass --name"):
        fleet_name(None, ["b", "a"])
