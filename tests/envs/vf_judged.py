"""``vf_guess`` with a second seat ahead of the player (``env: verifiers, options: {id:
vf_judged}``): a ``judge`` agent the environment marks untrainable in ``setup`` finishes first,
without a model call, and records a reward of 5 on its own trace; then the player guesses as in
``vf_guess``. Only the player's trace is trainable, so only its reward is the episode's."""

import verifiers.v1 as vf
from vf_guess import GuessEnv, GuessTaskset


class JudgedEnvConfig(vf.EnvConfig):
    judge: vf.AgentConfig = vf.AgentConfig()
    player: vf.AgentConfig = vf.AgentConfig()


class JudgedEnv(vf.Env[JudgedEnvConfig]):
    async def setup(self, agents):
        agents.judge.trainable = False

    async def run(self, task, agents):
        async with agents.judge.interaction(task) as interaction:
            pass
        interaction.trace.record_reward("judge", 5.0, 1.0)
        await GuessEnv.run(self, task, agents)


JudgedTaskset = GuessTaskset

__all__ = ["JudgedEnv", "JudgedTaskset"]
