"""Render a request's own chat template in a child process, within a time and a size budget.

A chat template is a program. Jinja's sandbox (which transformers renders in) stops attribute
escapes and ranges over 100,000 items, but not `{% for i in range(10**5) %}{% for j in
range(10**5) %}...` (hours of CPU) nor `{{ 'a' * 10**10 }}` (all the memory). So a request's
template runs in one long-lived child process, `python -I` on this file, which speaks JSON lines on
its stdin/stdout: the server kills it past the time budget (and starts the next one at once), its
address space is capped, and what it renders is capped in characters.

This file runs as a script in the child: it imports nothing from tandem (whose package imports
torch), only transformers' renderer, so that the templates render exactly as apply_chat_template
renders them.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

READY_TIMEOUT = 120.0  # the child imports transformers' renderer (about a second, longer on a busy host)


class TemplateError(ValueError):
    """The template failed, ran past the time budget or rendered too much: the request's fault."""


class TemplateSandbox:
    """One renderer process, reused; calls are serialized on one thread of their own, so a slow
    template delays only other requests' templates, never tokenization or the event loop."""

    def __init__(self, variables: dict[str, Any], timeout: float = 2.0, max_chars: int = 1_000_000,
                 max_memory_bytes: int = 512 << 20) -> None:
        self.variables = variables  # what apply_chat_template passes besides the messages: the special tokens
        self.timeout, self.max_chars, self.max_memory_bytes = timeout, max_chars, max_memory_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._buffer = b""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-template")
        self.kills = 0

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._spawn)

    async def render(self, messages: list[dict[str, Any]], template: str, add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
        """kwargs: the request's chat_template_kwargs (the special tokens' variables win over them)."""
        job = {"messages": messages, "template": template, "add_generation_prompt": add_generation_prompt,
               "tools": tools, "variables": {**(kwargs or {}), **self.variables}}
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._render, job)

    def close(self) -> None:
        self._kill()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- on the sandbox's thread ----------------------------------------------------------------
    def _spawn(self) -> None:
        self._kill()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(self.max_chars), str(self.max_memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._ready, self._buffer = False, b""

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            self._proc.wait()
        self._proc = None

    def _render(self, job: dict[str, Any]) -> str:
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        assert self._proc is not None and self._proc.stdin is not None
        if not self._ready:
            if self._read_line(time.monotonic() + READY_TIMEOUT) is None:
                self._kill()
                raise RuntimeError("the chat template renderer did not start")
            self._ready = True
        try:
            self._proc.stdin.write(json.dumps(job).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._spawn()
            raise RuntimeError("the chat template renderer exited; try again") from None
        reply = self._read_line(time.monotonic() + self.timeout)
        if reply is None:
            timed_out = self._proc.poll() is None
            self._spawn()  # the next request finds a fresh renderer already importing
            if timed_out:
                self.kills += 1
                raise TemplateError(f"the chat template ran for more than {self.timeout:g} s")
            raise TemplateError("the chat template crashed its renderer")
        if "error" in reply:
            raise TemplateError(f"cannot apply the chat template: {reply['error']}")
        return reply["text"]

    def _read_line(self, deadline: float) -> dict[str, Any] | None:
        """The child's next JSON line, or None if it has not finished one by the deadline (or died)."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


# -- the child -------------------------------------------------------------------------------------
def _child_main(max_chars: int, max_memory_bytes: int) -> None:
    import resource
    import threading

    from transformers.utils.chat_template_utils import render_jinja_template

    parent = os.getppid()

    def exit_with_parent() -> None:  # a child stuck in a template must not outlive a killed server
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    # Cap the address space at what the imports took plus the budget: a huge string is a MemoryError.
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + max_memory_bytes, used + max_memory_bytes))
    out = sys.stdout.buffer

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    reply({"ready": True})
    for line in sys.stdin.buffer:
        job = json.loads(line)
        try:
            rendered, _ = render_jinja_template([job["messages"]], tools=job.get("tools"),
                                                chat_template=job["template"],
                                                add_generation_prompt=job["add_generation_prompt"],
                                                **job["variables"])
            text = rendered[0]
            if len(text) > max_chars:
                reply({"error": f"it rendered more than {max_chars} characters"})
            else:
                reply({"text": text})
        except MemoryError:
            reply({"error": f"it used more than {max_memory_bytes >> 20} MiB"})
        except Exception as e:  # the template's own error (syntax, raise_exception, sandbox)
            reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
