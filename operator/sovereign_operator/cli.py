"""`sovereign-operator`: print the CRD, render children offline, or run the operator."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from sovereign_operator import yamlio
from sovereign_operator.api import custom_resource_definition
from sovereign_operator.api.document import InvalidDeployment, check_namespace, parse_document
from sovereign_operator.api.spec import HuggingFaceSource
from sovereign_operator.leadership import LeaseTiming
from sovereign_operator.main import LeaderElection, run_operator
from sovereign_operator.render import ClusterFacts, DeploymentRef, OperatorDefaults, render
from sovereign_operator.render.modelcache import ModelFacts, Resolved, Serving, cache_claim_name, endpoint_of

# Offline rendering has no real owner; apply with `--uid` set to the object's metadata.uid.
OFFLINE_UID = "00000000-0000-0000-0000-000000000000"


def _cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(yamlio.dump(custom_resource_definition()))
    return 0


def _read(path: str) -> str:
    """The file's text; raises UnicodeDecodeError for bytes that are not UTF-8 (as YAML requires)."""
    raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    return raw.decode("utf-8")


def _cmd_render(args: argparse.Namespace) -> int:
    try:
        documents = yamlio.load_all(_read(args.file))
    except UnicodeDecodeError as error:
        print(
            f"error: {args.file}: not UTF-8 text: byte {error.start} is {error.object[error.start]:#04x}",
            file=sys.stderr,
        )
        return 2
    except (OSError, yaml.YAMLError) as error:
        print(f"error: {args.file}: cannot read YAML: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.namespace is not None:
        try:
            check_namespace(args.namespace, "--namespace")
        except InvalidDeployment as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if not documents:
        print(f"error: {args.file}: no LLMDeployment documents", file=sys.stderr)
        return 2
    rendered = []
    defaults = OperatorDefaults.from_environment(os.environ)
    for index, document in enumerate(documents):
        try:
            parsed = parse_document(document)
        except InvalidDeployment as error:
            where = args.file if len(documents) == 1 else f"{args.file} (document {index + 1})"
            print(f"error: {where}: {error}", file=sys.stderr)
            return 1
        # --rdma-nodes yes: nodes advertise whatever RDMA resource this deployment would use.
        rdma = parsed.spec.networking.rdma
        resource = rdma.resource_name if "resource_name" in rdma.model_fields_set else defaults.rdma_resource
        advertised = {resource} if args.rdma_nodes == "yes" else set()
        ref = DeploymentRef(
            name=parsed.name,
            namespace=args.namespace or parsed.namespace or "default",
            uid=args.uid or parsed.uid or OFFLINE_UID,
            generation=parsed.generation,
        )
        model = None
        source = parsed.spec.model.source.hugging_face
        if source is not None and args.resolve_models:
            try:
                model = _resolved_model(source, defaults.hf_endpoint)
            except RuntimeError as error:
                print(
                    f"error: {args.file}: {parsed.name}: spec.model.source.huggingFace: {error}",
                    file=sys.stderr,
                )
                return 1
        elif source is not None:
            print(
                f"note: {parsed.name}: the cache claim, its download Job and the pools follow once the resolve"
                " Job has found the commit; --resolve-models asks the hub now and shows them",
                file=sys.stderr,
            )
        result = render(ref, parsed.spec, ClusterFacts(frozenset(advertised)), defaults=defaults, model=model)
        rendered += result.children + result.shared
    sys.stdout.write(yamlio.dump_all(rendered))
    return 0


def _resolved_model(source: HuggingFaceSource, default_endpoint: str) -> ModelFacts:
    """Ask the hub, as the resolve Job would, with this shell's $HF_TOKEN; rendered as if downloaded."""
    try:
        from sovereign_runtime.modelhub import classify, resolve
    except ImportError as error:
        raise RuntimeError(
            f"--resolve-models needs huggingface_hub (pip install 'sovereign[runtime]'): {error}"
        ) from None
    try:
        found = resolve(
            source.repo,
            source.revision,
            endpoint=endpoint_of(source, default_endpoint),
            token=os.environ.get("HF_TOKEN") or None,
            allow_patterns=source.allow_patterns or None,
            ignore_patterns=source.ignore_patterns or None,
        )
    except Exception as error:
        failure = classify(error)
        raise RuntimeError(f"{failure.reason}: {failure.message}") from None
    resolved = Resolved(found.commit, found.total_bytes, len(found.files))
    serving = Serving(found.commit, cache_claim_name(source, found.commit), found.total_bytes)
    return ModelFacts(resolved=resolved, complete=True, serving=serving)


def _cmd_run(args: argparse.Namespace) -> int:
    election = None
    if args.leader_elect:
        namespace = args.leader_election_namespace or os.environ.get("SOVEREIGN_OPERATOR_NAMESPACE")
        if not namespace:
            print(
                "error: --leader-elect needs --leader-election-namespace (or SOVEREIGN_OPERATOR_NAMESPACE): "
                "the namespace of the Lease",
                file=sys.stderr,
            )
            return 2
        try:
            timing = LeaseTiming(
                lease_duration=args.leader_election_lease_duration,
                renew_deadline=args.leader_election_renew_deadline,
                retry_period=args.leader_election_retry_period,
            )
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        election = LeaderElection(namespace=namespace, name=args.leader_election_id, timing=timing)
    return run_operator(
        namespaces=args.namespace,
        health_port=args.health_port,
        verbose=args.verbose,
        leader_election=election,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sovereign-operator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    crd = commands.add_parser("crd", help="print the LLMDeployment CustomResourceDefinition")
    crd.set_defaults(func=_cmd_crd)

    rend = commands.add_parser("render", help="print the children of LLMDeployment documents as YAML")
    rend.add_argument(
        "-f", "--file", required=True, help="YAML file with LLMDeployment documents, - for stdin"
    )
    rend.add_argument(
        "--rdma-nodes",
        choices=["yes", "no"],
        default="no",
        help="whether nodes advertise the RDMA resource (decides mode auto and rdma.enabled auto)",
    )
    rend.add_argument("--namespace", help="namespace of the children (default: the document's or default)")
    rend.add_argument("--uid", help=f"owner uid for ownerReferences (default: {OFFLINE_UID})")
    rend.add_argument(
        "--resolve-models",
        action="store_true",
        help="ask the hub (the source's endpoint, $HF_TOKEN) what huggingFace revisions resolve to, and"
        " render their cache claim, download Job and pools as they will be",
    )
    rend.set_defaults(func=_cmd_render)

    run = commands.add_parser("run", help="run the operator against the cluster of KUBECONFIG/in-cluster")
    run.add_argument(
        "--namespace",
        action="append",
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    run.add_argument("--health-port", type=int, default=8080, help="port of /metrics and /healthz (0: off)")
    run.add_argument("--verbose", action="store_true", help="debug logging")
    defaults = LeaseTiming()
    run.add_argument(
        "--leader-elect",
        action="store_true",
        help="act only while holding a coordination.k8s.io Lease; other replicas wait (HA)",
    )
    run.add_argument(
        "--leader-election-namespace", help="namespace of the Lease (default: $SOVEREIGN_OPERATOR_NAMESPACE)"
    )
    run.add_argument("--leader-election-id", default="sovereign-operator", help="name of the Lease")
    run.add_argument(
        "--leader-election-lease-duration",
        type=float,
        default=defaults.lease_duration,
        metavar="S",
        help="a standby takes over a holder that has not renewed for this long",
    )
    run.add_argument(
        "--leader-election-renew-deadline",
        type=float,
        default=defaults.renew_deadline,
        metavar="S",
        help="the holder stops writing and exits when it could not renew for this long",
    )
    run.add_argument(
        "--leader-election-retry-period",
        type=float,
        default=defaults.retry_period,
        metavar="S",
        help="time between renewals and between a standby's attempts",
    )
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
