"""In-process prefill/decode/unified servers and a router on 127.0.0.1 for the disaggregation tests."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from server_support import LiveServer
from sovereign_runtime.assembly import EngineOptions, load_runtime
from sovereign_runtime.disagg.service import DisaggConfig, DisaggService
from sovereign_runtime.engine.speculative import SpeculativeConfig
from sovereign_runtime.server import ServerConfig, create_app
from sovereign_runtime.server.app import STATE

MODEL = "tiny"


class Instance:
    """One `serve` process's app (any role) running in this process."""

    def __init__(
        self,
        checkpoint: Path,
        role: str,
        name: str = MODEL,
        api_key: str | None = None,
        speculative: SpeculativeConfig | None = None,
        **disagg: Any,
    ) -> None:
        options = EngineOptions(
            model_path=checkpoint,
            device="cpu",
            max_model_len=512,
            max_num_seqs=8,
            num_kv_blocks=96,
            speculative=speculative,
        )
        config = DisaggConfig(role=role, kv_host="127.0.0.1", kv_port=0, api_key=api_key, **disagg)
        self.service = DisaggService(config, name)
        runtime = self.service.wrap_runtime(load_runtime(options, lambda *_: None))
        app = create_app(ServerConfig(served_model_name=name, api_key=api_key), runtime=runtime)
        self.service.install(app)
        self.server = LiveServer(app)
        self.url = self.server.url
        self.engine = app[STATE].runtime.engine  # type: ignore[union-attr]

    def kv_health(self) -> dict[str, Any]:
        status, body = self.server.request("GET", "/health/kv")
        assert status in (200, 503), body
        return body  # type: ignore[no-any-return]

    def assert_no_leaks(self, timeout_s: float = 10.0) -> None:
        """Once idle, every KV block is free or an evictable cached page, and invariants hold."""
        llm = getattr(self.engine, "inner", self.engine).engine
        sched = llm.scheduler
        deadline = time.monotonic() + timeout_s
        while sched.has_work or sched.reserved:
            assert time.monotonic() < deadline, "instance did not become idle"
            time.sleep(0.02)
        time.sleep(0.05)  # let the engine thread settle in its wait
        sched.check()
        assert sched.pool.num_free + sched.cache.num_evictable_blocks == sched.pool.num_blocks
        assert not llm.kv_export_hooks
        assert not self.service._rooms

    def close(self) -> None:
        self.server.close()
        getattr(self.engine, "inner", self.engine).shutdown()


class LiveApp:
    """Any aiohttp app (router, fakes) on a free 127.0.0.1 port, on its own loop thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        self.run(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.run(site.start())
        self.port = int(self.runner.addresses[0][1])
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
