"""How a frontend's link decides to poll for answers (server/edge/link.py): its policy hears of the
answer times of the models it polls for, whether or not an answer was polled."""
from __future__ import annotations

from shmserve.server.edge.link import BrokerLink


def test_a_slow_models_answers_leave_the_polling_for_quick_ones_alone():
    """A model whose answers take 4 ms beside one that takes 0.2 ms, half the traffic each: the
    loop polls for the quick one's answers and not the slow one's, as if the slow one were not
    there; counting both, the average would be over the budget and nothing would be polled."""
    link = BrokerLink("unit", 1 << 20, poll_us=500)
    for _ in range(100):
        link._took("add_sub", 0.0002)
        link._took("slow", 0.004)
    assert link._spin.budget() == 0.0005

