"""An outside environment whose episodes want each turn's behaviour log-probs (as ``env:
verifiers`` does, to answer its generate calls): it answers with them, scaled to token ids, so a
test sees what reached the episode through ``envs.isolated``'s worker."""

from envs.base import Environment, Episode, StepResult, Task


class LogprobEpisode(Episode):
    wants_logprobs = True

    def __init__(self):
        self.prompt, self.stop_token_ids, self.turn_logprobs = [1, 2], (3,), None

    def step(self, generated: list[int]) -> StepResult:
        seen = [round(-lp * 10) for lp in (self.turn_logprobs or [])]
        return StepResult(seen, 0.0, len(seen) == 0, "answered" if not seen else None)

    @property
    def reward_parts(self) -> dict:
        # one well-formed part and ones the sampler drops (a name with a space, a non-number)
        return {"turns_seen": 2.0, "bad name": 1.0, "text": "x"}


class LogprobEnv(Environment):
    def sample_task(self, rng, task_id: str) -> Task:
        return Task(task_id, self.name, {})

    def start(self, task: Task) -> Episode:
        return LogprobEpisode()
