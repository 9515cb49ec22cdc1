"""A sampler told to stop mid-round returns within a decode step, not after the round's generate
call: the engine ends its requests (``stopped``) and the loop submits none of them (the leases
expire and the trainer hands the tasks out again)."""

from __future__ import annotations

import threading
import time

import pytest
from tiny_models import char_engine

from mixrl_wire import pb
from sampler_torch.loop import SamplerLoop

NEW_TOKENS = 20_000  # minutes of decoding on this CPU if the call ran to its length


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return char_engine(tmp_path_factory)


def test_a_stop_mid_generate_ends_the_round_unsubmitted(engine):
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, head_k=2, max_new_tokens=NEW_TOKENS)
    tasks = [pb.Task(task_id=i, prompt_ids=[5, 6, 7], group_size=2, sample_indices=[0, 1], sampling=sampling,
                     lease_id=f"lease{i}") for i in range(2)]
    # No client: a round that tried to submit (or to read its leases) would raise.
    loop = SamplerLoop(None, engine)
    steps = []
    started = threading.Event()
    real_generate = engine.generate

    def generate(prompts, params, **kw):  # the engine's own call, with a step counter beside it
        def on_step(step):
            steps.append(step)
            started.set()
        return real_generate(prompts, params, on_step=on_step, **kw)

    loop.engine = type("Counted", (), {"generate": staticmethod(generate), "version": 0})()
    loop._stoppable = True  # the wrapper forwards should_stop to the engine
    done = threading.Event()
    worker = threading.Thread(target=lambda: (loop.run_round(tasks), done.set()), daemon=True)
    worker.start()
    assert started.wait(120)
    time.sleep(0.2)
    stopped_at = time.monotonic()
    loop.stop()
    assert done.wait(10), "the round did not return after stop()"
    took = time.monotonic() - stopped_at
    assert took < 5, took
    assert 0 < len(steps) < NEW_TOKENS  # it ended mid-call, not at the requests' length
    assert loop.stats.rounds == 0 and loop.stats.accepted == 0 and loop.active_samples == 0


def test_the_loop_passes_should_stop_only_to_a_backend_that_takes_it(engine):
    seen = {}

    class Plain:  # a backend whose generate has no should_stop (a server client, say)
        version = 0

        def generate(self, prompts, params):
            seen["plain"] = True
            return engine.generate(prompts, params)

    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, head_k=2, max_new_tokens=2)
    items = [(pb.Task(task_id=0, prompt_ids=[5, 6], group_size=1, sample_indices=[0], sampling=sampling), 0)]
    recs = SamplerLoop(None, Plain())._generate(items)
    assert seen == {"plain": True} and len(recs[0]["token_ids"]) == 2
    stoppable = SamplerLoop(None, engine)
    stoppable.stop()  # already told: the engine ends the request before its first step
    (rec,) = stoppable._generate(items)
    assert rec["finish_reason"] == "stopped" and rec["token_ids"] == []
