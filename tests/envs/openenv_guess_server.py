"""A small OpenEnv server built with the package's own server framework (``openenv.core``'s
``create_app``, served by uvicorn on loopback): guess a number in [1, 8] chosen from the reset
seed; reward 1 when found. ``python openenv_guess_server.py [PORT]`` prints its port (without
PORT, one the system picks), then serves on 127.0.0.1."""

import random
import socket
import sys
from typing import Any

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessServerEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state, self.secret = State(step_count=0), 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
        self.secret = random.Random(seed).randint(1, 8)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text=f"Guess a number from 1 to 8 (game {seed % 1000}).", reward=0.0)

    def step(self, action: GuessAction):
        self._state.step_count += 1
        digits = "".join(c for c in action.message if c.isdigit())
        if digits == str(self.secret):
            return GuessObservation(text="right", done=True, reward=1.0)
        hint = "higher" if digits and int(digits) < self.secret else "lower"
        return GuessObservation(text=hint, done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessServerEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=16)

if __name__ == "__main__":
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    sys.exit(0)
