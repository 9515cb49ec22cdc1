# guess_env.py
import re

from envs.base import Environment, Episode, StepResult, Task


class GuessEpisode(Episode):
    def __init__(self, env, secret: int):
        self.env, self.secret, self.turns = env, secret, 0
        self.prompt = env.encode(f"Guess my number (1-{env.high}). Reply with a number.\n")
        self.stop_token_ids = tuple(t for t in (env.eos,) if t is not None) or (env.encode("\n")[-1],)

    def step(self, generated: list[int]) -> StepResult:
        self.turns += 1
        found = re.search(r"-?\d+", self.env.decode(generated))
        if found is None:
            self.note_error("no_number")  # counted as env/<name>/errors/no_number
            return StepResult([], 0.0, True, "empty_reply")
        guess = int(found.group())
        if guess == self.secret:
            return StepResult([], 1.0, True, "answered")
        if self.turns >= self.env.max_turns:
            return StepResult([], 0.0, True, "turn_limit")
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(self.env.encode(f" {hint}\n"), 0.0, False)


class Guess(Environment):
    """A secret in [1, high]; up to max_turns guesses, told higher or lower after each."""

    def __init__(self, tokenizer, difficulty: int = 1, *, high: int = 16, max_turns: int = 5):
        super().__init__(tokenizer, difficulty)
        self.high, self.max_turns = high, max_turns

    def sample_task(self, rng, task_id: str) -> Task:
        return Task(task_id, self.name, {"secret": int(rng.integers(1, self.high + 1))})

    def start(self, task: Task) -> Episode:
        return GuessEpisode(self, int(task.payload["secret"]))
