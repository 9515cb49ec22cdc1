"""A multi-turn ``verifiers.v1`` environment for the tests (``env: verifiers, options: {id: vf_guess}``):
guess a number, the environment plays the user and answers "higher" / "lower" for up to
``turns`` replies; reward ``found`` (1 when a reply names the secret) and a metric of turns."""

import re

import verifiers.v1 as vf


class GuessConfig(vf.TasksetConfig):
    high: int = 8
    turns: int = 3


class GuessData(vf.TaskData):
    secret: int
    turns: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        found, replies = 0.0, 0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                replies += 1
                numbers = [int(n) for n in re.findall(r"\d+", segment.last_reply or "")]
                if task.data.secret in numbers:
                    found = 1.0
                    break
                if replies >= task.data.turns:
                    break
                hint = "higher" if not numbers or numbers[0] < task.data.secret else "lower"
                segment = await interaction.turn(hint)
        trace = interaction.trace
        trace.record_reward("found", found, 1.0)
        trace.record_metric("replies", float(replies))


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    INFINITE = True

    def load(self):
        i = 0
        while True:
            secret = 1 + (7 * i + 3) % self.config.high
            yield GuessTask(GuessData(prompt=f"Guess my number from 1 to {self.config.high}.",
                                      secret=secret, turns=self.config.turns), self.config.task)
            i += 1


__all__ = ["GuessEnv", "GuessTaskset"]
