"""OpenAI-compatible HTTP server: chat/completions/models, health phases, drain and Prometheus metrics."""

from .app import ServerConfig, create_app, start_loading
from .protocol import APIError
from .runner import RunningServer, serve, start_server
from .state import EngineLike, LoadedRuntime, Loader, ServerState

__all__ = [
    "APIError",
    "EngineLike",
    "LoadedRuntime",
    "Loader",
    "RunningServer",
    "ServerConfig",
    "ServerState",
    "create_app",
    "serve",
    "start_loading",
    "start_server",
]
