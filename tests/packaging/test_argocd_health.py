"""The Argo CD health check for LLMDeployment, run under Lua 5.1 as Argo CD's GopherLua does.

Each fixture in fixtures/argocd/ holds a live object and the status/message Argo CD must show.
The script runs in an environment holding only `obj` and the few base functions GopherLua's
sandbox offers, so a dependency on anything else fails here rather than in Argo CD.
"""

from __future__ import annotations

from pathlib import Path

import lupa
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "charts/sovereign/files/argocd-health.lua"
FIXTURES = sorted((Path(__file__).parent / "fixtures/argocd").glob("*.yaml"))

try:  # lupa >= 2 ships one module per Lua version; Argo CD's GopherLua implements 5.1.
    from lupa import lua51 as lua_module
except ImportError:  # pragma: no cover - older lupa: only its default runtime
    lua_module = lupa


def to_lua(lua, value):
    """Python (YAML) value to a Lua value the way Argo CD hands JSON to GopherLua: arrays 1-based."""
    if isinstance(value, dict):
        return lua.table_from({k: to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, v) for v in value])
    return value


def run_health(obj: dict | None) -> dict:
    lua = lua_module.LuaRuntime(unpack_returned_tuples=True)
    assert lua.eval("_VERSION") == "Lua 5.1"
    env = lua.table_from({name: lua.globals()[name] for name in ("ipairs", "pairs", "type", "tostring")})
    env["obj"] = to_lua(lua, obj) if obj is not None else None
    chunk = lua.globals().loadstring(SCRIPT.read_text(), "argocd-health.lua")
    assert chunk is not None, "the health check does not compile under Lua 5.1"
    lua.globals().setfenv(chunk, env)
    result = chunk()
    return {"status": result["status"], "message": result["message"]}


def test_every_state_has_a_fixture():
    states = {yaml.safe_load(p.read_text())["expect"]["status"] for p in FIXTURES}
    assert states == {"Healthy", "Progressing", "Degraded"}
    assert any("status" not in yaml.safe_load(p.read_text())["object"] for p in FIXTURES)


@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_health_check_fixture(fixture: Path):
    case = yaml.safe_load(fixture.read_text())
    assert run_health(case["object"]) == case["expect"]


def test_missing_object_is_progressing():
    assert run_health(None)["status"] == "Progressing"


def test_integer_generations_compare_as_numbers():
    # 10 > 9 numerically but not as strings: the check must not compare generations lexically.
    obj = {
        "metadata": {"generation": 10},
        "status": {"observedGeneration": 9, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert run_health(obj)["status"] == "Progressing"
    obj["status"]["observedGeneration"] = 10
    assert run_health(obj) == {"status": "Healthy", "message": "ready"}
