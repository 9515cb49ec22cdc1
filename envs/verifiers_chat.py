"""``mixrl_chat``: a tool-less chat harness for ``verifiers`` environments, run in-process.

A ``verifiers.v1`` harness is the agent program of a rollout; its model calls go through the
rollout's interception endpoint (an OpenAI-compatible ``/chat/completions``), which hands them to
the training client and so to mixrl's generate endpoint (``envs.verifiers_endpoint``). The
built-in ``null`` and ``bash`` harnesses are PEP 723 scripts that ``uv`` installs (``openai``,
``mcp``, ...) into the runtime before the first rollout: a sampler host without ``uv`` or without
network access cannot run them. This harness is the same chat loop without the program: one
``/chat/completions`` call per segment, in the rollout's own event loop, with the task's messages
(system prompt and prompt, or the accreted conversation of a multi-turn exchange, which
``Harness.resume`` hands back as a Messages prompt). No tools: the reply ends the segment.

``envs.verifiers_env`` registers it as the harness id ``mixrl_chat`` (under
``verifiers.v1.harnesses``, where ``verifiers`` looks harness ids up), the default of
``env: verifiers``.
"""

from __future__ import annotations

import httpx
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace
from verifiers.v1.types import UserMessage

HARNESS_ID = "mixrl_chat"


class MixrlChatConfig(HarnessConfig):
    """No options of its own (``HarnessConfig``'s ``id`` and timeouts)."""


class MixrlChatHarness(Harness[MixrlChatConfig]):
    """One chat completion per segment, in-process (see the module doc)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: ModelContext, trace: Trace, runtime: Runtime, endpoint: str,
                     secret: str, mcp_urls: dict[str, str], data: TaskData,
                     tool_interception_url: str | None = None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append(message_to_wire(UserMessage(content=prompt)))
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        async with httpx.AsyncClient(timeout=None) as client:
            answer = await client.post(f"{endpoint.rstrip('/')}/chat/completions",
                                       headers={"Authorization": f"Bearer {secret}"},
                                       json={"model": ctx.model, "messages": messages})
        if answer.status_code != 200:
            return ProgramResult(1, "", f"chat completion failed: HTTP {answer.status_code}: "
                                 f"{answer.text[:500]}")
        return ProgramResult(0, answer.text, "")


__all__ = ["MixrlChatConfig", "MixrlChatHarness"]
