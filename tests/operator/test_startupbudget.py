"""Startup budgets learned from observed starts (startupbudget.py) and how the reconciler applies them.

Pods are made from the StatefulSet the operator renders (its template's annotations and probe) and
given the status a kubelet writes: a container start, a turn to Ready, or a life the startup probe cut
short. Nothing here sleeps: times are RFC 3339 strings around T0.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from operator_fakes import FakeKube, body_for
from operator_specs import DEEPSEEK_SPEC, TINY_SPEC, with_changes
from sovereign_operator.api import LLMDeploymentSpec
from sovereign_operator.api.status import StartupOverrun, StartupProfile, StartupSample
from sovereign_operator.observe import Observed
from sovereign_operator.podstatus import LifeMemory
from sovereign_operator.reconcile import Reconciler
from sovereign_operator.render import DeploymentRef, render
from sovereign_operator.render.plan import SpecKey, spec_key, startup_budget
from sovereign_operator.startupbudget import (
    SAMPLES_KEPT,
    Observations,
    ProfileKey,
    decide,
    in_force,
    learn,
    observe_starts,
    percentile,
    record,
)
from sovereign_operator.vocabulary import parse_rfc3339, rfc3339

T0 = parse_rfc3339("2026-03-01T10:00:00Z") or 0.0
H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}
A100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
NODES = {"h200-a": H200, "h200-b": H200, "a100-a": A100, "plain-gpu": {}}


def at(seconds: float) -> str:
    return rfc3339(T0 + seconds)


def rendered_for(spec: dict[str, Any]) -> Any:
    return render(DeploymentRef("llm", "ns", "uid-1"), LLMDeploymentSpec.model_validate(spec))


def statefulset(children: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return next(
        c
        for c in children
        if c["kind"] == "StatefulSet" and c["metadata"]["labels"]["app.kubernetes.io/component"] == component
    )


def pod_of(
    sts: dict[str, Any],
    ordinal: int,
    *,
    node: str = "h200-a",
    started: float = 0,
    ready_after: float | None = None,
    killed: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """A pod of the StatefulSet as the kubelet reports it: its container started at `started`, Ready
    `ready_after` seconds later (if at all), its previous life cut short by the startup probe (`killed`:
    that life's start and end)."""
    template = copy.deepcopy(sts["spec"]["template"])
    name = f"{sts['metadata']['name']}-{ordinal}"
    ready = ready_after is not None
    container = {
        "name": "runtime",
        "image": template["spec"]["containers"][0]["image"],
        "containerID": f"containerd://{name}-{started}",
        "ready": ready,
        "started": ready,
        "restartCount": 1 if killed else 0,
        "state": {"running": {"startedAt": at(started)}},
        "lastState": {},
    }
    if killed is not None:
        container["lastState"] = {
            "terminated": {
                "exitCode": 137,
                "reason": "Error",
                "startedAt": at(killed[0]),
                "finishedAt": at(killed[1]),
                "containerID": f"containerd://{name}-{killed[0]}",
            }
        }
    since = at(started + ready_after) if ready_after is not None else at(started)
    return {
        "metadata": {**template["metadata"], "name": name, "uid": f"uid-{name}"},
        "spec": {**template["spec"], "nodeName": node},
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": since}
            ],
            "containerStatuses": [container],
        },
    }


def sample(pod: str, started: float, seconds: int) -> StartupSample:
    return StartupSample(pod=pod, started_at=at(started), seconds=seconds)


KEY = SpecKey("pvc:deepseek-v3-weights/DeepSeek-V3", "fp8", "registry.example/sovereign-runtime:1")


def profile(
    node: str, samples: list[StartupSample], overruns: list[StartupOverrun] | None = None
) -> StartupProfile:
    return record(
        [],
        Observations(
            samples=[(ProfileKey(KEY, node), s) for s in samples],
            overruns=[(ProfileKey(KEY, node), o) for o in overruns or []],
        ),
    )[0]


# ---- pure parts ------------------------------------------------------------------------------------


def test_the_percentile_is_an_observed_value_by_nearest_rank() -> None:
    assert percentile([]) is None
    assert percentile([40]) == 40
    assert percentile([10, 400]) == 400  # a few samples: the slowest
    assert percentile(range(1, 21)) == 19  # 20 samples: the 19th
    assert percentile(range(1, 101)) == 95


def test_the_formula_names_its_cold_value_and_the_spec_key_its_profile() -> None:
    spec = LLMDeploymentSpec.model_validate(
        with_changes(DEEPSEEK_SPEC, startup={"jitCache": {"pvc": {"claimName": "jit"}}})
    )
    formula = startup_budget(spec)
    # 60 + 640 + 240 (warm JIT with the pvc) and the cold JIT allowance (900) as the cap.
    assert (formula.seconds, formula.formula_seconds, formula.cold_seconds) == (940, 940, 1600)
    assert formula.source == "formula" and "base 60 s + weight load 640 s + JIT 240 s" in (
        formula.reason or ""
    )
    assert spec_key(spec, None) == KEY
    overridden = startup_budget(
        LLMDeploymentSpec.model_validate(with_changes(DEEPSEEK_SPEC, startup={"budgetSeconds": 95}))
    )
    assert (overridden.seconds, overridden.source, overridden.overridden) == (100, "override", True)


def test_starts_are_read_from_ready_pods_and_typed_by_their_node() -> None:
    children = rendered_for(DEEPSEEK_SPEC).children
    decode = statefulset(children, "decode")
    annotations = decode["spec"]["template"]["metadata"]["annotations"]
    assert annotations["sovereign.ai/model-revision"] == KEY.revision
    assert annotations["sovereign.ai/model-precision"] == "fp8"
    assert "sovereign.ai/startup-budget-source" not in annotations  # the formula's budget
    pods = [
        pod_of(decode, 0, node="h200-a", started=0, ready_after=412),
        pod_of(decode, 1, node="a100-a", started=5, ready_after=700),
        pod_of(decode, 2, node="plain-gpu", started=9, ready_after=500),
        pod_of(decode, 3, node="h200-b", started=20),  # still starting: no sample yet
        pod_of(decode, 4, node="unknown-node", started=0, ready_after=300),  # node not read yet: later
    ]
    seen = observe_starts(pods, NODES, {})
    assert [(k.node_type, s.pod, s.seconds) for k, s in seen.samples] == [
        ("NVIDIA-H200", "llm-decode-0", 412),
        ("NVIDIA-A100-SXM4-80GB", "llm-decode-1", 700),
        ("gpu", "llm-decode-2", 500),
    ]
    assert {k.spec for k, _ in seen.samples} == {KEY} and not seen.overruns
    # A CPU pod is typed cpu whatever its node.
    tiny = statefulset(rendered_for(TINY_SPEC).children, "unified")
    [(key, _)] = observe_starts([pod_of(tiny, 0, node="anything", ready_after=8)], {}, {}).samples
    assert key == ProfileKey(SpecKey("builtin:sovereign-tiny", "bf16", key.spec.runtime_image), "cpu")


def test_the_history_keeps_each_start_once_and_stays_bounded() -> None:
    key = ProfileKey(KEY, "NVIDIA-H200")
    starts = [(key, sample(f"p-{i}", started=10 * i, seconds=400 + i)) for i in range(SAMPLES_KEPT + 5)]
    [first] = record([], Observations(samples=starts))
    assert len(first.samples) == SAMPLES_KEPT and first.samples[0].pod == "p-5"  # the newest, oldest first
    # Every pod still Ready shows its start again on every refresh: nothing changes, nothing is re-added
    # (15 Ready pods, 10 kept: the 5 oldest were dropped and stay dropped).
    assert record([first], Observations(samples=starts)) == [first]
    newer = (key, sample("p-new", started=1000, seconds=380))
    [second] = record([first], Observations(samples=[*starts, newer]))
    assert second.samples[-1].pod == "p-new" and second.samples[0].pod == "p-6"
    # Profiles beyond the bound: the least recently active go.
    many = [
        (ProfileKey(SpecKey(f"builtin:m{i}", "bf16", "img"), "cpu"), sample("x", started=i, seconds=5))
        for i in range(12)
    ]
    kept = record([], Observations(samples=many))
    assert len(kept) == 8 and kept[0].revision == "builtin:m11" and kept[-1].revision == "builtin:m4"


def test_the_learned_budget_is_p95_with_headroom_floored_by_weights_and_capped_by_the_cold_formula() -> None:
    formula = startup_budget(LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC))  # 60 + 640 + 900 = 1600
    assert learn([], KEY, formula).seconds is None
    fast = profile("NVIDIA-H200", [sample(f"p{i}", i, 380 + i) for i in range(4)])
    learned = learn([fast], KEY, formula)
    # p95 of 4 = the slowest (383 s) × 1.5 = 575 -> floored by base + weight load (700 s).
    assert (learned.seconds, learned.p95_seconds, learned.samples, learned.node_type) == (
        700,
        383,
        4,
        "NVIDIA-H200",
    )
    slow = profile("NVIDIA-A100-SXM4-80GB", [sample("q", 0, 900)])
    learned = learn([fast, slow], KEY, formula)
    assert (learned.seconds, learned.node_type, learned.samples) == (1350, "NVIDIA-A100-SXM4-80GB", 5)
    slower = profile("NVIDIA-A100-SXM4-80GB", [sample("q", 0, 1500)])
    assert learn([fast, slower], KEY, formula).seconds == 1600  # never above the cold formula
    other = profile("NVIDIA-H200", [sample("r", 0, 100)]).model_copy(update={"runtime_image": "other:2"})
    assert learn([other], KEY, formula).seconds is None  # another image's starts say nothing of these
    budget = decide(formula, learn([fast, slow], KEY, formula), KEY)
    assert (budget.seconds, budget.source, budget.samples, budget.p95_seconds) == (1350, "observed", 5, 900)
    assert budget.reason == (
        "learned from 5 observed starts: p95 900 s on NVIDIA-A100-SXM4-80GB × 1.5 = 1350 s (the formula: 1600 s)"
    )


def test_an_overrun_widens_two_fall_back_to_the_cold_formula_and_a_start_ends_the_run() -> None:
    formula = startup_budget(LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC))
    samples = [sample(f"p{i}", i, 400) for i in range(3)]  # learned: max(600, 700) = 700 s
    one = StartupOverrun(pod="p9", started_at=at(100), finished_at=at(800), window_seconds=700)
    widened = decide(formula, learn([profile("NVIDIA-H200", samples, [one])], KEY, formula), KEY)
    assert (widened.seconds, widened.source, widened.overruns, widened.overrun_at) == (
        1400,
        "observed",
        1,
        at(800),
    )
    assert "pod p9 on NVIDIA-H200 overran the learned budget (700 s)" in (widened.reason or "")
    two = StartupOverrun(pod="p8", started_at=at(900), finished_at=at(2300), window_seconds=1400)
    fallback = decide(formula, learn([profile("NVIDIA-H200", samples, [one, two])], KEY, formula), KEY)
    assert (fallback.seconds, fallback.source, fallback.overruns) == (1600, "formula", 2)
    assert (fallback.reason or "").startswith(
        "fell back to the formula's cold value (1600 s): 2 consecutive starts"
    )
    # A start that succeeded after them ends the run: learned again.
    after = [*samples, sample("p8", 2400, 1200)]
    learned = learn([profile("NVIDIA-H200", after, [one, two])], KEY, formula)
    assert learned.overruns == 0 and decide(formula, learned, KEY).seconds == 1600  # 1200 × 1.5, capped
    # An overrun on a node type without a sample of its own counts too (a pod landed on slower GPUs).
    a100 = profile("NVIDIA-A100-SXM4-80GB", [], [one])
    assert decide(formula, learn([profile("NVIDIA-H200", samples), a100], KEY, formula), KEY).seconds == 1400


def test_the_budget_in_force_waits_for_a_rollout_except_after_an_overrun() -> None:
    formula = startup_budget(LLMDeploymentSpec.model_validate(DEEPSEEK_SPEC))
    first = in_force(formula, learn([], KEY, formula), KEY, "tmpl-1", None)
    assert (first.seconds, first.source, first.pod_template_hash) == (1600, "formula", "tmpl-1")
    observed = [profile("NVIDIA-H200", [sample(f"p{i}", i, 400) for i in range(3)])]
    # New samples, same pod template: the pods keep their budget (a new one would roll them all).
    assert in_force(formula, learn(observed, KEY, formula), KEY, "tmpl-1", first) == first
    # The pods roll for another reason: the learned budget comes with them.
    rolled = in_force(formula, learn(observed, KEY, formula), KEY, "tmpl-2", first)
    assert (rolled.seconds, rolled.source, rolled.pod_template_hash) == (700, "observed", "tmpl-2")
    # The formula itself changed (e.g. readBandwidthMiBps): decided again.
    faster = startup_budget(
        LLMDeploymentSpec.model_validate(with_changes(DEEPSEEK_SPEC, startup={"readBandwidthMiBps": 2000}))
    )
    assert in_force(faster, learn(observed, KEY, faster), KEY, "tmpl-2", rolled).weight_load_seconds == 320
    # An overrun of the budget in force: at once; the same overrun again: nothing new.
    overrun = StartupOverrun(pod="p9", started_at=at(100), finished_at=at(800), window_seconds=700)
    overran = [profile("NVIDIA-H200", observed[0].samples, [overrun])]
    widened = in_force(formula, learn(overran, KEY, formula), KEY, "tmpl-2", rolled)
    assert (widened.seconds, widened.overrun_at) == (1400, at(800))
    assert in_force(formula, learn(overran, KEY, formula), KEY, "tmpl-2", widened) == widened


# ---- through the reconciler ------------------------------------------------------------------------


class PodKube(FakeKube):
    """The fake apiserver with pods: made from the applied StatefulSets by the test, on typed nodes."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.pods: list[dict[str, Any]] = []
        self.sts_applies: list[int] = []

    async def apply(self, child: dict[str, Any]) -> None:
        await super().apply(child)
        if child["kind"] == "StatefulSet":
            self.sts_applies.append(startup_threshold(child))

    async def observe(self, namespace: str, instance: str) -> Observed:
        observed = await super().observe(namespace, instance)
        return Observed(
            statefulsets=observed.statefulsets,
            router=observed.router,
            pods=copy.deepcopy(self.pods),
            node_labels=NODES,
        )

    def sts(self) -> dict[str, Any]:
        return self.children[("StatefulSet", "llm-unified")]


def startup_threshold(sts: dict[str, Any]) -> int:
    return int(sts["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureThreshold"])


GPU_SPEC = with_changes(DEEPSEEK_SPEC, mode="unified", prefill=None, decode={"replicas": 2})


def test_the_reconciler_learns_without_rolling_pods_and_answers_overruns_at_once() -> None:
    kube = PodKube(body_for(GPU_SPEC))
    reconciler = Reconciler(kube, clock=lambda: at(0))

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        assert kube.sts_applies == [160]  # the formula: 1600 s
        # Two pods start in 400 and 420 s: status records them, the StatefulSet is not written.
        sts = kube.sts()
        kube.pods = [
            pod_of(sts, 0, node="h200-a", started=0, ready_after=400),
            pod_of(sts, 1, node="h200-b", started=3, ready_after=420),
        ]
        assert await reconciler.refresh_status("ns", "llm")
        observations = kube.body["status"]["startupObservations"]
        assert (observations["samples"], observations["learnedSeconds"]) == (2, 700)
        assert [s["seconds"] for s in observations["profiles"][0]["samples"]] == [400, 420]
        assert kube.body["status"]["startupBudget"]["source"] == "formula"
        assert kube.sts_applies == [160]
        # Steady state: the same pods again write nothing.
        assert not await reconciler.refresh_status("ns", "llm")
        await reconciler.reconcile(kube.body)
        assert kube.sts_applies == [160]

        # A spec change that rolls the pods anyway (a runtime argument) brings the learned budget along.
        kube.body["spec"]["runtime"]["args"] = ["--max-num-seqs", "64"]
        kube.body["metadata"]["generation"] = 2
        await reconciler.reconcile(kube.body)
        assert kube.sts_applies == [160, 70]
        budget = kube.body["status"]["startupBudget"]
        assert (budget["seconds"], budget["source"], budget["samples"], budget["p95Seconds"]) == (
            700,
            "observed",
            2,
            420,
        )
        assert kube.body["status"]["startupBudgetSeconds"] == 700
        annotations = kube.sts()["spec"]["template"]["metadata"]["annotations"]
        assert annotations["sovereign.ai/startup-budget-source"] == "observed"

        # A new pod on an A100 node overruns the learned 700 s: widened at once (the pod keeps its probe
        # until it is recreated), and said so in status and in Degraded's message.
        sts = kube.sts()
        kube.pods.append(pod_of(sts, 2, node="a100-a", started=1500, killed=(790, 1490)))
        await reconciler.refresh_status("ns", "llm")
        assert kube.sts_applies == [160, 70, 140]
        budget = kube.body["status"]["startupBudget"]
        assert (budget["seconds"], budget["source"], budget["overruns"]) == (1400, "observed", 1)
        degraded = next(c for c in kube.body["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "StartupProbeFailed"
        assert "raised the budget to 1400 s (observed)" in degraded["message"]
        assert not await reconciler.refresh_status("ns", "llm") and kube.sts_applies == [160, 70, 140]

        # It overruns again before any start succeeds: the cold formula, and no crash loop.
        kube.pods[2] = pod_of(kube.sts(), 2, node="a100-a", started=3000, killed=(1510, 2910))  # recreated
        await reconciler.refresh_status("ns", "llm")
        assert kube.sts_applies == [160, 70, 140, 160]
        budget = kube.body["status"]["startupBudget"]
        assert (budget["seconds"], budget["source"], budget["overruns"]) == (1600, "formula", 2)
        assert budget["reason"].startswith("fell back to the formula's cold value (1600 s)")
        assert "samples" not in budget and "p95Seconds" not in budget  # the learned numbers went with it
        # It starts under the cold formula: the run of overruns ends; the budget waits for a rollout.
        kube.pods[2] = pod_of(kube.sts(), 2, node="a100-a", started=3000, ready_after=1100)
        await reconciler.refresh_status("ns", "llm")
        observations = kube.body["status"]["startupObservations"]
        assert observations["learnedSeconds"] == 1600 and kube.sts_applies == [160, 70, 140, 160]

    asyncio.run(scenario())


def test_an_overrun_under_the_formula_is_not_one_of_the_learned_budget() -> None:
    """Pods whose probe came from the formula keep the existing behaviour: reported, not widened."""
    kube = PodKube(body_for(GPU_SPEC))
    reconciler = Reconciler(kube, clock=lambda: at(0))

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        kube.pods = [pod_of(kube.sts(), 0, started=1700, killed=(0, 1600))]
        await reconciler.refresh_status("ns", "llm")
        assert kube.sts_applies == [160]
        assert "startupObservations" not in kube.body["status"]

    asyncio.run(scenario())


@pytest.mark.parametrize("lives", [{}, {"containerd://llm-unified-0-0": LifeMemory(None, started=True)}])
def test_a_life_that_had_started_is_no_overrun(lives: dict[str, LifeMemory]) -> None:
    sts = statefulset(rendered_for(GPU_SPEC).children, "unified")
    sts["spec"]["template"]["metadata"]["annotations"]["sovereign.ai/startup-budget-source"] = "observed"
    pod = pod_of(sts, 0, started=1700, killed=(0, 1600))
    # Without the monitor's memory its run time says so; a life the monitor saw start was not cut short.
    assert bool(observe_starts([pod], NODES, lives).overruns) == (not lives)


# ---- with the runtime's processes ------------------------------------------------------------------

HOLD_COLD_S = 6.0
CPU_SPEC = with_changes(
    TINY_SPEC,
    runtime={
        "device": "cpu",
        # The test hook: a 6 s kernel compilation that the JIT cache keeps (a warm cache holds 0 s).
        "args": [
            "--enable-fault-injection",
            "--debug-hold-compiling-s",
            str(HOLD_COLD_S),
            "--debug-hold-compiling-cached-s",
            "0",
        ],
    },
    startup={"jitCache": {"pvc": {"claimName": "jit-cache"}}},
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_pod(sts: dict[str, Any], ordinal: int, jit_volume: Path) -> tuple[dict[str, Any], float]:
    """Run the pod's runtime container as a process (its args, the JIT cache volume at TRITON_CACHE_DIR)
    and play its kubelet: the container's start, then the pod's turn to Ready once /health/ready says so.
    Returns the pod as the kubelet reports it and the runtime's own compiling time."""
    container = sts["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    args = list(container["args"])
    args[args.index("--host") + 1], args[args.index("--port") + 1] = "127.0.0.1", str(port)
    env = {**os.environ, "TRITON_CACHE_DIR": str(jit_volume / "triton"), "OMP_NUM_THREADS": "2"}
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sovereign_runtime", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the runtime never became ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        ready = time.time()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/startup", timeout=2) as answer:
            compiling = float(json.loads(answer.read())["phase_seconds"]["compiling"])
    finally:
        proc.terminate()
        proc.wait(30)
    pod = pod_of(sts, ordinal, node="cpu-node", started=started - T0, ready_after=ready - started)
    return pod, compiling


@pytest.mark.slow
def test_with_a_persistent_jit_cache_later_starts_are_faster_and_their_learned_budget_shrinks(
    tmp_path: Path,
) -> None:
    """Real runtime processes, one per rollout, on one JIT-cache volume: the first start compiles (the
    test hook holds it 6 s) under the formula's budget; the second finds the cache warm, and the
    rollout that started it brought the budget learned from the first: smaller than the formula's."""
    kube = PodKube(body_for(CPU_SPEC))
    reconciler = Reconciler(kube, clock=lambda: at(0))
    jit_volume = tmp_path / "jit-cache-pvc"

    async def rollout(generation: int) -> None:
        # Any change of the pods' template rolls them; the budget decided then comes with it.
        kube.body["spec"]["runtime"]["args"] = [
            *CPU_SPEC["runtime"]["args"],
            "--self-test-interval",
            str(300 + generation),
        ]
        kube.body["metadata"]["generation"] = generation
        await reconciler.reconcile(kube.body)

    async def scenario() -> None:
        await reconciler.reconcile(kube.body)
        budgets = [copy.deepcopy(kube.body["status"]["startupBudget"])]
        cold_pod, cold_compiling = run_pod(kube.sts(), 0, jit_volume)
        kube.pods = [cold_pod]
        await reconciler.refresh_status("ns", "llm")
        await rollout(2)
        budgets.append(copy.deepcopy(kube.body["status"]["startupBudget"]))
        warm_pod, warm_compiling = run_pod(kube.sts(), 0, jit_volume)
        kube.pods = [warm_pod]
        await reconciler.refresh_status("ns", "llm")
        await rollout(3)
        budgets.append(copy.deepcopy(kube.body["status"]["startupBudget"]))

        cold, warm = (observe_starts([p], {}, {}).samples[0][1].seconds for p in (cold_pod, warm_pod))
        assert cold_compiling >= HOLD_COLD_S > warm_compiling  # the second start found the cache warm
        assert [b["source"] for b in budgets] == ["formula", "observed", "observed"]
        # The formula: base 60 s + JIT 60 s (CPU); learned: max(p95 × 1.5, base + weight load 60 s).
        assert budgets[0]["seconds"] == 120
        assert budgets[1]["seconds"] == max(60, math.ceil(math.ceil(cold * 1.5) / 10) * 10) <= 120
        assert budgets[2]["seconds"] == max(60, math.ceil(math.ceil(max(cold, warm) * 1.5) / 10) * 10)
        assert budgets[1]["samples"] == 1 and budgets[2]["samples"] == 2
        print(f"starts: cold {cold} s, warm {warm} s; budgets: {[b['seconds'] for b in budgets]} s")

    asyncio.run(scenario())
