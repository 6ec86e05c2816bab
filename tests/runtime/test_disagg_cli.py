"""Which address a decode instance advertises to prefill instances for its KV receiver."""

from __future__ import annotations

import pytest
from sovereign_runtime.cli import kv_advertise_host
from sovereign_runtime.program import build_parser


def test_flag_then_pod_ip_then_bind_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert kv_advertise_host("decode-0.example", "0.0.0.0") == "decode-0.example"
    assert kv_advertise_host(None, "0.0.0.0") == "10.1.2.3"  # the operator sets POD_IP (downward API)
    monkeypatch.delenv("POD_IP")
    assert kv_advertise_host(None, "192.168.0.7") == "192.168.0.7"
    assert kv_advertise_host(None, "0.0.0.0") not in ("", "0.0.0.0")


def test_serve_defaults_match_what_the_operator_renders() -> None:
    args = build_parser().parse_args(["serve", "--model", "x", "--role", "decode"])
    assert (args.kv_transport, args.kv_port, args.kv_transfer_timeout) == ("tcp", 8001, 30.0)
    args = build_parser().parse_args(["serve", "--model", "x", "--role", "prefill", "--kv-transport", "rdma"])
    assert args.kv_transport == "rdma"
