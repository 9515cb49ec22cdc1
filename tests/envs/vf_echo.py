"""A single-turn ``verifiers.v1`` taskset for the tests (``env: verifiers, options: {id: vf_echo}``):
"say the word"; reward functions ``says_word`` (weight 1) and ``short`` (weight 0.5)."""

import verifiers.v1 as vf

WORDS = ["hello", "world", "answer", "think", "step", "there"]


class EchoConfig(vf.TasksetConfig):
    split: str = "train"
    count: int = 4


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def says_word(self, task, trace) -> float:
        reply = trace.assistant_messages[-1].content if trace.assistant_messages else ""
        return float(task.word in (reply or ""))

    @vf.reward(weight=0.5)
    async def short(self, task, trace) -> float:
        reply = trace.assistant_messages[-1].content if trace.assistant_messages else ""
        return float(len(reply or "") <= 40)


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        words = WORDS[:3] if self.config.split == "train" else WORDS[3:]
        for i in range(self.config.count):
            word = words[i % len(words)]
            yield EchoTask(EchoData(prompt=f"Say the word {word}.", system_prompt="Be brief.",
                                    word=word, name=f"{self.config.split}-{i}"), self.config.task)


__all__ = ["EchoTaskset"]
