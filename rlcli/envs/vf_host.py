"""verifiers' own chat program, run with this Python instead of a uv-managed one.

verifiers' ``null`` harness (its plain chat loop; tools come from the task's MCP servers)
runs a PEP 723 script that ``uv`` first syncs into a fresh environment, which needs uv and
a package index on every rollout host. This harness runs the very same script
(``CHAT_PROGRAM_SOURCE``: verifiers' multi-turn tool loop, unmodified) with the current
interpreter, which has its dependencies whenever verifiers is installed. Everything else
(interception, the trace, resumed segments for multi-turn environments) is verifiers'.

verifiers finds a harness by id as a package exporting one ``Harness`` through ``__all__``,
first under ``verifiers.v1.harnesses``; this module registers itself there as
``rlcli_host``, so ``harness = {id = "rlcli-host"}`` names it.
"""

import hashlib
import json
import sys

from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

__all__ = ["HostChatHarness"]

HARNESS_ID = "rlcli-host"


class HostChatHarnessConfig(HarnessConfig):
    pass


class HostChatHarness(Harness[HostChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system_prompt, prompt = self.resolve_prompt(data)
        args = [f"--base-url={endpoint}", f"--api-key={secret}", f"--model={ctx.model}"]
        if tool_interception_url:
            args.append(f"--tool-interception-url={tool_interception_url}")
        if system_prompt:
            args.append(f"--system-prompt={system_prompt}")
        if mcp_urls:
            servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
            args.append("--mcp-config=" + json.dumps({"mcpServers": servers}))
        if isinstance(prompt, str):
            args.append(f"--prompt={prompt}")
        elif prompt is not None:
            path = f".vf-initial-messages-{trace.id}.json"
            await runtime.write(path, json.dumps([message_to_wire(m) for m in prompt]).encode())
            args.append(f"--initial-messages-file={path}")
        script = f".vf-chat-{hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()[:16]}.py"
        await runtime.write(script, CHAT_PROGRAM_SOURCE.encode())
        return await runtime.run_program([sys.executable, script, *args], {**self.config.resolved_env})


sys.modules.setdefault("verifiers.v1.harnesses.rlcli_host", sys.modules[__name__])
