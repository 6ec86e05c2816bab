"""One replica over several "hosts": ranks started independently (one process per node, on distinct
127.0.0.0/8 addresses) meet at the leader's address and answer as the single-process server does, for
TP 2 across two hosts, PP 2 and TP 2 x PP 2, unified and as a prefill/decode pair; the group fails as one
(a rank killed mid-request fails the request and every rank exits, and the restarted group serves again;
a rank that never comes is named). The pure parts (layout, stage split, micro-batches) are tested alone."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from group_support import (
    SERVE,
    Group,
    Node,
    alive,
    chat,
    descendants,
    free_port,
    get,
    make_group,
    next_host,
    running,
    wait_ready,
)
from sovereign_runtime.builtin.tasks import check_answer, make_questions
from sovereign_runtime.engine.group import GroupAddress, GroupLayout, GroupTimeouts, Member
from sovereign_runtime.model.config import ModelConfig
from sovereign_runtime.model.context import AttentionMetadata
from sovereign_runtime.model.pipeline import PipelineStage, split_layers, split_micro_batches
from sovereign_runtime.server.node_health import node_report

# ---- the pure parts -----------------------------------------------------------------------------------


def test_layout_puts_tensor_parallelism_within_a_node_and_stages_across() -> None:
    layout = GroupLayout(tensor_parallel=8, pipeline_parallel=2, nnodes=2)
    assert layout.world_size == 16 and layout.ranks_per_node == 8
    assert [layout.node(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert [layout.stage(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert layout.peer(3, 1) == 11 and layout.stage_ranks(1) == list(range(8, 16))
    across = GroupLayout(2, 1, 2)  # TP across two nodes: one rank each
    assert across.ranks_per_node == 1 and [across.node(r) for r in (0, 1)] == [0, 1]
    assert GroupLayout(2, 2, 2).node_ranks(1) == range(2, 4)
    assert "cannot be split evenly over --nnodes 3" in (GroupLayout(2, 1, 3).problem() or "")
    assert GroupLayout(2, 2, 4).problem() is None


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("leader.ns.svc", "leader.ns.svc", 29500),
        ("10.0.0.5:1234", "10.0.0.5", 1234),
        ("[fd00::1]:99", "fd00::1", 99),
        ("[fd00::1]", "fd00::1", 29500),
    ],
)
def test_leader_address_parses_host_and_port(text: str, host: str, port: int) -> None:
    assert GroupAddress.parse(text) == GroupAddress(host, port)


@pytest.mark.parametrize("text", ["h:x", "h:70000", ":80", "[fd00::1", "[fd00::1]x"])
def test_bad_leader_addresses_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"port|host|IPv6"):
        GroupAddress.parse(text)


def test_layers_split_evenly_with_the_remainder_first_and_mtp_on_the_last_stage(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    assert split_layers(61, 2) == [range(0, 31), range(31, 61)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="4 pipeline stages for 3 decoder layers"):
        split_layers(3, 4)
    config = ModelConfig.from_pretrained(tiny_checkpoint)  # 3 layers and an MTP layer
    first, last = PipelineStage.of(config, 0, 2), PipelineStage.of(config, 1, 2)
    assert first.layers == range(0, 2) and last.layers == range(2, 3)
    for name, on_first, on_last in [
        ("model.embed_tokens.weight", True, True),  # the last stage's MTP embeds the next tokens
        ("model.layers.1.self_attn.o_proj.weight", True, False),
        ("model.layers.2.mlp.gate.weight", False, True),
        ("model.norm.weight", False, True),
        ("lm_head.weight", True, False),
        ("mtp.0.shared_head.head.weight", True, False),  # rank 0 computes the draft logits
        ("mtp.0.eh_proj.weight", False, True),
        ("mtp.0.self_attn.kv_b_proj.weight", False, True),
    ]:
        assert (first.holds(name, config), last.holds(name, config)) == (on_first, on_last), name
    # An engine cache of 3 decoder layers + the MTP layer: 2 pages per block on each stage.
    assert (first.kv_layers(config, 4), last.kv_layers(config, 4)) == (2, 2)
    assert [first.owner_of_layer(config, layer) for layer in range(4)] == [0, 0, 1, 1]


def _meta(query_lens: list[int], context_lens: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    tokens = starts[-1]
    return AttentionMetadata(
        positions=torch.arange(tokens),
        slot_mapping=torch.arange(100, 100 + tokens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.arange(len(query_lens) * 3, dtype=torch.int32).view(-1, 3),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        block_size=4,
    )


def test_micro_batches_are_whole_sequences_in_order_with_balanced_tokens() -> None:
    decode = split_micro_batches(_meta([1, 1, 1, 1, 1], [5, 9, 2, 7, 3]), 2)
    assert [m.tokens for m in decode] == [slice(0, 3), slice(3, 5)]
    assert decode[1].meta.query_start_loc.tolist() == [0, 1, 2]
    assert decode[1].meta.context_lens.tolist() == [7, 3] and decode[1].meta.max_context_len == 7
    assert decode[1].meta.block_tables.tolist() == [[9, 10, 11], [12, 13, 14]]
    assert decode[1].meta.slot_mapping.tolist() == [103, 104] and decode[0].meta.is_decode
    mixed = split_micro_batches(_meta([1, 6, 1, 1], [4, 6, 8, 2]), 3)  # a prompt chunk is never cut
    assert [m.tokens for m in mixed] == [slice(0, 1), slice(1, 7), slice(7, 9)]
    assert [m.meta.max_query_len for m in mixed] == [1, 6, 1]
    assert [m.tokens for m in split_micro_batches(_meta([3], [3]), 4)] == [slice(0, 3)]  # one sequence


def test_a_worker_node_is_ready_only_once_each_of_its_ranks_is() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    layout = GroupLayout(2, 2, 2)
    member = Member(layout, 2, GroupAddress("127.0.0.1", store.port), GroupTimeouts(), store)
    status, body = node_report(member, layout.node_ranks(1))
    assert status == 503 and body["phase"] == "joining"
    member.report("loading_weights")
    status, body = node_report(member, layout.node_ranks(1))
    assert status == 503 and body["detail"] == "rank 2: loading_weights, rank 3: joining"
    member.report("ready")
    Member(layout, 3, member.address, GroupTimeouts(), store).report("ready")
    assert node_report(member, layout.node_ranks(1)) == (200, {"phase": "ready", "ranks": [2, 3]})


# ---- groups of processes -----------------------------------------------------------------------------

# The lifecycle tests are about starting and failing, not about answers: no self-test before ready.
LIFECYCLE = ("--no-self-test",)


@pytest.fixture(scope="module")
def reference() -> Iterator[Node]:
    """The single-process server every group must answer as."""
    host = next_host()
    port = free_port(host)
    node = Node(host, port, [*SERVE, "--host", host, "--port", str(port)])
    group = Group([node], 0)
    with running(group):
        wait_ready(node)
        yield node


def _kv_health(base: str) -> dict[str, object]:
    return get(base + "/health/kv")[1]


@pytest.mark.parametrize(
    ("tp", "pp", "speculative"),
    [(2, 1, False), (1, 2, True), (2, 2, False)],
    ids=["tp2-across-hosts", "pp2-mtp", "tp2xpp2"],
)
def test_a_group_over_two_hosts_answers_as_one_process_unified_and_disaggregated(
    tp: int, pp: int, speculative: bool, reference: Node
) -> None:
    spec = ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "2"] if speculative else []
    # The decode group runs the output self-test before ready (its batch-invariance check on a group);
    # the prefill group skips it, to keep the test short.
    prefill = make_group(tp, pp, 2, "--role", "prefill", "--no-self-test")
    decode = make_group(tp, pp, 2, "--role", "decode", *spec, kv_port=True)
    questions = make_questions(2, seed=21)
    with running(prefill), running(decode):
        for group in (prefill, decode):
            wait_ready(group.leader)
            for worker in group.nodes[1:]:  # the worker node answers its probes too
                status, body = get(worker.url + "/health/ready")
                assert status == 200 and body["phase"] == "ready", body
        for number, q in enumerate(questions):
            expected = chat(reference.url, q.prompt)
            assert check_answer(q, expected), (q.prompt, expected)
            # Unified: the decode group prefills a plain request itself.
            assert chat(decode.leader.url, q.prompt) == expected, q.prompt
            # Disaggregated: the prompt's KV comes from the prefill group, layer by layer and stage by stage.
            params = {"prefill_url": prefill.leader.url, "room": f"group{tp}x{pp}room{number}"}
            assert chat(decode.leader.url, q.prompt, kv_transfer_params=params) == expected, q.prompt
        health = _kv_health(decode.leader.url)
        assert health["transfers_ok"] == len(questions) and health["fallbacks"] == 0, health
        if speculative:
            with urllib.request.urlopen(decode.leader.url + "/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
            accepted = [
                line for line in metrics.splitlines() if line.startswith("sovereign:spec_decode_num_accepted")
            ]
            assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0, metrics
        # A drain on the leader stops the whole group cleanly.
        for group in (prefill, decode):
            assert group.leader.proc is not None
            group.leader.proc.send_signal(signal.SIGTERM)
        for group in (prefill, decode):
            for node in group.nodes:
                assert node.wait(60) == 0, node.output[-4000:]


def _stream_until_killed(group: Group) -> tuple[list[dict[str, object]], float]:
    """Stream a long completion; SIGKILL the worker node after its first tokens. Returns the events."""
    body = {"model": "builtin:sovereign-tiny", "prompt": "a", "temperature": 0, "max_tokens": 200}
    request = urllib.request.Request(
        group.leader.url + "/v1/completions",
        data=json.dumps({**body, "ignore_eos": True, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events: list[dict[str, object]] = []
    killed_at = 0.0
    with urllib.request.urlopen(request, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 3:
                worker = group.nodes[1].proc
                assert worker is not None
                worker.kill()
                killed_at = time.monotonic()
    return events, killed_at


def test_a_rank_killed_mid_request_fails_the_request_and_the_group_and_the_restarted_group_serves() -> None:
    group = make_group(1, 2, 2, *LIFECYCLE)
    with running(group):
        wait_ready(group.leader)
        ranks = [
            pid for node in group.nodes if node.proc for pid in [node.proc.pid, *descendants(node.proc.pid)]
        ]
        events, killed_at = _stream_until_killed(group)
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1, events[-3:]
        assert errors[0]["code"] == "group_failure" and "this replica restarts" in errors[0]["message"], (
            errors
        )
        assert sum(1 for e in events if "choices" in e) < 200  # it ended early, with the error
        # The leader exits with the reason; nothing of the group is left behind.
        assert group.leader.wait(30) == 1
        assert "parallel group failed" in group.leader.output, group.leader.output[-3000:]
        assert time.monotonic() - killed_at < 15
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in ranks[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if alive(pid)]
        # Started again (as LeaderWorkerSet recreates the group): the same addresses serve again.
        group.start()
        wait_ready(group.leader)
        q = make_questions(1, seed=3)[0]
        assert check_answer(q, chat(group.leader.url, q.prompt))


def test_a_dead_leader_ends_its_workers() -> None:
    group = make_group(2, 2, 2, *LIFECYCLE)  # two ranks per node: the node's subprocess rank goes too
    with running(group):
        wait_ready(group.leader)
        worker = group.nodes[1]
        assert worker.proc is not None
        ranks = [worker.proc.pid, *descendants(worker.proc.pid)]
        assert len(ranks) == 2, ranks
        assert group.leader.proc is not None
        group.leader.proc.kill()
        assert worker.wait(30) == 1
        assert "parallel group failed" in worker.output and "leader" in worker.output, worker.output[-3000:]
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if alive(pid)]


def test_a_node_that_never_comes_is_named_and_the_leader_exits() -> None:
    group = make_group(1, 2, 2, "--rendezvous-timeout", "4", *LIFECYCLE)
    with running(group, only=[0]):  # no pod was ever scheduled for node 1
        status, body = 0, {}
        deadline = time.monotonic() + 30
        while status != 503 and time.monotonic() < deadline:  # the startup probe says what it waits for
            try:
                status, body = get(group.leader.url + "/health/startup")
            except OSError:
                time.sleep(0.1)
        assert body.get("phase") == "joining_group", body
        assert group.leader.wait(60) == 1
        assert "rank(s) 1 (node(s) 1) of 2 did not join the rendezvous within 4 s" in group.leader.output
