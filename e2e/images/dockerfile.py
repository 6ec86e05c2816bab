"""The final stage of an ``images/*.Dockerfile``, read as the local image build needs it.

The Dockerfiles stay the one source of what an image looks like at run time: environment, user,
entrypoint and command, exposed ports, working directory, the accounts ``groupadd``/``useradd``
create and the directories ``mkdir -p``/``chown -R`` prepare. The local build (no Docker engine)
reads them from here, and a RUN step it does not know how to reproduce stops the build with the
step named, rather than being skipped in silence.

Standard library only.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# The environment of the base image before the Dockerfile's own ENV lines: Docker's default PATH for
# Debian images and a UTF-8 locale (what python:*-slim sets; nvidia/cuda bases set similar).
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}

# RUN commands whose effect the local build produces another way, with what replaces them.
REPLACED_COMMANDS = {
    "apt-get": "the Debian packages of the base root filesystem (debootstrap)",
    "pip": "site-packages copied from the project's .venv and the project's wheel",
    "rm": "nothing to remove: no wheels, sources or apt lists are put into the image",
}


class DockerfileError(ValueError):
    """A Dockerfile the local build cannot reproduce; the message names the file and the step."""


@dataclass(frozen=True)
class Account:
    """A system user created by ``useradd`` (with its group from ``groupadd``)."""

    name: str
    uid: int
    group: str
    gid: int
    home: str
    create_home: bool
    shell: str


@dataclass(frozen=True)
class Directory:
    """A directory the image must contain, with its numeric owner."""

    path: str
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class FinalStage:
    """What the image built from a Dockerfile's last stage looks like at run time."""

    env: dict[str, str]
    user: str | None
    entrypoint: list[str] | None
    cmd: list[str] | None
    exposed_ports: list[str]
    workdir: str | None
    accounts: list[Account] = field(default_factory=list)
    directories: list[Directory] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # RUN commands the build replaces, in order


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, line continuations joined, comments and blanks dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    if pending.strip():
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _expand(value: str, env: dict[str, str], where: str) -> str:
    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name is None:
            raise DockerfileError(f"{where}: unsupported substitution {match.group(0)!r}")
        return env.get(name, "")

    return re.sub(r"\$(?:\{(\w+)\}|(\w+)|\{[^}]*\})", sub, value)


def _env_pairs(rest: str, env: dict[str, str], where: str) -> list[tuple[str, str]]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        # The legacy form `ENV NAME value with spaces`.
        return [(words[0], _expand(" ".join(words[1:]), env, where))]
    pairs = []
    for word in words:
        name, sep, value = word.partition("=")
        if not sep:
            raise DockerfileError(f"{where}: ENV {word!r} is not NAME=value")
        pairs.append((name, _expand(value, env, where)))
    return pairs


def _exec_form(rest: str, where: str) -> list[str]:
    try:
        value = json.loads(rest)
    except json.JSONDecodeError:
        raise DockerfileError(f"{where}: use the exec (JSON array) form, got {rest!r}") from None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise DockerfileError(f"{where}: expected a JSON array of strings, got {rest!r}")
    return value


def _options(
    words: list[str], flags: set[str], valued: set[str], where: str
) -> tuple[dict[str, str], list[str]]:
    """Parse ``--flag`` and ``--option value`` words; anything else unknown is an error."""
    found: dict[str, str] = {}
    positional: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in flags:
            found[word] = ""
        elif word in valued:
            if i + 1 >= len(words):
                raise DockerfileError(f"{where}: {word} needs a value")
            found[word] = words[i + 1]
            i += 1
        elif word.startswith("-"):
            raise DockerfileError(f"{where}: option {word} is not supported by the local build")
        else:
            positional.append(word)
        i += 1
    return found, positional


def _commands(rest: str, where: str) -> list[list[str]]:
    """A RUN line (shell form) as its `&&`-joined commands."""
    commands: list[list[str]] = [[]]
    for word in shlex.split(rest):
        if word == "&&":
            commands.append([])
        elif word in (";", "||", "|") or word.endswith(";"):
            raise DockerfileError(f"{where}: only `&&` chains are supported by the local build")
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def _numeric_owner(spec: str, where: str) -> tuple[int, int]:
    user, _, group = spec.partition(":")
    if not user.isdigit() or (group and not group.isdigit()):
        raise DockerfileError(f"{where}: chown {spec!r} must be numeric uid:gid")
    return int(user), int(group or user)


def final_stage(path: Path) -> FinalStage:
    """Read the last stage of the Dockerfile at ``path``."""
    steps = instructions(path.read_text())
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    if not froms:
        raise DockerfileError(f"{path}: no FROM instruction")
    env = dict(BASE_ENV)
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    exposed: list[str] = []
    workdir: str | None = None
    groups: dict[str, int] = {}
    accounts: list[Account] = []
    made: list[str] = []
    owners: dict[str, tuple[int, int]] = {}
    replaced: list[str] = []
    for word, rest in steps[froms[-1] + 1 :]:
        where = f"{path.name}: {word} {rest}"
        if word == "ENV":
            env.update(_env_pairs(rest, env, where))
        elif word == "USER":
            user = _expand(rest, env, where)
        elif word == "ENTRYPOINT":
            entrypoint = _exec_form(rest, where)
            cmd = None  # Docker resets CMD when ENTRYPOINT is set after it
        elif word == "CMD":
            cmd = _exec_form(rest, where)
        elif word == "EXPOSE":
            exposed += [_expand(p, env, where) for p in rest.split()]
        elif word == "WORKDIR":
            target = _expand(rest, env, where)
            workdir = target if target.startswith("/") else f"{(workdir or '').rstrip('/')}/{target}"
        elif word == "RUN":
            for command in _commands(rest, where):
                _interpret(command, where, groups, accounts, made, owners, replaced)
        elif word in ("ARG", "COPY", "LABEL"):
            continue  # build-time inputs; COPY of the project is the wheel the build installs
        else:
            raise DockerfileError(f"{where}: instruction {word} is not supported by the local build")
    return FinalStage(
        env=env,
        user=user,
        entrypoint=entrypoint,
        cmd=cmd,
        exposed_ports=exposed,
        workdir=workdir,
        accounts=accounts,
        directories=_directories(made, owners, accounts),
        replaced=replaced,
    )


def _directories(
    made: list[str], owners: dict[str, tuple[int, int]], accounts: list[Account]
) -> list[Directory]:
    """Every directory ``mkdir -p`` and ``useradd --create-home`` make, with the parents a recursive
    chown reaches, sorted so parents come first. Parents above every chown keep root as owner."""
    paths: set[str] = set()
    for path in made:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            paths.add("/" + "/".join(parts[:i]))
    found = {p: Directory(p, *_owner_of(p, owners)) for p in paths}
    for account in accounts:
        if account.create_home:
            found[account.home] = Directory(account.home, account.uid, account.gid)
    return [found[p] for p in sorted(found)]


def _owner_of(path: str, owners: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """The owner a recursive chown of ``path`` or one of its parents gave it (root otherwise)."""
    best: tuple[int, int] = (0, 0)
    best_len = -1
    for root, owner in owners.items():
        if (path == root or path.startswith(root.rstrip("/") + "/")) and len(root) > best_len:
            best, best_len = owner, len(root)
    return best


def _interpret(
    command: list[str],
    where: str,
    groups: dict[str, int],
    accounts: list[Account],
    made: list[str],
    owners: dict[str, tuple[int, int]],
    replaced: list[str],
) -> None:
    program, args = command[0], command[1:]
    name = program.rsplit("/", 1)[-1]
    if name == "groupadd":
        opts, rest = _options(args, {"--system", "-r"}, {"--gid", "-g"}, where)
        gid = opts.get("--gid", opts.get("-g"))
        if len(rest) != 1 or gid is None or not gid.isdigit():
            raise DockerfileError(f"{where}: groupadd needs a numeric --gid and one group name")
        groups[rest[0]] = int(gid)
    elif name == "useradd":
        opts, rest = _options(
            args,
            {"--system", "-r", "--create-home", "-m", "--no-create-home", "-M"},
            {"--uid", "-u", "--gid", "-g", "--home-dir", "-d", "--shell", "-s"},
            where,
        )
        uid, gid = opts.get("--uid", opts.get("-u")), opts.get("--gid", opts.get("-g"))
        if len(rest) != 1 or uid is None or not uid.isdigit() or gid is None:
            raise DockerfileError(f"{where}: useradd needs a numeric --uid, a --gid and one user name")
        group = next((g for g, n in groups.items() if str(n) == gid or g == gid), None)
        if group is None:
            raise DockerfileError(f"{where}: useradd --gid {gid}: no groupadd created that group")
        accounts.append(
            Account(
                name=rest[0],
                uid=int(uid),
                group=group,
                gid=groups[group],
                home=opts.get("--home-dir", opts.get("-d", f"/home/{rest[0]}")),
                create_home="--create-home" in opts or "-m" in opts,
                shell=opts.get("--shell", opts.get("-s", "/usr/sbin/nologin")),
            )
        )
    elif name == "mkdir":
        opts, rest = _options(args, {"-p"}, set(), where)
        if "-p" not in opts or not rest:
            raise DockerfileError(f"{where}: only `mkdir -p DIR...` is supported")
        made.extend(r.rstrip("/") for r in rest)
    elif name == "chown":
        opts, rest = _options(args, {"-R"}, set(), where)
        if len(rest) < 2:
            raise DockerfileError(f"{where}: chown needs an owner and a path")
        owner = _numeric_owner(rest[0], where)
        for target in rest[1:]:
            owners[target.rstrip("/")] = owner
    elif re.fullmatch(r"python[0-9.]*", name) and args[:2] == ["-m", "venv"]:
        replaced.append("venv: /opt/venv made by the build with the image's python3.11")
    elif re.fullmatch(r"python[0-9.]*", name) and args[:2] == ["-m", "pip"]:
        replaced.append(f"pip: {REPLACED_COMMANDS['pip']}")
    elif name in REPLACED_COMMANDS:
        replaced.append(f"{name}: {REPLACED_COMMANDS[name]}")
    else:
        raise DockerfileError(
            f"{where}: the local build has no equivalent for `{shlex.join(command)}`"
            " (teach e2e/images/dockerfile.py, or do it another way)"
        )


def context_sources(path: Path) -> list[str]:
    """The build-context paths the Dockerfile's COPY instructions read (``--from`` copies excluded),
    in order, without trailing slashes: what the local build puts into the project's wheel."""
    found: list[str] = []
    for word, rest in instructions(path.read_text()):
        if word != "COPY" or "--from=" in rest:
            continue
        sources = [s for s in shlex.split(rest) if not s.startswith("--")][:-1]
        found += [s.rstrip("/") for s in sources if s.rstrip("/") not in found]
    return found
