"""The autoscaler on a group the trainer reports as wholly masked (useful share 0 on the wire)."""

from fleet.autoscale import GroupSignal, decide, read_status
from mixrl_wire import pb


def test_a_useful_share_of_zero_is_read_as_zero_and_that_group_gives_a_replica():
    st = pb.StatusResponse(groups=[
        pb.GroupStatus(name="masked", samplers=2, tokens_per_s=900.0, outstanding=16, useful_share=0.0,
                       idle_share=0.0),
        pb.GroupStatus(name="good", samplers=2, tokens_per_s=300.0, outstanding=16, useful_share=0.9,
                       idle_share=0.0)])
    read = read_status(st, {"masked": 8, "good": 8})
    # Set on the wire (HasField) and 0: every token masked -- not "unknown, taken as 1".
    assert read["masked"]["useful_share"] == 0.0
    sig = [GroupSignal(n, 2, 1, 4, 1.0, **read[n]) for n in ("masked", "good")]
    move = decide(sig)
    assert move is not None and (move.donor, move.receiver) == ("masked", "good")
