"""`sovereign-runtime serve`: the OpenAI server for one model.

``serve`` wires the runtime's assembly (``assembly.py``: model, engine, tensor parallelism) to the HTTP
server and the prefill/decode role (``disagg``). This module imports torch: the entry point
(``program.py``) imports it only for ``serve``, so ``router`` and ``download`` start without it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import jinja2

from . import builtin
from .allocator import tune_malloc
from .assembly import (
    DTYPES,
    EngineOptions,
    GroupStart,
    connect_group,
    make_loader,
    parallel_problem_for,
    serve_rank,
)
from .disagg.service import ROLES, DisaggConfig, DisaggService
from .engine.group import (
    DEFAULT_PORT as DEFAULT_GROUP_PORT,
)
from .engine.group import (
    GroupAddress,
    GroupLayout,
    GroupTimeouts,
    Member,
    exit_when_parent_dies,
    node_address,
    spawn_node_ranks,
)
from .engine.repetition import check_window
from .engine.sampling import SamplingDefaults, read_generation_config
from .engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from .engine.speculative import ALGORITHMS, DEFAULT_MAX_BATCH_SIZE, MAX_DRAFT_TOKENS, SpeculativeConfig
from .model.faults import FaultSpec
from .program import UsageError
from .program import main as main  # console scripts installed before program.py still call cli:main
from .read_deadlines import add_read_deadline_flags, read_deadlines
from .server import ServerConfig, create_app, serve
from .server.app import jit_cache_dir
from .tokenizer import compile_chat_template

DEVICES = ("auto", "cpu", "cuda")

BUILTIN_PREFIX = builtin.PREFIX
log = logging.getLogger("sovereign_runtime")


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper bound without ``high``)."""
    wanted = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse


_positive_int = _int_in(1)
_non_negative_int = _int_in(0)
_draft_tokens = _int_in(1, MAX_DRAFT_TOKENS)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _repetition_window(text: str) -> int:
    try:
        value = int(text)
        check_window(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            str(exc) if "repetition_window" in str(exc) else f"expected an integer, got {text!r}"
        ) from None
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, metavar="PATH|builtin:NAME", help="HF checkpoint directory or builtin:NAME"
    )
    p.add_argument("--role", choices=ROLES, default="unified")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument(
        "--served-model-name", metavar="NAME", help="model id clients send (default: from --model)"
    )
    group = p.add_argument_group("parallelism (docs/engine.md, distributed)")
    group.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="shard every layer over N ranks (one per GPU on CUDA); rank 0 serves HTTP",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="split the layers into N stages, one after the other (with tensor parallelism: each stage"
        " over --tensor-parallel-size ranks)",
    )
    group.add_argument(
        "--nnodes",
        type=_positive_int,
        metavar="N",
        help="nodes (pods) the ranks are spread over, each starting its share; default $LWS_GROUP_SIZE, else 1",
    )
    group.add_argument(
        "--node-rank",
        type=_non_negative_int,
        metavar="R",
        help="this node's index, 0 for the leader (which serves HTTP); default $LWS_WORKER_INDEX, else 0",
    )
    group.add_argument(
        "--leader-address",
        metavar="HOST[:PORT]",
        help=f"where the nodes meet: the leader's address and rendezvous port (default {DEFAULT_GROUP_PORT});"
        " default $LWS_LEADER_ADDRESS (LeaderWorkerSet sets it)",
    )
    group.add_argument(
        "--rendezvous-timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="how long the ranks wait for the whole group to join before all exit naming the missing ones",
    )
    group.add_argument(
        "--rank-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a rank silent this long is dead: the whole group exits (status 1) and fails requests in flight",
    )
    # Set by a node on the ranks it starts as subprocesses (not for people).
    p.add_argument("--group-rank", type=_non_negative_int, help=argparse.SUPPRESS)
    p.add_argument(
        "--max-model-len", type=_positive_int, metavar="TOKENS", help="context length (default: config)"
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template to use in place of the model's own (for example one that renders"
        " 'tools': DeepSeek-V3's own template does not)",
    )
    p.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto: requests that leave temperature, top_p, top_k, min_p or repetition_penalty out get the"
        " model's generation_config.json values (as vLLM does); none: OpenAI's defaults",
    )
    p.add_argument(
        "--max-num-seqs", type=_positive_int, default=64, metavar="N", help="requests in one batch"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        metavar="N",
        help="tokens one step computes: running decodes first, then prefill chunks of the rest (at least"
        " --max-num-seqs)",
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-gib", type=_positive_float, metavar="GIB", help="KV-cache size in GiB")
    kv.add_argument("--num-kv-blocks", type=_positive_int, metavar="N", help="KV-cache size in blocks")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto")
    p.add_argument(
        "--api-key-file", metavar="PATH", help="file holding the API key (else $SOVEREIGN_API_KEY)"
    )
    p.add_argument("--drain-timeout", type=_positive_float, default=30.0, metavar="SECONDS")
    p.add_argument(
        "--internal-token-file",
        metavar="PATH",
        help="the deployment's internal token (else $SOVEREIGN_INTERNAL_TOKEN): decode honours"
        " kv_transfer_params and prefill answers /v1/internal/prefill only from peers sending it",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=8 * 1024 * 1024,
        metavar="BYTES",
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=_positive_int,
        default=256,
        metavar="N",
        help="admitted requests not yet running; past this new ones get 429 with Retry-After",
    )
    add_read_deadline_flags(p)
    p.add_argument(
        "--request-timeout",
        type=_non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="abort a generation request this long after it arrived (408); 0: no limit. A request's"
        " own request_timeout may ask for less",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip warm-up requests before reporting ready")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    guard = p.add_argument_group("output guard (docs/troubleshooting.md)")
    guard.add_argument(
        "--self-test-interval",
        type=_non_negative_float,
        default=300.0,
        metavar="SECONDS",
        help="rerun the known-answer self-test this often while serving (0: only before ready)",
    )
    guard.add_argument(
        "--no-self-test", action="store_true", help="skip the self-test: ready right after warm-up"
    )
    guard.add_argument(
        "--repetition-window",
        type=_repetition_window,
        default=0,
        metavar="N",
        help="end a request whose last N tokens repeat a pattern of <= 8 tokens (0: off; per request too)",
    )
    guard.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="allow --inject-fault and --debug-hold-compiling-s (tests and alert drills only)",
    )
    guard.add_argument(
        "--inject-fault",
        metavar="SPEC",
        help="test-only fault, e.g. nan_layer=1,nan_p=0.2 or batch_min_seqs=3 (needs --enable-fault-injection)",
    )
    guard.add_argument(
        "--debug-hold-compiling-s",
        type=_positive_float,
        metavar="SECONDS",
        help="test-only: hold startup in phase compiling this long (/health/startup answers 503 with the"
        " phase and its progress), as a slow kernel compilation would (needs --enable-fault-injection)",
    )
    guard.add_argument(
        "--debug-hold-compiling-cached-s",
        type=_non_negative_float,
        metavar="SECONDS",
        help="test-only, with --debug-hold-compiling-s: the hold is a compilation whose result the JIT cache"
        " keeps. A completed hold leaves a mark in the JIT cache directory ($TRITON_CACHE_DIR, else"
        " ~/.triton/cache); a start that finds it holds this long instead (a warm cache)",
    )
    spec = p.add_argument_group("speculative decoding (docs/runtime.md)")
    spec.add_argument(
        "--speculative-algorithm",
        choices=ALGORITHMS,
        help="draft with the checkpoint's multi-token-prediction layer (DeepSeek-V3's NextN) and verify"
        " the drafts in one forward; outputs are the model's own. A checkpoint without MTP tensors serves"
        " without it (one warning; /v1/models and /metrics say so)",
    )
    spec.add_argument(
        "--speculative-num-draft-tokens",
        type=_draft_tokens,
        metavar="K",
        help=f"draft tokens per step, 1..{MAX_DRAFT_TOKENS} (default 1; needs --speculative-algorithm)",
    )
    spec.add_argument(
        "--speculative-max-batch-size",
        type=_non_negative_int,
        metavar="N",
        help=f"draft only while at most N sequences run, above it decode is compute-bound and drafting"
        f" costs more than it returns (default {DEFAULT_MAX_BATCH_SIZE}; 0: always draft)",
    )
    p.add_argument(
        "--kv-transport",
        choices=("tcp", "rdma"),
        default="tcp",
        help="prefill->decode KV transfer: tcp, or rdma through NIXL (prefill/decode roles)",
    )
    p.add_argument(
        "--kv-port", type=_port, default=8001, help="port of the decode role's KV receiver (TCP transport)"
    )
    p.add_argument(
        "--kv-advertise-host",
        metavar="HOST",
        help="address prefill instances dial for the KV (default: $POD_IP, else --host unless 0.0.0.0)",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a remote prefill slower than this is abandoned and the decode role prefills locally",
    )


def resolve_model(spec: str) -> Path:
    """``builtin:NAME`` through ``sovereign_runtime.builtin``; otherwise a checkpoint directory."""
    if spec.startswith(BUILTIN_PREFIX):
        try:
            return builtin.resolve_builtin(spec)
        except (FileNotFoundError, ValueError) as exc:
            raise UsageError(f"--model {spec}: {exc}") from None
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {spec}: not a checkpoint directory (no config.json)")
    if not (path / "tokenizer.json").is_file():
        raise UsageError(f"--model {spec}: no tokenizer.json next to the checkpoint")
    return path


def read_api_key(api_key_file: str | None) -> str | None:
    return read_secret(api_key_file, "SOVEREIGN_API_KEY", "--api-key-file")


def read_secret(path: str | None, env: str, flag: str) -> str | None:
    """A secret from a file (stripped), else from the environment, else None."""
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
        if not value:
            raise UsageError(f"{flag} {path}: the file is empty")
        return value
    return os.environ.get(env) or None


def kv_advertise_host(flag: str | None, host: str) -> str:
    """The address a prefill instance dials: the flag, the pod IP (Kubernetes downward API), the bind
    address, or this host's name as a last resort."""
    if flag:
        return flag
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # no resolvable hostname: only local peers can reach us anyway
        return "127.0.0.1"


# Flags that only tests and drills may use; each is refused unless --enable-fault-injection is given too.
TEST_ONLY_FLAGS = (
    ("--inject-fault", "inject_fault"),
    ("--debug-hold-compiling-s", "debug_hold_compiling_s"),
    ("--debug-hold-compiling-cached-s", "debug_hold_compiling_cached_s"),
)


def check_test_only_flags(args: argparse.Namespace) -> None:
    """Refuse a test-only flag without the explicit opt-in, and the opt-in without anything to inject."""
    given = [flag for flag, attr in TEST_ONLY_FLAGS if getattr(args, attr) is not None]
    if given and not args.enable_fault_injection:
        raise UsageError(
            f"serve: {given[0]} is for tests and drills only; add --enable-fault-injection to allow it"
        )
    if args.enable_fault_injection and not given:
        raise UsageError(
            "serve: --enable-fault-injection needs --inject-fault SPEC or --debug-hold-compiling-s SECONDS"
            " (what to inject)"
        )
    if args.debug_hold_compiling_cached_s is not None and args.debug_hold_compiling_s is None:
        raise UsageError(
            "serve: --debug-hold-compiling-cached-s shortens the hold of --debug-hold-compiling-s; give both"
        )


def fault_spec(args: argparse.Namespace) -> FaultSpec | None:
    """The test-only ``FaultSpec`` of ``--inject-fault``, refused unless ``--enable-fault-injection``."""
    check_test_only_flags(args)
    if args.inject_fault is None:
        return None
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        raise UsageError(
            "serve: --inject-fault works on one process only (--tensor-parallel-size and"
            " --pipeline-parallel-size 1)"
        )
    try:
        spec = FaultSpec.parse(args.inject_fault)
    except ValueError as exc:
        raise UsageError(f"serve: --inject-fault: {exc}") from None
    hostname = socket.gethostname()
    if not spec.engages_on(hostname):
        log.warning(
            "fault injection: on_host=%s is not this host (%s); serving without it", spec.on_host, hostname
        )
        return None
    return spec


def _env_count(name: str, low: int) -> int | None:
    """An integer from the environment (LeaderWorkerSet's), or None when unset; bad values refused."""
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"serve: ${name}={text!r} is not an integer") from None
    if value < low:
        raise UsageError(f"serve: ${name}={value} must be >= {low}")
    return value


def parallel_layout(args: argparse.Namespace) -> tuple[GroupLayout, int, GroupAddress]:
    """The group's layout, this node's index and where the group meets, from the flags and LeaderWorkerSet's
    environment (flags win; a flag contradicting the environment is refused)."""
    env_nodes = _env_count("LWS_GROUP_SIZE", 1)
    if args.nnodes is not None and env_nodes is not None and args.nnodes != env_nodes:
        raise UsageError(
            f"serve: --nnodes {args.nnodes} contradicts $LWS_GROUP_SIZE={env_nodes} (the pods in this group)"
        )
    nnodes = args.nnodes or env_nodes or 1
    node = args.node_rank if args.node_rank is not None else _env_count("LWS_WORKER_INDEX", 0) or 0
    if node >= nnodes:
        raise UsageError(f"serve: --node-rank {node} must be below --nnodes {nnodes}")
    layout = GroupLayout(args.tensor_parallel_size, args.pipeline_parallel_size, nnodes)
    problem = layout.problem()
    if problem:
        raise UsageError(f"serve: {problem}")
    text = args.leader_address or os.environ.get("LWS_LEADER_ADDRESS")
    if text is None:
        if nnodes > 1 or args.group_rank is not None:
            raise UsageError(
                f"serve: --nnodes {nnodes} needs --leader-address HOST[:PORT] (or $LWS_LEADER_ADDRESS, which"
                " LeaderWorkerSet sets): where the nodes meet"
            )
        # One node: its ranks meet on a free loopback port.
        return layout, node, GroupAddress("127.0.0.1", 0)
    try:
        address = GroupAddress.parse(text)
    except ValueError as exc:
        raise UsageError(f"serve: --leader-address {exc}") from None
    if nnodes == 1 and args.leader_address is None and args.group_rank is None:
        address = GroupAddress("127.0.0.1", 0)  # a one-pod group ignores LeaderWorkerSet's address
    return layout, node, address


def check_parallel(args: argparse.Namespace, model_path: Path, layout: GroupLayout) -> None:
    """Refuse a layout this model or machine cannot run, before starting anything."""
    problem = parallel_problem_for(model_path, layout, args.device)
    if problem:
        raise UsageError(f"serve: {problem}")


def _group_timeouts(args: argparse.Namespace) -> GroupTimeouts:
    return GroupTimeouts(rendezvous_s=args.rendezvous_timeout, rank_s=args.rank_timeout)


def _own_address(args: argparse.Namespace, layout: GroupLayout) -> str:
    """This node's address for the group's connections (one node: loopback unless --host names one)."""
    if layout.nnodes == 1 and args.host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return node_address(args.host)


def step_token_budget(args: argparse.Namespace) -> int:
    """``--max-num-batched-tokens``, refused below ``--max-num-seqs``: every running request decodes one
    token a step, and a budget under the batch would leave the same requests out of every step."""
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise UsageError(
            f"serve: --max-num-batched-tokens {args.max_num_batched_tokens} is below --max-num-seqs"
            f" {args.max_num_seqs}: each running request needs a token every step; raise it or lower"
            " --max-num-seqs"
        )
    return int(args.max_num_batched_tokens)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The engine's speculative decoding from the flags; a draft flag without the algorithm is refused."""
    if args.speculative_algorithm is None:
        for flag, value in (
            ("--speculative-num-draft-tokens", args.speculative_num_draft_tokens),
            ("--speculative-max-batch-size", args.speculative_max_batch_size),
        ):
            if value is not None:
                raise UsageError(f"serve: {flag} needs --speculative-algorithm mtp")
        return None
    if args.role == "prefill":
        raise UsageError(
            "serve: --speculative-algorithm: a prefill instance never decodes; speculative decoding belongs"
            " on the decode (or unified) role"
        )
    config = SpeculativeConfig(algorithm=args.speculative_algorithm)
    if args.speculative_num_draft_tokens is not None:
        config.num_draft_tokens = args.speculative_num_draft_tokens
    if args.speculative_max_batch_size is not None:
        config.max_batch_size = args.speculative_max_batch_size
    return config


def sampling_defaults(mode: str, model_path: Path) -> SamplingDefaults:
    """What requests that leave the sampling fields out get (``--generation-config``); a bad
    generation_config.json is a ``UsageError`` naming the file and the key."""
    if mode == "none":
        return SamplingDefaults()
    try:
        defaults = read_generation_config(model_path)
    except ValueError as exc:
        raise UsageError(f"serve: {exc} (--generation-config none ignores the file)") from None
    if defaults.changed():
        log.info("sampling defaults from %s/generation_config.json: %s", model_path, defaults.changed())
    return defaults


def read_chat_template(path: Path | None) -> str | None:
    """``--chat-template``: the file's text, compiled once here so a syntax error stops ``serve`` at start
    naming the file and the line."""
    if path is None:
        return None
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"serve: --chat-template {path}: {exc}") from None
    try:
        compile_chat_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise UsageError(f"serve: --chat-template {path}, line {exc.lineno}: {exc.message}") from None
    return source


def engine_options(
    args: argparse.Namespace, model_path: Path, speculative: SpeculativeConfig | None
) -> EngineOptions:
    """The engine's part of the ``serve`` flags (refusing bad combinations as ``UsageError``)."""
    return EngineOptions(
        model_path=model_path,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=step_token_budget(args),
        kv_cache_gib=args.kv_cache_gib,
        num_kv_blocks=args.num_kv_blocks,
        self_test=not args.no_self_test,
        fault=fault_spec(args),
        speculative=speculative,
        chat_template=read_chat_template(args.chat_template),
    )


def run_serve(args: argparse.Namespace) -> int:
    speculative = speculative_config(args)
    model_path = resolve_model(args.model)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sovereign_runtime").info("%s", tune_malloc(os.environ))
    layout, node, address = parallel_layout(args)
    if args.group_rank is not None:
        return _run_subprocess_rank(args, model_path, layout, address)
    if layout.world_size > 1:
        check_parallel(args, model_path, layout)
    if node > 0:
        return _run_worker_node(args, model_path, layout, node, address)
    api_key = read_api_key(args.api_key_file)
    name = args.served_model_name or (
        args.model if args.model.startswith(BUILTIN_PREFIX) else model_path.name
    )
    options = engine_options(args, model_path, speculative)
    defaults = sampling_defaults(args.generation_config, model_path)
    config = ServerConfig(
        served_model_name=name,
        api_key=api_key,
        drain_timeout_s=args.drain_timeout,
        warmup=not args.no_warmup,
        model_root=args.model,
        max_body_bytes=args.max_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        self_test_interval_s=args.self_test_interval,
        repetition_window=args.repetition_window,
        sampling_defaults=defaults,
        read_deadlines=read_deadlines(args),
        request_timeout_s=args.request_timeout,
        debug_hold_compiling_s=args.debug_hold_compiling_s or 0.0,
        debug_hold_cached_s=args.debug_hold_compiling_cached_s,
        debug_hold_cache_dir=jit_cache_dir(os.environ),
    )
    if args.role != "unified" and args.kv_transport == "rdma":
        try:
            import nixl  # noqa: F401  (the optional `rdma` extra: checked only when asked for)
        except ImportError as exc:
            raise UsageError(f"serve: --kv-transport rdma needs the NIXL library ({exc})") from None
    disagg = DisaggService(
        DisaggConfig(
            role=args.role,
            transport=args.kv_transport,
            kv_host=args.host,
            kv_port=args.kv_port,
            advertise_host=kv_advertise_host(args.kv_advertise_host, args.host),
            transfer_timeout_s=args.kv_transfer_timeout,
            idle_timeout_s=min(10.0, args.kv_transfer_timeout),
            internal_token=read_secret(
                args.internal_token_file, "SOVEREIGN_INTERNAL_TOKEN", "--internal-token-file"
            ),
            api_key=api_key,
        ),
        name,
    )
    if layout.world_size == 1:
        app = create_app(config, loader=disagg.wrap_loader(make_loader(options)))
        disagg.install(app)
        return asyncio.run(serve(app, args.host, args.port))

    # Rank 0 hosts the group's store; this node's other ranks start now and load their shards while
    # rank 0 loads its own and the other nodes join.
    try:
        group = connect_group(layout, 0, address, _group_timeouts(args), _own_address(args, layout))
    except RuntimeError as exc:
        log.error("serve: cannot host the group's rendezvous at %s: %s", address, exc)
        return 1
    group.children = spawn_node_ranks(args.serve_argv, layout, 0, group.address)
    options.group = group
    try:
        app = create_app(config, loader=disagg.wrap_loader(make_loader(options)))
        disagg.install(app)
        return asyncio.run(serve(app, args.host, args.port))
    finally:
        _stop_children(group)  # normally already stopped by the runtime's close; kills stragglers


def _stop_children(group: GroupStart) -> None:
    for child in group.children:
        if child.poll() is None:
            child.kill()
            child.wait()


def _run_worker_node(
    args: argparse.Namespace, model_path: Path, layout: GroupLayout, node: int, address: GroupAddress
) -> int:
    """A node other than the leader's: its first rank here, the others as subprocesses, and the node's
    health endpoints on --host/--port for its probes (only the leader serves the API)."""
    from .server.node_health import serve_node_health

    joined: list[Member] = []
    serve_node_health(lambda: joined[0] if joined else None, layout.node_ranks(node), args.host, args.port)
    first = layout.node_ranks(node)[0]
    try:
        group = connect_group(layout, first, address, _group_timeouts(args), _own_address(args, layout))
    except RuntimeError as exc:  # GroupError: the leader never answered
        log.error("parallel group failed: %s; exiting", exc)
        return 1
    group.children = spawn_node_ranks(args.serve_argv, layout, node, address)
    try:
        return serve_rank(model_path, args.device, args.dtype, group, first, on_member=joined.append)
    finally:
        _stop_children(group)


def _run_subprocess_rank(
    args: argparse.Namespace, model_path: Path, layout: GroupLayout, address: GroupAddress
) -> int:
    if not 0 < args.group_rank < layout.world_size:
        raise UsageError("serve: --group-rank is set by a node for the ranks it starts")
    exit_when_parent_dies()
    try:
        group = connect_group(
            layout, args.group_rank, address, _group_timeouts(args), _own_address(args, layout)
        )
    except RuntimeError as exc:
        log.error("parallel group failed: %s; exiting", exc)
        return 1
    return serve_rank(model_path, args.device, args.dtype, group, args.group_rank)
