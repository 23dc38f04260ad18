"""verifiers' own chat program, run inside this process instead of a uv-managed subprocess.

verifiers' ``null`` harness (its plain multi-turn chat loop; tools come from the task's
MCP servers) runs a PEP 723 script that ``uv`` first syncs into a fresh environment: that
needs uv and a package index on every rollout host, and costs a Python start-up (openai,
mcp) on every segment of every episode. This harness executes the very same script text
(``CHAT_PROGRAM_SOURCE``: verifiers' chat loop, compaction and MCP client, unmodified)
once, as a module of this process, and drives one conversation per segment with its own
functions, as its ``main()`` does. verifiers allows this: a harness may run its loop
in-process as long as every model call goes through the interception endpoint, which it
does (the trace is built there). Local ``bash``/``edit`` tools are not offered, exactly as
in ``null``. Everything else (interception, the trace, resumed segments for multi-turn
environments, scoring) is verifiers'.

verifiers finds a harness by id as a package exporting one ``Harness`` through ``__all__``,
first under ``verifiers.v1.harnesses``; this module registers itself there as
``rlcli_host``, so ``harness = {id = "rlcli-host"}`` names it.
"""

import argparse
import json
import sys
import traceback
from contextlib import AsyncExitStack

from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult

__all__ = ["HostChatHarness"]

_program: dict | None = None


def chat_program() -> dict:
    """The names verifiers' chat program defines (executed once, not as ``__main__``)."""
    global _program
    if _program is None:
        namespace = {"__name__": "rlcli_verifiers_chat_program"}
        exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
        _program = namespace
    return _program


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
        servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        args = argparse.Namespace(
            base_url=endpoint, api_key=secret, model=ctx.model, system_prompt=system_prompt or "",
            prompt=prompt if isinstance(prompt, str) else "", initial_messages_file="",
            mcp_config=json.dumps({"mcpServers": servers}) if servers else "",
            tool_interception_url=tool_interception_url or "", bash=False, compaction=False, summarize_at_tokens=None,
            edit=False, search=False, serper_key="")
        initial = [message_to_wire(m) for m in prompt] if prompt is not None and not isinstance(prompt, str) else []
        try:
            await _converse(chat_program(), args, initial)
        except SystemExit as e:  # the program's way of reporting a lost model connection
            return ProgramResult(exit_code=int(e.code or 0), stdout="", stderr=traceback.format_exc())
        except Exception:
            return ProgramResult(exit_code=1, stdout="", stderr=traceback.format_exc())
        return ProgramResult(exit_code=0, stdout="", stderr="")


async def _converse(p: dict, args: argparse.Namespace, initial: list[dict]) -> None:
    """One segment: what the program's ``main()`` does after parsing its arguments."""
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                         timeout=httpx.Timeout(None, connect=5.0))
    tool_client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) if args.tool_interception_url else None
    try:
        async with AsyncExitStack() as stack:
            config = json.loads(args.mcp_config or "{}")
            tools, dispatch, servers = [], {}, {}
            if config.get("mcpServers"):
                tools, dispatch, servers = await p["connect_mcp"](config, stack, set())
            messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
            if initial:
                messages.extend(initial)
            elif args.prompt:
                messages.append({"role": "user", "content": args.prompt})
            compactor = p["Compactor"](client, args.model, tools, False, None)
            compactor.note_good(messages)
            await p["run_chat_loop"](args, compactor, messages, dispatch, servers, tool_client)
    finally:
        if tool_client is not None:
            await tool_client.aclose()
        await client.close()


sys.modules.setdefault("verifiers.v1.harnesses.rlcli_host", sys.modules[__name__])
